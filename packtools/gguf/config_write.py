"""transformers config -> GGUF metadata, as llama.cpp's convert_hf_to_gguf.py writes it.

Keys are written with GGUFWriter's add_* methods, so names and value types are gguf-py's.
Two additions over the converter, both harmless to llama.cpp: `expert_weights_norm` for every
arch whose transformers config has the switch (llama.cpp hard-codes it per arch, and a
transformers config may differ), and `expert_group_count`/`expert_group_used_count` whenever the
config's groups limit the routing (keeping every group limits nothing, and llama.cpp refuses a used
count that is not below the group count). Settings no GGUF key can carry raise
UnrepresentableConfigError; configs whose model cannot run (packtools.arch.routing) UnrunnableConfig.
The keys every arch has are written here; each architecture's record writes its own
(GGUFArch.write_config, packtools.arch.models).
"""

from __future__ import annotations

import gguf
from transformers import PretrainedConfig

from packtools.arch import get_arch
from packtools.arch.routing import check_routing
from packtools.gguf.archs import arch_for_model_type
from packtools.gguf.config_parts import DEEPSEEK_YARN_LOG_MUL_PER_MSCALE, refuse
from packtools.gguf.errors import UnknownArchitectureError
from packtools.gguf.gguf_arch import GGUFArch


def write_config_kv(writer: gguf.GGUFWriter, config: PretrainedConfig) -> GGUFArch:
    """Add the architecture's hyperparameters to `writer`; returns the GGUF arch used."""
    arch = arch_for_model_type(config.model_type)
    if arch.write_config is None:
        raise UnknownArchitectureError("<transformers config>", config.model_type,
                                       f"packtools reads {arch.gguf_name} GGUFs (llama.cpp's converter writes "
                                       "them) but does not write them")
    check_routing(config)
    if arch.ffn_act is not None and config.hidden_act != arch.ffn_act:
        refuse(config, "hidden_act", config.hidden_act, "llama.cpp's MoE graphs use SiLU-gated FFNs"
               if arch.ffn_act == "silu" else f"llama.cpp's {arch.gguf_name} graph uses {arch.ffn_act}")
    mtp = (getattr(config, arch.mtp_layers_attr) or 0) if arch.mtp_layers_attr is not None else 0
    # as llama.cpp's converter: the MTP layers are blocks after the decoder layers; a transformers
    # model has no weights for them, so the file has none (llama.cpp runs such a file without MTP)
    writer.add_block_count(config.num_hidden_layers + mtp)
    if mtp:
        writer.add_nextn_predict_layers(mtp)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(get_arch(config.model_type).num_experts(config))
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch.norm_topk_attr is not None:
        writer.add_expert_weights_norm(bool(getattr(config, arch.norm_topk_attr)))
    _write_rope(writer, config, arch)
    arch.write_config(writer, config)
    return arch


def _write_rope(writer: gguf.GGUFWriter, config: PretrainedConfig, arch: GGUFArch) -> None:
    params = getattr(config, "rope_parameters", None) or {}
    if "rope_theta" in params:
        writer.add_rope_freq_base(params["rope_theta"])
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        return
    if rope_type == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(params["factor"])
        return
    if rope_type != "yarn":
        refuse(config, "rope_parameters.rope_type", rope_type, "only default, linear and yarn map to GGUF")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if params.get("attention_factor") is not None:
        writer.add_rope_scaling_yarn_attn_factor(params["attention_factor"])
    if params.get("beta_fast") is not None:
        writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
    if params.get("beta_slow") is not None:
        writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    if arch.yarn_log_mul and params.get("mscale_all_dim"):
        if params.get("mscale", params["mscale_all_dim"]) != params["mscale_all_dim"]:
            refuse(config, "rope_parameters.mscale", params.get("mscale"), "GGUF holds one yarn mscale")
        writer.add_rope_scaling_yarn_log_mul(DEEPSEEK_YARN_LOG_MUL_PER_MSCALE * params["mscale_all_dim"])
    if arch.yarn_truncate is not None and params.get("truncate", True) is not arch.yarn_truncate:
        refuse(config, "rope_parameters.truncate", params.get("truncate"),
               f"{arch.gguf_name} GGUFs imply truncate={arch.yarn_truncate}")
