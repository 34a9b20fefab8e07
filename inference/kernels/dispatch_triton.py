"""The grouped GEMM's dispatch in one program: the pairs sorted by expert and the block table.

A prefill's MoE layer needs its (token, expert) pairs grouped by expert and a table of blocks of
at most BLOCK_M pairs of one expert (inference.kernels.ops.GemmBlocks) before its grouped GEMMs.
Built from torch ops that is a stable sort (a radix sort of a few hundred keys: ~27 us on an
H100), three searchsorted, a cumsum and some twenty small element-wise and index kernels, about
thirty launches a layer (a third of a 64-token prefill's kernels). Here it is one program:

    counts[e] = pairs of expert e; starts = exclusive cumsum of counts     (pass 1 over the pairs)
    position of pair p = starts[e_p] + (pairs q < p with e_q = e_p)        (pass 2: a stable sort)
    block b belongs to the expert whose block range [bstart, bend) holds it (blocks = ceil(count / BLOCK_M))

The pairs are read in chunks of CHUNK (a [CHUNK, EP] one-hot of their experts), so many pairs need
no more registers than a few, only more time (inference.kernels.dispatch hands long prefills to
torch's ops). Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_dispatch_kernel(expert_ptr, map_ptr, order_ptr, sorted_ptr, table_ptr, miss_ptr, S, E, B,
                        BLOCK_M: tl.constexpr, EP: tl.constexpr, CHUNK: tl.constexpr, COUNT_MISSES: tl.constexpr):
    """expert_ptr: int64 [S] the pairs' experts (top_k_index flattened); map_ptr: int32 [E] the
    experts' slots (-1: absent). Writes order_ptr (int64 [S]: the pair at each sorted position,
    ascending expert, pairs of one expert in ascending order), sorted_ptr (int64 [S]: the expert
    at each sorted position) and table_ptr (int32 [B, 3]: slot (an absent expert's 0), first
    sorted position, pairs; rows past the real blocks hold 0 pairs); with COUNT_MISSES adds the
    pairs whose expert is absent to miss_ptr (int32 [1])."""
    e = tl.arange(0, EP)
    emask = e < E
    counts = tl.zeros([EP], tl.int32)
    for c0 in range(0, S, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        experts = tl.load(expert_ptr + s, mask=s < S, other=-1).to(tl.int32)  # [CHUNK]
        counts += tl.sum((experts[:, None] == e[None, :]).to(tl.int32), axis=0)  # [EP]
    starts = tl.cumsum(counts, 0) - counts  # [EP] first sorted position of each expert
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [EP]
    block_ends = tl.cumsum(blocks, 0)  # [EP] one past each expert's last block
    slots = tl.load(map_ptr + e, mask=emask, other=0)  # [EP] int32
    if COUNT_MISSES:
        tl.atomic_add(miss_ptr, tl.sum(tl.where(slots < 0, counts, 0)))
    seen = tl.zeros([EP], tl.int32)  # pairs of each expert placed so far
    for c0 in range(0, S, CHUNK):
        s = c0 + tl.arange(0, CHUNK)
        smask = s < S
        experts = tl.load(expert_ptr + s, mask=smask, other=-1).to(tl.int32)
        one_hot = (experts[:, None] == e[None, :]).to(tl.int32)  # [CHUNK, EP]
        before = tl.cumsum(one_hot, 0) - one_hot  # [CHUNK, EP] earlier pairs of the chunk, same expert
        position = tl.sum(one_hot * (starts + seen)[None, :] + one_hot * before, axis=1)  # [CHUNK]
        tl.store(order_ptr + position, s.to(tl.int64), mask=smask)
        tl.store(sorted_ptr + position, experts.to(tl.int64), mask=smask)
        seen += tl.sum(one_hot, axis=0)
    for b0 in range(0, B, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        # the expert of block b: the first whose blocks end past b (one with no pairs ends where it
        # starts, so it is passed over); none past the last real block
        owner = tl.sum(((block_ends[None, :] <= b[:, None]) & emask[None, :]).to(tl.int32), axis=1)  # [CHUNK]
        # [CHUNK, EP]; owner E (past the real blocks) matches a padding column of no pairs, or none
        mine = e[None, :] == owner[:, None]
        local = b - tl.sum(tl.where(mine, (block_ends - blocks)[None, :], 0), axis=1)  # [CHUNK] index among its blocks
        count = tl.sum(tl.where(mine, counts[None, :], 0), axis=1) - local * BLOCK_M
        count = tl.minimum(tl.maximum(count, 0), BLOCK_M)
        slot = tl.maximum(tl.sum(tl.where(mine, slots[None, :], 0), axis=1), 0)  # an absent expert reads slot 0
        first = tl.sum(tl.where(mine, starts[None, :], 0), axis=1) + local * BLOCK_M
        bmask = b < B
        tl.store(table_ptr + 3 * b, slot, mask=bmask)
        tl.store(table_ptr + 3 * b + 1, tl.where(count > 0, first, 0), mask=bmask)
        tl.store(table_ptr + 3 * b + 2, count, mask=bmask)
