"""Triton device functions: the dot product of quantized weight rows with an activation row.

Each `dot_<type>` reads one step of a tile of weight rows in their GGML block format, dequantizes
them with gguf-py's arithmetic (the same formulas as inference.dequant's kernels: bit-exact
float32 values), rounds each weight to the model's dtype (what a resident model holds after
loading the dequantized tensor), and returns the float32 products with the matching activations
as a tile (not yet summed: the caller accumulates tiles across steps and reduces once at the
end, `reduce_tile`, rather than paying a cross-thread reduction every step). Nothing is written
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
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes, load_fp16_as_f32
from inference.dequant.triton_kquants import _k_scales
from inference.dequant.triton_legacy import _mxfp4_value

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
def _x(x_row, offsets, mask):
    return tl.load(x_row + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _x_all(x_row, offsets):
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
def _halves_mxfp4(base, mask, lane):
    """MXFP4, 17 B: E8M0 e @0, e2m1 nibbles @1; e8m0_half(e) * kvalue(q)."""
    e = load_bytes(base, mask)  # i32 [BN, NB, 1] biased exponent
    # 2**(e - 128): a float32 subnormal for e < 2, like ggml_e8m0_to_fp32_half.
    subnormal = tl.full(e.shape, 0x00200000, tl.int32) << e
    d = tl.where(e < 2, subnormal, (tl.maximum(e, 1) - 1) << 23).to(tl.float32, bitcast=True)
    packed = load_bytes(base + 1 + lane, mask)
    return _mxfp4_value(packed & 0x0F, d), _mxfp4_value(packed >> 4, d)


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


# ---- 256-element K-quants: one super-block per step -----------------------------------------------
# Each `_part_<type>` returns the rounded weights of one of the super-block's 2 (or 4) parts
# and their element offsets within it; the parts together cover its 256 elements.

@triton.jit
def _super(row, kb, rmask, TYPE_SIZE: tl.constexpr):
    """(super-block byte ptr [BN, 1], x element offset of its first element)."""
    return row + kb * TYPE_SIZE, kb * 256


@triton.jit
def _q45_k_layout(base, rmask):
    """Q4_K/Q5_K: (base [BN, 1, 1], mask [BN, 1, 1], pair [1, 4, 1], i [1, 1, 32])."""
    return (base[:, :, None], rmask[:, :, None], tl.arange(0, 4)[None, :, None],
            tl.arange(0, 32)[None, None, :])


@triton.jit
def _part_q4_k(base, mask, pair, i, packed, nibble: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q4_K, 144 B: d @0, dmin @2, scales @4, nibbles @16; (d*sc) * q - (dmin*m).
    Byte 32 pair + i (i < 32) holds element 64 pair + i (low nibble) and 64 pair + 32 + i (high)."""
    scale, offset = _k_scales(base, 2 * pair + nibble, mask)  # f32 [BN, 4, 1]
    q = ((packed >> (4 * nibble)) & 0x0F).to(tl.float32)
    return round_weights(scale * q - offset, WR, INTERP), 64 * pair + 32 * nibble + i  # [BN, 4, 32]


@triton.jit
def dot_q4_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = _super(row, kb, rmask, 144)
    base, mask, pair, i = _q45_k_layout(base, rmask)
    packed = load_bytes(base + 16 + 32 * pair + i, mask)  # i32 [BN, 4, 32]
    acc = None
    for nibble in tl.static_range(2):
        w, k = _part_q4_k(base, mask, pair, i, packed, nibble, WR, INTERP)
        term = w * _x_all(x_row, x0 + k)  # [BN, 4, 32]
        acc = term if nibble == 0 else acc + term
    return acc


@triton.jit
def _part_q5_k(base, mask, pair, i, packed, high_bits, nibble: tl.constexpr, WR: tl.constexpr,
               INTERP: tl.constexpr):
    """Q5_K, 176 B: Q4_K's header, qh[32] @16 (bit s of byte i: sub-block s), nibbles @48."""
    sub = 2 * pair + nibble  # [1, 4, 1]
    scale, offset = _k_scales(base, sub, mask)
    q = ((packed >> (4 * nibble)) & 0x0F) | (((high_bits >> sub) & 0x01) << 4)
    return round_weights(scale * q.to(tl.float32) - offset, WR, INTERP), 64 * pair + 32 * nibble + i


@triton.jit
def dot_q5_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = _super(row, kb, rmask, 176)
    base, mask, pair, i = _q45_k_layout(base, rmask)
    packed = load_bytes(base + 48 + 32 * pair + i, mask)  # i32 [BN, 4, 32]
    high_bits = load_bytes(base + 16 + i, mask)  # i32 [BN, 1, 32]
    acc = None
    for nibble in tl.static_range(2):
        w, k = _part_q5_k(base, mask, pair, i, packed, high_bits, nibble, WR, INTERP)
        term = w * _x_all(x_row, x0 + k)  # [BN, 4, 32]
        acc = term if nibble == 0 else acc + term
    return acc


@triton.jit
def _q6_k_layout(base, rmask):
    """Q6_K as [h, j, t] = [2, 4, 16]: (base [BN,1,1,1], mask, h, j, t)."""
    return (base[:, :, None, None], rmask[:, :, None, None], tl.arange(0, 2)[None, :, None, None],
            tl.arange(0, 4)[None, None, :, None], tl.arange(0, 16)[None, None, None, :])


@triton.jit
def _part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, n: tl.constexpr, WR: tl.constexpr,
               INTERP: tl.constexpr):
    """Q6_K, 210 B: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; (d*sc) * (q - 32).
    As [h, j, t] = [2, 4, 16]: element 128h + 64n + 16j + t (nibble n of ql byte 64h + 16j + t)."""
    sub = 8 * h + 4 * n + j  # [1, 2, 4, 1]
    sub_scale = tl.load(base + 192 + sub, mask=mask, other=0).to(tl.int8, bitcast=True)
    scale = d * sub_scale.to(tl.float32)  # f32 [BN, 2, 4, 1]
    q = ((low_bits >> (4 * n)) & 0x0F) | (((high_bits >> (2 * (2 * n + j // 2))) & 0x03) << 4)
    return round_weights(scale * (q - 32).to(tl.float32), WR, INTERP), 128 * h + 64 * n + 16 * j + t


@triton.jit
def _q6_k_bytes(base, mask, h, j, t):
    """(d, low bits, high bits) of Q6_K super-blocks."""
    d = load_fp16_as_f32(base + 208, mask)
    low_bits = load_bytes(base + 64 * h + 16 * j + t, mask)  # i32 [BN, 2, 4, 16]
    high_bits = load_bytes(base + 128 + 32 * h + 16 * (j % 2) + t, mask)
    return d, low_bits, high_bits


@triton.jit
def dot_q6_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = _super(row, kb, rmask, 210)
    base, mask, h, j, t = _q6_k_layout(base, rmask)
    d, low_bits, high_bits = _q6_k_bytes(base, mask, h, j, t)
    acc = None
    for n in tl.static_range(2):
        w, k = _part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, n, WR, INTERP)
        term = w * _x_all(x_row, x0 + k)  # [BN, 2, 4, 16]
        acc = term if n == 0 else acc + term
    return acc


@triton.jit
def _crumbs(base, rmask):
    """Q2_K/Q3_K's 2-bit codes as [BN, h, half, t] = [BN, 2, 2, 16] (see triton_kquants):
    (base [BN,1,1,1], mask, h, half, t)."""
    return (base[:, :, None, None], rmask[:, :, None, None], tl.arange(0, 2)[None, :, None, None],
            tl.arange(0, 2)[None, None, :, None], tl.arange(0, 16)[None, None, None, :])


@triton.jit
def _part_q2_k(base, mask, h, half, t, d, dmin, packed, sh: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q2_K, 84 B: scales[16] @0 (lo nibble sc, hi nibble m), 2-bit qs @16, d @80, dmin @82;
    element 128h + 32sh + 16half + t sits at bits 2sh of byte 32h + 16half + t."""
    scales = load_bytes(base + 8 * h + 2 * sh + half, mask)  # i32 [BN, 2, 2, 1]
    scale = d * (scales & 0x0F).to(tl.float32)
    offset = dmin * (scales >> 4).to(tl.float32)
    q = ((packed >> (2 * sh)) & 0x03).to(tl.float32)
    return round_weights(scale * q - offset, WR, INTERP), 128 * h + 32 * sh + 16 * half + t


@triton.jit
def _q2_k_bytes(base, mask, h, half, t):
    """(d, dmin, packed codes [BN, 2, 2, 16]) of Q2_K super-blocks."""
    d = load_fp16_as_f32(base + 80, mask)
    dmin = load_fp16_as_f32(base + 82, mask)
    return d, dmin, load_bytes(base + 16 + 32 * h + 16 * half + t, mask)


@triton.jit
def dot_q2_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = _super(row, kb, rmask, 84)
    base, mask, h, half, t = _crumbs(base, rmask)
    d, dmin, packed = _q2_k_bytes(base, mask, h, half, t)
    acc = None
    for sh in tl.static_range(4):
        w, k = _part_q2_k(base, mask, h, half, t, d, dmin, packed, sh, WR, INTERP)
        term = w * _x_all(x_row, x0 + k)  # [BN, 2, 2, 16]
        acc = term if sh == 0 else acc + term
    return acc


@triton.jit
def _part_q3_k(base, mask, h, half, t, d, packed, hmask, sh: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q3_K, 110 B: hmask[32] @0, 2-bit qs @32, scales[12] @96, d @108; (d*sc) * q."""
    sub = 8 * h + 2 * sh + half  # [1, 2, 2, 1]
    low = load_bytes(base + 96 + sub % 8, mask)
    high = load_bytes(base + 104 + sub % 4, mask)
    six_bit = ((low >> (4 * (sub // 8))) & 0x0F) | (((high >> (2 * (sub // 4))) & 0x03) << 4)
    scale = d * (six_bit - 32).to(tl.float32)
    no_offset = (hmask >> (4 * h + sh)) & 0x01
    q = ((packed >> (2 * sh)) & 0x03) - ((no_offset ^ 1) << 2)
    return round_weights(scale * q.to(tl.float32), WR, INTERP), 128 * h + 32 * sh + 16 * half + t


@triton.jit
def _q3_k_bytes(base, mask, h, half, t):
    """(d, packed codes [BN, 2, 2, 16], high-bit mask bytes [BN, 1, 2, 16]) of Q3_K super-blocks."""
    d = load_fp16_as_f32(base + 108, mask)
    packed = load_bytes(base + 32 + 32 * h + 16 * half + t, mask)
    return d, packed, load_bytes(base + 16 * half + t, mask)


@triton.jit
def dot_q3_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = _super(row, kb, rmask, 110)
    base, mask, h, half, t = _crumbs(base, rmask)
    d, packed, hmask = _q3_k_bytes(base, mask, h, half, t)
    acc = None
    for sh in tl.static_range(4):
        w, k = _part_q3_k(base, mask, h, half, t, d, packed, hmask, sh, WR, INTERP)
        term = w * _x_all(x_row, x0 + k)  # [BN, 2, 2, 16]
        acc = term if sh == 0 else acc + term
    return acc
