"""Lookahead: while layer L computes, predict the experts layer L+1 will want and hint them.

Layer L+1's router applied to layer L's MoE input predicts L+1's choice well (the residual
stream changes little from one layer to the next; on the benchmark's balanced-routing model the
top-k recall was 0.86, and 0.997 for the top 2k), so the prediction costs one small matmul and
is sent as a Prefetch hint without waiting: storaged loads the hinted experts from idle read
bandwidth while this layer computes, demand reads first. A wrong hint costs bandwidth, never
correctness: the next layer still acquires exactly the experts its router picks. Whether a
prediction is sent at all is the HintPolicy's call (inference.experts.hint_policy): the next
layer's forward reports the experts it used (`observe`), and a width of step whose hints are
mostly wasted stops sending them until its predictions improve.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from inference.experts.errors import ExpertsError
from inference.experts.hint_policy import HintPolicy


class NextLayerPredictor:
    """Layer `layer`'s MoE input → a mask [E] of the experts `next_layer` probably wants."""

    def __init__(self, source, next_layer: int, router_weight: torch.Tensor, per_token: int,
                 correction_bias: torch.Tensor | None = None, policy: HintPolicy | None = None):
        if per_token < 1:
            raise ExpertsError(f"lookahead needs at least one expert per token, got {per_token}")
        self.source = source
        self.next_layer = next_layer
        self.weight = router_weight  # [E, H]
        self.per_token = min(per_token, router_weight.shape[0])
        self.bias = correction_bias  # [E] or None: sigmoid routers select on sigmoid(logits) + bias
        self.hinted = 0  # experts hinted so far
        self.policy = policy if policy is not None else HintPolicy(0.0)  # shared by the model's predictors

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """int32 [E], 1 for each expert in some token's predicted top (per_token); no host sync."""
        logits = F.linear(hidden.to(self.weight.dtype), self.weight).float()  # [T, E]
        if self.bias is not None:
            logits = logits.sigmoid() + self.bias.float()
        picks = logits.topk(self.per_token, dim=-1).indices.reshape(-1)  # [T * per_token]
        mask = torch.zeros(self.weight.shape[0], dtype=torch.int32, device=hidden.device)
        return mask.index_fill_(0, picks, 1)

    def send(self, mask: list[int], tokens: int) -> None:
        """Hint the experts of `mask` (predicted for a step over `tokens` tokens) if the policy
        says they pay; they are scored against what the next layer uses either way."""
        experts = [expert for expert, wanted in enumerate(mask) if wanted]
        if self.policy.predicted(self.next_layer, tokens, experts):
            self.source.prefetch(self.next_layer, experts)
            self.hinted += len(experts)

    def observe(self, tokens: int, used: list[int]) -> None:
        """The next layer ran over `tokens` tokens with the distinct experts `used`."""
        self.policy.observe(self.next_layer, tokens, used)


def router_of(block: torch.nn.Module, experts: torch.nn.Module, num_experts: int,
              hidden: int) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(router weight [E, H], selection bias [E] or None) of an MoE block: the child module other
    than its experts holding an [E, H] weight; None when the block has no such router."""
    for name, child in block.named_children():
        if child is experts:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, torch.Tensor) and tuple(weight.shape) == (num_experts, hidden) \
                and weight.device.type != "meta":
            bias = getattr(child, "e_score_correction_bias", None)
            if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,):
                bias = getattr(block, "e_score_correction_bias", None)
                if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (num_experts,):
                    bias = None
            return weight, bias
    return None
