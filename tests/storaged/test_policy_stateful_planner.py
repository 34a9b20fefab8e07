"""Property-based state-machine test of the Acquire / Prefetch / complete / abort / release
protocol. The shadow is built only from the plans the planner returned; after every step the
caches must agree with it: budgets respected, one key per slot, hits on the right slot, no
pinned or LOADING entry evicted, pins equal to the sessions holding them, single flight, and a
SlotsExhausted that changed nothing (also when the Acquire would have released the session's
pins on the other layers).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storaged.policy import (AcquirePlanner, EntryState, ExpertKey, ModelLayout, SlotCache, SlotsExhausted,
                             Source)

MODEL = 0
LAYERS = 3
EXPERTS = 6
SESSIONS = ["s0", "s1", "s2"]
VRAM_SLOTS = 5
HOST_SLOTS = 3

expert_lists = st.lists(st.integers(0, EXPERTS - 1), max_size=4, unique=True)


class PlannerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        vram = SlotCache(VRAM_SLOTS, slot_bytes=64, half_life=4)
        host = SlotCache(HOST_SLOTS, slot_bytes=64, half_life=4, tier="host")
        layout = ModelLayout.contiguous(LAYERS, EXPERTS, max_experts_per_acquire=4)
        self.planner = AcquirePlanner(vram, host, {MODEL: layout}, prefetch_threshold=0.6,
                                      max_prefetch_in_flight=2)
        self.slot_of: dict[ExpertKey, int] = {}  # VRAM residency as announced by plans
        self.loading: set[ExpertKey] = set()
        self.demoting: set[ExpertKey] = set()  # VRAM victims on their way to the host tier
        self.pinned: dict[str, dict[int, set[ExpertKey]]] = {s: {} for s in SESSIONS}

    # ---- shadow helpers --------------------------------------------------------------------

    def pin_count(self, key: ExpertKey) -> int:
        return sum(key in layers.get(key.layer, ()) for layers in self.pinned.values())

    def snapshot(self):
        p = self.planner
        return (sorted(p.vram.views()), sorted(p.host.views()), p.loading(), p.stats(),
                [p.held(session) for session in SESSIONS])

    def apply_evictions(self, evictions) -> None:
        for eviction in evictions:
            if eviction.tier != "vram":
                continue
            victim = eviction.key
            assert victim not in self.loading, f"LOADING {victim} evicted"
            assert self.pin_count(victim) == 0, f"pinned {victim} evicted"
            assert self.slot_of.pop(victim) == eviction.slot

    def apply_demotions(self, demotions) -> None:
        for demotion in demotions:
            assert demotion.key not in self.slot_of, f"{demotion.key} demoted while still in VRAM"
            assert demotion.key not in self.demoting, f"{demotion.key} demoted twice"
            self.demoting.add(demotion.key)

    def start_load(self, step) -> None:
        assert step.key not in self.slot_of, f"{step.key} loaded twice (single flight broken)"
        if step.source is Source.HOST:
            assert self.planner.host.pin_count(step.key) == 1, f"{step.key} copied up from an unpinned slot"
            assert step.after_demotion == (step.key in self.demoting)
        assert step.slot not in self.slot_of.values(), f"slot {step.slot} given to two keys"
        self.slot_of[step.key] = step.slot
        self.loading.add(step.key)

    # ---- rules -----------------------------------------------------------------------------

    @rule(session=st.sampled_from(SESSIONS), layer=st.integers(0, LAYERS - 1),
          experts=expert_lists, release_other_layers=st.booleans())
    def acquire(self, session, layer, experts, release_other_layers):
        before = self.snapshot()
        try:
            plan = self.planner.acquire(session, MODEL, layer, experts,
                                        release_other_layers=release_other_layers)
        except SlotsExhausted:
            assert self.snapshot() == before, "SlotsExhausted changed the state"
            return
        assert [step.key.expert for step in plan.steps] == experts
        for step in plan.steps:  # sources follow from the state before the call
            if step.key in self.loading:
                assert step.source is Source.WAIT, f"{step.key} is loading: single flight"
            elif step.key in self.slot_of:
                assert step.source is Source.READY, f"{step.key} is resident: must hit"
            else:
                assert step.source.needs_io
        if release_other_layers:  # the session's pins on every other layer go with them
            self.pinned[session] = {}
        self.pinned[session][layer] = set()  # the previous pins are released first
        self.apply_evictions(plan.evictions)
        self.apply_demotions(plan.demotions)
        for step in plan.steps:
            if step.source in (Source.READY, Source.WAIT):
                assert self.slot_of[step.key] == step.slot, "hit on a slot of another key"
            else:
                self.start_load(step)
            self.pinned[session][layer].add(step.key)

    @rule(layer=st.integers(0, LAYERS - 1), experts=expert_lists)
    def prefetch(self, layer, experts):
        plan = self.planner.prefetch(MODEL, layer, experts)
        self.apply_evictions(plan.evictions)
        self.apply_demotions(plan.demotions)
        for step in plan.loads:
            assert step.source.needs_io
            self.start_load(step)

    @precondition(lambda self: self.loading)
    @rule(data=st.data(), succeed=st.booleans())
    def finish_load(self, data, succeed):
        key = data.draw(st.sampled_from(sorted(self.loading)))
        self.loading.discard(key)
        if key in self.demoting:
            succeed = False  # a copy up waits for its demotion: only a failure (or shutdown) ends it first
        if succeed:
            assert self.planner.complete(key) == self.slot_of[key]
            return
        holders = self.planner.abort(key)
        assert holders == {s for s in SESSIONS if key in self.pinned[s].get(key.layer, ())}
        for session in holders:
            self.pinned[session][key.layer].discard(key)
        del self.slot_of[key]

    @precondition(lambda self: self.demoting)
    @rule(data=st.data(), succeed=st.booleans())
    def finish_demotion(self, data, succeed):
        key = data.draw(st.sampled_from(sorted(self.demoting)))
        self.demoting.discard(key)
        if succeed:
            self.planner.demoted(key)
        else:
            self.planner.demotion_failed(key)
            assert key not in self.planner.host

    @rule(session=st.sampled_from(SESSIONS), layer=st.none() | st.integers(0, LAYERS - 1))
    def release(self, session, layer):
        layers = self.pinned[session]
        chosen = list(layers) if layer is None else [layer]
        expected = sum(len(layers.pop(chosen_layer, ())) for chosen_layer in chosen)
        assert self.planner.release(session, layer) == expected

    @rule(session=st.sampled_from(SESSIONS))
    def close_session(self, session):
        expected = sum(len(keys) for keys in self.pinned[session].values())
        assert self.planner.close_session(session) == expected
        self.pinned[session] = {}
        assert self.planner.held(session) == {}

    # ---- invariants --------------------------------------------------------------------------

    @invariant()
    def vram_matches_shadow(self):
        vram = self.planner.vram
        assert len(vram) == len(self.slot_of) <= VRAM_SLOTS  # budget never exceeded
        for key, view in vram.views():
            assert self.slot_of[key] == view.slot
            assert view.state is (EntryState.LOADING if key in self.loading else EntryState.READY)
            assert view.pin_count == self.pin_count(key), f"{key}: residual or missing pins"
        for slot in range(VRAM_SLOTS):
            owner = vram.key_at(slot)
            assert owner is None or self.slot_of[owner] == slot
        assert set(self.planner.loading()) == self.loading
        resident = vram.resident()
        assert (resident.entries, resident.loading) == (len(self.slot_of), len(self.loading))
        assert resident.pinned_entries == sum(1 for key in self.slot_of if self.pin_count(key))

    @invariant()
    def host_tier_is_consistent(self):
        host = self.planner.host
        assert len(host) <= HOST_SLOTS
        slots = [view.slot for _, view in host.views()]
        assert len(slots) == len(set(slots))
        for key, view in host.views():
            assert (view.state is EntryState.LOADING) == (key in self.demoting), f"host {key}: demotion state"
            if view.pin_count:
                assert key in self.loading, f"host {key} pinned without a copy up in flight"
            assert view.pin_count <= 1
            if key in self.slot_of and key not in self.loading:  # in both tiers: a copy-up's duplicate
                assert view.state is EntryState.READY

    @invariant()
    def stats_agree(self):
        stats = self.planner.stats()
        held = sum(len(keys) for layers in self.pinned.values() for keys in layers.values())
        assert stats.pins_outstanding == held
        assert stats.sessions == sum(1 for layers in self.pinned.values()
                                     if any(layers.values()))
        assert 0 <= stats.prefetch_in_flight <= 2
        assert stats.prefetch_used + stats.prefetch_wasted <= stats.prefetch_issued

    def teardown(self):
        for key in sorted(self.demoting):
            self.planner.demoted(key)
        for key in sorted(self.loading):
            self.planner.complete(key)
        for session in SESSIONS:
            self.planner.close_session(session)
        stats = self.planner.stats()
        assert (stats.pins_outstanding, stats.host_copies_in_flight, stats.sessions) == (0, 0, 0)
        assert self.planner.vram.evictable_count == len(self.planner.vram)


TestPlannerMachine = PlannerMachine.TestCase
TestPlannerMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
