"""The arena's host map and the client's view of the shared host tier: bad geometry, bad values
and bad files are refused with errors naming them."""

from __future__ import annotations

import os

import pytest

from storaged.device import ArenaDescriptor, ArenaDescriptorError, CpuArena
from storaged.device.client_host_tier import ClientHostTier
from storaged.device.descriptor import KIND_MEMFD
from storaged.device.errors import ArenaMapError, SlotRangeError
from storaged.device.host_tier import HostTier

SLOT = 4096


@pytest.mark.parametrize("map_entries, host_slots, match", [
    (0, 2, "host_slots"),   # a host map needs a slot map to follow
    (3, -1, "host_slots"),
])
def test_arena_refuses_a_bad_host_map_geometry(map_entries, host_slots, match):
    with pytest.raises(ValueError, match=match):
        CpuArena(2, SLOT, map_entries=map_entries, host_slots=host_slots)


@pytest.mark.parametrize("map_entries, host_slots", [(0, 1), (4, -2)])
def test_descriptor_refuses_a_bad_host_map_geometry(map_entries, host_slots):
    with pytest.raises(ArenaDescriptorError, match="host_slots"):
        ArenaDescriptor(kind=KIND_MEMFD, slot_bytes=SLOT, slot_count=2, map_entries=map_entries, host_slots=host_slots)


def test_host_map_entries_follow_the_slot_map_and_hold_host_slots_only():
    with CpuArena(2, SLOT, map_entries=3, host_slots=5) as arena:
        assert arena.descriptor().host_slots == 5 and arena.region_entries == 6
        arena.publish(arena.host_index(1), 4)  # host slot 4 of 5: fine, though the arena has 2 slots
        arena.publish(1, 1)
        assert (arena.read_map(1), arena.read_map(arena.host_index(1))) == (1, 4)
        with pytest.raises(SlotRangeError):
            arena.publish(arena.host_index(0), 5)  # past the host tier
        with pytest.raises(SlotRangeError):
            arena.publish(0, 2)  # a host-sized value in the slot map: past the arena
        with pytest.raises(IndexError):
            arena.publish(6, 0)  # past both maps
        arena.unpublish([1, arena.host_index(1)])
        assert (arena.read_map(1), arena.read_map(arena.host_index(1))) == (-1, -1)
    with CpuArena(2, SLOT, map_entries=3) as arena, pytest.raises(IndexError, match="no host map"):
        arena.host_index(0)


def test_client_host_tier_maps_the_shared_file_read_only():
    with HostTier(3, SLOT, shared=True) as tier:
        tier.slot_tensor(2).fill_(7)
        client = ClientHostTier(tier.client_fd, SLOT, 3)
        assert bytes(client.slot_view(2, 8).numpy()) == b"\x07" * 8
        with pytest.raises(SlotRangeError):
            client.slot_view(3)
        client.close()
    with HostTier(2, SLOT) as private:
        assert private.client_fd is None  # not shared: nothing to hand out


def test_client_host_tier_refuses_a_file_smaller_than_described(tmp_path):
    path = tmp_path / "short"
    path.write_bytes(b"\0" * SLOT)
    fd = os.open(path, os.O_RDONLY)
    try:
        with pytest.raises(ArenaMapError, match="at least"):
            ClientHostTier(fd, SLOT, 2)
    finally:
        os.close(fd)
