"""bench.e2e.llamacpp_run's handling of a running llama-bench: the short decode test's figures stand
when the full one cannot finish in time, the deadline stops it, the RAM limit is tightened once the
model is loaded, and bad output or a CPU-only run on a GPU device is an error. A script replays
llama-bench's progress lines and JSON records (taken from a real run) with chosen timings."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.llamacpp_command import LlamaBenchOutputError, LlamaBenchPlan  # noqa: E402
from bench.e2e.llamacpp_run import LlamaBenchProcess, _figures  # noqa: E402

RECORDS = [json.loads(line) for line in (Path(__file__).parent / "fixtures" / "llama_bench_cpu.jsonl")
           .read_text().splitlines()]
REPLAY = '''import json, sys, time
for kind, value in json.loads(open(sys.argv[1]).read()):
    if kind == "sleep":
        time.sleep(value)
    elif kind == "exit":
        sys.exit(value)
    else:
        stream = sys.stdout if kind == "out" else sys.stderr
        stream.write((json.dumps(value) if kind == "out" else value) + "\\n")
        stream.flush()
'''


def record(n_prompt: int, n_gen: int, ns_per_token: float, backends: str = "CPU") -> dict:
    avg_ns = int(ns_per_token * (n_prompt + n_gen))
    return RECORDS[0] | {"n_prompt": n_prompt, "n_gen": n_gen, "avg_ns": avg_ns, "samples_ns": [avg_ns],
                         "avg_ts": (n_prompt + n_gen) * 1e9 / avg_ns, "backends": backends}


def replayed_test(index: int, total: int, test: dict, before: float = 0.0) -> list:
    kind = "prompt" if test["n_prompt"] else "generation"
    return [["err", f"llama-bench: benchmark {index}/{total}: starting"], ["sleep", before],
            ["err", f"llama-bench: benchmark {index}/{total}: warmup {kind} run"],
            ["err", f"llama-bench: benchmark {index}/{total}: {kind} run 1/1"], ["out", test]]


@pytest.fixture
def fake(tmp_path):
    """A plan whose binary replays `steps` (written to a file the script reads)."""
    def make(steps: list, tokens: int = 32) -> LlamaBenchPlan:
        (tmp_path / "replay.py").write_text(REPLAY)
        (tmp_path / "steps.json").write_text(json.dumps(steps))
        binary = tmp_path / "llama-bench"
        binary.write_text(f"#!/bin/sh\nexec {sys.executable} {tmp_path / 'replay.py'} {tmp_path / 'steps.json'}\n")
        binary.chmod(0o755)
        return LlamaBenchPlan(binary, tmp_path / "model.gguf", 0.5, 1000, 1000, 2, 0, 8, tokens, 1)
    return make


def run(plan: LlamaBenchPlan, tmp_path: Path, seconds: float, device: str = "cpu"):
    loaded = []
    bench = LlamaBenchProcess(plan, tmp_path / "bench.log", None, lambda: loaded.append(time.perf_counter()))
    started = time.perf_counter()
    status, stopped = bench.run(started + seconds)
    elapsed = time.perf_counter() - started
    result = {"notes": []}
    return bench, status, stopped, elapsed, loaded, lambda: _figures(result, plan, bench, status, stopped, device)


def test_full_decode_test_is_used_when_it_finishes(fake, tmp_path):
    plan = fake(replayed_test(1, 3, record(8, 0, 1e5), before=0.2) + replayed_test(2, 3, record(0, 2, 1e6))
                + replayed_test(3, 3, record(0, 32, 1e6)))
    bench, status, stopped, _, loaded, figures = run(plan, tmp_path, 30)
    assert (status, stopped) == (0, None) and len(loaded) == 1
    result = figures()
    assert result["tokens"] == 32 and result["decode_tok_s"] == pytest.approx(1000)
    assert result["prefill_tok_s"] == pytest.approx(10000)
    assert [t["test"] for t in result["llamacpp"]["tests"]] == ["pp8", "tg2", "tg32"]
    assert not any("decoded" in note for note in result["notes"])
    assert "prompt run 1/1" in (tmp_path / "bench.log").read_text()


def test_probe_stands_when_the_full_test_would_overrun(fake, tmp_path):
    # tg2 at 1 s a token: tg32 plus its warm-up would need 33 s of the 8 s share
    plan = fake(replayed_test(1, 3, record(8, 0, 1e5)) + replayed_test(2, 3, record(0, 2, 1e9))
                + [["sleep", 60]] + replayed_test(3, 3, record(0, 32, 1e9)))
    bench, status, stopped, elapsed, _, figures = run(plan, tmp_path, 8)
    assert status == "stopped" and "tg32 would have needed ~33 s at tg2's speed" in stopped
    assert elapsed < 6  # stopped when tg2 arrived, not at the deadline
    result = figures()
    assert result["tokens"] == 2 and result["decode_tok_s"] == pytest.approx(1.0)
    assert any(note.startswith("decoded 2 of 32 tokens (llama-bench tg2): stopped, tg32 would") for note in
               result["notes"])


def test_a_crash_after_the_probe_is_stated(fake, tmp_path):
    plan = fake(replayed_test(1, 3, record(8, 0, 1e5)) + replayed_test(2, 3, record(0, 2, 1e6)) + [["exit", 137]])
    bench, status, stopped, _, _, figures = run(plan, tmp_path, 30)
    assert (status, stopped) == (137, None)
    result = figures()
    assert result["tokens"] == 2 and result["llamacpp"]["exit"] == 137
    assert "decoded 2 of 32 tokens (llama-bench tg2): llama-bench exited (137) before tg32 finished" in result["notes"]


def test_deadline_stops_a_run_that_finished_nothing(fake, tmp_path):
    plan = fake([["err", "llama-bench: benchmark 1/3: starting"], ["sleep", 60]])
    bench, status, stopped, elapsed, loaded, figures = run(plan, tmp_path, 1.0)
    assert status == "stopped" and stopped == "its time share ran out" and elapsed < 8 and not loaded
    with pytest.raises(RuntimeError, match="before its prompt and a generation test finished"):
        figures()


def test_a_record_that_is_not_llama_bench_json_is_an_error(fake, tmp_path):
    plan = fake(replayed_test(1, 2, record(8, 0, 1e5)) + [["out", {"n_prompt": 8}]])
    with pytest.raises(LlamaBenchOutputError, match="lacks"):
        run(plan, tmp_path, 30)[-1]()


def test_a_cpu_only_run_on_a_gpu_device_is_an_error(fake, tmp_path):
    plan = fake(replayed_test(1, 2, record(8, 0, 1e5)) + replayed_test(2, 2, record(0, 2, 1e6)), tokens=2)
    with pytest.raises(RuntimeError, match="ran on 'CPU', not CUDA"):
        run(plan, tmp_path, 30, device="cuda")[-1]()
