"""bench/cpu_expert_probe.py: its C kernel (both the AVX2 and the portable loop) against gguf-py's
dequantization, the check failing on a wrong kernel, and a short run of the probe."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import cpu_expert_probe  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the kernel")


@pytest.mark.parametrize("march", ["native", "x86-64"])  # x86-64: no AVX2, FMA or F16C, the portable loop
def test_kernel_equals_gguf_dequantization_times_x(tmp_path, march):
    kernel = cpu_expert_probe.build_kernel(tmp_path, march=march)
    assert cpu_expert_probe.check(kernel, np.random.default_rng(3)) <= cpu_expert_probe.TOLERANCE


def test_check_fails_on_a_wrong_kernel(tmp_path, monkeypatch):
    kernel = cpu_expert_probe.build_kernel(tmp_path)
    right = cpu_expert_probe.gemv_many

    def off_by_a_row(*args, **kwargs):  # every output one row late: a layout slip
        return [np.roll(y, 1) for y in right(*args, **kwargs)]

    monkeypatch.setattr(cpu_expert_probe, "gemv_many", off_by_a_row)
    with pytest.raises(AssertionError, match="q4k_gemv is off by"):
        cpu_expert_probe.check(kernel, np.random.default_rng(3))


def test_probe_reports_rates_per_thread_count(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert cpu_expert_probe.main(["--threads", "1", "2", "--experts", "8", "--seconds", "0.01",
                                  "--cache-dir", str(tmp_path / "cache"), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["threads"] for r in result["rows"]] == [1, 2]
    assert all(r["gbps"] > 0 and r["memory_sum_gbps"] > 0 for r in result["rows"])
    assert result["max_relative_error"] <= cpu_expert_probe.TOLERANCE
    assert "threads:" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--threads", "0"], ["--experts", "4"], ["--seconds", "0"],
                                  ["--link-mode", "copy-engine"], ["--gpu-link-load", "--link-mode", "dma"]])
def test_probe_refuses_bad_arguments(argv):
    with pytest.raises(SystemExit) as exc:
        cpu_expert_probe.main(argv)
    assert exc.value.code == 2


def test_link_load_needs_cuda(tmp_path, capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the link load runs (test_link_load_runs_beside_the_cpu_kernel)")
    assert cpu_expert_probe.main(["--threads", "1", "--experts", "8", "--seconds", "0.01", "--gpu-link-load",
                                  "--cache-dir", str(tmp_path)]) == 2
    assert "--gpu-link-load needs CUDA" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("mode", cpu_expert_probe.LINK_MODES)
def test_link_load_runs_beside_the_cpu_kernel(tmp_path, mode):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    kernel = cpu_expert_probe.build_kernel(tmp_path)
    result = cpu_expert_probe.link_rates(kernel, 8, [1, 2], 0.2, nbytes=64 << 20, mode=mode)
    assert result["link_mode"] == mode and result["link_alone_gbps"] > 1 and [r["threads"] for r in result["rows"]] == [1, 2]
    assert all(r["cpu_gbps"] > 0 and r["link_gbps"] > 1 for r in result["rows"])
