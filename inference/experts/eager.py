"""The arithmetic of transformers' eager experts forward for one expert (or one row per pair, or
groups of rows), shared by the exact path (inference.experts.forward) and the fused path's
fallback for weights its kernels cannot read (inference.experts.fused)."""

from __future__ import annotations

import torch

from inference.experts.plan import LayerPlan, Which


def expert_outputs(module: torch.nn.Module, plan: LayerPlan, x: torch.Tensor, weights: dict[str, torch.Tensor],
                   i: Which) -> torch.Tensor:
    """Expert i on its tokens x; or (i None) expert e on row e of x; or (i a tensor of cumulative
    row counts) every expert on its group of rows: up, gate, down, as eager does."""
    gate_up = plan.up_output(x, weights, i)  # [rows, 2I] in the module's layout
    activated = module._apply_gate(gate_up) if plan.target.has_gate else module.act_fn(gate_up)
    out = plan.down_output(activated, weights, i)  # [rows, H]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out
