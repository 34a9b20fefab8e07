"""Triton device functions: the dot product of quantized weight rows with an activation row.

This module has the plain floats and the 32-element block types, and the helpers every type
shares (rounding, the activation loads, the tile reduction); the 256-element K-quants are in
inference.kernels.quant_dot_k, and the grouped GEMM's weight tiles in inference.kernels.quant_tile.

Each `dot_<type>` reads one step of a tile of weight rows in their GGML block format, dequantizes
them with gguf-py's arithmetic (the same formulas as inference.dequant's kernels: bit-exact
float32 values), rounds each weight to the model's dtype (what a resident model holds after
loading the dequantized tensor), and returns the float32 products with the matching activations
as a tile (not yet summed: the caller accumulates tiles across steps and reduces once at the
end, `reduce_tile`, rather than paying a cross-thread reduction every step; MXFP4's
`dot_mxfp4_acc` adds its products to the accumulator it is given, by fma). Nothing is written
to memory: the weights are read once, in place, from the slot.

Common arguments:
    row    [BN, 1] uint8 pointers to the first byte of each weight row
    kb     index of the first block of this step (a step covers NB blocks)
    nblk   blocks per row (the step's tail beyond it is masked)
    x_row  pointer to the activation row (model dtype), element k = x_row[k]
    rmask  [BN, 1] rows that exist
Returns a float32 tile whose first dimension is BN (its other dimensions depend on the type).

A weight row's K elements are split into blocks; elements are visited in a permuted order that
follows the packed bytes, and the activations are loaded at the same element indices, so the
dot product needs no reordering of the values. Kernels using these must be launched with
enable_fp_fusion=False so the dequantization rounds like gguf-py (see inference.dequant).
MXFP4's codes, which its 17-byte blocks put at every alignment, are read byte by byte: reading the
aligned 4-byte words around them and realigning by funnel shifts cut the SASS loads (19 -> 11 a
step) but made the grouped GEMM 1.61x slower on an H100 (12.05 -> 19.37 ms for a 64-token
DeepSeek-like prefill) and left the GEMV's time as it was. The
grouped GEMM rounds its operand with `to_model_dtype`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes, load_fp16_as_f32

# Rounding of dequantized weights to the model's dtype (the `WR` constexpr).
ROUND_NONE, ROUND_BF16, ROUND_F16 = 0, 1, 2


@triton.jit
def round_weights(v, WR: tl.constexpr, BITWISE: tl.constexpr):
    """float32 values rounded to the model dtype and widened back (exactly what a bf16/f16
    tensor of them holds). BITWISE does the bfloat16 round-to-nearest-even on the bits (NaN kept
    as NaN): triton's interpreter truncates in its cast, and on the GPU a cast feeding an add or
    a multiply lets the compiler compute it in bfloat16 instead."""
    if WR == 1:
        if BITWISE:
            bits = v.to(tl.uint32, bitcast=True)
            rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return tl.where(v != v, v, rounded.to(tl.float32, bitcast=True))
        else:
            return v.to(tl.bfloat16).to(tl.float32)
    elif WR == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def to_model_dtype(v, WR: tl.constexpr):
    """float32 values as the model dtype (WR bf16 or f16), rounded to nearest even, with one
    `cvt.rn.{bf16,f16}x2.f32` per two values. An inline instruction, not a cast: the compiler
    cannot move it above the arithmetic that made v (a cast may be hoisted so that the
    arithmetic runs in the narrow type, which rounds differently)."""
    if WR == 1:
        return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [v], dtype=tl.bfloat16,
                                         is_pure=True, pack=2)
    else:
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,r,r", [v], dtype=tl.float16,
                                         is_pure=True, pack=2)


@triton.jit
def _x(x_row, offsets, mask):
    return tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def x_all(x_row, offsets):
    return tl.load(x_row + offsets).to(tl.float32)


@triton.jit
def reduce_tile(tile, RANK: tl.constexpr):
    """[BN, ...] (RANK dimensions) -> [BN]: the sum over everything but the rows."""
    if RANK == 4:
        return tl.sum(tl.sum(tl.sum(tile, axis=3), axis=2), axis=1)
    elif RANK == 3:
        return tl.sum(tl.sum(tile, axis=2), axis=1)
    else:
        return tl.sum(tile, axis=1)


# ---- plain floats: a "block" is one element -----------------------------------------------------

@triton.jit
def weights_float(row, kb, nblk, rmask, ELEM: tl.constexpr, NB: tl.constexpr, WR: tl.constexpr,
                  INTERP: tl.constexpr):
    """F32 (ELEM 0), F16 (1), BF16 (2): (weights [BN, NB], their element offsets [1, NB], valid [1, NB])."""
    k = kb + tl.arange(0, NB)[None, :]  # [1, NB]
    kmask = k < nblk
    mask = rmask & kmask  # [BN, NB]
    if ELEM == 0:
        w = tl.load((row + k * 4).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
    elif ELEM == 1:
        w = tl.load((row + k * 2).to(tl.pointer_type(tl.float16)), mask=mask, other=0.0).to(tl.float32)
    else:
        w = tl.load((row + k * 2).to(tl.pointer_type(tl.bfloat16)), mask=mask, other=0.0).to(tl.float32)
    return round_weights(w, WR, INTERP), k, kmask


@triton.jit
def dot_float(row, kb, nblk, x_row, rmask, ELEM: tl.constexpr, NB: tl.constexpr, WR: tl.constexpr,
              INTERP: tl.constexpr):
    w, k, kmask = weights_float(row, kb, nblk, rmask, ELEM, NB, WR, INTERP)
    return w * _x(x_row, k, kmask)  # [BN, NB]


# ---- 32-element block types: a [BN, NB, 16] tile of payload bytes per step ----------------------
# Each `_halves_<type>` returns the unrounded weights of elements 0..15 (`low`) and 16..31
# (`high`) of NB blocks of every row, [BN, NB, 16] each.

@triton.jit
def _blocks32(row, kb, nblk, rmask, TYPE_SIZE: tl.constexpr, NB: tl.constexpr):
    """(block byte ptrs [BN, NB, 1], mask [BN, NB, 1], lane [1, 1, 16], x offsets of the low
    halves [1, NB, 16], x mask [1, NB, 1])."""
    blk = kb + tl.arange(0, NB)[None, :, None]  # [1, NB, 1]
    bvalid = blk < nblk
    base = row[:, :, None] + blk.to(tl.int64) * TYPE_SIZE  # [BN, NB, 1]
    lane = tl.arange(0, 16)[None, None, :]  # [1, 1, 16]
    return base, rmask[:, :, None] & bvalid, lane, blk * 32 + lane, bvalid


@triton.jit
def _halves_dot(low, high, x_row, xoff, xmask, WR: tl.constexpr, INTERP: tl.constexpr):
    """Elements 0..15 of each block from `low`, 16..31 from `high`, dotted with x."""
    low = round_weights(low, WR, INTERP)
    high = round_weights(high, WR, INTERP)
    return low * _x(x_row, xoff, xmask) + high * _x(x_row, xoff + 16, xmask)  # [BN, NB, 16]


@triton.jit
def _halves_q8_0(base, mask, lane):
    """Q8_0, 34 B: fp16 d @0, int8 x[32] @2; x * d."""
    d = load_fp16_as_f32(base, mask)  # f32 [BN, NB, 1]
    low = tl.load(base + 2 + lane, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    high = tl.load(base + 18 + lane, mask=mask, other=0).to(tl.int8, bitcast=True).to(tl.float32)
    return low * d, high * d


@triton.jit
def _halves_q4_0(base, mask, lane):
    """Q4_0, 18 B: fp16 d @0, nibbles @2; d * (q - 8)."""
    d = load_fp16_as_f32(base, mask)
    packed = load_bytes(base + 2 + lane, mask)  # i32 [BN, NB, 16]
    return d * ((packed & 0x0F) - 8).to(tl.float32), d * ((packed >> 4) - 8).to(tl.float32)


@triton.jit
def _halves_q4_1(base, mask, lane):
    """Q4_1, 20 B: fp16 d @0, fp16 m @2, nibbles @4; (d * q) + m."""
    d = load_fp16_as_f32(base, mask)
    m = load_fp16_as_f32(base + 2, mask)
    packed = load_bytes(base + 4 + lane, mask)
    return (d * (packed & 0x0F).to(tl.float32)) + m, (d * (packed >> 4).to(tl.float32)) + m


@triton.jit
def _qh_word3(base, offset: tl.constexpr, mask):
    """The little-endian uint32 of high bits at `offset` of each block, int32 [BN, NB, 1]."""
    word = load_bytes(base + offset, mask)
    word |= load_bytes(base + offset + 1, mask) << 8
    word |= load_bytes(base + offset + 2, mask) << 16
    word |= load_bytes(base + offset + 3, mask) << 24
    return word


@triton.jit
def _halves_q5_0(base, mask, lane):
    """Q5_0, 22 B: fp16 d @0, uint32 qh @2, nibbles @6; d * (q - 16)."""
    d = load_fp16_as_f32(base, mask)
    qh = _qh_word3(base, 2, mask)
    packed = load_bytes(base + 6 + lane, mask)
    low = (packed & 0x0F) | (((qh >> lane) & 1) << 4)
    high = (packed >> 4) | (((qh >> (lane + 16)) & 1) << 4)
    return d * (low - 16).to(tl.float32), d * (high - 16).to(tl.float32)


@triton.jit
def _halves_q5_1(base, mask, lane):
    """Q5_1, 24 B: fp16 d @0, fp16 m @2, uint32 qh @4, nibbles @8; (d * q) + m."""
    d = load_fp16_as_f32(base, mask)
    m = load_fp16_as_f32(base + 2, mask)
    qh = _qh_word3(base, 4, mask)
    packed = load_bytes(base + 8 + lane, mask)
    low = (packed & 0x0F) | (((qh >> lane) & 1) << 4)
    high = (packed >> 4) | (((qh >> (lane + 16)) & 1) << 4)
    return (d * low.to(tl.float32)) + m, (d * high.to(tl.float32)) + m


@triton.jit
def _e2m1_scaled(sign_and_code):
    """An e2m1 value times 2^-126, exactly, from its 4 bits placed at bits 31 (sign) and 22-24
    (exponent, mantissa) of a float32: that float is the value's 2^-126 multiple, the
    exponent-0 (subnormal) codes included."""
    return sign_and_code.to(tl.float32, bitcast=True)


@triton.jit
def _halves_mxfp4(base, mask, lane):
    """MXFP4, 17 B: E8M0 e @0, e2m1 nibbles @1; e8m0_half(e) * kvalue(q), kvalue the doubled
    e2m1, found with no table and no int-to-float conversion: (e2m1 * 2^-126) * 2^127 is
    kvalue exactly, then d * kvalue as gguf-py computes it. Code 8 (-0) gives -0.0 where gguf-py
    gives +0."""
    e = load_bytes(base, mask)  # i32 [BN, NB, 1] biased exponent
    # 2**(e - 128): a float32 subnormal for e < 2, like ggml_e8m0_to_fp32_half.
    subnormal = tl.full(e.shape, 0x00200000, tl.int32) << e
    d = tl.where(e < 2, subnormal, (tl.maximum(e, 1) - 1) << 23).to(tl.float32, bitcast=True)
    packed = load_bytes(base + 1 + lane, mask)  # i32 [BN, NB, 16]: low nibbles elements 0..15, high 16..31
    low = _e2m1_scaled(((packed << 22) & 0x01C00000) | ((packed << 28) & -0x80000000)) * 2.0**127  # kvalue
    high = _e2m1_scaled(((packed << 18) & 0x01C00000) | ((packed << 24) & -0x80000000)) * 2.0**127
    return d * low, d * high


@triton.jit
def dot_mxfp4_acc(acc, row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """acc + one step's MXFP4 products, by fma. A weight d * kvalue is a power of two times at
    most two significant bits, at least 2^-128 when not zero, so bfloat16 holds every one
    exactly (and float32 does): rounding to the model dtype is skipped but for float16."""
    base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 17, NB)
    low, high = _halves_mxfp4(base, mask, lane)  # [BN, NB, 16] each
    if WR == 2:
        low = round_weights(low, WR, INTERP)
        high = round_weights(high, WR, INTERP)
    return tl.fma(high, _x(x_row, xoff + 16, xmask), tl.fma(low, _x(x_row, xoff, xmask), acc))  # [BN, NB, 16]


@triton.jit
def halves32(QT: tl.constexpr, row, kb, nblk, rmask, NB: tl.constexpr):
    """(low, high, x offsets of low [1, NB, 16], x mask [1, NB, 1]) of a 32-element type; QT
    codes as in moe_triton: 3 Q8_0, 4 Q4_0, 5 Q4_1, 6 Q5_0, 7 Q5_1, 8 MXFP4."""
    if QT == 3:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 34, NB)
        low, high = _halves_q8_0(base, mask, lane)
    elif QT == 4:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 18, NB)
        low, high = _halves_q4_0(base, mask, lane)
    elif QT == 5:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 20, NB)
        low, high = _halves_q4_1(base, mask, lane)
    elif QT == 6:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 22, NB)
        low, high = _halves_q5_0(base, mask, lane)
    elif QT == 7:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 24, NB)
        low, high = _halves_q5_1(base, mask, lane)
    else:
        base, mask, lane, xoff, xmask = _blocks32(row, kb, nblk, rmask, 17, NB)
        low, high = _halves_mxfp4(base, mask, lane)
    return low, high, xoff, xmask


@triton.jit
def dot_blocks32(QT: tl.constexpr, row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr,
                 INTERP: tl.constexpr):
    low, high, xoff, xmask = halves32(QT, row, kb, nblk, rmask, NB)
    return _halves_dot(low, high, x_row, xoff, xmask, WR, INTERP)
