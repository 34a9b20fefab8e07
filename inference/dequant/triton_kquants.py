"""Triton kernels of the 256-element K-quants: Q2_K, Q3_K, Q4_K, Q5_K, Q6_K.

Same arithmetic as torch_kquants (and gguf-py). Dequantizing is instruction-bound before it is
bandwidth-bound, so each packed byte is loaded once and every value it holds (2 nibbles, or 4
crumbs) is stored from it; tiles are shaped so that each sub-block's scale is one value per
tile row, computed once. Launch contract and the no-FMA rule are in triton_common.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes, load_fp16_as_f32, row_block_bases


@triton.jit
def _bases(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride,
           TYPE_SIZE: tl.constexpr, BLOCKS: tl.constexpr):
    """(block byte ptrs [B, 1, 1, 1], block out ptrs [B, 1, 1, 1], valid [B], mask [B, 1, 1, 1])."""
    raw_base, out_base, valid = row_block_bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, TYPE_SIZE, 256, BLOCKS)
    mask = valid[:, None, None, None]
    return raw_base[:, None, None, None], out_base[:, None, None, None], valid, mask


@triton.jit
def _store(out_ptrs, value, mask):
    tl.store(out_ptrs, value.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _crumb_layout():
    """Q2_K/Q3_K's 64 bytes of 2-bit codes as [1, h, half, t] = [1, 2, 2, 16]: byte
    32h + 16half + t holds elements 128h + 32sh + 16half + t at bits 2sh (sh = 0..3),
    which is sub-block 8h + 2sh + half."""
    h = tl.arange(0, 2)[None, :, None, None]
    half = tl.arange(0, 2)[None, None, :, None]
    t = tl.arange(0, 16)[None, None, None, :]
    return h, half, t


@triton.jit
def q2_k_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q2_K, 84 B: scales[16] @0 (lo nibble sc, hi nibble m), 2-bit qs @16, d @80, dmin @82;
    (d*sc) * q - (dmin*m)."""
    raw_base, out_base, valid, mask = _bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 84, BLOCKS)
    d = load_fp16_as_f32(raw_base + 80, mask)  # f32 [B, 1, 1, 1]
    dmin = load_fp16_as_f32(raw_base + 82, mask)
    h, half, t = _crumb_layout()
    packed = load_bytes(raw_base + 16 + 32 * h + 16 * half + t, mask)  # i32 [B, 2, 2, 16]
    for sh in tl.static_range(4):
        scales = load_bytes(raw_base + 8 * h + 2 * sh + half, mask)  # i32 [B, 2, 2, 1]
        scale = d * (scales & 0x0F).to(tl.float32)
        offset = dmin * (scales >> 4).to(tl.float32)
        q = ((packed >> (2 * sh)) & 0x03).to(tl.float32)
        _store(out_base + 128 * h + 32 * sh + 16 * half + t, scale * q - offset, mask)


@triton.jit
def q3_k_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q3_K, 110 B: hmask[32] @0, 2-bit qs @32, scales[12] @96, d @108; (d*sc) * q.

    Element 32k + i has its hmask bit at bit k of byte i (set: no -4 offset). 6-bit scale s:
    low nibble from byte 96 + s % 8 (high half when s >= 8), top 2 bits from byte
    104 + s % 4 at bit 2 * (s // 4); stored minus 32.
    """
    raw_base, out_base, valid, mask = _bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 110, BLOCKS)
    d = load_fp16_as_f32(raw_base + 108, mask)  # f32 [B, 1, 1, 1]
    h, half, t = _crumb_layout()
    packed = load_bytes(raw_base + 32 + 32 * h + 16 * half + t, mask)  # i32 [B, 2, 2, 16]
    hmask = load_bytes(raw_base + 16 * half + t, mask)  # i32 [B, 1, 2, 16]
    for sh in tl.static_range(4):
        sub = 8 * h + 2 * sh + half  # [1, 2, 2, 1]
        low = load_bytes(raw_base + 96 + sub % 8, mask)  # i32 [B, 2, 2, 1]
        high = load_bytes(raw_base + 104 + sub % 4, mask)
        six_bit = ((low >> (4 * (sub // 8))) & 0x0F) | (((high >> (2 * (sub // 4))) & 0x03) << 4)
        scale = d * (six_bit - 32).to(tl.float32)
        no_offset = (hmask >> (4 * h + sh)) & 0x01  # i32 [B, 2, 2, 16]
        q = ((packed >> (2 * sh)) & 0x03) - ((no_offset ^ 1) << 2)  # in [-4, 3]
        _store(out_base + 128 * h + 32 * sh + 16 * half + t, scale * q.to(tl.float32), mask)


@triton.jit
def _k_scales(raw_base, sub, mask):
    """Q4_K/Q5_K header (d @0, dmin @2, 12 scale bytes @4) -> (d*sc, dmin*m) for sub-blocks
    `sub`. With b the scale bytes: sc = b[s] & 63 (s < 4) or (b[s+4] & 15) | (b[s-4] >> 2 & 48);
    m = b[s+4] & 63 (s < 4) or (b[s+4] >> 4) | (b[s] >> 2 & 48)."""
    d = load_fp16_as_f32(raw_base, mask)
    dmin = load_fp16_as_f32(raw_base + 2, mask)
    upper = load_bytes(raw_base + 4 + sub + 4, mask)  # b[s + 4]
    lower = load_bytes(raw_base + 4 + sub % 4, mask)  # b[s % 4]
    own = load_bytes(raw_base + 4 + sub, mask)  # b[s]
    first = sub < 4
    sc = tl.where(first, lower & 0x3F, (upper & 0x0F) | ((lower >> 2) & 0x30))
    mins = tl.where(first, upper & 0x3F, (upper >> 4) | ((own >> 2) & 0x30))
    return d * sc.to(tl.float32), dmin * mins.to(tl.float32)


@triton.jit
def _k_nibble_layout():
    """Q4_K/Q5_K's 128 nibble bytes as [1, pair, 1, i] = [1, 4, 1, 32]: byte 32 pair + i holds
    sub-block 2 pair (low nibble) and 2 pair + 1 (high nibble), element i of each."""
    pair = tl.arange(0, 4)[None, :, None, None]
    i = tl.arange(0, 32)[None, None, None, :]
    return pair, i


@triton.jit
def q4_k_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q4_K, 144 B: d @0, dmin @2, scales @4, nibbles @16; (d*sc) * q - (dmin*m)."""
    raw_base, out_base, valid, mask = _bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 144, BLOCKS)
    pair, i = _k_nibble_layout()
    packed = load_bytes(raw_base + 16 + 32 * pair + i, mask)  # i32 [B, 4, 1, 32]
    for nibble in tl.static_range(2):
        scale, offset = _k_scales(raw_base, 2 * pair + nibble, mask)  # f32 [B, 4, 1, 1]
        q = ((packed >> (4 * nibble)) & 0x0F).to(tl.float32)
        _store(out_base + 64 * pair + 32 * nibble + i, scale * q - offset, mask)


@triton.jit
def q5_k_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q5_K, 176 B: Q4_K's header, qh[32] @16 (bit s of byte i: sub-block s), nibbles @48."""
    raw_base, out_base, valid, mask = _bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 176, BLOCKS)
    pair, i = _k_nibble_layout()
    packed = load_bytes(raw_base + 48 + 32 * pair + i, mask)  # i32 [B, 4, 1, 32]
    high_bits = load_bytes(raw_base + 16 + i, mask)  # i32 [B, 1, 1, 32]
    for nibble in tl.static_range(2):
        sub = 2 * pair + nibble  # [1, 4, 1, 1]
        scale, offset = _k_scales(raw_base, sub, mask)
        q = ((packed >> (4 * nibble)) & 0x0F) | (((high_bits >> sub) & 0x01) << 4)
        _store(out_base + 64 * pair + 32 * nibble + i, scale * q.to(tl.float32) - offset, mask)


@triton.jit
def q6_k_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q6_K, 210 B: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; (d*sc) * (q - 32).

    As [1, h, j, t] = [1, 2, 4, 16]: ql byte 64h + 16j + t holds elements 128h + 64n + 16j + t
    in nibble n; their top 2 bits are in qh byte 128 + 32h + 16(j % 2) + t at bit
    2(2n + j // 2); that element is in sub-block 8h + 4n + j.
    """
    raw_base, out_base, valid, mask = _bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 210, BLOCKS)
    d = load_fp16_as_f32(raw_base + 208, mask)  # f32 [B, 1, 1, 1]
    h = tl.arange(0, 2)[None, :, None, None]
    j = tl.arange(0, 4)[None, None, :, None]
    t = tl.arange(0, 16)[None, None, None, :]
    low_bits = load_bytes(raw_base + 64 * h + 16 * j + t, mask)  # i32 [B, 2, 4, 16]
    high_bits = load_bytes(raw_base + 128 + 32 * h + 16 * (j % 2) + t, mask)  # i32 [B, 2, 4, 16]
    for n in tl.static_range(2):
        sub = 8 * h + 4 * n + j  # [1, 2, 4, 1]
        sub_scale = tl.load(raw_base + 192 + sub, mask=mask, other=0).to(tl.int8, bitcast=True)
        scale = d * sub_scale.to(tl.float32)  # f32 [B, 2, 4, 1]
        q = ((low_bits >> (4 * n)) & 0x0F) | (((high_bits >> (2 * (2 * n + j // 2))) & 0x03) << 4)
        _store(out_base + 128 * h + 64 * n + 16 * j + t, scale * (q - 32).to(tl.float32), mask)
