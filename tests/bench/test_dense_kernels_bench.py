"""bench/dense_kernels.py: the sizes it times are the bench models' own, its report reads its
results, and it refuses what it cannot do (the timing itself needs CUDA: the H200 runs it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a directory of scripts, not an installed package

from bench import dense_kernels  # noqa: E402


def test_the_qwen3_bench_shape_sizes_are_its_model_s():
    linears, dims = dense_kernels.model_dims("qwen3")
    assert {(n, k) for _, n, k in linears} == {(2048, 2048), (1024, 2048), (512, 2048)}  # q/o, k/v, LM head
    assert dims == {"heads": 4, "kv_heads": 2, "key_dim": 512, "value_dim": 512, "router": (128, 2048, 8)}


def test_the_deepseek_bench_shape_has_mla_attention_and_no_softmax_router():
    linears, dims = dense_kernels.model_dims("deepseek")
    assert (4096, 4096) in {(n, k) for _, n, k in linears}  # the dense layer's MLP
    assert dims["router"] is None and dims["key_dim"] == 16 and dims["value_dim"] == 16


def test_the_report_reads_a_run_s_results():
    gemv = {"module": "q_proj", "n": 2048, "k": 2048, "mib": 8.0, "config": [2, 1024, 4], "cublas_us": 6.0,
            "ours_us": 4.0, "cublas_tbps": 1.4, "ours_tbps": 2.1}
    attention = {"length": 300, "visible": 250, "sdpa_us": 43.0, "sdpa_cudnn_us": None, "ours_us": 8.3}
    router = {"experts": 128, "hidden": 2048, "top_k": 8, "same_experts": True, "torch_us": 24.3, "ours_us": 5.4}
    text = dense_kernels.report({"qwen3": {"gemv": [gemv], "attention": [attention], "router": router}})
    assert "x1.50" in text and "sdpa_cudnn n/a" in text and "ours 8.30" in text
    assert "torch 24.33 us" not in text and "torch 24.30 us, ours 5.40 us (same experts: True)" in text


@pytest.mark.parametrize("argv, message", [
    (["--shapes", "llama"], "invalid choice: 'llama'"),
    (["--visible", "0"], "--visible and --lengths take positive numbers of keys"),
], ids=["unknown shape", "no visible key"])
def test_bad_arguments_are_refused_naming_them(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the CUDA check to the argument's
    with pytest.raises(SystemExit) as exited:
        dense_kernels.main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_without_cuda_it_says_so(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        dense_kernels.main([])
    assert "timed on CUDA" in capsys.readouterr().err
