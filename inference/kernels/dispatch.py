"""Launcher of the grouped GEMM's dispatch: a call's (token, expert) pairs grouped by expert and
their block table (ops.GemmBlocks), built on the device with no host synchronization.

    grouped = device_dispatch(top_k_index.reshape(-1), slot_map, misses)
    out = moe_gemm(x, grouped.order, grouped.blocks, ...)        # [S, H], sorted order
    by_pair[grouped.order] = out

One Triton program (inference.kernels.dispatch_triton) for up to DISPATCH_PROGRAM_PAIRS pairs,
torch ops beyond.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.kernels import ops
from inference.kernels.ops import GemmBlocks, triton_module

DISPATCH_CHUNK = 64  # blocks of the table the dispatch program builds at a time
# Up to this many pairs one program dispatches, all of them in its registers (the chunked program
# before it took 39 us a layer for 512 pairs on an H100, against about 84 us of device time for
# torch's ops and their thirty launches; the register sort is not timed yet); beyond it a longer
# prefill takes torch's sort and searchsorted.
DISPATCH_PROGRAM_PAIRS = 1024


@dataclasses.dataclass(frozen=True)
class Dispatch:
    """A grouped call's pairs grouped by expert, built on the device (no host synchronization)."""

    order: torch.Tensor  # int64 [S]: the pair at each sorted position (ascending expert, then pair)
    sorted_experts: torch.Tensor  # int64 [S]: the expert at each sorted position
    blocks: GemmBlocks


def _pow2(n: int) -> int:
    """The power of two at or above n (>= 1)."""
    return 1 << max(0, (n - 1).bit_length())


def device_dispatch(experts: torch.Tensor, slot_map: torch.Tensor, misses: torch.Tensor | None = None,
                    block_m: int | None = None) -> Dispatch:
    """The pairs of `experts` (int64 [S], top_k_index flattened) sorted by expert, stably, and
    their `gemm_blocks` (experts at slot_map[expert], int32 [E]), in one program
    (inference.kernels.dispatch_triton); pairs whose expert is absent (slot -1) are added to
    `misses` (int32 [1]) and read slot 0: garbage the caller throws away.

    The number of blocks depends on the routing, which the host does not see, so the table has
    as many rows as any routing of S pairs over E experts can need (S // block_m + min(S, E)); the
    rows past the real blocks hold 0 pairs, and their programs return at once. Beyond
    DISPATCH_PROGRAM_PAIRS pairs the same is built from torch ops.
    """
    block_m = block_m or ops.GEMM_BLOCK_M
    pairs, n_experts = experts.shape[0], slot_map.shape[0]
    assert experts.dtype == torch.int64 and slot_map.dtype == torch.int32, (experts.dtype, slot_map.dtype)
    rows = pairs // block_m + min(pairs, n_experts)  # every block any routing can need
    if pairs > DISPATCH_PROGRAM_PAIRS:
        return _torch_dispatch(experts, slot_map, misses, block_m, rows)
    device = experts.device
    order = torch.empty(pairs, dtype=torch.int64, device=device)  # [S]
    sorted_experts = torch.empty(pairs, dtype=torch.int64, device=device)  # [S]
    table = torch.empty((rows, 3), dtype=torch.int32, device=device)  # [B, 3]
    if pairs:
        assert triton_module() is not None, "device_dispatch without triton: check fused_unavailable_reason first"
        from inference.kernels import dispatch_triton

        dispatch_triton.moe_dispatch_kernel[(1,)](
            experts.contiguous(), slot_map, order, sorted_experts, table, misses if misses is not None else slot_map,
            pairs, n_experts, rows, BLOCK_M=block_m, EP=_pow2(n_experts), SP=_pow2(pairs),
            CHUNK=DISPATCH_CHUNK, COUNT_MISSES=misses is not None, num_warps=8)
    return Dispatch(order, sorted_experts, GemmBlocks(table, block_m))


def _torch_dispatch(experts: torch.Tensor, slot_map: torch.Tensor, misses: torch.Tensor | None,
                    block_m: int, rows: int) -> Dispatch:
    """device_dispatch from torch ops: a stable sort, then each block's expert by searchsorted."""
    sorted_experts, order = torch.sort(experts, stable=True)  # [S]
    if misses is not None:
        misses.add_((slot_map[sorted_experts] < 0).sum(dtype=torch.int32))
    n_experts = slot_map.shape[0]
    ids = torch.arange(n_experts, device=experts.device)  # [E]
    starts = torch.searchsorted(sorted_experts, ids)  # [E] first sorted position of each expert
    counts = torch.searchsorted(sorted_experts, ids, right=True) - starts  # [E] pairs of each expert
    nblocks = (counts + block_m - 1) // block_m  # [E]
    ends = nblocks.cumsum(0)  # [E] one past each expert's last block
    b = torch.arange(rows, device=experts.device)  # [B] every block that can exist
    expert = torch.searchsorted(ends, b, right=True).clamp_(max=n_experts - 1)  # [B] the expert of block b
    local = b - (ends[expert] - nblocks[expert])  # [B] block b's index among its expert's blocks
    count = (counts[expert] - local * block_m).clamp_(0, block_m)  # [B] 0 past the last real block
    slot = slot_map[expert].to(torch.int64).clamp_(min=0)  # [B] an absent expert (-1) reads slot 0: garbage
    table = torch.stack([slot, starts[expert] + local * block_m, count], dim=1)  # [B, 3]
    return Dispatch(order, sorted_experts, GemmBlocks(table.to(torch.int32), block_m))
