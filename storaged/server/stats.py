"""The policy's and the engine's figures copied into StoragedMetrics, and the Stats reply.

The planner counts hits, misses, evictions and prefetch outcomes itself, and only its event-loop
thread may read them; `MetricsSync.sync()`, which the daemon runs on that loop every second and
before each Stats reply, copies them (and the fences', sessions' and engine's figures) into
StoragedMetrics, which the /metrics thread reads. Read bytes, read latency, I/O errors and
checksum failures are recorded by the read workers directly; H2D bytes, Acquire latency and
refusals by the engine.

`stats_reply` is the second rendering of a StatsSnapshot (storaged.metrics renders the first,
/metrics): the reply fields the field table names, and every series in `figures`.
"""

from __future__ import annotations

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.metrics import StoragedMetrics
from storaged.policy import PolicyStats
from storaged.server.engine import StorageEngine
from storaged.server.sessions import SessionRegistry
from storaged.stats_snapshot import StatsSnapshot

SYNC_INTERVAL_SECONDS = 1.0


class MetricsSync:
    def __init__(self, engine: StorageEngine, sessions: SessionRegistry):
        self.engine = engine
        self.sessions = sessions

    @property
    def metrics(self) -> StoragedMetrics:
        return self.engine.metrics

    def sync(self) -> PolicyStats:
        stats = self.engine.planner.stats()
        planner, fences, metrics = self.engine.planner, self.engine.fences, self.metrics
        tiers = {"vram": (stats.vram_hits, stats.vram_misses, stats.vram_evictions, stats.vram_coalesced,
                          stats.vram_resident_entries, stats.vram_resident_bytes, planner.vram.slot_count),
                 "host": (stats.host_hits, stats.host_misses, stats.host_evictions, 0,
                          stats.host_resident_entries, stats.host_resident_bytes,
                          planner.host.slot_count if planner.host is not None else 0)}
        for tier, figures in tiers.items():
            for name, value in zip(("hits_total", "misses_total", "evictions_total", "coalesced_total",
                                    "resident_experts", "resident_bytes", "capacity_slots"), figures):
                metrics.set(name, value, label=tier)
        metrics.set_tier_names(("vram",) if planner.host is None else ("vram", "host"))
        for name, value in (("prefetch_issued_total", stats.prefetch_issued),
                            ("prefetch_used_total", stats.prefetch_used),
                            ("prefetch_wasted_total", stats.prefetch_wasted),
                            ("pins", stats.pins_outstanding), ("sessions", len(self.sessions)),
                            ("loads_in_flight", self.engine.loads_in_flight),
                            ("fence_waits_total", fences.waits), ("fence_wait_seconds_total", fences.wait_seconds),
                            ("fence_revocations_total", fences.revocations)):
            metrics.set(name, value)
        return stats


def stats_reply(snapshot: StatsSnapshot) -> pb.StatsResponse:
    """The Stats reply of `snapshot`: a reply field the table names but the proto lacks is a
    ValueError from protobuf, which tests/storaged/test_stats_snapshot.py guards against."""
    tiers = [pb.TierStats(tier=tier, **snapshot.tier_fields(tier)) for tier in snapshot.tier_names]
    return pb.StatsResponse(tiers=tiers, figures=snapshot.series(), **snapshot.reply_fields())


def stats_response(sync: MetricsSync) -> pb.StatsResponse:
    sync.sync()
    return stats_reply(sync.metrics.snapshot())
