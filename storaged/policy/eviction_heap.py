"""Min-heap of evictable cache entries with lazy invalidation: victim choice in O(log n).

An entry is evictable while it is READY and unpinned. Its heap item is
(log_score, last_tick, token, entry); the entry remembers the token of its one live item.
Re-scoring or pinning an entry only forgets the token (O(1)); the stale item stays in the
list and is dropped when it reaches the top. So that stale items cannot pile up (a hot entry
is re-scored on every hit), the list is rebuilt from live items once it is more than twice as
long as the live count; each push or discard pays for O(1) of that rebuild, amortized.

`work` counts the heap items touched, so tests can show that choosing a victim costs O(1)
amortized heap operations (each O(log n)) rather than a scan of every slot.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Protocol

COMPACT_SLACK = 32  # stale items tolerated beyond 2x live before a rebuild
# Tokens are unique across every heap, not per heap: an entry moved to another heap (layer_share.py)
# leaves a stale item behind, which must never match the token of its new live item.
_TOKENS = itertools.count()


class HeapEntry(Protocol):
    log_score: float
    last_tick: int
    heap_token: int | None  # token of this entry's live heap item; None: not in the heap


@dataclass
class HeapWork:
    """Operation counts of one heap (cumulative)."""

    pushes: int = 0
    probes: int = 0  # items looked at on top of the heap: stale ones dropped + live ones returned
    rebuilt_items: int = 0  # items scanned by compaction rebuilds


class EvictionHeap:
    """Evictable entries ordered by (decayed frequency, last access): the minimum is the victim."""

    def __init__(self) -> None:
        # items: (log_score, last_tick, token, entry); tokens are unique, so the entry is never
        # compared and ties on score fall back to recency (older access evicted first).
        self._items: list[tuple[float, int, int, HeapEntry]] = []
        self._live = 0
        self.work = HeapWork()

    def __len__(self) -> int:
        """Number of evictable entries (live items)."""
        return self._live

    @property
    def stored_items(self) -> int:
        """Live plus stale items held in the list (bounded by 2 * live + COMPACT_SLACK + 1)."""
        return len(self._items)

    def push(self, entry: HeapEntry) -> None:
        """Make `entry` evictable with its current score."""
        assert entry.heap_token is None, "entry already has a live heap item"
        token = next(_TOKENS)
        entry.heap_token = token
        self._live += 1
        self.work.pushes += 1
        heapq.heappush(self._items, (entry.log_score, entry.last_tick, token, entry))
        if len(self._items) > 2 * self._live + COMPACT_SLACK:
            self._rebuild()

    def discard(self, entry: HeapEntry) -> None:
        """Make `entry` not evictable (pinned, re-scored or removed); no-op if it was not."""
        if entry.heap_token is not None:
            entry.heap_token = None
            self._live -= 1

    def peek_min(self) -> HeapEntry | None:
        """The evictable entry with the lowest (score, last access), or None if there is none."""
        items = self._items
        while items:
            self.work.probes += 1
            _, _, token, entry = items[0]
            if entry.heap_token == token:
                return entry
            heapq.heappop(items)
        assert self._live == 0, f"{self._live} live entries but an empty heap"
        return None

    def pop_min(self) -> HeapEntry | None:
        """Remove and return the lowest entry (it is no longer evictable)."""
        entry = self.peek_min()
        if entry is not None:
            heapq.heappop(self._items)
            entry.heap_token = None
            self._live -= 1
        return entry

    def rebase(self, shift: float) -> None:
        """Every entry's log_score was reduced by `shift`: re-key the live items (O(n)).

        A common shift keeps the order, but the stored keys must match the entries' scores."""
        self.work.rebuilt_items += len(self._items)
        self._items = [(item[0] - shift, *item[1:]) for item in self._items
                       if item[3].heap_token == item[2]]
        heapq.heapify(self._items)

    def _rebuild(self) -> None:
        self.work.rebuilt_items += len(self._items)
        self._items = [item for item in self._items if item[3].heap_token == item[2]]
        heapq.heapify(self._items)
        assert len(self._items) == self._live, (len(self._items), self._live)
