"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (zai-org): attention with q/k/v biases, optional q/k RMSNorm,
partial NeoX rotary (half the head by default), and DeepSeek-V3's MoE (packtools.arch.models._v3_moe).
The checkpoints end with multi-token-prediction layers, which transformers does not load;
llama.cpp's converter appends them as extra blocks (nextn_predict_layers), which a bundle leaves out.
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch.group_routing import top2_group_score
from packtools.arch.models._v3_moe import read_v3_moe, tiny_v3_moe, write_v3_moe
from packtools.arch.parts import NAMED_PROJ, after_first_k_dense, swiglu_spec
from packtools.arch.record import Architecture
from packtools.arch.tiny import TinySize
from packtools.gguf.config_parts import ATTN, TensorFacts, partial_rope, refuse, write_head_dim
from packtools.gguf.gguf_arch import MODEL_ARCH, GGUFArch
from packtools.gguf.metadata import Metadata

_Q_NORM = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ATTN_Q_NORM].format(bid=0) + ".weight"
DEFAULT_PARTIAL_ROTARY = 0.5  # Glm4MoeConfig's default, and the converter's


def _tiny(size: TinySize) -> dict:
    return {
        **tiny_v3_moe(size),
        "head_dim": size.head_dim,  # GLM-4.5's config.json states it (128, not hidden / heads)
        "attention_bias": True,
        "use_qk_norm": True,
        "num_nextn_predict_layers": 1,
    }


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _read(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    default_head_dim = kwargs["hidden_size"] // kwargs["num_attention_heads"]
    head_dim = meta.get(ATTN.KEY_LENGTH, default_head_dim)
    rope = partial_rope(meta, kwargs["rope_parameters"], head_dim)
    return {
        # llama.cpp's glm4moe graph reads a file without the gating key as sigmoid
        **read_v3_moe(meta, "Glm4MoeTopkRouter", absent_gating=gguf.ExpertGatingFuncType.SIGMOID),
        **({"head_dim": head_dim} if ATTN.KEY_LENGTH in meta else {}),
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "attention_bias": facts.attention_bias,
        "use_qk_norm": _Q_NORM in facts.names,
        "rope_parameters": rope,
    }


def _write(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if not config.n_shared_experts:
        refuse(config, "n_shared_experts", config.n_shared_experts,
               "transformers' Glm4MoeMoE always has a shared expert of n_shared_experts * moe_intermediate_size")
    head_dim = _head_dim(config)
    factor = config.rope_parameters.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY)
    if (head_dim * factor) % 2:
        refuse(config, "rope_parameters.partial_rotary_factor", factor, f"rotates an odd {head_dim * factor} dims")
    writer.add_head_count_kv(config.num_key_value_heads)
    if getattr(config, "head_dim", None) is not None:
        write_head_dim(writer, config.head_dim)
    writer.add_rope_dimension_count(int(head_dim * factor))
    write_v3_moe(writer, config)


ARCHITECTURE = Architecture(
    spec=swiglu_spec("glm4_moe", "n_routed_experts", "moe_intermediate_size", after_first_k_dense, ("mlp",),
                     NAMED_PROJ, notes="first_k_dense_replace dense layers; shared experts and "
                                       "gate.e_score_correction_bias are dense; MTP layers are not loaded"),
    tiny=_tiny,
    gguf=GGUFArch("glm4_moe", MODEL_ARCH.GLM4_MOE, False, "norm_topk_prob", read_config=_read, write_config=_write,
                  mtp_layers_attr="num_nextn_predict_layers"),
    check_routing=top2_group_score("n_group"),
)
