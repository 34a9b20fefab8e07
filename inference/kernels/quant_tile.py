"""Triton device functions: a tile of dequantized weights for a tensor-core dot (the grouped GEMM).

`weight_tile` returns one step of a [BN rows, BK columns] tile of weights read in place from
their GGML blocks, with the same arithmetic and rounding as inference.kernels.quant_dot (it is
built from the same per-type parts), and the column index of each of its BK elements. Columns
come in the order the packed bytes give them (e.g. Q4_K's low nibbles, then high, per pair of
sub-blocks), not ascending: the GEMM loads the activations at the same columns, so the dot
product needs no reordering. A step covers NB blocks (one super-block for the K-quants, NB
elements for plain floats).
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.dequant.triton_common import load_bytes
from inference.kernels import quant_dot as qd
from inference.kernels import quant_dot_k as qk


@triton.jit
def _flat(w, k, BN: tl.constexpr, BK: tl.constexpr):
    """[BN, ...] weights and their [1, ...] columns -> ([BN, BK], [BK])."""
    return tl.reshape(w, (BN, BK)), tl.reshape(k, (BK,))


@triton.jit
def _join2(a, ka, b, kb_, BN: tl.constexpr):
    """Two [BN, ...] parts of a super-block -> ([BN, 256], [256])."""
    return _flat(tl.join(a, b), tl.join(ka, kb_), BN, 256)


@triton.jit
def weight_tile(QT: tl.constexpr, row, kb, nblk, rmask, NB: tl.constexpr, BN: tl.constexpr, WR: tl.constexpr,
                INTERP: tl.constexpr):
    """(weights [BN, BK] float32 (holding model-dtype values unless WR is 0), their columns [BK]
    int32, columns that exist [BK]). row: [BN, 1] uint8 pointers to each weight row; kb: the
    step's first block; INTERP: run by triton's interpreter (rounding on the bits, as
    quant_dot.round_weights does there, and no inline instructions)."""
    if QT <= 2:
        w, k, kmask = qd.weights_float(row, kb, nblk, rmask, QT, NB, WR, INTERP)  # [BN, NB], [1, NB]
        return tl.reshape(w, (BN, NB)), tl.reshape(k, (NB,)), tl.reshape(kmask, (NB,))
    elif QT <= 8:
        low, high, xoff, xmask = qd.halves32(QT, row, kb, nblk, rmask, NB)  # [BN, NB, 16] x2
        w = tl.join(qd.round_weights(low, WR, INTERP), qd.round_weights(high, WR, INTERP))  # [BN, NB, 16, 2]
        k = tl.join(xoff, xoff + 16)  # [1, NB, 16, 2]
        valid = tl.broadcast_to(xmask, xoff.shape)
        w, k = _flat(w, k, BN, NB * 32)
        return w, k, tl.reshape(tl.join(valid, valid), (NB * 32,))
    elif QT == 11 or QT == 12:  # Q4_K, Q5_K: two nibble parts [BN, 4, 32]
        if QT == 11:
            base, x0 = qk.super(row, kb, rmask, 144)
            base, mask, pair, i = qk.q45_k_layout(base, rmask)
            packed = load_bytes(base + 16 + 32 * pair + i, mask)
            w0, k0 = qk.part_q4_k(base, mask, pair, i, packed, 0, WR, INTERP)
            w1, k1 = qk.part_q4_k(base, mask, pair, i, packed, 1, WR, INTERP)
        else:
            base, x0 = qk.super(row, kb, rmask, 176)
            base, mask, pair, i = qk.q45_k_layout(base, rmask)
            packed = load_bytes(base + 48 + 32 * pair + i, mask)
            high_bits = load_bytes(base + 16 + i, mask)
            w0, k0 = qk.part_q5_k(base, mask, pair, i, packed, high_bits, 0, WR, INTERP)
            w1, k1 = qk.part_q5_k(base, mask, pair, i, packed, high_bits, 1, WR, INTERP)
        w, k = _join2(w0, k0, w1, k1, BN)
        return w, x0 + k, k >= 0
    elif QT == 13:  # Q6_K: two parts [BN, 2, 4, 16]
        base, x0 = qk.super(row, kb, rmask, 210)
        base, mask, h, j, t = qk.q6_k_layout(base, rmask)
        d, low_bits, high_bits = qk.q6_k_bytes(base, mask, h, j, t)
        w0, k0 = qk.part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, 0, WR, INTERP)
        w1, k1 = qk.part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, 1, WR, INTERP)
        w, k = _join2(w0, k0, w1, k1, BN)
        return w, x0 + k, k >= 0
    else:  # Q2_K (9), Q3_K (10): four parts [BN, 2, 2, 16]
        if QT == 9:
            base, x0 = qk.super(row, kb, rmask, 84)
            base, mask, h, half, t = qk.crumbs(base, rmask)
            d, dmin, packed = qk.q2_k_bytes(base, mask, h, half, t)
            w0, k0 = qk.part_q2_k(base, mask, h, half, t, d, dmin, packed, 0, WR, INTERP)
            w1, k1 = qk.part_q2_k(base, mask, h, half, t, d, dmin, packed, 1, WR, INTERP)
            w2, k2 = qk.part_q2_k(base, mask, h, half, t, d, dmin, packed, 2, WR, INTERP)
            w3, k3 = qk.part_q2_k(base, mask, h, half, t, d, dmin, packed, 3, WR, INTERP)
        else:
            base, x0 = qk.super(row, kb, rmask, 110)
            base, mask, h, half, t = qk.crumbs(base, rmask)
            d, packed, hmask = qk.q3_k_bytes(base, mask, h, half, t)
            w0, k0 = qk.part_q3_k(base, mask, h, half, t, d, packed, hmask, 0, WR, INTERP)
            w1, k1 = qk.part_q3_k(base, mask, h, half, t, d, packed, hmask, 1, WR, INTERP)
            w2, k2 = qk.part_q3_k(base, mask, h, half, t, d, packed, hmask, 2, WR, INTERP)
            w3, k3 = qk.part_q3_k(base, mask, h, half, t, d, packed, hmask, 3, WR, INTERP)
        w = tl.join(tl.join(w0, w1), tl.join(w2, w3))  # [BN, 2, 2, 16, 2, 2]
        k = tl.join(tl.join(k0, k1), tl.join(k2, k3))
        w, k = _flat(w, k, BN, 256)
        return w, x0 + k, k >= 0


@triton.jit
def weight_part(QT: tl.constexpr, row, kb, nblk, rmask, NB: tl.constexpr, BN: tl.constexpr, WR: tl.constexpr,
                INTERP: tl.constexpr, PART: tl.constexpr):
    """Part PART of weight_tile's step (ops.GEMM_PARTS[QT] of them, together its columns): a smaller
    tile ([BN, BK / parts]) for fewer live registers, with its columns and their validity."""
    if QT <= 2:
        w, k, kmask = qd.weights_float(row, kb, nblk, rmask, QT, NB, WR, INTERP)  # [BN, NB], [1, NB]
        return tl.reshape(w, (BN, NB)), tl.reshape(k, (NB,)), tl.reshape(kmask, (NB,))
    elif QT <= 8:
        low, high, xoff, xmask = qd.halves32(QT, row, kb, nblk, rmask, NB)  # [BN, NB, 16] x2
        valid = tl.reshape(tl.broadcast_to(xmask, xoff.shape), (NB * 16,))
        if PART == 0:
            w, k = _flat(qd.round_weights(low, WR, INTERP), xoff, BN, NB * 16)
        else:
            w, k = _flat(qd.round_weights(high, WR, INTERP), xoff + 16, BN, NB * 16)
        return w, k, valid
    elif QT == 11 or QT == 12:  # Q4_K, Q5_K: codes and scales read as words
        HIGH: tl.constexpr = QT == 12
        base, x0 = qk.super(row, kb, rmask, 176 if HIGH else 144)
        words, high_bits, base, mask, pair, w_ = qk.k_words(base, rmask, 48 if HIGH else 16, HIGH)
        w, k = qk.part_k_words(base, mask, pair, w_, words, high_bits, PART, HIGH, WR, INTERP)  # [BN, 4, 8, 2, 2]
        w, k = _flat(w, k, BN, 128)
        return w, x0 + k, k >= 0
    elif QT == 13:
        base, x0 = qk.super(row, kb, rmask, 210)
        base, mask, h, j, t = qk.q6_k_layout(base, rmask)
        d, low_bits, high_bits = qk.q6_k_bytes(base, mask, h, j, t)
        w, k = qk.part_q6_k(base, mask, h, j, t, d, low_bits, high_bits, PART, WR, INTERP)  # [BN, 2, 4, 16]
        w, k = _flat(w, k, BN, 128)
        return w, x0 + k, k >= 0
    elif QT == 9:
        base, x0 = qk.super(row, kb, rmask, 84)
        base, mask, h, half, t = qk.crumbs(base, rmask)
        d, dmin, packed = qk.q2_k_bytes(base, mask, h, half, t)
        w, k = qk.part_q2_k(base, mask, h, half, t, d, dmin, packed, PART, WR, INTERP)  # [BN, 2, 2, 16]
        w, k = _flat(w, k, BN, 64)
        return w, x0 + k, k >= 0
    else:
        base, x0 = qk.super(row, kb, rmask, 110)
        base, mask, h, half, t = qk.crumbs(base, rmask)
        d, packed, hmask = qk.q3_k_bytes(base, mask, h, half, t)
        w, k = qk.part_q3_k(base, mask, h, half, t, d, packed, hmask, PART, WR, INTERP)
        w, k = _flat(w, k, BN, 64)
        return w, x0 + k, k >= 0
