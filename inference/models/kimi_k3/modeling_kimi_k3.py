"""Kimi-K3 text model in transformers style: KimiK3Model, KimiK3ForCausalLM.

Cross-layer attention residuals (attn_res_block_size = S, llama.cpp src/models/kimi-k3.cpp point 1):
instead of one running residual stream, the model keeps a list of banked block states and a partial
sum of the current block. Before attention, before the MLP, and once before the final norm, the
sub-layer reads a softmax mix of [banked..., partial]: candidate v scores `<x>_res_proj(<x>_res_norm(v))`
(an RMSNorm with weight, then a pseudo-query row [1, H]), and the mix sums the *raw* candidates with
the softmax of the scores. At layers L % S == 0 the layer input (the partial sum) is banked first and
the new block's partial sum restarts from that layer's attention output. Layer 0 banks the embedding,
and with nothing banked before it its attention reads the embedding itself.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.masking_utils import create_causal_mask, create_recurrent_attention_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import PreTrainedModel
from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearRMSNorm
from transformers.utils import can_return_tuple
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from inference.models.kimi_k3.attention_kimi_k3 import KimiK3DeltaAttention, KimiK3MLAAttention
from inference.models.kimi_k3.configuration_kimi_k3 import KimiK3Config
from inference.models.kimi_k3.moe_kimi_k3 import KimiK3Experts, KimiK3MLP, KimiK3SparseMoeBlock, KimiK3TopkRouter
from inference.models.kimi_k3.transformers_compat import (
    accepts_legacy_cache_name,
    cache_of,
    mask_cache_kwargs,
    output_cache_kwargs,
)

KimiK3RMSNorm = KimiLinearRMSNorm  # same math: float32 normalisation, weight applied in the input dtype


def mix_attention_residuals(banked: list[torch.Tensor], partial: torch.Tensor, norm: nn.Module,
                            proj: nn.Linear) -> torch.Tensor:
    """softmax_i(proj(norm(v_i))) weighted sum of v_i over v = [banked..., partial] ([B, T, H] each)."""
    if not banked:
        return partial  # a softmax over one candidate is 1: the candidate itself
    candidates = torch.stack([*banked, partial], dim=-2)  # [B, T, N+1, H]
    scores = proj(norm(candidates)).squeeze(-1).float()  # [B, T, N+1]
    weights = torch.softmax(scores, dim=-1)
    mixed = (weights.unsqueeze(-1) * candidates.float()).sum(dim=-2)  # [B, T, H]
    return mixed.to(partial.dtype)


class KimiK3DecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: KimiK3Config, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.layer_type = config.layer_types[layer_idx]
        self.self_attn = (KimiK3MLAAttention(config, layer_idx) if self.layer_type == "full_attention"
                          else KimiK3DeltaAttention(config, layer_idx))
        self.mlp = KimiK3SparseMoeBlock(config) if config.mlp_layer_types[layer_idx] == "sparse" else KimiK3MLP(config)
        self.input_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attn_res_block_size = config.attn_res_block_size
        if self.attn_res_block_size is not None:
            self.self_attention_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attention_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
            self.mlp_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res_proj = nn.Linear(config.hidden_size, 1, bias=False)

    def forward(self, hidden_states: torch.Tensor, banked: list[torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, position_ids: torch.LongTensor | None = None,
                cache: Cache | None = None, **kwargs) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """hidden_states: the partial sum entering the layer; returns (partial sum leaving it, banked)."""
        partial: torch.Tensor | None = hidden_states
        banked = list(banked or [])
        uses_residual_attention = self.attn_res_block_size is not None
        if uses_residual_attention:
            attn_input = mix_attention_residuals(banked, partial, self.self_attention_res_norm,
                                                 self.self_attention_res_proj)
            if self.layer_idx % self.attn_res_block_size == 0:
                banked.append(partial)  # the raw layer input, not the mix
                partial = None
        else:
            attn_input = partial

        normed = self.input_layernorm(attn_input)
        if self.layer_type == "linear_attention":
            attn_output = self.self_attn(normed, cache=cache, attention_mask=attention_mask, **kwargs)
        else:
            attn_output, _ = self.self_attn(normed, attention_mask=attention_mask, cache=cache, **kwargs)
        partial = attn_output if partial is None else partial + attn_output

        mlp_input = (mix_attention_residuals(banked, partial, self.mlp_res_norm, self.mlp_res_proj)
                     if uses_residual_attention else partial)
        partial = partial + self.mlp(self.post_attention_layernorm(mlp_input))
        return partial, banked


class KimiK3PreTrainedModel(PreTrainedModel):
    config: KimiK3Config
    config_class = KimiK3Config
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KimiK3DecoderLayer"]
    _supports_flash_attn = True
    _supports_sdpa = True
    # the official checkpoint is multimodal; this is its language model
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^mm_projector\."]
    _can_record_outputs = {
        "router_logits": OutputRecorder(KimiK3TopkRouter, index=0),
        "hidden_states": OutputRecorder(KimiK3DecoderLayer, index=0),
        "attentions": OutputRecorder(KimiK3MLAAttention, index=1),
    }
    _is_stateful = True
    # transformers decides whether experts implementations are switchable by looking for
    # "@use_experts_implementation" in this module's source; KimiK3Experts (moe_kimi_k3) has it
    _can_set_experts_implementation_cached_value = True
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias", "A_log"]

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiK3DeltaAttention):  # FLA's initialization, as kimi_linear's
            init.copy_(module.A_log, init.uniform_(module.A_log, a=1.0, b=16.0).log())
            init.uniform_(module.dt_bias, a=math.log(1e-3), b=math.log(1e-1))
            dt = module.dt_bias.exp().clamp_min(1e-4)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))  # inverse softplus
            init.ones_(module.o_norm.weight)
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3TopkRouter):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)


class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, config.pad_token_id)
        self.layers = nn.ModuleList([KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = nn.Linear(config.hidden_size, 1, bias=False)
        self.gradient_checkpointing = False
        self.post_init()

    @merge_with_config_defaults
    @capture_outputs
    @accepts_legacy_cache_name
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, use_cache: bool | None = None,
                **kwargs) -> MoeModelOutputWithPast:
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)
        masks = attention_mask
        if not isinstance(masks, dict):
            mask_kwargs = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
                           "position_ids": position_ids, **mask_cache_kwargs(cache)}
            masks = {"full_attention": create_causal_mask(**mask_kwargs),
                     "linear_attention": create_recurrent_attention_mask(**mask_kwargs)}

        hidden_states, banked = inputs_embeds, []
        for i, layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            hidden_states, banked = layer(hidden_states, banked, attention_mask=masks[self.config.layer_types[i]],
                                          position_ids=position_ids, cache=cache, **kwargs)
        if self.config.attn_res_block_size is not None:
            hidden_states = mix_attention_residuals(banked, hidden_states, self.output_attn_res_norm,
                                                    self.output_attn_res_proj)
        return MoeModelOutputWithPast(last_hidden_state=self.norm(hidden_states), **output_cache_kwargs(cache))


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {}

    def __init__(self, config: KimiK3Config):
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @can_return_tuple
    @accepts_legacy_cache_name
    def forward(self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
                position_ids: torch.LongTensor | None = None, cache: Cache | None = None,
                inputs_embeds: torch.Tensor | None = None, labels: torch.LongTensor | None = None,
                use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0,
                **kwargs) -> MoeCausalLMOutputWithPast:
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                             cache=cache, inputs_embeds=inputs_embeds, use_cache=use_cache, **kwargs)
        # positions whose logits are wanted (0: all); transformers 5.17 has no slice_logits_to_keep
        keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, keep, :]
        logits = self.lm_head(hidden_states)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return MoeCausalLMOutputWithPast(loss=loss, logits=logits, **output_cache_kwargs(cache_of(outputs)),
                                         hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                         router_logits=outputs.router_logits)


__all__ = ["KimiK3PreTrainedModel", "KimiK3Model", "KimiK3ForCausalLM"]
