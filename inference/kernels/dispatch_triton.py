"""The grouped GEMM's dispatch in one program: the pairs sorted by expert and the block table.

A prefill's MoE layer needs its (token, expert) pairs grouped by expert and a table of blocks of
at most BLOCK_M pairs of one expert (inference.kernels.ops.GemmBlocks) before its grouped GEMMs.
Built from torch ops that is a stable sort (a radix sort of a few hundred keys: ~27 us on an
H100), three searchsorted, a cumsum and some twenty small element-wise and index kernels, about
thirty launches a layer (a third of a 64-token prefill's kernels). Here it is one program:

    counts[e] = pairs of expert e (a histogram); starts = exclusive cumsum of counts
    the sorted pairs: the keys expert * SP + pair (unique: a stable sort) sorted in registers
    block b belongs to the expert whose block range [bstart, bend) holds it (blocks = ceil(count / BLOCK_M))

All S pairs sit in the program's registers at once (SP, the power of two at or above S), so its
registers grow with the pairs: inference.kernels.dispatch hands long prefills to torch's ops.
Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def moe_dispatch_kernel(expert_ptr, map_ptr, order_ptr, sorted_ptr, table_ptr, miss_ptr, S, E, B,
                        BLOCK_M: tl.constexpr, EP: tl.constexpr, SP: tl.constexpr, CHUNK: tl.constexpr,
                        COUNT_MISSES: tl.constexpr):
    """expert_ptr: int64 [S] the pairs' experts (top_k_index flattened); map_ptr: int32 [E] the
    experts' slots (-1: absent). Writes order_ptr (int64 [S]: the pair at each sorted position,
    ascending expert, pairs of one expert in ascending order), sorted_ptr (int64 [S]: the expert
    at each sorted position) and table_ptr (int32 [B, 3]: slot (an absent expert's 0), first
    sorted position, pairs; rows past the real blocks hold 0 pairs); with COUNT_MISSES adds the
    pairs whose expert is absent to miss_ptr (int32 [1]). SP: a power of two >= S; CHUNK: the
    blocks of the table built at a time."""
    e = tl.arange(0, EP)
    emask = e < E
    s = tl.arange(0, SP)
    smask = s < S
    experts = tl.load(expert_ptr + s, mask=smask, other=0).to(tl.int32)  # [SP]
    counts = tl.histogram(experts, EP, mask=smask)  # [EP]
    # unique keys, so sorting them is a stable sort by expert; the padding past S sorts last
    keys = tl.sort(tl.where(smask, experts * SP + s, EP * SP + s))  # [SP] int32
    tl.store(order_ptr + s, (keys % SP).to(tl.int64), mask=smask)
    tl.store(sorted_ptr + s, (keys // SP).to(tl.int64), mask=smask)
    starts = tl.cumsum(counts, 0) - counts  # [EP] first sorted position of each expert
    blocks = (counts + BLOCK_M - 1) // BLOCK_M  # [EP]
    block_ends = tl.cumsum(blocks, 0)  # [EP] one past each expert's last block
    slots = tl.load(map_ptr + e, mask=emask, other=0)  # [EP] int32
    if COUNT_MISSES:
        tl.atomic_add(miss_ptr, tl.sum(tl.where(slots < 0, counts, 0)))
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
