"""The host tier read in place, through a real daemon process (CPU arena).

Clients find host-tier objects through the arena's host map and read them from the daemon's
host tier memory file, mapped read-only. The contract is the slot map's: an entry names a host
slot only while that slot holds the object's bytes, and a host slot a client may still be
reading in a step it has started is not overwritten until it finished that step.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import threading
import time

import pytest
from storaged_testkit import SLOT_BYTES, start_daemon, write_bundle

from storaged.client import StorageClient, StorageError
from storaged.client.dataplane import receive_host_tier_fd
from storaged.io.host_memory import SHARED_SEALS
from storaged.wire import dataplane as wire

SLOTS, HOST_SLOTS = 4, 3


@pytest.fixture(scope="module")
def served(disk_dir):
    bundle = disk_dir / "host-reads-bundle"
    payloads = write_bundle(bundle)
    daemon = start_daemon(disk_dir, {"tiny": bundle}, vram_cache_bytes=SLOTS * SLOT_BYTES,
                          host_cache_bytes=HOST_SLOTS * SLOT_BYTES, fence_timeout_seconds=5.0,
                          socket_path=disk_dir / "host-reads.sock")
    yield daemon, payloads
    assert daemon.stop() == 0, daemon.stderr()


@pytest.fixture
def client(served):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client:
        yield client


def _host_entries(session, layers=(1, 2, 4)) -> dict[tuple[int, int], int]:
    """{(layer, expert): host slot} of every published host map entry of `layers`."""
    host_map = session.host_map()
    view = session.slot_map_view
    return {(layer, e): int(host_map[view.row(layer), e]) for layer in layers for e in range(view.experts_per_row)
            if int(host_map[view.row(layer), e]) >= 0}


def _wait_for(predicate, timeout: float = 5.0):
    """Demotions publish after their copy completed, on the daemon's loop: poll for it."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.01)


def _demote_layer_1(session) -> None:
    """Layer 1's experts 4..7 into VRAM, then pushed down to the host tier by layer 2's."""
    session.acquire(1, [4, 5, 6, 7])
    session.release(1)
    session.acquire(2, [0, 1, 2])
    session.release(2)


def test_the_host_map_names_demoted_objects_whose_bytes_are_the_packs(client, served):
    _, payloads = served
    with client.attach("tiny") as session:
        assert session.arena.descriptor.host_slots == HOST_SLOTS
        _demote_layer_1(session)
        entries = _wait_for(lambda: len(_host_entries(session, (1,))) >= 3 and _host_entries(session, (1,)))
        assert entries and len(set(entries.values())) == len(entries), entries  # distinct host slots
        tier = session.host_tier()
        for (layer, expert), slot in entries.items():
            payload = payloads[(layer, expert)]
            assert tier.slot_view(slot, len(payload)).numpy().tobytes() == payload, (layer, expert)
            assert int(session.slot_map()[session.slot_map_view.row(layer), expert]) == -1  # not in VRAM any more
        # promoted again: VRAM is preferred, and the host copy stays valid (and named) meanwhile
        (layer, expert), slot = next(iter(entries.items()))
        session.acquire(layer, [expert])
        assert _host_entries(session, (layer,)).get((layer, expert)) == slot
        session.release(layer)


def test_the_host_tier_file_is_sealed_read_only(client, served):
    daemon, _ = served
    with client.attach("tiny") as session:
        fd = receive_host_tier_fd(wire.socket_path_for(str(daemon.socket)), session.id)
        try:
            assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SHARED_SEALS == SHARED_SEALS
            assert os.fstat(fd).st_size >= HOST_SLOTS * SLOT_BYTES
            with pytest.raises(PermissionError):
                mmap.mmap(fd, SLOT_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)


def test_host_tier_is_refused_to_an_unknown_session(served):
    daemon, _ = served
    with pytest.raises(StorageError, match="session") as error:
        receive_host_tier_fd(wire.socket_path_for(str(daemon.socket)), "no-such-session")
    assert error.value.code.name == "NOT_FOUND"


def test_a_daemon_without_a_host_tier_shares_none(disk_dir):
    bundle = disk_dir / "no-host-bundle"
    write_bundle(bundle)
    daemon = start_daemon(disk_dir, {"tiny": bundle}, vram_cache_bytes=SLOTS * SLOT_BYTES,
                          socket_path=disk_dir / "no-host.sock")
    try:
        with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
            assert session.arena.descriptor.host_slots == 0
            assert session.host_map() is None and session.host_tier() is None
            with pytest.raises(StorageError, match="shares no host tier") as error:
                receive_host_tier_fd(wire.socket_path_for(str(daemon.socket)), session.id)
            assert error.value.code.name == "FAILED_PRECONDITION"
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def test_a_mid_step_reader_holds_back_reuse_of_a_host_slot(client, served):
    """A session mid-step may be reading host slots it found in the host map: a demotion that
    evicts such an entry clears it at once but writes the slot only after that step finished."""
    _, payloads = served
    with client.attach("tiny") as reader, client.attach("tiny") as writer:
        _demote_layer_1(reader)
        entries = _wait_for(lambda: len(_host_entries(reader)) == HOST_SLOTS and _host_entries(reader))
        assert entries, _host_entries(reader)
        tier = reader.host_tier()
        before = {slot: tier.slot_view(slot).numpy().tobytes() for slot in entries.values()}
        reader.fence.begin()  # a device step would now read host map entries and host slots
        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault("slots", writer.acquire(4, [4, 5, 6, 7])))
        thread.start()  # evicts every VRAM object; their demotions need the host slots back
        try:
            changed = _wait_for(lambda: [k for k, s in entries.items() if _host_entries(reader).get(k) != s],
                                timeout=2.0)
            assert changed, "no host map entry changed: the test did not make a demotion evict one"
            time.sleep(0.3)
            assert thread.is_alive(), "the writer's loads went ahead while a reader was mid-step"
            for slot, data in before.items():
                assert tier.slot_view(slot).numpy().tobytes() == data, f"host slot {slot} overwritten mid-step"
        finally:
            reader.fence.end()
        thread.join(10)
        assert not thread.is_alive() and "slots" in result, result
        # the demotions went ahead: the host map names the demoted objects, with their bytes
        demoted = _wait_for(lambda: {k: s for k, s in _host_entries(reader).items() if k[0] == 2})
        assert demoted, _host_entries(reader)
        for (layer, expert), slot in demoted.items():
            payload = payloads[(layer, expert)]
            assert tier.slot_view(slot, len(payload)).numpy().tobytes() == payload
        writer.release(4)
