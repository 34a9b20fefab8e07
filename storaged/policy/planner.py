"""The Acquire / Prefetch transactions over the VRAM tier and the optional host tier.

Host tier (tier 2) is a read-through cache of recently read objects, not a victim cache:
a pack read lands in a host slot, which is then copied to the VRAM slot; a VRAM eviction drops
the entry without any copy. Why this and not demotion on eviction:
  - The host slots are pinned memory and the O_DIRECT read needs a pinned target anyway, so
    the host slot *is* the staging buffer: no extra copy, and H2D runs at pinned speed.
  - Demotion would add a device→host copy to every eviction, and an eviction sits on a miss's
    critical path; read-through adds nothing there.
  - The cost, inclusion (an object may sit in both tiers), is small because the host budget is
    normally several times the VRAM budget.
A demand read that finds no host slot (host tier off, or all pinned/loading) reads through the
caller's own staging (Source.PACK). A prefetch only displaces entries whose decayed score is
below `prefetch_threshold`, in both tiers, and holds no pins.

Caller protocol: every step whose source needs I/O ends with exactly one `complete(key)` (bytes
valid in VRAM) or `abort(key)` (I/O or checksum failure: slots freed, holders returned so their
waiters can be failed). Not thread-safe, by design: storaged's asyncio loop thread is the
only caller.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from storaged.policy.capacity import check_capacity
from storaged.policy.errors import (DuplicateExpert, InvalidExpert, InvalidLayer, PolicyStateError,
                                    TooManyExperts, UnknownModel)
from storaged.policy.keys import ExpertKey, ModelLayout
from storaged.policy.plan import (AcquirePlan, Eviction, ExpertStep, PolicyStats, PrefetchPlan,
                                  SessionId, Source)
from storaged.policy.sessions import SessionPins
from storaged.policy.slot_cache import EntryState, SlotCache


class _HostUse(enum.Enum):
    NONE = "none"
    COPY = "copy"  # host entry READY and pinned until the copy to VRAM is done
    FILL = "fill"  # host entry LOADING: the pack read lands there first


@dataclass(slots=True)
class _PendingLoad:
    host_use: _HostUse
    speculative: bool  # a prefetch nobody has demanded yet


class AcquirePlanner:
    """Residency decisions for storaged: demand Acquire, Prefetch hints, completion, release."""

    def __init__(self, vram: SlotCache, host: SlotCache | None, models: Mapping[int, ModelLayout],
                 *, prefetch_threshold: float = 0.5, max_prefetch_in_flight: int | None = None):
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
        self._models = dict(models)
        self._sessions = SessionPins()
        self._pending: dict[ExpertKey, _PendingLoad] = {}
        self._prefetch_in_flight = 0

    # ---- demand ------------------------------------------------------------------------------

    def acquire(self, session: SessionId, model: int, layer: int, experts: Sequence[int], *,
                release_other_layers: bool = False) -> AcquirePlan:
        """Pin `experts` of (model, layer) for `session`, replacing its previous pins there.

        `release_other_layers`: also drop the session's pins on every other layer of `model`, in
        the same step, so those slots can be this request's victims (a client computing one
        layer at a time then needs only that layer's demand to fit). Raises an InvalidRequest
        subclass or CapacityExhausted before changing anything, the other layers' pins included.
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
        slots: list[int] = []
        for index in missing:
            reservation = vram.try_reserve(keys[index])
            assert reservation is not None, f"capacity check passed but {keys[index]} got no slot"
            vram.pin(keys[index])
            slots.append(reservation.slot)
            self._note_eviction(evictions, vram, reservation.evicted, reservation.slot)
        sources = self._plan_sources([keys[i] for i in missing], evictions, speculative=False)
        for index, slot, (source, host_slot) in zip(missing, slots, sources, strict=True):
            steps[index] = ExpertStep(keys[index], slot, source, host_slot)
        assert all(step is not None for step in steps)
        return AcquirePlan(session, model, layer, tuple(steps), tuple(evictions))  # type: ignore[arg-type]

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
        for expert in experts:
            key = ExpertKey(model, layer, expert)
            if self._prefetch_in_flight >= self.max_prefetch_in_flight:
                break
            if key in self.vram:
                continue
            reservation = self.vram.try_reserve(key, prefetch=True,
                                                evict_below=self.prefetch_threshold)
            if reservation is None:
                break  # no free slot and the coldest entry is above threshold: same for the rest
            self._note_eviction(evictions, self.vram, reservation.evicted, reservation.slot)
            ((source, host_slot),) = self._plan_sources([key], evictions, speculative=True)
            loads.append(ExpertStep(key, reservation.slot, source, host_slot))
        return PrefetchPlan(model, layer, tuple(loads), tuple(evictions),
                            skipped=len(experts) - len(loads))

    # ---- completion ----------------------------------------------------------------------------

    def complete(self, key: ExpertKey) -> int:
        """The key's bytes are valid in its VRAM slot. Returns that slot."""
        pending = self._finish(key, "complete")
        self._settle_host(key, pending.host_use, loaded=True)
        return self.vram.complete(key)

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
            sessions=self._sessions.session_count,
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

    def _plan_sources(self, keys: list[ExpertKey], evictions: list[Eviction], *,
                      speculative: bool) -> list[tuple[Source, int | None]]:
        """Pick each VRAM-missing key's source and record its pending load."""
        if not keys:
            return []
        host = self.host
        sources: list[tuple[Source, int | None]] = [(Source.PACK, None)] * len(keys)
        uses = [_HostUse.NONE] * len(keys)
        if host is not None:
            # Host hits are pinned first so that filling one key cannot evict another's copy.
            for index, key in enumerate(keys):
                assert host.state(key) is not EntryState.LOADING, f"{key}: host fill, no VRAM load"
                host_slot = host.lookup(key)
                if host_slot is not None:
                    host.pin(key)
                    sources[index], uses[index] = (Source.HOST, host_slot), _HostUse.COPY
            for index, key in enumerate(keys):
                if uses[index] is not _HostUse.NONE:
                    continue
                reservation = host.try_reserve(
                    key, evict_below=self.prefetch_threshold if speculative else None)
                if reservation is not None:
                    self._note_eviction(evictions, host, reservation.evicted, reservation.slot)
                    sources[index] = (Source.PACK_VIA_HOST, reservation.slot)
                    uses[index] = _HostUse.FILL
        for key, use in zip(keys, uses, strict=True):
            self._pending[key] = _PendingLoad(use, speculative)
        if speculative:
            self._prefetch_in_flight += len(keys)
        return sources

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
        if use is _HostUse.COPY:
            host.unpin(key)  # the host copy stays valid whether or not the H2D copy worked
        elif loaded:
            host.complete(key)
        else:
            host.abort(key)  # the read into the host slot may be what failed

    @staticmethod
    def _note_eviction(evictions: list[Eviction], cache: SlotCache, evicted: ExpertKey | None,
                       slot: int) -> None:
        if evicted is not None:
            evictions.append(Eviction(cache.tier, evicted, slot))
