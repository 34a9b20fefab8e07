"""Shrink any MoE model type's transformers config to test size, from its config class defaults.

A written architecture module says its tiny config key by key (packtools.arch.tiny); a model type
served through the generic path (packtools.arch.generic) has none, so its tiny config is the
config class's defaults with every size that matters shrunk: few layers (enough for each kind of
layer the defaults list to appear once), hidden 64, a few experts of small width, a small vocab,
narrow attention (plain, multi-head latent, linear and Mamba alike). The keys are the spellings
transformers' MoE configs use; a key the class does not have is not added, and a per-layer list
or pattern (`layer_types`, `mlp_layer_types`, `hybrid_override_pattern`, ...) is cut to the new
layer count. `shrink_kwargs` is deterministic: it depends on the model type and the sizes only.
"""

from __future__ import annotations

import dataclasses

from transformers import CONFIG_MAPPING, PretrainedConfig

from packtools.arch.tiny import NUM_ATTENTION_HEADS, NUM_KEY_VALUE_HEADS, TinySize, expert_groups

MAX_TINY_LAYERS = 8  # a per-layer pattern needing more layers to show every kind is cut here
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
TOP_K_KEYS = ("num_experts_per_tok", "moe_k", "moe_topk", "num_experts_per_token", "experts_per_token",
              "top_k_experts")
MOE_SWITCHES = ("enable_moe_block",)  # configs whose experts are off by default (gemma4_text)
GROUP_KEYS = (("n_group", "topk_group"), ("num_expert_group", "topk_group"))
DENSE_WIDTH_KEYS = ("intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
                    "shared_intermediate_size", "dense_intermediate_size", "shared_experts_intermediate_size")
# multi-head latent attention, DSA indexers, linear attention and Mamba mixers: small, consistent
NARROW = {
    "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "qk_head_dim": 16,
    "o_lora_rank": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 64,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_d_state": 16, "ssm_state_size": 16, "mamba_dt_rank": 8,
    "mamba_n_groups": 1, "n_groups": 1, "mamba_chunk_size": 16, "chunk_size": 16,
    "router_hidden_size": 16, "num_nextn_predict_layers": 0,
    "swa_num_attention_heads": NUM_ATTENTION_HEADS, "swa_num_key_value_heads": NUM_KEY_VALUE_HEADS,
    "swa_head_dim": 16, "hidden_size_per_layer_input": 16,
}
VOCAB_KEYS = ("vocab_size_per_layer_input",)  # per-layer token embeddings (gemma4_text)
# Mamba heads follow from the width: heads * head_dim = expand * hidden
MAMBA_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("mamba_num_heads", "mamba_head_dim", "expand"))
PER_LAYER_SKIP = ("layer_types_pattern",)
FIRST_DENSE_KEYS = ("first_k_dense_replace", "num_dense_layers")
# defaults that do not build or run a model (a per-layer list left to the checkpoint, no attention
# layer at all): the least a tiny config of the type must say
DEFAULTS_THAT_DO_NOT_BUILD = {
    "lfm2_moe": {"layer_types": ["conv", "full_attention", "conv"]},
    # all Mamba by default, and transformers' generate needs one attention layer for its cache
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
}
TOP_K_LIMITS = {"zaya": 1}  # its config validates num_experts_per_tok == 1


class TinyConfigError(ValueError):
    """A model type whose config cannot be shrunk to a test size."""

    def __init__(self, model_type: str, reason: str):
        self.model_type = model_type
        super().__init__(f"{model_type}: no tiny config: {reason}")


def config_defaults(model_type: str) -> PretrainedConfig:
    try:
        return CONFIG_MAPPING[model_type]()
    except KeyError:
        raise TinyConfigError(model_type, "transformers has no config class for it") from None


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _per_layer_keys(defaults: dict, layers: int) -> list[str]:
    """Keys holding one entry per decoder layer (a list, or a pattern string of one char each)."""
    return [k for k, v in defaults.items() if k not in PER_LAYER_SKIP and isinstance(v, (list, str))
            and len(v) == layers and layers > 1 and not k.endswith(("_token", "_name", "_type", "_id"))
            and k not in ("architectures", "dtype", "torch_dtype", "model_type")]


def _layer_count(defaults: dict, per_layer: list[str], size: TinySize) -> int:
    """Enough layers for every kind a per-layer list names to appear (at least size.num_layers)."""
    layers = size.num_layers
    for key in per_layer:
        seen: set = set()
        for index, kind in enumerate(defaults[key]):
            if kind not in seen:
                seen.add(kind)
                layers = max(layers, index + 1)
    return layers


def _cut(kinds: list | str, n: int, compress: bool) -> list | str:
    """The first n entries, or (compress) each distinct kind once in order of first use, cycled to n."""
    if not compress:
        return kinds[:n]
    distinct = list(dict.fromkeys(kinds))
    cut = [distinct[i % len(distinct)] for i in range(n)]
    return "".join(cut) if isinstance(kinds, str) else cut


def _shrink_composite(model_type: str, config: PretrainedConfig, size: TinySize) -> dict:
    """A composite config (a multimodal model) shrinks its text model's config; the other parts keep
    their defaults, since the causal-LM model of such a config is its text model alone."""
    if "text_config" not in config.sub_configs:
        raise TinyConfigError(model_type, f"a composite config without a text_config ({sorted(config.sub_configs)})")
    text_type = getattr(config.sub_configs["text_config"], "model_type", None)
    if not text_type or text_type == model_type:
        raise TinyConfigError(model_type, "its text_config names no model type of its own")
    from packtools.arch.tiny import common_kwargs

    return {"text_config": {**common_kwargs(size), **shrink_kwargs(text_type, size)}}


def shrink_kwargs(model_type: str, size: TinySize) -> dict:
    """Config kwargs that shrink `model_type`'s defaults to `size` (the keys common_kwargs lacks)."""
    config = config_defaults(model_type)
    defaults = config.to_dict()
    if getattr(config, "sub_configs", None):
        return _shrink_composite(model_type, config, size)
    needed = DEFAULTS_THAT_DO_NOT_BUILD.get(model_type, {})
    layers = defaults.get("num_hidden_layers")
    if not _int(layers) and isinstance(defaults.get("layers_block_type"), list):
        layers = len(defaults["layers_block_type"])  # nemotron_h: the pattern sets the depth
    if not _int(layers):
        raise TinyConfigError(model_type, "its config has no num_hidden_layers")
    if model_type in TOP_K_LIMITS:
        size = dataclasses.replace(size, top_k=min(size.top_k, TOP_K_LIMITS[model_type]))
    per_layer = [key for key in _per_layer_keys(defaults, layers) if key not in needed]
    n = _layer_count(defaults, per_layer, size)
    # every kind within the first few layers, or else each kind once (hybrids whose first attention
    # layer comes late: granitemoehybrid)
    compress = n > max(MAX_TINY_LAYERS, size.num_layers)
    if compress:
        n = max([size.num_layers] + [len(set(defaults[key])) for key in per_layer])
    out: dict = {"num_hidden_layers": n, **needed}
    if "layer_types" in needed:
        out["num_hidden_layers"] = len(needed["layer_types"])
    for key in per_layer:
        out[key] = _cut(defaults[key], n, compress)
    heads = NUM_ATTENTION_HEADS
    mla = _int(defaults.get("kv_lora_rank"))
    if defaults.get("num_key_value_heads") == defaults.get("num_attention_heads") or mla:
        out["num_key_value_heads"] = heads
    else:
        out["num_key_value_heads"] = NUM_KEY_VALUE_HEADS
    if "head_dim" in defaults:
        out["head_dim"] = NARROW["qk_rope_head_dim"] if mla else size.head_dim
    for key in EXPERT_COUNT_KEYS:
        if key in defaults and (defaults[key] is None or _int(defaults[key]) and defaults[key] > 0):
            out[key] = size.num_experts
    for key in TOP_K_KEYS:
        if key in defaults and (defaults[key] is None or _int(defaults[key])):
            out[key] = size.top_k
    for key in VOCAB_KEYS:
        if _int(defaults.get(key)):
            out[key] = size.vocab_size
    for key in MOE_SWITCHES:
        if defaults.get(key) is False:
            out[key] = True
    if "n_shared_experts" in defaults and defaults["n_shared_experts"] is None:
        out["n_shared_experts"] = 1
    for group_key, keep_key in GROUP_KEYS:
        if _int(defaults.get(group_key)) and _int(defaults.get(keep_key)):
            out[group_key], out[keep_key] = expert_groups(size.num_experts, size.top_k)
    if "moe_intermediate_size" in defaults:
        out["moe_intermediate_size"] = size.moe_intermediate_size
    for key in DENSE_WIDTH_KEYS:
        if _int(defaults.get(key)):
            out[key] = size.dense_intermediate_size
    for key, value in NARROW.items():
        if _int(defaults.get(key)) and defaults[key] > value:
            out[key] = value
    if _int(defaults.get("q_lora_rank")):
        out["q_lora_rank"] = 32
    for key in FIRST_DENSE_KEYS:
        if _int(defaults.get(key)):
            out[key] = min(defaults[key], 1 if n >= 2 else 0)
    if isinstance(defaults.get("mlp_only_layers"), list):
        out["mlp_only_layers"] = []
    if _int(defaults.get("decoder_sparse_step")) and defaults["decoder_sparse_step"] > n:
        out["decoder_sparse_step"] = 1
    for key, period in defaults.items():  # jamba: attention / experts every `period` layers from `offset`
        offset_key = key.replace("_period", "_offset")
        if key.endswith("_layer_period") and _int(period) and _int(defaults.get(offset_key)) and period > 2:
            out[key], out[offset_key] = 2, defaults[offset_key] % 2
    for heads_key, dim_key, expand_key in MAMBA_HEADS:
        if _int(defaults.get(heads_key)):
            expand = defaults.get(expand_key) or 2
            out[heads_key] = int(expand * size.hidden_size) // out.get(dim_key, defaults.get(dim_key) or 16)
    return out
