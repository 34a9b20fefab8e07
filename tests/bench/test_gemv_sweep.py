"""bench/gemv_sweep.py on a CPU machine: its arguments (the sweep itself needs CUDA)."""

from __future__ import annotations

import argparse

import pytest

from bench.gemv_sweep import GEMM_CONFIGS, gemm_config, positive_int


@pytest.mark.parametrize("text, value", [("64", 64), ("1", 1), ("2048", 2048)])
def test_prefill_lengths_parse(text, value):
    assert positive_int(text) == value


@pytest.mark.parametrize("text", ["0", "-5", "64.0", "many", ""])
def test_a_bad_prefill_length_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="positive integer") as err:
        positive_int(text)
    assert repr(text) in str(err.value)


def test_the_gemm_configs_include_the_shipped_shape_and_long_prompt_blocks():
    from inference.kernels import ops
    from packformat import ElementType
    for element_type in (ElementType.Q4_K, ElementType.MXFP4):  # the sweep reports the shipped shapes
        assert (ops.GEMM_BLOCK_M, *ops.gemm_shape(element_type)) in GEMM_CONFIGS
    assert max(block_m for block_m, _, _ in GEMM_CONFIGS) >= 64


@pytest.mark.parametrize("text, value", [("16x128x4", (16, 128, 4)), ("32X64x8", (32, 64, 8))])
def test_gemm_shapes_parse(text, value):
    assert gemm_config(text) == value


@pytest.mark.parametrize("text", ["16x128", "16x96x4", "0x64x4", "16x64x4x1", "axbxc", ""])
def test_a_bad_gemm_shape_is_refused_naming_it(text):
    with pytest.raises(argparse.ArgumentTypeError, match="PAIRSxROWSxWARPS") as err:
        gemm_config(text)
    assert repr(text) in str(err.value)
