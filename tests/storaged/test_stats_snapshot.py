"""storaged's field table (storaged.stats_snapshot): its rules, the Stats reply it fills, and a
figure added to it in one place reaching /metrics, the Stats reply, the client and the ops lint."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from pathlib import Path

import pytest
from ops_testkit import exported_metric_names
from storaged_testkit import SLOT_BYTES, start_daemon

from storaged import stats_snapshot
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.client import StorageClient, replies
from storaged.metrics import StoragedMetrics
from storaged.server.stats import stats_reply, stats_response
from storaged.stats_snapshot import PREFIX, Histogram, Kind, StatField, StatFieldError, StatsSnapshot

DOCS = Path(__file__).resolve().parents[2] / "docs"
# Reply fields that are no figure: the tier list's names, and the map of every series.
_NOT_FIGURES = {"tiers", "figures", "tier"}


def _reply_names(fields, *, tier: bool) -> list[str]:
    names = []
    for f in fields:
        if (f.label == "tier") == tier:
            names += [n for n in (f.reply, f.reply_mean_us) if n is not None]
    return names


@pytest.mark.parametrize("message, tier", [(pb.StatsResponse, False), (pb.TierStats, True)])
def test_every_reply_field_is_filled_by_exactly_one_figure(message, tier):
    names = _reply_names(stats_snapshot.table(), tier=tier)
    assert len(names) == len(set(names)), f"a {message.__name__} field is filled twice: {names}"
    proto = {f.name for f in message.DESCRIPTOR.fields} - _NOT_FIGURES
    assert set(names) == proto


@pytest.mark.parametrize("entry, words", [
    (lambda: StatField("Hits_total", Kind.COUNTER, "experts", "x"), "lower-case"),
    (lambda: StatField("hits", Kind.COUNTER, "experts", "x"), "end in _total"),
    (lambda: StatField("hits_total", Kind.GAUGE, "experts", "x"), "end in _total"),
    (lambda: StatField("read_total", Kind.COUNTER, "bytes", "x"), "_bytes"),
    (lambda: StatField("wait", Kind.GAUGE, "seconds", "x"), "_seconds"),
    (lambda: StatField("read_seconds", Kind.HISTOGRAM, "seconds", "x"), "buckets"),
    (lambda: StatField("pins", Kind.GAUGE, "pins", "x", buckets=(1.0,)), "buckets"),
    (lambda: StatField("read_seconds", Kind.HISTOGRAM, "seconds", "x", buckets=(2.0, 1.0)), "increase"),
    (lambda: StatField("pins", Kind.GAUGE, "pins", "x", reply_mean_us="pins_us"), "mean"),
    (lambda: StatField("pins", Kind.GAUGE, "pins", "x", label_values=("a",)), "without a label"),
    (lambda: StatField("read_seconds", Kind.HISTOGRAM, "seconds", "x", label="tier", buckets=(1.0,)),
     "labelled histograms"),
])
def test_table_entries_that_break_the_rules_are_refused(entry, words):
    with pytest.raises(StatFieldError, match=words):
        entry()


def test_a_figure_named_twice_is_refused(monkeypatch):
    monkeypatch.setattr(stats_snapshot, "FIELDS", stats_snapshot.FIELDS + (stats_snapshot.FIELDS[0],))
    with pytest.raises(StatFieldError, match="hits_total"):
        StoragedMetrics()


def test_the_reply_round_trips_to_the_same_snapshot():
    metrics = StoragedMetrics()
    metrics.observe_acquire(2e-4)
    metrics.observe_acquire(4e-4)
    metrics.add("hits_total", 5, label="vram")
    metrics.set("capacity_slots", 10, label="vram")
    metrics.set("fence_wait_seconds_total", 0.25)
    metrics.record_dataplane_request("prefetch")
    metrics.set_tier_names(("vram",))
    sent = metrics.snapshot()
    reply = pb.StatsResponse.FromString(stats_reply(sent).SerializeToString())
    got = replies.stats(reply)
    assert got.series() == sent.series() and got.tier_names == ("vram",)
    assert (got.acquires, got.acquire_latency_mean_us) == (2, pytest.approx(300.0))
    assert (reply.acquires, reply.acquire_latency_mean_us) == (2, pytest.approx(300.0))
    assert got.tiers["vram"].hits == reply.tiers[0].hits == 5 and list(got.tiers) == ["vram"]
    assert got["fence_wait_seconds_total"] == 0.25 and got["dataplane_requests_total"] == {"prefetch": 1}
    assert got["acquire_seconds"] == Histogram(2, pytest.approx(6e-4))  # buckets stay on /metrics
    with pytest.raises(AttributeError, match="no_such_figure"):
        got.no_such_figure  # noqa: B018
    with pytest.raises(AttributeError, match="no figure 'hist'"):
        got.tiers["vram"].hist  # noqa: B018


def test_the_docs_name_every_figure():
    storaged_md = (DOCS / "storaged.md").read_text()
    documented = set(re.findall(r"`([a-z_0-9]+)(?:\{\w+\})?`", storaged_md))
    missing = [f.name for f in stats_snapshot.table() if f.name not in documented]
    assert not missing, f"docs/storaged.md does not name {missing}"


_WIDGETS = StatField("widgets_total", Kind.COUNTER, "widgets", "Widgets the daemon made")


def test_a_figure_added_to_the_table_reaches_metrics_the_reply_the_client_and_the_ops_lint(
        monkeypatch, runtime_of, bundle):
    name = PREFIX + _WIDGETS.name
    assert name not in exported_metric_names()
    monkeypatch.setattr(stats_snapshot, "FIELDS", stats_snapshot.FIELDS + (_WIDGETS,))  # the one place

    assert name in exported_metric_names()  # the list the rules and dashboards are checked against
    runtime, sessions, model, sync = runtime_of(bundle.path)
    runtime.metrics.add("widgets_total", 3)
    server = runtime.metrics.start_http_server(0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{server.address[1]}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.close()
    assert f"# TYPE {name} counter" in body and f"{name} 3.0" in body
    reply = stats_response(sync)  # what the servicer's Stats returns
    assert reply.figures["widgets_total"] == 3
    parsed = replies.stats(pb.StatsResponse.FromString(reply.SerializeToString()))
    assert parsed["widgets_total"] == 3


def test_the_reply_carries_the_daemons_figures(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path, vram_cache_bytes=4 * SLOT_BYTES)
    session = sessions.open(model)
    asyncio.run(runtime.engine.acquire(session, 1, (0, 1)))
    asyncio.run(runtime.engine.acquire(session, 1, (1, 2)))
    stats = replies.stats(stats_response(sync))
    vram = stats.tiers["vram"]
    assert (vram.hits, vram.misses, vram.capacity_slots, vram.resident_experts) == (1, 3, 4, 3)
    assert (stats.sessions, stats.pins, stats.acquires, stats.reads) == (1, 2, 2, 3) and stats.bytes_read > 0
    assert list(stats.tiers) == ["vram"]  # no host tier configured


def test_a_live_daemon_sends_every_figure(disk_dir, bundle):
    directory = disk_dir / "stats-snapshot"
    directory.mkdir()
    daemon = start_daemon(directory, {"tiny": bundle.path}, host_cache_bytes=4 * SLOT_BYTES)
    try:
        with StorageClient(str(daemon.socket)) as client:
            with client.attach("tiny") as session:
                session.acquire(1, [0, 1])
                stats = client.stats()
            info = client.info()
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    assert isinstance(stats, StatsSnapshot)
    assert set(stats.series()) >= set(StoragedMetrics().snapshot().series())
    assert list(stats.tiers) == ["vram", "host"]
    assert stats.tiers["vram"].capacity_slots == info.slot_count and stats.tiers["host"].capacity_slots == 4
    assert stats.tiers["vram"].misses == 2 and stats.acquires == 1
