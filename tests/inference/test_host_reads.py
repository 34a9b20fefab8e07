"""HostReads.merge: the one map the kernels read, from storaged's slot map and host map."""

from __future__ import annotations

import pytest
import torch

from inference.experts.host_reads import HostReads, absent_only
from inference.kernels.ops import HostSlots

FIRST = 10  # the arena's slot count: host slot h is id FIRST + h


@pytest.mark.parametrize("vram, host, merged", [
    ([3, -1, -1, 0], [-1, 2, -1, 5], [3, FIRST + 2, -1, 0]),  # VRAM first; host only; neither; both: VRAM
    ([-1, -1], [0, 9], [FIRST, FIRST + 9]),                   # host slot 0 is not "absent"
    ([9, 0], [-1, -1], [9, 0]),                               # no host entry: the slot map unchanged
    ([-1], [-1], [-1]),
], ids=["mixed", "host only", "vram only", "absent"])
def test_merge_prefers_vram_then_the_host_tier(vram, host, merged):
    reads = HostReads(torch.tensor([host], dtype=torch.int32), HostSlots(FIRST, delta=-4096))
    slot_map = torch.tensor([vram], dtype=torch.int32)
    got = reads.merge(slot_map)
    assert got.dtype == torch.int32 and got.tolist() == [merged]
    out = torch.empty_like(slot_map)
    assert reads.merge(slot_map, out=out) is out and out.tolist() == [merged]


def test_merge_reads_the_maps_as_they_are_now():
    """The maps are live views of the daemon's: a merge after an entry changed sees the change."""
    host_map = torch.tensor([[4, -1]], dtype=torch.int32)
    slot_map = torch.tensor([[-1, 1]], dtype=torch.int32)
    reads = HostReads(host_map, HostSlots(FIRST, 0))
    assert reads.merge(slot_map).tolist() == [[FIRST + 4, 1]]
    host_map[0, 0] = -1  # the daemon cleared it (a demotion reuses the host slot)
    slot_map[0, 1] = -1  # and a VRAM victim
    assert reads.merge(slot_map).tolist() == [[-1, -1]]


@pytest.mark.parametrize("first", [0, -1, 2**31])
def test_host_slot_ids_must_fit_int32_above_the_arena(first):
    with pytest.raises(ValueError, match="host slot ids start"):
        HostSlots(first, 0)


@pytest.mark.parametrize("hint, merged, kept", [
    ([1, 1, 1, 0], [-1, 3, FIRST + 1, -1], [1, 0, 0, 0]),  # only the expert in neither tier is hinted
    ([0, 1], [-1, -1], [0, 1]),
    ([1, 1], [0, FIRST], [0, 0]),
])
def test_hints_name_only_experts_in_neither_tier(hint, merged, kept):
    got = absent_only(torch.tensor(hint, dtype=torch.int32), torch.tensor(merged, dtype=torch.int32))
    assert got.dtype == torch.int32 and got.tolist() == kept
    assert absent_only(torch.tensor(hint, dtype=torch.int32), None).tolist() == hint
