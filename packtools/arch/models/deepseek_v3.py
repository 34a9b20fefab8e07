"""DeepSeek-V3 (and Kimi-K2, which is one): MLA, `first_k_dense_replace` dense layers, shared
experts, sigmoid routing with selection biases (e_score_correction_bias, dense) and group-limited
top-k. llama.cpp's GGUF arch is DEEPSEEK2, shared with DeepSeek-V2; expert_gating_func tells them
apart (sigmoid here).
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.group_routing import top2_group_score
from packtools.arch.parts import NAMED_PROJ, after_first_k_dense, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize, expert_groups, mla_attention
from packtools.gguf.config_parts import LLM, TensorFacts, read_mla, write_expert_groups, write_mla
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.gguf.routing import expert_groups as gguf_expert_groups


def tiny_deepseek(size: TinySize) -> dict:
    n_group, topk_group = expert_groups(size.num_experts, size.top_k)
    return {
        **mla_attention(),
        "q_lora_rank": 32,
        "n_routed_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "n_shared_experts": 1,
        "n_group": n_group,
        "topk_group": topk_group,
        # one dense layer first (as in the real model's first_k_dense_replace=3) so that
        # dense/MoE mixing is exercised; a single-layer model keeps its one MoE layer
        "first_k_dense_replace": 1 if size.num_layers >= 2 else 0,
    }


def _tiny(size: TinySize) -> dict:
    return {**tiny_deepseek(size), "num_nextn_predict_layers": 0}


def read_deepseek2(meta: Metadata, kwargs: dict) -> dict:
    """What DeepSeek-V2 and V3 read alike: MLA, leading dense layers, shared experts."""
    return {
        **read_mla(meta, kwargs),
        "first_k_dense_replace": meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "n_shared_experts": meta.get(LLM.EXPERT_SHARED_COUNT, 0),
    }


def write_deepseek2(writer: gguf.GGUFWriter, config: PretrainedConfig, gating: gguf.ExpertGatingFuncType) -> None:
    write_mla(writer, config)
    writer.add_expert_gating_func(gating)
    writer.add_head_count_kv(1)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace or 0)
    writer.add_expert_shared_count(config.n_shared_experts or 0)


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    n_group, topk_group = gguf_expert_groups(meta)
    return {
        **read_deepseek2(meta, kwargs),
        # llama.cpp's converter drops DeepSeek's multi-token-prediction layers; none are in the file
        "num_nextn_predict_layers": 0,
        "n_group": n_group,
        "topk_group": topk_group,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    write_deepseek2(writer, config, gguf.ExpertGatingFuncType.SIGMOID)
    write_expert_groups(writer, config.n_group, config.topk_group)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("deepseek_v3", "n_routed_experts", "moe_intermediate_size", after_first_k_dense, ("mlp",),
                     NAMED_PROJ, notes="first_k_dense_replace dense layers; gate.e_score_correction_bias is dense; "
                                       "covers Kimi-K2"),
    tiny=_tiny,
    gguf=GGUFArch("deepseek_v3", MODEL_ARCH.DEEPSEEK2, False, "norm_topk_prob", read_config=_read,
                  write_config=_write, mla=True, yarn_log_mul=True, gating_func=gguf.ExpertGatingFuncType.SIGMOID),
    check_routing=top2_group_score("n_group"),
)
