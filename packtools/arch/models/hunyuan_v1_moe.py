"""Hunyuan-A13B (Tencent, HunYuanMoEV1): every layer routes (softmax, top-k weights renormalised)
beside one always-on shared MLP; experts and the shared MLP are both `intermediate_size` wide;
q/k RMSNorm per head after the rotary embedding. llama.cpp's converter reads Tencent's per-layer
lists (moe_intermediate_size, moe_topk, num_shared_expert, all equal) and folds the NTK "alpha" of
a dynamic rope into rope_theta, which is what llama.cpp (and so a GGUF read here) computes.
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import NAMED_PROJ, every_layer, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, head_dim_or_default, write_head_dim
from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata


def _tiny(size: TinySize) -> dict:
    return {
        "num_experts": size.num_experts,
        "moe_topk": size.top_k,
        "intermediate_size": size.moe_intermediate_size,  # the experts' and the shared MLP's width
        "head_dim": size.head_dim,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    width = meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH)
    for key in (LLM.FEED_FORWARD_LENGTH, LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH):
        if meta.get(key, width) != width:
            raise InvalidMetadataError(meta.path, meta.key(key), meta.get(key),
                                       f"transformers' HunYuanMoEV1 experts and shared MLP are all intermediate_size "
                                       f"wide; {meta.key(LLM.EXPERT_FEED_FORWARD_LENGTH)} is {width}")
    shared = meta.get(LLM.EXPERT_SHARED_COUNT, 1)
    if shared != 1:
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_SHARED_COUNT), shared,
                                   "transformers' HunYuanMoEV1 has one shared MLP")
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim_or_default(meta, kwargs),
        "intermediate_size": width,
        "attention_bias": facts.attention_bias,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_head_count_kv(config.num_key_value_heads)
    write_head_dim(writer, config.head_dim or config.hidden_size // config.num_attention_heads)
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.intermediate_size)
    writer.add_expert_shared_count(1)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("hunyuan_v1_moe", "num_experts", "intermediate_size", every_layer, ("mlp",), NAMED_PROJ,
                     notes="routed experts in every layer; mlp.shared_mlp and mlp.gate.wg are dense"),
    tiny=_tiny,
    # llama.cpp always renormalises Hunyuan's top-k weights, as transformers' router does (no switch)
    gguf=GGUFArch("hunyuan_v1_moe", MODEL_ARCH.HUNYUAN_MOE, None, None, read_config=_read, write_config=_write),
)
