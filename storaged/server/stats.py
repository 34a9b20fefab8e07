"""Policy counters → Prometheus metrics, and the Stats reply built from both.

The planner counts hits, misses, evictions and prefetch outcomes itself; they are copied into
StoragedMetrics as deltas by `MetricsSync.sync()`, which the daemon runs on the event loop
(the planner's thread) every second and before each Stats reply. Read bytes, read latency, I/O
errors and checksum failures are recorded by the read workers directly; H2D bytes and Acquire
latency by the engine.
"""

from __future__ import annotations

import dataclasses

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.metrics import StoragedMetrics
from storaged.policy import PolicyStats
from storaged.server.engine import StorageEngine
from storaged.server.sessions import SessionRegistry

SYNC_INTERVAL_SECONDS = 1.0

# PolicyStats counter → (StoragedMetrics recorder name, tier or None)
_COUNTERS = {
    "vram_hits": ("record_hit", "vram"), "vram_misses": ("record_miss", "vram"),
    "vram_evictions": ("record_eviction", "vram"), "host_hits": ("record_hit", "host"),
    "host_misses": ("record_miss", "host"), "host_evictions": ("record_eviction", "host"),
}
_PREFETCH = {"prefetch_issued": "issued", "prefetch_used": "used", "prefetch_wasted": "wasted"}


class MetricsSync:
    def __init__(self, engine: StorageEngine, sessions: SessionRegistry):
        self.engine = engine
        self.sessions = sessions
        self._last = {name: 0 for name in (*_COUNTERS, *_PREFETCH)}
        self._fences = (0, 0.0, 0)  # waits, wait seconds, revocations already recorded

    @property
    def metrics(self) -> StoragedMetrics:
        return self.engine.metrics

    def sync(self) -> PolicyStats:
        stats = self.engine.planner.stats()
        now = dataclasses.asdict(stats)
        for name, (recorder, tier) in _COUNTERS.items():
            delta = now[name] - self._last[name]
            if delta:
                getattr(self.metrics, recorder)(tier, delta)
        prefetch = {label: now[name] - self._last[name] for name, label in _PREFETCH.items()}
        if any(prefetch.values()):
            self.metrics.record_prefetch(**prefetch)
        self._last = {name: now[name] for name in self._last}
        fences = self.engine.fences
        waits, seconds, revocations = fences.waits, fences.wait_seconds, fences.revocations
        last_waits, last_seconds, last_revocations = self._fences
        if waits > last_waits:
            self.metrics.fence_waits.inc(waits - last_waits)
            self.metrics.fence_wait_seconds.inc(seconds - last_seconds)
        if revocations > last_revocations:
            self.metrics.fence_revocations.inc(revocations - last_revocations)
        self._fences = (waits, seconds, revocations)
        self.metrics.set_resident("vram", stats.vram_resident_entries, stats.vram_resident_bytes)
        self.metrics.set_resident("host", stats.host_resident_entries, stats.host_resident_bytes)
        self.metrics.set_sessions(len(self.sessions))
        return stats


def _mean_us(figures: dict[str, float], name: str) -> float:
    count = figures.get(f"{name}_count", 0.0)
    return figures.get(f"{name}_sum", 0.0) / count * 1e6 if count else 0.0


def stats_response(sync: MetricsSync) -> pb.StatsResponse:
    stats = sync.sync()
    figures = sync.metrics.snapshot()
    planner = sync.engine.planner

    def tier(name: str, capacity: int, coalesced: int) -> pb.TierStats:
        return pb.TierStats(
            tier=name, hits=int(figures[f"hits_total{{tier={name}}}"]),
            misses=int(figures[f"misses_total{{tier={name}}}"]),
            evictions=int(figures[f"evictions_total{{tier={name}}}"]),
            resident_experts=int(figures[f"resident_experts{{tier={name}}}"]),
            resident_bytes=int(figures[f"resident_bytes{{tier={name}}}"]),
            capacity_slots=capacity, coalesced=coalesced)

    tiers = [tier("vram", planner.vram.slot_count, stats.vram_coalesced)]
    if planner.host is not None:
        tiers.append(tier("host", planner.host.slot_count, 0))
    counter = lambda name: int(figures[name])  # noqa: E731
    return pb.StatsResponse(
        tiers=tiers, bytes_read=counter("read_bytes_total"), h2d_bytes=counter("h2d_bytes_total"),
        io_errors=counter("io_errors_total"), checksum_failures=counter("checksum_failures_total"),
        prefetch_issued=counter("prefetch_issued_total"), prefetch_used=counter("prefetch_used_total"),
        prefetch_wasted=counter("prefetch_wasted_total"), sessions=len(sync.sessions),
        pins=stats.pins_outstanding, acquires=counter("acquire_seconds_count"),
        capacity_exhausted=sync.engine.capacity_exhausted,
        acquire_latency_mean_us=_mean_us(figures, "acquire_seconds"),
        read_latency_mean_us=_mean_us(figures, "read_seconds"),
        loads_in_flight=sync.engine.loads_in_flight, reads=counter("read_seconds_count"),
        demotions=counter("demotions_total"), d2h_bytes=counter("d2h_bytes_total"),
        fence_waits=counter("fence_waits_total"), fence_revocations=counter("fence_revocations_total"),
        hits_verified=counter("hits_verified_total"), hit_mismatches=counter("hit_mismatches_total"))
