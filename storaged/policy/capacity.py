"""The admission check of a demand Acquire, done before the planner changes anything.

Why a separate check rather than reserving and rolling back: a failing Acquire must leave the
state exactly as it was (pins, counters, decayed scores, eviction heap), and undoing a partial
reservation would have to restore all of that. Counting first is O(request + released pins).
"""

from __future__ import annotations

from collections.abc import Sequence

from storaged.policy.errors import SlotsExhausted
from storaged.policy.keys import ExpertKey
from storaged.policy.slot_cache import EntryState, SlotCache


def check_capacity(vram: SlotCache, model: int, layer: int, previous: tuple[ExpertKey, ...],
                   released_elsewhere: Sequence[ExpertKey], keys: tuple[ExpertKey, ...]) -> None:
    """Raise SlotsExhausted if the misses among `keys` cannot all get a VRAM slot once the
    requesting session's pins on `previous` (its pins on this layer) and `released_elsewhere`
    (its pins on other layers that this Acquire drops; never in `keys`, which are all of
    `layer`) are gone. A session holds at most one pin per key."""
    available = vram.free_slot_count + vram.evictable_count
    if available >= len(keys):
        return  # even if every key missed or pinned an evictable entry, all would fit
    previously_held = set(previous)
    for key in (*previous, *released_elsewhere):  # evictable once this session's pin is gone
        if vram.state(key) is EntryState.READY and vram.pin_count(key) == 1:
            available += 1
    needed = 0
    for key in keys:
        state = vram.state(key)
        if state is None:
            needed += 1
        elif state is EntryState.READY:
            pins_after_release = vram.pin_count(key) - (1 if key in previously_held else 0)
            if pins_after_release == 0:
                available -= 1  # a hit on an evictable entry pins it: no longer a victim
    if needed > available:
        raise SlotsExhausted(vram.tier, needed, available,
                                f"model {model} layer {layer}: {len(keys)} experts requested")
