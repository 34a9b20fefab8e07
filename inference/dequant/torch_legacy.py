"""Torch dequantizers of the 32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4.

Each mirrors gguf-py 0.19.0's `<Type>.dequantize_blocks` (gguf/quants.py) op for op; byte
layouts are given as offsets inside one block. See torch_common for the shared contract.
"""

from __future__ import annotations

import functools

import torch

from inference.dequant.torch_common import fp16_field, little_endian_bits32, nibble_planes

QK = 32  # elements per block of every type here


def _nibbles(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """16 packed bytes at `offset` -> uint8 [n, 32]: 16 low nibbles then 16 high nibbles."""
    packed = blocks[:, offset : offset + QK // 2].reshape(-1, 1, QK // 2)  # uint8 [n, 1, 16]
    return nibble_planes(packed).reshape(-1, QK)  # uint8 [n, 32]


def dequantize_q8_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q8_0, 34 B: fp16 d @0, int8 x[32] @2; value = x * d."""
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    x = blocks[:, 2:34].view(torch.int8).to(torch.float32)  # f32 [n, 32]
    return x * d


def dequantize_q4_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0, 18 B: fp16 d @0, nibbles @2; value = d * (q - 8)."""
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    q = _nibbles(blocks, 2).to(torch.int8) - 8  # int8 [n, 32] in [-8, 7]
    return d * q.to(torch.float32)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1, 20 B: fp16 d @0, fp16 m @2, nibbles @4; value = (d * q) + m."""
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    m = fp16_field(blocks, 2)  # f32 [n, 1]
    q = _nibbles(blocks, 4).to(torch.float32)  # f32 [n, 32] in [0, 15]
    return (d * q) + m


def _five_bit(blocks: torch.Tensor, high_offset: int, low_offset: int) -> torch.Tensor:
    """uint8 [n, 32] 5-bit codes: nibble at low_offset, bit 4 from the uint32 at high_offset."""
    high = little_endian_bits32(blocks[:, high_offset : high_offset + 4])  # uint8 [n, 32] 0/1
    return _nibbles(blocks, low_offset) | (high << 4)  # uint8 [n, 32] in [0, 31]


def dequantize_q5_0(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_0, 22 B: fp16 d @0, uint32 qh @2, nibbles @6; value = d * (q - 16)."""
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    q = _five_bit(blocks, 2, 6).to(torch.int8) - 16  # int8 [n, 32] in [-16, 15]
    return d * q.to(torch.float32)


def dequantize_q5_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_1, 24 B: fp16 d @0, fp16 m @2, uint32 qh @4, nibbles @8; value = (d * q) + m."""
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    m = fp16_field(blocks, 2)  # f32 [n, 1]
    q = _five_bit(blocks, 4, 8).to(torch.float32)  # f32 [n, 32] in [0, 31]
    return (d * q) + m


# e2m1 code -> value, doubled (gguf-py's MXFP4.kvalues); the halving is folded into the scale.
MXFP4_KVALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


@functools.lru_cache(maxsize=None)
def _mxfp4_table(device: torch.device) -> torch.Tensor:
    return torch.tensor(MXFP4_KVALUES, dtype=torch.float32, device=device)  # f32 [16]


def e8m0_to_fp32_half(exponent: torch.Tensor) -> torch.Tensor:
    """E8M0 byte e -> 2**(e - 128) as float32 bits, like ggml_e8m0_to_fp32_half.

    e < 2 gives a float32 subnormal (0x00200000 << e); e = 255 gives 2**127, not NaN.
    """
    e = exponent.to(torch.int32)  # int32 [n, 1] in [0, 255]
    subnormal = e.new_full(e.shape, 0x00200000) << e  # int32 [n, 1] bits
    normal = (e - 1) << 23  # int32 [n, 1] bits; e = 0, 1 never selected
    return torch.where(e < 2, subnormal, normal).view(torch.float32)  # f32 [n, 1]


def dequantize_mxfp4(blocks: torch.Tensor) -> torch.Tensor:
    """MXFP4, 17 B: E8M0 e @0, e2m1 nibbles @1; value = e8m0_half(e) * kvalues[q]."""
    d = e8m0_to_fp32_half(blocks[:, 0:1])  # f32 [n, 1]
    codes = _nibbles(blocks, 1).to(torch.int64)  # int64 [n, 32] in [0, 15]
    values = _mxfp4_table(blocks.device)[codes]  # f32 [n, 32]
    return d * values
