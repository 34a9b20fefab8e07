"""scripts/demo.sh, the README's main job, run with this interpreter (no bootstrap; GPU if any).

Checks that it prints the answer and the cache and inference figures, and that storaged and
inference are gone afterwards: when it succeeds, and when it is stopped with SIGTERM mid-way.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO_SECONDS = 300  # the README promises under 5 minutes on 2 cores, set-up included
pytestmark = pytest.mark.slow


def demo_env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "EXPERTPACK_SKIP_BOOTSTRAP": "1", "PYTHON": sys.executable, "DEMO_DIR": str(tmp_path / "demo")}


def pids_and_run_dir(output: str) -> tuple[list[int], Path]:
    pids = [int(pid) for pid in re.findall(r"^(?:storaged|inference) pid (\d+)$", output, re.MULTILINE)]
    socket = re.search(r"storaged on (\S+)/storaged\.sock", output)
    assert socket, output
    return pids, Path(socket.group(1))


def assert_nothing_left(pids: list[int], run_dir: Path) -> None:
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists(), f"process {pid} outlived the demo"
    assert not run_dir.exists()


def figure(name: str, output: str) -> int:
    match = re.search(rf"\b{name}=(\d+)", output)
    assert match, f"{name} not printed:\n{output}"
    return int(match.group(1))


def test_demo_answers_prints_the_figures_and_stops_everything(tmp_path):
    result = subprocess.run(["bash", "scripts/demo.sh"], cwd=REPO, env=demo_env(tmp_path), capture_output=True,
                            text=True, timeout=DEMO_SECONDS, stdin=subprocess.DEVNULL)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert re.search(r"^answer: (['\"]).+\1$", output, re.MULTILINE), output  # repr of a non-empty answer
    assert "completion_tokens=48 finish_reason=length" in output
    vram = re.search(r"vram\s+tier: hits=(\d+) misses=(\d+) evictions=\d+ resident_experts=(\d+)", output)
    assert vram, output
    hits, misses, resident = map(int, vram.groups())
    # every expert of the 2 x 8 read once from the pack, then kept: some by a demand miss, the
    # others ahead of demand by the lookahead's prefetch hints
    assert resident == 16 and 0 < misses <= 16
    assert hits > 0
    assert figure("bytes_read", output) == 16 * 110592  # 16 objects of 108 KiB, none read twice
    assert re.search(rf'expertpack_storaged_misses_total\{{tier="vram"\}} {misses}$', output, re.MULTILINE), output
    assert re.search(r"ttft=\d+\.\d+s \(mean of 1 request\(s\)\)", output), output
    assert figure("generated_tokens", output) == 48
    pids, run_dir = pids_and_run_dir(output)
    assert len(pids) == 2
    assert_nothing_left(pids, run_dir)


def test_demo_stopped_mid_way_stops_storaged_and_inference(tmp_path):
    demo = subprocess.Popen(["bash", "scripts/demo.sh"], cwd=REPO, env=demo_env(tmp_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
    lines = []
    try:
        for line in demo.stdout:
            lines.append(line)
            if line.startswith("inference pid "):  # both started; inference is still loading
                demo.send_signal(signal.SIGTERM)
                break
        lines.extend(demo.stdout)
        assert demo.wait(60) == 128 + signal.SIGTERM
    finally:
        if demo.poll() is None:
            demo.kill()
    output = "".join(lines)
    assert "demo: FAILED (status 143)" in output
    pids, run_dir = pids_and_run_dir(output)
    assert len(pids) == 2, output
    assert_nothing_left(pids, run_dir)
