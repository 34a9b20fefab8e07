"""What the planner hands back to storaged's I/O layer, and the counters it exports."""

from __future__ import annotations

import enum
from collections.abc import Hashable
from dataclasses import dataclass
from typing import NamedTuple

from storaged.policy.keys import ExpertKey

SessionId = Hashable  # whatever identifies a client session (Attach's session token)


class Source(enum.Enum):
    """Where the bytes of a step's VRAM slot come from."""

    READY = "ready"  # hit: the slot already holds the bytes
    WAIT = "wait"  # another request's load of this key is in flight: wait for its completion
    HOST = "host"  # copy host slot → VRAM slot, then planner.complete(key) (frees the host slot)
    PACK = "pack"  # read pack through the caller's own staging → VRAM slot, complete(key)

    @property
    def needs_io(self) -> bool:
        """The caller must move bytes and then call planner.complete(key) or abort(key)."""
        return self in (Source.HOST, Source.PACK)


class ExpertStep(NamedTuple):
    """One requested expert's outcome. A NamedTuple: several are built per Acquire, on the hit
    path, where a frozen dataclass's construction cost shows."""

    key: ExpertKey
    slot: int  # VRAM slot index
    source: Source
    host_slot: int | None = None  # host tier slot of a HOST step
    promote: bool = False  # WAIT on a prefetch still in flight: raise that read to demand priority
    after_demotion: bool = False  # HOST step whose host copy is still arriving: wait for demoted(key)


class Eviction(NamedTuple):
    """A READY entry dropped to make room; the slot it had now belongs to another key."""

    tier: str
    key: ExpertKey
    slot: int


class Demotion(NamedTuple):
    """A VRAM victim to copy to a host slot before its VRAM slot is overwritten."""

    key: ExpertKey
    vram_slot: int
    host_slot: int


@dataclass(frozen=True)
class AcquirePlan:
    """The outcome of one Acquire: one step per requested expert, in request order."""

    session: SessionId
    model: int
    layer: int
    steps: tuple[ExpertStep, ...]
    evictions: tuple[Eviction, ...]
    demotions: tuple[Demotion, ...] = ()

    @property
    def slots(self) -> tuple[int, ...]:
        return tuple(step.slot for step in self.steps)

    @property
    def loads(self) -> tuple[ExpertStep, ...]:
        """Steps whose bytes this caller must bring in (HOST, PACK_VIA_HOST, PACK)."""
        return tuple(step for step in self.steps if step.source.needs_io)

    @property
    def waits(self) -> tuple[ExpertStep, ...]:
        """Steps loaded by someone else: wait for that load's completion."""
        return tuple(step for step in self.steps if step.source is Source.WAIT)


@dataclass(frozen=True)
class PrefetchPlan:
    """Low-priority loads to issue for a Prefetch hint; nothing is pinned."""

    model: int
    layer: int
    loads: tuple[ExpertStep, ...]
    evictions: tuple[Eviction, ...]
    skipped: int  # hinted experts not loaded: already resident/loading, or no cheap slot
    demotions: tuple[Demotion, ...] = ()


@dataclass(frozen=True)
class PolicyStats:
    """A snapshot of the policy's counters (cumulative) and gauges (current)."""

    vram_hits: int
    vram_misses: int
    vram_coalesced: int  # misses that joined a load already in flight instead of reading again
    vram_evictions: int
    vram_aborts: int
    host_hits: int  # host lookups come from VRAM misses, demand and prefetch alike
    host_misses: int
    host_evictions: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_wasted: int
    prefetch_in_flight: int
    vram_resident_entries: int  # READY
    vram_loading_entries: int
    vram_resident_bytes: int
    host_resident_entries: int
    host_resident_bytes: int
    pins_outstanding: int  # VRAM pins held by sessions
    host_copies_in_flight: int  # host entries pinned while copied to VRAM
    sessions: int  # sessions holding at least one pin
    demotions: int = 0  # VRAM victims copied down to the host tier
