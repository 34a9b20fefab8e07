"""OLMoE: experts in every layer, optional q/k/v clipping."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import NAMED_PROJ, every_layer, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, TensorFacts
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata


def _tiny(size: TinySize) -> dict:
    return {
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "clip_qkv": meta.get(ATTN.CLAMP_KQV),
        "attention_bias": facts.attention_bias,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_head_count_kv(config.num_key_value_heads)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("olmoe", "num_experts", "intermediate_size", every_layer, ("mlp",), NAMED_PROJ),
    tiny=_tiny,
    gguf=GGUFArch("olmoe", MODEL_ARCH.OLMOE, False, "norm_topk_prob", read_config=_read, write_config=_write),
)
