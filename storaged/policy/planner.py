"""The Acquire / Prefetch transactions over the VRAM tier and the optional host tier.

The tiers add up: budgets of b in VRAM and b in host RAM hold about 2b of experts, because the
host tier holds what VRAM evicted rather than what was read. A VRAM victim is demoted: its bytes
are copied to a host slot before its VRAM slot is overwritten (the arena keeps copies into and
out of one slot in issue order, so the load that overwrites the slot needs no wait of its own). A VRAM miss
found in the host tier is copied up (Source.HOST; if the object is still being demoted, after
the demotion); its host entry then stays as a duplicate made the coldest, so the next demotion
reuses that slot first, and when the object later leaves VRAM again its host copy is already
there and no copy is needed. (Freeing the host slot at copy-up instead would deadlock a swap:
the victim's demotion wants the slot the copy-up is still reading.) A miss found in neither tier
reads the pack into staging (Source.PACK). A demotion evicts the coldest unpinned host entry
(duplicates first); with none, the victim is dropped (it is on disk). A prefetch only displaces
entries whose decayed score is below `prefetch_threshold`, and holds no pins.

Caller protocol: every step whose source needs I/O ends with exactly one `complete(key)` (bytes
valid in VRAM) or `abort(key)` (I/O or checksum failure: slots freed, holders returned so their
waiters can be failed); every Demotion of a plan ends with `demoted(key)` or
`demotion_failed(key)`. Not thread-safe, by design: storaged's asyncio loop thread is the only
caller.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from storaged.policy.capacity import check_capacity
from storaged.policy.errors import (DuplicateExpert, InvalidExpert, InvalidLayer, PolicyStateError,
                                    TooManyExperts, UnknownModel)
from storaged.policy.keys import ExpertKey, ModelLayout
from storaged.policy.plan import (AcquirePlan, Demotion, Eviction, ExpertStep, PolicyStats,
                                  PrefetchPlan, SessionId, Source)
from storaged.policy.sessions import SessionPins
from storaged.policy.slot_cache import EntryState, SlotCache


class PreloadOutcome(enum.Enum):
    """What AcquirePlanner.preload did with one expert."""

    LOADED = "loaded"  # a load was planned
    PRESENT = "present"  # a tier holds it, or is loading it
    BUSY = "busy"  # no room until a load in flight completes
    FULL = "full"  # neither tier has room


class _HostUse(enum.Enum):
    NONE = "none"
    COPY = "copy"  # host entry pinned until its copy to VRAM is done, then freed (exclusive tiers)


@dataclass(slots=True)
class _PendingLoad:
    host_use: _HostUse
    speculative: bool  # a prefetch nobody has demanded yet


class AcquirePlanner:
    """Residency decisions for storaged: demand Acquire, Prefetch hints, completion, release."""

    def __init__(self, vram: SlotCache, host: SlotCache | None, models: Mapping[int, ModelLayout],
                 *, prefetch_threshold: float = 0.5, max_prefetch_in_flight: int | None = None,
                 prefetch_reserve: int | None = None):
        """prefetch_reserve: VRAM slots (free or evictable) a hint never takes, so a demand Acquire
        is not refused because speculative loads hold the cache; default (None): the model's
        acquire limit, one layer's whole demand."""
        if host is not None and host.slot_count == 0:
            host = None  # a zero budget turns the tier off
        if prefetch_threshold < 0:
            raise ValueError(f"prefetch_threshold must be >= 0, got {prefetch_threshold}")
        self.vram = vram
        self.host = host
        self.prefetch_threshold = prefetch_threshold
        # Speculative loads may hold at most a quarter of VRAM by default, so demand keeps room.
        if max_prefetch_in_flight is None:
            max_prefetch_in_flight = max(1, vram.slot_count // 4)
        if max_prefetch_in_flight < 0:
            raise ValueError(f"max_prefetch_in_flight must be >= 0, got {max_prefetch_in_flight}")
        self.max_prefetch_in_flight = max_prefetch_in_flight
        if prefetch_reserve is not None and prefetch_reserve < 0:
            raise ValueError(f"prefetch_reserve must be >= 0, got {prefetch_reserve}")
        self.prefetch_reserve = prefetch_reserve
        self._models = dict(models)
        self._sessions = SessionPins()
        self._pending: dict[ExpertKey, _PendingLoad] = {}
        self._prefetch_in_flight = 0
        self._demoting: set[ExpertKey] = set()  # host entries LOADING from a VRAM victim
        self.demotions = 0  # VRAM victims copied down to the host tier

    # ---- demand ------------------------------------------------------------------------------

    def acquire(self, session: SessionId, model: int, layer: int, experts: Sequence[int], *,
                release_other_layers: bool = False) -> AcquirePlan:
        """Pin `experts` of (model, layer) for `session`, replacing its previous pins there.

        `release_other_layers`: also drop the session's pins on every other layer of `model`, in
        the same step, so those slots can be this request's victims (a client computing one
        layer at a time then needs only that layer's demand to fit). Raises an InvalidExpertRequest
        subclass or SlotsExhausted before changing anything, the other layers' pins included.
        """
        self._validate(model, layer, experts, enforce_limit=True)
        keys = tuple([ExpertKey(model, layer, expert) for expert in experts])
        sessions = self._sessions
        previous = sessions.held(session, model, layer)
        other_layers = sessions.other_layers(session, model, layer) if release_other_layers else ()
        released_elsewhere = [key for ref in other_layers for key in sessions.held(session, *ref)]
        check_capacity(self.vram, model, layer, previous, released_elsewhere, keys)

        vram = self.vram
        for _, other_layer in other_layers:
            for key in sessions.take(session, model=model, layer=other_layer):
                vram.unpin(key)  # before any reservation, so these slots can be victims
        sessions.replace(session, model, layer, keys)
        kept = set(previous).intersection(keys) if previous else ()
        for key in previous:
            if key not in kept:
                vram.unpin(key)  # a pin held across consecutive Acquires is simply kept
        steps: list[ExpertStep | None] = [None] * len(keys)
        missing: list[int] = []
        # Hits and joins are pinned before any reservation so none of them can be the victim.
        for index, key in enumerate(keys):
            pin = key not in kept
            slot = vram.lookup(key, pin=pin)
            if slot is not None:
                steps[index] = ExpertStep(key, slot, Source.READY)
                continue
            slot = vram.join_loading(key, pin=pin)
            if slot is not None:
                steps[index] = ExpertStep(key, slot, Source.WAIT, promote=self._promote(key))
                continue
            assert pin, f"{key} pinned by this session but not resident"
            missing.append(index)

        evictions: list[Eviction] = []
        demotions: list[Demotion] = []
        slots: list[int] = []
        # Sources first: a host hit must be pinned before a demotion could evict it from the host.
        sources = self._plan_sources([keys[i] for i in missing], speculative=False)
        for index in missing:
            reservation = vram.try_reserve(keys[index])
            assert reservation is not None, f"capacity check passed but {keys[index]} got no slot"
            vram.pin(keys[index])
            slots.append(reservation.slot)
            self._evict_vram(evictions, demotions, reservation)
        for index, slot, (source, host_slot, after) in zip(missing, slots, sources, strict=True):
            steps[index] = ExpertStep(keys[index], slot, source, host_slot, after_demotion=after)
        assert all(step is not None for step in steps)
        return AcquirePlan(session, model, layer, tuple(steps), tuple(evictions),  # type: ignore[arg-type]
                           tuple(demotions))

    def validate_layer(self, model: int, layer: int) -> None:
        """Raise UnknownModel or InvalidLayer unless `layer` is one of the model's MoE layers."""
        self._validate(model, layer, (), enforce_limit=False)

    def release(self, session: SessionId, layer: int | None = None, *,
                model: int | None = None) -> int:
        """Drop the session's pins on `layer` (of `model`), or all of them. Returns how many."""
        released = self._sessions.take(session, model=model, layer=layer)
        for key in released:
            self.vram.unpin(key)
        return len(released)

    def close_session(self, session: SessionId) -> int:
        """Stream ended or client died: drop everything the session holds."""
        return self.release(session)

    # ---- prefetch ------------------------------------------------------------------------------

    def prefetch(self, model: int, layer: int, experts: Sequence[int]) -> PrefetchPlan:
        """Reserve slots for hinted experts without displacing anything worth keeping."""
        self._validate(model, layer, experts, enforce_limit=False)
        loads: list[ExpertStep] = []
        evictions: list[Eviction] = []
        demotions: list[Demotion] = []
        # A hint never takes the slots one layer's whole demand may need: a demand Acquire must
        # not be refused because speculative loads hold the cache (seen at a 10% budget, where the
        # arena barely holds a prefill's layer).
        reserve = self._models[model].acquire_limit if self.prefetch_reserve is None else self.prefetch_reserve
        for expert in experts:
            key = ExpertKey(model, layer, expert)
            if self._prefetch_in_flight >= self.max_prefetch_in_flight:
                break
            if self.vram.free_slot_count + self.vram.evictable_count <= reserve:
                break
            if key in self.vram:
                continue
            reservation = self.vram.try_reserve(key, prefetch=True,
                                                evict_below=self.prefetch_threshold)
            if reservation is None:
                break  # no free slot and the coldest entry is above threshold: same for the rest
            ((source, host_slot, after),) = self._plan_sources([key], speculative=True)
            self._evict_vram(evictions, demotions, reservation)
            loads.append(ExpertStep(key, reservation.slot, source, host_slot, after_demotion=after))
        return PrefetchPlan(model, layer, tuple(loads), tuple(evictions),
                            skipped=len(experts) - len(loads), demotions=tuple(demotions))

    # ---- preload -------------------------------------------------------------------------------

    def preload(self, model: int, layer: int, expert: int) -> tuple[PreloadOutcome, PrefetchPlan | None]:
        """Fill room at start with (model, layer, expert), unless either tier holds it: into a free
        VRAM slot, or into the slot of a VRAM entry demoted to a free host slot. Nothing is dropped
        and no host entry is evicted, so every load adds an expert to what the tiers hold; a load
        runs at prefetch priority (a demand joining it promotes it) and pins nothing.

        → (LOADED, a plan of one load), (PRESENT, None), (BUSY, None): preloads in flight fill the
        bound on speculative loads or every VRAM slot, try again once one completed; or
        (FULL, None): neither tier has room left."""
        self._validate(model, layer, (expert,), enforce_limit=False)
        key = ExpertKey(model, layer, expert)
        host = self.host
        if key in self.vram or (host is not None and key in host):
            return PreloadOutcome.PRESENT, None
        if self._prefetch_in_flight >= self.max_prefetch_in_flight:
            return PreloadOutcome.BUSY, None
        if not self.vram.free_slot_count and (host is None or not host.free_slot_count):
            return PreloadOutcome.FULL, None
        reservation = self.vram.try_reserve(key)  # not counted as a prefetch hint: nobody asked
        if reservation is None:  # every VRAM slot pinned or loading
            return (PreloadOutcome.BUSY if self._prefetch_in_flight else PreloadOutcome.FULL), None
        ((source, host_slot, after),) = self._plan_sources([key], speculative=True)
        evictions: list[Eviction] = []
        demotions: list[Demotion] = []
        self._evict_vram(evictions, demotions, reservation)
        assert all(e.tier == self.vram.tier for e in evictions), f"{key}: a preload evicted from the host tier"
        step = ExpertStep(key, reservation.slot, source, host_slot, after_demotion=after)
        return PreloadOutcome.LOADED, PrefetchPlan(model, layer, (step,), tuple(evictions), skipped=0,
                                                   demotions=tuple(demotions))

    # ---- completion ----------------------------------------------------------------------------

    def complete(self, key: ExpertKey) -> int:
        """The key's bytes are valid in its VRAM slot. Returns that slot."""
        pending = self._finish(key, "complete")
        self._settle_host(key, pending.host_use, loaded=True)
        return self.vram.complete(key)

    def reload(self, key: ExpertKey) -> ExpertStep:
        """A READY VRAM entry's bytes failed verification: it is LOADING again in the same slot,
        pins kept (other requests now wait for it), to be read from the pack; like any load it ends
        with complete(key) or abort(key), which drops it and every session's pin on it."""
        slot = self.vram.reload(key)
        self._pending[key] = _PendingLoad(_HostUse.NONE, speculative=False)
        return ExpertStep(key, slot, Source.PACK)

    def demoted(self, key: ExpertKey) -> int:
        """A demotion's copy to its host slot completed: the host entry is READY. Returns the slot."""
        self._end_demotion(key, "demoted")
        return self.host.complete(key)  # type: ignore[union-attr]

    def demotion_failed(self, key: ExpertKey) -> None:
        """A demotion's copy failed: the host slot is freed (the object is on disk anyway)."""
        self._end_demotion(key, "demotion_failed")
        self.host.abort(key)  # type: ignore[union-attr]

    def _end_demotion(self, key: ExpertKey, operation: str) -> None:
        if key not in self._demoting:
            raise PolicyStateError("host", key, f"{operation} with no demotion in flight")
        self._demoting.discard(key)

    def abort(self, key: ExpertKey) -> frozenset[SessionId]:
        """The key's load failed: free its slots. Returns the sessions that were waiting on it."""
        pending = self._finish(key, "abort")
        self._settle_host(key, pending.host_use, loaded=False)
        holders = self._sessions.forget_key(key)
        dropped_pins = self.vram.abort(key)
        assert dropped_pins == len(holders), (key, dropped_pins, holders)
        return holders

    # ---- observation ---------------------------------------------------------------------------

    def loading(self) -> tuple[ExpertKey, ...]:
        """Keys whose loads were planned and not yet completed or aborted."""
        return tuple(self._pending)

    def held(self, session: SessionId) -> dict[tuple[int, int], tuple[ExpertKey, ...]]:
        """The session's pins per (model, layer)."""
        return self._sessions.held_by(session)

    def stats(self) -> PolicyStats:
        vram, vram_now = self.vram.counters, self.vram.resident()
        host = self.host.counters if self.host is not None else None
        host_now = self.host.resident() if self.host is not None else None
        return PolicyStats(
            vram_hits=vram.hits, vram_misses=vram.misses, vram_coalesced=vram.coalesced,
            vram_evictions=vram.evictions, vram_aborts=vram.aborts,
            host_hits=host.hits if host else 0, host_misses=host.misses if host else 0,
            host_evictions=host.evictions if host else 0,
            prefetch_issued=vram.prefetch_issued, prefetch_used=vram.prefetch_used,
            prefetch_wasted=vram.prefetch_wasted, prefetch_in_flight=self._prefetch_in_flight,
            vram_resident_entries=vram_now.ready, vram_loading_entries=vram_now.loading,
            vram_resident_bytes=vram_now.resident_bytes,
            host_resident_entries=host_now.ready if host_now else 0,
            host_resident_bytes=host_now.resident_bytes if host_now else 0,
            pins_outstanding=vram_now.pins, host_copies_in_flight=host_now.pins if host_now else 0,
            sessions=self._sessions.session_count, demotions=self.demotions,
        )

    # ---- internals -----------------------------------------------------------------------------

    def _validate(self, model: int, layer: int, experts: Sequence[int], *,
                  enforce_limit: bool) -> None:
        layout = self._models.get(model)
        if layout is None:
            raise UnknownModel(model, list(self._models))
        if layer not in layout.moe_layers:
            raise InvalidLayer(model, layer, len(layout.moe_layers))
        if enforce_limit and len(experts) > layout.acquire_limit:
            raise TooManyExperts(model, layer, len(experts), layout.acquire_limit)
        seen: set[int] = set()
        for expert in experts:
            if not 0 <= expert < layout.experts_per_layer:
                raise InvalidExpert(model, layer, expert, layout.experts_per_layer)
            if expert in seen:
                raise DuplicateExpert(model, layer, expert)
            seen.add(expert)

    def _plan_sources(self, keys: list[ExpertKey], *, speculative: bool
                      ) -> list[tuple[Source, int | None, bool]]:
        """Each VRAM-missing key's (source, host slot, after_demotion); records its pending load.
        A host hit (or an object still being demoted to the host) is pinned there until its copy
        up completes; everything else is read from the pack."""
        if not keys:
            return []
        host = self.host
        sources: list[tuple[Source, int | None, bool]] = []
        for key in keys:
            use = _HostUse.NONE
            source: tuple[Source, int | None, bool] = (Source.PACK, None, False)
            if host is not None:
                host_slot = host.lookup(key, pin=True)  # counts the host hit or miss
                if host_slot is not None:
                    source, use = (Source.HOST, host_slot, False), _HostUse.COPY
                else:
                    host_slot = host.join_loading(key, pin=True)  # LOADING in the host: a demotion
                    if host_slot is not None:
                        assert key in self._demoting, f"{key}: LOADING in the host tier but not demoting"
                        source, use = (Source.HOST, host_slot, True), _HostUse.COPY
            sources.append(source)
            self._pending[key] = _PendingLoad(use, speculative)
        if speculative:
            self._prefetch_in_flight += len(keys)
        return sources

    def _evict_vram(self, evictions: list[Eviction], demotions: list[Demotion], reservation) -> None:
        """Record a VRAM reservation's victim, and demote it to the host tier when one is there
        and a host slot is free or held by an unpinned entry (that entry is simply dropped)."""
        victim = reservation.evicted
        if victim is None:
            return
        evictions.append(Eviction(self.vram.tier, victim, reservation.slot))
        host = self.host
        if host is None:
            return
        if victim in host:  # its duplicate from an earlier copy-up: the only copy again
            assert host.state(victim) is EntryState.READY, f"{victim} LOADING in the host while READY in VRAM"
            host.refresh(victim)
            return
        host_reservation = host.try_reserve(victim)
        if host_reservation is None:
            return  # every host slot is pinned or loading: the victim is dropped (it is on disk)
        if host_reservation.evicted is not None:
            evictions.append(Eviction(host.tier, host_reservation.evicted, host_reservation.slot))
        self._demoting.add(victim)
        self.demotions += 1
        demotions.append(Demotion(victim, reservation.slot, host_reservation.slot))

    def _promote(self, key: ExpertKey) -> bool:
        """A demand joined `key`'s load: if it was a prefetch, it now has demand priority."""
        pending = self._pending.get(key)
        if pending is None or not pending.speculative:
            return False
        pending.speculative = False
        self._prefetch_in_flight -= 1
        return True

    def _finish(self, key: ExpertKey, operation: str) -> _PendingLoad:
        pending = self._pending.pop(key, None)
        if pending is None:
            raise PolicyStateError(self.vram.tier, key, f"{operation} with no load in flight")
        if pending.speculative:
            self._prefetch_in_flight -= 1
        return pending

    def _settle_host(self, key: ExpertKey, use: _HostUse, *, loaded: bool) -> None:
        if use is _HostUse.NONE:
            return
        host = self.host
        assert host is not None, f"{key}: host use {use} without a host tier"
        if key not in host:
            return  # the demotion this copy waited for failed and freed the host slot
        host.unpin(key)
        if loaded:
            host.make_coldest(key)  # a duplicate now: the first host slot the next demotion takes
