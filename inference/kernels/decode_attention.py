"""Attention of one query token over a key/value cache, split over the keys (flash-decoding).

A decode step's query is one token: torch's SDPA kernels, built for long queries, spend ~24 us
per layer on it over a 300-key static cache (the Qwen3-like shape on the H200, mem-efficient
kernel: the boolean mask rules out flash), and read every key of the cache, used or not.
Here a program takes one (sequence, key/value head, range of keys): the query heads that share
that key/value head (GQA) are the rows of one tensor-core product, key blocks the mask hides
entirely are never read, and a second kernel merges the ranges' partial softmaxes. Scores and
the softmax run in float32 (tf32 tensor-core products: exact for half inputs; the probabilities
keep 10 mantissa bits where flash attention rounds them to the cache's dtype). Importing this
module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def decode_attention_split_kernel(
        q_ptr, k_ptr, v_ptr, mask_ptr, part_acc_ptr, part_ml_ptr,
        L, G, DK, DV, scale, splits,
        q_sb, q_sh, k_sb, k_sh, k_sl, v_sb, v_sh, v_sl, m_sb, m_sl,
        HAS_MASK: tl.constexpr, CHUNK: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (b, h, s): for query heads h*G .. h*G+G-1 of sequence b, keys [s*CHUNK, (s+1)*CHUNK):
    the running max m, the sum l of exp(score - m) and acc = sum exp(score - m) * v, float32,
    at part_ml[b, head, s, 0:2] and part_acc[b, head, s, :]."""
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    g_ok = g < G
    heads = h * G + g  # [BLOCK_G] query heads of this key/value head
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * q_sb + heads[:, None] * q_sh + dk[None, :],
                mask=g_ok[:, None] & (dk < DK)[None, :], other=0.0).to(tl.float32)  # [BLOCK_G, BLOCK_DK]
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_DV), tl.float32)
    k_base = k_ptr + b * k_sb + h * k_sh
    v_base = v_ptr + b * v_sb + h * v_sh
    for n0 in range(s * CHUNK, s * CHUNK + CHUNK, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        visible = n < L
        if HAS_MASK:
            visible = visible & (tl.load(mask_ptr + b * m_sb + n * m_sl, mask=n < L, other=0) != 0)
        if tl.max(visible.to(tl.int32), axis=0) > 0:  # a block the mask hides is not read
            k = tl.load(k_base + n[:, None] * k_sl + dk[None, :],
                        mask=visible[:, None] & (dk < DK)[None, :], other=0.0)  # [BLOCK_N, BLOCK_DK]
            # tf32 products of half inputs are exact (10 mantissa bits hold 7 or 10)
            scores = tl.dot(q, tl.trans(k.to(tl.float32)), input_precision="tf32") * scale  # [BLOCK_G, BLOCK_N]
            scores = tl.where(visible[None, :], scores, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(scores, axis=1))  # finite: the block shows a key
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * v_sl + dv[None, :],
                        mask=visible[:, None] & (dv < DV)[None, :], other=0.0)  # [BLOCK_N, BLOCK_DV]
            # probabilities enter the tensor cores with tf32's 10 mantissa bits (flash attention
            # rounds them to the values' dtype)
            acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="tf32")
            m_i = m_new
    n_heads = tl.num_programs(1) * G
    row = (b * n_heads + heads) * splits + s  # [BLOCK_G] (b, head, s) of the partials
    tl.store(part_acc_ptr + row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None] & (dv < DV)[None, :])
    tl.store(part_ml_ptr + row * 2, m_i, mask=g_ok)
    tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_ok)


@triton.jit
def decode_attention_merge_kernel(part_acc_ptr, part_ml_ptr, out_ptr, DV, splits, o_sb, o_sh,
                                  BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (b, head): out[b, 0, head, :] = sum_s w_s acc_s / sum_s w_s l_s, w_s = exp(m_s - max m)."""
    b = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    n_heads = tl.num_programs(1)
    first = (b * n_heads + head) * splits  # the (b, head) partials' first row
    dv = tl.arange(0, BLOCK_DV)
    m_run = tl.full((1,), float("-inf"), tl.float32)
    l_run = tl.zeros((1,), tl.float32)
    acc = tl.zeros((BLOCK_DV,), tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < splits
        m = tl.load(part_ml_ptr + (first + s) * 2, mask=s_ok, other=float("-inf"))  # [BLOCK_S]
        l = tl.load(part_ml_ptr + (first + s) * 2 + 1, mask=s_ok, other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # [1]
        # ranges that saw no key keep m = -inf and weigh nothing; -inf - -inf is NaN, kept out
        alpha = tl.where(m_run > float("-inf"), tl.exp(m_run - m_new), 0.0)
        w = tl.where(m > float("-inf"), tl.exp(m - m_new), 0.0)  # [BLOCK_S]
        part = tl.load(part_acc_ptr + (first + s)[:, None] * DV + dv[None, :],
                       mask=s_ok[:, None] & (dv < DV)[None, :], other=0.0)  # [BLOCK_S, BLOCK_DV]
        acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        m_run = m_new
    out = acc / l_run  # a query that sees no key: 0 / 0, NaN, as SDPA's math kernel gives
    tl.store(out_ptr + b * o_sb + head * o_sh + dv, out.to(out_ptr.dtype.element_ty), mask=dv < DV)
