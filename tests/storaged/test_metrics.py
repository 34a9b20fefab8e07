"""StoragedMetrics: names, private registry, snapshot figures, the HTTP endpoint (the field table
itself and the Stats reply: test_stats_snapshot.py)."""

from __future__ import annotations

import urllib.request

import prometheus_client
import pytest

from storaged.metrics import (ACQUIRE_SECONDS_BUCKETS, PREFIX, READ_SECONDS_BUCKETS, StoragedMetrics,
                              UnknownFigureError, UnknownLabelError, WrongKindError)

EXPECTED_FAMILIES = {
    "hits_total", "misses_total", "evictions_total", "read_bytes_total", "h2d_bytes_total", "read_seconds",
    "acquire_seconds", "acquire_phase_seconds_total", "resident_experts", "resident_bytes", "io_errors_total", "checksum_failures_total",
    "prefetch_issued_total", "prefetch_used_total", "prefetch_wasted_total", "preload_loads_total", "preloading", "sessions", "demotions_total",
    "d2h_bytes_total", "fence_waits_total", "fence_wait_seconds_total", "fence_revocations_total",
    "dataplane_requests_total", "hits_verified_total", "hit_mismatches_total",
    "sessions_idle_closed_total", "sessions_refused_total",
    "coalesced_total", "capacity_slots", "pins", "capacity_exhausted_total", "loads_in_flight",
}


def test_metric_names_are_prefixed_and_complete():
    metrics = StoragedMetrics()
    exposed = prometheus_client.generate_latest(metrics.registry).decode()
    types = {line.split()[2]: line.split()[3] for line in exposed.splitlines() if line.startswith("# TYPE")}
    assert all(name.startswith(PREFIX) for name in types)
    assert {name.removeprefix(PREFIX) for name in types} == EXPECTED_FAMILIES
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
    metrics.add("hits_total", 3, label="vram")
    metrics.add("hits_total", label="host")
    metrics.set("misses_total", 2, label="vram")
    metrics.add("evictions_total", 4, label="host")
    metrics.observe_read(8192, 0.002)
    metrics.observe_read(4096, 0.001)
    metrics.record_h2d(12288)
    metrics.observe_acquire(5e-5)
    metrics.set("resident_experts", 7, label="vram")
    metrics.set("resident_bytes", 7 * 8192, label="vram")
    metrics.record_io_error()
    metrics.record_checksum_failure()
    metrics.set("prefetch_issued_total", 5)
    metrics.set("sessions", 2)
    metrics.record_hit_verified(mismatch=False)
    metrics.record_hit_verified(mismatch=True)
    metrics.record_dataplane_request("acquire")
    figures = metrics.snapshot().series()
    expected = {
        "hits_total{tier=vram}": 3, "hits_total{tier=host}": 1, "misses_total{tier=vram}": 2,
        "misses_total{tier=host}": 0, "evictions_total{tier=host}": 4, "read_bytes_total": 12288,
        "read_seconds_count": 2, "h2d_bytes_total": 12288, "acquire_seconds_count": 1,
        "resident_experts{tier=vram}": 7, "resident_bytes{tier=vram}": 57344, "resident_bytes{tier=host}": 0,
        "io_errors_total": 1, "checksum_failures_total": 1, "prefetch_issued_total": 5,
        "prefetch_used_total": 0, "sessions": 2, "hits_verified_total": 2, "hit_mismatches_total": 1,
        "dataplane_requests_total{kind=acquire}": 1,
    }
    assert {k: figures[k] for k in expected} == expected
    assert figures["read_seconds_sum"] == pytest.approx(0.003)
    assert all(isinstance(v, float) for v in figures.values())
    assert not any(k.endswith(("_created", "_bucket")) for k in figures)


def test_histogram_buckets_are_cumulative_and_inclusive():
    metrics = StoragedMetrics()
    for seconds in (1e-4, 1e-4, 3e-4, 2.0):  # on a bound counts in that bucket; 2 s only in +Inf
        metrics.observe("read_seconds", seconds)
    histogram = metrics.snapshot()["read_seconds"]
    buckets = dict(histogram.buckets)
    assert (buckets[1e-4], buckets[2.5e-4], buckets[5e-4], buckets[1.0], buckets[float("inf")]) == (2, 2, 3, 3, 4)
    assert histogram.count == 4 and histogram.sum == pytest.approx(2.0005)


@pytest.mark.parametrize("call, error", [
    (lambda m: m.add("hits_total", label="disk"), UnknownLabelError),
    (lambda m: m.add("misses_total", label="VRAM"), UnknownLabelError),
    (lambda m: m.add("evictions_total", label=""), UnknownLabelError),
    (lambda m: m.set("resident_experts", 1, label="gpu"), UnknownLabelError),
    (lambda m: m.add("hits_total"), UnknownLabelError),  # a labelled figure without its label
    (lambda m: m.add("io_errors_total", label="vram"), UnknownLabelError),
    (lambda m: m.set_tier_names(("vram", "disk")), UnknownLabelError),
    (lambda m: m.add("no_such_total"), UnknownFigureError),
    (lambda m: m.observe("no_such_seconds", 1.0), UnknownFigureError),
    (lambda m: m.add("sessions"), WrongKindError),  # a gauge
    (lambda m: m.set("read_seconds", 1.0), WrongKindError),  # a histogram
    (lambda m: m.observe("read_bytes_total", 1.0), WrongKindError),
    (lambda m: m.add("io_errors_total", -1), ValueError),  # counters only go up
    (lambda m: (m.set("prefetch_used_total", 5), m.set("prefetch_used_total", 4)), ValueError),
])
def test_bad_recordings_are_refused(call, error):
    metrics = StoragedMetrics()
    with pytest.raises(error):
        call(metrics)


def test_a_refused_recording_changes_nothing():
    metrics = StoragedMetrics()
    metrics.set("prefetch_used_total", 5)
    before = metrics.snapshot().series()
    for call in (lambda: metrics.set("prefetch_used_total", 4), lambda: metrics.add("hits_total", label="disk"),
                 lambda: metrics.add("io_errors_total", -1)):
        with pytest.raises(ValueError):
            call()
    assert metrics.snapshot().series() == before


def test_instances_do_not_share_a_registry():
    first, second = StoragedMetrics(), StoragedMetrics()
    first.add("hits_total", label="vram")
    assert first.snapshot()["hits_total"]["vram"] == 1 and second.snapshot()["hits_total"]["vram"] == 0
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
