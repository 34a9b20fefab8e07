"""ops/grafana: the provisioning files and dashboards hang together (the live test in
test_live_dashboards.py checks that their queries return data)."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from ops_testkit import DASHBOARDS, GRAFANA

PANEL_TYPES = {"timeseries", "stat", "row"}
# Grafana's built-in variables the expressions may use; anything else must be a dashboard variable.
BUILTIN_VARIABLES = {"__rate_interval", "__interval", "__range"}


def dashboard_panels(dashboard: dict) -> list[dict]:
    return [p for p in dashboard["panels"] if p["type"] != "row"]


@pytest.fixture(params=DASHBOARDS, ids=lambda p: p.stem)
def dashboard(request) -> dict:
    return json.loads(request.param.read_text())


def test_both_dashboards_ship():
    assert {d.stem for d in DASHBOARDS} == {"storaged", "inference"}


def test_dashboard_structure(dashboard):
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    assert {"datasource", "instance"} <= variables
    for panel in dashboard["panels"]:
        assert panel["type"] in PANEL_TYPES, panel["title"]
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]) and panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24
    for panel in dashboard_panels(dashboard):
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        assert panel["description"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
        for target in panel["targets"]:
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= variables | BUILTIN_VARIABLES, (panel["title"], used)


def test_panels_overlap_nowhere(dashboard):
    cells = set()
    for panel in dashboard["panels"]:
        g = panel["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']!r} overlaps another panel"
        cells |= mine


def test_the_panels_the_issue_asks_for():
    titles = {p["title"] for d in DASHBOARDS for p in dashboard_panels(json.loads(d.read_text()))}
    assert {"Hit rate per tier", "SSD bytes per generated token", "Read bandwidth", "Acquire latency",
            "Resident experts", "Resident bytes", "Errors", "Tokens per second", "Time to first token"} <= titles


def test_provisioning_points_at_the_dashboards_and_datasource():
    datasources = yaml.safe_load((GRAFANA / "provisioning/datasources/expertpack.yml").read_text())
    (source,) = datasources["datasources"]
    assert source["type"] == "prometheus" and source["uid"] == "expertpack-prometheus"
    providers = yaml.safe_load((GRAFANA / "provisioning/dashboards/expertpack.yml").read_text())
    (provider,) = providers["providers"]
    assert provider["type"] == "file" and provider["options"]["path"].startswith("/")
    uids = {json.loads(d.read_text())["uid"] for d in DASHBOARDS}
    assert len(uids) == len(DASHBOARDS)
    for d in DASHBOARDS:  # the dashboards' datasource variable defaults to the provisioned one
        variable = next(v for v in json.loads(d.read_text())["templating"]["list"] if v["name"] == "datasource")
        assert variable["current"]["value"] == source["uid"]
