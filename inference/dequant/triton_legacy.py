"""Triton kernels of the 32-element block types: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4.

Same arithmetic as torch_legacy (and gguf-py). Dequantizing is instruction-bound before it is
bandwidth-bound, so each packed byte is loaded once: a program holds a [BLOCKS, 16] tile of
payload bytes and stores the low nibbles as elements 0..15 and the high ones as 16..31.
Launch contract and the no-FMA rule are in triton_common.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes, load_fp16_as_f32, row_block_bases


@triton.jit
def _tile(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride,
          TYPE_SIZE: tl.constexpr, BLOCKS: tl.constexpr):
    """(block byte ptrs [B], out ptrs [B, 16] of elements 0..15, valid [B], mask [B, 1], lane [1, 16])."""
    raw_base, out_base, valid = row_block_bases(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, TYPE_SIZE, 32, BLOCKS)
    lane = tl.arange(0, 16)[None, :]  # [1, 16] payload byte
    return raw_base, out_base[:, None] + lane, valid, valid[:, None], lane


@triton.jit
def _store_halves(out_ptrs, low, high, mask):
    """Elements 0..15 from the low nibbles, 16..31 from the high ones."""
    tl.store(out_ptrs, low.to(out_ptrs.dtype.element_ty), mask=mask)
    tl.store(out_ptrs + 16, high.to(out_ptrs.dtype.element_ty), mask=mask)


@triton.jit
def _qh_word(raw_base, offset: tl.constexpr, valid):
    """The little-endian uint32 of high bits at `offset`, as int32 [B, 1] (bit j = element j)."""
    word = load_bytes(raw_base + offset, valid)
    word |= load_bytes(raw_base + offset + 1, valid) << 8
    word |= load_bytes(raw_base + offset + 2, valid) << 16
    word |= load_bytes(raw_base + offset + 3, valid) << 24
    return word[:, None]


@triton.jit
def q8_0_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q8_0, 34 B: fp16 d @0, int8 x[32] @2; x * d."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 34, BLOCKS)
    d = load_fp16_as_f32(raw_base, valid)[:, None]  # f32 [B, 1]
    low = tl.load(raw_base[:, None] + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True)
    high = tl.load(raw_base[:, None] + 18 + lane, mask=mask, other=0).to(tl.int8, bitcast=True)
    _store_halves(out_ptrs, low.to(tl.float32) * d, high.to(tl.float32) * d, mask)


@triton.jit
def q4_0_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q4_0, 18 B: fp16 d @0, nibbles @2; d * (q - 8)."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 18, BLOCKS)
    d = load_fp16_as_f32(raw_base, valid)[:, None]  # f32 [B, 1]
    packed = load_bytes(raw_base[:, None] + 2 + lane, mask)  # i32 [B, 16]
    low = d * ((packed & 0x0F) - 8).to(tl.float32)
    high = d * ((packed >> 4) - 8).to(tl.float32)
    _store_halves(out_ptrs, low, high, mask)


@triton.jit
def q4_1_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q4_1, 20 B: fp16 d @0, fp16 m @2, nibbles @4; (d * q) + m."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 20, BLOCKS)
    d = load_fp16_as_f32(raw_base, valid)[:, None]  # f32 [B, 1]
    m = load_fp16_as_f32(raw_base + 2, valid)[:, None]  # f32 [B, 1]
    packed = load_bytes(raw_base[:, None] + 4 + lane, mask)  # i32 [B, 16]
    low = (d * (packed & 0x0F).to(tl.float32)) + m
    high = (d * (packed >> 4).to(tl.float32)) + m
    _store_halves(out_ptrs, low, high, mask)


@triton.jit
def q5_0_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q5_0, 22 B: fp16 d @0, uint32 qh @2, nibbles @6; d * (q - 16)."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 22, BLOCKS)
    d = load_fp16_as_f32(raw_base, valid)[:, None]  # f32 [B, 1]
    qh = _qh_word(raw_base, 2, valid)  # i32 [B, 1]
    packed = load_bytes(raw_base[:, None] + 6 + lane, mask)  # i32 [B, 16]
    low = (packed & 0x0F) | (((qh >> lane) & 1) << 4)
    high = (packed >> 4) | (((qh >> (lane + 16)) & 1) << 4)
    _store_halves(out_ptrs, d * (low - 16).to(tl.float32), d * (high - 16).to(tl.float32), mask)


@triton.jit
def q5_1_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """Q5_1, 24 B: fp16 d @0, fp16 m @2, uint32 qh @4, nibbles @8; (d * q) + m."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 24, BLOCKS)
    d = load_fp16_as_f32(raw_base, valid)[:, None]  # f32 [B, 1]
    m = load_fp16_as_f32(raw_base + 2, valid)[:, None]  # f32 [B, 1]
    qh = _qh_word(raw_base, 4, valid)  # i32 [B, 1]
    packed = load_bytes(raw_base[:, None] + 8 + lane, mask)  # i32 [B, 16]
    low = (packed & 0x0F) | (((qh >> lane) & 1) << 4)
    high = (packed >> 4) | (((qh >> (lane + 16)) & 1) << 4)
    _store_halves(out_ptrs, (d * low.to(tl.float32)) + m, (d * high.to(tl.float32)) + m, mask)


@triton.jit
def _mxfp4_value(code, d):
    """d * kvalues[code] for e2m1 codes 0..15 (kvalues doubled: 0,1,2,3,4,6,8,12, negated).

    Magnitudes come from the nibbles of 0xC8643210; the sign is applied to the rounded
    product (IEEE negation is exact), and code 8 stays +0 like gguf-py's int8 zero.
    """
    table = tl.full(code.shape, 0xC8643210, tl.uint32)
    magnitude = (table >> ((code & 7) * 4).to(tl.uint32)) & 0xF
    product = d * magnitude.to(tl.float32)
    return tl.where(code > 8, -product, product)


@triton.jit
def mxfp4_kernel(raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, BLOCKS: tl.constexpr):
    """MXFP4, 17 B: E8M0 e @0, e2m1 nibbles @1; e8m0_half(e) * kvalue(q)."""
    raw_base, out_ptrs, valid, mask, lane = _tile(
        raw_ptr, out_ptr, blocks_per_row, raw_row_stride, out_row_stride, 17, BLOCKS)
    e = load_bytes(raw_base, valid)[:, None]  # i32 [B, 1] biased exponent
    # 2**(e - 128): a float32 subnormal for e < 2, like ggml_e8m0_to_fp32_half.
    subnormal = tl.full([BLOCKS, 1], 0x00200000, tl.int32) << e
    d = tl.where(e < 2, subnormal, (tl.maximum(e, 1) - 1) << 23).to(tl.float32, bitcast=True)
    packed = load_bytes(raw_base[:, None] + 1 + lane, mask)  # i32 [B, 16]
    _store_halves(out_ptrs, _mxfp4_value(packed & 0x0F, d), _mxfp4_value(packed >> 4, d), mask)
