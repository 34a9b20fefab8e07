"""transformers config -> GGUF metadata, as llama.cpp's convert_hf_to_gguf.py writes it.

Keys are written with GGUFWriter's add_* methods, so names and value types are gguf-py's.
Two additions over the converter, both harmless to llama.cpp: `expert_weights_norm` for every
arch whose transformers config has the switch (llama.cpp hard-codes it per arch, and a
transformers config may differ), and `expert_group_count`/`expert_group_used_count` whenever the
config's groups limit the routing (keeping every group limits nothing, and llama.cpp refuses a used
count that is not below the group count). Settings no GGUF key can carry raise
UnrepresentableConfigError; configs whose model cannot run (packtools.arch.routing) UnrunnableConfig.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
from transformers import PretrainedConfig

from packtools.arch import get_arch
from packtools.arch.routing import check_routing
from packtools.gguf.archs import GGUFArch, arch_for_model_type
from packtools.gguf.errors import UnrepresentableConfigError

# yarn_log_multiplier is 0.1 * mscale_all_dim in DeepSeek-2 GGUFs (llama.cpp's legacy convention)
DEEPSEEK_YARN_LOG_MUL_PER_MSCALE = 0.1


def write_config_kv(writer: gguf.GGUFWriter, config: PretrainedConfig) -> GGUFArch:
    """Add the architecture's hyperparameters to `writer`; returns the GGUF arch used."""
    arch = arch_for_model_type(config.model_type)
    check_routing(config)
    if config.model_type != "gpt_oss" and config.hidden_act != "silu":
        _refuse(config, "hidden_act", config.hidden_act, "llama.cpp's MoE graphs use SiLU-gated FFNs")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_expert_count(get_arch(config.model_type).num_experts(config))
    writer.add_expert_used_count(config.num_experts_per_tok)
    if arch.norm_topk_attr is not None:
        writer.add_expert_weights_norm(bool(getattr(config, arch.norm_topk_attr)))
    _write_rope(writer, config)
    _ARCH_WRITERS[config.model_type](writer, config)
    return arch


def _refuse(config: PretrainedConfig, setting: str, value: object, reason: str) -> None:
    raise UnrepresentableConfigError(config.model_type, setting, value, reason)


def _write_rope(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
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
        _refuse(config, "rope_parameters.rope_type", rope_type, "only default, linear and yarn map to GGUF")
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    if params.get("attention_factor") is not None:
        writer.add_rope_scaling_yarn_attn_factor(params["attention_factor"])
    if params.get("beta_fast") is not None:
        writer.add_rope_scaling_yarn_beta_fast(params["beta_fast"])
    if params.get("beta_slow") is not None:
        writer.add_rope_scaling_yarn_beta_slow(params["beta_slow"])
    if config.model_type in ("deepseek_v3", "deepseek_v2") and params.get("mscale_all_dim"):
        if params.get("mscale", params["mscale_all_dim"]) != params["mscale_all_dim"]:
            _refuse(config, "rope_parameters.mscale", params.get("mscale"), "GGUF holds one yarn mscale")
        writer.add_rope_scaling_yarn_log_mul(DEEPSEEK_YARN_LOG_MUL_PER_MSCALE * params["mscale_all_dim"])
    if config.model_type == "gpt_oss" and params.get("truncate", True) is not False:
        _refuse(config, "rope_parameters.truncate", params.get("truncate"), "gpt-oss GGUFs imply truncate=False")


def _write_expert_groups(writer: gguf.GGUFWriter, n_group: int | None, topk_group: int | None) -> None:
    if n_group is not None and topk_group is not None and topk_group < n_group:
        writer.add_expert_group_count(n_group)
        writer.add_expert_group_used_count(topk_group)


def _write_head_dim(writer: gguf.GGUFWriter, head_dim: int) -> None:
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)


def _all_layers_sparse(config: PretrainedConfig) -> None:
    # gguf-py's QWEN2MOE/QWEN3MOE tensor sets have no dense FFN: every layer must route
    if config.mlp_only_layers or config.decoder_sparse_step != 1:
        _refuse(config, "mlp_only_layers/decoder_sparse_step", (config.mlp_only_layers, config.decoder_sparse_step),
                "llama.cpp's Qwen MoE archs have routed experts in every layer")


def _qwen3_moe(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    _all_layers_sparse(config)
    writer.add_head_count_kv(config.num_key_value_heads)
    _write_head_dim(writer, config.head_dim)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)


def _qwen2_moe(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    _all_layers_sparse(config)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)


def _mixtral(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_vocab_size(config.vocab_size)
    head_dim = config.head_dim or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if config.head_dim is not None:
        _write_head_dim(writer, config.head_dim)
    if config.sliding_window is not None:
        writer.add_sliding_window(config.sliding_window)


def _olmoe(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    writer.add_head_count_kv(config.num_key_value_heads)
    if config.clip_qkv is not None:
        writer.add_clamp_kqv(config.clip_qkv)


def _write_mla(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
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


def _write_deepseek2(writer: gguf.GGUFWriter, config: PretrainedConfig, gating: gguf.ExpertGatingFuncType) -> None:
    _write_mla(writer, config)
    writer.add_expert_gating_func(gating)
    writer.add_head_count_kv(1)
    writer.add_value_length(config.kv_lora_rank)
    writer.add_leading_dense_block_count(config.first_k_dense_replace or 0)
    writer.add_expert_shared_count(config.n_shared_experts or 0)


def _deepseek_v3(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    _write_deepseek2(writer, config, gguf.ExpertGatingFuncType.SIGMOID)
    _write_expert_groups(writer, config.n_group, config.topk_group)


def _deepseek_v2(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    _write_deepseek2(writer, config, gguf.ExpertGatingFuncType.SOFTMAX)
    if config.topk_method == "group_limited_greedy":  # "greedy" ignores the groups
        _write_expert_groups(writer, config.n_group, config.topk_group)


def _gpt_oss(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    alternating = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(config.num_hidden_layers)]
    if list(config.layer_types) != alternating:
        _refuse(config, "layer_types", config.layer_types, "llama.cpp's gpt-oss alternates sliding/full from layer 0")
    # transformers < 5.18 has no swiglu_limit attribute and always clamps at 7.0.
    limit = getattr(config, "swiglu_limit", 7.0)
    if limit != 7.0:
        _refuse(config, "swiglu_limit", limit, "llama.cpp's gpt-oss clamps at 7.0")
    writer.add_head_count_kv(config.num_key_value_heads)
    _write_head_dim(writer, config.head_dim)
    writer.add_sliding_window(config.sliding_window)
    writer.add_expert_feed_forward_length(config.intermediate_size)


def _kimi_linear(writer: gguf.GGUFWriter, config: PretrainedConfig) -> None:
    if config.linear_num_heads != config.num_attention_heads:
        _refuse(config, "linear_num_heads", config.linear_num_heads, "llama.cpp's KDA uses head_count heads")
    dense = [kind == "dense" for kind in config.mlp_layer_types]
    leading_dense = dense.index(False) if False in dense else len(dense)
    if any(dense[leading_dense:]):
        _refuse(config, "mlp_layer_types", config.mlp_layer_types, "dense layers must all come first")
    _write_mla(writer, config)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    # a KV head count of 0 marks a KDA (linear attention) layer
    writer.add_head_count_kv([1 if kind == "full_attention" else 0 for kind in config.layer_types])
    writer.add_ssm_conv_kernel(config.linear_conv_kernel_dim)
    writer.add_kda_head_dim(config.linear_head_dim)
    writer.add_expert_shared_count(config.num_shared_experts)
    writer.add_leading_dense_block_count(leading_dense)
    _write_expert_groups(writer, config.num_expert_group, config.topk_group)


_ARCH_WRITERS: dict[str, Callable[[gguf.GGUFWriter, PretrainedConfig], None]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "gpt_oss": _gpt_oss,
    "kimi_linear": _kimi_linear,
}
