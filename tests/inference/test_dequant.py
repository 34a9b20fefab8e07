"""Bit-exactness of inference.dequant against gguf-py, on CPU (torch) and CUDA (torch, triton)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dequant_cases import (
    ALL_TYPES,
    assert_bit_equal,
    edge_bytes,
    edge_cases,
    QUANT_TYPES,
    reference,
    shapes_for,
    valid_bytes,
)
from inference.dequant import dequantize, triton_backend

RANDOM_CASES = [
    pytest.param(qtype, shape, id=f"{qtype.name}-{'x'.join(map(str, shape))}")
    for qtype in ALL_TYPES
    for shape in shapes_for(qtype)
]
EDGE_CASES = [
    pytest.param(qtype, case, id=f"{qtype.name}-{case.name}")
    for qtype in QUANT_TYPES
    for case in edge_cases(qtype)
]
EDGE_SHAPE = (4, 512)  # 8 K-quant / 64 legacy blocks per edge case

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _seed(*parts: object) -> int:
    return sum(ord(c) for c in "/".join(map(str, parts)))


def _backends(device: str) -> list[str]:
    """Backends to compare on `device`: torch everywhere, triton too on CUDA when it imports."""
    if device == "cuda" and triton_backend() is not None:
        return ["torch", "triton"]
    return ["torch"]


def _check(qtype, raw: np.ndarray, shape, device: str, what: str) -> None:
    expected = reference(qtype, raw, shape)
    raw_tensor = torch.from_numpy(raw.copy()).to(device)
    for backend in _backends(device):
        if backend == "triton" and qtype not in triton_backend().TRITON_TYPES:
            continue
        actual = dequantize(raw_tensor, qtype, shape, backend=backend)
        assert actual.device.type == device
        assert_bit_equal(actual, expected, f"{what} [{device}/{backend}]")


@pytest.mark.parametrize(("qtype", "shape"), RANDOM_CASES)
def test_random_valid_blocks_match_gguf(qtype, shape):
    rng = np.random.default_rng(_seed(qtype, shape))
    _check(qtype, valid_bytes(qtype, shape, rng), shape, "cpu", f"{qtype.name} {shape}")


@pytest.mark.parametrize(("qtype", "case"), EDGE_CASES)
def test_edge_blocks_match_gguf(qtype, case):
    rng = np.random.default_rng(_seed(qtype, case.name))
    raw = edge_bytes(qtype, case, EDGE_SHAPE, rng)
    _check(qtype, raw, EDGE_SHAPE, "cpu", f"{qtype.name} {case.name}")


def _edge_values(qtype, case_name: str) -> torch.Tensor:
    from dequant_cases import E8M0_EDGES, FP16_EDGES

    case = next(case for case in FP16_EDGES + E8M0_EDGES if case.name == case_name)
    raw = edge_bytes(qtype, case, EDGE_SHAPE, np.random.default_rng(1))
    return dequantize(torch.from_numpy(raw), qtype, EDGE_SHAPE)


def test_edge_cases_produce_the_values_they_name():
    """The edge table really reaches signed zeros, f32 subnormals and infinities."""
    from packformat.constants import ElementType

    zeros = _edge_values(ElementType.Q4_0, "negative_zero_scales")
    assert (zeros == 0).all() and torch.signbit(zeros).any() and not torch.signbit(zeros).all()
    tiny = _edge_values(ElementType.MXFP4, "e8m0_zero_subnormal_scale")
    assert (tiny[tiny != 0].abs() < torch.finfo(torch.float32).tiny).any()  # 2**-128 * k, k < 4
    huge = _edge_values(ElementType.MXFP4, "e8m0_255_overflows_to_inf")
    assert torch.isinf(huge).any() and not torch.isnan(huge).any()


def test_result_does_not_alias_raw_bytes():
    """F32 must be copied out: the caller's slot bytes may be reused right after the call."""
    from packformat.constants import ElementType

    raw = torch.from_numpy(np.arange(8, dtype=np.float32).view(np.uint8).copy())
    values = dequantize(raw, ElementType.F32, (8,))
    raw.zero_()
    assert values.tolist() == [float(i) for i in range(8)]


def test_unaligned_and_strided_raw_bytes_are_read_correctly():
    """A role may start at any byte of a buffer; fp16 fields and float views must not care."""
    for qtype in ALL_TYPES:
        shape = shapes_for(qtype)[1]
        raw = valid_bytes(qtype, shape, np.random.default_rng(_seed("unaligned", qtype)))
        buffer = torch.zeros(raw.size + 3, dtype=torch.uint8)
        buffer[1 : 1 + raw.size] = torch.from_numpy(raw)
        actual = dequantize(buffer[1 : 1 + raw.size], qtype, shape)
        assert_bit_equal(actual, reference(qtype, raw, shape), f"{qtype.name} at offset 1")
        every_other = torch.zeros(2 * raw.size, dtype=torch.uint8)
        every_other[::2] = torch.from_numpy(raw)
        actual = dequantize(every_other[::2], qtype, shape)
        assert_bit_equal(actual, reference(qtype, raw, shape), f"{qtype.name} at byte stride 2")


# --- CUDA: the same tables through the torch path and the triton kernels. ---


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("qtype", "shape"), RANDOM_CASES)
def test_cuda_random_valid_blocks_match_gguf(qtype, shape):
    rng = np.random.default_rng(_seed(qtype, shape))
    _check(qtype, valid_bytes(qtype, shape, rng), shape, "cuda", f"{qtype.name} {shape}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(("qtype", "case"), EDGE_CASES)
def test_cuda_edge_blocks_match_gguf(qtype, case):
    rng = np.random.default_rng(_seed(qtype, case.name))
    raw = edge_bytes(qtype, case, EDGE_SHAPE, rng)
    _check(qtype, raw, EDGE_SHAPE, "cuda", f"{qtype.name} {case.name}")


@pytest.mark.gpu
@needs_cuda
def test_cuda_has_triton_kernels_for_the_hot_types():
    module = triton_backend()
    assert module is not None, "triton should import on the GPU machine"
    from packformat.constants import ElementType

    hot = {ElementType.Q4_K, ElementType.MXFP4, ElementType.Q2_K, ElementType.Q3_K, ElementType.Q8_0}
    assert hot <= module.TRITON_TYPES
