"""The ArchSpec of a model type served through transformers' experts interface, read off its model.

transformers 5 marks the routed experts of most MoE models with `@use_experts_implementation`: one
module per sparse layer holding `gate_up_proj` [E, 2I, H] (or `up_proj` [E, I, H] without a gate)
and `down_proj` [E, H, I], plus flags (has_gate, has_bias, is_transposed, is_concatenated). A
`GenericSpec` answers every ArchSpec question from the model of the config itself, built on the meta
device: which layers are sparse (those holding such a module), how many experts and how wide (its
parameter shapes), so no per-model rule has to be written or kept in step with transformers.
Checkpoint names come from transformers' own conversion mapping (packtools.arch.generic).
"""

from __future__ import annotations

import dataclasses
import re
from collections import OrderedDict

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from packformat.constants import Role
from packtools.arch.errors import UnrunnableConfig
from packtools.arch.spec import ArchSpec, ExpertKey

# the block between the layer and its experts may be absent (gemma4_text: model.layers.N.experts)
_EXPERTS_NAME = re.compile(r"^model\.layers\.(?P<layer>\d+)\.(?:(?P<container>[A-Za-z_][\w.]*)\.)?experts$")
_CACHE_SIZE = 8


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether transformers' @use_experts_implementation decorated this module's class."""
    return all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed")) and hasattr(
        module, "down_proj")


@dataclasses.dataclass(frozen=True)
class ModelExperts:
    """What a meta-device model of one config says about its routed experts."""

    layers: tuple[int, ...]
    container: str  # the runtime module path between "layers.N." and ".experts"
    num_experts: int
    hidden: int
    intermediate: int
    module: torch.nn.Module  # the first layer's experts module (meta)


class ExpertsNotFound(ValueError):
    pass


def model_experts(model: torch.nn.Module) -> ModelExperts:
    """The experts modules of `model`, checked to be one per layer, alike, under one container."""
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        match = _EXPERTS_NAME.match(name)
        if match is None:
            raise ExpertsNotFound(f"an experts module at {name!r}, not at model.layers.<n>[.<block>].experts")
        layer = int(match["layer"])
        if layer in found:
            raise ExpertsNotFound(f"two experts modules in layer {layer}: {found[layer][0]!r} and {name!r}")
        found[layer] = (match["container"] or "", module)
    if not found:
        raise ExpertsNotFound("no module of the model uses transformers' experts interface")
    containers = {container for container, _ in found.values()}
    if len(containers) > 1:
        raise ExpertsNotFound(f"experts modules under several blocks {sorted(containers)}")
    shapes = {tuple(module.down_proj.shape) for _, module in found.values()}
    if len(shapes) > 1:
        raise ExpertsNotFound(f"experts modules of different shapes {sorted(shapes)} (down_proj)")
    first = found[min(found)][1]
    num_experts, rows, cols = first.down_proj.shape
    hidden, intermediate = (cols, rows) if first.is_transposed else (rows, cols)
    return ModelExperts(tuple(sorted(found)), containers.pop(), int(num_experts), int(hidden), int(intermediate),
                        first)


_meta_cache: OrderedDict[str, ModelExperts] = OrderedDict()


def config_experts(config: PretrainedConfig) -> ModelExperts:
    """model_experts of `config`'s model on the meta device (the last few configs' answers kept)."""
    key = f"{config.model_type}\0{config.to_json_string(use_diff=False)}"
    if key in _meta_cache:
        _meta_cache.move_to_end(key)
        return _meta_cache[key]
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers' own error, whatever it is, says what is wrong
        raise UnrunnableConfig(config.model_type, "config", "(as given)",
                               f"transformers cannot build its model: {type(exc).__name__}: {exc}") from exc
    found = model_experts(model)
    _meta_cache[key] = found
    if len(_meta_cache) > _CACHE_SIZE:
        _meta_cache.popitem(last=False)
    return found


def sparse_layers(config: PretrainedConfig) -> list[int]:
    """The layers whose block holds an experts module (GenericSpec's moe_layer_rule)."""
    return list(config_experts(config).layers)


@dataclasses.dataclass(frozen=True)
class GenericSpec(ArchSpec):
    """An ArchSpec whose sizes and sparse layers are read from the config's model, not its keys
    (the *_attr fields name the config keys for messages and for tools that read keys)."""

    # checkpoint name after "layers.N." -> fused runtime part, where transformers renames a whole
    # fused tensor on load (granitemoe: block_sparse_moe.input_linear.weight -> experts.gate_up_proj)
    fused_aliases: dict[str, str] = dataclasses.field(default_factory=dict)

    def moe_layers(self, config: PretrainedConfig) -> list[int]:
        return list(config_experts(config).layers)

    def num_experts(self, config: PretrainedConfig) -> int:
        return config_experts(config).num_experts

    def moe_intermediate_size(self, config: PretrainedConfig) -> int:
        return config_experts(config).intermediate

    def top_k(self, config: PretrainedConfig) -> int:
        return super().top_k(config.get_text_config())  # a composite config's text model routes

    def role_shapes(self, config: PretrainedConfig) -> dict[Role, tuple[int, ...]]:
        shapes = super().role_shapes(config.get_text_config())
        return {role: shape for role, shape in shapes.items() if role in self.layout.roles}

    def parse_expert_key(self, key: str) -> ExpertKey | None:
        found = super().parse_expert_key(key)
        if found is None and self.fused_aliases and (match := self._alias_regex.match(key)):
            return ExpertKey(int(match["layer"]), None, self.fused_aliases[match["alias"]])
        return found

    @property
    def _alias_regex(self) -> re.Pattern[str]:
        aliases = "|".join(re.escape(a) for a in sorted(self.fused_aliases, key=len, reverse=True))
        return re.compile(rf"^(?:{self._prefix_pattern()})layers\.(?P<layer>\d+)\.(?P<alias>{aliases})$")

    def _container_pattern(self) -> str:
        # ArchSpec's patterns put the block between "layers\.N\." and "\.experts": an absent block
        # ("") leaves "layers.N.experts", so the dot before "experts" goes with the block
        named = "|".join(re.escape(c) for c in self.containers if c)
        if "" not in self.containers:
            return named
        return f"(?:{named})" if named else ""

    @property
    def fused_regex(self) -> re.Pattern[str]:
        return re.compile(self._fix_empty_block(super().fused_regex.pattern))

    @property
    def per_expert_regex(self) -> re.Pattern[str] | None:
        pattern = super().per_expert_regex
        return None if pattern is None else re.compile(self._fix_empty_block(pattern.pattern))

    def _fix_empty_block(self, pattern: str) -> str:
        if "" not in self.containers:
            return pattern
        block = self._container_pattern()
        return pattern.replace(rf"\.(?:{block})\.experts\.", rf"\.(?:{block}\.)?experts\." if block else r"\.experts\.")

    def _block(self, container: str) -> str:
        return f"{container}." if container else ""

    def per_expert_key(self, layer: int, expert: int, role: Role, suffix: str = "weight") -> str:
        part = next(name for name, r in self.per_expert_parts.items() if r == role)
        return (f"{self.checkpoint_prefixes[0]}layers.{layer}.{self._block(self.containers[0])}experts.{expert}."
                f"{part}.{suffix}")

    def fused_key(self, layer: int, part: str) -> str:
        return f"model.layers.{layer}.{self._block(self.containers[0])}experts.{part}"
