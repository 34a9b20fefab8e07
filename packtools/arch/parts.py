"""ArchSpec pieces several architectures share: expert layouts, checkpoint part names, the rules
that say which layers have routed experts."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PretrainedConfig

from packtools.arch.spec import ArchSpec, FusedPart
from packformat.constants import Role
from packtools.sources.base import ExpertLayout


def every_layer(config: PretrainedConfig) -> list[int]:
    return list(range(config.num_hidden_layers))


def after_first_k_dense(config: PretrainedConfig) -> list[int]:
    # mirrors DeepseekV2/V3DecoderLayer.__init__
    return list(range(config.first_k_dense_replace or 0, config.num_hidden_layers))


SWIGLU_LAYOUT = ExpertLayout(roles=(Role.GATE, Role.UP, Role.DOWN), orientation="out_in", gate_up="concat")

NAMED_PROJ = {"gate_proj": Role.GATE, "up_proj": Role.UP, "down_proj": Role.DOWN}
# mixtral-style checkpoints: w1 = gate, w3 = up, w2 = down
W_PROJ = {"w1": Role.GATE, "w3": Role.UP, "w2": Role.DOWN}
# transformers 5 runtime: gate_up_proj [E, 2I, H], gate rows first; down_proj [E, H, I]
SWIGLU_FUSED = {"gate_up_proj": FusedPart((Role.GATE, Role.UP)), "down_proj": FusedPart((Role.DOWN,))}


def swiglu_spec(model_type: str, num_experts_attr: str, inter_attr: str,
                rule: Callable[[PretrainedConfig], list[int]], containers: tuple[str, ...],
                per_expert: dict[str, Role], notes: str = "") -> ArchSpec:
    """The spec of an architecture whose experts are transformers' usual SwiGLU experts."""
    return ArchSpec(
        model_type=model_type,
        layout=SWIGLU_LAYOUT,
        num_experts_attr=num_experts_attr,
        moe_intermediate_attr=inter_attr,
        moe_layer_rule=rule,
        containers=containers,
        per_expert_parts=per_expert,
        fused_parts=SWIGLU_FUSED,
        notes=notes,
    )
