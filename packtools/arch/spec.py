"""What packtools needs to know about one MoE architecture.

An ArchSpec answers, from a transformers config: which layers have routed experts, how many
experts, top-k and expert width; and, for Hugging Face checkpoints, how routed expert tensors
are named in both forms transformers 5 reads:

- per-expert 2-D tensors, what `save_pretrained` writes
  (`model.layers.3.mlp.experts.7.gate_proj.weight`, mixtral `block_sparse_moe.experts.7.w1.weight`);
- fused 3-D tensors, the runtime parameter names (`model.layers.3.mlp.experts.gate_up_proj`
  [E, 2I, H], `down_proj` [E, H, I]; gpt_oss `gate_up_proj` [E, H, 2I] interleaved, plus biases).

Per-expert tensors may also be block-scaled (`block_scaled`): packed FP4 data plus a companion
tensor of block scales, each copied verbatim into a weight role and its scale role.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from transformers import PretrainedConfig

from packformat.constants import Role
from packtools.sources.base import ExpertLayout


@dataclasses.dataclass(frozen=True)
class FusedPart:
    """A fused 3-D expert tensor [E, *per_expert]: each role is one of `splits` equal,
    contiguous chunks of dim 0 of the per-expert slice (so still a verbatim byte range)."""

    roles: tuple[Role, ...]  # role of chunk 0, 1, ...

    @property
    def splits(self) -> int:
        return len(self.roles)


@dataclasses.dataclass(frozen=True)
class BlockScaledParts:
    """How a checkpoint names per-expert projections stored as packed FP4 plus block scales.

    The data tensor `<part>.<data_suffix>` holds two E2M1 codes per byte (element 2j in the low
    nibble), as int8/uint8 [out, in/2] or float4_e2m1fn_x2 ("F4", [out, in]); the scale tensor
    `<part>.<scale_suffix>` holds one UE8M0 exponent per 32 elements (float8_e8m0fnu or uint8,
    [out, in/32]). DeepSeek-V4: ("weight", "scale"); compressed-tensors mxfp4-pack-quantized
    (Kimi-K3): ("weight_packed", "weight_scale"). int8/uint8 data counts as FP4 only because the
    arch says so here; a float data tensor without a scale tensor stays a plain weight.
    """

    data_suffix: str = "weight"
    scale_suffix: str = "scale"


@dataclasses.dataclass(frozen=True)
class ExpertKey:
    """A checkpoint tensor that holds routed expert weights."""

    layer: int
    expert: int | None  # None: a fused tensor holding every expert of the layer
    part: str  # per-expert projection name ("gate_proj", "w1") or fused name ("gate_up_proj")
    suffix: str = "weight"  # per-expert tensor name ending: "weight", or a BlockScaledParts suffix


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layout: ExpertLayout
    num_experts_attr: str  # config attribute (transformers aliases resolve on the object)
    moe_intermediate_attr: str
    moe_layer_rule: Callable[[PretrainedConfig], list[int]]
    # module names between "layers.N." and ".experts." in checkpoints, the runtime one ("mlp") included
    containers: tuple[str, ...]
    per_expert_parts: dict[str, Role]  # save_pretrained projection name -> role; empty if never per-expert
    fused_parts: dict[str, FusedPart]  # runtime 3-D parameter name -> how it splits into roles
    top_k_attr: str = "num_experts_per_tok"
    notes: str = ""
    block_scaled: BlockScaledParts | None = None  # per-expert parts may come as FP4 + block scales
    # what checkpoint names may start with before "layers.N." (e.g. Kimi-K3's "language_model.model.")
    checkpoint_prefixes: tuple[str, ...] = ("model.", "")

    # ---- config facts ----
    def moe_layers(self, config: PretrainedConfig) -> list[int]:
        return sorted(self.moe_layer_rule(config))

    def num_experts(self, config: PretrainedConfig) -> int:
        return int(getattr(config, self.num_experts_attr))

    def top_k(self, config: PretrainedConfig) -> int:
        return int(getattr(config, self.top_k_attr))

    def moe_intermediate_size(self, config: PretrainedConfig) -> int:
        return int(getattr(config, self.moe_intermediate_attr))

    def role_shapes(self, config: PretrainedConfig) -> dict[Role, tuple[int, ...]]:
        """Logical shape of every role of one expert, last dim contiguous."""
        hidden, inter = int(config.hidden_size), self.moe_intermediate_size(config)
        if self.layout.orientation == "in_out":
            return {
                Role.GATE_UP: (hidden, 2 * inter),
                Role.GATE_UP_BIAS: (2 * inter,),
                Role.DOWN: (inter, hidden),
                Role.DOWN_BIAS: (hidden,),
            }
        return {Role.GATE: (inter, hidden), Role.UP: (inter, hidden), Role.DOWN: (hidden, inter)}

    # ---- checkpoint names ----
    def _container_pattern(self) -> str:
        return "|".join(re.escape(c) for c in self.containers)

    def _prefix_pattern(self) -> str:
        return "|".join(re.escape(p) for p in sorted(self.checkpoint_prefixes, key=len, reverse=True))

    @property
    def per_expert_suffixes(self) -> tuple[str, ...]:
        """Name endings of per-expert tensors: "weight", plus the block-scaled data and scale ones."""
        extra = (self.block_scaled.data_suffix, self.block_scaled.scale_suffix) if self.block_scaled else ()
        return tuple(dict.fromkeys(("weight", *extra)))

    @property
    def per_expert_regex(self) -> re.Pattern[str] | None:
        if not self.per_expert_parts:
            return None
        parts = "|".join(re.escape(p) for p in self.per_expert_parts)
        suffixes = "|".join(re.escape(s) for s in sorted(self.per_expert_suffixes, key=len, reverse=True))
        return re.compile(
            rf"^(?:{self._prefix_pattern()})layers\.(?P<layer>\d+)\.(?:{self._container_pattern()})\.experts\."
            rf"(?P<expert>\d+)\.(?P<part>{parts})\.(?P<suffix>{suffixes})$"
        )

    @property
    def fused_regex(self) -> re.Pattern[str]:
        # longest names first so "gate_up_proj_bias" is not read as "gate_up_proj"
        parts = "|".join(re.escape(p) for p in sorted(self.fused_parts, key=len, reverse=True))
        return re.compile(
            rf"^(?:{self._prefix_pattern()})layers\.(?P<layer>\d+)\.(?:{self._container_pattern()})\.experts\."
            rf"(?P<part>{parts})$"
        )

    def parse_expert_key(self, key: str) -> ExpertKey | None:
        """The routed-expert identity of a checkpoint tensor name, or None for a dense tensor."""
        per_expert = self.per_expert_regex
        if per_expert is not None and (match := per_expert.match(key)):
            return ExpertKey(int(match["layer"]), int(match["expert"]), match["part"], match["suffix"])
        if match := self.fused_regex.match(key):
            return ExpertKey(int(match["layer"]), None, match["part"])
        return None

    def per_expert_key(self, layer: int, expert: int, role: Role, suffix: str = "weight") -> str:
        """The checkpoint name of this role of this expert (save_pretrained's, with "weight")."""
        part = next(name for name, r in self.per_expert_parts.items() if r == role)
        return f"{self.checkpoint_prefixes[0]}layers.{layer}.{self.containers[0]}.experts.{expert}.{part}.{suffix}"

    def fused_key(self, layer: int, part: str) -> str:
        """The runtime (state_dict) name of a fused expert tensor."""
        return f"model.layers.{layer}.mlp.experts.{part}"

    def is_routed_runtime_key(self, key: str) -> bool:
        """Whether a model.state_dict() key is a routed expert parameter."""
        match = self.fused_regex.match(key)
        return match is not None and key.startswith("model.")
