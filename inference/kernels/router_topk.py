"""A softmax router's top-k for one token: softmax over the experts' logits in float32, the k
largest probabilities (descending; equal ones by lowest expert id, as a stable sort would
order them), optionally renormalized to sum to one.

transformers' routers run this as five to seven kernels per MoE layer (softmax, top-k, the sort of
the k values torch.topk does, the sum and division, casts): ~9 us of a decode step's layer on the
H200. Here it is one program per token. Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softmax_topk_kernel(logits_ptr, scores_ptr, indices_ptr, E, K, logits_stride,
                        RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    """Row t: p = softmax(logits[t, :E]) (float32); scores[t, :K] = the K largest p, descending
    (divided by their sum with RENORMALIZE), rounded to the scores' dtype; indices[t, :K] their experts."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    logits = tl.load(logits_ptr + t * logits_stride + e, mask=e < E, other=float("-inf")).to(tl.float32)
    shifted = tl.exp(logits - tl.max(logits, axis=0))
    p = shifted / tl.sum(shifted, axis=0)  # [BLOCK_E], 0 beyond E
    left = tl.where(e < E, p, -1.0)  # probabilities not taken yet; -1 ranks below every probability
    slot = tl.arange(0, BLOCK_K)
    values = tl.zeros((BLOCK_K,), tl.float32)
    chosen = tl.zeros((BLOCK_K,), tl.int64)
    for i in range(K):
        best = tl.max(left, axis=0)
        pick = tl.min(tl.where(left == best, e, BLOCK_E), axis=0)  # the lowest id among equals
        values = tl.where(slot == i, best, values)
        chosen = tl.where(slot == i, pick.to(tl.int64), chosen)
        left = tl.where(e == pick, -1.0, left)
    if RENORMALIZE:
        values = values / tl.sum(tl.where(slot < K, values, 0.0), axis=0)
    tl.store(scores_ptr + t * K + slot, values.to(scores_ptr.dtype.element_ty), mask=slot < K)
    tl.store(indices_ptr + t * K + slot, chosen, mask=slot < K)
