"""bench/concurrency.py end to end on the CPU at small scale: a real storaged daemon serving a tiny
bundle, `inference serve --storaged` in front of it, and the bench at 1 and 2 streams."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a directory of scripts, not an installed package

from bench.concurrency import parse_args, prompt_of  # noqa: E402
from packtools.build import build_bundle  # noqa: E402
from packtools.synth.hf import synth_hf  # noqa: E402
from storaged.client import StorageClient  # noqa: E402

STARTUP_SECONDS = 180  # importing torch and transformers on a loaded 2-core machine
MAX_TOKENS, ROUNDS = 6, 2


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(inference base URL, storaged socket, storaged pid) for a tiny float32 qwen3_moe bundle."""
    root = tmp_path_factory.mktemp("concurrency")
    synth_hf("qwen3_moe", root / "checkpoint", seed=0, dtype="float32")
    build_bundle(root / "checkpoint", root / "bundle", progress=False)
    socket_dir = Path(tempfile.mkdtemp(prefix="cb-", dir="/tmp"))  # short: sun_path limit
    socket = socket_dir / "s.sock"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    daemon = subprocess.Popen([sys.executable, "-m", "storaged", "--socket", str(socket), "--device", "cpu",
                               "--vram-cache-bytes", "64MiB", "--metrics-address", "off", "--no-direct-io",
                               "--model", f"tiny={root / 'bundle'}"], cwd=REPO, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    server = None
    try:
        with StorageClient(str(socket)) as client:
            client.wait_until_serving(60)
        server = subprocess.Popen([sys.executable, "-m", "inference", "serve", "--bundle", str(root / "bundle"),
                                   "--storaged", str(socket), "--storaged-model", "tiny", "--port", "0",
                                   "--dtype", "float32", "--torch-threads", "1", "--max-num-seqs", "4"],
                                  cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        found = threading.Event()
        address: list[str] = []
        lines: list[str] = []

        def read() -> None:
            for line in server.stdout:  # drained to the end so the server never blocks on a full pipe
                lines.append(line)
                match = re.search(r"serving '[^']*' on (http://\S+)", line)
                if match and not found.is_set():
                    address.append(match.group(1))
                    found.set()
        threading.Thread(target=read, daemon=True).start()
        assert found.wait(STARTUP_SECONDS), "".join(lines)
        deadline = time.monotonic() + STARTUP_SECONDS
        while not _healthy(address[0]):
            assert server.poll() is None and time.monotonic() < deadline, "".join(lines)
            time.sleep(0.2)
        yield address[0], str(socket), daemon.pid
    finally:
        for process in (server, daemon):
            if process is not None and process.poll() is None:
                process.terminate()
                process.wait(60)


@pytest.mark.slow  # a daemon, a server and the bench: ~40 s on a 2-core CPU
def test_the_bench_reports_each_level_against_a_live_server(served, tmp_path):
    url, socket, pid = served
    out = tmp_path / "concurrency.json"
    result = subprocess.run([sys.executable, str(REPO / "bench" / "concurrency.py"), "--url", url, "--storaged", socket,
                             "--storaged-pid", str(pid), "--streams", "1,2", "--max-tokens", str(MAX_TOKENS),
                             "--rounds", str(ROUNDS), "--prompt-tokens", "8", "--json", str(out)],
                            cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [level["streams"] for level in report["levels"]] == [1, 2]
    for level in report["levels"]:
        assert level["completion_tokens"] == level["streams"] * ROUNDS * MAX_TOKENS  # ignore_eos: all of them
        assert level["requests"] == level["streams"] * ROUNDS
        assert level["aggregate_tokens_per_second"] > 0
        assert level["acquires"] > 0 and level["pack_bytes_read"] >= 0 and level["ssd_bytes_per_token"] >= 0
        assert level["ttft_p50_seconds"] > 0 and level["inter_token_p50_seconds"] > 0
    assert report["levels"][0]["speedup_vs_first"] == 1.0
    assert "2 streams:" in result.stdout


def test_bad_arguments_are_refused():
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://h:1", "--streams", "0,2"])
    with pytest.raises(SystemExit):
        parse_args(["--url", "http://h:1", "--max-tokens", "0"])
    assert parse_args(["--url", "http://h:1"]).streams == (1, 2, 4, 8, 16)
    assert prompt_of(1, 8) != prompt_of(2, 8)
