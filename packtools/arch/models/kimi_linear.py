"""Kimi-Linear: KDA (linear attention) layers with an MLA layer every fourth, `mlp_layer_types`
dense/sparse, one shared expert, sigmoid routing. The checkpoint's q/k/v conv1d are concatenated
at load; llama.cpp's converter splits them again and stores the decay A = -exp(A_log).
"""

from __future__ import annotations

import re
from collections.abc import Callable

import gguf
import torch
from transformers import PretrainedConfig

from packtools.arch.group_routing import top2_group_score
from packtools.arch.parts import W_PROJ, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import NUM_ATTENTION_HEADS, TinySize, mla_attention
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, read_mla, refuse, write_expert_groups, write_mla
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.gguf.routing import expert_groups
from packtools.gguf.tensor_rules import DenseRule, Tensors


def kimi_sparse_layers(config: PretrainedConfig) -> list[int]:
    return [i for i, kind in enumerate(config.mlp_layer_types) if kind == "sparse"]


def tiny_kimi_moe(size: TinySize) -> dict:
    """Moonshot's MoE keys (Kimi-Linear and Kimi-K3 name them alike): one shared expert, no groups."""
    return {
        "num_experts": size.num_experts,
        "num_experts_per_token": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "num_shared_experts": 1,
        "num_expert_group": 1,
        "topk_group": 1,
    }


def _tiny(size: TinySize) -> dict:
    layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(size.num_layers)]
    if "full_attention" not in layer_types:
        # the model needs at least one full attention layer (its cache is sized from it)
        layer_types[-1] = "full_attention"
    return {
        **mla_attention(),
        "q_lora_rank": None,
        **tiny_kimi_moe(size),
        "layer_types": layer_types,
        "mlp_layer_types": ["sparse"] * size.num_layers,
        "linear_attn_config": {"head_dim": 16, "num_heads": NUM_ATTENTION_HEADS, "short_conv_kernel_size": 4},
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    kv_heads = meta.require(ATTN.HEAD_COUNT_KV)
    layers = kwargs["num_hidden_layers"]
    kv_heads = kv_heads if isinstance(kv_heads, list) else [kv_heads] * layers
    leading_dense = meta.get(LLM.LEADING_DENSE_BLOCK_COUNT, 0)
    return {
        **read_mla(meta, kwargs),
        "layer_types": ["full_attention" if n else "linear_attention" for n in kv_heads],
        "mlp_layer_types": ["dense" if i < leading_dense else "sparse" for i in range(layers)],
        "linear_num_heads": kwargs["num_attention_heads"],
        "linear_head_dim": meta.require(gguf.Keys.KDA.HEAD_DIM),
        "linear_conv_kernel_dim": meta.require(gguf.Keys.SSM.CONV_KERNEL),
        "num_shared_experts": meta.get(LLM.EXPERT_SHARED_COUNT, 0),
        **dict(zip(("num_expert_group", "topk_group"), expert_groups(meta))),
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if config.linear_num_heads != config.num_attention_heads:
        refuse(config, "linear_num_heads", config.linear_num_heads, "llama.cpp's KDA uses head_count heads")
    dense = [kind == "dense" for kind in config.mlp_layer_types]
    leading_dense = dense.index(False) if False in dense else len(dense)
    if any(dense[leading_dense:]):
        refuse(config, "mlp_layer_types", config.mlp_layer_types, "dense layers must all come first")
    write_mla(writer, config)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    # a KV head count of 0 marks a KDA (linear attention) layer
    writer.add_head_count_kv([1 if kind == "full_attention" else 0 for kind in config.layer_types])
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_kda_head_dim(config.linear_head_dim)
    writer.add_expert_shared_count(config.num_shared_experts)
    writer.add_leading_dense_block_count(leading_dense)
    write_expert_groups(writer, config.num_expert_group, config.topk_group)


def _respell(name: str) -> str:
    # the checkpoint names transformers 5 renames at load
    return re.sub(r"\.dt_bias$", ".dt_proj.bias", name.replace(".forget_gate.", "."))


def _conv_rule(hf_name: str, name: str, gguf_name: Callable[[str], str]) -> DenseRule:
    names = tuple(gguf_name(name.replace("conv1d", f"{part}_conv1d")) for part in "qkv")

    def split(conv: torch.Tensor) -> Tensors:  # [3*D, 1, K]: q, k, v channels stacked
        d_inner, kernel = conv.shape[0] // 3, conv.shape[-1]
        # llama.cpp wants ggml ne [K, 1, D, 1], i.e. numpy (1, D, 1, K)
        return tuple(part.reshape(1, d_inner, 1, kernel).contiguous() for part in conv.split(d_inner, dim=0))

    def join(tensors: Tensors) -> torch.Tensor:
        parts = [t.reshape(t.shape[1], 1, t.shape[-1]) for t in tensors]
        return torch.cat(parts, dim=0)

    return DenseRule(hf_name, names, split, join)


def _special_rule(config: PretrainedConfig, hf_name: str, name: str,
                  gguf_name: Callable[[str], str]) -> DenseRule | None:
    if name.endswith("self_attn.conv1d.weight"):
        return _conv_rule(hf_name, name, gguf_name)
    if name.endswith(".A_log"):
        # llama.cpp stores A itself; log(-A) recovers A_log to within float rounding
        return DenseRule(hf_name, (gguf_name(name),), lambda t: (-torch.exp(t),), lambda ts: torch.log(-ts[0]))
    return None


ARCHITECTURE = Architecture(
    spec=swiglu_spec("kimi_linear", "num_experts", "moe_intermediate_size", kimi_sparse_layers,
                     ("block_sparse_moe", "mlp"), W_PROJ,
                     notes="mlp_layer_types dense/sparse; q/k/v conv1d are concatenated at load"),
    tiny=_tiny,
    gguf=GGUFArch("kimi_linear", MODEL_ARCH.KIMI_LINEAR, True, "moe_renormalize", read_config=_read,
                  write_config=_write, mla=True, rope=False, respell=_respell, special_dense_rule=_special_rule),
    check_routing=top2_group_score("num_expert_group"),
    synth_layers=4,  # both linear (KDA) and full attention layers appear from 4 layers on
)
