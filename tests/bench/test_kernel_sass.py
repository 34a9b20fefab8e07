"""bench/kernel_sass.py: its launch-shape parsing, its loop finder on a hand-written SASS listing,
and (slow) a real compile of the Q4_K GEMV for sm_90 on this CPU machine."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.kernel_sass import loop_of, opcode, parse_shape

REPO = Path(__file__).resolve().parents[2]


def run_tool(*args: str) -> subprocess.CompletedProcess:
    """bench/kernel_sass.py with triton's real compiler (not the tests' interpreter)."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, str(REPO / "bench" / "kernel_sass.py"), *args], capture_output=True,
                          text=True, env=env, timeout=900)


@pytest.mark.parametrize("text, expected", [("8x1", (8, 1)), ("4X2", (4, 2)), ("64x8", (64, 8))])
def test_launch_shapes_parse(text, expected):
    assert parse_shape(text) == expected


@pytest.mark.parametrize("text, why", [("8", "ROWSxWARPS"), ("8x", "ROWSxWARPS"), ("6x1", "power of two"),
                                       ("8x3", "warps"), ("0x1", "power of two"), ("ax1", "ROWSxWARPS")])
def test_bad_launch_shapes_are_refused_naming_them(text, why):
    with pytest.raises(argparse.ArgumentTypeError, match=why) as err:
        parse_shape(text)
    assert repr(text) in str(err.value)


SASS = """Function:moe_gemv_kernel
--:-:-:-:1\tMOV R1, c[0x0][0x28];
LBB1:
--:-:-:-:1\tLDG.E.U8 R2, desc[UR4][R4.64];
--:-:-:-:1\t@!P0 FFMA R3, R2, R5, R3;
--:-:-:-:1\tLOP3.LUT R6, R2, 0xf, RZ, 0xc0, !PT;
--:-:-:-:6\t@P5 BRA LBB1;
LBB0:
--:-:-:-:1\tFADD R7, R3, R3;
LBB2:
--:-:-:Y:0\tBRA LBB2;
"""


def test_the_loop_is_the_longest_backward_branch_and_opcodes_drop_predicates_and_suffixes():
    loop = loop_of(SASS)
    assert [opcode(line) for line in loop] == ["LDG", "FFMA", "LOP3", "BRA"]  # not the one-line LBB2 spin
    assert loop_of("Function:k\n--:-:-:-:1\tEXIT;\n") == []


@pytest.mark.slow
def test_the_q4_k_gemv_compiles_and_its_loop_is_counted(tmp_path):
    out = tmp_path / "sass.json"
    run = run_tool("--types", "Q4_K", "--shapes", "8x1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["type"] == "Q4_K" and row["loop_instructions"] > 100
    assert row["opcodes"].get("FFMA", 0) > 0 and "I2F" not in row["opcodes"]  # conversion-free Q4_K
    assert "Q4_K   8x1: loop" in run.stdout


@pytest.mark.slow
def test_the_q4_k_gemm_compiles_with_vector_loads_and_one_conversion_per_two_weights(tmp_path):
    """The prefill's grouped GEMM: tensor-core dots, the packed nibbles loaded as 16-byte vectors (the
    row offsets keep their divisibility) and the weights rounded by cvt.rn.bf16x2 (F2FP), not on
    their bits (that took a float compare, FSETP, per weight)."""
    out = tmp_path / "sass.json"
    run = run_tool("--kernel", "gemm", "--types", "Q4_K", "--shapes", "64x4", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    report = json.loads(out.read_text())
    (row,) = report["rows"]
    assert report["kernel"] == "gemm" and row["kernel"] == "gemm" and "gemm Q4_K   64x4: loop" in run.stdout
    per_thread = 64 * 256 / 128  # weights of one step per thread (64 rows, a 256-element super-block, 4 warps)
    assert row["opcodes"].get("HMMA", 0) > 0 and row["opcodes"].get("F2FP", 0) == per_thread / 2
    assert "FSETP" not in row["opcodes"]
    assert row["global_loads"] < per_thread / 4  # byte by byte it was 84 of 128


@pytest.mark.slow
def test_the_q4_k_gemv_reads_its_codes_wider_than_bytes(tmp_path):
    """At the shipped 4 x 1, a thread's step covers 16 bytes of Q4_K codes (4 rows of 256 weights
    over 32 threads): they load as vectors, since the row offsets keep their 16-byte divisibility
    (through a select they did not: 80 byte loads with the scales')."""
    out = tmp_path / "sass.json"
    run = run_tool("--types", "Q4_K", "--shapes", "4x1", "--json", str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert 0 < row["global_loads"] < 16, row


def test_whole_steps_are_refused_for_the_gemv():
    run = run_tool("--types", "Q4_K", "--whole")
    assert run.returncode != 0 and "--whole: only the GEMM" in run.stderr


@pytest.mark.parametrize("name, why", [("IQ2_XXS", "not a type the fused kernels read"),
                                       ("NOPE", "not an element type")])
def test_a_type_the_gemv_does_not_read_is_refused_naming_it(name, why):
    run = run_tool("--types", name)
    assert run.returncode != 0 and f"{name}: {why}" in run.stderr


def test_an_unknown_baseline_revision_is_refused_naming_it():
    run = run_tool("--types", "Q4_K", "--shapes", "8x1", "--baseline-rev", "no-such-revision")
    assert run.returncode != 0 and "--baseline-rev 'no-such-revision': git archive failed" in run.stderr


@pytest.mark.slow
def test_a_baseline_revision_is_compiled_beside_the_tree():
    run = run_tool("--types", "Q4_K", "--shapes", "8x1", "--baseline-rev", "HEAD")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "(at HEAD: " in run.stdout


def test_swapped_operands_are_refused_for_the_gemv():
    run = run_tool("--types", "Q4_K", "--swap", "on")
    assert run.returncode != 0 and "--swap: only the GEMM" in run.stderr
