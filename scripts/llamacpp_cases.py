"""The cases of scripts/llamacpp_golden.py: which tiny models llama.cpp converts, quantizes and runs.

A table module of its own so the driver stays about the steps; tests read the cases through
llamacpp_golden (which re-exports everything here).
"""

from __future__ import annotations

import dataclasses

NEW_TOKENS = 32
PROMPT = [1, 17, 305, 88, 421, 42, 260, 133, 77, 499, 12, 301]  # fixed token ids, vocab 512
NARROW = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 4}  # F32 and MXFP4 cases
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256, "num_experts": 4}  # K-quants: 256-element rows
# DeepSeek-V4's heavily compressed layers pool 128 tokens into one entry (llama.cpp accepts no other
# ratio), so its prompt is long enough to fill one and to slide far past the window of 16
LONG_PROMPT = [1] + [(17 * i * i + 31 * i) % 509 + 3 for i in range(149)]
PROMPTS = {"short": PROMPT, "long": LONG_PROMPT}


@dataclasses.dataclass(frozen=True)
class Case:
    arch: str
    quant: str  # "F32" (converter output as is) or a llama-quantize ftype name
    sizes: dict
    overrides: dict = dataclasses.field(default_factory=dict)  # config attributes of the random model
    quantize_args: tuple[str, ...] = ()  # llama-quantize options, e.g. --tensor-type per tensor
    # "float", or "compressed-tensors-mxfp4": experts stored as the official Kimi-K3 checkpoint does,
    # which the converter turns into MXFP4 itself (the GGUF is its output, not llama-quantize's)
    expert_format: str = "float"
    prompt: str = "short"  # a key of PROMPTS
    variant: str = ""  # tells apart cases of one arch and quant whose configs differ (e.g. "topk8")
    # also record llama.cpp's lightning-indexer choices (DeepSeek-V4's "lid_top_k-<layer>" nodes)
    record_indexer: bool = False
    converter_args: tuple[str, ...] = ()  # extra convert_hf_to_gguf.py options

    @property
    def name(self) -> str:
        return f"{self.arch}-{self.quant}" + (f"-{self.variant}" if self.variant else "")

    @property
    def checkpoint(self) -> str:  # one HF checkpoint per (arch, width, expert format, variant), shared by its quantizations
        width = "wide" if self.sizes["hidden_size"] == WIDE["hidden_size"] else "narrow"
        return (f"{self.arch}-{width}" + ("" if self.expert_format == "float" else f"-{self.expert_format}")
                + (f"-{self.variant}" if self.variant else ""))


# transformers' DeepseekV3Config does not serialize scoring_func/topk_method; DeepSeek-V3's own
# config.json has them, and without scoring_func the converter writes no expert_gating_func, which
# llama.cpp then reads as softmax (DeepSeek-V2 routing).
def _deepseek_v3_keys(config: dict) -> dict:
    return {"scoring_func": "sigmoid", "topk_method": "noaux_tc"}


# DeepSeek-V2's config.json says "scoring_func": "softmax" (transformers' DeepseekV2Config does not
# serialize it); the converter writes it as expert_gating_func 1, as for a real DeepSeek-V2.
def _deepseek_v2_keys(config: dict) -> dict:
    return {"scoring_func": "softmax"}


def _kimi_linear_keys(config: dict) -> dict:
    """Moonshot's own config.json spellings, which the converter reads (transformers renamed them)."""
    layer_numbers = range(1, config["num_hidden_layers"] + 1)  # Moonshot counts layers from 1
    kinds = dict(zip(layer_numbers, config["layer_types"]))
    linear = {**config["linear_attn_config"],
              "full_attn_layers": [n for n, kind in kinds.items() if kind == "full_attention"],
              "kda_layers": [n for n, kind in kinds.items() if kind == "linear_attention"]}
    return {"linear_attn_config": linear, "first_k_dense_replace": 0, "moe_router_activation_func": "sigmoid"}


# dots.llm1's config.json says "scoring_func": "sigmoid" (Dots1Config does not serialize it); the
# converter writes it as expert_gating_func, which llama.cpp's dots1 graph needs
def _dots1_keys(config: dict) -> dict:
    return {"scoring_func": "sigmoid"}


# Tencent's config.json states the MoE settings per layer (all equal), which the converter reads;
# transformers' HunYuanMoEV1Config keeps the experts' width in intermediate_size and one shared MLP
def _hunyuan_keys(config: dict) -> dict:
    layers = config["num_hidden_layers"]
    return {"moe_intermediate_size": [config["intermediate_size"]] * layers,
            "moe_topk": [config["moe_topk"]] * layers, "num_shared_expert": [1] * layers}


# MiniMax-M2's released config.json states "rotary_dim" and "scoring_func": "sigmoid", which the
# converter reads; transformers' MiniMaxM2Config folds the first into rope_parameters, drops the second
def _minimax_m2_keys(config: dict) -> dict:
    rotary_dim = int(config["head_dim"] * config["rope_parameters"]["partial_rotary_factor"])
    return {"rotary_dim": rotary_dim, "scoring_func": "sigmoid"}


CONVERTER_CONFIG_KEYS = {"deepseek_v3": _deepseek_v3_keys, "deepseek_v2": _deepseek_v2_keys,
                         "kimi_linear": _kimi_linear_keys, "dots1": _dots1_keys,
                         "hunyuan_v1_moe": _hunyuan_keys, "minimax_m2": _minimax_m2_keys}
# DeepSeek-V2-Lite's routing: plain top-k over all experts (the tiny default is V2 / V2.5's
# group_limited_greedy). Its q_lora_rank stays: llama.cpp reads a missing q_lora_rank only in
# 26/27-layer files, which it takes for V2-Lite by their depth.
DEEPSEEK_V2_LITE_ROUTING = {"topk_method": "greedy", "n_group": 1, "topk_group": 1}
# llama.cpp's OLMoE graph sizes attn_k_norm as n_embd, i.e. assumes n_kv_heads == n_heads (true of
# OLMoE-1B-7B); transformers sizes it head_dim * n_kv_heads.
OLMOE_MHA = {"num_key_value_heads": 4}

# Kimi-K3 as users hold it: llama.cpp's converter output (F32), the common Q2_K quantization with
# Q2_K gate/up and Q3_K down experts, and MXFP4 experts from the official compressed-tensors
# checkpoint. 4 layers: a dense first layer, KDA and MLA layers, two attention-residual blocks.
# The wide case's latent width is 256 so that expert rows are whole K-quant blocks.
K3_LAYERS = {"num_layers": 4}
K3_USERS_Q2_K = ("--tensor-type", "ffn_gate_exps=q2_k", "--tensor-type", "ffn_up_exps=q2_k",
                 "--tensor-type", "ffn_down_exps=q3_k")
KIMI_K3_CASES = [
    Case("kimi_k3", "F32", {**NARROW, **K3_LAYERS}),
    Case("kimi_k3", "Q2_K", {**WIDE, **K3_LAYERS}, {"routed_expert_hidden_size": 256}, quantize_args=K3_USERS_Q2_K),
    Case("kimi_k3", "MXFP4", {**NARROW, **K3_LAYERS}, expert_format="compressed-tensors-mxfp4"),
]

# DeepSeek-V4 as DeepSeek publishes it (packtools synth --layout official: FP8 dense, FP4 experts);
# the converter repacks the experts to MXFP4 and, told to (DSV4_DENSE_BF16_FLAG), keeps the
# dequantized FP8 dense weights exact in BF16 instead of its Q8_0. index_topk 64 exceeds the
# compressed entries of the prompt, so every visible entry is attended; with index_topk 8 the
# indexer chooses, and llama.cpp breaks ties among equal scores differently from torch.topk, so that
# case also records llama.cpp's choices (docs/packtools.md, DeepSeek-V4).
DEEPSEEK_V4_CASES = [
    Case("deepseek_v4", "MXFP4", NARROW, {"index_topk": 64}, expert_format="deepseek-v4-official", prompt="long"),
    Case("deepseek_v4", "MXFP4", NARROW, {"index_topk": 8}, expert_format="deepseek-v4-official", prompt="long",
         variant="topk8", record_indexer=True),
]

CASES = [
    Case("qwen3_moe", "F32", NARROW),
    Case("qwen2_moe", "F32", NARROW),
    Case("mixtral", "F32", NARROW),
    Case("olmoe", "F32", NARROW, OLMOE_MHA),
    Case("deepseek_v3", "F32", NARROW),
    # 8 experts: 4 groups of 2, 2 kept, where DeepSeek-V2's group rule and llama.cpp's part visibly
    # (with 2 groups of 2 they chose alike at every compared position)
    Case("deepseek_v2", "F32", {**NARROW, "num_experts": 8}),
    Case("deepseek_v2", "F32", NARROW, DEEPSEEK_V2_LITE_ROUTING, variant="greedy"),
    Case("gpt_oss", "F32", NARROW),
    Case("kimi_linear", "F32", NARROW),
    Case("dots1", "F32", NARROW),
    Case("glm4_moe", "F32", NARROW),
    Case("ernie4_5_moe", "F32", NARROW),
    Case("hunyuan_v1_moe", "F32", NARROW),
    Case("minimax_m2", "F32", NARROW),
    # 4 layers: three gated DeltaNet layers, then full attention. Qwen3-Next's converter insists on the
    # checkpoint's MTP tensors unless told --no-mtp; a transformers checkpoint has none
    Case("qwen3_next", "F32", NARROW, converter_args=("--no-mtp",)),
    Case("gpt_oss", "MXFP4_MOE", NARROW),
    Case("qwen3_moe", "Q4_K_S", WIDE),
    Case("mixtral", "Q3_K_S", WIDE),
    Case("deepseek_v3", "Q2_K", WIDE),
    *KIMI_K3_CASES,
    *DEEPSEEK_V4_CASES,
]
