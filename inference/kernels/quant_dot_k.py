"""Triton device functions of the 256-element K-quants (Q2_K .. Q6_K): one super-block per step.

The same contract as inference.kernels.quant_dot (which has the plain floats and the 32-element
block types, and the shared helpers): each `dot_<type>` returns the float32 products of a step's
weights, dequantized with gguf-py's arithmetic and rounded to the model dtype, with the matching
activations, as a tile (Q4_K's `dot_q4_k_acc` adds them to the accumulator it is given, by fma);
each `part_<type>` gives one part of a super-block's weights and their element offsets, which the
GEMV (`dot_<type>`) and the grouped GEMM's tiles (inference.kernels.quant_tile) are both built
from. Q4_K, Q5_K and Q6_K turn their codes into floats without a conversion instruction (the code
OR-ed into the bits of 2^23, then an exact fma: `q4_k_values`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes, load_fp16_as_f32
from inference.dequant.triton_kquants import _k_scales
from inference.kernels import quant_dot as qd


# ---- 256-element K-quants: one super-block per step -----------------------------------------------
# Each `_part_<type>` returns the rounded weights of one of the super-block's 2 (or 4) parts
# and their element offsets within it; the parts together cover its 256 elements.

@triton.jit
def super(row, kb, rmask, TYPE_SIZE: tl.constexpr):
    """(super-block byte ptr [BN, 1], x element offset of its first element)."""
    return row + kb * TYPE_SIZE, kb * 256


@triton.jit
def q45_k_layout(base, rmask):
    """Q4_K/Q5_K: (base [BN, 1, 1], mask [BN, 1, 1], pair [1, 4, 1], i [1, 1, 32])."""
    return (base[:, :, None], rmask[:, :, None], tl.arange(0, 4)[None, :, None],
            tl.arange(0, 32)[None, None, :])


@triton.jit
def q4_k_values(base, mask, pair, nibble: tl.constexpr, packed):
    """Q4_K's float32 values (d*sc) * q - (dmin*m) of nibble `nibble` of `packed` [BN, 4, 32],
    gguf-py's arithmetic without an int-to-float conversion per weight: OR-ing q into the bits
    of 2^23 makes the float 2^23 + q (2^23 + 16 q for the high nibble, left in place), and one
    fma takes 2^23 * scale back off. scale = d*sc has at most 17 significant bits (fp16 d times a
    6-bit sc), scale * q at most 21, so that fma's one rounding is exact and the value is
    bit-identical to gguf-py's. (A non-finite d gives NaN where gguf-py gives infinities; the row
    is not finite either way.)"""
    scale, offset = _k_scales(base, 2 * pair + nibble, mask)  # f32 [BN, 4, 1]
    if nibble == 0:
        two23_q = ((packed & 0x0F) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + q
        scaled = tl.fma(scale, two23_q, scale * -8388608.0)  # scale * q, exact
    else:
        two23_q = ((packed & 0xF0) | 0x4B000000).to(tl.float32, bitcast=True)  # 2^23 + 16 q
        scaled = tl.fma(scale * 0.0625, two23_q, scale * -524288.0)  # scale * q, exact
    return scaled - offset


@triton.jit
def part_q4_k(base, mask, pair, i, packed, nibble: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q4_K, 144 B: d @0, dmin @2, scales @4, nibbles @16; (d*sc) * q - (dmin*m).
    Byte 32 pair + i (i < 32) holds element 64 pair + i (low nibble) and 64 pair + 32 + i (high)."""
    value = q4_k_values(base, mask, pair, nibble, packed)  # f32 [BN, 4, 32]
    return qd.round_weights(value, WR, INTERP), 64 * pair + 32 * nibble + i


@triton.jit
def k_words(base, rmask, CODES: tl.constexpr, HIGH: tl.constexpr):
    """Q4_K's (Q5_K's) 128 code bytes (@CODES: 16, 48) of super-blocks `base` [BN, 1] as uint32
    words, 16-byte vector loads rather than a pointer per byte: (words [BN, 4, 8] (word 8 pair + w
    holds bytes 32 pair + 4 w .. + 3), Q5_K's 32 qh bytes @16 as words [BN, 1, 8] (else the
    words again, unused), header ptrs [BN, 1, 1], mask, pair [1, 4, 1], w [1, 1, 8])."""
    base, mask = base[:, :, None], rmask[:, :, None]
    pair = tl.arange(0, 4)[None, :, None]
    w = tl.arange(0, 8)[None, None, :]
    word_ptr = base.to(tl.pointer_type(tl.uint32), bitcast=True)
    words = tl.load(word_ptr + CODES // 4 + 8 * pair + w, mask=mask, other=0)  # u32 [BN, 4, 8]
    if HIGH:
        high_bits = tl.load(word_ptr + 4 + w, mask=mask, other=0)  # u32 [BN, 1, 8]
    else:
        high_bits = words
    return words, high_bits, base, mask, pair, w


@triton.jit
def _halves_under_2_23(words, INTERP: tl.constexpr):
    """Each word's low and high 16 bits OR-ed into the bits of 2^23: a nibble is then one AND
    away from 2^23 + q 2^s, an AND with one immediate (0x4B000000 | 0xF << s; OR-ing 2^23 in per
    weight would take two). Inline, so the compiler cannot fold the two steps back together."""
    if INTERP:
        return (words & 0xFFFF) | 0x4B000000, (words >> 16) | 0x4B000000
    low = tl.inline_asm_elementwise("lop3.b32 $0, $1, 0xFFFF, 0x4B000000, 0xEA;", "=r,r", [words],
                                    dtype=tl.uint32, is_pure=True, pack=1)
    high = tl.inline_asm_elementwise("{.reg .b32 t; shr.u32 t, $1, 16; or.b32 $0, t, 0x4B000000;}", "=r,r",
                                     [words], dtype=tl.uint32, is_pure=True, pack=1)
    return low, high


@triton.jit
def _k_code_byte(source, high_bits, scale, offset, SHIFT: tl.constexpr, HIGH: tl.constexpr):
    """The code at bit SHIFT (<= 12) of `source` (a half word under 2^23), masked in place, not
    shifted down: 2^23 + q 2^s; with HIGH (Q5_K) its fifth bit OR-ed in from `high_bits`, where
    it lies at bit SHIFT + 4. The fma's scale 2^-s (a power of two: exact) takes it back to
    scale * q exactly, as q4_k_values; then minus the offset."""
    two23_q = source & (0x4B000000 | (0x0F << SHIFT))  # 2^23 + q 2^s (its low four bits)
    if HIGH:
        two23_q = two23_q | (high_bits & (0x10 << SHIFT))
    scale_s = scale * (1.0 / (1 << SHIFT))  # exact
    return tl.fma(scale_s, two23_q.to(tl.float32, bitcast=True), scale_s * -8388608.0) - offset


@triton.jit
def _k_scales_words(base, pair, nibble: tl.constexpr, mask):
    """_k_scales for sub-blocks 2 pair + nibble from the header read as four uint32 words (d and
    dmin in word 0, the 12 scale bytes in words 1-3) rather than a byte at a time: (d*sc, dmin*m)
    [BN, 4, 1], the same values."""
    header = (base).to(tl.pointer_type(tl.uint32), bitcast=True)  # [BN, 1, 1]
    w0 = tl.load(header, mask=mask, other=0)
    w1 = tl.load(header + 1, mask=mask, other=0)  # scale bytes 0-3
    w2 = tl.load(header + 2, mask=mask, other=0)  # 4-7
    w3 = tl.load(header + 3, mask=mask, other=0)  # 8-11
    d = (w0 & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    dmin = (w0 >> 16).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)
    sub = 2 * pair + nibble  # [1, 4, 1]
    # b[s] of s = sub % 4, b[s + 4] and b[s + 8]: byte (sub % 4) of words 1, 2 and 3
    shift = (8 * (sub % 4)).to(tl.uint32)
    own = (w1 >> shift) & 0xFF  # b[s % 4]
    upper4 = (w2 >> shift) & 0xFF  # b[s % 4 + 4]
    upper8 = (w3 >> shift) & 0xFF  # b[s % 4 + 8]
    first = sub < 4
    sc = tl.where(first, own & 0x3F, (upper8 & 0x0F) | ((own >> 2) & 0x30))
    mins = tl.where(first, upper4 & 0x3F, (upper8 >> 4) | ((upper4 >> 2) & 0x30))
    return d * sc.to(tl.float32), dmin * mins.to(tl.float32)


@triton.jit
def part_k_words(base, mask, pair, w, words, high_bits, nibble: tl.constexpr, HIGH: tl.constexpr, WR: tl.constexpr,
                 INTERP: tl.constexpr):
    """part_q4_k's (HIGH: part_q5_k's) values from k_words: code `nibble` of the four bytes of
    each word, as [BN, 4, 8, 2, 2] (byte b = 2 j + l last, so that a thread's values of a word lie
    in consecutive registers, packed and stored in pairs), and their element offsets 64 pair +
    32 nibble + 4 w + b. Q5_K's fifth bits: bit 2 pair + nibble of qh byte 4 w + b (high_bits
    [BN, 1, 8], its words), moved above each byte's code of this part, two bytes a shift."""
    scale, offset = _k_scales_words(base, pair, nibble, mask)  # f32 [BN, 4, 1]
    low, high = _halves_under_2_23(words, INTERP)  # [BN, 4, 8] x2
    if HIGH:
        bits = (high_bits >> (2 * pair + nibble).to(tl.uint32)) & 0x01010101  # [BN, 4, 8] bit 8 b of byte b
        low_bits = bits << (4 + 4 * nibble)  # bytes 0, 1: at 4 + s
        high_bits = bits >> (12 - 4 * nibble)  # bytes 2, 3 (of the word shifted by 16): at 4 + s
    else:
        low_bits = low
        high_bits = high
    v0 = _k_code_byte(low, low_bits, scale, offset, 4 * nibble, HIGH)
    v1 = _k_code_byte(low, low_bits, scale, offset, 8 + 4 * nibble, HIGH)
    v2 = _k_code_byte(high, high_bits, scale, offset, 4 * nibble, HIGH)
    v3 = _k_code_byte(high, high_bits, scale, offset, 8 + 4 * nibble, HIGH)
    value = tl.join(tl.join(v0, v2), tl.join(v1, v3))  # [BN, 4, 8, 2, 2]: [..., j, l] is byte 2 j + l
    j = tl.arange(0, 2)[None, None, None, :, None]
    lo = tl.arange(0, 2)[None, None, None, None, :]
    k = 64 * pair[:, :, :, None, None] + 32 * nibble + 4 * w[:, :, :, None, None] + 2 * j + lo
    return qd.round_weights(value, WR, INTERP), k


@triton.jit
def dot_q4_k_acc(row, kb, x_row, rmask, acc, WR: tl.constexpr, INTERP: tl.constexpr):
    """acc [BN, 4, 32] float32 plus super-block kb's products, accumulated by fma: the GEMV's
    Q4_K step (one instruction per weight fewer than a separate multiply and add)."""
    base, x0 = super(row, kb, rmask, 144)
    base, mask, pair, i = q45_k_layout(base, rmask)
    packed = load_bytes(base + 16 + 32 * pair + i, mask)  # i32 [BN, 4, 32]
    for nibble in tl.static_range(2):
        w, k = part_q4_k(base, mask, pair, i, packed, nibble, WR, INTERP)
        acc = tl.fma(w, qd.x_all(x_row, x0 + k), acc)  # [BN, 4, 32]
    return acc


@triton.jit
def part_q5_k(base, mask, pair, i, packed, high_bits, nibble: tl.constexpr, WR: tl.constexpr,
               INTERP: tl.constexpr):
    """Q5_K, 176 B: Q4_K's header, qh[32] @16 (bit s of byte i: sub-block s), nibbles @48."""
    sub = 2 * pair + nibble  # [1, 4, 1]
    scale, offset = _k_scales(base, sub, mask)
    q = ((packed >> (4 * nibble)) & 0x0F) | (((high_bits >> sub) & 0x01) << 4)
    # scale * q as q4_k_values computes it (a 5-bit q: at most 22 significant bits, exact)
    scaled = tl.fma(scale, (q | 0x4B000000).to(tl.float32, bitcast=True), scale * -8388608.0)
    return qd.round_weights(scaled - offset, WR, INTERP), 64 * pair + 32 * nibble + i


@triton.jit
def dot_q5_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = super(row, kb, rmask, 176)
    base, mask, pair, i = q45_k_layout(base, rmask)
    packed = load_bytes(base + 48 + 32 * pair + i, mask)  # i32 [BN, 4, 32]
    high_bits = load_bytes(base + 16 + i, mask)  # i32 [BN, 1, 32]
    acc = None
    for nibble in tl.static_range(2):
        w, k = part_q5_k(base, mask, pair, i, packed, high_bits, nibble, WR, INTERP)
        term = w * qd.x_all(x_row, x0 + k)  # [BN, 4, 32]
        acc = term if nibble == 0 else acc + term
    return acc


@triton.jit
def q6_k_layout(base, rmask):
    """Q6_K as [h, j, t] = [2, 4, 16]: (base [BN,1,1,1], mask, h, j, t)."""
    return (base[:, :, None, None], rmask[:, :, None, None], tl.arange(0, 2)[None, :, None, None],
            tl.arange(0, 4)[None, None, :, None], tl.arange(0, 16)[None, None, None, :])


@triton.jit
def part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, n: tl.constexpr, WR: tl.constexpr,
               INTERP: tl.constexpr):
    """Q6_K, 210 B: ql[128] @0, qh[64] @128, int8 scales[16] @192, d @208; (d*sc) * (q - 32).
    As [h, j, t] = [2, 4, 16]: element 128h + 64n + 16j + t (nibble n of ql byte 64h + 16j + t)."""
    sub = 8 * h + 4 * n + j  # [1, 2, 4, 1]
    sub_scale = tl.load(base + 192 + sub, mask=mask, other=0).to(tl.int8, bitcast=True)
    scale = d * sub_scale.to(tl.float32)  # f32 [BN, 2, 4, 1]
    q = ((low_bits >> (4 * n)) & 0x0F) | (((high_bits >> (2 * (2 * n + j // 2))) & 0x03) << 4)
    # scale * (q - 32) without an int-to-float conversion: scale = d*sc has at most 18 significant
    # bits, so scale * q (the fma, as in q4_k_values) and scale * (q - 32) have at most 24, and
    # both the fma and the subtraction are exact
    scaled = tl.fma(scale, (q | 0x4B000000).to(tl.float32, bitcast=True), scale * -8388608.0)
    return qd.round_weights(scaled - scale * 32.0, WR, INTERP), 128 * h + 64 * n + 16 * j + t


@triton.jit
def q6_k_bytes(base, mask, h, j, t):
    """(d, low bits, high bits) of Q6_K super-blocks."""
    d = load_fp16_as_f32(base + 208, mask)
    low_bits = load_bytes(base + 64 * h + 16 * j + t, mask)  # i32 [BN, 2, 4, 16]
    high_bits = load_bytes(base + 128 + 32 * h + 16 * (j % 2) + t, mask)
    return d, low_bits, high_bits


@triton.jit
def dot_q6_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = super(row, kb, rmask, 210)
    base, mask, h, j, t = q6_k_layout(base, rmask)
    d, low_bits, high_bits = q6_k_bytes(base, mask, h, j, t)
    acc = None
    for n in tl.static_range(2):
        w, k = part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, n, WR, INTERP)
        term = w * qd.x_all(x_row, x0 + k)  # [BN, 2, 4, 16]
        acc = term if n == 0 else acc + term
    return acc


@triton.jit
def crumbs(base, rmask):
    """Q2_K/Q3_K's 2-bit codes as [BN, h, half, t] = [BN, 2, 2, 16] (see triton_kquants):
    (base [BN,1,1,1], mask, h, half, t)."""
    return (base[:, :, None, None], rmask[:, :, None, None], tl.arange(0, 2)[None, :, None, None],
            tl.arange(0, 2)[None, None, :, None], tl.arange(0, 16)[None, None, None, :])


@triton.jit
def part_q2_k(base, mask, h, half, t, d, dmin, packed, sh: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q2_K, 84 B: scales[16] @0 (lo nibble sc, hi nibble m), 2-bit qs @16, d @80, dmin @82;
    element 128h + 32sh + 16half + t sits at bits 2sh of byte 32h + 16half + t."""
    scales = load_bytes(base + 8 * h + 2 * sh + half, mask)  # i32 [BN, 2, 2, 1]
    scale = d * (scales & 0x0F).to(tl.float32)
    offset = dmin * (scales >> 4).to(tl.float32)
    q = ((packed >> (2 * sh)) & 0x03).to(tl.float32)
    return qd.round_weights(scale * q - offset, WR, INTERP), 128 * h + 32 * sh + 16 * half + t


@triton.jit
def q2_k_bytes(base, mask, h, half, t):
    """(d, dmin, packed codes [BN, 2, 2, 16]) of Q2_K super-blocks."""
    d = load_fp16_as_f32(base + 80, mask)
    dmin = load_fp16_as_f32(base + 82, mask)
    return d, dmin, load_bytes(base + 16 + 32 * h + 16 * half + t, mask)


@triton.jit
def dot_q2_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = super(row, kb, rmask, 84)
    base, mask, h, half, t = crumbs(base, rmask)
    d, dmin, packed = q2_k_bytes(base, mask, h, half, t)
    acc = None
    for sh in tl.static_range(4):
        w, k = part_q2_k(base, mask, h, half, t, d, dmin, packed, sh, WR, INTERP)
        term = w * qd.x_all(x_row, x0 + k)  # [BN, 2, 2, 16]
        acc = term if sh == 0 else acc + term
    return acc


@triton.jit
def part_q3_k(base, mask, h, half, t, d, packed, hmask, sh: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    """Q3_K, 110 B: hmask[32] @0, 2-bit qs @32, scales[12] @96, d @108; (d*sc) * q."""
    sub = 8 * h + 2 * sh + half  # [1, 2, 2, 1]
    low = load_bytes(base + 96 + sub % 8, mask)
    high = load_bytes(base + 104 + sub % 4, mask)
    six_bit = ((low >> (4 * (sub // 8))) & 0x0F) | (((high >> (2 * (sub // 4))) & 0x03) << 4)
    scale = d * (six_bit - 32).to(tl.float32)
    no_offset = (hmask >> (4 * h + sh)) & 0x01
    q = ((packed >> (2 * sh)) & 0x03) - ((no_offset ^ 1) << 2)
    return qd.round_weights(scale * q.to(tl.float32), WR, INTERP), 128 * h + 32 * sh + 16 * half + t


@triton.jit
def q3_k_bytes(base, mask, h, half, t):
    """(d, packed codes [BN, 2, 2, 16], high-bit mask bytes [BN, 1, 2, 16]) of Q3_K super-blocks."""
    d = load_fp16_as_f32(base + 108, mask)
    packed = load_bytes(base + 32 + 32 * h + 16 * half + t, mask)
    return d, packed, load_bytes(base + 16 * half + t, mask)


@triton.jit
def dot_q3_k(row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr):
    base, x0 = super(row, kb, rmask, 110)
    base, mask, h, half, t = crumbs(base, rmask)
    d, packed, hmask = q3_k_bytes(base, mask, h, half, t)
    acc = None
    for sh in tl.static_range(4):
        w, k = part_q3_k(base, mask, h, half, t, d, packed, hmask, sh, WR, INTERP)
        term = w * qd.x_all(x_row, x0 + k)  # [BN, 2, 2, 16]
        acc = term if sh == 0 else acc + term
    return acc
