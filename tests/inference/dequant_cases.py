"""Test inputs for the dequantizers: valid random blocks, edge cases, and gguf-py's reference.

Shared by test_dequant*.py (CPU and GPU). "Valid" means every fp16 scale field holds a finite
value from a sane range (random bytes there would give inf/NaN, which prove nothing), MXFP4's
E8M0 byte a moderate exponent, and F16/BF16/F32 data finite values; all other bytes are random.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import gguf
import numpy as np
import torch

from packformat.constants import SELF_CONTAINED_TYPES, ElementType, block_shape

# Byte offsets of the fp16 scale fields inside one block (see gguf-py's dequantize_blocks).
FP16_FIELDS: dict[ElementType, tuple[int, ...]] = {
    ElementType.Q8_0: (0,),
    ElementType.Q4_0: (0,),
    ElementType.Q4_1: (0, 2),
    ElementType.Q5_0: (0,),
    ElementType.Q5_1: (0, 2),
    ElementType.Q2_K: (80, 82),
    ElementType.Q3_K: (108,),
    ElementType.Q4_K: (0, 2),
    ElementType.Q5_K: (0, 2),
    ElementType.Q6_K: (208,),
}
E8M0_FIELDS: dict[ElementType, tuple[int, ...]] = {ElementType.MXFP4: (0,)}
FLOAT_TYPES = (ElementType.F32, ElementType.F16, ElementType.BF16)
# gguf-py is the reference, so these are the pack's GGML types; its own types (F4_E2M1X2 with
# UE8M0 scales) are checked in test_dequant_scaled.py
QUANT_TYPES = tuple(sorted(set(SELF_CONTAINED_TYPES) - set(FLOAT_TYPES)))
ALL_TYPES = tuple(sorted(SELF_CONTAINED_TYPES))
assert set(FP16_FIELDS) | set(E8M0_FIELDS) == set(QUANT_TYPES)


def shapes_for(qtype: ElementType) -> list[tuple[int, ...]]:
    """One block, several rows of a few blocks, and a [64, 512] matrix."""
    block_elems = max(block_shape(qtype)[0], 1)
    return [(block_elems,), (3, 2 * max(block_elems, 32)), (64, 512)]


def nbytes_of(qtype: ElementType, shape: tuple[int, ...]) -> int:
    block_elems, type_size = block_shape(qtype)
    return math.prod(shape) // block_elems * type_size


def _random_fp16_bits(rng: np.random.Generator, count: int) -> np.ndarray:
    """uint16 [count] bits of fp16 values +-2**[-14, 4): normal, finite, both signs."""
    magnitude = np.exp2(rng.uniform(-14.0, 4.0, count)).astype(np.float16)
    sign = np.where(rng.random(count) < 0.5, -1, 1).astype(np.float16)
    return (magnitude * sign).view(np.uint16)


def _random_floats(qtype: ElementType, rng: np.random.Generator, count: int) -> np.ndarray:
    """uint8 bytes of `count` finite values, with zeros, signed zeros and subnormals mixed in."""
    values = rng.standard_normal(count).astype(np.float32) * np.float32(4.0)
    specials = np.array([0.0, -0.0, 1e-45, -3e-39, 6e-8, -6.1e-5, 65504.0, 1.5], dtype=np.float32)
    values[: min(count, specials.size)] = specials[: min(count, specials.size)]
    if qtype == ElementType.F32:
        return values.view(np.uint8)
    if qtype == ElementType.F16:
        return values.astype(np.float16).view(np.uint8)
    return (values.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)  # BF16 truncation


def valid_bytes(qtype: ElementType, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """uint8 [nbytes] of valid random blocks of `qtype` for a tensor of `shape`."""
    nbytes = nbytes_of(qtype, shape)
    if qtype in FLOAT_TYPES:
        return _random_floats(qtype, rng, math.prod(shape))
    _, type_size = block_shape(qtype)
    blocks = rng.integers(0, 256, size=(nbytes // type_size, type_size), dtype=np.uint8)
    for offset in FP16_FIELDS.get(qtype, ()):
        bits = _random_fp16_bits(rng, blocks.shape[0])
        blocks[:, offset : offset + 2] = bits.view(np.uint8).reshape(-1, 2)
    for offset in E8M0_FIELDS.get(qtype, ()):
        blocks[:, offset] = rng.integers(110, 145, size=blocks.shape[0], dtype=np.uint8)
    return blocks.reshape(-1)


@dataclass(frozen=True)
class EdgeCase:
    """Valid random blocks, then every scale field set to `scale_bits` (fp16 bits, or the E8M0
    byte for MXFP4; None keeps the random scales) and the other bytes to `payload` if given."""

    name: str
    scale_bits: int | None
    payload: int | None = None


FP16_EDGES = (
    EdgeCase("zero_scales", 0x0000),
    EdgeCase("negative_zero_scales", 0x8000),
    EdgeCase("negative_scales", 0xB555),  # -0.3333
    EdgeCase("smallest_subnormal_scales", 0x0001),
    EdgeCase("largest_subnormal_negative_scales", 0x83FF),
    EdgeCase("largest_finite_scales", 0x7BFF),  # 65504
    EdgeCase("max_codes", None, 0xFF),
    EdgeCase("min_codes", None, 0x00),
    EdgeCase("negative_scales_max_codes", 0xC000, 0xFF),  # -2.0
    EdgeCase("subnormal_scales_alternating_codes", 0x0200, 0xA5),
)
E8M0_EDGES = (
    EdgeCase("e8m0_zero_subnormal_scale", 0),
    EdgeCase("e8m0_one_subnormal_scale", 1),
    EdgeCase("e8m0_two", 2),
    EdgeCase("e8m0_unit", 127),
    EdgeCase("e8m0_largest_finite_products", 253),
    EdgeCase("e8m0_255_overflows_to_inf", 255),
    EdgeCase("max_codes", None, 0xFF),
    EdgeCase("codes_0x88_are_signed_zeros", None, 0x88),
)


def edge_cases(qtype: ElementType) -> tuple[EdgeCase, ...]:
    return E8M0_EDGES if qtype in E8M0_FIELDS else FP16_EDGES


def edge_bytes(
    qtype: ElementType, case: EdgeCase, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """uint8 [nbytes]: valid random blocks with `case` applied."""
    blocks = valid_bytes(qtype, shape, rng).reshape(-1, block_shape(qtype)[1])
    fp16_fields, e8m0_fields = FP16_FIELDS.get(qtype, ()), E8M0_FIELDS.get(qtype, ())
    scale_bytes = [o for f in fp16_fields for o in (f, f + 1)] + list(e8m0_fields)
    if case.payload is not None:
        payload_columns = [c for c in range(blocks.shape[1]) if c not in scale_bytes]
        blocks[:, payload_columns] = case.payload
    if case.scale_bits is not None:
        for offset in fp16_fields:
            blocks[:, offset] = case.scale_bits & 0xFF
            blocks[:, offset + 1] = case.scale_bits >> 8
        for offset in e8m0_fields:
            blocks[:, offset] = case.scale_bits
    return blocks.reshape(-1)


def reference(qtype: ElementType, raw: np.ndarray, shape: tuple[int, ...]) -> torch.Tensor:
    """gguf-py's float32 dequantization of `raw` for a tensor of `shape`."""
    rows = raw.reshape(math.prod(shape[:-1]), -1)  # uint8 [rows, bytes per row]
    with np.errstate(over="ignore"):  # e8m0 = 255 overflows to inf on purpose
        values = gguf.quants.dequantize(rows, gguf.GGMLQuantizationType(qtype))
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32).reshape(shape))


def assert_bit_equal(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    """Equal bit patterns: +0 and -0 differ, as do any two NaN payloads (none are expected)."""
    assert actual.dtype == torch.float32, f"{what}: dtype {actual.dtype}"
    assert tuple(actual.shape) == tuple(expected.shape), f"{what}: shape {tuple(actual.shape)}"
    actual_bits = actual.detach().cpu().contiguous().view(torch.int32)
    expected_bits = expected.contiguous().view(torch.int32)
    if not torch.equal(actual_bits, expected_bits):
        bad = (actual_bits != expected_bits).nonzero()[0].tolist()
        index = tuple(bad)
        raise AssertionError(
            f"{what}: first mismatch at {index}: got {actual.cpu()[index].item()!r}, "
            f"gguf-py {expected[index].item()!r}; {(actual_bits != expected_bits).sum().item()} differ"
        )
