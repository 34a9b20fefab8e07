"""bench/engine_bench.py on the CPU at tiny sizes: an in-process daemon answers Acquires from both
tiers and the phase split adds up to figures that are there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_engine_bench_measures_acquires_and_their_phases(tmp_path):
    out = tmp_path / "engine.json"
    done = subprocess.run([sys.executable, "bench/engine_bench.py", "--layers", "4", "--experts", "16", "--top-k", "4",
                           "--tokens", "3", "--repeats", "2", "--profile", "5", "--dir", str(tmp_path),
                           "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert results["acquire_us_best_round_mean"] > 0 and results["host_tier"]
    assert results["vram_slots"] == 32  # half of 4 x 16 experts
    phases = results["phase_us_mean"]
    assert set(phases) == {"plan", "unmap", "issue", "join"} and phases["plan"] > 0 and phases["issue"] > 0
    assert "function calls" in results["profile"]
    assert not list(tmp_path.glob("engine-bench-*"))  # the bundle is removed


@pytest.mark.parametrize(("flag", "value"), [("--top-k", "17"), ("--intermediate", "48"), ("--vram-share", "0")])
def test_engine_bench_refuses_bad_geometry(flag, value):
    done = subprocess.run([sys.executable, "bench/engine_bench.py", "--experts", "16", flag, value], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag in done.stderr
