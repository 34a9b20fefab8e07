"""Small but real transformers configs of every supported MoE architecture.

Each builder returns the kwargs of a config that `AutoModelForCausalLM.from_config` builds and
that runs forward/generate on CPU in float32. The sizes scale: hidden 4096 with 256 experts of
moe_intermediate 2048 and a couple of layers is a full-width layer stack (build it on the meta
device). Attention stays deliberately narrow (4 heads) because the experts are what we test.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

# Token ids shared by every tiny config and by packtools.tokenizer_synth, which builds a
# tokenizer whose special tokens sit at exactly these ids.
PAD_TOKEN_ID = 0
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

NUM_ATTENTION_HEADS = 4
NUM_KEY_VALUE_HEADS = 2
MAX_POSITIONS = 4096


@dataclasses.dataclass(frozen=True)
class TinySize:
    hidden_size: int
    num_layers: int
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    vocab_size: int

    def validate(self) -> None:
        if self.hidden_size % (2 * NUM_ATTENTION_HEADS):
            raise ValueError(f"hidden_size {self.hidden_size} must be a multiple of {2 * NUM_ATTENTION_HEADS}")
        if self.num_layers < 1:
            raise ValueError(f"num_layers {self.num_layers} must be >= 1")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k {self.top_k} must be in [1, num_experts={self.num_experts}]")
        if self.moe_intermediate_size < 2 or self.moe_intermediate_size % 2:
            raise ValueError(f"moe_intermediate_size {self.moe_intermediate_size} must be even and >= 2")
        if self.vocab_size <= EOS_TOKEN_ID:
            raise ValueError(f"vocab_size {self.vocab_size} must exceed the special token ids")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // NUM_ATTENTION_HEADS

    @property
    def dense_intermediate_size(self) -> int:
        # dense layers and shared experts: twice an expert, like the real models' ratio order
        return 2 * self.moe_intermediate_size


def _common(size: TinySize) -> dict:
    return {
        "vocab_size": size.vocab_size,
        "hidden_size": size.hidden_size,
        "num_hidden_layers": size.num_layers,
        "num_attention_heads": NUM_ATTENTION_HEADS,
        "num_key_value_heads": NUM_KEY_VALUE_HEADS,
        "max_position_embeddings": MAX_POSITIONS,
        "pad_token_id": PAD_TOKEN_ID,
        "bos_token_id": BOS_TOKEN_ID,
        "eos_token_id": EOS_TOKEN_ID,
        "tie_word_embeddings": False,
    }


def _qwen3_moe(size: TinySize) -> dict:
    return {
        "head_dim": size.head_dim,
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
    }


def _qwen2_moe(size: TinySize) -> dict:
    return {
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "shared_expert_intermediate_size": size.dense_intermediate_size,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }


def _mixtral(size: TinySize) -> dict:
    return {
        "num_local_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
    }


def _olmoe(size: TinySize) -> dict:
    return {
        "num_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
    }


def _gpt_oss(size: TinySize) -> dict:
    kwargs = {
        "head_dim": size.head_dim,
        "num_local_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "intermediate_size": size.moe_intermediate_size,
        "sliding_window": 32,  # short, so a test prompt of a few dozen tokens crosses it
    }
    # gpt_oss ships YaRN over 4096 original positions; keep max positions consistent with it
    kwargs["max_position_embeddings"] = 131072
    return kwargs


def _expert_groups(num_experts: int, top_k: int) -> tuple[int, int]:
    """(n_group, topk_group) for group-limited routing that always leaves >= top_k candidates."""
    for n_group in (8, 4, 2, 1):
        if num_experts % n_group == 0 and num_experts // n_group >= 2:
            break
    else:
        return 1, 1
    per_group = num_experts // n_group
    topk_group = max(1, n_group // 2)
    while topk_group * per_group < top_k:
        topk_group += 1
    return n_group, topk_group


def _mla_attention() -> dict:
    # Multi-head latent attention dims, small and independent of hidden_size
    return {
        "num_key_value_heads": NUM_ATTENTION_HEADS,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    }


def _deepseek_v3(size: TinySize) -> dict:
    n_group, topk_group = _expert_groups(size.num_experts, size.top_k)
    return {
        **_mla_attention(),
        "q_lora_rank": 32,
        "n_routed_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "intermediate_size": size.dense_intermediate_size,
        "n_shared_experts": 1,
        "n_group": n_group,
        "topk_group": topk_group,
        # one dense layer first (as in the real model's first_k_dense_replace=3) so that
        # dense/MoE mixing is exercised; a single-layer model keeps its one MoE layer
        "first_k_dense_replace": 1 if size.num_layers >= 2 else 0,
        "num_nextn_predict_layers": 0,
    }


def _deepseek_v2(size: TinySize) -> dict:
    # DeepSeek-V2 / V2.5's routing: softmax, best-expert group scores, top-k weights not renormalised
    v3_only = ("num_nextn_predict_layers",)  # DeepSeek-V2 has no multi-token prediction layers
    return {
        **{k: v for k, v in _deepseek_v3(size).items() if k not in v3_only},
        "topk_method": "group_limited_greedy",
        "norm_topk_prob": False,
    }


def _kimi_moe(size: TinySize) -> dict:
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


def _kimi_linear(size: TinySize) -> dict:
    layer_types = ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(size.num_layers)]
    if "full_attention" not in layer_types:
        # the model needs at least one full attention layer (its cache is sized from it)
        layer_types[-1] = "full_attention"
    return {
        **_mla_attention(),
        "q_lora_rank": None,
        **_kimi_moe(size),
        "layer_types": layer_types,
        "mlp_layer_types": ["sparse"] * size.num_layers,
        "linear_attn_config": {"head_dim": 16, "num_heads": NUM_ATTENTION_HEADS, "short_conv_kernel_size": 4},
    }


def _kimi_k3(size: TinySize) -> dict:
    # every fourth layer MLA as in Kimi-Linear, at least one; Moonshot numbers layers from 1
    full = [i + 1 for i in range(size.num_layers) if i % 4 == 3] or [size.num_layers]
    return {
        **_mla_attention(),
        "q_lora_rank": 32,
        "linear_attn_config": {"num_heads": NUM_ATTENTION_HEADS, "head_dim": 16, "short_conv_kernel_size": 4,
                               "gate_lower_bound": -5.0, "use_full_rank_gate": True, "full_attn_layers": full},
        **_kimi_moe(size),
        "first_k_dense_replace": 1 if size.num_layers >= 2 else 0,
        "routed_expert_hidden_size": size.hidden_size // 2,  # the real model's latent ratio (3584 / 7168)
        "latent_moe_use_norm": True,
        "attn_res_block_size": 2,  # banks at layers 0, 2, ...: a 2-layer model already mixes two blocks
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        # Moonshot's MLA low-rank norms and KDA q/k l2 norms use 1e-6 whatever rms_norm_eps is, and
        # llama.cpp uses rms_norm_eps for both: 1e-6 everywhere makes them compute the same function
        "rms_norm_eps": 1e-6,
    }


def _deepseek_v4(size: TinySize) -> dict:
    attention_cycle = ("heavily_compressed_attention", "compressed_sparse_attention")
    return {
        "num_key_value_heads": 1,
        "head_dim": 32,
        "q_lora_rank": 32,
        "o_groups": 2,
        "o_lora_rank": 16,
        "index_n_heads": 2,
        "index_head_dim": 16,
        "index_topk": 8,
        "sliding_window": 16,
        # small compression rates so short test prompts reach the compressed branches
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
        "layer_types": [attention_cycle[i % 2] for i in range(size.num_layers)],
        "n_routed_experts": size.num_experts,
        "num_experts_per_tok": size.top_k,
        "moe_intermediate_size": size.moe_intermediate_size,
        "n_shared_experts": 1,
        # one hash-routed layer (tid2eid lookup) first, top-k routed layers after it
        "mlp_layer_types": ["hash_moe"] + ["moe"] * (size.num_layers - 1),
        "num_nextn_predict_layers": 0,
        "max_position_embeddings": MAX_POSITIONS,
    }


TINY_BUILDERS: dict[str, Callable[[TinySize], dict]] = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "olmoe": _olmoe,
    "gpt_oss": _gpt_oss,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v2": _deepseek_v2,
    "kimi_linear": _kimi_linear,
    "deepseek_v4": _deepseek_v4,
    "kimi_k3": _kimi_k3,
}


def tiny_config_kwargs(model_type: str, size: TinySize) -> dict:
    """Config kwargs for AutoConfig.for_model(model_type, **kwargs)."""
    size.validate()
    return {**_common(size), **TINY_BUILDERS[model_type](size)}
