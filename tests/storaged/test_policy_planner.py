"""Unit tests of the Acquire / Prefetch transactions over a VRAM tier and a host tier."""

from __future__ import annotations

import pytest

from storaged.policy import (AcquirePlanner, DuplicateExpert, EntryState, ExpertKey, InvalidExpert, InvalidLayer,
                             ModelLayout, PolicyStateError, PreloadOutcome, SlotCache, SlotsExhausted, Source,
                             TooManyExperts, UnknownModel)

MODEL = 0
LAYOUTS = {
    MODEL: ModelLayout.contiguous(layer_count=4, experts_per_layer=8, max_experts_per_acquire=4),
    5: ModelLayout(frozenset({3, 4}), experts_per_layer=16),  # layers 0-2 dense
}


def planner(vram_slots: int = 4, host_slots: int = 0, **options) -> AcquirePlanner:
    vram = SlotCache(vram_slots, slot_bytes=1 << 20, half_life=64)
    host = SlotCache(host_slots, slot_bytes=1 << 20, half_life=64, tier="host")
    options.setdefault("prefetch_reserve", 0)  # these caches are smaller than one layer's demand
    return AcquirePlanner(vram, host, LAYOUTS, **options)


def key(expert: int, layer: int = 0, model: int = MODEL) -> ExpertKey:
    return ExpertKey(model, layer, expert)


def acquire_loaded(p: AcquirePlanner, session, layer: int, experts: list[int]):
    """Acquire and finish every load the plan asks this caller for."""
    plan = p.acquire(session, MODEL, layer, experts)
    for step in plan.loads:
        p.complete(step.key)
    return plan


def state_of(p: AcquirePlanner, sessions=("a", "b", "c")):
    host = list(p.host.views()) if p.host is not None else []
    return (sorted(p.vram.views()), sorted(host), p.loading(), p.stats(),
            [p.held(session) for session in sessions])


@pytest.mark.parametrize("model, layer, experts, error, offending", [
    (9, 0, [1], UnknownModel, "model 9"),
    (MODEL, 4, [1], InvalidLayer, "layer 4"),
    (MODEL, -1, [1], InvalidLayer, "layer -1"),
    (5, 1, [1], InvalidLayer, "layer 1"),  # a dense layer of model 5
    (MODEL, 0, [8], InvalidExpert, "expert 8"),
    (MODEL, 0, [2, -1], InvalidExpert, "expert -1"),
    (MODEL, 0, [3, 1, 3], DuplicateExpert, "expert 3"),
    (MODEL, 0, [0, 1, 2, 3, 4], TooManyExperts, "5 experts"),
])
def test_invalid_requests_are_typed_and_change_nothing(model, layer, experts, error, offending):
    p = planner()
    acquire_loaded(p, "a", 0, [1])
    before = state_of(p)
    with pytest.raises(error, match=offending):
        p.acquire("a", model, layer, experts)
    assert state_of(p) == before


def test_model_with_sparse_moe_layers_accepts_its_moe_layers():
    p = planner()
    plan = p.acquire("a", 5, 4, [15])
    assert plan.steps[0].key == ExpertKey(5, 4, 15)


def test_miss_then_hit_returns_the_same_slot():
    p = planner()
    first = p.acquire("a", MODEL, 0, [3, 5])
    assert [step.source for step in first.steps] == [Source.PACK, Source.PACK]
    for step in first.loads:
        assert p.complete(step.key) == step.slot
    second = p.acquire("b", MODEL, 0, [5, 3])
    assert [step.source for step in second.steps] == [Source.READY, Source.READY]
    assert second.slots == first.slots[::-1]
    assert p.vram.pin_count(key(3)) == 2
    stats = p.stats()
    assert (stats.vram_hits, stats.vram_misses, stats.pins_outstanding) == (2, 2, 4)


def test_single_flight_second_request_waits_on_the_same_slot():
    p = planner()
    load = p.acquire("a", MODEL, 0, [2]).steps[0]
    wait = p.acquire("b", MODEL, 0, [2]).steps[0]
    assert (load.source, wait.source) == (Source.PACK, Source.WAIT)
    assert wait.slot == load.slot and not wait.promote
    assert p.loading() == (key(2),)
    assert p.stats().vram_coalesced == 1
    p.complete(key(2))
    assert p.acquire("c", MODEL, 0, [2]).steps[0].source is Source.READY


def test_acquire_replaces_the_sessions_previous_pins_on_that_layer_only():
    p = planner(vram_slots=8)
    acquire_loaded(p, "a", 0, [1, 2])
    acquire_loaded(p, "a", 1, [1])
    acquire_loaded(p, "a", 0, [2, 3])
    assert p.vram.pin_count(key(1)) == 0
    assert p.vram.pin_count(key(2)) == 1
    assert p.vram.pin_count(key(1, layer=1)) == 1
    assert p.held("a") == {(MODEL, 0): (key(2), key(3)), (MODEL, 1): (key(1, layer=1),)}


def test_own_previous_pins_on_the_layer_count_as_capacity():
    p = planner(vram_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    plan = p.acquire("a", MODEL, 0, [2, 3])  # evicts the two experts it just let go of
    assert {eviction.key for eviction in plan.evictions} == {key(0), key(1)}


def test_capacity_exhausted_rolls_back_everything():
    p = planner(vram_slots=3, host_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    acquire_loaded(p, "b", 1, [0])
    before = state_of(p)
    with pytest.raises(SlotsExhausted, match=r"vram tier: 2 slot\(s\) needed but only 1"):
        p.acquire("a", MODEL, 0, [0, 2, 3])  # 0 stays a hit; 2 and 3 need slots; 1 is freed
    assert state_of(p) == before
    assert p.acquire("a", MODEL, 0, [0, 2]).evictions[0].key == key(1)


def test_hits_of_the_same_request_are_pinned_before_any_victim_is_chosen():
    p = planner(vram_slots=2)
    acquire_loaded(p, "a", 0, [0, 1])
    for _ in range(3):
        acquire_loaded(p, "a", 0, [1])  # 1 hot, 0 cold and unpinned
    p.release("a")
    with pytest.raises(SlotsExhausted):
        p.acquire("b", MODEL, 0, [2, 0, 1])  # both victims are requested hits
    plan = p.acquire("b", MODEL, 0, [2, 0])  # the cold 0 is listed after the miss
    assert [step.source for step in plan.steps] == [Source.PACK, Source.READY]
    assert [eviction.key for eviction in plan.evictions] == [key(1)]


def test_release_one_layer_and_close_session():
    p = planner(vram_slots=8)
    acquire_loaded(p, "a", 0, [1, 2])
    acquire_loaded(p, "a", 1, [1])
    acquire_loaded(p, "b", 0, [1])
    assert p.release("a", 0) == 2
    assert p.held("a") == {(MODEL, 1): (key(1, layer=1),)}
    assert p.release("a", 0) == 0  # idempotent
    assert p.close_session("a") == 1
    assert p.close_session("a") == 0
    assert p.vram.pin_count(key(1)) == 1  # b's pin is untouched
    assert p.close_session("b") == 1
    assert p.stats().pins_outstanding == 0 and p.stats().sessions == 0


def test_release_filters_by_model():
    p = planner(vram_slots=8)
    acquire_loaded(p, "a", 0, [1])
    p.acquire("a", 5, 3, [1])
    assert p.release("a", model=5) == 1
    assert p.held("a") == {(MODEL, 0): (key(1),)}


def test_abort_frees_the_slot_and_returns_the_waiting_sessions():
    p = planner(vram_slots=2)
    slot = p.acquire("a", MODEL, 0, [4]).steps[0].slot
    p.acquire("b", MODEL, 0, [4, 5])
    assert p.abort(key(4)) == frozenset({"a", "b"})
    assert key(4) not in p.vram and p.vram.pins_outstanding == 1
    assert p.held("a") == {} and p.held("b") == {(MODEL, 0): (key(5),)}
    retry = p.acquire("a", MODEL, 0, [4]).steps[0]
    assert (retry.source, retry.slot) == (Source.PACK, slot)
    assert p.stats().vram_aborts == 1


@pytest.mark.parametrize("operation", ["complete", "abort"])
def test_complete_or_abort_without_a_load_in_flight_is_a_protocol_error(operation):
    p = planner()
    acquire_loaded(p, "a", 0, [1])
    with pytest.raises(PolicyStateError, match=r"expert 1\): " + operation):
        getattr(p, operation)(key(1))
    with pytest.raises(PolicyStateError, match=r"expert 2\): " + operation):
        getattr(p, operation)(key(2))


def test_vram_victims_are_demoted_and_a_later_miss_copies_them_back_up():
    p = planner(vram_slots=1, host_slots=4)
    first = p.acquire("a", MODEL, 0, [1])
    assert first.steps[0].source is Source.PACK and first.demotions == ()  # misses read the pack
    p.complete(key(1))
    second = p.acquire("a", MODEL, 0, [2])  # evicts 1 from VRAM: its bytes go down to the host
    (demotion,) = second.demotions
    assert (demotion.key, demotion.vram_slot) == (key(1), first.steps[0].slot)
    assert p.host.state(key(1)) is EntryState.LOADING
    assert p.demoted(key(1)) == demotion.host_slot
    p.complete(key(2))
    again = p.acquire("a", MODEL, 0, [1])
    step = again.steps[0]
    assert (step.source, step.host_slot, step.after_demotion) == (Source.HOST, demotion.host_slot, False)
    assert [d.key for d in again.demotions] == [key(2)]
    assert p.host.pin_count(key(1)) == 1  # pinned while the copy up runs
    p.complete(key(1))
    p.demoted(key(2))
    # 1's host copy stays as the coldest duplicate; 2 took another host slot
    assert p.host.state(key(1)) is EntryState.READY and p.host.state(key(2)) is EntryState.READY
    assert p.host.decayed_score(key(1)) == 0.0
    back = acquire_loaded(p, "a", 0, [2])  # 1 leaves VRAM again: its host copy is already there
    assert back.steps[0].source is Source.HOST and back.demotions == ()
    stats = p.stats()
    assert (stats.host_hits, stats.demotions, stats.host_copies_in_flight) == (2, 2, 0)


def _run(p: AcquirePlanner, experts, rounds: int) -> list[Source]:
    """Acquire each expert in turn, `rounds` times, finishing every load and demotion."""
    sources = []
    for _ in range(rounds):
        for expert in experts:
            plan = p.acquire("a", MODEL, 0, [expert])
            sources.append(plan.steps[0].source)
            for step in plan.loads:
                p.complete(step.key)
            for demotion in plan.demotions:
                p.demoted(demotion.key)
    return sources


@pytest.mark.parametrize("vram_slots, host_slots", [(2, 3), (3, 2), (1, 4)])
def test_tiers_add_up_to_the_sum_of_their_budgets(vram_slots, host_slots):
    """A working set of vram + host - 1 objects (one host slot is the swap space of the copy-up
    in flight) is read from the pack once, then served from the two tiers forever."""
    p = planner(vram_slots=vram_slots, host_slots=host_slots)
    working_set = range(vram_slots + host_slots - 1)
    first = _run(p, working_set, 1)
    assert first == [Source.PACK] * len(working_set)
    later = _run(p, working_set, 20)
    assert Source.PACK not in later, later
    assert {k for k, _ in p.vram.views()} | {k for k, _ in p.host.views()} == {key(e) for e in working_set}


def test_a_miss_on_an_object_still_being_demoted_waits_for_the_demotion():
    p = planner(vram_slots=1, host_slots=2)
    acquire_loaded(p, "a", 0, [1])
    acquire_loaded(p, "a", 0, [2])  # 1 is being demoted; demoted() not called yet
    step = p.acquire("a", MODEL, 0, [1]).steps[0]
    assert (step.source, step.after_demotion) == (Source.HOST, True)
    p.demoted(key(1))
    p.complete(key(1))
    assert p.host.pin_count(key(1)) == 0


def test_a_failed_copy_up_keeps_the_host_entry_and_a_failed_demotion_frees_its_slot():
    p = planner(vram_slots=1, host_slots=2)
    acquire_loaded(p, "a", 0, [1])
    p.demoted(acquire_loaded(p, "a", 0, [2]).demotions[0].key)  # host {1}, VRAM {2}
    plan = p.acquire("a", MODEL, 0, [1])  # copy 1 up; VRAM victim 2 goes down to the free host slot
    assert plan.steps[0].source is Source.HOST and [d.key for d in plan.demotions] == [key(2)]
    p.abort(key(1))
    assert p.host.state(key(1)) is EntryState.READY and p.host.pin_count(key(1)) == 0
    p.demotion_failed(key(2))
    assert key(2) not in p.host and p.host.free_slot_count == 1


@pytest.mark.parametrize("operation", ["demoted", "demotion_failed"])
def test_demotion_callbacks_without_a_demotion_are_a_protocol_error(operation):
    p = planner(vram_slots=1, host_slots=1)
    acquire_loaded(p, "a", 0, [1])
    with pytest.raises(PolicyStateError, match=r"expert 1\): " + operation):
        getattr(p, operation)(key(1))


def test_a_victim_is_dropped_without_a_host_tier_or_when_every_host_slot_is_pinned():
    no_host = planner(vram_slots=1, host_slots=0)
    acquire_loaded(no_host, "a", 0, [1])
    assert acquire_loaded(no_host, "a", 0, [2]).demotions == ()
    p = planner(vram_slots=1, host_slots=1)
    acquire_loaded(p, "a", 0, [1])
    p.demoted(acquire_loaded(p, "a", 0, [2]).demotions[0].key)  # host {1}, VRAM {2}
    plan = p.acquire("a", MODEL, 0, [1])  # the host slot is pinned by 1's copy up
    assert plan.steps[0].source is Source.HOST
    assert plan.demotions == () and [e.key for e in plan.evictions] == [key(2)]  # 2 is dropped


def test_prefetch_uses_free_slots_and_skips_resident_keys():
    p = planner(vram_slots=4)
    acquire_loaded(p, "a", 0, [1])
    plan = p.prefetch(MODEL, 0, [1, 2])
    assert [step.key for step in plan.loads] == [key(2)] and plan.skipped == 1
    assert p.vram.pin_count(key(2)) == 0 and p.vram.state(key(2)) is EntryState.LOADING
    assert p.stats().prefetch_issued == 1 and p.stats().prefetch_in_flight == 1


def test_prefetch_never_displaces_warm_pinned_or_loading_entries():
    p = planner(vram_slots=3, prefetch_threshold=0.5)
    acquire_loaded(p, "a", 0, [1])  # pinned
    acquire_loaded(p, "b", 0, [2])
    p.release("b")  # READY, unpinned, but just used: score ~1
    p.acquire("c", MODEL, 0, [3])  # LOADING
    p.release("c")
    assert p.prefetch(MODEL, 1, [4]).loads == ()
    for _ in range(200):  # time passes; 2 goes cold, 1 and 3 stay pinned / loading
        acquire_loaded(p, "a", 0, [1])
    plan = p.prefetch(MODEL, 1, [4, 5])
    assert [step.key for step in plan.loads] == [key(4, layer=1)]
    assert [eviction.key for eviction in plan.evictions] == [key(2)]


def test_prefetch_in_flight_is_bounded():
    p = planner(vram_slots=8, max_prefetch_in_flight=2)
    assert len(p.prefetch(MODEL, 0, [1, 2, 3]).loads) == 2
    p.complete(key(1))
    assert [step.key for step in p.prefetch(MODEL, 0, [3, 4]).loads] == [key(3)]


def test_demand_joining_a_prefetch_promotes_it_once_and_counts_it_used():
    p = planner(vram_slots=4)
    p.prefetch(MODEL, 0, [1])
    wait = p.acquire("a", MODEL, 0, [1]).steps[0]
    assert (wait.source, wait.promote) == (Source.WAIT, True)
    assert p.acquire("b", MODEL, 0, [1]).steps[0].promote is False
    p.complete(key(1))
    stats = p.stats()
    assert (stats.prefetch_used, stats.prefetch_wasted, stats.prefetch_in_flight) == (1, 0, 0)


def test_unused_prefetch_is_wasted_when_evicted():
    p = planner(vram_slots=1)
    p.prefetch(MODEL, 0, [1])
    p.complete(key(1))
    acquire_loaded(p, "a", 0, [2])
    stats = p.stats()
    assert (stats.prefetch_used, stats.prefetch_wasted, stats.vram_evictions) == (0, 1, 1)


def test_stats_report_resident_entries_and_bytes_per_tier():
    p = planner(vram_slots=4, host_slots=4)
    acquire_loaded(p, "a", 0, [1, 2])
    p.acquire("a", MODEL, 1, [1])
    stats = p.stats()
    assert (stats.vram_resident_entries, stats.vram_loading_entries) == (2, 1)
    assert stats.vram_resident_bytes == 2 << 20
    assert (stats.host_resident_entries, stats.host_resident_bytes) == (0, 0)  # misses never fill it
    assert (stats.pins_outstanding, stats.sessions) == (3, 1)


def test_prefetch_leaves_room_for_one_layers_whole_demand():
    """Hints never take the slots a demand Acquire of a whole layer may need: with 6 slots and up
    to 4 experts per Acquire, at most 2 are prefetched; the demand that follows fits."""
    p = planner(vram_slots=6, max_prefetch_in_flight=6, prefetch_reserve=None)  # the default: 4 per Acquire
    plan = p.prefetch(MODEL, 1, [0, 1, 2, 3, 4, 5])
    assert len(plan.loads) == 2 and plan.skipped == 4
    assert len(p.acquire("a", MODEL, 0, [0, 1, 2, 3]).loads) == 4


# ---- preload ---------------------------------------------------------------------------------

def preload_all(p: AcquirePlanner, keys: list[ExpertKey], *, complete: bool = True) -> list:
    """Preload `keys` in order, finishing each load and demotion at once; → the outcomes."""
    outcomes = []
    for k in keys:
        outcome, plan = p.preload(k.model, k.layer, k.expert)
        outcomes.append(outcome)
        if plan is not None and complete:
            assert [step.source for step in plan.loads] == [Source.PACK]
            for demotion in plan.demotions:
                p.demoted(demotion.key)
            p.complete(k)
    return outcomes


ROUND_ROBIN = [key(expert, layer) for expert in range(8) for layer in range(4)]  # each layer its share


@pytest.mark.parametrize("vram_slots, host_slots", [(4, 3), (4, 0), (2, 9), (1, 1)])
def test_preload_fills_vram_then_the_host_tier_and_drops_nothing(vram_slots, host_slots):
    p = planner(vram_slots, host_slots, max_prefetch_in_flight=64)
    outcomes = preload_all(p, ROUND_ROBIN)
    loaded = vram_slots + host_slots
    assert outcomes == [PreloadOutcome.LOADED] * loaded + [PreloadOutcome.FULL] * (len(ROUND_ROBIN) - loaded)
    held = {k for k, _ in p.vram.views()} | ({k for k, _ in p.host.views()} if p.host else set())
    assert held == set(ROUND_ROBIN[:loaded])  # exclusive tiers, each key once, none lost
    stats = p.stats()
    assert (stats.vram_resident_entries, stats.host_resident_entries) == (vram_slots, host_slots)
    assert (stats.host_evictions, stats.demotions, stats.prefetch_issued) == (0, host_slots, 0)
    assert preload_all(p, ROUND_ROBIN[:1]) == [PreloadOutcome.PRESENT]


def test_preload_waits_at_the_bound_on_speculative_loads():
    p = planner(4, 2, max_prefetch_in_flight=2)
    assert preload_all(p, ROUND_ROBIN[:3], complete=False) == [PreloadOutcome.LOADED] * 2 + [PreloadOutcome.BUSY]
    p.complete(ROUND_ROBIN[0])
    assert preload_all(p, ROUND_ROBIN[2:3]) == [PreloadOutcome.LOADED]


def test_preload_takes_no_pinned_slot_and_waits_for_its_own_loads():
    p = planner(2, 3, max_prefetch_in_flight=8)
    acquire_loaded(p, "a", 0, [0, 1])  # every VRAM slot pinned: nothing to demote
    assert preload_all(p, [key(2)]) == [PreloadOutcome.FULL]
    p.release("a")
    assert preload_all(p, [key(2), key(3)], complete=False) == [PreloadOutcome.LOADED] * 2
    # both VRAM slots LOADING, a host slot free: no VRAM slot until one of the loads completes
    assert preload_all(p, [key(4)], complete=False) == [PreloadOutcome.BUSY]
    p.complete(key(2))
    assert preload_all(p, [key(4)], complete=False) == [PreloadOutcome.LOADED]


def test_a_demand_joining_a_preload_promotes_it():
    p = planner(4, 0, max_prefetch_in_flight=8)
    _, plan = p.preload(MODEL, 0, 5)
    step = p.acquire("a", MODEL, 0, [5]).steps[0]
    assert (step.source, step.slot, step.promote) == (Source.WAIT, plan.loads[0].slot, True)
    p.complete(key(5))
    assert p.stats().prefetch_in_flight == 0


@pytest.mark.parametrize("model, layer, expert, error", [
    (9, 0, 1, UnknownModel), (MODEL, 4, 1, InvalidLayer), (MODEL, 0, 8, InvalidExpert), (MODEL, 0, -1, InvalidExpert),
])
def test_preload_of_an_invalid_expert_is_typed_and_changes_nothing(model, layer, expert, error):
    p = planner(4, 2)
    before = state_of(p)
    with pytest.raises(error):
        p.preload(model, layer, expert)
    assert state_of(p) == before
