"""bench/host_experts_bench.py: a short run against the same kernels as the baseline (equal
outputs, a ratio near one), and a baseline whose outputs are wrong stops the run."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import host_experts_bench  # noqa: E402
from inference.kernels.host_experts import SOURCE  # noqa: E402

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the kernels")
SHORT = ["--threads", "1", "--pairs", "2", "--objects-mib", "8", "--seconds", "0.05"]


def test_a_short_run_against_itself(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert host_experts_bench.main([*SHORT, "--baseline", str(SOURCE), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert {r["type"] for r in result["rows"]} == {"Q4_K", "MXFP4"}
    for row in result["rows"]:
        assert row["jobs"] >= 3 and row["gbps_median"] > 0 and row["memory_sum_gbps"] > 0
        assert 0.2 < row["over_baseline"] < 5  # the same kernels: the ratio is the machine's noise
    assert "÷ baseline" in capsys.readouterr().out
    assert result["cpu"] == host_experts_bench.host_cpu()  # the host the figures are of


CPUINFO = """processor\t: 0
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480C
flags\t\t: fpu sse avx2 avx512f avx512bw avx512_bf16 amx_tile amx_bf16
"""


@pytest.mark.parametrize("text, expected", [
    (CPUINFO, {"model": "Intel(R) Xeon(R) Platinum 8480C", "logical_cpus": 2,
               "flags": ["avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16"]}),
    ("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx2\n",
     {"model": "AMD EPYC", "logical_cpus": 1, "flags": ["avx2"]}),
    ("processor\t: 0\n", {"model": None, "logical_cpus": 1, "flags": []}),
], ids=["avx512 and amx", "avx2 only", "no model line"])
def test_host_cpu_reads_model_count_and_flags(text, expected):
    assert host_experts_bench.host_cpu(text) == expected


def test_a_baseline_with_other_outputs_is_refused(tmp_path, capsys):
    wrong = tmp_path / "wrong.c"  # every output row negated: a sign slip in a kernel
    text = SOURCE.read_text()
    assert "out[n + i] = float_to_bf16(y[i]);" in text
    wrong.write_text(text.replace("out[n + i] = float_to_bf16(y[i]);", "out[n + i] = float_to_bf16(-y[i]);"))
    assert host_experts_bench.main([*SHORT, "--types", "Q4_K", "--baseline", str(wrong)]) == 1
    assert "the baseline's outputs differ" in capsys.readouterr().err
