"""Kimi-K3 GGUFs (`general.architecture = kimi-k3`): metadata keys and the config they denote.

gguf-py 0.19 has no KIMI_K3 arch, so the keys are spelled here, as llama.cpp writes and reads them
(vendored gguf-py/gguf/constants.py `Keys`, src/llama-arch.cpp LLM_KV_*, src/models/kimi-k3.cpp
load_arch_hparams). The config is the official one's text part (the keys llama.cpp's converter,
conversion/kimi_k3.py, reads from it): `linear_attn_config` with 1-indexed `full_attn_layers`,
`mla_use_nope`, `routed_expert_hidden_size`, the SiTU betas, `attn_res_block_size`...

What the file says about layer kinds: `attention.head_count_kv` is a per-layer list, 0 for a KDA
(linear attention) layer, 1 for an MLA layer (llama.cpp serves MLA as one MQA head).
"""

from __future__ import annotations

import gguf

from packtools.gguf.config_parts import TensorFacts
from packtools.gguf.errors import ExpertLayoutError, UnknownArchitectureError
from packtools.gguf.metadata import Metadata
from packtools.gguf.routing import expert_groups

GGUF_ARCH_NAME = "kimi-k3"
MODEL_TYPE = "kimi_k3"

LLM, ATTN, ROPE = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
# keys gguf-py 0.19 does not have (vendored gguf-py Keys.* / llama-arch.cpp LLM_KV_*)
KDA_HEAD_DIM = "{arch}.kda.head_dim"
KDA_GATE_LOWER_BOUND = "{arch}.kda.gate_lower_bound"
EXPERT_LATENT_LENGTH = "{arch}.expert_latent_length"
SITU_BETA = "{arch}.activation.situ_beta"
SITU_LINEAR_BETA = "{arch}.activation.situ_linear_beta"
ATTN_RES_BLOCK_SIZE = "{arch}.attn_res.block_size"
VOCAB_SIZE = "{arch}.vocab_size"

MLA_KV_HEADS = 1  # what the converter writes for an MLA layer: the latent is one MQA head
KDA_KV_HEADS = 0


def layer_is_kda(meta: Metadata) -> list[bool]:
    """Per layer: True for KDA (linear attention), False for MLA, from attention.head_count_kv."""
    layers = meta.require(LLM.BLOCK_COUNT)
    kv_heads = meta.require(ATTN.HEAD_COUNT_KV)
    key = meta.key(ATTN.HEAD_COUNT_KV)
    if not isinstance(kv_heads, list):
        kv_heads = [kv_heads] * layers  # llama.cpp accepts one value for every layer
    if len(kv_heads) != layers:
        raise ExpertLayoutError(f"{meta.path}: {key} lists {len(kv_heads)} layers, block_count is {layers}")
    unknown = {i: n for i, n in enumerate(kv_heads) if n not in (KDA_KV_HEADS, MLA_KV_HEADS)}
    if unknown:
        layer, value = next(iter(unknown.items()))
        raise ExpertLayoutError(f"{meta.path}: {key}[{layer}] is {value}; a kimi-k3 layer is KDA ({KDA_KV_HEADS}) "
                                f"or MLA ({MLA_KV_HEADS})")
    return [n == KDA_KV_HEADS for n in kv_heads]


def config_kwargs(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    """The kimi_k3 part of packtools.gguf.config_read.hf_config_kwargs (official config keys)."""
    gating = meta.get(LLM.EXPERT_GATING_FUNC)
    if gating != gguf.ExpertGatingFuncType.SIGMOID:
        raise UnknownArchitectureError(meta.path, GGUF_ARCH_NAME, f"expert_gating_func {gating} is not sigmoid")
    layers = kwargs["num_hidden_layers"]
    heads = kwargs["num_attention_heads"]
    is_kda = layer_is_kda(meta)
    _check_layer_tensors(meta, is_kda, facts.names)
    linear = {
        "full_attn_layers": [i + 1 for i in range(layers) if not is_kda[i]],  # 1-indexed, as Moonshot counts
        "kda_layers": [i + 1 for i in range(layers) if is_kda[i]],
        "num_heads": heads,
        "head_dim": meta.require(KDA_HEAD_DIM),
        "short_conv_kernel_size": meta.require(gguf.Keys.SSM.CONV_KERNEL),
        # absent: llama.cpp's -inf, i.e. Kimi-Linear's softplus decay (None in the config, not its -5 default)
        "gate_lower_bound": meta.get(KDA_GATE_LOWER_BOUND),
        "use_full_rank_gate": True,  # kimi-k3 files hold one ssm_g, never kimi-linear's g_a/g_b
    }
    rope_dim = meta.require(ROPE.DIMENSION_COUNT)
    return {
        "vocab_size": meta.get(VOCAB_SIZE, facts.vocab_size),
        "hidden_act": "situ",
        "activation_situ_beta": meta.require(SITU_BETA),
        "activation_situ_linear_beta": meta.require(SITU_LINEAR_BETA),
        "linear_attn_config": linear,
        # the converter needs kv heads == heads to split kv_b; the file's 1 is llama.cpp's MQA view
        "num_key_value_heads": heads,
        "q_lora_rank": meta.get(ATTN.Q_LORA_RANK),
        "kv_lora_rank": meta.require(ATTN.KV_LORA_RANK),
        "qk_rope_head_dim": rope_dim,  # nope-only: it sizes the un-absorbed part of K, no rotation
        "qk_nope_head_dim": meta.require(ATTN.KEY_LENGTH_MLA) - rope_dim,
        "v_head_dim": meta.require(ATTN.VALUE_LENGTH_MLA),
        "mla_use_nope": True,
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "num_shared_experts": meta.get(LLM.EXPERT_SHARED_COUNT, 0),
        **dict(zip(("num_expert_group", "topk_group"), expert_groups(meta))),
        "first_k_dense_replace": meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0),
        "routed_scaling_factor": meta.get(LLM.EXPERT_WEIGHTS_SCALE, 1.0),
        "moe_router_activation_func": "sigmoid",
        "routed_expert_hidden_size": meta.get(EXPERT_LATENT_LENGTH),
        # optional tensors (TENSOR_NOT_REQUIRED in llama.cpp) whose presence is the switch
        "latent_moe_use_norm": _any_layer_has(facts, "ffn_routed_norm.weight"),
        "mla_use_output_gate": _any_layer_has(facts, "attn_gate.weight"),
        # llama.cpp's 0 turns the cross-layer residuals off; the config says that with None
        "attn_res_block_size": meta.require(ATTN_RES_BLOCK_SIZE) or None,
    }


def _any_layer_has(facts: TensorFacts, suffix: str) -> bool:
    return any(name.startswith("blk.") and name.endswith("." + suffix) for name in facts.names)


# one tensor only each kind of layer has: the KDA decay A, the MLA latent projection
_KDA_MARKER, _MLA_MARKER = "blk.{bid}.ssm_a", "blk.{bid}.attn_kv_a_mqa.weight"


def _check_layer_tensors(meta: Metadata, is_kda: list[bool], names: frozenset[str]) -> None:
    """The per-layer kv list and the tensors must agree on which layers are KDA and which MLA."""
    if not names:
        return  # no tensor list to check against
    key = meta.key(ATTN.HEAD_COUNT_KV)
    for layer, kda in enumerate(is_kda):
        expected, other = (_KDA_MARKER, _MLA_MARKER) if kda else (_MLA_MARKER, _KDA_MARKER)
        expected, other = expected.format(bid=layer), other.format(bid=layer)
        if expected not in names:
            kind = "KDA" if kda else "MLA"
            found = f"; it has {other}" if other in names else ""
            raise ExpertLayoutError(f"{meta.path}: {key}[{layer}] makes layer {layer} {kind}, but the file has no "
                                    f"{expected}{found}")
