"""Qwen3-Next (Qwen3-Next-80B-A3B): gated DeltaNet linear attention in three of every four layers,
gated full attention (q_proj doubled into query and gate, q/k RMSNorm, partial NeoX rotary) in the
fourth, Qwen2-MoE's experts with a gated shared expert in every layer. Its RMSNorms scale by
(1 + weight); llama.cpp's converter stores 1 + weight, the decay A = -exp(A_log), the conv1d
without its unit dim, and splits in_proj_qkvz ([q, k, v, z] per key head) into one qkv block and
the output gate z. transformers runs the linear attention on CPU in PyTorch (no fla kernels needed).
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch
from transformers import PretrainedConfig

from packtools.arch.models.qwen2_moe import tiny_qwen2_moe
from packtools.arch.models.qwen3_moe import all_layers_sparse, qwen_sparse_layers
from packtools.arch.parts import NAMED_PROJ, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import NUM_ATTENTION_HEADS, NUM_KEY_VALUE_HEADS, TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, partial_rope, refuse, write_head_dim
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.gguf.tensor_rules import DenseRule, Tensors

SSM = gguf.Keys.SSM
RECURRENT_LAYERS = "{arch}.attention.recurrent_layers"  # llama.cpp's LLM_KV_ATTENTION_RECURRENT_LAYERS
DEFAULT_FULL_ATTENTION_INTERVAL = 4  # llama.cpp's, and the converter's, where the file has neither key


def _tiny(size: TinySize) -> dict:
    return {
        **tiny_qwen2_moe(size),  # Qwen2-MoE's experts and gated shared expert
        "head_dim": size.head_dim,
        # two value heads per key head, as Qwen3-Next-80B's 32 over 16
        "linear_num_key_heads": NUM_KEY_VALUE_HEADS,
        "linear_num_value_heads": NUM_ATTENTION_HEADS,
        "linear_key_head_dim": size.head_dim,
        "linear_value_head_dim": size.head_dim,
        "layer_types": _tiny_layer_types(size.num_layers),
    }


def _tiny_layer_types(layers: int) -> list[str]:
    kinds = ["full_attention" if (i + 1) % DEFAULT_FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
             for i in range(layers)]
    # generate needs one attention layer (transformers reads the cache's length from it)
    kinds[-1] = "full_attention"
    return kinds


def _layer_types(meta: Metadata, layers: int) -> list[str]:
    recurrent = meta.get(RECURRENT_LAYERS)
    if recurrent is None:
        interval = meta.get(LLM.FULL_ATTENTION_INTERVAL, DEFAULT_FULL_ATTENTION_INTERVAL)
        recurrent = [(i + 1) % interval != 0 for i in range(layers)]
    return ["linear_attention" if r else "full_attention" for r in recurrent[:layers]]


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    head_dim = meta.require(ATTN.KEY_LENGTH)
    value_heads = meta.require(SSM.TIME_STEP_RANK)
    rope = partial_rope(meta, kwargs["rope_parameters"], head_dim)
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim,
        # block 0 is usually a linear attention layer: any full attention layer's query bias says it
        "attention_bias": any(name.endswith(".attn_q.bias") for name in facts.names),
        "rope_parameters": rope,
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "shared_expert_intermediate_size": meta.get(LLM.EXPERT_SHARED_FEED_FORWARD_LENGTH, facts.shared_expert_rows),
        "norm_topk_prob": True,  # llama.cpp's qwen3next graph always renormalises
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "linear_conv_kernel_dim": meta.require(SSM.CONV_KERNEL),
        "linear_key_head_dim": meta.require(SSM.STATE_SIZE),
        "linear_value_head_dim": meta.require(SSM.INNER_SIZE) // value_heads,
        "linear_num_key_heads": meta.require(SSM.GROUP_COUNT),
        "linear_num_value_heads": value_heads,
        "layer_types": _layer_types(meta, kwargs["num_hidden_layers"]),
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    all_layers_sparse(config)
    if not config.norm_topk_prob:
        refuse(config, "norm_topk_prob", False, "llama.cpp's qwen3next graph always renormalises the top-k weights")
    if config.attention_bias:
        refuse(config, "attention_bias", True, "llama.cpp's qwen3next graph has no o_proj bias")
    if config.linear_value_head_dim != config.linear_key_head_dim:
        refuse(config, "linear_value_head_dim", config.linear_value_head_dim,
               f"llama.cpp's qwen3next sizes value heads as key heads ({config.linear_key_head_dim})")
    factor = config.rope_parameters.get("partial_rotary_factor", 1.0)
    writer.add_head_count_kv(config.num_key_value_heads)
    write_head_dim(writer, config.head_dim)
    writer.add_rope_dimension_count(int(config.head_dim * factor))
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_ssm_state_size(config.linear_key_head_dim)
    writer.add_ssm_group_count(config.linear_num_key_heads)
    writer.add_ssm_time_step_rank(config.linear_num_value_heads)
    writer.add_ssm_inner_size(config.linear_value_head_dim * config.linear_num_value_heads)
    writer.add_array(RECURRENT_LAYERS.format(arch=writer.arch), [t == "linear_attention" for t in config.layer_types])


def _respell(name: str) -> str:
    return name[: -len(".dt_bias")] + ".dt_proj.bias" if name.endswith(".dt_bias") else name


def _qkvz_rule(config: PretrainedConfig, hf_name: str, name: str, gguf_name: Callable[[str], str]) -> DenseRule:
    """in_proj_qkvz [nk * (2 dk + 2 r dv), H], rows [q, k, v, z] per key head (r value heads each)
    <-> attn_qkv [nk dk + nk dk + nv dv, H] (all q, all k, all v) and attn_gate [nv dv, H]."""
    nk, dk = config.linear_num_key_heads, config.linear_key_head_dim
    per_head_v = config.linear_num_value_heads // nk * config.linear_value_head_dim
    sizes = [dk, dk, per_head_v, per_head_v]
    layer = name.split(".")[2]

    def split(qkvz: torch.Tensor) -> Tensors:
        hidden = qkvz.shape[-1]
        q, k, v, z = torch.split(qkvz.reshape(nk, sum(sizes), hidden), sizes, dim=1)
        qkv = torch.cat([part.reshape(-1, hidden) for part in (q, k, v)])
        return qkv.contiguous(), z.reshape(-1, hidden).contiguous()

    def join(tensors: Tensors) -> torch.Tensor:
        qkv, z = tensors
        hidden = qkv.shape[-1]
        q, k, v = torch.split(qkv, [nk * dk, nk * dk, nk * per_head_v])
        parts = [part.reshape(nk, -1, hidden) for part in (q, k, v, z)]
        return torch.cat(parts, dim=1).reshape(-1, hidden)

    names = tuple(gguf.TENSOR_NAMES[kind].format(bid=layer) + ".weight"
                  for kind in (gguf.MODEL_TENSOR.ATTN_QKV, gguf.MODEL_TENSOR.ATTN_GATE))
    return DenseRule(hf_name, names, split, join)


def _special_rule(config: PretrainedConfig, hf_name: str, name: str,
                  gguf_name: Callable[[str], str]) -> DenseRule | None:
    if name.endswith("linear_attn.in_proj_qkvz.weight"):
        return _qkvz_rule(config, hf_name, name, gguf_name)
    if name.endswith(".A_log"):
        # llama.cpp stores A itself; log(-A) recovers A_log to within float rounding
        return DenseRule(hf_name, (gguf_name(name),), lambda t: (-torch.exp(t),), lambda ts: torch.log(-ts[0]))
    if name.endswith("linear_attn.conv1d.weight"):  # [conv_dim, 1, K] stored as [conv_dim, K]
        return DenseRule(hf_name, (gguf_name(name),), lambda t: (t.squeeze(1),), lambda ts: ts[0])
    if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
        # Qwen3NextRMSNorm scales by 1 + weight; the file holds the scale (x + 1 - 1 may round)
        return DenseRule(hf_name, (gguf_name(name),), lambda t: (t + 1,), lambda ts: ts[0] - 1)
    return None


ARCHITECTURE = Architecture(
    spec=swiglu_spec("qwen3_next", "num_experts", "moe_intermediate_size", qwen_sparse_layers, ("mlp",), NAMED_PROJ,
                     notes="layer_types linear_attention (gated DeltaNet) / full_attention; shared_expert + "
                           "shared_expert_gate are dense"),
    tiny=_tiny,
    gguf=GGUFArch("qwen3_next", MODEL_ARCH.QWEN3NEXT, None, None, read_config=_read, write_config=_write,
                  respell=_respell, special_dense_rule=_special_rule),
    synth_layers=4,  # a full attention layer every fourth
)
