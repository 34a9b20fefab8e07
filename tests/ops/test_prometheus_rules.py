"""ops/prometheus: promtool accepts the scrape config and the rules, every alert's unit tests
pass, each alert is really exercised by them, and every metric named exists in our code."""

from __future__ import annotations

import json
import re

import pytest
import yaml

from ops_testkit import (DASHBOARDS, PROMETHEUS, RULE_TESTS, RULES, exported_metric_names, require_binary,
                         run_tool)

_METRIC_NAME = re.compile(r"\bexpertpack_[a-z_]+\b")


def alert_rules() -> list[dict]:
    groups = yaml.safe_load(RULES.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"] if "alert" in rule]


def test_promtool_accepts_the_scrape_config_and_its_rules():
    result = run_tool(require_binary("promtool"), "check", "config", "prometheus.yml", cwd=PROMETHEUS)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 rule files found" in result.stdout


def test_promtool_accepts_the_rules():
    result = run_tool(require_binary("promtool"), "check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr


def test_alert_unit_tests_pass():
    result = run_tool(require_binary("promtool"), "test", "rules", *map(str, RULE_TESTS))
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_alerts_we_promise_exist():
    names = {rule["alert"] for rule in alert_rules()}
    assert {"StoragedDown", "StoragedIOErrors", "StoragedChecksumFailures", "StoragedLowHitRate",
            "StoragedAcquireLatencyHigh"} <= names


@pytest.mark.parametrize("alert", [rule["alert"] for rule in alert_rules()])
def test_every_alert_has_a_unit_test_that_sees_it_fire(tmp_path, alert):
    """Replace one alert's expression with one that never fires: some unit test must now fail."""
    require_binary("promtool")
    rules = yaml.safe_load(RULES.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = "vector(1) < 0"
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(json.dumps(rules))  # JSON is YAML
    (tmp_path / "tests").mkdir()
    for test in RULE_TESTS:
        (tmp_path / "tests" / test.name).write_text(test.read_text())
    result = run_tool("promtool", "test", "rules", *(str(tmp_path / "tests" / t.name) for t in RULE_TESTS))
    assert result.returncode != 0, f"no unit test expects {alert} to fire"
    assert f"alertname: {alert}" in result.stdout + result.stderr


def test_rules_and_dashboards_name_only_metrics_we_export():
    exported = exported_metric_names()
    texts = {RULES.name: RULES.read_text(), **{d.name: d.read_text() for d in DASHBOARDS}}
    for name, text in texts.items():
        used = set(_METRIC_NAME.findall(text))
        assert used, name
        assert used <= exported, f"{name} names metrics nobody exports: {sorted(used - exported)}"


def test_scrape_jobs_are_the_ones_the_rules_select():
    config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"expertpack-storaged", "expertpack-inference"}
    assert jobs["expertpack-storaged"]["static_configs"][0]["targets"] == ["127.0.0.1:9464"]
    assert jobs["expertpack-inference"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    selected = set(re.findall(r'job="([^"]+)"', RULES.read_text()))
    assert selected == set(jobs)
