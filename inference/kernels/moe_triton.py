"""Triton kernels of the fused experts path: a grouped GEMV over arena slots, and the combine.

`moe_gemv_kernel`: program (p, n-tile) computes rows n of out[p] = W(slot[p]) · x[token[p]] for
one (token, expert) pair p, reading W's quantized rows in place from the slot (no gathered copy,
no dequantized copy). A weight is up to two row segments of the object (gate rows then up rows,
each its own role), so split gate/up roles make one [2I] output without concatenating bytes.

`moe_combine_kernel`: out[t] = sum over t's k experts, in ascending expert id, of
round(y[p] * w[p]), each partial sum rounded to the model dtype: the order and roundings of
transformers' eager experts forward (one index_add_ per expert, ascending), so the combine adds
no difference of its own.

Importing this module imports triton; inference.kernels.ops decides when to use it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.kernels import quant_dot as qd
from inference.kernels import quant_dot_k as qk
from inference.kernels import quant_tile as qt

# The kernels' non-constexpr arguments as triton types, for compiling them ahead of time without a
# launch (tests/inference/kernels_compile_check.py, bench/kernel_sass.py): a bf16 model's.
_COMMON_ARGUMENT_TYPES = {
    "x_ptr": "*bf16", "arena_ptr": "*u8", "out_ptr": "*bf16", "x_stride": "i32", "slot_bytes": "i32", "off1": "i32",
    "off2": "i32", "n_split": "i32", "row_bytes": "i32", "nblk": "i32", "out_stride": "i32", "N": "i32",
    "host_first": "i32", "host_delta": "i64"}  # a host tier: its distance is 64-bit
GEMM_ARGUMENT_TYPES = {**_COMMON_ARGUMENT_TYPES, "order_ptr": "*i64", "blocks_ptr": "*i32"}
GEMV_ARGUMENT_TYPES = {**_COMMON_ARGUMENT_TYPES, "expert_ptr": "*i64", "map_ptr": "*i32", "miss_ptr": "*i32"}

# Kernel type codes (the QT constexpr): each type's inference.dequant.registry.FusedKernel.code,
# checked against ops.KERNEL_CODES on import of inference.kernels.ops.


@triton.jit
def _dot(QT: tl.constexpr, acc, row, kb, nblk, x_row, rmask, NB: tl.constexpr, WR: tl.constexpr,
         INTERP: tl.constexpr):
    """acc plus the product tile of the step at block kb (acc 0.0 on the first step): Q4_K and
    MXFP4 accumulate by fma, the others add their tile."""
    if QT <= 2:
        return acc + qd.dot_float(row, kb, nblk, x_row, rmask, QT, NB, WR, INTERP)
    elif QT == 8:
        return qd.dot_mxfp4_acc(acc, row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    elif QT <= 7:
        return acc + qd.dot_blocks32(QT, row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    elif QT == 9:
        return acc + qk.dot_q2_k(row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    elif QT == 10:
        return acc + qk.dot_q3_k(row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    elif QT == 11:
        return qk.dot_q4_k_acc(row, kb, x_row, rmask, acc, WR, INTERP)
    elif QT == 12:
        return acc + qk.dot_q5_k(row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    else:
        return acc + qk.dot_q6_k(row, kb, nblk, x_row, rmask, NB, WR, INTERP)


@triton.jit
def moe_gemv_kernel(x_ptr, x_stride, expert_ptr, map_ptr, miss_ptr, arena_ptr, slot_bytes, host_first, host_delta,
                    off1, off2, n_split, row_bytes, nblk, out_ptr, out_stride, N,
                    QT: tl.constexpr, NB: tl.constexpr, RANK: tl.constexpr, BLOCK_N: tl.constexpr,
                    WR: tl.constexpr, INTERP: tl.constexpr, TOP_K: tl.constexpr, X_PER_PAIR: tl.constexpr,
                    COUNT_MISSES: tl.constexpr):
    """out[p, n] = sum_k W[n, k] x[row, k] with W the weight of pair p's expert, row = p's token
    (p // TOP_K), or p itself when X_PER_PAIR (x holds one row per pair).

    Pair p's expert is expert_ptr[p] (top_k_index flattened), found at slot map_ptr[expert] (a row
    of storaged's slot map, or a table of just-acquired slots). Rows n < n_split start at byte
    off1 + n * row_bytes of the object, the others at off2 + (n - n_split) * row_bytes. Slot -2:
    the CPU computes the pair (inference.kernels.handoff), the program writes nothing. Slot -1
    (the expert is not resident) is counted in miss_ptr (COUNT_MISSES) and reads slot 0
    instead: the result is garbage, and the caller, who sees the count, discards it. A slot
    >= host_first is host tier slot (slot - host_first), read in place over the link at byte
    host_delta + (slot - host_first) * slot_bytes from the arena's start (host_delta may be < 0).
    """
    p = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows
    nmask = n < N
    slot = tl.load(map_ptr + tl.load(expert_ptr + p))
    if slot == -2:  # the CPU computes this pair (inference.kernels.handoff): its row is written there
        return
    if COUNT_MISSES:
        tl.atomic_add(miss_ptr, 1, mask=(slot < 0) & (tl.program_id(1) == 0))
    slot = tl.maximum(slot, 0).to(tl.int64)
    base = tl.where(slot >= host_first, host_delta + (slot - host_first) * slot_bytes, slot * slot_bytes)  # bytes
    if X_PER_PAIR:
        token = p
    else:
        token = p // TOP_K
    # rows past N read row N - 1 (their sums are not stored), so no load needs a row mask: a
    # constant-true mask compiles to unpredicated loads
    n64 = tl.minimum(n, N - 1).to(tl.int64)
    # the second role's rows by arithmetic, as in moe_gemm_kernel: the offsets keep their 16-byte
    # divisibility, so the packed bytes of Q4_K, Q5_K (and Q2_K's 4) load as vectors
    second = (n64 >= n_split).to(tl.int64)  # [BN] 1 for the second role's rows
    row_offset = off1 + n64 * row_bytes + second * (off2 - off1 - n_split * row_bytes.to(tl.int64))  # [BN] bytes
    row = (arena_ptr + base + row_offset)[:, None]  # [BN, 1] uint8 ptrs
    x_row = x_ptr + token * x_stride
    rmask = tl.full([BLOCK_N, 1], 1, tl.int1)
    # products accumulate as a tile; one reduction after the loop, not one per step
    acc = _dot(QT, 0.0, row, 0, nblk, x_row, rmask, NB, WR, INTERP)
    for kb in range(NB, nblk, NB):
        acc = _dot(QT, acc, row, kb, nblk, x_row, rmask, NB, WR, INTERP)
    # the matmul's output dtype is the model's: round as cuBLAS does (to nearest even)
    out = qd.round_weights(qd.reduce_tile(acc, RANK), WR, INTERP)
    tl.store(out_ptr + p * out_stride + n, out.to(out_ptr.dtype.element_ty), mask=nmask)


@triton.jit
def moe_combine_kernel(y_ptr, y_stride, w_ptr, expert_ptr, out_ptr, out_stride, H,
                       K: tl.constexpr, KP: tl.constexpr, BLOCK_H: tl.constexpr, WR: tl.constexpr):
    """out[t, h] = ((0 + c1) + c2) + ... with c = round(y[p, h] * w[p]), p over token t's K pairs
    in ascending expert id (ranked here from expert_ptr, top_k_index [T, K]; KP = K rounded up
    to a power of two)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    j = tl.arange(0, KP)
    experts = tl.load(expert_ptr + t * K + j, mask=j < K, other=2**62)  # [KP], padding sorts last
    rank = tl.sum((experts[None, :] < experts[:, None]).to(tl.int32), axis=1)  # [KP] place of each pair
    acc = tl.zeros([BLOCK_H], tl.float32)
    for r in tl.static_range(K):
        p = t * K + tl.sum(tl.where(rank == r, j, 0))  # the pair with the r-th smallest expert id
        y = tl.load(y_ptr + p * y_stride + h, mask=hmask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + p).to(tl.float32)
        # rounded on the float32 bits: left as casts, the compiler turns this chain into native
        # bfloat16 mul/add instructions, whose results differed from eager's (seen on an H200)
        c = qd.round_weights(y * w, WR, True)
        acc = qd.round_weights(acc + c, WR, True)
    tl.store(out_ptr + t * out_stride + h, acc.to(out_ptr.dtype.element_ty), mask=hmask)


@triton.jit
def _gemm_step(acc, x_base, w, k, kmask, mmask, WR: tl.constexpr, INTERP: tl.constexpr, SWAP: tl.constexpr):
    """acc [BM, BN] += x[rows, k] (loaded at w's columns k) times w [BN, BK] transposed; with SWAP
    acc [BN, BM] += w times x[rows, k] transposed (the weights the dot's first operand)."""
    a = tl.load(x_base + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)  # [BM, BK]
    if INTERP:  # the interpreter has no bfloat16 dot: float32 of the same (exact) values
        return acc + tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
    elif WR == 0 and SWAP:
        return tl.dot(w, tl.trans(a), acc, input_precision="ieee")
    elif WR == 0:
        return acc + tl.dot(a, tl.trans(w), input_precision="ieee")
    # below, w holds unrounded float32 weights, rounded here once to the operand's dtype by an
    # instruction the compiler cannot move above the dequantization (a cast it would: the
    # arithmetic then runs in bfloat16, seen for Q4_1's d * q + m on an H200)
    elif SWAP:
        return tl.dot(qd.to_model_dtype(w, WR), tl.trans(a), acc)
    else:
        return acc + tl.dot(a, tl.trans(qd.to_model_dtype(w, WR)))


@triton.jit
def moe_gemm_kernel(x_ptr, x_stride, order_ptr, blocks_ptr, arena_ptr, slot_bytes, host_first, host_delta,
                    off1, off2, n_split, row_bytes, nblk, out_ptr, out_stride, N,
                    QT: tl.constexpr, NB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    TOP_K: tl.constexpr, GATHER_TOKENS: tl.constexpr, WR: tl.constexpr, INTERP: tl.constexpr,
                    SPLIT: tl.constexpr, PARTS: tl.constexpr, SWAP: tl.constexpr = False):
    """out[s, n] = sum_k W[n, k] x[row(s), k] for up to BLOCK_M expert-sorted pairs s of one expert.

    Block b of blocks_ptr (int32 [B, 3]: slot, first sorted position, pairs) names the expert's
    arena slot and its pairs s = first .. first + pairs - 1 (a block of 0 pairs does nothing);
    order_ptr[s] (int64) is pair s's index p = token * TOP_K + j. With GATHER_TOKENS x row(s) is
    p's token (the up projection reading hidden states), else s itself (down, reading the
    activation in sorted order). The weight tile of each step is dequantized once for all of the
    block's pairs (tensor-core dot); rows of W lie as in moe_gemv_kernel (off1/off2/n_split).
    SPLIT: each step dequantized in PARTS parts (ops.GEMM_PARTS[QT]) rather than whole. A slot >=
    host_first is a host tier slot, read in place as in moe_gemv_kernel. The weights are rounded to
    the model dtype once, as the dot's operand (quant_dot.to_model_dtype). SWAP: the weights the dot's
    first operand (ops.GEMM_SWAP), the accumulator [BN, BM] then, transposed for the store.
    """
    b = tl.program_id(0)
    count = tl.load(blocks_ptr + 3 * b + 2)
    if count == 0:  # a row past the real blocks of a table built on the device (inference.kernels.dispatch)
        return
    slot = tl.load(blocks_ptr + 3 * b).to(tl.int64)
    first = tl.load(blocks_ptr + 3 * b + 1)
    m = tl.arange(0, BLOCK_M)
    mmask = m < count  # [BM]
    s = (first + m).to(tl.int64)  # [BM] sorted positions
    if GATHER_TOKENS:
        x_rows = tl.load(order_ptr + s, mask=mmask, other=0) // TOP_K
    else:
        x_rows = s
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] output rows
    nmask = n < N
    n64 = n.to(tl.int64)
    # the second role's rows by arithmetic, not a select over the rows: triton keeps the offsets'
    # 16-byte divisibility through it (not through a select), so a row's packed bytes load as
    # vectors where the launch's offsets allow (16 bytes for Q4_K and Q5_K)
    second = (n64 >= n_split).to(tl.int64)  # [BN] 1 for the second role's rows
    row_offset = off1 + n64 * row_bytes + second * (off2 - off1 - n_split * row_bytes.to(tl.int64))  # [BN] bytes
    base = tl.where(slot >= host_first, host_delta + (slot - host_first) * slot_bytes, slot * slot_bytes)  # bytes
    row = (arena_ptr + base + row_offset)[:, None]  # [BN, 1] uint8 ptrs
    rmask = nmask[:, None]
    x_base = x_ptr + x_rows[:, None] * x_stride  # [BM, 1]
    if SWAP and not INTERP:  # (the interpreter's dot is the same either way)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    # compiled, the tiles hold unrounded float32 weights (WR 0) that _gemm_step rounds once, as the
    # dot's operand; interpreted, they are rounded on their bits (the interpreter's cast truncates)
    TILE_WR: tl.constexpr = WR if INTERP else 0
    for kb in range(0, nblk, NB):
        if SPLIT:  # the step in parts: smaller tiles, fewer live registers
            for part in tl.static_range(PARTS):
                w, k, kmask = qt.weight_part(QT, row, kb, nblk, rmask, NB, BLOCK_N, TILE_WR, INTERP, part)
                acc = _gemm_step(acc, x_base, w, k, kmask, mmask, WR, INTERP, SWAP)
        else:
            w, k, kmask = qt.weight_tile(QT, row, kb, nblk, rmask, NB, BLOCK_N, TILE_WR, INTERP)  # [BN, BK], [BK]
            acc = _gemm_step(acc, x_base, w, k, kmask, mmask, WR, INTERP, SWAP)
    if SWAP and not INTERP:
        acc = tl.trans(acc)  # [BM, BN]
    out = qd.round_weights(acc, WR, INTERP)
    tl.store(out_ptr + s[:, None] * out_stride + n[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
