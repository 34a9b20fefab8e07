"""Replacement by layer shares: a step larger than the tier must not evict the layer needed next."""

from __future__ import annotations

import pytest

from storaged.policy import ExpertKey, SlotCache


def key(layer: int, expert: int, model: int = 0) -> ExpertKey:
    return ExpertKey(model, layer, expert)


def acquire_layer(cache: SlotCache, layer: int, experts: range) -> int:
    """One layer's Acquire as the planner does it: hits pinned first, then misses reserved and
    pinned; returns the hits. The pins are dropped by the next layer's call (release_layer)."""
    hits = 0
    missing = []
    for expert in experts:
        if cache.lookup(key(layer, expert), pin=True) is not None:
            hits += 1
        else:
            missing.append(expert)
    for expert in missing:
        cache.reserve(key(layer, expert))
        cache.pin(key(layer, expert))
        cache.complete(key(layer, expert))
    return hits


def release_layer(cache: SlotCache, layer: int, experts: range) -> None:
    for expert in experts:
        cache.unpin(key(layer, expert))


def cyclic_hits(cache: SlotCache, layers: int, demand: int, steps: int) -> list[int]:
    """Hits per step when every step reads `demand` experts of each layer, layers in order."""
    experts = range(demand)
    per_step = []
    previous = None
    for _ in range(steps):
        hits = 0
        for layer in range(layers):
            if previous is not None:
                release_layer(cache, previous, experts)
            hits += acquire_layer(cache, layer, experts)
            previous = layer
        per_step.append(hits)
    return per_step


@pytest.mark.parametrize("layers, slots, demand", [
    (4, 8, 3),    # a step of 12 over 8 slots: each layer keeps its share of 2
    (12, 24, 5),  # 60 over 24: share 2
    (3, 12, 6),   # 18 over 12: share 4
    (4, 16, 3),   # the step fits (12 of 16): everything hits
])
def test_a_cyclic_step_larger_than_the_tier_keeps_each_layers_share(layers, slots, demand):
    """Layers read in a cycle, the same experts every step. The lowest score alone would evict the
    layer needed next, every time (0 hits once the step outgrows the tier). By shares, a step hits
    at least three quarters of what the tier can keep besides the layer being computed (slots -
    demand; Belady's optimum for a cycle keeps about that much)."""
    cache = SlotCache(slots)
    hits = cyclic_hits(cache, layers, demand, steps=6)
    assert hits[0] == 0
    if layers * demand <= slots:
        assert hits[1:] == [layers * demand] * 5
    else:
        assert all(3 * (slots - demand) // 4 <= h < layers * demand for h in hits[2:]), hits


def test_a_layer_below_its_share_takes_from_the_layer_holding_most():
    cache = SlotCache(6)
    for layer, count in ((0, 4), (1, 2)):  # layer 0 holds 4, layer 1 holds 2 (older: lower score)
        for expert in range(count):
            cache.reserve(key(layer, expert))
            cache.complete(key(layer, expert))
    for expert in range(2):  # layer 1 accessed again: hotter than layer 0
        assert cache.lookup(key(1, expert)) is not None
    reservation = cache.reserve(key(2, 0))  # layer 2 holds nothing: below its share of 2
    assert reservation.evicted is not None and reservation.evicted.layer == 0
    reservation = cache.reserve(key(1, 5))  # layer 1 at its share (2 of 6 / 3): replaces within itself
    assert reservation.evicted is not None and reservation.evicted.layer == 1


def test_an_entry_made_coldest_goes_first_whatever_its_layer():
    """A duplicate of another tier's copy is dropped before any layer's share is considered."""
    cache = SlotCache(4)
    for layer in (0, 1):
        for expert in range(2):
            cache.reserve(key(layer, expert))
            cache.complete(key(layer, expert))
    cache.make_coldest(key(0, 1))
    reservation = cache.reserve(key(1, 7))  # layer 1 is at its share: would replace within itself
    assert reservation.evicted == key(0, 1)


def test_models_share_the_tier_by_layer():
    cache = SlotCache(4)
    for model in (0, 1):
        for expert in range(2):
            cache.reserve(key(0, expert, model))
            cache.complete(key(0, expert, model))
    reservation = cache.reserve(key(0, 9, model=1))  # model 1's layer 0 at its share of 2
    assert reservation.evicted is not None and reservation.evicted.model == 1


def test_prefetch_threshold_applies_to_the_share_rule_victim():
    """evict_below is checked against the victim the share rule picks, not the global minimum."""
    cache = SlotCache(6)
    for layer, count in ((0, 4), (1, 2)):
        for expert in range(count):
            cache.reserve(key(layer, expert))
            cache.complete(key(layer, expert))
    for _ in range(3):  # layer 1's entries hot; layer 0's cold
        for expert in range(2):
            cache.lookup(key(1, expert))
    # layer 2 holds nothing: the victim comes from the layer holding most, layer 0 (cold)
    reservation = cache.try_reserve(key(2, 0), prefetch=True, evict_below=1.0)
    assert reservation is not None and reservation.evicted.layer == 0
    # three layers now, a share of 2: layer 1 holds 2 and replaces within itself, but its coldest
    # entry is hot, above the threshold (layer 0's cold entries are not considered)
    assert cache.try_reserve(key(1, 5), prefetch=True, evict_below=1.0) is None


def test_entries_moving_between_the_coldest_and_a_layers_heap_stay_counted_once():
    """A duplicate made coldest and then accessed again moves between heaps, leaving stale items
    behind; a stale item must never pass for the entry's live one (tokens unique across heaps)."""
    cache = SlotCache(4)
    keys = [key(layer, expert) for layer in (0, 1) for expert in range(2)]
    for k in keys:
        cache.reserve(k)
        cache.complete(k)
    for _ in range(60):  # enough pushes to make every heap compact itself several times
        for k in keys:
            cache.make_coldest(k)
            cache.refresh(k)
    assert cache.evictable_count == 4
    evicted = {cache.reserve(key(2, expert)).evicted for expert in range(4)}
    assert evicted == set(keys) and cache.evictable_count == 0


def test_an_idle_models_layers_lose_their_share():
    """A model no client uses any more must not keep a share of the tier: within a few half-lives of
    accesses its layers count as idle, the active layers' shares grow and they take its slots."""
    cache = SlotCache(16)  # half-life 16 accesses: idle after 8 x 16
    for layer in (0, 1):  # model 1 fills half the tier, then is never read again
        for expert in range(4):
            cache.reserve(key(layer, expert, model=1))
            cache.complete(key(layer, expert, model=1))
    hits = cyclic_hits(cache, layers=2, demand=6, steps=20)  # model 0: 12 a step, fits beside 4 others
    assert hits[1] == 6  # while model 1 counts, each of model 0's layers keeps to a share of 16 / 4
    assert hits[-5:] == [12] * 5  # then model 0 holds its whole step
    assert sum(k.model == 1 for k, _ in cache.views()) == 4
