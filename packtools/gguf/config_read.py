"""GGUF metadata (+ a few facts read off the tensors) -> transformers config kwargs.

The inverse of config_write: what llama.cpp would build from the file, said in transformers'
terms. Where the file is silent, llama.cpp's own defaults for the arch apply (e.g. Qwen3-MoE
renormalises the top-k weights, Qwen2-MoE does not).
"""

from __future__ import annotations

from collections.abc import Callable

import gguf

from packtools.arch import get_arch
from packtools.gguf.archs import GGUFArch
from packtools.gguf.config_write import DEEPSEEK_YARN_LOG_MUL_PER_MSCALE
from packtools.gguf.deepseek4 import config_kwargs as _deepseek_v4
from packtools.gguf.errors import InvalidMetadataError, UnknownArchitectureError
from packtools.gguf.kimi_k3 import config_kwargs as _kimi_k3
from packtools.gguf.metadata import Metadata, shortest_float
from packtools.gguf.routing import expert_groups
from packtools.gguf.tensor_facts import TensorFacts

LLM, ATTN, ROPE, TOK = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope, gguf.Keys.Tokenizer
LLAMA_CPP_DEFAULT_ROPE_THETA = 10000.0


# archs whose every FFN is MoE: no feed_forward_length in the file (deepseek4; transformers
# aliases DeepseekV4's intermediate_size to moe_intermediate_size)
_NO_DENSE_FFN = frozenset({"deepseek_v4"})


def hf_config_kwargs(meta: Metadata, arch: GGUFArch, facts: TensorFacts) -> dict:
    """Keyword arguments of AutoConfig.for_model(arch.model_type, **kwargs)."""
    kwargs = {
        "vocab_size": facts.vocab_size,
        "tie_word_embeddings": facts.tied_embeddings,
        "hidden_size": meta.require(LLM.EMBEDDING_LENGTH),
        "num_hidden_layers": meta.require(LLM.BLOCK_COUNT),
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
    if arch.model_type not in _NO_DENSE_FFN:
        kwargs["intermediate_size"] = meta.require(LLM.FEED_FORWARD_LENGTH)
    if arch.norm_topk_attr is not None:
        kwargs[arch.norm_topk_attr] = bool(meta.get(LLM.EXPERT_WEIGHTS_NORM, arch.implied_norm_topk))
    rope = _rope_parameters(meta, arch)
    if rope is not None:
        kwargs["rope_parameters"] = rope
    kwargs.update(_ARCH_READERS[arch.model_type](meta, facts, kwargs))
    return kwargs


def _rope_parameters(meta: Metadata, arch: GGUFArch) -> dict | None:
    if arch.model_type in ("kimi_linear", "kimi_k3"):
        return None  # their MLA layers are NoPE; the config has no rope parameters
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
        if arch.model_type in ("deepseek_v3", "deepseek_v2") and ROPE.SCALING_YARN_LOG_MUL in meta:
            mscale = shortest_float(meta.get(ROPE.SCALING_YARN_LOG_MUL) / DEEPSEEK_YARN_LOG_MUL_PER_MSCALE)
            params.update(mscale=mscale, mscale_all_dim=mscale)
        if arch.model_type == "gpt_oss":
            params["truncate"] = False
    elif scaling != gguf.RopeScalingType.NONE.value:
        raise UnknownArchitectureError(meta.path, arch.gguf_name, f"rope scaling {scaling!r} is not supported")
    return params


def expert_hidden_width(meta: Metadata) -> int:
    """The width routed experts take in and give out: the latent width of a latent MoE (kimi-k3's
    expert_latent_length), else the embedding length."""
    return meta.get("{arch}.expert_latent_length") or meta.require(LLM.EMBEDDING_LENGTH)


def _head_dim_or_default(meta: Metadata, kwargs: dict) -> int:
    return meta.get(ATTN.KEY_LENGTH, kwargs["hidden_size"] // kwargs["num_attention_heads"])


def _qwen3_moe(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": _head_dim_or_default(meta, kwargs),
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "attention_bias": facts.attention_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _qwen2_moe(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    shared = meta.get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, facts.shared_expert_rows)
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "shared_expert_intermediate_size": shared or 0,
        "qkv_bias": facts.attention_bias,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _mixtral(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": meta.get(ATTN.KEY_LENGTH),
        "sliding_window": meta.get(ATTN.SLIDING_WINDOW),
    }


def _olmoe(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "clip_qkv": meta.get(ATTN.CLAMP_KQV),
        "attention_bias": facts.attention_bias,
    }


def _mla(meta: Metadata, kwargs: dict) -> dict:
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


def _deepseek2(meta: Metadata, kwargs: dict) -> dict:
    """What DeepSeek-V2 and V3 read alike: MLA, leading dense layers, shared experts."""
    return {
        **_mla(meta, kwargs),
        "first_k_dense_replace": meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "n_shared_experts": meta.get(LLM.EXPERT_SHARED_COUNT, 0),
    }


def _deepseek_v3(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    n_group, topk_group = expert_groups(meta)
    return {
        **_deepseek2(meta, kwargs),
        # llama.cpp's converter drops DeepSeek's multi-token-prediction layers; none are in the file
        "num_nextn_predict_layers": 0,
        "n_group": n_group,
        "topk_group": topk_group,
    }


def _deepseek_v2(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    if kwargs["norm_topk_prob"]:
        raise InvalidMetadataError(meta.path, meta.key(LLM.EXPERT_WEIGHTS_NORM), True,
                                   "transformers' DeepseekV2 router never renormalises the top-k weights")
    n_group, topk_group = expert_groups(meta)
    # DeepSeek-V2 and V2.5 keep the best groups by their best expert (group_limited_greedy); llama.cpp
    # scores a group by its two best experts instead (DeepSeek-V3's rule), which changes the choice
    # only when groups are limited. The file does not say which: the checkpoint's rule is the model.
    return {
        **_deepseek2(meta, kwargs),
        "n_group": n_group,
        "topk_group": topk_group,
        "topk_method": "group_limited_greedy" if n_group > 1 else "greedy",
    }


def _gpt_oss(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    layers = kwargs["num_hidden_layers"]
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": _head_dim_or_default(meta, kwargs),
        "sliding_window": meta.require(ATTN.SLIDING_WINDOW),
        "intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "attention_bias": facts.attention_bias,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
    }


def _kimi_linear(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    kv_heads = meta.require(ATTN.HEAD_COUNT_KV)
    layers = kwargs["num_hidden_layers"]
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    leading_dense = meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    return {
        **_mla(meta, kwargs),
        "layer_types": ["full_attention" if n else "linear_attention" for n in kv_heads],
        "mlp_layer_types": ["dense" if i < leading_dense else "sparse" for i in range(layers)],
        "linear_num_heads": kwargs["num_attention_heads"],
        "linear_head_dim": meta.require(gguf.Keys.KDA.HEAD_DIM),
        "linear_conv_kernel_dim": meta.require(gguf.Keys.SSM.CONV_KERNEL),
        "num_shared_experts": meta.get(LLM.EXPERT_SHARED_COUNT, 0),
        **dict(zip(("num_expert_group", "topk_group"), expert_groups(meta))),
    }


_ARCH_READERS: dict[str, Callable[[Metadata, TensorFacts, dict], dict]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "gpt_oss": _gpt_oss,
    "kimi_linear": _kimi_linear,
    "kimi_k3": _kimi_k3,
    "deepseek_v4": _deepseek_v4,
}
