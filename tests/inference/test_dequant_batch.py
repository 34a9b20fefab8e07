"""dequantize_many (several experts of one layer at once) and the non-float32 output dtypes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dequant_cases import ALL_TYPES, assert_bit_equal, nbytes_of, reference, valid_bytes
from inference.dequant import dequantize, dequantize_many, triton_backend
from packformat.constants import ElementType, block_shape

EXPERTS = 3
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _role_shape(qtype: ElementType) -> tuple[int, ...]:
    """A small [rows, cols] role whose row holds several blocks (several programs on the GPU)."""
    return (5, 4 * max(block_shape(qtype)[0], 256))


def _experts(qtype: ElementType, shape: tuple[int, ...]) -> list[np.ndarray]:
    rng = np.random.default_rng(int(qtype) + 100)
    return [valid_bytes(qtype, shape, rng) for _ in range(EXPERTS)]


def _arena(experts: list[np.ndarray], slot_size: int, role_offset: int, device: str) -> torch.Tensor:
    """uint8 [N, nbytes] rows that are strided views into one arena of `slot_size`-byte slots,
    like roles of cached experts inside storaged's VRAM arena."""
    arena = torch.zeros(len(experts), slot_size, dtype=torch.uint8)  # uint8 [N, slot_size]
    for slot, raw in enumerate(experts):
        arena[slot, role_offset : role_offset + raw.size] = torch.from_numpy(raw)
    arena = arena.to(device)
    return arena[:, role_offset : role_offset + experts[0].size]  # [N, nbytes], row stride slot_size


def _backends(device: str, qtype: ElementType) -> list[str]:
    module = triton_backend() if device == "cuda" else None
    return ["torch", "triton"] if module is not None and qtype in module.TRITON_TYPES else ["torch"]


def _check_batch(qtype: ElementType, device: str) -> None:
    shape = _role_shape(qtype)
    experts = _experts(qtype, shape)
    expected = torch.stack([reference(qtype, raw, shape) for raw in experts])  # f32 [N, *shape]
    nbytes = nbytes_of(qtype, shape)
    as_list = [torch.from_numpy(raw.copy()).to(device) for raw in experts]
    as_rows = torch.stack(as_list)  # uint8 [N, nbytes], contiguous
    as_arena = _arena(experts, slot_size=nbytes + 4096 + 3, role_offset=1, device=device)
    assert as_arena.stride(0) != nbytes
    for backend in _backends(device, qtype):
        for form, raws in (("list", as_list), ("rows", as_rows), ("arena", as_arena)):
            actual = dequantize_many(raws, qtype, shape, backend=backend)
            assert_bit_equal(actual, expected, f"{qtype.name} {form} [{device}/{backend}]")
        for out_dtype in (torch.bfloat16, torch.float16):
            actual = dequantize_many(as_arena, qtype, shape, out_dtype=out_dtype, backend=backend)
            assert actual.dtype == out_dtype
            # One rounding from the exact float32 value, like torch's own cast.
            want = expected.to(device).to(out_dtype)
            assert torch.equal(actual.view(torch.int16), want.view(torch.int16)), (
                f"{qtype.name} {out_dtype} [{device}/{backend}]"
            )


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_many_equals_each_alone_on_cpu(qtype):
    _check_batch(qtype, "cpu")


def test_many_of_one_matches_single_call_and_empty_batch_is_empty():
    qtype, shape = ElementType.Q4_K, (2, 512)
    raw = valid_bytes(qtype, shape, np.random.default_rng(7))
    single = dequantize(torch.from_numpy(raw), qtype, shape)
    batch = dequantize_many(torch.from_numpy(raw).reshape(1, -1), qtype, shape)
    assert batch.shape == (1, *shape)
    assert_bit_equal(batch[0], single, "batch of one")
    empty = dequantize_many(torch.zeros(0, raw.size, dtype=torch.uint8), qtype, shape)
    assert empty.shape == (0, *shape) and empty.dtype == torch.float32


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_many_equals_each_alone_on_cuda(qtype):
    _check_batch(qtype, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_cuda_auto_backend_uses_triton_and_agrees_with_torch():
    """'auto' on CUDA takes the triton path where a kernel exists; same bits as forced torch."""
    module = triton_backend()
    assert module is not None
    for qtype in sorted(module.TRITON_TYPES):
        shape = (64, 4096)
        raw = torch.from_numpy(valid_bytes(qtype, shape, np.random.default_rng(int(qtype)))).cuda()
        auto = dequantize(raw, qtype, shape)
        forced = dequantize(raw, qtype, shape, backend="torch")
        assert torch.equal(auto.view(torch.int32), forced.view(torch.int32)), qtype.name
