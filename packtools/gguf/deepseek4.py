"""DeepSeek-V4 GGUFs (`general.architecture = deepseek4`): metadata keys, config, tensor names.

gguf-py 0.19 has no DEEPSEEK4 arch, so keys and tensor names are spelled here as llama.cpp writes
and reads them (vendored gguf-py/gguf/constants.py, src/llama-arch.cpp, src/models/deepseek4.cpp
load_arch_hparams / load_arch_tensors; the converter is conversion/deepseek.py DeepseekV4Model).
What llama.cpp's converter does to the official checkpoint: routed experts repacked losslessly
to MXFP4 (blk.N.ffn_{gate,up,down}_exps), FP8 dense weights dequantized and written Q8_0,
bfloat16 / float32 tensors kept, tid2eid written int32, MTP layers dropped, and the hash layers'
unused gate.bias dropped. Every dense tensor keeps its checkpoint shape (numpy order).
"""

from __future__ import annotations

import re

import gguf
from transformers import PretrainedConfig

from packtools.gguf.config_parts import TensorFacts
from packtools.gguf.errors import TensorMappingError, UnknownArchitectureError
from packtools.gguf.metadata import Metadata
from packtools.gguf.tensor_rules import DenseRule, plain_rule

GGUF_ARCH_NAME = "deepseek4"
MODEL_TYPE = "deepseek_v4"

LLM, ATTN, ROPE = gguf.Keys.LLM, gguf.Keys.Attention, gguf.Keys.Rope
# keys gguf-py 0.19 does not have (vendored gguf-py Keys.* / llama-arch.cpp LLM_KV_*)
SWIGLU_CLAMP_EXP = "{arch}.swiglu_clamp_exp"
INDEXER_HEAD_COUNT = "{arch}.attention.indexer.head_count"
INDEXER_KEY_LENGTH = "{arch}.attention.indexer.key_length"
INDEXER_TOP_K = "{arch}.attention.indexer.top_k"
OUTPUT_GROUP_COUNT = "{arch}.attention.output_group_count"
OUTPUT_LORA_RANK = "{arch}.attention.output_lora_rank"
COMPRESS_RATIOS = "{arch}.attention.compress_ratios"
COMPRESS_ROPE_FREQ_BASE = "{arch}.attention.compress_rope_freq_base"
HC_COUNT = "{arch}.hyper_connection.count"
HC_SINKHORN_ITERATIONS = "{arch}.hyper_connection.sinkhorn_iterations"
HC_EPSILON = "{arch}.hyper_connection.epsilon"
HASH_LAYER_COUNT = "{arch}.hash_layer_count"

GATING_SQRT_SOFTPLUS = 4  # llama.cpp LLAMA_EXPERT_GATING_FUNC_TYPE_SQRT_SOFTPLUS; gguf-py 0.19 stops at 2
# compress ratio -> transformers layer type (transformers' _COMPRESS_RATIO_TO_LAYER_TYPE; llama.cpp
# accepts exactly these three)
LAYER_TYPE_OF_RATIO = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}


def config_kwargs(meta: Metadata, facts: TensorFacts, kwargs: dict) -> dict:
    """The deepseek_v4 part of packtools.gguf.config_read.hf_config_kwargs."""
    layers = kwargs["num_hidden_layers"]
    gating = meta.require(LLM.EXPERT_GATING_FUNC)
    if gating != GATING_SQRT_SOFTPLUS:
        raise UnknownArchitectureError(meta.path, GGUF_ARCH_NAME, f"expert_gating_func {gating} is not sqrtsoftplus "
                                                                  f"({GATING_SQRT_SOFTPLUS})")
    ratios = list(meta.require(COMPRESS_RATIOS))
    if len(ratios) < layers:  # llama.cpp refuses the same; the list may carry MTP layers after the trunk
        raise UnknownArchitectureError(meta.path, GGUF_ARCH_NAME,
                                       f"{meta.key(COMPRESS_RATIOS)} has {len(ratios)} entries for {layers} blocks")
    unknown = sorted({r for r in ratios[:layers] if r not in LAYER_TYPE_OF_RATIO})
    if unknown:
        raise UnknownArchitectureError(meta.path, GGUF_ARCH_NAME, f"compress ratios {unknown} are not one of "
                                                                  f"{sorted(LAYER_TYPE_OF_RATIO)}")
    clamps = meta.require(SWIGLU_CLAMP_EXP)
    clamps = clamps if isinstance(clamps, list) else [clamps]
    if len(set(clamps[:layers])) != 1:
        raise UnknownArchitectureError(meta.path, GGUF_ARCH_NAME, f"per-layer swiglu clamps {clamps} differ; "
                                                                  "transformers has one swiglu_limit")
    hash_layers = meta.require(HASH_LAYER_COUNT)
    head_dim = meta.require(ATTN.KEY_LENGTH)
    return {
        "num_key_value_heads": meta.require(ATTN.HEAD_COUNT_KV),
        "head_dim": head_dim,
        # the rope dims are the last qk_rope_head_dim of every head (partial rotary)
        "partial_rotary_factor": meta.require(ROPE.DIMENSION_COUNT) / head_dim,
        "rope_theta": meta.get(ROPE.FREQ_BASE, 10000.0),
        "compress_rope_theta": meta.require(COMPRESS_ROPE_FREQ_BASE),
        "q_lora_rank": meta.require(ATTN.Q_LORA_RANK),
        "sliding_window": meta.require(ATTN.SLIDING_WINDOW),
        "moe_intermediate_size": meta.require(LLM.EXPERT_FEED_FORWARD_LENGTH),
        "n_shared_experts": meta.require(LLM.EXPERT_SHARED_COUNT),
        "routed_scaling_factor": meta.require(LLM.EXPERT_WEIGHTS_SCALE),
        "scoring_func": "sqrtsoftplus",
        "swiglu_limit": float(clamps[0]),
        "index_n_heads": meta.require(INDEXER_HEAD_COUNT),
        "index_head_dim": meta.require(INDEXER_KEY_LENGTH),
        "index_topk": meta.require(INDEXER_TOP_K),
        "o_groups": meta.require(OUTPUT_GROUP_COUNT),
        "o_lora_rank": meta.require(OUTPUT_LORA_RANK),
        "compress_rates": {LAYER_TYPE_OF_RATIO[4]: 4, LAYER_TYPE_OF_RATIO[128]: 128},
        "layer_types": [LAYER_TYPE_OF_RATIO[r] for r in ratios[:layers]],
        "mlp_layer_types": ["hash_moe" if i < hash_layers else "moe" for i in range(layers)],
        "hc_mult": meta.require(HC_COUNT),
        "hc_sinkhorn_iters": meta.require(HC_SINKHORN_ITERATIONS),
        "hc_eps": meta.require(HC_EPSILON),
        # llama.cpp's converter drops the MTP layers; none are in the file
        "num_nextn_predict_layers": 0,
    }


# transformers runtime name (after "model.layers.N.") -> GGUF name (after "blk.N.")
_LAYER_NAMES = {
    "self_attn.sinks": "attn_sinks.weight",
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_norm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_proj.weight": "attn_kv.weight",
    "self_attn.kv_norm.weight": "attn_kv_a_norm.weight",
    "self_attn.o_a_proj.weight": "attn_output_a.weight",
    "self_attn.o_b_proj.weight": "attn_output_b.weight",
    "self_attn.compressor.position_bias": "attn_compressor_ape.weight",
    "self_attn.compressor.kv_proj.weight": "attn_compressor_kv.weight",
    "self_attn.compressor.gate_proj.weight": "attn_compressor_gate.weight",
    "self_attn.compressor.kv_norm.weight": "attn_compressor_norm.weight",
    "self_attn.compressor.indexer.position_bias": "indexer_compressor_ape.weight",
    "self_attn.compressor.indexer.kv_proj.weight": "indexer_compressor_kv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "indexer_compressor_gate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "indexer_compressor_norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "indexer.attn_q_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "indexer.proj.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.gate.tid2eid": "ffn_gate_tid2eid.weight",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn.weight",
    "attn_hc.base": "hc_attn_base.weight",
    "attn_hc.scale": "hc_attn_scale.weight",
    "ffn_hc.fn": "hc_ffn_fn.weight",
    "ffn_hc.base": "hc_ffn_base.weight",
    "ffn_hc.scale": "hc_ffn_scale.weight",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "model.hc_head.hc_fn": "output_hc_fn.weight",
    "model.hc_head.hc_base": "output_hc_base.weight",
    "model.hc_head.hc_scale": "output_hc_scale.weight",
}
_LAYER_KEY = re.compile(r"^model\.layers\.(?P<bid>\d+)\.(?P<rest>.+)$")


def gguf_tensor_name(hf_name: str) -> str:
    """The deepseek4 GGUF tensor holding transformers' dense tensor `hf_name`."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    match = _LAYER_KEY.match(hf_name)
    if match and match["rest"] in _LAYER_NAMES:
        return f"blk.{match['bid']}.{_LAYER_NAMES[match['rest']]}"
    raise TensorMappingError(f"deepseek_v4: {hf_name!r} has no deepseek4 GGUF tensor in packtools' table "
                             "(packtools/gguf/deepseek4.py)")


def dense_rule(config: PretrainedConfig, hf_name: str) -> DenseRule:
    """deepseek4 stores every dense tensor under its own name and shape, transform-free."""
    return plain_rule(hf_name, gguf_tensor_name(hf_name))
