"""DeepSeek-V3's MoE outside DeepSeek's GGUF arch (dots1, glm4moe): `first_k_dense_replace` dense
layers, shared experts, sigmoid routing with selection biases, group-limited top-k scored by each
group's two best experts, routed_scaling_factor. The GGUF keys are llama.cpp's generic expert keys."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import LLM, require_gating, write_expert_groups
from packtools.gguf.metadata import Metadata
from packtools.gguf.routing import expert_groups

SIGMOID = gguf.ExpertGatingFuncType.SIGMOID


def tiny_v3_moe(size: TinySize) -> dict:
    return {
        "n_routed_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "n_shared_experts": 1,
        "n_group": 1,
        "topk_group": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        # one dense layer first, as the real models have; a single-layer model keeps its MoE layer
        "first_k_dense_replace": 1 if size.num_layers >= 2 else 0,
    }


def read_v3_moe(meta: Metadata, router: str, absent_gating: gguf.ExpertGatingFuncType | None = None) -> dict:
    """`router`: the transformers router class, named where the file's gating is not sigmoid;
    `absent_gating`: what llama.cpp's graph reads when the file has no gating key."""
    require_gating(meta, SIGMOID, f"transformers' {router} gates with sigmoid", absent_gating)
    n_group, topk_group = expert_groups(meta)
    return {
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "first_k_dense_replace": meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "n_shared_experts": meta.require(LLM.EXPERT_SHARED_COUNT),
        "routed_scaling_factor": meta.get(LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        "n_group": n_group,
        "topk_group": topk_group,
    }


def write_v3_moe(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_leading_dense_block_count(config.first_k_dense_replace or 0)
    writer.add_expert_shared_count(config.n_shared_experts)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
    writer.add_expert_gating_func(SIGMOID)
    write_expert_groups(writer, config.n_group, config.topk_group)
