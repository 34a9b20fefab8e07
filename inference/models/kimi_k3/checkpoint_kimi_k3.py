"""How the official Kimi-K3 checkpoint names and lays out what KimiK3ForCausalLM holds.

The official repository is multimodal (KimiK3ForConditionalGeneration): text weights are stored as
`language_model.<name>`, next to `vision_tower.*` and `mm_projector.*` (ignored here), and
config.json keeps the text model in `text_config`. Runtime (state_dict) names are the checkpoint
names without `language_model.`, except the MoE layers: `block_sparse_moe` is `mlp` at run time (so
routed experts sit at `model.layers.N.mlp.experts`, where packtools and transformers' experts
integrations look for them), and per-expert `experts.E.w1/w3/w2.weight` become the fused
`experts.gate_up_proj` [E, 2I, D] (w1 rows first) and `experts.down_proj` [E, D, I].
Dense layers keep `mlp.gate_proj/up_proj/down_proj` in both forms.

These are transformers WeightRenaming/WeightConverter rules, registered for model_type "kimi_k3":
from_pretrained applies them, save_pretrained applies their reverse (so it writes official names),
and packtools' HF reader runs the same rules (packtools.arch.hf_names).
"""

from __future__ import annotations

from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter, WeightRenaming

from inference.models.kimi_k3.configuration_kimi_k3 import KimiK3Config

CHECKPOINT_PREFIX = "language_model."
# module names under block_sparse_moe in the checkpoint; `mlp.gate_proj` of dense layers is not one
MOE_BLOCK_PARTS = ("gate", "experts", "shared_experts", "routed_expert_down_proj", "routed_expert_up_proj",
                   "routed_expert_norm")


def checkpoint_conversion_mapping() -> list[WeightRenaming | WeightConverter]:
    parts = "|".join(MOE_BLOCK_PARTS)
    return [
        WeightRenaming(source_patterns=r"^language_model\.", target_patterns=""),
        WeightRenaming(source_patterns=rf"\.block_sparse_moe\.({parts})\.", target_patterns=r"\.mlp\.\1\."),
        WeightConverter(
            source_patterns=[r"\.experts.*.w1.weight", r"\.experts.*.w3.weight"],
            target_patterns=r"\.experts.gate_up_proj",
            operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
        ),
        WeightConverter(
            source_patterns=r"\.experts.*.w2.weight",
            target_patterns=r"\.experts.down_proj",
            operations=[MergeModulelist(dim=0)],
        ),
    ]


def official_config_dict(config: KimiK3Config) -> dict:
    """config.json as the official repository lays it out: the multimodal wrapper with the text
    model in text_config (what llama.cpp's converter and Moonshot's code read)."""
    text = config.to_dict()
    for derived in ("model_type", "architectures", "transformers_version", "qk_head_dim", "head_dim",
                    "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim", "kda_gate_lower_bound",
                    "layer_types", "mlp_layer_types"):
        text.pop(derived, None)
    text["model_type"] = "kimi_linear"
    text["architectures"] = ["KimiLinearForCausalLM"]
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "vocab_size": config.vocab_size,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": config.eos_token_id,
        "pad_token_id": config.pad_token_id,
        "tie_word_embeddings": config.tie_word_embeddings,
        "text_config": text,
    }
