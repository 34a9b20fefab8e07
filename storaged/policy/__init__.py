"""storaged's cache policy: which (model, layer, expert) objects live in which tier's slots.

Tiers: VRAM (one device allocation cut into equal slots), an optional pinned host-RAM tier
(equal slots holding what VRAM evicted: the tiers are exclusive and add up, see planner.py), and
the pack on NVMe. `SlotMapLayout` places each object's entry in the arena's slot map.

- `SlotCache`: one tier. Entries are LOADING (slot reserved, bytes not valid, invisible to
  lookups) or READY. Replacement gives each (model, layer) a fair share of the slots (a layer
  at its share replaces within itself, else the layer holding the most gives way: layer_share.py,
  so a step larger than the tier does not evict the layer needed next), and within a layer evicts
  the unpinned READY entry with the lowest decayed access frequency (halving every `half_life`
  accesses, applied lazily through a logical clock, so an access is O(1)); the older last access
  breaks ties. Victims come off lazily invalidated min-heaps: O(log n), not a scan of every slot.
  Pinned and LOADING entries are never evicted.
- `AcquirePlanner`: the Acquire transaction of a session (replace its pins on a layer, and on
  request drop its pins on the model's other layers; hits, single-flight waits, loads from host
  or pack; all-or-nothing on SlotsExhausted), Prefetch
  (free or cold slots only, never pinned or loading ones), Preload (fills free room at start,
  demoting into free host slots, never dropping anything), completion/abort, release/close, and
  `reload(key)`: a resident object whose bytes failed verification is loaded again in its slot.
- `PolicyStats`: counters and gauges for the Stats RPC and Prometheus.

Pure Python, no I/O. Not thread-safe and need not be: storaged calls it only from its single
asyncio event-loop thread, and no call awaits, so each call is atomic with respect to the others.
"""

from storaged.policy.errors import (DuplicateExpert, InvalidExpert, InvalidExpertRequest, InvalidLayer,
                                    PolicyError, PolicyStateError, SlotsExhausted, TooManyExperts, UnknownModel)
from storaged.policy.keys import ExpertKey, ModelLayout
from storaged.policy.plan import (AcquirePlan, Demotion, Eviction, ExpertStep, PolicyStats,
                                  PrefetchPlan, SessionId, Source)
from storaged.policy.planner import AcquirePlanner, PreloadOutcome
from storaged.policy.slot_cache import (EntryState, EntryView, Reservation, ResidentStats,
                                        SlotCache, TierCounters)
from storaged.policy.slot_map import ABSENT, SlotMapLayout

__all__ = [
    "ABSENT", "Demotion", "SlotMapLayout", "AcquirePlan", "AcquirePlanner", "SlotsExhausted", "DuplicateExpert",
    "EntryState",
    "EntryView", "Eviction", "ExpertKey", "ExpertStep", "InvalidExpert", "InvalidLayer",
    "InvalidExpertRequest", "ModelLayout", "PolicyError", "PolicyStateError", "PolicyStats",
    "PrefetchPlan", "PreloadOutcome", "Reservation", "ResidentStats", "SessionId", "SlotCache", "Source",
    "TierCounters", "TooManyExperts", "UnknownModel",
]
