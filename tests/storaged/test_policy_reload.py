"""AcquirePlanner.reload: a resident object whose bytes failed verification is loaded again in its
own slot, its pins kept, while other requests wait for it instead of being served the bad copy."""

from __future__ import annotations

import pytest
from test_policy_planner import MODEL, acquire_loaded, key, planner

from storaged.policy import EntryState, PolicyStateError, Source


def test_reload_keeps_slot_and_pins_and_makes_others_wait():
    p = planner(vram_slots=3)
    slot = acquire_loaded(p, "a", 0, [1, 2]).steps[0].slot
    acquire_loaded(p, "b", 0, [1])
    step = p.reload(key(1))
    assert (step.key, step.slot, step.source) == (key(1), slot, Source.PACK)
    assert p.vram.state(key(1)) is EntryState.LOADING and p.vram.pin_count(key(1)) == 2
    assert p.loading() == (key(1),)
    joined = p.acquire("c", MODEL, 0, [1]).steps[0]  # not served the bad copy: it waits for the load
    assert (joined.source, joined.slot) == (Source.WAIT, slot)
    assert p.complete(key(1)) == slot
    hit = p.acquire("c", MODEL, 0, [1]).steps[0]
    assert (hit.source, hit.slot) == (Source.READY, slot)
    assert p.held("a") == {(MODEL, 0): (key(1), key(2))}


def test_a_failed_reload_drops_the_object_and_every_holders_pin():
    p = planner(vram_slots=3)
    acquire_loaded(p, "a", 0, [1, 2])
    acquire_loaded(p, "b", 0, [1])
    p.reload(key(1))
    assert p.abort(key(1)) == frozenset({"a", "b"})
    assert key(1) not in p.vram and p.vram.pins_outstanding == 1  # a's pin on expert 2
    assert p.held("a") == {(MODEL, 0): (key(2),)} and p.held("b") == {}
    retry = p.acquire("a", MODEL, 0, [1]).steps[0]
    assert retry.source is Source.PACK


def test_an_unpinned_object_reloading_is_not_evictable():
    p = planner(vram_slots=1)
    acquire_loaded(p, "a", 0, [1])
    p.release("a")
    p.reload(key(1))
    assert not p.vram.is_evictable(key(1))
    p.complete(key(1))
    assert p.vram.is_evictable(key(1))


@pytest.mark.parametrize("setup", ["absent", "loading"])
def test_reload_of_an_object_that_is_not_resident_is_a_protocol_error(setup):
    p = planner()
    if setup == "loading":
        p.acquire("a", MODEL, 0, [1])
    with pytest.raises(PolicyStateError, match=r"expert 1\): reload"):
        p.reload(key(1))
