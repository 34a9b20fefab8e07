"""bench/e2e end to end on the CPU at tiny sizes: every contender of the matrix runs (or says why
it is skipped) and results.json / results.md are written; plus the naive GGUF loader against the
pack, the layer planner and the run_all.sh syntax."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.contenders import CONTENDERS  # noqa: E402
from bench.e2e.prepare import prepare_model  # noqa: E402
from bench.e2e.shapes import FULL_SHAPES, TINY_SHAPES, ShapeError, plan_layers  # noqa: E402

DISK_DIR = Path("/var/tmp")


@pytest.fixture
def disk_dir(tmp_path_factory):
    import tempfile
    path = Path(tempfile.mkdtemp(prefix="e2e-test-", dir=DISK_DIR if DISK_DIR.is_dir() else None))
    yield path
    import shutil
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.slow  # the whole tiny matrix in a subprocess: minutes on a 2-core CPU
def test_matrix_runs_every_contender_on_cpu(disk_dir):
    out = disk_dir / "out"
    done = subprocess.run(
        [sys.executable, "-m", "bench.e2e.main", "--device", "cpu", "--tiny", "--out", str(out), "--workdir",
         str(disk_dir / "work"), "--seconds", "360", "--tokens", "3", "--prompt-len", "8", "--budgets", "0.25", "1.0",
         "--torch-threads", "1"], cwd=REPO, capture_output=True, text=True, timeout=540)
    results = json.loads((out / "results.json").read_text())
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert results["errors"] == []
    runs = results["e2e"]["runs"]
    assert {(r["shape"], r["contender"]) for r in runs} == {(s.name, c) for s in TINY_SHAPES.values()
                                                             for c in CONTENDERS}
    for run in runs:
        if "skipped" in run:  # only a stated reason is acceptable, never a missing figure
            assert run["skipped"], run
            continue
        assert 0 < run["prefill_tok_s"] < 1e6 and 0 < run["decode_tok_s"] < 1e6, run
        assert 2 <= run["tokens"] <= 3
        if run["contender"] == "llamacpp":  # llama-bench feeds random tokens and returns none
            assert run["llamacpp"]["tests"], run
        else:
            assert len(run["token_ids"]) == run["tokens"] + 1
        assert run["ssd_bytes_per_token"] is None or run["ssd_bytes_per_token"] >= 0
        if run["contender"].startswith("storaged"):
            assert 0 <= run["from_memory"] <= 1 and run["decode_routed"] > 0
    by_key = {(r["shape"], r["contender"], r["budget_fraction"]): r for r in runs if "token_ids" in r}
    for shape in TINY_SHAPES.values():  # same weights, same greedy tokens (float32 on CPU)
        reference = by_key[(shape.name, "gguf_mmap", 1.0)]["token_ids"]
        for contender in ("storaged", "storaged_preload", "storaged_no_lookahead", "storaged_copy_up", "storaged_io4",
                          "storaged_serial", "resident"):
            got = by_key[(shape.name, contender, 1.0)]["token_ids"]
            common = min(len(got), len(reference))  # a run may stop a token early at its deadline
            assert got[:common] == reference[:common], contender
        # 25%: 4 slots, a layer's 8 experts in groups
        for contender in ("storaged", "storaged_preload", "storaged_copy_up", "storaged_io4", "storaged_serial"):
            run = by_key[(shape.name, contender, 0.25)]
            assert any("once it had ended" in note for note in run["notes"]) == (contender == "storaged_preload")
            assert not any("arena raised" in note for note in run["notes"]), run["notes"]
            common = min(len(run["token_ids"]), len(reference))
            assert run["token_ids"][:common] == reference[:common], contender
    assert [r for r in runs if r["contender"] == "resident" and r["budget_fraction"] == 1.0][0].get("tokens")
    markdown = (out / "results.md").read_text()
    matrix, ratios = markdown.split("## Decode speed ratios")
    assert "| shape | contender |" in matrix and matrix.count("| Qwen3-30B-A3B-like (tiny) |") == 21
    for run in (r for r in runs if r["contender"] == "storaged_preload_cpu"):  # CPU experts need CUDA
        assert "no CUDA here" in run["skipped"], run
    # storaged over each baseline at both budgets; accelerate and resident figures where they ran; the
    # storaged ÷ llama.cpp table where llama.cpp ran (a CPU build of it is present)
    llamacpp_ran = [r for r in runs if r["contender"] == "llamacpp" and "decode_tok_s" in r
                    and r["shape"] == "Qwen3-30B-A3B-like (tiny)"]
    # storaged, storaged_preload and storaged_io4 in each ratio table; + the lookahead table:
    # storaged with hints against storaged without, at both budgets
    assert ratios.count("| Qwen3-30B-A3B-like (tiny) |") == 6 + 3 * len(llamacpp_ran) + 2 and "×" in ratios
    assert "### Lookahead hints" in ratios
    assert any("host RAM" in s for s in results["statements"])


def test_gguf_mmap_source_returns_the_pack_objects(disk_dir):
    import torch

    from bench.e2e.gguf_mmap_source import GGUFMmapSource
    from inference.experts import LocalPackSource
    from packformat.bundle import open_bundle

    model = prepare_model(TINY_SHAPES["deepseek"], 3, disk_dir, with_bf16_checkpoint=False)
    with open_bundle(model.bundle_dir) as bundle:
        naive, local = GGUFMmapSource(model.gguf_path, bundle, "cpu"), LocalPackSource(bundle, "cpu")
        for layer in bundle.pack.layers:
            assert naive.layout(layer) == local.layout(layer)
            for got, want in zip(naive.acquire(layer, [7, 0, 3]), local.acquire(layer, [7, 0, 3]), strict=True):
                size = bundle.pack.entry(layer, 0).size
                assert torch.equal(got[:size], want[:size])
        naive.close()


@pytest.mark.parametrize(("key", "free_gb", "seconds", "bf16", "layers", "reason"), [
    ("qwen3", 60, 100, True, 25, "free disk"),  # 1.89 GB a layer with its bf16 copy
    ("qwen3", 60, 20, True, 5, "preparation time"),
    ("qwen3", 60, 1000, False, 48, "the layer cap"),
    ("qwen3", 10, 1000, False, 11, "free disk"),
    ("deepseek", 60, 30, False, 3, "preparation time"),  # 6.85 GB a MoE layer, plus the dense first layer
])
def test_plan_layers(key, free_gb, seconds, bf16, layers, reason):
    plan = plan_layers(FULL_SHAPES[key], free_bytes=int(free_gb * 1e9), seconds=seconds, write_bytes_per_s=0.5e9,
                       with_bf16_checkpoint=bf16, max_layers=48)
    assert (plan.layers, plan.reason) == (layers, reason)


def test_plan_layers_refuses_when_nothing_fits():
    with pytest.raises(ShapeError, match="DeepSeek-V4-Flash-like"):
        plan_layers(FULL_SHAPES["deepseek"], free_bytes=10**9, seconds=100, write_bytes_per_s=0.5e9,
                    with_bf16_checkpoint=True, max_layers=48)


def test_run_all_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(REPO / "bench" / "run_all.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_snapshot_holds_the_committed_tree_and_names_its_commit(tmp_path):
    dest = tmp_path / "snap"
    done = subprocess.run(["bash", str(REPO / "bench" / "snapshot.sh"), str(dest)], cwd=REPO, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert (dest / "COMMIT").read_text().strip() == head
    tracked = subprocess.run(["git", "ls-files", "bench"], cwd=REPO, capture_output=True, text=True).stdout.split()
    assert tracked and all((dest / path).exists() for path in tracked)
    assert not (dest / ".git").exists()


@pytest.mark.slow  # runs the matrix until a contender's figures are written
def test_sigterm_mid_matrix_keeps_what_was_measured(disk_dir):
    """run_all.sh's timeout sends SIGTERM: the runs finished so far are written, the rest are stated
    as not run, and no further contender starts."""
    import signal
    import time

    out = disk_dir / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "bench.e2e.main", "--device", "cpu", "--tiny", "--out", str(out), "--workdir",
         str(disk_dir / "work"), "--seconds", "400", "--tokens", "2", "--prompt-len", "8", "--budgets", "1.0",
         "--contenders", "resident", "storaged", "gguf_mmap", "--torch-threads", "1"],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:  # until the first contender's figures are written
            path = out / "results.json"
            if path.exists() and json.loads(path.read_text())["e2e"]["runs"]:
                break
            time.sleep(0.5)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=120) == 1
    finally:
        process.kill()
    results = json.loads((out / "results.json").read_text())
    measured = [r for r in results["e2e"]["runs"] if "decode_tok_s" in r]
    assert measured and measured[0]["contender"] == "resident"
    assert any("not run, the time budget is spent" in e for e in results["errors"]), results["errors"]
    assert "DeepSeek-V4-Flash-like (tiny): not run, the time budget is spent" in results["errors"]
