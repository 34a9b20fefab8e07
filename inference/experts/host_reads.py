"""Experts read in place from storaged's host tier: one map for the fused GEMV over both tiers.

When VRAM holds half of the experts and host RAM the other half, a decode step needs about half of
its experts from the host tier. Copying them up costs a round trip to storaged per layer and a
copy each; the fused GEMV can instead read their quantized bytes where they are, over the link
(the daemon's host tier is a shared memory file this process maps read-only and registers with
the device). A decode step whose every expert is in one tier or the other then needs no Acquire.

The daemon publishes two maps: the slot map (object -> VRAM slot) and the host map (object ->
host slot). The kernels take one, merged inside the fenced step (so every slot it names stays
valid until the step finishes):

    merged[r, e] = slot_map[r, e]              where the object is in VRAM
                 = first + host_map[r, e]      else, where it is in the host tier
                 = -1                          else (absent: the step counts a miss)

The decode-sized GEMVs read the host tier, and so does a prefill's grouped GEMM while its blocks
read each expert's bytes about once (`host_tier_pairs`): it reads an expert's weights once per
block of up to 16 of its tokens, so over the link a long prompt would read the same bytes many
times; such a prompt keeps the slot map alone and acquires (the daemon copies up) what VRAM lacks.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.experts import fused as F
from inference.kernels import ops
from inference.kernels.ops import HostSlots


def reads_host_tier(binding) -> bool:
    """Whether an experts binding's (inference.experts.forward.ExpertsBinding) calls may read
    host-tier slots in place: its fused kernels do (biases, read from the slots by torch, would not be)."""
    fused = binding.fused
    return fused is not None and not fused.up_biases and fused.down_bias is None


def host_tier_pairs(binding) -> int:
    """The most (token, expert) pairs of one call that read host-tier slots in place: the per-pair
    GEMVs, or a grouped GEMM whose blocks read each expert's bytes about once over the link (a
    block of pairs per expert on average); a longer prompt acquires, and the daemon copies them up."""
    return max(F.GROUPED_PAIRS, ops.GEMM_BLOCK_M * binding.plan.target.num_experts) if reads_host_tier(binding) else 0


@dataclasses.dataclass(frozen=True)
class HostReads:
    """The daemon's host map rows (int32 [rows, E], on the compute device, live) and where the
    kernels find host slots (`slots`: ids from slots.first on are host slots)."""

    host_map: torch.Tensor
    slots: HostSlots
    # where this process maps the tier (host slot 0's CPU address; 0: unknown) and its slot count,
    # for CPU threads computing host-tier experts (inference.experts.cpu_experts)
    host_address: int = 0
    host_slots: int = 0

    def merge(self, slot_map: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """int32 [rows, E]: each object's VRAM slot, else first + its host slot, else -1. Device
        work only (no host sync): it can run inside a captured step."""
        host = torch.where(self.host_map >= 0, self.host_map + self.slots.first, -1)  # [rows, E] int32
        if out is None:
            return torch.where(slot_map >= 0, slot_map, host)
        return torch.where(slot_map >= 0, slot_map, host, out=out)


def absent_only(hint: torch.Tensor, merged_row: torch.Tensor | None) -> torch.Tensor:
    """int32 [E]: the lookahead's hint mask less the experts either tier holds (merged_row: the
    next layer's row of the merged map, or None: unchanged). A hint for a host-tier expert would
    have the daemon copy it up, pushing another object out of both tiers, for an expert the
    kernels read in place anyway. Device work only."""
    if merged_row is None:
        return hint
    return hint * (merged_row < 0).to(hint.dtype)
