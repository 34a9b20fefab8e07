"""Property-based state-machine test of one tier against a brute-force oracle.

Scores are recomputed from the shadow's own access history and the expected victim is the
minimum over every evictable entry, the O(n) scan the heap must agree with.
"""

from __future__ import annotations

import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storaged.policy import EntryState, ExpertKey, SlotCache

MACHINE_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                            suppress_health_check=[HealthCheck.too_slow])

KEYS = [ExpertKey(0, 0, expert) for expert in range(8)]


class SlotCacheMachine(RuleBasedStateMachine):
    SLOTS = 4
    HALF_LIFE = 3

    def __init__(self) -> None:
        super().__init__()
        self.cache = SlotCache(self.SLOTS, slot_bytes=4096, half_life=self.HALF_LIFE)
        self.now = 0
        self.accesses: dict[ExpertKey, list[int]] = {}  # shadow access history of resident keys
        self.slot_of: dict[ExpertKey, int] = {}
        self.loading: set[ExpertKey] = set()
        self.pins: dict[ExpertKey, int] = {}

    def access(self, key: ExpertKey) -> None:
        self.now += 1
        self.accesses[key].append(self.now)

    def score(self, key: ExpertKey) -> float:
        return sum(2.0 ** (-(self.now - tick) / self.HALF_LIFE) for tick in self.accesses[key])

    def evictable(self) -> list[ExpertKey]:
        return [k for k in self.slot_of if k not in self.loading and self.pins[k] == 0]

    def forget(self, key: ExpertKey) -> None:
        del self.slot_of[key], self.accesses[key], self.pins[key]
        self.loading.discard(key)

    @rule(key=st.sampled_from(KEYS), threshold=st.none() | st.sampled_from([0.3, 0.8, 2.0]))
    def reserve(self, key, threshold):
        if key in self.slot_of:
            return
        candidates = self.evictable()
        free = self.SLOTS - len(self.slot_of)
        lowest = min(candidates, key=self.score, default=None)
        before = sorted(self.cache.views())
        reservation = self.cache.try_reserve(key, prefetch=threshold is not None,
                                             evict_below=threshold)
        must_refuse = free == 0 and (lowest is None or (
            threshold is not None and self.score(lowest) >= threshold * (1 + 1e-9)))
        if reservation is None:
            assert free == 0 and (lowest is None or threshold is not None)
            if threshold is not None and lowest is not None:
                assert self.score(lowest) >= threshold * (1 - 1e-9)
            assert sorted(self.cache.views()) == before
            return
        assert not must_refuse
        victim = reservation.evicted
        if free > 0:
            assert victim is None and reservation.slot not in self.slot_of.values()
        else:
            assert victim in candidates, f"evicted {victim}, not an unpinned READY entry"
            assert self.score(victim) <= self.score(lowest) * (1 + 1e-9), "not the minimum"
            assert reservation.slot == self.slot_of[victim]
            self.forget(victim)
        self.slot_of[key] = reservation.slot
        self.accesses[key] = []
        self.pins[key] = 0
        self.loading.add(key)
        self.access(key)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key):
        slot = self.cache.lookup(key)
        if key in self.slot_of and key not in self.loading:
            assert slot == self.slot_of[key]
            self.access(key)
        else:
            assert slot is None

    @rule(key=st.sampled_from(KEYS))
    def join(self, key):
        slot = self.cache.join_loading(key)
        if key in self.loading:
            assert slot == self.slot_of[key]
            self.access(key)
        else:
            assert slot is None

    @precondition(lambda self: self.loading)
    @rule(data=st.data(), succeed=st.booleans())
    def finish(self, data, succeed):
        key = data.draw(st.sampled_from(sorted(self.loading)))
        if succeed:
            assert self.cache.complete(key) == self.slot_of[key]
            self.loading.discard(key)
        else:
            assert self.cache.abort(key) == self.pins[key]
            self.forget(key)

    @precondition(lambda self: self.slot_of)
    @rule(data=st.data())
    def pin(self, data):
        key = data.draw(st.sampled_from(sorted(self.slot_of)))
        assert self.cache.pin(key) == self.slot_of[key]
        self.pins[key] += 1

    @precondition(lambda self: any(self.pins.values()))
    @rule(data=st.data())
    def unpin(self, data):
        key = data.draw(st.sampled_from(sorted(k for k, n in self.pins.items() if n)))
        self.cache.unpin(key)
        self.pins[key] -= 1

    @invariant()
    def cache_matches_shadow(self):
        cache = self.cache
        assert len(cache) == len(self.slot_of) <= self.SLOTS
        for key, view in cache.views():
            assert view.slot == self.slot_of[key]
            assert view.state is (EntryState.LOADING if key in self.loading else EntryState.READY)
            assert view.pin_count == self.pins[key]
            assert math.isclose(cache.decayed_score(key), self.score(key), rel_tol=1e-9)
        assert len(set(self.slot_of.values())) == len(self.slot_of)  # one key per slot
        for slot in range(self.SLOTS):
            owner = cache.key_at(slot)
            assert owner is None or self.slot_of[owner] == slot
        assert cache.pins_outstanding == sum(self.pins.values())
        assert cache.evictable_count == len(self.evictable())
        assert cache.free_slot_count == self.SLOTS - len(self.slot_of)
        stats = cache.resident()
        assert (stats.entries, stats.loading, stats.ready) == (
            len(self.slot_of), len(self.loading), len(self.slot_of) - len(self.loading))
        assert stats.pinned_entries == sum(1 for n in self.pins.values() if n)
        assert stats.resident_bytes == stats.ready * cache.slot_bytes


TestSlotCacheMachine = SlotCacheMachine.TestCase
TestSlotCacheMachine.settings = MACHINE_SETTINGS
