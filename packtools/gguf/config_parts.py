"""Pieces of the GGUF <-> transformers config mapping that several architectures share.

The per-architecture readers and writers (packtools.arch.models) are built from these; the
generic part every architecture goes through is packtools.gguf.config_read / config_write.
"""

from __future__ import annotations

import dataclasses

import gguf
from transformers import PretrainedConfig

from packtools.gguf.errors import InvalidMetadataError, UnrepresentableConfigError
from packtools.gguf.metadata import Metadata, shortest_float

LLM, ATTN, ROPE = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
# yarn_log_multiplier is 0.1 * mscale_all_dim in DeepSeek-2 GGUFs (llama.cpp's legacy convention)
DEEPSEEK_YARN_LOG_MUL_PER_MSCALE = 0.1


@dataclasses.dataclass(frozen=True)
class TensorFacts:
    """What the tensor list says that the metadata may not."""

    vocab_size: int  # rows of token_embd.weight
    tied_embeddings: bool  # no output.weight: the LM head reuses token_embd
    attention_bias: bool  # blk.0.attn_q.bias exists
    shared_expert_rows: int | None  # rows of blk.N.ffn_gate_shexp.weight, if any
    names: frozenset[str] = frozenset()  # every tensor name, for optional tensors that set a switch


# ---- reading (GGUF metadata -> config kwargs) ----
def head_dim_or_default(meta: Metadata, kwargs: dict) -> int:
    return meta.get(ATTN.KEY_LENGTH, kwargs["hidden_size"] // kwargs["num_attention_heads"])


def require_gating(meta: Metadata, gating: gguf.ExpertGatingFuncType, reason: str,
                   absent: gguf.ExpertGatingFuncType | None = None) -> None:
    """Refuse a file whose expert_gating_func is not the one the transformers router computes.
    `absent`: what llama.cpp's graph reads when the key is missing (None: it has no default and aborts)."""
    value = meta.get(LLM.EXPERT_GATING_FUNC, None if absent is None else int(absent))
    if value != int(gating):
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_GATING_FUNC), value,
                                   f"{reason} ({int(gating)}, {gating.name.lower()})")


def read_mla(meta: Metadata, kwargs: dict) -> dict:
    """Multi-head latent attention, and the expert keys every MLA arch of llama.cpp writes alike."""
    rope_dim = meta.require(ROPE.DIMENSION_COUNT)
    if ATTN.KEY_LENGTH_MLA in meta:
        key_dim, value_dim = meta.require(ATTN.KEY_LENGTH_MLA), meta.require(ATTN.VALUE_LENGTH_MLA)
    else:  # files from before llama.cpp's MLA cache: plain per-head key/value lengths
        key_dim, value_dim = meta.require(ATTN.KEY_LENGTH), meta.require(ATTN.VALUE_LENGTH)
    return {
        # transformers expands the latent to every head; the file's single MQA head is llama.cpp's view
        "num_key_value_heads": kwargs["num_attention_heads"],
        "q_lora_rank": meta.get(ATTN.Q_LORA_RANK),
        "kv_lora_rank": meta.require(ATTN.KV_LORA_RANK),
        "qk_rope_head_dim": rope_dim,
        "qk_nope_head_dim": key_dim - rope_dim,
        "v_head_dim": value_dim,
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "routed_scaling_factor": meta.get(LLM.EXPERT_WEIGHTS_SCALE, 1.0),
    }


# ---- writing (config -> GGUF metadata) ----
def refuse(config: PretrainedConfig, setting: str, value: object, reason: str) -> None:
    raise UnrepresentableConfigError(config.model_type, setting, value, reason)


def write_expert_groups(writer: gguf.GGUFWriter, n_group: int | None, topk_group: int | None) -> None:
    if n_group is not None and topk_group is not None and topk_group < n_group:
        writer.add_expert_group_count(n_group)
        writer.add_expert_group_used_count(topk_group)


def partial_rope(meta: Metadata, rope_parameters: dict, head_dim: int) -> dict:
    """`rope_parameters` with the rotated share of each head read back from the file: llama.cpp
    stores the rotated dims (rope.dimension_count), transformers a partial_rotary_factor."""
    return {**rope_parameters,
            "partial_rotary_factor": shortest_float(meta.require(ROPE.DIMENSION_COUNT) / head_dim)}


def write_head_dim(writer: gguf.GGUFWriter, head_dim: int) -> None:
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def write_mla(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    # llama.cpp runs MLA as MQA over the compressed latent: one KV "head" of kv_lora_rank (+ rope)
    if config.q_lora_rank is not None:
        writer.add_q_lora_rank(config.q_lora_rank)
    writer.add_kv_lora_rank(config.kv_lora_rank)
    writer.add_rope_dimension_count(config.qk_rope_head_dim)
    writer.add_key_length(config.kv_lora_rank + config.qk_rope_head_dim)
    writer.add_key_length_mla(config.qk_nope_head_dim + config.qk_rope_head_dim)
    writer.add_value_length_mla(config.v_head_dim)
    writer.add_vocab_size(config.vocab_size)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_weights_scale(config.routed_scaling_factor)
