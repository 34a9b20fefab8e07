"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): routed experts in every layer but `mlp_only_layers`."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import NAMED_PROJ, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, head_dim_or_default, refuse, write_head_dim
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata


def qwen_sparse_layers(config: PretrainedConfig) -> list[int]:
    # mirrors Qwen2Moe/Qwen3MoeDecoderLayer.__init__
    if config.num_experts <= 0:
        return []
    return [
        i
        for i in range(config.num_hidden_layers)
        if i not in config.mlp_only_layers and (i + 1) % config.decoder_sparse_step == 0
    ]


def all_layers_sparse(config: PretrainedConfig) -> None:
    # gguf-py's QWEN2MOE/QWEN3MOE tensor sets have no dense FFN: every layer must route
    if config.mlp_only_layers or config.decoder_sparse_step != 1:
        refuse(config, "mlp_only_layers/decoder_sparse_step", (config.mlp_only_layers, config.decoder_sparse_step),
               "llama.cpp's Qwen MoE archs have routed experts in every layer")


def _tiny(size: TinySize) -> dict:
    return {
        "head_dim": size.head_dim,
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim_or_default(meta, kwargs),
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "attention_bias": facts.attention_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    all_layers_sparse(config)
    writer.add_head_count_kv(config.num_key_value_heads)
    write_head_dim(writer, config.head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("qwen3_moe", "num_experts", "moe_intermediate_size", qwen_sparse_layers, ("mlp",), NAMED_PROJ),
    tiny=_tiny,
    gguf=GGUFArch("qwen3_moe", MODEL_ARCH.QWEN3MOE, True, "norm_topk_prob", read_config=_read, write_config=_write),
)
