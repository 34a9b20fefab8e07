"""The "expertpack" experts implementation registered with transformers' ExpertsInterface.

transformers calls `expertpack_experts_forward(experts_module, hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])` in place of the module's own forward. The module's
routed parameters stay on the meta device; the weights come from the expert source instead:

1. group the (token, slot) pairs by expert: the unique experts are the one host sync;
2. acquire those experts' objects for the module's layer;
3. dequantize each weight for all of them at once (LayerPlan.materialize);
4. per expert, compute exactly what transformers' eager forward computes (same ops, same order);
   when every expert serves a single (token, slot) pair, as in decoding one sequence, the same
   computation runs for all of them at once, one batched matmul per projection (launch count,
   not arithmetic, is what a decode step spends its time on);
5. sum each token's contributions in ascending expert order starting from zero — the order in
   which the eager forward's per-expert `index_add_` adds them — so float32 results match it.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.experts.errors import ExpertSourceError, RoutingError, UnboundExpertsError
from inference.experts.plan import LayerPlan
from inference.experts.source import ExpertSource

IMPLEMENTATION_NAME = "expertpack"
BINDING_ATTRIBUTE = "expertpack_binding"


@dataclasses.dataclass
class ExpertsBinding:
    """What one experts module needs at run time: its layer, its source and its plan."""

    layer: int
    source: ExpertSource
    plan: LayerPlan


def expertpack_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    binding: ExpertsBinding | None = getattr(self, BINDING_ATTRIBUTE, None)
    if binding is None:
        raise UnboundExpertsError(type(self).__name__)
    plan = binding.plan
    tokens, top_k = top_k_index.shape
    if tokens == 0:
        return torch.zeros_like(hidden_states)

    pair_experts = top_k_index.reshape(-1)  # [S], S = T * k, pair p = (token p // k, slot p % k)
    sorted_experts, pair_order = torch.sort(pair_experts, stable=True)  # pairs grouped by expert
    unique, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    expert_ids, expert_counts = torch.stack([unique, counts]).tolist()  # the one device -> host sync
    for expert in (expert_ids[0], expert_ids[-1]):
        if not 0 <= expert < plan.target.num_experts:
            raise RoutingError(binding.layer, expert, plan.target.num_experts)

    objects = binding.source.acquire(binding.layer, expert_ids)
    if len(objects) != len(expert_ids):
        raise ExpertSourceError(binding.layer, f"asked for {len(expert_ids)} experts {expert_ids}, "
                                f"got {len(objects)} objects")
    weights = plan.materialize(objects)  # name -> [n, *shape], n = unique experts

    pair_weights = top_k_weights.reshape(-1)  # [S]
    pair_tokens = pair_order // top_k  # [S] token of each expert-sorted pair
    if len(expert_ids) == len(pair_order):
        # every expert serves one pair (decode): one batched matmul per projection, not n small ones
        contributions = _expert_outputs(self, plan, hidden_states[pair_tokens], weights, None)
        contributions = (contributions * pair_weights[pair_order, None]).to(hidden_states.dtype)  # [S, H]
    else:
        contributions = hidden_states.new_empty((tokens * top_k, hidden_states.shape[-1]))  # [S, H], sorted
        start = 0
        for i, count in enumerate(expert_counts):
            rows = slice(start, start + count)
            start += count
            out = _expert_outputs(self, plan, hidden_states[pair_tokens[rows]], weights, i)  # [count, H]
            contributions[rows] = (out * pair_weights[pair_order[rows], None]).to(hidden_states.dtype)

    return _sum_in_expert_order(contributions, pair_order, top_k_index, hidden_states)


def _expert_outputs(module: torch.nn.Module, plan: LayerPlan, x: torch.Tensor, weights: dict[str, torch.Tensor],
                    i: int | None) -> torch.Tensor:
    """Expert i on its tokens x, or (i None) expert e on row e of x: up, gate, down, as eager does."""
    gate_up = plan.up_output(x, weights, i)  # [rows, 2I] in the module's layout
    activated = module._apply_gate(gate_up) if plan.target.has_gate else module.act_fn(gate_up)
    out = plan.down_output(activated, weights, i)  # [rows, H]
    if getattr(module, "has_post_expert_norm", False):
        out = module.post_expert_norm(out)
    return out


def _sum_in_expert_order(contributions: torch.Tensor, pair_order: torch.Tensor, top_k_index: torch.Tensor,
                         hidden_states: torch.Tensor) -> torch.Tensor:
    """Per token, 0 + c(e1) + c(e2) + ... with e1 < e2 < ...: eager's index_add_ order, deterministic."""
    tokens, top_k = top_k_index.shape
    by_pair = torch.empty_like(contributions)
    by_pair[pair_order] = contributions  # back to (token, slot) order, [S, H]
    by_pair = by_pair.view(tokens, top_k, -1)
    slot_rank = torch.argsort(top_k_index, dim=1, stable=True)  # [T, k] slots by ascending expert id
    ordered = by_pair.gather(1, slot_rank.unsqueeze(-1).expand_as(by_pair))
    final = torch.zeros_like(hidden_states)
    for slot in range(top_k):
        final = final + ordered[:, slot]
    return final
