"""dots.llm1 (rednote-hilab): Qwen3-style attention (q/k RMSNorm per head) with DeepSeek-V3's MoE
(packtools.arch.models._v3_moe). llama.cpp's GGUF arch is DOTS1; its converter writes the gating
function from config.json's `scoring_func` (dots.llm1's says "sigmoid"; transformers' Dots1Config
does not keep the key), and llama.cpp's dots1 graph has no default for it.
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.group_routing import top2_group_score
from packtools.arch.models._v3_moe import read_v3_moe, tiny_v3_moe, write_v3_moe
from packtools.arch.parts import NAMED_PROJ, after_first_k_dense, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import NUM_ATTENTION_HEADS, TinySize
from packtools.gguf.config_parts import ATTN, TensorFacts, refuse
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata


def _tiny(size: TinySize) -> dict:
    # dots.llm1 has as many KV heads as heads, and llama.cpp's dots1 graph sizes k/v so
    return {**tiny_v3_moe(size), "num_key_value_heads": NUM_ATTENTION_HEADS}


def _full_attention(layers: int) -> list[str]:
    return ["full_attention"] * layers


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        **read_v3_moe(meta, "Dots1TopkRouter"),
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "attention_bias": facts.attention_bias,
        # llama.cpp's dots1 graph attends every layer fully (transformers slides from max_window_layers on)
        "layer_types": _full_attention(kwargs["num_hidden_layers"]),
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if config.attention_bias:
        refuse(config, "attention_bias", config.attention_bias, "llama.cpp's dots1 graph has no o_proj bias")
    if list(config.layer_types) != _full_attention(config.num_hidden_layers):
        refuse(config, "layer_types", config.layer_types, "llama.cpp's dots1 graph has no sliding-window layers")
    if config.num_key_value_heads != config.num_attention_heads:
        refuse(config, "num_key_value_heads", config.num_key_value_heads,
               f"llama.cpp's dots1 graph sizes k and v as num_attention_heads={config.num_attention_heads} heads")
    if not config.n_shared_experts:
        refuse(config, "n_shared_experts", config.n_shared_experts, "llama.cpp's dots1 graph requires shared experts")
    writer.add_head_count_kv(config.num_key_value_heads)
    write_v3_moe(writer, config)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("dots1", "n_routed_experts", "moe_intermediate_size", after_first_k_dense, ("mlp",), NAMED_PROJ,
                     notes="first_k_dense_replace dense layers; shared experts and gate.e_score_correction_bias "
                           "are dense"),
    tiny=_tiny,
    gguf=GGUFArch("dots1", MODEL_ARCH.DOTS1, False, "norm_topk_prob", read_config=_read, write_config=_write),
    check_routing=top2_group_score("n_group"),
)
