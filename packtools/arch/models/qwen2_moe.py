"""Qwen2-MoE (Qwen1.5-MoE, Qwen2-57B-A14B): Qwen3-MoE's layers plus a gated dense shared expert."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.models.qwen3_moe import all_layers_sparse, qwen_sparse_layers
from packtools.arch.parts import NAMED_PROJ, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata


def tiny_qwen2_moe(size: TinySize) -> dict:
    return {
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "shared_expert_intermediate_size": size.dense_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    shared = meta.get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, facts.shared_expert_rows)
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "shared_expert_intermediate_size": shared or 0,
        "qkv_bias": facts.attention_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    all_layers_sparse(config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("qwen2_moe", "num_experts", "moe_intermediate_size", qwen_sparse_layers, ("mlp",), NAMED_PROJ,
                     notes="shared_expert + shared_expert_gate are dense"),
    tiny=tiny_qwen2_moe,
    gguf=GGUFArch("qwen2_moe", MODEL_ARCH.QWEN2MOE, False, "norm_topk_prob", read_config=_read, write_config=_write),
)
