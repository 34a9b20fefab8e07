"""Every Grafana panel's query returns data from a live stack: a real Prometheus (Debian's)
scraping a real storaged and a real `inference serve --storaged` while requests run.

The Prometheus config is the shipped one with our ports and a 1 s interval, and it loads the
shipped alert rules, so this also checks that the rules evaluate without errors against the
real series and that none fires on a healthy stack.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from ops_testkit import DASHBOARDS, InferenceServe, PrometheusServer, free_port, require_binary
from storaged_testkit import disk_tmp_root, start_daemon
from test_engine_fixtures import tiny_bundle

# Grafana fills these in; a window over the whole test keeps every rate defined at query time.
GRAFANA_VARIABLES = {"$__rate_interval": "2m", "$instance": ".+"}
REQUESTS = 6


def _panel_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, expression with Grafana's variables filled in) for every target."""
    queries = []
    for path in DASHBOARDS:
        for panel in json.loads(path.read_text())["panels"]:
            for target in panel.get("targets", ()):
                expr = target["expr"]
                for variable, value in GRAFANA_VARIABLES.items():
                    expr = expr.replace(variable, value)
                assert "$" not in expr, f"{path.name} {panel['title']!r}: unfilled variable in {expr}"
                queries.append((path.stem, panel["title"], expr))
    return queries


@pytest.fixture
def stack(tmp_path_factory):
    """storaged (CPU arena, VRAM and host tiers) + inference serve + Prometheus scraping both."""
    require_binary("prometheus")
    bundle = tiny_bundle(tmp_path_factory)  # the inference tests' tiny qwen3_moe bundle
    stride = json.loads((bundle / "manifest.json").read_text())["pack"]["object_stride"]
    work = tmp_path_factory.mktemp("live-ops")
    run_dir = tempfile.mkdtemp(prefix="ops-live-", dir=disk_tmp_root())  # short socket path
    storaged_metrics = f"127.0.0.1:{free_port()}"
    inference_port = free_port()
    prometheus = PrometheusServer(work, {"expertpack-storaged": storaged_metrics,
                                         "expertpack-inference": f"127.0.0.1:{inference_port}"})
    started = []
    try:
        started.append(prometheus)
        # The daemon's model name is the bundle directory's name: inference's default for --storaged.
        daemon = start_daemon(Path(run_dir), {bundle.name: bundle}, metrics_address=storaged_metrics,
                              vram_cache_bytes=16 * stride, host_cache_bytes=8 * stride, direct_io=False)
        started.append(daemon)
        server = InferenceServe(bundle, daemon.socket, inference_port, work / "inference.log")
        started.append(server)
        prometheus.wait_ready()
        server.wait_healthy()
        yield prometheus, server
    finally:
        for process in reversed(started):
            process.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


@pytest.mark.slow
def test_every_panel_query_returns_data(stack):
    prometheus, server = stack
    for job in ("expertpack-storaged", "expertpack-inference"):
        prometheus.wait_until(f'up{{job="{job}"}} == 1', timeout=30)
    for i in range(REQUESTS):
        reply = server.chat(f"hello number {i}", max_tokens=12)
        assert reply["usage"]["completion_tokens"] == 12, reply
    # the counters after the last request must be scraped (1 s interval) before we look
    prometheus.wait_until(f"expertpack_inference_generated_tokens_total >= {12 * REQUESTS}", timeout=15)
    time.sleep(1.5)

    empty, not_finite = [], []
    for dashboard, title, expr in _panel_queries():
        result = prometheus.query(expr)
        values = [float(series["value"][1]) for series in result]
        if not values:
            empty.append(f"{dashboard}: {title}: {expr}")
        elif not any(math.isfinite(v) for v in values):
            not_finite.append(f"{dashboard}: {title}: {values} from {expr}")
    assert not empty, "panels without data:\n" + "\n".join(empty)
    assert not not_finite, "panels with only NaN/Inf:\n" + "\n".join(not_finite)

    # the headline figures moved: experts were read from the pack and tokens were generated
    assert prometheus.query("sum(rate(expertpack_storaged_read_bytes_total[2m])) > 0")
    assert prometheus.query("sum(rate(expertpack_inference_generated_tokens_total[2m])) > 0")
    assert prometheus.query('expertpack_storaged_resident_experts{tier="vram"} > 0')

    rules = prometheus.rules()
    assert {rule["name"] for rule in rules} >= {"StoragedDown", "StoragedLowHitRate"}
    broken = [(rule["name"], rule.get("lastError")) for rule in rules if rule["health"] != "ok"]
    assert not broken, f"rules failing to evaluate: {broken}"
    firing = [rule["name"] for rule in rules if rule.get("state") == "firing"]
    assert not firing, f"alerts firing on a healthy stack: {firing}"
