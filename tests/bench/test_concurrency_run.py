"""bench/concurrency_run.py: the whole driver on the CPU at tiny sizes (a synthesized model, a real
storaged daemon, a real `inference serve` whose completions go through the GGUF's tokenizer), its
refusals of bad arguments, and the ratios the benchmark's bar is read from."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a directory of scripts, not an installed package

import bench.concurrency_run as concurrency_run  # noqa: E402
from bench.concurrency_run import parse_args, ratios, uniform_routing_share  # noqa: E402

DISK_DIR = Path("/var/tmp")  # storaged reads with O_DIRECT, which tmpfs refuses
MAX_TOKENS = 3


@pytest.fixture
def workdir():
    path = Path(tempfile.mkdtemp(prefix="concurrency-run-", dir=DISK_DIR if DISK_DIR.is_dir() else None))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "concurrency_run.py"), *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_the_driver_measures_each_level_of_a_shape_end_to_end(workdir):
    """~17 s on a 2-core CPU: a model prepared, a daemon and a server started, two levels measured."""
    out = workdir / "out" / "concurrency.json"
    done = _run("--device", "cpu", "--tiny", "--shapes", "qwen3", "--streams", "1,2", "--max-tokens", str(MAX_TOKENS),
                "--prompt-tokens", "6", "--torch-threads", "1", "--workdir", str(workdir / "work"), "--json", str(out),
                "--time-budget", "500")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == []
    [shape] = report["shapes"]
    assert shape["key"] == "qwen3" and shape["shape"] == "Qwen3-30B-A3B-like (tiny)" and shape["not_run"] == []
    assert [level["streams"] for level in shape["levels"]] == [1, 2]
    for level in shape["levels"]:  # the server's own usage counts: every token of every stream came back
        assert level["completion_tokens"] == level["streams"] * MAX_TOKENS
        assert level["aggregate_tokens_per_second"] > 0 and level["acquires"] > 0
        # the arena holds a quarter of the experts and nothing else does: the daemon read the pack
        assert level["pack_bytes_read"] > 0 and level["ssd_bytes_per_token"] > 0
        assert level["block_read_bytes"] is not None
    assert shape["arena_fraction"] == shape["budget_fraction"] == 0.25 and shape["host_tier_bytes"] == 0
    assert shape["serve_exit_status"] == 0 and shape["storaged_exit_status"] == 0  # both stopped cleanly
    assert shape["ratios"]["tokens_per_second_vs_1"]["1"] == 1.0 and "2" in shape["ratios"]["ssd_bytes_per_token_vs_1"]
    assert not (workdir / "work" / Path(shape["model"]["bundle"]).parent.name).exists()  # the model was removed
    table = out.with_suffix(".md").read_text()
    assert "| Qwen3-30B-A3B-like (tiny) | 2 |" in table and table in done.stdout


def test_a_spent_time_budget_runs_nothing_and_says_so(workdir):
    out = workdir / "c.json"
    done = _run("--device", "cpu", "--tiny", "--shapes", "qwen3,deepseek", "--time-budget", "1", "--workdir",
                str(workdir / "work"), "--json", str(out), timeout=300)
    assert done.returncode == 1
    report = json.loads(out.read_text())
    assert report["shapes"] == [] and [e.split(":")[0] for e in report["errors"]] == ["qwen3", "deepseek"]
    assert all("time budget" in e for e in report["errors"])


def test_a_missing_module_stops_the_run_before_anything_starts(workdir, monkeypatch, capsys):
    monkeypatch.setattr(concurrency_run, "NEEDED_MODULES", ("json", "no_such_module_for_the_test"))
    assert concurrency_run.main(["--workdir", str(workdir / "work"), "--json", str(workdir / "c.json")]) == 2
    assert "no_such_module_for_the_test" in capsys.readouterr().err
    assert not (workdir / "work").exists() and not (workdir / "c.json").exists()


@pytest.mark.parametrize("argv, message", [
    (["--streams", "0,2"], "--streams"),
    (["--streams", "1,x"], "--streams"),
    (["--streams", "1,300"], "--streams"),
    (["--budget", "0"], "--budget"),
    (["--budget", "1.5"], "--budget"),
    (["--budget", "quarter"], "--budget"),
    (["--shapes", "qwen3,llama"], "'llama'"),
    (["--shapes", ""], "--shapes"),
    (["--layers", "1", "--shapes", "deepseek"], "deepseek"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--rounds", "0"], "--rounds"),
    (["--time-budget", "0"], "--time-budget"),
    (["--device", "cpu", "--host-tier"], "--host-tier"),
    (["--torch-threads", "2"], "--torch-threads"),  # the default device is cuda
    (["--tiny", "--cpu-scale"], "--cpu-scale"),
])
def test_bad_arguments_are_refused_naming_what_is_wrong(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(argv)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_cpu_scale_keeps_the_routing_of_each_shape():
    from bench.concurrency_run import layers_of, shapes_of
    from bench.e2e.shapes import FULL_SHAPES

    args = parse_args(["--cpu-scale", "--device", "cpu"])
    for key, full in FULL_SHAPES.items():
        scaled = shapes_of(args)[key]
        assert (scaled.experts, scaled.top_k, scaled.arch, scaled.expert_type) == \
            (full.experts, full.top_k, full.arch, full.expert_type)
        assert scaled.hidden == scaled.moe_intermediate == 256
        assert layers_of(args, key) == 4 + full.dense_layers


def test_defaults_are_the_benchmarks_bar():
    args = parse_args([])
    assert args.shapes == ("qwen3", "deepseek") and args.budget == 0.25 and args.streams == (1, 2, 4, 8, 16)
    assert args.device == "cuda" and not args.host_tier and not args.layer_floor


def _level(streams: int, tok_s: float, per_token: float | None) -> dict:
    return {"streams": streams, "aggregate_tokens_per_second": tok_s, "ssd_bytes_per_token": per_token,
            "block_read_bytes_per_token": per_token}


@pytest.mark.parametrize("levels, eight_over_one, at_least_4x, falling", [
    ([_level(1, 10, 100), _level(2, 19, 60), _level(8, 45, 20)], 4.5, True, True),
    ([_level(1, 10, 100), _level(8, 30, 20)], 3.0, False, True),
    ([_level(1, 10, 100), _level(2, 12, 120), _level(8, 40, 20)], 4.0, True, False),
    ([_level(1, 10, 100), _level(2, 12, 60)], None, None, True),  # no 8-stream level
    ([_level(1, 10, None), _level(8, 50, None)], 5.0, True, None),  # no Stats figures
])
def test_ratios_against_one_stream(levels, eight_over_one, at_least_4x, falling):
    got = ratios(levels)
    assert got["tokens_per_second_8_over_1"] == eight_over_one
    assert got["eight_streams_at_least_4x"] is at_least_4x
    assert got["ssd_bytes_per_token_falling"] is falling
    assert got["tokens_per_second_vs_1"]["1"] == 1.0


@pytest.mark.parametrize("streams, experts, top_k, share", [
    (1, 128, 8, 1.0),  # one token: its k experts
    (8, 128, 8, 0.8066),  # 51.6 distinct of 64 picks
    (4, 16, 16, 0.25),  # every token picks every expert: n tokens share one read each
    (2, 256, 6, 0.9883),
])
def test_uniform_routing_share(streams, experts, top_k, share):
    assert uniform_routing_share(streams, experts, top_k) == pytest.approx(share, abs=1e-4)


def test_ratios_carry_the_uniform_routing_bound_when_the_shape_is_known():
    got = ratios([_level(1, 10, 100), _level(8, 20, 80)], experts=128, top_k=8)
    assert got["uniform_routing_bytes_per_token_vs_1"] == {"1": 1.0, "8": pytest.approx(0.8066, abs=1e-4)}
    assert "uniform_routing_bytes_per_token_vs_1" not in ratios([_level(1, 10, 100)])


def test_no_one_stream_level_no_ratios():
    assert ratios([_level(2, 10, 100)]) == {}
