"""Torch dequantizers of the 256-element K-quant super-blocks: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Each mirrors gguf-py 0.19.0's `<Type>.dequantize_blocks` (gguf/quants.py) op for op, including
the float32 order `d * sc * q - dmin * m` as (d * sc) * q - (dmin * m); byte layouts are given as
offsets inside one super-block. See torch_common for the shared contract.
"""

from __future__ import annotations

import torch

from inference.dequant.torch_common import (
    bit_planes,
    crumb_planes,
    fp16_field,
    nibble_planes,
    shift_amounts,
)

QK_K = 256  # elements per super-block


def dequantize_q2_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q2_K, 84 B: scales[16] @0 (lo nibble sc, hi nibble m), 2-bit qs[64] @16, d @80, dmin @82."""
    n = blocks.shape[0]
    scales = blocks[:, 0:16]  # uint8 [n, 16]
    d = fp16_field(blocks, 80)  # f32 [n, 1]
    dmin = fp16_field(blocks, 82)  # f32 [n, 1]
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(n, 16, 1)  # f32 [n, 16, 1]
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(n, 16, 1)  # f32 [n, 16, 1]
    qs = crumb_planes(blocks[:, 16:80].reshape(n, 2, 32))  # uint8 [n, 2, 4, 32]
    q = qs.reshape(n, 16, 16).to(torch.float32)  # f32 [n, 16 sub-blocks, 16]
    return (dl * q - ml).reshape(n, QK_K)


def q3_k_scales(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 12] packed 6-bit scales -> int8 [n, 16] in [-32, 31].

    Bytes 0..7 hold the low nibbles (scale k < 8 in byte k's low half, k >= 8 in byte k-8's
    high half); bytes 8..11 hold the top 2 bits (scale 4s + j at bits 2s of byte 8 + j).
    """
    n = scales.shape[0]
    low_shifts = shift_amounts(0, 8, 4, scales.device).reshape(1, 2, 1)
    high_shifts = shift_amounts(0, 8, 2, scales.device).reshape(1, 4, 1)
    low = (scales[:, 0:8].reshape(n, 1, 8) >> low_shifts).reshape(n, 16)  # uint8 [n, 16]
    high = (scales[:, 8:12].reshape(n, 1, 4) >> high_shifts).reshape(n, 16)  # uint8 [n, 16]
    packed = (low & 0x0F) | ((high & 0x03) << 4)  # uint8 [n, 16] in [0, 63]
    return packed.to(torch.int8) - 32


def dequantize_q3_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q3_K, 110 B: hmask[32] @0, 2-bit qs[64] @32, scales[12] @96, d @108.

    value = (d * scale) * (q_low - 4 * (1 - hbit)): a set hmask bit means no offset.
    """
    n = blocks.shape[0]
    d = fp16_field(blocks, 108)  # f32 [n, 1]
    scales = q3_k_scales(blocks[:, 96:108]).to(torch.float32)  # f32 [n, 16]
    dl = (d * scales).reshape(n, 16, 1)  # f32 [n, 16, 1]
    q_low = crumb_planes(blocks[:, 32:96].reshape(n, 2, 32)).reshape(n, 16, 16)  # uint8 0..3
    h_bit = bit_planes(blocks[:, 0:32].reshape(n, 1, 32)).reshape(n, 16, 16)  # uint8 0/1
    h_bit = h_bit ^ 1
    q = (q_low.to(torch.int8) - (h_bit << 2).to(torch.int8)).to(torch.float32)  # f32 [n, 16, 16]
    return (dl * q).reshape(n, QK_K)


def k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """uint8 [n, 12] -> (sc, m), each uint8 [n, 8] 6-bit: gguf-py's Q4_K.get_scale_min.

    Bytes 0..3: sc 0..3 (low 6 bits) + top bits of sc 4..7; bytes 4..7: m 0..3 + top bits of
    m 4..7; bytes 8..11: low nibbles of sc 4..7 (low half) and m 4..7 (high half).
    """
    n = scales.shape[0]
    grouped = scales.reshape(n, 3, 4)
    d, m, m_d = grouped[:, 0], grouped[:, 1], grouped[:, 2]  # uint8 [n, 4] each
    sc = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)  # uint8 [n, 8]
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)  # uint8 [n, 8]
    return sc, mins


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K header (d @0, dmin @2, scales @4..16) -> (d * sc, dmin * m), f32 [n, 8, 1]."""
    n = blocks.shape[0]
    d = fp16_field(blocks, 0)  # f32 [n, 1]
    dmin = fp16_field(blocks, 2)  # f32 [n, 1]
    sc, mins = k_scale_min(blocks[:, 4:16])
    scale = (d * sc.to(torch.float32)).reshape(n, 8, 1)  # f32 [n, 8, 1]
    offset = (dmin * mins.to(torch.float32)).reshape(n, 8, 1)  # f32 [n, 8, 1]
    return scale, offset


def dequantize_q4_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_K, 144 B: d @0, dmin @2, scales @4, nibbles[128] @16; value = (d*sc) * q - (dmin*m).

    Sub-block 2j is the low nibbles of bytes 16 + 32j .. +31, sub-block 2j+1 their high nibbles.
    """
    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    q = nibble_planes(blocks[:, 16:144].reshape(n, 4, 32)).reshape(n, 8, 32)  # uint8 0..15
    return (scale * q.to(torch.float32) - offset).reshape(n, QK_K)


def dequantize_q5_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q5_K, 176 B: d @0, dmin @2, scales @4, qh[32] @16 (bit j = sub-block j), nibbles @48."""
    n = blocks.shape[0]
    scale, offset = _k_scales(blocks)
    q_low = nibble_planes(blocks[:, 48:176].reshape(n, 4, 32)).reshape(n, 8, 32)  # uint8 0..15
    q_high = bit_planes(blocks[:, 16:48].reshape(n, 1, 32)).reshape(n, 8, 32)  # uint8 0/1
    q = (q_low | (q_high << 4)).to(torch.float32)  # f32 [n, 8, 32] in [0, 31]
    return (scale * q - offset).reshape(n, QK_K)


def dequantize_q6_k(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K, 210 B: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; d*sc * (q - 32)."""
    n = blocks.shape[0]
    scales = blocks[:, 192:208].view(torch.int8).to(torch.float32)  # f32 [n, 16]
    d = fp16_field(blocks, 208)  # f32 [n, 1]
    dl = (d * scales).reshape(n, 16, 1)  # f32 [n, 16, 1]
    q_low = nibble_planes(blocks[:, 0:128].reshape(n, 2, 64)).reshape(n, 8, 32)  # uint8 0..15
    q_high = crumb_planes(blocks[:, 128:192].reshape(n, 2, 32)).reshape(n, 8, 32)  # uint8 0..3
    q = (q_low | (q_high << 4)).to(torch.int8) - 32  # int8 [n, 8, 32] in [-32, 31]
    return (dl * q.reshape(n, 16, 16).to(torch.float32)).reshape(n, QK_K)
