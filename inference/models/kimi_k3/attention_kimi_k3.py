"""Kimi-K3 attention: KDA with a full-rank output gate, and nope-only MLA with a sigmoid output gate.

Both reuse transformers' kimi_linear pieces where the math is the same (the chunked/recurrent KDA
kernels, causal conv1d, the gated RMSNorm, MLA's latent expansion and cache handling); what differs
from Kimi-Linear (llama.cpp src/models/kimi-k3.cpp, points 4 and 5):
- KDA: q/k/v each have their own depthwise conv (`q_conv1d`, `k_conv1d`, `v_conv1d`, [d, 1, K]) and the
  convolution always uses SiLU; the output gate is one full-rank `g_proj` [d, H] instead of g_b(g_a(x));
  with `gate_lower_bound` set the decay is g = lower_bound * sigmoid(exp(A_log) * (f_b(f_a(x)) + dt_bias)),
  else Kimi-Linear's g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias); `A_log` is a plain [num_heads].
- MLA: attention output * sigmoid(g_proj(x)) before o_proj, x being the normed layer input; no RoPE
  (the rope part of q/k is used as is, as in kimi_linear).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.models.kimi_linear import modeling_kimi_linear as kimi_linear
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from inference.models.kimi_k3.configuration_kimi_k3 import KimiK3Config
from inference.models.kimi_k3.transformers_compat import count_in_place_conv_token, linear_attention_states

KDA_CONV_ACTIVATION = "silu"  # fixed in K3 (hidden_act is "situ", which only the MLPs use)


class KimiK3DeltaAttention(nn.Module):
    """Kimi Delta Attention of a K3 linear-attention layer (parameter names as in the official checkpoint)."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.hidden_size = config.hidden_size
        self.num_heads = config.linear_num_heads
        self.head_dim = config.linear_head_dim
        self.projection_size = self.num_heads * self.head_dim  # d
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.gate_lower_bound = config.kda_gate_lower_bound

        d = self.projection_size
        self.q_proj = nn.Linear(self.hidden_size, d, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, d, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, d, bias=False)
        self.q_conv1d = self._depthwise_conv(d)
        self.k_conv1d = self._depthwise_conv(d)
        self.v_conv1d = self._depthwise_conv(d)
        self.f_a_proj = nn.Linear(self.hidden_size, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, d, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(d, dtype=torch.float32))
        self.A_log = nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32))
        self.b_proj = nn.Linear(self.hidden_size, self.num_heads, bias=False)
        self.g_proj = nn.Linear(self.hidden_size, d, bias=False)
        self.o_norm = kimi_linear.KimiLinearRMSNormGated(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(d, self.hidden_size, bias=False)

    def _depthwise_conv(self, channels: int) -> nn.Conv1d:
        return nn.Conv1d(channels, channels, kernel_size=self.conv_kernel_size, groups=channels, bias=False,
                         padding=self.conv_kernel_size - 1)

    def decay(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """Per-channel log decay g [B, T, heads, head_dim] (float32, <= 0)."""
        raw = self.f_b_proj(self.f_a_proj(hidden_states)).float() + self.dt_bias.float()  # [B, T, d]
        raw = raw.view(*raw.shape[:2], self.num_heads, self.head_dim)
        rate = self.A_log.float().exp().view(1, 1, -1, 1)  # exp(A_log) per head
        if self.gate_lower_bound is not None:
            return self.gate_lower_bound * torch.sigmoid(rate * raw)
        return -rate * F.softplus(raw)

    def forward(self, hidden_states: torch.Tensor, cache: Cache | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden_states = kimi_linear.apply_mask_to_padding_states(hidden_states, attention_mask)
        batch_size, seq_len = hidden_states.shape[:2]
        head_shape = (batch_size, seq_len, self.num_heads, self.head_dim)

        # q, k and v convolve channel by channel, so one conv over their concatenation is the same
        # computation and lets the cache keep one conv state, as kimi_linear's does
        mixed_qkv = torch.cat([self.q_proj(hidden_states), self.k_proj(hidden_states),
                               self.v_proj(hidden_states)], dim=-1).transpose(1, 2)  # [B, 3d, T]
        conv_weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight,
                                 self.v_conv1d.weight]).squeeze(1)  # [3d, K]
        conv_state, recurrent_state = linear_attention_states(cache, self.layer_idx)
        if conv_state is not None and seq_len == 1:
            count_in_place_conv_token(cache, self.layer_idx)
            mixed_qkv = kimi_linear.causal_conv1d_update(mixed_qkv, conv_state, weight=conv_weight,
                                                         activation=KDA_CONV_ACTIVATION)
        else:
            if cache is not None:
                mixed_qkv = cache.update_conv_state(mixed_qkv, self.layer_idx, conv_kernel_size=self.conv_kernel_size)
            mixed_qkv = kimi_linear.causal_conv1d_fn(mixed_qkv, weight=conv_weight, activation=KDA_CONV_ACTIVATION)
            mixed_qkv = mixed_qkv[:, :, -seq_len:]  # a continued prefill convolved its cached prefix too
        query, key, value = (t.reshape(head_shape) for t in
                             torch.split(mixed_qkv.transpose(1, 2), [self.projection_size] * 3, dim=-1))

        g = self.decay(hidden_states)
        beta = torch.sigmoid(self.b_proj(hidden_states))  # [B, T, heads]
        kda = (kimi_linear.recurrent_kimi_delta_attention if recurrent_state is not None and seq_len == 1
               else kimi_linear.chunk_kimi_delta_attention)
        core, last_state = kda(query, key, value, g=g, beta=beta, initial_state=recurrent_state,
                               output_final_state=cache is not None, use_qk_l2norm_in_kernel=True)
        if cache is not None:
            cache.update_recurrent_state(last_state.to(torch.float32), self.layer_idx)

        gate = self.g_proj(hidden_states).view(head_shape)  # full-rank output gate
        output = self.o_norm(core, gate).reshape(batch_size, seq_len, -1)  # [B, T, d]
        return self.o_proj(output)


class KimiK3MLAAttention(kimi_linear.KimiLinearAttention):
    """Kimi-Linear's nope-only MLA plus K3's sigmoid output gate `g_proj` [heads * v_head_dim, H]."""

    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.g_proj = (nn.Linear(config.hidden_size, self.num_heads * self.v_head_dim, bias=False)
                       if config.mla_use_output_gate else None)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None,
                cache: Cache | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch_size, seq_length = hidden_states.shape[:-1]
        if self.q_lora_rank is None:
            q_states = self.q_proj(hidden_states)
        else:
            q_states = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        query_states = q_states.view(batch_size, seq_length, -1, self.qk_head_dim).transpose(1, 2)  # [B, h, T, qk]

        compressed_kv = self.kv_a_proj_with_mqa(hidden_states)  # [B, T, kv_lora + rope]
        kv_nope, k_rot = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_nope = self.kv_a_layernorm(kv_nope).view(batch_size, 1, seq_length, self.kv_lora_rank)
        k_rot = k_rot.reshape(batch_size, 1, seq_length, self.qk_rope_head_dim)
        if cache is not None:  # the cache holds the compressed latent
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx, kwargs=kwargs)
        key_states, value_states = self.expand_kv(kv_nope, k_rot)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, kimi_linear.eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self, query_states, key_states, value_states, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )
        attn_output = attn_output.reshape(batch_size, seq_length, -1)  # [B, T, h * v]
        if self.g_proj is not None:
            attn_output = attn_output * torch.sigmoid(self.g_proj(hidden_states))
        return self.o_proj(attn_output), attn_weights
