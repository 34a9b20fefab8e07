"""Small but real transformers configs: the sizes and keys every architecture's tiny config shares.

Each architecture's record (packtools.arch.models) adds its own keys; together they make a config
that `AutoModelForCausalLM.from_config` builds and that runs forward/generate on CPU in float32.
The sizes scale: hidden 4096 with 256 experts of moe_intermediate 2048 and a couple of layers is a
full-width layer stack (build it on the meta device). Attention stays deliberately narrow (4 heads) because the experts are what we test.
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


def common_kwargs(size: TinySize) -> dict:
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


def expert_groups(num_experts: int, top_k: int) -> tuple[int, int]:
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


def mla_attention() -> dict:
    # Multi-head latent attention dims, small and independent of hidden_size
    return {
        "num_key_value_heads": NUM_ATTENTION_HEADS,
        "kv_lora_rank": 16,
        "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 8,
        "v_head_dim": 16,
    }


def tiny_config_kwargs(builder: Callable[[TinySize], dict], size: TinySize) -> dict:
    """Config kwargs for AutoConfig.for_model(model_type, **kwargs): the keys every tiny config
    has, then the architecture's own (`builder`, its record's `tiny`)."""
    size.validate()
    return {**common_kwargs(size), **builder(size)}
