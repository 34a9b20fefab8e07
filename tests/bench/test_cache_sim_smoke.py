"""bench/cache_sim.py: the real policy under batched uniform routing, both replacement rules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_sim(tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "sim.json"
    done = subprocess.run([sys.executable, "bench/cache_sim.py", "--layers", "6", "--experts", "32", "--top-k", "4",
                           "--prompt-tokens", "8", "--max-tokens", "6", "--rounds", "2", "--streams", "1", "8",
                           "--json", str(out), *extra], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "| layer share | 8 |" in done.stdout and "| lowest score | 8 |" in done.stdout
    return {(level["rule"], level["streams"]): level for level in json.loads(out.read_text())["levels"]}


def test_layer_shares_keep_hits_where_the_step_outgrows_the_arena(tmp_path):
    """8 streams x top-4 of 32 touch ~20 experts a layer, 120 a step, over 48 slots: the lowest
    score alone evicts the layer needed next (no decode hits); shares keep some."""
    levels = run_sim(tmp_path)
    assert levels[("lowest score", 8)]["decode_hit_rate"] < 0.02
    assert levels[("layer share", 8)]["decode_hit_rate"] > 0.1
    assert levels[("layer share", 8)]["pack_reads"] < levels[("lowest score", 8)]["pack_reads"]
    assert levels[("layer share", 1)]["bytes_per_token_vs_1"] == 1.0
    assert levels[("layer share", 8)]["bytes_per_token_vs_1"] < 1.0


def test_with_a_host_tier_the_demotions_complete_and_reads_fall(tmp_path):
    without = run_sim(tmp_path)
    with_host = run_sim(tmp_path, "--host-share", "1")
    assert with_host[("layer share", 8)]["pack_reads"] < without[("layer share", 8)]["pack_reads"]


@pytest.mark.parametrize(("flag", "value"), [("--top-k", "33"), ("--budget", "0"), ("--streams", "0")])
def test_cache_sim_refuses_bad_arguments(flag, value):
    done = subprocess.run([sys.executable, "bench/cache_sim.py", "--experts", "32", flag, value], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and flag in done.stderr
