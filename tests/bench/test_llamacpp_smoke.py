"""The llama.cpp contender end to end on the CPU at the tiny shape: bench.e2e.main runs llama-bench
(a CPU build: bench/llamacpp/build.sh --cpu) beside storaged on the same GGUF and reports its
figures, its own timings and the storaged ÷ llama.cpp ratios. Without a binary the test is skipped,
unless EXPERTPACK_REQUIRE_LLAMACPP=1, where a missing binary fails it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.llamacpp_command import REQUIRE_ENV, llama_bench_path, llamacpp_required  # noqa: E402
from bench.e2e.llamacpp_run import binary_problem  # noqa: E402

DISK_DIR = Path("/var/tmp")


@pytest.fixture
def binary() -> Path:
    path = llama_bench_path()
    problem = binary_problem(path, "cpu")
    if problem:
        if llamacpp_required():
            pytest.fail(f"{REQUIRE_ENV}=1 and {problem}")
        pytest.skip(problem)
    return path


@pytest.fixture
def disk_dir():
    path = Path(tempfile.mkdtemp(prefix="llamacpp-test-", dir=DISK_DIR if DISK_DIR.is_dir() else None))
    yield path
    import shutil
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow
def test_llamacpp_contender_runs_beside_storaged_on_cpu(binary, disk_dir):
    out = disk_dir / "out"
    env = {**os.environ, REQUIRE_ENV: "1"}
    done = subprocess.run(
        [sys.executable, "-m", "bench.e2e.main", "--device", "cpu", "--tiny", "--shapes", "qwen3", "--out", str(out),
         "--workdir", str(disk_dir / "work"), "--seconds", "200", "--tokens", "3", "--prompt-len", "8",
         "--budgets", "0.5", "1.0", "--contenders", "storaged", "llamacpp", "--torch-threads", "1",
         "--llamacpp-bin", str(binary)], cwd=REPO, env=env, capture_output=True, text=True, timeout=400)
    results = json.loads((out / "results.json").read_text())
    assert done.returncode == 0 and results["errors"] == [], done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["budget_fraction"]: r for r in results["e2e"]["runs"] if r["contender"] == "llamacpp"}
    assert sorted(runs) == [0.5, 1.0]
    for fraction, run in runs.items():
        assert "skipped" not in run and "error" not in run, run
        assert 0 < run["prefill_tok_s"] < 1e6 and 0 < run["decode_tok_s"] < 1e6
        assert run["tokens"] in (2, 3) and run["prompt_len"] == 8
        assert run["ssd_bytes_per_token"] is not None and run["ssd_bytes_per_token"] >= 0
        peer = run["llamacpp"]
        # two tiny MoE layers; at 50% one layer's experts fit the budget, the other's stay on the CPU
        assert (peer["n_cpu_moe"], peer["moe_layers_in_vram"]) == ((1, 1) if fraction == 0.5 else (0, 2))
        assert ("--n-cpu-moe" in peer["command"]) == (fraction == 0.5) and "-ngl" in peer["command"]
        assert peer["backends"] == "CPU" and peer["load_mode"] == "mmap"
        assert [t["test"] for t in peer["tests"]][:2] == ["pp8", "tg2"]
        for test in peer["tests"]:  # llama-bench's own timings, kept for a profiler
            assert test["avg_ns"] > 0 and test["samples_ns"] and test["ns_per_token"] > 0
        chosen = [t for t in peer["tests"] if t["n_gen"] == run["tokens"]][0]
        assert run["decode_tok_s"] == pytest.approx(chosen["avg_ts"])
        assert Path(peer["log"]).exists()
    markdown = (out / "results.md").read_text()
    section = markdown.split("### storaged ÷ llama.cpp")[1]
    assert section.count("| Qwen3-30B-A3B-like (tiny) |") == 2 and "×" in section
    assert any(s.startswith("llamacpp: ") and "cpu build" in s for s in results["statements"])


@pytest.mark.slow  # two bench.e2e.main runs in subprocesses: ~50 s
def test_missing_binary_is_reported_as_not_run_with_its_reason(disk_dir):
    """Never silently skipped: a stated reason, or an error when the binary is required."""
    for required, key in (("0", "skipped"), ("1", "error")):
        out = disk_dir / f"out-{required}"
        env = {**os.environ, REQUIRE_ENV: required}
        subprocess.run(
            [sys.executable, "-m", "bench.e2e.main", "--device", "cpu", "--tiny", "--shapes", "qwen3", "--out",
             str(out), "--workdir", str(disk_dir / "work"), "--seconds", "60", "--budgets", "1.0",
             "--contenders", "llamacpp", "--llamacpp-bin", str(disk_dir / "no-llama-bench")],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        runs = json.loads((out / "results.json").read_text())["e2e"]["runs"]
        assert len(runs) == 1 and "llama-bench not found at" in runs[0][key], runs
        assert f"{disk_dir / 'no-llama-bench'}" in runs[0][key]


@pytest.mark.parametrize("key", ["qwen3", "deepseek"])
def test_layer_expert_bytes_are_the_ggufs(disk_dir, key):
    """--n-cpu-moe divides the budget by one layer's routed experts as the GGUF stores them."""
    from gguf import GGUFReader

    from bench.e2e.prepare import prepare_model
    from bench.e2e.shapes import TINY_SHAPES

    shape = TINY_SHAPES[key]
    model = prepare_model(shape, 2 + shape.dense_layers, disk_dir, with_bf16_checkpoint=False)
    per_layer = {}
    for tensor in GGUFReader(model.gguf_path).tensors:
        if "_exps." in tensor.name:
            layer = int(tensor.name.split(".")[1])
            per_layer[layer] = per_layer.get(layer, 0) + int(tensor.n_bytes)
    assert sorted(per_layer) == list(range(shape.dense_layers, 2 + shape.dense_layers))
    assert set(per_layer.values()) == {shape.expert_bytes * shape.experts}
