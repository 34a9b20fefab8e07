"""The records one cache tier keeps and reports: entries, reservations, counters."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

from storaged.policy.decay import NEVER_ACCESSED
from storaged.policy.keys import ExpertKey


class EntryState(enum.Enum):
    LOADING = "loading"
    READY = "ready"


@dataclass(slots=True, eq=False)
class CacheEntry:
    key: ExpertKey
    slot: int
    state: EntryState
    pin_count: int = 0
    log_score: float = NEVER_ACCESSED
    last_tick: int = 0
    heap_token: int | None = None  # set while READY and unpinned (evictable)
    heap: object = None  # the EvictionHeap holding heap_token's item (layer_share.py), else None
    layer_id: tuple[int, int] = field(init=False)  # (key.model, key.layer): layer_share.py's key, made once
    prefetched: bool = False  # reserved by a prefetch hint
    demanded: bool = False  # reserved by, or since used by, a demand request

    def __post_init__(self) -> None:
        self.layer_id = (self.key.model, self.key.layer)


class Reservation(NamedTuple):
    slot: int
    evicted: ExpertKey | None  # the READY entry whose slot was taken, if any


class EntryView(NamedTuple):
    slot: int
    state: EntryState
    pin_count: int


@dataclass
class TierCounters:
    """Cumulative event counts of one tier."""

    hits: int = 0  # lookups that found the key READY
    misses: int = 0  # lookups that did not (absent, or still LOADING)
    coalesced: int = 0  # requests that joined a load already in flight (single flight)
    evictions: int = 0
    aborts: int = 0
    prefetch_issued: int = 0
    prefetch_used: int = 0  # prefetched entries demanded before leaving the cache
    prefetch_wasted: int = 0  # prefetched entries evicted or aborted before any demand


@dataclass(frozen=True)
class ResidentStats:
    entries: int  # slots owned (LOADING + READY)
    ready: int
    loading: int
    pinned_entries: int
    pins: int  # sum of pin counts
    free_slots: int
    resident_bytes: int  # READY entries x slot_bytes
