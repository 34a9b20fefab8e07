"""`inference serve --storaged` as the benchmarks drive it: a subprocess on a free port, its output
in a log file, ready once /health answers 200."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from bench.common import BenchError, wait_or_kill

REPO = Path(__file__).resolve().parents[1]
READY_LINE = re.compile(r"serving '[^']*' on (http://\S+)")
SHUTDOWN_SECONDS = 5  # --shutdown-timeout: in-flight requests get this long after SIGTERM


class ServeProcess:
    """`python -m inference serve` of `bundle` with experts from storaged at `socket` (as
    `storaged_model`), `--port 0`; `url` is its address once /health answered 200.

    Raises BenchError when it exits, reports that the model failed to load, or is not healthy
    within `start_seconds`; the process is stopped then.
    """

    def __init__(self, bundle: Path, socket: str, *, storaged_model: str, device: str, dtype: str, max_num_seqs: int,
                 log_path: Path, extra_args: list[str] | tuple[str, ...] = (), start_seconds: float = 300.0):
        command = [sys.executable, "-m", "inference", "serve", "--bundle", str(bundle), "--storaged", socket,
                   "--storaged-model", storaged_model, "--port", "0", "--device", device, "--dtype", dtype,
                   "--max-num-seqs", str(max_num_seqs), "--shutdown-timeout", str(SHUTDOWN_SECONDS), *extra_args]
        env = {**os.environ, "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self.log_path = log_path
        self._terminated = False
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        started = time.monotonic()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        try:
            self.url = self._wait_until_healthy(started + start_seconds)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - started

    def log_tail(self, lines: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def _fail(self, why: str) -> BenchError:
        return BenchError(f"inference serve {why}; log {self.log_path}:\n{self.log_tail()}")

    def _wait_until_healthy(self, deadline: float) -> str:
        url = None
        while True:
            if self.process.poll() is not None:
                raise self._fail(f"exited with status {self.process.returncode}")
            if url is None:
                match = READY_LINE.search(self.log_path.read_text(errors="replace"))
                url = match.group(1) if match else None
            if url is not None:
                try:
                    with urllib.request.urlopen(url + "/health", timeout=5) as response:
                        if response.status == 200:
                            return url
                except urllib.error.HTTPError as exc:  # 503 while the model loads
                    reason = json.loads(exc.read() or b"{}").get("reason", "")
                    if reason.startswith("model failed to load"):
                        raise self._fail(reason) from None
                except OSError:
                    pass
            if time.monotonic() > deadline:
                raise self._fail("not healthy in time")
            time.sleep(0.2)

    def terminate(self) -> None:
        """SIGTERM, once (requests in flight get SHUTDOWN_SECONDS); returns at once."""
        if not self._terminated and self.process.poll() is None:
            self._terminated = True
            self.process.terminate()

    def stop(self) -> int:
        """SIGTERM, wait (SIGKILL after a minute); the exit status."""
        self.terminate()
        status = wait_or_kill(self.process)
        self._log.close()
        return status
