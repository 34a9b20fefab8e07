"""bench/layer_profile.py: its flags are honoured or refused, and a budgeted run on the CPU (tiny
shape, a real daemon) reports the partial-hit regime's figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a directory of scripts, not an installed package

from bench import layer_profile  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--budget", "0"], "--budget must be in (0, 1], got 0.0"),
    (["--budget", "1.5"], "--budget must be in (0, 1], got 1.5"),
    (["--budget", "0.5", "--modes", "llamacpp"], "--budget < 1 is for storaged's modes"),
    (["--budget", "0.5", "--modes", "resident"], "--budget < 1 is for storaged's modes"),
    (["--host-budget", "0.5"], "--host-budget 0.5: must be in [0, 1], with --budget < 1"),
    (["--budget", "0.5", "--host-budget", "2"], "--host-budget 2.0: must be in [0, 1]"),
    (["--budget", "0.5", "--lookahead-min-precision", "1.5"], "--lookahead-min-precision 1.5: must be in [0, 1]"),
    (["--budget", "0.5", "--lookahead", "0", "--lookahead-min-precision", "0.5"],
     "--lookahead-min-precision needs lookahead on"),
    (["--lookahead-min-precision", "0.5"], "--lookahead-min-precision needs lookahead on"),
    (["--wait-each-step", "--modes", "resident", "storaged-eager"], "--wait-each-step is for the static decoder's"),
    (["--sdpa-backend", "cudnn", "--modes", "llamacpp"], "--sdpa-backend is for the torch modes"),
    (["--sdpa-backend", "fast"], "invalid choice: 'fast'"),
    (["--no-dense-kernels", "--modes", "resident", "llamacpp"], "--no-dense-kernels is for storaged's modes"),
    (["--modes", "storaged-graph-copy"], "compute host-tier experts: they need --budget < 1"),
], ids=["zero budget", "budget above 1", "llamacpp below 100%", "resident below 100%",
        "host budget at 100%", "host budget above 1", "min precision above 1", "min precision, lookahead 0",
        "min precision at 100% (lookahead off)", "wait each step without a static decoder mode",
        "sdpa backend for llama.cpp alone", "unknown sdpa backend", "dense kernels off without storaged",
        "cpu experts without a host tier"])
def test_bad_flags_are_refused_naming_them(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        layer_profile.parse_args(argv)
    assert exited.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow  # a tiny model built and decoded through a real daemon: about a minute on 2 cores
def test_a_budgeted_cpu_run_reports_hits_and_traffic(tmp_path):
    results = layer_profile.run(layer_profile.parse_args([
        "--tiny", "--device", "cpu", "--layers", "2", "--modes", "storaged-eager", "--tokens", "3",
        "--prompt-len", "8", "--profile-steps", "1", "--budget", "0.5", "--lookahead", "0", "--decode", "sample",
        "--workdir", str(tmp_path)]))
    record = results["modes"]["storaged-eager"]
    assert "error" not in record, record.get("error")
    assert results["budget"] == 0.5 and record["budget"] == 0.5 and record["lookahead"] == 0
    assert 0 <= record["vram_hit_rate"] < 1  # half the experts: some lookups miss
    assert record["bytes_read_per_token"] >= 0 and record["reads_per_token"] >= 0
    # the host profile's 30 costliest functions: which ones make the list depends on the machine's load
    assert "function calls" in record["host_profile"] and "Ordered by: internal time" in record["host_profile"]
    assert "VRAM hit rate" in layer_profile.report(results)
    assert record["device_ms_per_step"] is None and record["device_idle_ms_per_token"] is None  # no CUDA timing


@pytest.mark.parametrize("idle, shown", [(0.3125, " 0.312 "), (None, " - ")], ids=["CUDA", "CPU"])
def test_the_report_shows_the_time_a_step_spends_beyond_its_device_work(idle, shown):
    record = {"decode_tok_s": 250.0, "prefill_tok_s": 400.0, "ms_per_token": 4.0, "device_busy_share": 0.75,
              "device_idle_ms_per_token": idle, "per_layer_us": {"experts GEMV": 139.2}}
    results = {"shape": "Qwen3-30B-A3B-like", "layers": 12, "moe_layers": 12, "device": "d", "budget": 0.5,
               "modes": {"storaged-graph-cpu": record}}
    lines = layer_profile.report(results).splitlines()
    assert "idle ms" in lines[1]
    row = next(line for line in lines if line.startswith("storaged-graph-cpu"))
    assert shown in row and "experts GEMV 139.2" in row



@pytest.mark.slow  # as above
def test_a_run_with_lookahead_reports_its_hints(tmp_path):
    results = layer_profile.run(layer_profile.parse_args([
        "--tiny", "--device", "cpu", "--layers", "2", "--modes", "storaged-eager", "--tokens", "3",
        "--prompt-len", "8", "--profile-steps", "1", "--budget", "0.5", "--lookahead", "2",
        "--lookahead-min-precision", "0", "--decode", "sample", "--workdir", str(tmp_path)]))
    record = results["modes"]["storaged-eager"]
    assert "error" not in record, record.get("error")
    assert record["lookahead"] == 2 and record["lookahead_min_precision"] == 0.0
    # min precision 0: every prediction is sent, one per step and hinted layer, and scored
    assert record["hints_sent_per_token"] > 0 and record["hints_withheld_per_token"] == 0
    assert record["hinted_experts_per_token"] >= record["hints_sent_per_token"]
    assert 0 <= record["hint_precision"]["single"] <= 1


def test_the_sdpa_backend_is_the_only_one_attention_may_use():
    import torch
    import torch.nn.functional as F

    q = k = v = torch.randn(1, 2, 4, 8)
    with layer_profile._sdpa_backend("math"):
        F.scaled_dot_product_attention(q, k, v)
    with layer_profile._sdpa_backend("cudnn"), pytest.raises(RuntimeError, match="No viable backend"):
        F.scaled_dot_product_attention(q, k, v)  # no cuDNN attention on the CPU
    F.scaled_dot_product_attention(q, k, v)  # and torch's choice again after


@pytest.mark.parametrize("budget, left_out", [("1.0", {"storaged-graph-cpu", "storaged-graph-copy"}),
                                              ("0.5", {"resident", "llamacpp"})])
def test_default_modes_are_those_the_budget_allows(budget, left_out):
    modes = layer_profile.parse_args(["--budget", budget]).modes
    assert set(modes) == set(layer_profile.MODES) - left_out
