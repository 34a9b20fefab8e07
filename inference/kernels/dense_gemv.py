"""One token through a dense projection: y[N] = W[N, K] @ x[K] (+ b), weights in bfloat16 or float16.

A decode step's attention projections, shared experts and LM head multiply one row by a weight
matrix; the time is the weight's bytes over memory bandwidth. cuBLAS runs these M=1 products at
~1.4 TB/s on the H200 for the 2-16 MiB matrices of a decode step (docs/benchmarks.md, the q/o
projections of the Qwen3-like shape), a third of what HBM gives: too few blocks per SM for the
small matrices, a tile sized for larger M. Here every program reads BLOCK_N whole rows in
BLOCK_K-column steps, multiplies in float32 and rounds once, like cuBLAS (the sum runs in another
order: results may differ from cuBLAS's by a unit in the last place). Importing this module
imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def dense_gemv_kernel(x_ptr, w_ptr, b_ptr, out_ptr, N, K, w_stride,
                      HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program p: out[p*BLOCK_N : (p+1)*BLOCK_N] = W[rows, :] @ x (+ b[rows])."""
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    row_ok = rows < N
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * w_stride  # [BLOCK_N, 1] row starts
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)  # [BLOCK_K]
        col_ok = cols < K
        x = tl.load(x_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        # each weight byte is read once per step: keep it out of the L2 the activations use
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & col_ok[None, :], other=0.0,
                    eviction_policy="evict_first").to(tl.float32)  # [BLOCK_N, BLOCK_K]
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N] float32
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=row_ok)
