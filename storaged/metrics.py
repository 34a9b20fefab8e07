"""StoragedMetrics: storaged's Prometheus metrics in a private registry, plus a plain snapshot.

Every name starts with `expertpack_storaged_` and carries its unit (`_bytes`, `_seconds`,
`_total` for counters). The registry is owned by the instance, never prometheus_client's global
one, so several daemons (or tests) in one process do not collide. `snapshot()` returns the same
figures as plain numbers for the Stats RPC, keyed without the prefix; labelled series are keyed
`name{label=value}`, histograms give `name_count` and `name_sum`.

Recording methods are thread-safe (prometheus_client metrics are), so read worker threads may
call observe_read while the event loop records hits.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

PREFIX = "expertpack_storaged_"
TIERS = ("vram", "host")
# Object reads: a 4 KiB hit in a fast NVMe queue (~100 us) up to a 100 MiB object on a slow disk.
READ_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
# Acquire: an all-hit round trip (tens of us) up to a layer of misses from disk.
ACQUIRE_SECONDS_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                           0.1, 0.25, 0.5, 1.0)


class UnknownTierError(ValueError):
    """A tier label other than those in TIERS."""


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint; close() stops it."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return host, port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class StoragedMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, p = self.registry, PREFIX
        self.hits = Counter(p + "hits_total", "Acquired experts found resident, by tier", ["tier"], registry=r)
        self.misses = Counter(p + "misses_total", "Acquired experts not resident, by tier", ["tier"],
                              registry=r)
        self.evictions = Counter(p + "evictions_total", "Experts evicted, by tier", ["tier"], registry=r)
        self.read_bytes = Counter(p + "read_bytes_total", "Bytes read from packs (padded objects)",
                                  registry=r)
        self.h2d_bytes = Counter(p + "h2d_bytes_total", "Bytes copied host to device", registry=r)
        self.read_seconds = Histogram(p + "read_seconds", "Latency of one object read from a pack",
                                      buckets=READ_SECONDS_BUCKETS, registry=r)
        self.acquire_seconds = Histogram(p + "acquire_seconds", "Latency of one Acquire, request to reply",
                                         buckets=ACQUIRE_SECONDS_BUCKETS, registry=r)
        self.resident_experts = Gauge(p + "resident_experts", "Experts resident, by tier", ["tier"],
                                      registry=r)
        self.resident_bytes = Gauge(p + "resident_bytes", "Bytes of resident experts, by tier", ["tier"],
                                    registry=r)
        self.io_errors = Counter(p + "io_errors_total", "Pack reads the OS failed", registry=r)
        self.checksum_failures = Counter(p + "checksum_failures_total", "Objects whose crc32 mismatched",
                                         registry=r)
        self.hits_verified = Counter(p + "hits_verified_total",
                                     "Acquire hits re-checked against their crc32 (verify_hits)", registry=r)
        self.hit_mismatches = Counter(p + "hit_mismatches_total",
                                      "Verified hits whose bytes mismatched (reloaded from the pack, not served)",
                                      registry=r)
        self.prefetch_issued = Counter(p + "prefetch_issued_total", "Prefetch loads started", registry=r)
        self.prefetch_used = Counter(p + "prefetch_used_total", "Prefetched experts later acquired",
                                     registry=r)
        self.prefetch_wasted = Counter(p + "prefetch_wasted_total",
                                       "Prefetched experts evicted without being acquired", registry=r)
        self.sessions = Gauge(p + "sessions", "Attached client sessions", registry=r)
        self.sessions_idle_closed = Counter(
            p + "sessions_idle_closed_total",
            "Sessions closed after session_idle_seconds without an Acquire stream or data plane connection",
            registry=r)
        self.sessions_refused = Counter(p + "sessions_refused_total",
                                        "Attach calls refused because the peer held max_sessions_per_peer sessions",
                                        registry=r)
        self.demotions = Counter(p + "demotions_total", "VRAM victims copied down to the host tier",
                                 registry=r)
        self.d2h_bytes = Counter(p + "d2h_bytes_total", "Bytes copied device to host (demotions)", registry=r)
        self.fence_waits = Counter(p + "fence_waits_total",
                                   "Slot reuses that waited for a session to finish a device step", registry=r)
        self.fence_wait_seconds = Counter(p + "fence_wait_seconds_total",
                                          "Seconds slot reuses waited for sessions' device steps", registry=r)
        self.fence_revocations = Counter(p + "fence_revocations_total",
                                         "Sessions whose step fence was revoked for staying mid-step too long",
                                         registry=r)
        self.dataplane_requests = Counter(p + "dataplane_requests_total", "Data plane requests, by kind",
                                          ["kind"], registry=r)
        for tier in TIERS:  # every labelled series exists from the start, at zero
            for metric in (self.hits, self.misses, self.evictions, self.resident_experts, self.resident_bytes):
                metric.labels(tier=tier)

    # ---- recording --------------------------------------------------------------------------------

    @staticmethod
    def _tier(tier: str) -> str:
        if tier not in TIERS:
            raise UnknownTierError(f"unknown tier {tier!r}; expected one of {TIERS}")
        return tier

    def record_hit(self, tier: str, count: int = 1) -> None:
        self.hits.labels(tier=self._tier(tier)).inc(count)

    def record_miss(self, tier: str, count: int = 1) -> None:
        self.misses.labels(tier=self._tier(tier)).inc(count)

    def record_eviction(self, tier: str, count: int = 1) -> None:
        self.evictions.labels(tier=self._tier(tier)).inc(count)

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self.read_bytes.inc(nbytes)
        self.read_seconds.observe(seconds)

    def record_h2d(self, nbytes: int) -> None:
        self.h2d_bytes.inc(nbytes)

    def observe_acquire(self, seconds: float) -> None:
        self.acquire_seconds.observe(seconds)

    def set_resident(self, tier: str, experts: int, nbytes: int) -> None:
        self.resident_experts.labels(tier=self._tier(tier)).set(experts)
        self.resident_bytes.labels(tier=tier).set(nbytes)

    def record_io_error(self) -> None:
        self.io_errors.inc()

    def record_checksum_failure(self) -> None:
        self.checksum_failures.inc()

    def record_hit_verified(self, *, mismatch: bool) -> None:
        self.hits_verified.inc()
        if mismatch:
            self.hit_mismatches.inc()

    def record_prefetch(self, *, issued: int = 0, used: int = 0, wasted: int = 0) -> None:
        self.prefetch_issued.inc(issued)
        self.prefetch_used.inc(used)
        self.prefetch_wasted.inc(wasted)

    def set_sessions(self, count: int) -> None:
        self.sessions.set(count)

    def record_demotion(self, nbytes: int) -> None:
        self.demotions.inc()
        self.d2h_bytes.inc(nbytes)

    def record_dataplane_request(self, kind: str) -> None:
        self.dataplane_requests.labels(kind=kind).inc()

    # ---- export -----------------------------------------------------------------------------------

    def snapshot(self) -> dict[str, float]:
        """Every series as a plain number, e.g. {'hits_total{tier=vram}': 3.0, 'read_seconds_count': 9.0}."""
        figures: dict[str, float] = {}
        for family in self.registry.collect():
            for sample in family.samples:
                if sample.name.endswith(("_created", "_bucket")):
                    continue  # creation timestamps and buckets are for Prometheus, not the Stats RPC
                key = sample.name.removeprefix(PREFIX)
                if sample.labels:
                    key += "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
                figures[key] = float(sample.value)
        return figures

    def exposition(self) -> bytes:
        """The text exposition format, as /metrics serves it."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on addr:port (port 0 picks a free one) from a daemon thread."""
        server, thread = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        return MetricsServer(server, thread)
