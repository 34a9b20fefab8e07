"""Unit tests of one cache tier: entry life cycle, pinning, replacement order, decay, cost."""

from __future__ import annotations

import random

import pytest

from storaged.policy import EntryState, ExpertKey, PolicyStateError, SlotCache, SlotsExhausted
from storaged.policy.decay import REBASE_AFTER_HALF_LIVES, DecayClock, log2_add


def key(expert: int, layer: int = 0) -> ExpertKey:
    return ExpertKey(0, layer, expert)


def loaded(cache: SlotCache, *experts: int) -> None:
    for expert in experts:
        cache.reserve(key(expert))
        cache.complete(key(expert))


def test_loading_entry_is_invisible_until_complete():
    cache = SlotCache(2)
    reservation = cache.reserve(key(1))
    assert reservation.evicted is None
    assert cache.state(key(1)) is EntryState.LOADING
    assert cache.lookup(key(1)) is None
    assert cache.counters.misses == 1
    assert cache.complete(key(1)) == reservation.slot
    assert cache.lookup(key(1)) == reservation.slot
    assert cache.counters.hits == 1


def test_abort_frees_the_slot_and_drops_its_pins():
    cache = SlotCache(1)
    slot = cache.reserve(key(1)).slot
    cache.pin(key(1))
    cache.pin(key(1))
    assert cache.abort(key(1)) == 2
    assert key(1) not in cache and cache.pins_outstanding == 0
    assert cache.reserve(key(2)).slot == slot  # the only slot is free again
    assert cache.counters.aborts == 1


def test_join_loading_only_matches_loading_entries():
    cache = SlotCache(2)
    slot = cache.reserve(key(1)).slot
    assert cache.join_loading(key(1)) == slot
    assert cache.join_loading(key(2)) is None
    cache.complete(key(1))
    assert cache.join_loading(key(1)) is None
    assert cache.counters.coalesced == 1


@pytest.mark.parametrize("operation, setup_state", [
    ("complete", None), ("abort", None), ("pin", None), ("unpin", None),
    ("complete", "ready"), ("abort", "ready"), ("unpin", "ready"), ("reserve", "loading"),
])
def test_protocol_violations_name_the_key(operation, setup_state):
    cache = SlotCache(2, tier="host")
    if setup_state is not None:
        cache.reserve(key(7))
        if setup_state == "ready":
            cache.complete(key(7))
    with pytest.raises(PolicyStateError, match=r"host tier: \(model 0, layer 0, expert 7\)"):
        getattr(cache, operation)(key(7))


def test_pinned_and_loading_entries_are_never_evicted():
    cache = SlotCache(3)
    loaded(cache, 1, 2)
    cache.pin(key(1))
    cache.reserve(key(3))  # stays LOADING
    for _ in range(5):  # make 2 the hottest entry so it would be the last choice
        cache.lookup(key(2))
    assert cache.reserve(key(4)).evicted == key(2)  # the only unpinned READY entry
    with pytest.raises(SlotsExhausted, match="vram tier: 1 slot"):
        cache.reserve(key(5))
    cache.unpin(key(1))
    assert cache.reserve(key(5)).evicted == key(1)


def test_capacity_exhausted_changes_nothing():
    cache = SlotCache(1)
    cache.reserve(key(1))
    before = (list(cache.views()), cache.clock, cache.counters)
    assert cache.try_reserve(key(2)) is None
    with pytest.raises(SlotsExhausted):
        cache.reserve(key(2))
    assert (list(cache.views()), cache.clock, cache.counters) == before


def test_zero_slot_tier_has_no_capacity():
    cache = SlotCache(0)
    assert cache.try_reserve(key(1)) is None
    assert cache.resident().free_slots == 0


def test_victim_is_least_frequent_then_least_recent():
    cache = SlotCache(3, half_life=1_000_000)  # no practical decay: pure frequency
    loaded(cache, 1, 2, 3)
    for expert, hits in ((1, 3), (2, 1), (3, 3)):
        for _ in range(hits):
            cache.lookup(key(expert))
    assert cache.reserve(key(4)).evicted == key(2)
    cache.complete(key(4))
    cache.lookup(key(4))
    cache.lookup(key(4))
    cache.lookup(key(4))
    # 1 and 3 have 4 accesses each and 4 has 4: the oldest last access (1) goes first.
    assert cache.reserve(key(5)).evicted == key(1)


@pytest.mark.parametrize("half_life, access_ticks, now", [
    (4, [1, 2, 3], 3),
    (4, [1], 9),
    (1, [1, 5, 6], 10),
    (16, [2, 3, 4, 10], 40),
])
def test_decayed_score_matches_the_definition(half_life, access_ticks, now):
    cache = SlotCache(2, half_life=half_life)
    filler = key(99)
    cache.reserve(filler)
    cache.complete(filler)
    target_reserved = False
    for tick in range(2, now + 1):  # tick 1 was the filler's reservation
        if tick in access_ticks:
            if not target_reserved:
                cache.reserve(key(1))
                cache.complete(key(1))
                target_reserved = True
            else:
                assert cache.lookup(key(1)) is not None
        else:
            cache.lookup(filler)
    assert cache.clock == now
    expected = sum(2.0 ** (-(now - tick) / half_life) for tick in access_ticks if tick >= 2)
    assert cache.decayed_score(key(1)) == pytest.approx(expected, rel=1e-12)


def test_log_domain_score_survives_a_long_uptime():
    clock = DecayClock(half_life=8)
    clock.now = 10**12  # 1.25e11 half-lives: 2^(now/H) overflows, and now/H alone loses digits
    assert clock.needs_rebase
    assert clock.rebase() == 10**12 / 8
    log_score, _ = clock.record_access(float("-inf"))
    log_score, _ = clock.record_access(log_score)
    assert clock.decayed(log_score) == pytest.approx(1.0 + 2.0 ** (-1 / 8), rel=1e-12)
    assert log2_add(3.0, float("-inf")) == 3.0
    assert log2_add(0.0, -5000.0) == 0.0


def test_rebase_keeps_scores_and_replacement_order():
    cache = SlotCache(3, half_life=1)
    loaded(cache, 1, 2)
    cache.pin(key(2))
    for _ in range(REBASE_AFTER_HALF_LIVES + 10):
        cache.lookup(key(2))
    assert cache.clock > REBASE_AFTER_HALF_LIVES
    loaded(cache, 3)
    cache.lookup(key(3))
    assert cache.decayed_score(key(3)) == pytest.approx(1.5, rel=1e-12)
    assert cache.decayed_score(key(2)) == pytest.approx(0.5, rel=1e-12)  # ~2, 2 ticks ago
    assert cache.decayed_score(key(1)) == 0.0  # 65546 half-lives ago
    assert cache.reserve(key(4)).evicted == key(1)
    cache.complete(key(4))
    cache.unpin(key(2))
    assert cache.reserve(key(5)).evicted == key(2)  # ~0.25 vs 0.75 (3) and 1 (4)


def decay_scenario(idle_accesses: int) -> ExpertKey:
    """An old hot entry (40 accesses) vs a new moderate one (3); returns the evicted key."""
    cache = SlotCache(3, half_life=16)
    loaded(cache, 1)  # the old hot entry
    for _ in range(39):
        cache.lookup(key(1))
    loaded(cache, 2)  # keeps the clock running without being a candidate
    cache.pin(key(2))
    for _ in range(idle_accesses):
        cache.lookup(key(2))
    loaded(cache, 3)  # the new moderately used entry
    cache.lookup(key(3))
    cache.lookup(key(3))
    return cache.reserve(key(4)).evicted


def test_frequency_decays_so_an_old_hot_entry_eventually_loses():
    assert decay_scenario(idle_accesses=0) == key(3)  # fresh frequency wins
    # 40 * 2^(-t/16) < ~3 once t > 16 * log2(40/3) ≈ 60 accesses.
    assert decay_scenario(idle_accesses=200) == key(1)


def test_prefetch_reservation_only_evicts_cold_entries():
    cache = SlotCache(2, half_life=4)
    loaded(cache, 1, 2)
    cache.lookup(key(1))
    assert cache.try_reserve(key(3), prefetch=True, evict_below=0.5) is None
    for _ in range(8):  # two half-lives of accesses to 1: 2 decays to ~0.25
        cache.lookup(key(1))
    assert cache.decayed_score(key(2)) < 0.5 < cache.decayed_score(key(1))
    reservation = cache.try_reserve(key(3), prefetch=True, evict_below=0.5)
    assert reservation is not None and reservation.evicted == key(2)
    assert cache.counters.prefetch_issued == 1


@pytest.mark.parametrize("demanded_before_leaving, used, wasted", [(True, 1, 0), (False, 0, 1)])
def test_prefetch_used_and_wasted(demanded_before_leaving, used, wasted):
    cache = SlotCache(1)
    cache.reserve(key(1), prefetch=True)
    cache.complete(key(1))
    if demanded_before_leaving:
        cache.lookup(key(1))
        cache.lookup(key(1))  # counted once
    cache.reserve(key(2))  # evicts it
    assert (cache.counters.prefetch_used, cache.counters.prefetch_wasted) == (used, wasted)


def test_aborted_prefetch_counts_as_wasted():
    cache = SlotCache(1)
    cache.reserve(key(1), prefetch=True)
    cache.abort(key(1))
    assert cache.counters.prefetch_wasted == 1


def test_resident_stats():
    cache = SlotCache(4, slot_bytes=4096)
    loaded(cache, 1, 2)
    cache.reserve(key(3))
    cache.pin(key(1))
    cache.pin(key(3))
    cache.pin(key(3))
    stats = cache.resident()
    assert (stats.entries, stats.ready, stats.loading) == (3, 2, 1)
    assert (stats.pinned_entries, stats.pins, stats.free_slots) == (2, 3, 1)
    assert stats.resident_bytes == 2 * 4096


def heap_work_per_operation(slot_count: int, operations: int = 6000) -> float:
    rng = random.Random(1234)
    cache = SlotCache(slot_count)
    next_expert = 0
    for _ in range(slot_count):
        loaded(cache, next_expert)
        next_expert += 1
    work_before = (cache.heap_work.pushes + cache.heap_work.probes
                   + cache.heap_work.rebuilt_items)
    evictions_before = cache.counters.evictions
    for _ in range(operations):
        if rng.random() < 0.6:  # a hit on some resident key
            resident = cache.key_at(rng.randrange(slot_count))
            cache.lookup(resident)
        else:  # a miss: evict, load
            cache.reserve(key(next_expert))
            cache.complete(key(next_expert))
            next_expert += 1
        assert cache.heap_stored_items <= 2 * cache.evictable_count + 33
    assert cache.counters.evictions - evictions_before > operations // 3
    work = (cache.heap_work.pushes + cache.heap_work.probes + cache.heap_work.rebuilt_items
            - work_before)
    return work / operations


def test_victim_choice_costs_constant_heap_operations_not_a_slot_scan():
    """Each heap operation is O(log n); the number of them per cache operation must not grow
    with the slot count (a scan would look at every slot: 256 and 8192 per eviction)."""
    small = heap_work_per_operation(256)
    large = heap_work_per_operation(8192)
    assert small < 8 and large < 8
    assert large < 1.5 * small
