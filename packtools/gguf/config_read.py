"""GGUF metadata (+ a few facts read off the tensors) -> transformers config kwargs.

The inverse of config_write: what llama.cpp would build from the file, said in transformers'
terms. Where the file is silent, llama.cpp's own defaults for the arch apply (e.g. Qwen3-MoE
renormalises the top-k weights, Qwen2-MoE does not). The keys every arch has are read here; each
architecture's record reads its own (GGUFArch.read_config, packtools.arch.models).
"""

from __future__ import annotations

import gguf

from packtools.arch import get_arch
from packtools.gguf.config_parts import DEEPSEEK_YARN_LOG_MUL_PER_MSCALE, TensorFacts
from packtools.gguf.errors import UnknownArchitectureError
from packtools.gguf.gguf_arch import GGUFArch
from packtools.gguf.metadata import Metadata, shortest_float

__all__ = ["expert_hidden_width", "hf_config_kwargs", "mtp_blocks"]

LLM, ATTN, ROPE, TOK = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.Tokenizer
LLAMA_CPP_DEFAULT_ROPE_THETA = 10000.0


def hf_config_kwargs(meta: Metadata, arch: GGUFArch, facts: TensorFacts) -> dict:
    """Keyword arguments of AutoConfig.for_model(arch.model_type, **kwargs)."""
    kwargs = {
        "vocab_size": facts.vocab_size,
        "tie_word_embeddings": facts.tied_embeddings,
        "hidden_size": meta.require(LLM.EMBEDDING_LENGTH),
        # llama.cpp's blocks end with the multi-token-prediction layers, which are not decoder layers
        "num_hidden_layers": meta.require(LLM.BLOCK_COUNT) - mtp_blocks(meta),
        "num_attention_heads": meta.require(ATTN.HEAD_COUNT),
        "max_position_embeddings": meta.require(LLM.CONTEXT_LENGTH),
        "rms_norm_eps": meta.require(ATTN.LAYERNORM_RMS_EPS),
        "hidden_act": "silu",
        get_arch(arch.model_type).num_experts_attr: meta.require(LLM.EXPERT_COUNT),
        "num_experts_per_tok": meta.require(LLM.EXPERT_USED_COUNT),
        "bos_token_id": meta.get(TOK.BOS_ID),
        "eos_token_id": meta.get(TOK.EOS_ID),
        "pad_token_id": meta.get(TOK.PAD_ID),
    }
    if arch.mtp_layers_attr is not None:
        kwargs[arch.mtp_layers_attr] = mtp_blocks(meta)
    if arch.dense_ffn:
        kwargs["intermediate_size"] = meta.require(LLM.FEED_FORWARD_LENGTH)
    if arch.norm_topk_attr is not None:
        kwargs[arch.norm_topk_attr] = bool(meta.get(LLM.EXPERT_WEIGHTS_NORM, arch.implied_norm_topk))
    rope = _rope_parameters(meta, arch)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    kwargs.update(arch.read_config(meta, facts, kwargs))
    return kwargs


def mtp_blocks(meta: Metadata) -> int:
    """How many of the file's blocks, the last ones, are multi-token-prediction layers."""
    return meta.get(LLM.NEXTN_PREDICT_LAYERS, 0)


def _rope_parameters(meta: Metadata, arch: GGUFArch) -> dict | None:
    if not arch.rope:
        return None  # NoPE attention; the config has no rope parameters
    params = {"rope_type": "default", "rope_theta": meta.get(ROPE.FREQ_BASE, LLAMA_CPP_DEFAULT_ROPE_THETA)}
    scaling = meta.get(ROPE.SCALING_TYPE, gguf.RopeScalingType.NONE.value)
    if scaling == gguf.RopeScalingType.LINEAR.value:
        params.update(rope_type="linear", factor=meta.require(ROPE.SCALING_FACTOR))
    elif scaling == gguf.RopeScalingType.YARN.value:
        params.update(
            rope_type="yarn",
            factor=meta.require(ROPE.SCALING_FACTOR),
            original_max_position_embeddings=meta.require(ROPE.SCALING_ORIG_CTX_LEN),
        )
        optional = {
            "attention_factor": ROPE.SCALING_YARN_ATTN_FACTOR,
            "beta_fast": ROPE.SCALING_YARN_BETA_FAST,
            "beta_slow": ROPE.SCALING_YARN_BETA_SLOW,
        }
        params.update({name: meta.get(key) for name, key in optional.items() if key in meta})
        if arch.yarn_log_mul and ROPE.SCALING_YARN_LOG_MUL in meta:
            mscale = shortest_float(meta.get(ROPE.SCALING_YARN_LOG_MUL) / DEEPSEEK_YARN_LOG_MUL_PER_MSCALE)
            params.update(mscale=mscale, mscale_all_dim=mscale)
        if arch.yarn_truncate is not None:
            params["truncate"] = arch.yarn_truncate
    elif scaling != gguf.RopeScalingType.NONE.value:
        raise UnknownArchitectureError(meta.path, arch.gguf_name, f"rope scaling {scaling!r} is not supported")
    return params


def expert_hidden_width(meta: Metadata) -> int:
    """The width routed experts take in and give out: the latent width of a latent MoE (kimi-k3's
    expert_latent_length), else the embedding length."""
    return meta.get("{arch}.expert_latent_length") or meta.require(LLM.EMBEDDING_LENGTH)
