"""The fused kernels compile for an H100/H200 (sm_90) on a machine without a GPU: triton's
compiler runs through PTX and ptxas here, so an error that only the real compiler sees (the
interpreter accepts more, e.g. a loop bound that is not a constexpr) fails on the CPU first."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def test_every_fused_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    env["PYTHONPATH"] = str(REPO)
    run = subprocess.run([sys.executable, str(Path(__file__).with_name("kernels_compile_check.py"))],
                         capture_output=True, text=True, env=env, timeout=1200)
    lines = run.stdout.splitlines()
    assert run.returncode == 0, "\n".join(line for line in lines if not line.endswith(": ok")) + run.stderr[-2000:]
    # 14 types x (four GEMMs: parts or whole, operands swapped or not; one GEMV), Q4_K's GEMM for
    # float16 and float32 models swapped or not, then 2 GEMVs, 3 + 1 attention kernels, 2 top-k
    # selections, and the dispatch program at 5 sizes
    assert len(lines) == 14 * 5 + 4 + 8 + 5 and all(line.endswith(": ok") for line in lines)
