"""Kimi-K3 feed-forward parts: SiTU activation, dense/shared MLP, routed experts, latent MoE block.

SiTU (llama.cpp's `kimi_k3_situ`, Moonshot's `activation_situ_*`):
    situ(gate, up) = beta * tanh(gate / beta) * sigmoid(gate) * linear_beta * tanh(up / linear_beta)
a soft-capped SiLU on the gate branch times a soft-capped identity on the up branch (linear_beta <= 0
or None leaves the up branch as is). Every MLP of the model uses it: dense layers, shared experts,
routed experts.

Latent MoE: the router scores the full-width input; routed experts run in a narrower latent space
(`routed_expert_down_proj` H -> L, experts L -> L, optional `routed_expert_norm` on their weighted
sum, `routed_expert_up_proj` L -> H); shared experts read the full-width input.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm, KimiLinearTopkRouter

from inference.models.kimi_k3.configuration_kimi_k3 import KimiK3Config


class KimiK3SituGate(nn.Module):
    """The gate branch of SiTU: beta * tanh(x / beta) * sigmoid(x), a SiLU whose growth is capped at beta."""

    def __init__(self, beta: float):
        super().__init__()
        if not beta > 0:
            raise ValueError(f"activation_situ_beta must be > 0, got {beta}")
        self.beta = float(beta)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.beta * torch.tanh(x / self.beta) * torch.sigmoid(x)

    def extra_repr(self) -> str:
        return f"beta={self.beta}"


class KimiK3SituLinear(nn.Module):
    """The up branch of SiTU: linear_beta * tanh(x / linear_beta), or x itself when linear_beta is off."""

    def __init__(self, linear_beta: float | None):
        super().__init__()
        self.linear_beta = float(linear_beta) if linear_beta is not None and linear_beta > 0 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.linear_beta is None:
            return x
        return self.linear_beta * torch.tanh(x / self.linear_beta)

    def extra_repr(self) -> str:
        return f"linear_beta={self.linear_beta}"


def gate_and_up_activations(config: KimiK3Config) -> tuple[nn.Module, nn.Module]:
    """(gate-branch activation, up-branch transform) of config.hidden_act."""
    if config.hidden_act == "situ":
        return KimiK3SituGate(config.activation_situ_beta), KimiK3SituLinear(config.activation_situ_linear_beta)
    return ACT2FN[config.hidden_act], nn.Identity()


class KimiK3MLP(nn.Module):
    """Gated MLP (dense layers and shared experts): down(act(gate(x)) * up_act(up(x)))."""

    def __init__(self, config: KimiK3Config, intermediate_size: int | None = None):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.intermediate_size = config.intermediate_size if intermediate_size is None else intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)
        self.act_fn, self.up_act_fn = gate_and_up_activations(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_act_fn(self.up_proj(x)))


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """Routed experts as 3-D tensors: gate_up_proj [E, 2I, D] (gate rows first), down_proj [E, D, I],
    D = routed_expert_hidden_size (the latent width) or hidden_size. `_apply_gate` is SiTU, so every
    experts implementation (eager, batched_mm, grouped_mm, expertpack) applies the same activation."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.num_experts = config.num_experts
        self.hidden_dim = config.expert_hidden_size
        self.intermediate_dim = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * self.intermediate_dim, self.hidden_dim))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim, self.intermediate_dim))
        self.act_fn, self.up_act_fn = gate_and_up_activations(config)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)  # [S, I] each
        return self.act_fn(gate) * self.up_act_fn(up)  # [S, I]

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        final = torch.zeros_like(hidden_states)  # [T, D]
        with torch.no_grad():
            hit = torch.unique(top_k_index).tolist()
        for expert in hit:
            token_idx, slot = torch.where(top_k_index == expert)
            state = hidden_states[token_idx]  # [n, D]
            gate_up = nn.functional.linear(state, self.gate_up_proj[expert])  # [n, 2I]
            out = nn.functional.linear(self._apply_gate(gate_up), self.down_proj[expert])  # [n, D]
            out = out * top_k_weights[token_idx, slot, None]
            final.index_add_(0, token_idx, out.to(final.dtype))
        return final


class KimiK3TopkRouter(KimiLinearTopkRouter):
    """Kimi-Linear's sigmoid, group-limited top-k router with its weight [E, H] and e_score_correction_bias [E]
    always created in float32: transformers 5.24's KimiLinearTopkRouter does so, 5.17's creates them in the
    default dtype, which from_config(dtype=bfloat16) sets, so the routing weights would be rounded to bf16
    there (and experts chosen differently from 5.24 and llama.cpp)."""

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.weight = nn.Parameter(self.weight.data.float())  # a no-op where it already is float32
        self.e_score_correction_bias = nn.Buffer(self.e_score_correction_bias.float())


class KimiK3SparseMoeBlock(nn.Module):
    """Router on the full-width input, routed experts in the latent space, shared experts at full width."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        self.config = config
        self.gate = KimiK3TopkRouter(config)
        self.experts = KimiK3Experts(config)
        self.shared_experts = (
            KimiK3MLP(config, intermediate_size=config.moe_intermediate_size * config.num_shared_experts)
            if config.num_shared_experts > 0 else None
        )
        latent = config.routed_expert_hidden_size
        self.routed_expert_down_proj = nn.Linear(config.hidden_size, latent, bias=False) if latent else None
        self.routed_expert_up_proj = nn.Linear(latent, config.hidden_size, bias=False) if latent else None
        self.routed_expert_norm = (
            KimiLinearRMSNorm(latent, eps=config.rms_norm_eps) if latent and config.latent_moe_use_norm else None
        )

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape  # [B, T, H]
        _, top_k_weights, top_k_index = self.gate(hidden_states)  # [N, k] each, N = B*T
        flat = hidden_states.reshape(-1, shape[-1])  # [N, H]
        routed_in = self.routed_expert_down_proj(flat) if self.routed_expert_down_proj is not None else flat  # [N, D]
        routed = self.experts(routed_in, top_k_index, top_k_weights)  # [N, D]
        if self.routed_expert_norm is not None:
            routed = self.routed_expert_norm(routed)
        if self.routed_expert_up_proj is not None:
            routed = self.routed_expert_up_proj(routed)  # [N, H]
        output = routed.view(shape)
        if self.shared_experts is not None:
            output = output + self.shared_experts(hidden_states)
        return output
