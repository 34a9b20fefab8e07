"""The llama.cpp contender's command line per VRAM budget (--n-cpu-moe arithmetic), the parsing of
llama-bench's JSON (a record from a real llama-bench run), where its binary is looked for, and the
storaged ÷ llama.cpp ratios of the report."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.llamacpp_command import (BIN_ENV, BUILD_SESSION_ENV, BUILD_STATUS_ENV, DEFAULT_BIN,  # noqa: E402
                                        LlamaBenchOutputError, LlamaBenchPlan, binary_summary, build_in_progress,
                                        build_paused, llama_bench_path, moe_layers_in_vram, parse_output,
                                        session_processes, wait_for_build)
from bench.e2e.llamacpp_run import binary_problem  # noqa: E402
from bench.e2e.report import markdown  # noqa: E402
from bench.e2e.shapes import FULL_SHAPES  # noqa: E402
from packformat import constants as C  # noqa: E402

FIXTURES = Path(__file__).parent / "fixtures"
LAYER = 1000  # bytes of one MoE layer's experts, for the arithmetic cases


def plan(fraction=0.5, budget=6 * LAYER, layer=LAYER, moe_layers=12, dense_layers=0, tokens=32, **kw):
    return LlamaBenchPlan(Path("/opt/llama-bench"), Path("/m/model.gguf"), fraction, budget, layer, moe_layers,
                          dense_layers, kw.pop("prompt_len", 64), tokens, kw.pop("threads", 16))


@pytest.mark.parametrize(("fraction", "budget", "moe_layers", "dense", "in_vram", "n_cpu_moe"), [
    (1.0, 12 * LAYER, 12, 0, 12, 0),  # 100%: -ngl 99 alone
    (1.0, 0, 12, 0, 12, 0),  # 100% means every weight in VRAM whatever the byte count
    (0.5, 6 * LAYER, 12, 0, 6, 6),  # exactly six layers fit
    (0.5, 6 * LAYER - 1, 12, 0, 5, 7),  # one byte short of six: five
    (0.5, 6 * LAYER + LAYER - 1, 12, 0, 6, 6),  # a partial layer stays on the CPU
    (0.1, LAYER - 1, 12, 0, 0, 12),  # smaller than one layer: every expert on the CPU
    (0.1, 0, 12, 0, 0, 12),
    (0.99, 13 * LAYER, 12, 0, 12, 0),  # padded budget bytes above the GGUF's: all fit, no override
    (0.25, 0, 3, 1, 0, 4),  # a dense first block counts in --n-cpu-moe's block index
    (0.5, LAYER, 3, 1, 1, 3),
    (0.9, 3 * LAYER, 3, 1, 3, 0),
])
def test_layers_in_vram_and_n_cpu_moe(fraction, budget, moe_layers, dense, in_vram, n_cpu_moe):
    p = plan(fraction, budget, moe_layers=moe_layers, dense_layers=dense)
    assert (p.layers_in_vram, p.n_cpu_moe) == (in_vram, n_cpu_moe)
    command = p.command()
    assert command[command.index("-ngl") + 1] == "99"
    if n_cpu_moe:
        assert command[command.index("--n-cpu-moe") + 1] == str(n_cpu_moe)
    else:
        assert "--n-cpu-moe" not in command


@pytest.mark.parametrize(("fraction", "n_cpu_moe"), [(1.0, 0), (0.5, 6), (0.25, 9), (0.1, 11)])
def test_qwen3_shape_budgets_give_the_placements_a_user_would_pick(fraction, n_cpu_moe):
    """12 Q4_K layers; the budget is a fraction of the padded pack objects (as storaged's arena)."""
    shape = FULL_SHAPES["qwen3"]
    budget = int(fraction * 12 * shape.experts * C.align_up(shape.expert_bytes + 3 * C.ROLE_ALIGNMENT, C.ALIGNMENT))
    p = plan(fraction, budget, layer=shape.expert_bytes * shape.experts)
    assert p.n_cpu_moe == n_cpu_moe


def test_command_line():
    assert plan(0.25, 3 * LAYER, tokens=32, prompt_len=64, threads=16).command() == [
        "/opt/llama-bench", "-m", "/m/model.gguf", "-p", "64", "-n", "2,32", "-ngl", "99", "--n-cpu-moe", "9",
        "-lm", "mmap", "-fa", "auto", "-t", "16", "-r", "1", "-o", "jsonl", "--progress"]


@pytest.mark.parametrize(("tokens", "tests"), [(1, [1]), (2, [2]), (3, [2, 3]), (32, [2, 32])])
def test_decode_tests_put_a_short_probe_first(tokens, tests):
    p = plan(tokens=tokens)
    assert p.decode_tests == tests and p.command()[p.command().index("-n") + 1] == ",".join(map(str, tests))


@pytest.mark.parametrize("changes", [
    dict(fraction=0.0), dict(fraction=1.5), dict(budget=-1), dict(layer=0), dict(moe_layers=0),
    dict(dense_layers=-1), dict(tokens=0), dict(prompt_len=0), dict(threads=0)])
def test_plan_refuses_bad_values(changes):
    with pytest.raises(ValueError):
        plan(**changes)


@pytest.mark.parametrize(("budget", "layer", "layers"), [(-1, 1, 3), (0, 0, 3), (0, 1, 0)])
def test_moe_layers_in_vram_refuses_bad_values(budget, layer, layers):
    with pytest.raises(ValueError):
        moe_layers_in_vram(budget, layer, layers)


def test_real_llama_bench_output_is_parsed():
    tests = parse_output((FIXTURES / "llama_bench_cpu.jsonl").read_text())
    assert [t.name for t in tests] == ["pp8", "tg2", "tg3"]
    prompt, probe, full = tests
    assert prompt.n_gen == 0 and probe.n_prompt == 0 and full.n_gen == 3
    for test in tests:
        assert test.avg_ns > 0 and len(test.samples_ns) == 1 and test.samples_ns[0] == test.avg_ns
        assert test.stddev_ns == 0  # one repetition
        tokens = test.n_prompt + test.n_gen
        assert test.avg_ts == pytest.approx(tokens * 1e9 / test.avg_ns, rel=1e-3)
        assert test.ns_per_token == pytest.approx(test.avg_ns / tokens)
        assert test.backends == "CPU" and test.load_mode == "mmap" and test.n_gpu_layers == 99
        assert test.n_cpu_moe == 2 and test.flash_attn == -1  # auto
    assert tests[0].as_dict()["test"] == "pp8" and tests[0].as_dict()["samples_ns"] == tests[0].samples_ns


def test_json_array_output_is_parsed_like_jsonl():
    lines = (FIXTURES / "llama_bench_cpu.jsonl").read_text().splitlines()
    array = "[\n" + ",\n".join(lines) + "\n]\n"
    assert parse_output(array) == parse_output("\n".join(lines))


def _record(**changes) -> str:
    record = json.loads((FIXTURES / "llama_bench_cpu.jsonl").read_text().splitlines()[0])
    for key, value in changes.items():
        if value is None:
            del record[key]
        else:
            record[key] = value
    return json.dumps(record)


@pytest.mark.parametrize(("text", "message"), [
    ("", "no test record"),
    ("not json\n", "not JSON"),
    ('{"a": 1}\n', "lacks n_prompt"),
    ("[1, 2]", "not a list of test objects"),
    (_record(avg_ns=None), "lacks avg_ns"),
    (_record(n_gen=4), "prompt or a generation test"),
    (_record(avg_ns=0), "no timed repetition"),
    (_record(samples_ns=[]), "no timed repetition"),
    (_record(avg_ts="fast"), "malformed"),
])
def test_bad_output_is_refused_with_a_reason(text, message):
    with pytest.raises(LlamaBenchOutputError, match=message):
        parse_output(text)


def test_binary_path_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv(BIN_ENV, raising=False)
    assert llama_bench_path() == DEFAULT_BIN.resolve()
    monkeypatch.setenv(BIN_ENV, str(tmp_path / "env-bench"))
    assert llama_bench_path() == tmp_path / "env-bench"
    assert llama_bench_path(tmp_path / "flag-bench") == tmp_path / "flag-bench"


def _fake_binary(directory: Path, flavour: str | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    binary = directory / "llama-bench"
    binary.write_text("#!/bin/sh\nexit 0\n")
    binary.chmod(0o755)
    if flavour:
        (directory / "BUILD_INFO").write_text(f"flavour={flavour}\ncommit=0c1e57098bba43ac\ncompiler=gcc 13\n")
    return binary


@pytest.mark.parametrize(("flavour", "device", "problem"), [
    ("cuda", "cuda", None), ("cpu", "cpu", None), ("cuda", "cpu", None), (None, "cuda", None),
    ("cpu", "cuda", "is a CPU build"),
])
def test_binary_problem_names_a_wrong_flavour(tmp_path, monkeypatch, flavour, device, problem):
    monkeypatch.delenv(BUILD_STATUS_ENV, raising=False)
    found = binary_problem(_fake_binary(tmp_path / "bin", flavour), device)
    assert found is None if problem is None else problem in found


def test_binary_problem_names_a_missing_or_unusable_binary(tmp_path, monkeypatch):
    monkeypatch.delenv(BUILD_STATUS_ENV, raising=False)
    assert "not found at" in binary_problem(tmp_path / "nowhere", "cpu")
    binary = _fake_binary(tmp_path / "bin", "cpu")
    binary.chmod(0o644)
    assert "not executable" in binary_problem(binary, "cpu")
    status = tmp_path / "llamacpp-build.status"
    status.write_text("1\n")
    monkeypatch.setenv(BUILD_STATUS_ENV, str(status))
    assert "build.sh failed (exit status 1)" in binary_problem(tmp_path / "nowhere", "cpu")


def test_binary_summary(tmp_path):
    assert binary_summary(tmp_path / "nowhere").startswith("missing")
    assert "no BUILD_INFO" in binary_summary(_fake_binary(tmp_path / "plain", None))
    assert binary_summary(_fake_binary(tmp_path / "built", "cuda")).startswith("cuda build of llama.cpp 0c1e57098bba")


def test_wait_for_build(tmp_path, monkeypatch):
    monkeypatch.delenv(BUILD_STATUS_ENV, raising=False)
    assert wait_for_build(time.perf_counter()) is None  # no background build
    status = tmp_path / "llamacpp-build.status"
    monkeypatch.setenv(BUILD_STATUS_ENV, str(status))
    started = time.perf_counter()
    assert "had not finished" in wait_for_build(started + 0.3, poll_seconds=0.05)
    assert time.perf_counter() - started >= 0.3
    status.write_text("0\n")
    assert wait_for_build(time.perf_counter()) is None
    status.write_text("2\n")
    assert wait_for_build(time.perf_counter()) == \
        f"bench/llamacpp/build.sh failed (exit status 2); its log: {tmp_path / 'llamacpp-build.log'}"


def _run(contender, fraction, decode, prefill, **extra):
    return {"shape": "S", "contender": contender, "budget_fraction": fraction, "decode_tok_s": decode,
            "prefill_tok_s": prefill, "notes": [], **extra}


def test_report_prints_storaged_over_llamacpp_decode_and_prefill():
    runs = [_run("storaged", 0.1, 3.0, 100.0), _run("llamacpp", 0.1, 1.5, 400.0,
                                                    llamacpp={"n_cpu_moe": 11, "moe_layers_in_vram": 1}),
            _run("storaged", 1.0, 50.0, 2000.0), _run("llamacpp", 1.0, 900.0, 5000.0,
                                                      llamacpp={"n_cpu_moe": 0, "moe_layers_in_vram": 12}),
            _run("storaged", 0.5, 10.0, 500.0)]  # llama.cpp did not run at 50%: no row
    text = markdown({"e2e": {"runs": runs}})
    section = text.split("### storaged ÷ llama.cpp")[1]
    assert "| S | storaged | 10% | 2.00× | 0.25× | 1.50 | 400.00 | 11 | 1 |" in section
    assert "| S | storaged | 100% | 0.06× | 0.40× | 900.00 | 5000.00 | 0 | 12 |" in section
    assert "| S | storaged | 50% |" not in section
    decode_table = text.split("## Decode speed ratios")[1].split("###")[0]
    assert "÷ llamacpp" in decode_table and "| S | storaged | 10% | – | – | – | 2.00× | – |" in decode_table


def test_build_in_progress_while_the_status_file_is_absent(tmp_path, monkeypatch):
    monkeypatch.delenv(BUILD_STATUS_ENV, raising=False)
    assert not build_in_progress()  # no background build at all
    status = tmp_path / "llamacpp-build.status"
    monkeypatch.setenv(BUILD_STATUS_ENV, str(status))
    assert build_in_progress()
    status.write_text("0\n")
    assert not build_in_progress()
    status.write_text("1\n")  # ended, failed: no longer taking the cores
    assert not build_in_progress()


def _states(pids):
    return {pid: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] for pid in pids}


def _settled_states(pids, expect_stopped: bool, timeout: float = 20.0):
    """The processes' states once each is stopped ('T') or each is not, or at the timeout: a signal
    is delivered when the process is next scheduled, not when kill(2) returns."""
    deadline = time.monotonic() + timeout
    while True:
        states = _states(pids)
        if all((state == "T") == expect_stopped for state in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(0.01)


def test_build_paused_stops_every_process_of_the_build_session_and_continues_them(tmp_path, monkeypatch):
    session_file, status = tmp_path / "llamacpp-build.session", tmp_path / "llamacpp-build.status"
    monkeypatch.setenv(BUILD_STATUS_ENV, str(status))
    monkeypatch.setenv(BUILD_SESSION_ENV, str(session_file))
    # a stand-in for build.sh: a session leader and children in process groups of their own, as
    # ninja's. The leader execs a sleep rather than `wait`, which can return (and end the leader)
    # when its stopped children report, and every sleep outlasts a slow machine's test
    build = subprocess.Popen(["setsid", "bash", "-c",
                              f'echo $$ > {session_file}; set -m; sleep 600 & sleep 600 & exec sleep 600'])
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (not session_file.exists() or
                                              len(session_processes(int(session_file.read_text() or 0))) < 3):
            time.sleep(0.05)
        pids = session_processes(int(session_file.read_text()))
        assert len(pids) == 3 and len({os.getpgid(pid) for pid in pids}) == 3
        with build_paused() as paused:
            assert paused
            assert set(_settled_states(pids, True).values()) == {"T"}
        assert "T" not in _settled_states(pids, False).values()
        status.write_text("0\n")  # the build ended: nothing to pause
        with build_paused() as paused:
            assert not paused
        monkeypatch.delenv(BUILD_SESSION_ENV)
        status.unlink()
        with build_paused() as paused:  # a build whose session is unknown is left running
            assert not paused
    finally:
        os.killpg(build.pid, signal.SIGKILL) if build.poll() is None else None
        for pid in session_processes(build.pid):
            os.kill(pid, signal.SIGKILL)
        build.wait()
