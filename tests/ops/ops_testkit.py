"""Helpers for the ops tests: the shipped files, the Debian tools that check them, a live stack.

The tools come from Debian packages (systemd, prometheus) that ops/ci-deps.sh installs; a test
that needs one skips, naming the package, only when the binary is absent.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
OPS = REPO / "ops"
UNITS = OPS / "systemd"
PROMETHEUS = OPS / "prometheus"
RULES = PROMETHEUS / "rules" / "expertpack.rules.yml"
RULE_TESTS = sorted((PROMETHEUS / "tests").glob("*.yml"))
GRAFANA = OPS / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))

_PACKAGE_OF = {"systemd-analyze": "systemd", "systemd-sysusers": "systemd", "promtool": "prometheus",
               "prometheus": "prometheus", "setpriv": "util-linux"}


def require_binary(name: str) -> str:
    """The path of `name`, or skip the test saying which Debian package provides it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} is not installed (Debian package {_PACKAGE_OF.get(name, name)}; "
                    "ops/ci-deps.sh installs it)")
    return path


def run_tool(*command: str, cwd: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}


def exported_metric_names() -> set[str]:
    """Every series name storaged and inference export, from their real registries: the names the
    rules and dashboards may use (storaged's come from its field table, storaged.stats_snapshot)."""
    from inference.engine.metrics import EngineMetrics  # here: it imports torch, which most ops tests never need
    from storaged.metrics import StoragedMetrics

    names = set()
    for registry in (StoragedMetrics().registry, EngineMetrics().registry):
        for family in registry.collect():
            names.update(family.name + suffix for suffix in _SUFFIXES[family.type])
    return names


def unit_settings(path: Path) -> dict[str, dict[str, list[str]]]:
    """A unit file as {section: {key: [values in order]}} (keys may repeat, e.g. DeviceAllow)."""
    sections: dict[str, dict[str, list[str]]] = {}
    current = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            current = sections.setdefault(line.strip("[]"), {})
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"{path}: {line!r} before any section"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


# ---- a live stack: Prometheus, storaged and `inference serve` as real processes ------------------

STARTUP_SECONDS = 120  # importing torch and transformers on a loaded 2-core CI machine


def http_json(url: str, body: dict | None = None, timeout: float = 30) -> dict:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


class LoggedProcess:
    """A child process whose output goes to self.log; stop() terminates it, then kills it."""

    process: subprocess.Popen
    log: object
    stop_grace_seconds = 15.0

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()[-4000:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(self.stop_grace_seconds)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


class PrometheusServer(LoggedProcess):
    """Debian's prometheus on loopback with a config derived from ops/prometheus/prometheus.yml:
    the same jobs and rules, our targets, and a 1 s scrape and evaluation interval."""

    def __init__(self, directory: Path, targets: dict[str, str]):
        config = yaml.safe_load((PROMETHEUS / "prometheus.yml").read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES)]
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": [targets[job["job_name"]]]}]
        (directory / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(directory / "prometheus.log", "w+")
        self.process = subprocess.Popen(
            [require_binary("prometheus"), f"--config.file={directory / 'prometheus.yml'}",
             f"--storage.tsdb.path={directory / 'data'}", f"--web.listen-address=127.0.0.1:{self.port}",
             "--log.level=warn"], stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not become ready:\n{self.output()}")
            time.sleep(0.1)

    def query(self, expr: str) -> list[dict]:
        reply = http_json(f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}")
        assert reply["status"] == "success", reply
        return reply["data"]["result"]

    def wait_until(self, expr: str, timeout: float) -> None:
        """Until `expr` returns a non-empty result (e.g. 'up{job="x"} == 1')."""
        deadline = time.monotonic() + timeout
        while not self.query(expr):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{expr} still empty after {timeout}s:\n{self.output()}")
            time.sleep(0.2)

    def rules(self) -> list[dict]:
        groups = http_json(self.url + "/api/v1/rules")["data"]["groups"]
        return [rule for group in groups for rule in group["rules"]]



class InferenceServe(LoggedProcess):
    """`python -m inference serve --storaged SOCKET` on a fixed loopback port."""

    stop_grace_seconds = 30.0

    def __init__(self, bundle: Path, storaged_socket: Path, port: int, log: Path):
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(log, "w+")
        command = [sys.executable, "-m", "inference", "serve", "--bundle", str(bundle), "--port", str(port),
                   "--storaged", str(storaged_socket), "--dtype", "float32", "--torch-threads", "1",
                   "--model-name", "tiny"]
        self.process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                        stdout=self.log, stderr=subprocess.STDOUT)

    def wait_healthy(self, timeout: float = STARTUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while True:
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"inference serve did not become healthy:\n{self.output()}")
            time.sleep(0.2)

    def chat(self, text: str, max_tokens: int) -> dict:
        return http_json(self.url + "/v1/chat/completions", {
            "model": "tiny", "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0})

