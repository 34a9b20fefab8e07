"""Unit tests of Acquire(release_other_layers=True): a session's pins scoped to the layer it
computes, dropped atomically with the request that needs their slots."""

from __future__ import annotations

import pytest

from storaged.policy import (AcquirePlanner, EntryState, ExpertKey, ModelLayout, SlotCache, SlotsExhausted,
                             Source)

MODEL, OTHER_MODEL = 0, 5
LAYOUTS = {
    MODEL: ModelLayout.contiguous(layer_count=4, experts_per_layer=8, max_experts_per_acquire=4),
    OTHER_MODEL: ModelLayout(frozenset({3, 4}), experts_per_layer=16),
}


def planner(vram_slots: int, host_slots: int = 0) -> AcquirePlanner:
    vram = SlotCache(vram_slots, slot_bytes=1 << 20, half_life=64)
    host = SlotCache(host_slots, slot_bytes=1 << 20, half_life=64, tier="host")
    return AcquirePlanner(vram, host, LAYOUTS)


def key(expert: int, layer: int = 0, model: int = MODEL) -> ExpertKey:
    return ExpertKey(model, layer, expert)


def acquire_loaded(p: AcquirePlanner, session, layer: int, experts: list[int], *, model: int = MODEL,
                   release_other_layers: bool = False):
    plan = p.acquire(session, model, layer, experts, release_other_layers=release_other_layers)
    for step in plan.loads:
        p.complete(step.key)
    return plan


def state_of(p: AcquirePlanner, sessions=("a", "b")):
    host = list(p.host.views()) if p.host is not None else []
    return (sorted(p.vram.views()), sorted(host), p.loading(), p.stats(),
            [p.held(session) for session in sessions])


def test_walking_the_layers_needs_only_one_layers_demand():
    p = planner(vram_slots=2)
    for layer in range(4):
        plan = acquire_loaded(p, "a", layer, [0, 1], release_other_layers=True)
        assert p.held("a") == {(MODEL, layer): (key(0, layer), key(1, layer))}
        expected_victims = {key(0, layer - 1), key(1, layer - 1)} if layer else set()
        assert {eviction.key for eviction in plan.evictions} == expected_victims
    stats = p.stats()
    assert (stats.vram_evictions, stats.pins_outstanding, stats.vram_misses) == (6, 2, 8)


def test_without_the_flag_the_other_layers_pins_exhaust_the_cache():
    p = planner(vram_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    before = state_of(p)
    with pytest.raises(SlotsExhausted, match="model 0 layer 1"):
        p.acquire("a", MODEL, 1, [0, 1])
    assert state_of(p) == before


def test_only_this_sessions_pins_on_this_models_other_layers_are_dropped():
    p = planner(vram_slots=8)
    acquire_loaded(p, "a", 0, [1, 2])
    acquire_loaded(p, "a", 2, [1])
    acquire_loaded(p, "a", 3, [1], model=OTHER_MODEL)
    acquire_loaded(p, "b", 0, [1])
    acquire_loaded(p, "a", 1, [5], release_other_layers=True)
    assert p.held("a") == {(MODEL, 1): (key(5, 1),), (OTHER_MODEL, 3): (key(1, 3, OTHER_MODEL),)}
    assert p.held("b") == {(MODEL, 0): (key(1),)}
    assert [p.vram.pin_count(k) for k in (key(1), key(2), key(1, 2))] == [1, 0, 0]
    assert p.stats().pins_outstanding == 3


def test_same_layer_keeps_its_continuing_pins_as_without_the_flag():
    p = planner(vram_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    plan = p.acquire("a", MODEL, 0, [1, 2], release_other_layers=True)
    assert [step.source for step in plan.steps] == [Source.READY, Source.PACK]
    assert [eviction.key for eviction in plan.evictions] == [key(0)]
    assert p.vram.pin_count(key(1)) == 1


@pytest.mark.parametrize("name, vram_slots, setup, wanted, fits", [
    # (session, layer, experts) acquired and loaded first; then "a" asks for `wanted` on layer 1.
    ("own other-layer pins become victims", 2, [("a", 0, [0, 1])], [0, 1], True),
    ("pins shared with another session stay", 2, [("a", 0, [0, 1]), ("b", 0, [0])], [0, 1], False),
    ("another session's other-layer pins stay", 2, [("b", 0, [0, 1])], [0], False),
    ("this layer's pin kept, the other's a victim", 2, [("a", 0, [0]), ("a", 1, [0])], [0, 1], True),
    ("demand above the whole cache", 3, [("a", 0, [0, 1, 2])], [0, 1, 2, 3], False),
])
def test_capacity_counts_exactly_the_pins_this_request_drops(name, vram_slots, setup, wanted, fits):
    p = planner(vram_slots=vram_slots)
    for session, layer, experts in setup:
        acquire_loaded(p, session, layer, experts)
    before = state_of(p)
    if fits:
        p.acquire("a", MODEL, 1, wanted, release_other_layers=True)
        assert set(p.held("a")) == {(MODEL, 1)}, name
        return
    with pytest.raises(SlotsExhausted):
        p.acquire("a", MODEL, 1, wanted, release_other_layers=True)
    assert state_of(p) == before, f"{name}: a refused Acquire changed the state"


def test_capacity_exhausted_keeps_the_other_layers_pins_and_host_tier():
    p = planner(vram_slots=3, host_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    acquire_loaded(p, "b", 2, [0])
    before = state_of(p)
    with pytest.raises(SlotsExhausted, match=r"2 slot\(s\) needed but only 1"):
        p.acquire("a", MODEL, 0, [0, 2, 3], release_other_layers=True)  # b's pin is not ours
    with pytest.raises(SlotsExhausted, match=r"4 slot\(s\) needed but only 2"):
        p.acquire("a", MODEL, 1, [0, 1, 2, 3], release_other_layers=True)
    assert state_of(p) == before
    assert p.held("a") == {(MODEL, 0): (key(0), key(1))}


def test_a_loading_pin_on_another_layer_is_dropped_but_not_evicted():
    p = planner(vram_slots=1)
    (step,) = p.acquire("a", MODEL, 0, [4]).loads  # still LOADING: not a victim until complete
    before = state_of(p)
    with pytest.raises(SlotsExhausted):
        p.acquire("a", MODEL, 1, [4], release_other_layers=True)
    assert state_of(p) == before
    p.complete(step.key)
    plan = acquire_loaded(p, "a", 1, [4], release_other_layers=True)
    assert [eviction.key for eviction in plan.evictions] == [key(4)]
    assert p.vram.state(key(4, 1)) is EntryState.READY and p.held("a") == {(MODEL, 1): (key(4, 1),)}


def test_an_abort_after_the_pin_was_dropped_has_no_holders():
    p = planner(vram_slots=2)
    (step,) = p.acquire("a", MODEL, 0, [4]).loads
    acquire_loaded(p, "a", 1, [4], release_other_layers=True)
    assert p.vram.pin_count(step.key) == 0
    assert p.abort(step.key) == frozenset()
    assert p.vram.state(step.key) is None and p.stats().pins_outstanding == 1
