"""MiniMax-M2: experts in every layer (`block_sparse_moe` in checkpoints, `mlp` at run time),
sigmoid routing with selection biases (e_score_correction_bias) and top-k weights always
renormalised, q/k RMSNorm over all heads at once, partial NeoX rotary. llama.cpp's converter
reads the released config.json's `rotary_dim` and `scoring_func` ("sigmoid"), which transformers'
MiniMaxM2Config folds into rope_parameters and does not keep.
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import W_PROJ, every_layer, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import (ATTN, LLM, TensorFacts, partial_rope, refuse, require_gating,
                                         write_head_dim)
from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata

SIGMOID = gguf.ExpertGatingFuncType.SIGMOID


def _tiny(size: TinySize) -> dict:
    return {
        "num_local_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
        "head_dim": size.head_dim,
        # MiniMax-M2 rotates half of each head (rotary_dim 64 of head_dim 128)
        "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    require_gating(meta, SIGMOID, "transformers' MiniMaxM2TopKRouter gates with sigmoid")
    scale = meta.get(LLM.EXPERT_WEIGHTS_SCALE, 1.0)
    if scale not in (0.0, 1.0):  # llama.cpp scales by neither
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_WEIGHTS_SCALE), scale,
                                   "transformers' MiniMaxM2 router does not scale the top-k weights")
    head_dim = meta.require(ATTN.KEY_LENGTH)
    rope = partial_rope(meta, kwargs["rope_parameters"], head_dim)
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim,
        "intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "rope_parameters": rope,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if config.tie_word_embeddings:
        refuse(config, "tie_word_embeddings", True, "llama.cpp's minimax-m2 graph requires its own output matrix")
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    rotary = config.head_dim * factor
    if rotary != int(rotary) or int(rotary) % 2:
        refuse(config, "rope_parameters.partial_rotary_factor", factor, f"rotates {rotary} of {config.head_dim} dims")
    writer.add_head_count_kv(config.num_key_value_heads)
    write_head_dim(writer, config.head_dim)
    writer.add_rope_dimension_count(int(rotary))
    writer.add_expert_feed_forward_length(config.intermediate_size)
    writer.add_expert_gating_func(SIGMOID)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("minimax_m2", "num_local_experts", "intermediate_size", every_layer,
                     ("block_sparse_moe", "mlp"), W_PROJ,
                     notes="checkpoint container block_sparse_moe, runtime mlp; e_score_correction_bias is dense"),
    tiny=_tiny,
    # llama.cpp always renormalises MiniMax-M2's top-k weights, as transformers' router does (no switch)
    gguf=GGUFArch("minimax_m2", MODEL_ARCH.MINIMAXM2, None, None, read_config=_read, write_config=_write),
)
