"""Victim choice that gives every (model, layer) a fair share of a tier's slots.

A forward pass reads the layers in a cycle: layer 0, 1, ..., L-1, then layer 0 of the next step.
When one step's objects outnumber the slots (several sequences batched, or a prefill), a purely
frequency-and-recency victim is the entry used longest ago, which in a cycle is an entry of the
layer needed next: every access then misses (measured: 8 decode streams at a 25% arena read as
many bytes per step as with no cache at all). Belady's rule for a cycle evicts what is needed
furthest ahead, the entries of the layer just computed.

So the victim for a newcomer of layer g is chosen by occupancy before score:
1. an entry made coldest (a duplicate another tier holds too) from any layer: dropping it costs
   nothing;
2. while g holds at least its share (slots / active layers holding entries), g's own coldest entry:
   a layer at its share replaces within itself;
3. else, or when g has nothing evictable (all pinned for the step in progress), the coldest entry of
   an idle layer if there is one, else of the layer holding the most slots, which in a cycle is the
   layer just computed, holding its whole step pinned a moment ago; among layers holding as many,
   the one whose coldest entry was used last (in a cycle, the layer needed furthest ahead: breaking
   the tie the other way would bring the cascade back, each layer taking its slots from the layer
   needed next).
A layer is idle when none of its entries was accessed in the last `idle_after` accesses of the
tier (a model no client uses any more, for one): it has no share, so the layers in use take its
slots instead of keeping to a share that counts it.
Within a layer, entries are ranked by decayed frequency and recency (decay.py) as before. With one
layer this is the plain lowest-score rule.

Cost: O(log n) per operation as a single heap; step 3 also looks at each layer's heap top once,
O(layers), and only when a layer is below its share or fully pinned.
"""

from __future__ import annotations

from storaged.policy.decay import NEVER_ACCESSED
from storaged.policy.entries import CacheEntry
from storaged.policy.eviction_heap import EvictionHeap, HeapWork

LayerId = tuple[int, int]  # (model, layer)


class LayerShareEviction:
    """The evictable entries of one tier, in a heap per layer plus one for coldest entries,
    and how many slots (entries in any state) each layer holds."""

    def __init__(self, slot_count: int, idle_after: int) -> None:
        if idle_after <= 0:
            raise ValueError(f"idle_after must be a positive number of accesses, got {idle_after}")
        self.slot_count = slot_count
        self.idle_after = idle_after
        self._heaps: dict[LayerId, EvictionHeap] = {}
        self._coldest = EvictionHeap()  # entries whose score was reset to NEVER_ACCESSED
        self._held: dict[LayerId, int] = {}  # slots per layer, 0-count layers removed
        self._last_use: dict[LayerId, int] = {}  # the tier's access tick of each layer's latest access
        # active layers holding entries: recounted when a layer comes or goes, and every
        # idle_after // 16 accesses (for layers turning idle or active again)
        self._active_layers = 0
        self._active_counted_at: int | None = None
        self._live = 0

    # ---- occupancy -------------------------------------------------------------------------

    def occupy(self, entry: CacheEntry) -> None:
        """`entry` took a slot (any state)."""
        layer = entry.layer_id
        held = self._held.get(layer, 0)
        self._held[layer] = held + 1
        if not held:
            self._active_counted_at = None  # a layer more: recount

    def vacate(self, entry: CacheEntry) -> None:
        """`entry` gave its slot back (evicted or aborted); it is no longer evictable."""
        self.discard(entry)
        layer = entry.layer_id
        held = self._held[layer] - 1
        if held:
            self._held[layer] = held
        else:
            del self._held[layer]
            self._active_counted_at = None

    def touch(self, entry: CacheEntry, tick: int) -> None:
        """`entry` was accessed at the tier's access tick `tick`."""
        # once per access, so nothing more: a layer turning active again is counted at the next
        # periodic recount (within idle_after // 16 accesses)
        self._last_use[entry.layer_id] = tick

    def _active_count(self, now: int) -> int:
        counted_at = self._active_counted_at
        if counted_at is None or now - counted_at >= max(1, self.idle_after // 16) or now < counted_at:
            horizon = now - self.idle_after
            self._active_layers = sum(1 for layer in self._held if self._last_use.get(layer, now) >= horizon)
            self._active_counted_at = now
        return self._active_layers

    # ---- the evictable set -----------------------------------------------------------------

    def __len__(self) -> int:
        return self._live

    def push(self, entry: CacheEntry) -> None:
        """Make `entry` evictable with its current score."""
        if entry.log_score == NEVER_ACCESSED:
            heap = self._coldest
        else:
            layer = entry.layer_id
            heap = self._heaps.get(layer)
            if heap is None:
                heap = self._heaps[layer] = EvictionHeap()
        heap.push(entry)
        entry.heap = heap
        self._live += 1

    def discard(self, entry: CacheEntry) -> None:
        """Make `entry` not evictable (pinned, re-scored or removed); no-op if it was not."""
        if entry.heap_token is not None:
            entry.heap.discard(entry)
            entry.heap = None
            self._live -= 1

    def peek_victim(self, model: int, layer: int, now: int) -> CacheEntry | None:
        """The entry a newcomer of (model, layer) should displace at access tick `now`, or None if
        nothing is evictable."""
        victim = self._coldest.peek_min()
        if victim is not None:
            return victim
        own_id = (model, layer)
        own = self._heaps.get(own_id)
        held = self._held.get(own_id, 0)
        # the newcomer's layer is active (it is being accessed now), counted once
        layers = max(1, self._active_count(now) + (held == 0))
        if own is not None and held * layers >= self.slot_count:  # at or above its share
            victim = own.peek_min()
            if victim is not None:
                return victim
        horizon = now - self.idle_after
        best: CacheEntry | None = None
        best_rank: tuple[bool, int, int] = (False, 0, 0)
        for other_id, heap in self._heaps.items():
            if other_id == own_id or not len(heap):
                continue
            top = heap.peek_min()
            rank = (self._last_use.get(other_id, now) < horizon, self._held[other_id], top.last_tick)
            if best is None or rank > best_rank:
                best, best_rank = top, rank
        if best is None and own is not None:
            best = own.peek_min()
        return best

    def take(self, victim: CacheEntry) -> None:
        """Remove `victim`, which peek_victim just returned, from the evictable set."""
        popped = victim.heap.pop_min()
        assert popped is victim, "take() of an entry that is not at the top of its heap"
        victim.heap = None
        self._live -= 1

    def rebase(self, shift: float) -> None:
        for heap in self._heaps.values():
            heap.rebase(shift)
        self._coldest.rebase(shift)

    @property
    def work(self) -> HeapWork:
        """Heap operations of every layer's heap, summed."""
        heaps = [*self._heaps.values(), self._coldest]
        return HeapWork(pushes=sum(h.work.pushes for h in heaps), probes=sum(h.work.probes for h in heaps),
                        rebuilt_items=sum(h.work.rebuilt_items for h in heaps))

    @property
    def stored_items(self) -> int:
        return sum(h.stored_items for h in self._heaps.values()) + self._coldest.stored_items
