"""Mixtral: experts in every layer (`block_sparse_moe` in checkpoints, `mlp` at run time).

llama.cpp has no GGUF arch of its own for it: the converter writes it as LLAMA with experts, and
permutes the Q and K rows into llama.cpp's rope layout.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
from transformers import PretrainedConfig

from packtools.arch.parts import W_PROJ, every_layer, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, TensorFacts, write_head_dim
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.gguf.tensor_rules import DenseRule, permute_for_llama_rope, unpermute_for_llama_rope


def _tiny(size: TinySize) -> dict:
    return {
        "num_local_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": meta.get(ATTN.KEY_LENGTH),
        "sliding_window": meta.get(ATTN.SLIDING_WINDOW),
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_vocab_size(config.vocab_size)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if config.head_dim is not None:
        write_head_dim(writer, config.head_dim)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)


def _llama_rope_rule(config: PretrainedConfig, hf_name: str, name: str,
                     gguf_name: Callable[[str], str]) -> DenseRule | None:
    if not name.endswith(("self_attn.q_proj.weight", "self_attn.k_proj.weight")):
        return None
    is_key = name.endswith("k_proj.weight")
    n_head = config.num_key_value_heads if is_key else config.num_attention_heads
    return DenseRule(
        hf_name,
        (gguf_name(name),),
        lambda t: (permute_for_llama_rope(t, n_head),),
        lambda ts: unpermute_for_llama_rope(ts[0], n_head),
    )


ARCHITECTURE = Architecture(
    spec=swiglu_spec("mixtral", "num_local_experts", "intermediate_size", every_layer, ("block_sparse_moe", "mlp"),
                     W_PROJ, notes="checkpoint container block_sparse_moe, runtime mlp"),
    tiny=_tiny,
    gguf=GGUFArch("mixtral", MODEL_ARCH.LLAMA, None, None, read_config=_read, write_config=_write,
                  special_dense_rule=_llama_rope_rule),
)
