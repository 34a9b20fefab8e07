"""ERNIE-4.5 MoE (Baidu: ERNIE-4.5-21B-A3B, -300B-A47B): GPT-J-style (interleaved) rotary, softmax
routing whose choice adds a per-expert bias (moe_statics.e_score_correction_bias) and whose top-k
weights are always renormalised, shared experts, MoE from `moe_layer_start_index` on every
`moe_layer_interval`-th layer. llama.cpp's converter states the shared experts' width as
intermediate_size // num_key_value_heads (true of Baidu's configs); the file's width is what
llama.cpp builds, so that is what a GGUF is read as.
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import NAMED_PROJ, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import NUM_KEY_VALUE_HEADS, TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, refuse
from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata

_O_BIAS = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_OUT].format(bid=0) + ".bias"


def ernie_sparse_layers(config: PretrainedConfig) -> list[int]:
    # mirrors Ernie4_5_MoeDecoderLayer.__init__
    return [i for i in range(config.num_hidden_layers)
            if (i + 1) % config.moe_layer_interval == 0
            and config.moe_layer_start_index <= i <= config.moe_layer_end_index]


def _tiny(size: TinySize) -> dict:
    return {
        "moe_num_experts": size.num_experts,
        "moe_k": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "moe_num_shared_experts": 1,
        # the converter's shared-expert width is intermediate_size // num_key_value_heads, as in
        # Baidu's configs (12288 // 4 = 2 * 1536)
        "intermediate_size": NUM_KEY_VALUE_HEADS * size.moe_intermediate_size,
        "moe_layer_start_index": 1 if size.num_layers >= 2 else 0,
        "moe_layer_end_index": size.num_layers - 1,
        "moe_layer_interval": 1,
        "tie_word_embeddings": False,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    inter = meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH)
    shared_width = meta.get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, 0)
    if shared_width % inter:
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH), shared_width,
                                   f"transformers' shared experts are a multiple of the expert width {inter}")
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "moe_intermediate_size": inter,
        "moe_num_shared_experts": shared_width // inter,
        "moe_layer_start_index": meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "moe_layer_end_index": kwargs["num_hidden_layers"] - 1,
        "moe_layer_interval": meta.require(LLM.INTERLEAVE_MOE_LAYER_STEP),
        "use_bias": _O_BIAS in facts.names,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if config.use_bias:
        refuse(config, "use_bias", config.use_bias, "llama.cpp's ernie4_5-moe graph has no FFN or LM-head biases")
    if config.moe_layer_end_index != config.num_hidden_layers - 1:
        refuse(config, "moe_layer_end_index", config.moe_layer_end_index,
               "llama.cpp's ernie4_5-moe graph routes every layer after the leading dense ones")
    if config.moe_layer_interval != 1:
        refuse(config, "moe_layer_interval", config.moe_layer_interval,
               "llama.cpp's ernie4_5-moe loader expects routed experts in every layer after the leading dense ones")
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_interleave_moe_layer_step(config.moe_layer_interval)
    writer.add_leading_dense_block_count(config.moe_layer_start_index)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_count(config.moe_num_shared_experts)
    if config.moe_num_shared_experts:
        writer.add_expert_shared_feed_forward_length(config.moe_intermediate_size * config.moe_num_shared_experts)


def _respell(name: str) -> str:
    # transformers 5 nests the selection bias under the router; Baidu's checkpoints (and the converter) do not
    return name.replace(".mlp.gate.moe_statics.e_score_correction.bias", ".mlp.moe_statics.e_score_correction.bias")


ARCHITECTURE = Architecture(
    spec=swiglu_spec("ernie4_5_moe", "moe_num_experts", "moe_intermediate_size", ernie_sparse_layers, ("mlp",),
                     NAMED_PROJ, notes="moe_layer_start_index / _end_index / _interval; shared experts and "
                                       "gate.moe_statics.e_score_correction_bias are dense"),
    tiny=_tiny,
    # llama.cpp always renormalises ERNIE's top-k weights, as transformers' router does (no switch)
    gguf=GGUFArch("ernie4_5_moe", MODEL_ARCH.ERNIE4_5_MOE, None, None, read_config=_read, write_config=_write,
                  respell=_respell),
)
