"""One cache tier: `slot_count` equal slots holding (model, layer, expert) objects.

Entry life: reserve → LOADING (slot owned, bytes not valid yet, invisible to lookups)
→ complete → READY, or → abort (slot freed: I/O or checksum failure). READY entries leave only
by eviction when a reservation needs their slot. Pinned entries (pin count > 0) and LOADING
entries are never evicted. The victim is an unpinned READY entry: first any entry made coldest
(a duplicate of another tier's copy), then, by each layer's share of the slots (layer_share.py),
the newcomer's own layer or the layer holding the most slots; within a layer the entry with the
lowest decayed access frequency (decay.py), the older last access breaking ties, found through
lazy min-heaps in O(log n) amortized (eviction_heap.py).

Not thread-safe, by design: storaged calls it from its single asyncio loop thread only.
"""

from __future__ import annotations

from collections.abc import Iterator

from storaged.policy.decay import NEVER_ACCESSED, DecayClock
from storaged.policy.entries import (CacheEntry, EntryState, EntryView, Reservation,
                                     ResidentStats, TierCounters)
from storaged.policy.errors import SlotsExhausted, PolicyStateError
from storaged.policy.eviction_heap import HeapWork
from storaged.policy.keys import ExpertKey
from storaged.policy.layer_share import LayerShareEviction

# In a forward pass every layer is read each step, a step being at most a few half-lives of
# accesses (a half-life is one tier's worth: 8 streams at a 25% arena make ~1.6 a step); a layer
# unread for longer belongs to a model or phase no longer running.
IDLE_AFTER_HALF_LIVES = 8

__all__ = ["CacheEntry", "EntryState", "EntryView", "Reservation", "ResidentStats", "SlotCache",
           "TierCounters"]


class SlotCache:
    """A tier of equal slots with frequency-and-recency replacement and pinning."""

    def __init__(self, slot_count: int, *, slot_bytes: int = 0, half_life: int | None = None,
                 tier: str = "vram"):
        if slot_count < 0:
            raise ValueError(f"{tier} tier: slot_count must be >= 0, got {slot_count}")
        if slot_bytes < 0:
            raise ValueError(f"{tier} tier: slot_bytes must be >= 0, got {slot_bytes}")
        self.tier = tier
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        # Default: frequency is remembered for about one cache turnover worth of accesses.
        self._clock = DecayClock(half_life if half_life is not None else max(16, slot_count))
        self._entries: dict[ExpertKey, CacheEntry] = {}
        self._slot_keys: list[ExpertKey | None] = [None] * slot_count
        self._free_slots = list(range(slot_count - 1, -1, -1))  # stack: slot 0 handed out first
        # A layer unused for a few half-lives is idle: it loses its share (layer_share.py).
        self._evictable = LayerShareEviction(slot_count, idle_after=IDLE_AFTER_HALF_LIVES * self._clock.half_life)
        self._pins = 0  # sum of pin counts
        self._pinned_entries = 0  # entries with pin_count > 0
        self._loading = 0  # entries in LOADING state
        self.counters = TierCounters()

    # ---- queries (no side effects) -------------------------------------------------------

    @property
    def half_life(self) -> int:
        return self._clock.half_life

    @property
    def clock(self) -> int:
        """Accesses so far (the logical time decay is measured in)."""
        return self._clock.now

    @property
    def free_slot_count(self) -> int:
        return len(self._free_slots)

    @property
    def evictable_count(self) -> int:
        """READY entries with no pins: what a reservation may evict."""
        return len(self._evictable)

    @property
    def pins_outstanding(self) -> int:
        return self._pins

    @property
    def heap_work(self) -> HeapWork:
        return self._evictable.work

    @property
    def heap_stored_items(self) -> int:
        return self._evictable.stored_items

    def __contains__(self, key: ExpertKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def state(self, key: ExpertKey) -> EntryState | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.state

    def slot_of(self, key: ExpertKey) -> int | None:
        entry = self._entries.get(key)
        return None if entry is None else entry.slot

    def key_at(self, slot: int) -> ExpertKey | None:
        return self._slot_keys[slot]

    def pin_count(self, key: ExpertKey) -> int:
        entry = self._entries.get(key)
        return 0 if entry is None else entry.pin_count

    def decayed_score(self, key: ExpertKey) -> float:
        """The key's replacement score now, in accesses; 0.0 if absent."""
        entry = self._entries.get(key)
        return 0.0 if entry is None else self._clock.decayed(entry.log_score)

    def last_access(self, key: ExpertKey) -> int:
        return self._entry(key, "last_access").last_tick

    def is_evictable(self, key: ExpertKey) -> bool:
        entry = self._entries.get(key)
        return entry is not None and entry.heap_token is not None

    def views(self) -> Iterator[tuple[ExpertKey, EntryView]]:
        for key, entry in self._entries.items():
            yield key, EntryView(entry.slot, entry.state, entry.pin_count)

    def resident(self) -> ResidentStats:
        """O(1): the counts are kept up to date by every transition."""
        ready = len(self._entries) - self._loading
        return ResidentStats(
            entries=len(self._entries),
            ready=ready,
            loading=self._loading,
            pinned_entries=self._pinned_entries,
            pins=self._pins,
            free_slots=len(self._free_slots),
            resident_bytes=ready * self.slot_bytes,
        )

    # ---- hit path ----------------------------------------------------------------------------

    def lookup(self, key: ExpertKey, *, pin: bool = False) -> int | None:
        """The slot of a READY `key` (counts a hit, refreshes its score), else None (a miss).

        `pin=True` also pins it; cheaper than lookup + pin because the entry leaves the
        eviction heap before its re-scoring would have re-pushed it.
        """
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.READY:
            self.counters.misses += 1
            return None
        self.counters.hits += 1
        self._demand_access(entry, pin)
        return entry.slot

    def join_loading(self, key: ExpertKey, *, pin: bool = False) -> int | None:
        """The slot of a LOADING `key` whose load the caller will wait for, else None.

        Counts a coalesced request and the access; `pin=True` keeps the entry resident once
        its load completes, until unpinned.
        """
        entry = self._entries.get(key)
        if entry is None or entry.state is not EntryState.LOADING:
            return None
        self.counters.coalesced += 1
        self._demand_access(entry, pin)
        return entry.slot

    # ---- reservation life cycle ----------------------------------------------------------------

    def try_reserve(self, key: ExpertKey, *, prefetch: bool = False,
                    evict_below: float | None = None) -> Reservation | None:
        """Give `key` a LOADING slot: a free one, else the lowest-scored evictable entry's.

        `evict_below` (prefetch): only evict an entry whose decayed score is below it.
        Returns None, changing nothing, when no slot qualifies.
        """
        if key in self._entries:
            raise PolicyStateError(self.tier, key, "reserve of a key that already has a slot")
        evicted: ExpertKey | None = None
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = self._evictable.peek_victim(key.model, key.layer, self._clock.now)
            if victim is None:
                return None
            if evict_below is not None and victim.log_score >= self._clock.log_level(evict_below):
                return None
            self._evictable.take(victim)
            slot = victim.slot
            evicted = victim.key
            self._remove(victim)
            self.counters.evictions += 1
        entry = CacheEntry(key, slot, EntryState.LOADING,
                           prefetched=prefetch, demanded=not prefetch)
        self._entries[key] = entry
        self._slot_keys[slot] = key
        self._evictable.occupy(entry)
        self._loading += 1
        self._record_access(entry)
        if prefetch:
            self.counters.prefetch_issued += 1
        return Reservation(slot, evicted)

    def reserve(self, key: ExpertKey, *, prefetch: bool = False) -> Reservation:
        """Like try_reserve, but raises SlotsExhausted when every slot is pinned or loading."""
        reservation = self.try_reserve(key, prefetch=prefetch)
        if reservation is None:
            raise SlotsExhausted(self.tier, needed=1, available=0, detail=f"for {key}")
        return reservation

    def complete(self, key: ExpertKey) -> int:
        """LOADING → READY: the slot's bytes are valid. Returns the slot."""
        entry = self._entry(key, "complete")
        if entry.state is not EntryState.LOADING:
            raise PolicyStateError(self.tier, key, "complete of an entry that is not LOADING")
        entry.state = EntryState.READY
        self._loading -= 1
        if entry.pin_count == 0:
            self._evictable.push(entry)
        return entry.slot

    def reload(self, key: ExpertKey) -> int:
        """READY → LOADING in place: the slot's bytes proved bad and a load will rewrite them. The
        entry keeps its slot and pins, and ends with complete or abort like any load. Returns the slot."""
        entry = self._entry(key, "reload")
        if entry.state is not EntryState.READY:
            raise PolicyStateError(self.tier, key, "reload of an entry that is not READY")
        self._evictable.discard(entry)
        entry.state = EntryState.LOADING
        self._loading += 1
        return entry.slot

    def abort(self, key: ExpertKey) -> int:
        """Drop a LOADING entry and free its slot (failed read). Returns the pins it had."""
        entry = self._entry(key, "abort")
        if entry.state is not EntryState.LOADING:
            raise PolicyStateError(self.tier, key, "abort of an entry that is not LOADING")
        self._remove(entry)
        self._free_slots.append(entry.slot)
        self.counters.aborts += 1
        return entry.pin_count

    def make_coldest(self, key: ExpertKey) -> None:
        """Forget the entry's accesses: the next eviction picks it first (a copy another tier
        now holds too, so dropping it costs nothing)."""
        entry = self._entry(key, "make_coldest")
        entry.log_score = NEVER_ACCESSED
        if entry.heap_token is not None:  # evictable: reposition it
            self._evictable.discard(entry)
            self._evictable.push(entry)

    def refresh(self, key: ExpertKey) -> None:
        """Count an access of `key` for replacement without counting a hit (it came from another tier)."""
        self._record_access(self._entry(key, "refresh"))

    def pin(self, key: ExpertKey) -> int:
        """Keep `key` resident (LOADING or READY) until a matching unpin. Returns its slot."""
        entry = self._entry(key, "pin")
        self._pinned_entries += entry.pin_count == 0
        entry.pin_count += 1
        self._pins += 1
        self._evictable.discard(entry)
        return entry.slot

    def unpin(self, key: ExpertKey) -> None:
        entry = self._entries.get(key)
        if entry is None or entry.pin_count == 0:
            problem = "a key that has no slot" if entry is None else "an entry with no pins"
            raise PolicyStateError(self.tier, key, f"unpin of {problem}")
        entry.pin_count -= 1
        self._pins -= 1
        self._pinned_entries -= entry.pin_count == 0
        if entry.pin_count == 0 and entry.state is EntryState.READY:
            self._evictable.push(entry)

    # ---- internals ---------------------------------------------------------------------------

    def _entry(self, key: ExpertKey, operation: str) -> CacheEntry:
        entry = self._entries.get(key)
        if entry is None:
            raise PolicyStateError(self.tier, key, f"{operation} of a key that has no slot")
        return entry

    def _record_access(self, entry: CacheEntry) -> None:
        entry.log_score, entry.last_tick = self._clock.record_access(entry.log_score)
        self._evictable.touch(entry, entry.last_tick)
        if entry.heap_token is not None:  # evictable: its heap position depends on the score
            self._evictable.discard(entry)
            self._evictable.push(entry)
        if self._clock.needs_rebase:
            shift = self._clock.rebase()
            for other in self._entries.values():
                other.log_score -= shift  # -inf stays -inf
            self._evictable.rebase(shift)

    def _demand_access(self, entry: CacheEntry, pin: bool) -> None:
        """A demand request uses `entry` (the hit path: one call, not three)."""
        if pin:  # before re-scoring, so the entry leaves the heap instead of being re-pushed
            self._pinned_entries += entry.pin_count == 0
            entry.pin_count += 1
            self._pins += 1
            self._evictable.discard(entry)
        if not entry.demanded:
            entry.demanded = True
            if entry.prefetched:
                self.counters.prefetch_used += 1
        self._record_access(entry)

    def _remove(self, entry: CacheEntry) -> None:
        """Forget `entry` (eviction or abort); the caller decides what happens to its slot."""
        self._evictable.vacate(entry)
        del self._entries[entry.key]
        self._slot_keys[entry.slot] = None
        self._pins -= entry.pin_count
        self._pinned_entries -= entry.pin_count > 0
        self._loading -= entry.state is EntryState.LOADING
        if entry.prefetched and not entry.demanded:
            self.counters.prefetch_wasted += 1
