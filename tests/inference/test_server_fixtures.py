"""A live `python -m inference serve` subprocess for the server tests, and raw HTTP helpers.

Imported by test_server*.py; the test at the bottom checks the launcher itself.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 120  # importing torch and transformers on a loaded 2-core CI machine
_LISTENING = re.compile(r"serving '([^']*)' on (http://\S+)")


class ServerProcess:
    """`python -m inference serve --bundle B --port 0 --local`, its address read from its first line."""

    def __init__(self, bundle: Path, *extra: str, model_name: str = "tiny-moe"):
        command = [sys.executable, "-m", "inference", "serve", "--bundle", str(bundle), "--port", "0", "--local",
                   "--dtype", "float32", "--torch-threads", "1", "--model-name", model_name, *extra]
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._address = threading.Event()
        self.base_url = ""
        threading.Thread(target=self._read_output, daemon=True).start()
        if not self._address.wait(STARTUP_SECONDS):
            self.kill()
            raise RuntimeError("server did not start:\n" + "".join(self.lines))
        self.wait_healthy()

    def _read_output(self) -> None:
        for line in self.process.stdout:  # drained to the end so the server never blocks on a full pipe
            self.lines.append(line)
            match = _LISTENING.search(line)
            if match and not self._address.is_set():
                self.base_url = match.group(2)
                self._address.set()

    def wait_healthy(self, timeout: float = STARTUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while get(self.base_url + "/health")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("server never became healthy:\n" + "".join(self.lines))
            time.sleep(0.1)

    def stop(self, signum: int = signal.SIGTERM, timeout: float = 60) -> int:
        self.process.send_signal(signum)
        return self.process.wait(timeout)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def request(method: str, url: str, body: bytes | None = None, timeout: float = 60) -> tuple[int, dict | str]:
    """(status, decoded JSON or text) of one HTTP request, error statuses included."""
    req = urllib.request.Request(url, data=body, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as response:
            status, raw = response.status, response.read()
            content_type = response.headers.get("Content-Type", "")
    except urllib.error.HTTPError as error:
        status, raw, content_type = error.code, error.read(), error.headers.get("Content-Type", "")
    except (ConnectionError, urllib.error.URLError):
        return 0, ""
    text = raw.decode()
    return status, json.loads(text) if content_type.startswith("application/json") else text


def get(url: str) -> tuple[int, dict | str]:
    return request("GET", url)


def post(url: str, body) -> tuple[int, dict | str]:
    return request("POST", url, body if isinstance(body, bytes) else json.dumps(body).encode())


def metric_values(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value}."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values
