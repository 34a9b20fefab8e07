"""gpt-oss: fused in_out experts with gate/up columns interleaved and biases, alternating
sliding-window and full attention, attention sinks, SwiGLU clamped at 7 (its own activation)."""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packformat.constants import Role
from packtools.arch.parts import every_layer
from packtools.arch.record import Architecture
from packtools.arch.spec import ArchSpec, FusedPart
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, LLM, TensorFacts, head_dim_or_default, refuse, write_head_dim
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata
from packtools.sources.base import ExpertLayout

# object role order shared with the GGUF source (packtools.gguf.expert_map.ROLE_ORDER):
# weights (gate, up | fused gate_up), down, then the biases in the same order
_LAYOUT = ExpertLayout(
    roles=(Role.GATE_UP, Role.DOWN, Role.GATE_UP_BIAS, Role.DOWN_BIAS), orientation="in_out", gate_up="interleaved"
)
# gate_up_proj [E, H, 2I] interleaved (not splittable into contiguous gate/up), biases
_FUSED = {
    "gate_up_proj": FusedPart((Role.GATE_UP,)),
    "gate_up_proj_bias": FusedPart((Role.GATE_UP_BIAS,)),
    "down_proj": FusedPart((Role.DOWN,)),
    "down_proj_bias": FusedPart((Role.DOWN_BIAS,)),
}


def _alternating(layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)]


def _tiny(size: TinySize) -> dict:
    return {
        "head_dim": size.head_dim,
        "num_local_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
        "sliding_window": 32,  # short, so a test prompt of a few dozen tokens crosses it
        # gpt_oss ships YaRN over 4096 original positions; keep max positions consistent with it
        "max_position_embeddings": 131072,
    }


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim_or_default(meta, kwargs),
        "sliding_window": meta.require(ATTN.SLIDING_WINDOW),
        "intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "attention_bias": facts.attention_bias,
        "layer_types": _alternating(kwargs["num_hidden_layers"]),
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if list(config.layer_types) != _alternating(config.num_hidden_layers):
        refuse(config, "layer_types", config.layer_types, "llama.cpp's gpt-oss alternates sliding/full from layer 0")
    # transformers < 5.18 has no swiglu_limit attribute and always clamps at 7.0.
    limit = getattr(config, "swiglu_limit", 7.0)
    if limit != 7.0:
        refuse(config, "swiglu_limit", limit, "llama.cpp's gpt-oss clamps at 7.0")
    writer.add_head_count_kv(config.num_key_value_heads)
    write_head_dim(writer, config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)


def _respell(name: str) -> str:
    # the converter sees the sinks as a weight
    return name + ".weight" if name.endswith(".self_attn.sinks") else name


ARCHITECTURE = Architecture(
    spec=ArchSpec(
        model_type="gpt_oss",
        layout=_LAYOUT,
        num_experts_attr="num_local_experts",
        moe_intermediate_attr="intermediate_size",
        moe_layer_rule=every_layer,
        containers=("mlp",),
        per_expert_parts={},
        fused_parts=_FUSED,
        notes="fused in_out interleaved gate_up with biases; router is mlp.router",
    ),
    tiny=_tiny,
    gguf=GGUFArch("gpt_oss", MODEL_ARCH.GPT_OSS, None, None, read_config=_read, write_config=_write,
                  yarn_truncate=False, ffn_act=None, respell=_respell),
)
