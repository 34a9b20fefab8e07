"""StoragedMetrics: names, private registry, snapshot figures, the HTTP endpoint."""

from __future__ import annotations

import urllib.request

import prometheus_client
import pytest

from storaged.metrics import (ACQUIRE_SECONDS_BUCKETS, PREFIX, READ_SECONDS_BUCKETS, StoragedMetrics,
                              UnknownTierError)

EXPECTED_FAMILIES = {
    "hits_total", "misses_total", "evictions_total", "read_bytes_total", "h2d_bytes_total", "read_seconds",
    "acquire_seconds", "resident_experts", "resident_bytes", "io_errors_total", "checksum_failures_total",
    "prefetch_issued_total", "prefetch_used_total", "prefetch_wasted_total", "sessions", "demotions_total",
    "d2h_bytes_total", "fence_waits_total", "fence_wait_seconds_total", "fence_revocations_total",
    "dataplane_requests_total", "hits_verified_total", "hit_mismatches_total",
    "sessions_idle_closed_total", "sessions_refused_total",
}


def test_metric_names_are_prefixed_and_complete():
    metrics = StoragedMetrics()
    exposed = prometheus_client.generate_latest(metrics.registry).decode()
    types = {line.split()[2]: line.split()[3] for line in exposed.splitlines() if line.startswith("# TYPE")}
    assert all(name.startswith(PREFIX) for name in types)
    assert {name.removeprefix(PREFIX) for name in types if not name.endswith("_created")} == EXPECTED_FAMILIES
    assert all(types[PREFIX + name] == "counter" for name in EXPECTED_FAMILIES if name.endswith("_total"))
    assert types[PREFIX + "read_seconds"] == "histogram" and types[PREFIX + "sessions"] == "gauge"
    for tier in ("vram", "host"):  # labelled series exist before anything happens
        assert f'{PREFIX}hits_total{{tier="{tier}"}} 0.0' in exposed


def test_buckets_cover_the_latency_ranges():
    assert READ_SECONDS_BUCKETS[0] == 1e-4 and READ_SECONDS_BUCKETS[-1] == 1.0
    assert ACQUIRE_SECONDS_BUCKETS[0] == 2e-5 and ACQUIRE_SECONDS_BUCKETS[-1] == 1.0
    assert list(READ_SECONDS_BUCKETS) == sorted(READ_SECONDS_BUCKETS)


def test_snapshot_reports_what_was_recorded():
    metrics = StoragedMetrics()
    metrics.record_hit("vram", 3)
    metrics.record_hit("host")
    metrics.record_miss("vram", 2)
    metrics.record_eviction("host", 4)
    metrics.observe_read(8192, 0.002)
    metrics.observe_read(4096, 0.001)
    metrics.record_h2d(12288)
    metrics.observe_acquire(5e-5)
    metrics.set_resident("vram", 7, 7 * 8192)
    metrics.record_io_error()
    metrics.record_checksum_failure()
    metrics.record_prefetch(issued=5, used=3, wasted=1)
    metrics.set_sessions(2)
    metrics.record_hit_verified(mismatch=False)
    metrics.record_hit_verified(mismatch=True)
    figures = metrics.snapshot()
    expected = {
        "hits_total{tier=vram}": 3, "hits_total{tier=host}": 1, "misses_total{tier=vram}": 2,
        "misses_total{tier=host}": 0, "evictions_total{tier=host}": 4, "read_bytes_total": 12288,
        "read_seconds_count": 2, "h2d_bytes_total": 12288, "acquire_seconds_count": 1,
        "resident_experts{tier=vram}": 7, "resident_bytes{tier=vram}": 57344, "resident_bytes{tier=host}": 0,
        "io_errors_total": 1, "checksum_failures_total": 1, "prefetch_issued_total": 5,
        "prefetch_used_total": 3, "prefetch_wasted_total": 1, "sessions": 2,
        "hits_verified_total": 2, "hit_mismatches_total": 1,
    }
    assert {k: figures[k] for k in expected} == expected
    assert figures["read_seconds_sum"] == pytest.approx(0.003)
    assert all(isinstance(v, float) for v in figures.values())
    assert not any(k.endswith(("_created", "_bucket")) for k in figures)


@pytest.mark.parametrize("call", [
    lambda m: m.record_hit("disk"), lambda m: m.record_miss("VRAM"), lambda m: m.record_eviction(""),
    lambda m: m.set_resident("gpu", 1, 1),
])
def test_unknown_tiers_are_refused(call):
    with pytest.raises(UnknownTierError):
        call(StoragedMetrics())


def test_instances_do_not_share_a_registry():
    first, second = StoragedMetrics(), StoragedMetrics()
    first.record_hit("vram")
    assert second.snapshot()["hits_total{tier=vram}"] == 0
    assert prometheus_client.REGISTRY.get_sample_value(PREFIX + "hits_total", {"tier": "vram"}) is None


def test_http_endpoint_serves_on_loopback():
    metrics = StoragedMetrics()
    metrics.observe_read(4096, 0.0003)
    server = metrics.start_http_server(0)
    try:
        host, port = server.address
        assert host == "127.0.0.1" and port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
        assert f"{PREFIX}read_bytes_total 4096.0" in body
        assert f'{PREFIX}read_seconds_bucket{{le="0.0005"}} 1.0' in body
    finally:
        server.close()
