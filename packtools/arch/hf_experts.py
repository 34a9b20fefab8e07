"""Where every routed expert role lies in a Hugging Face safetensors checkpoint.

Works on safetensors headers only: the result is, per (layer, expert, role), a file and an
absolute byte range. Per-expert tensors give a whole tensor per role; a fused [E, ...] tensor
gives expert e's slice, and a gate-first [E, 2I, H] gate_up_proj splits into GATE rows [0:I]
and UP rows [I:2I] of that slice, both contiguous, so every role is still a verbatim byte range.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import PretrainedConfig

from packtools.arch.errors import InconsistentExperts, MissingExpert, UnexpectedTensor, UnsupportedDtype
from packtools.arch.spec import ArchSpec, ExpertKey
from packtools.pack.constants import ElementType, Role
from packtools.safetensors_stream import TensorEntry

ELEMENT_TYPES = {"F32": ElementType.F32, "F16": ElementType.F16, "BF16": ElementType.BF16}


@dataclasses.dataclass(frozen=True)
class LocatedTensor:
    file: Path
    data_start: int  # absolute offset of the file's data section
    entry: TensorEntry


@dataclasses.dataclass(frozen=True)
class RoleRange:
    role: Role
    element_type: ElementType
    shape: tuple[int, ...]
    file: Path
    offset: int  # absolute byte offset in `file`
    nbytes: int
    tensor: str  # checkpoint tensor it comes from


class ExpertIndex:
    """Role byte ranges of every (layer, expert), validated against the config."""

    def __init__(self, spec: ArchSpec, config: PretrainedConfig, tensors: dict[str, LocatedTensor]):
        self.spec = spec
        self.layers = spec.moe_layers(config)
        self.num_experts = spec.num_experts(config)
        self._shapes = spec.role_shapes(config)
        self.forms: dict[int, str] = {}  # layer -> "per_expert" | "fused"
        self._ranges: dict[tuple[int, int], list[RoleRange]] = {}
        per_layer: dict[int, dict[str, tuple[ExpertKey, LocatedTensor]]] = {}
        for name, located in tensors.items():
            key = spec.parse_expert_key(name)
            if key is not None:
                per_layer.setdefault(key.layer, {})[name] = (key, located)
        for layer in sorted(set(per_layer) - set(self.layers)):
            name = next(iter(per_layer[layer]))
            raise UnexpectedTensor(
                f"routed expert tensor {name!r} is in layer {layer}, which has no routed experts "
                f"(MoE layers per config: {self.layers})"
            )
        for layer in self.layers:
            if layer not in per_layer:
                raise MissingExpert(layer, None, "every routed expert tensor")
            self._index_layer(layer, per_layer[layer])
        self.expert_tensor_names = {name for found in per_layer.values() for name in found}

    def roles(self, layer: int, expert: int) -> list[RoleRange]:
        try:
            return self._ranges[(layer, expert)]
        except KeyError:
            raise KeyError(f"no routed expert ({layer}, {expert}); MoE layers {self.layers}, "
                           f"{self.num_experts} experts") from None

    # ---- building ----
    def _index_layer(self, layer: int, found: dict[str, tuple[ExpertKey, LocatedTensor]]) -> None:
        fused = {key.part: (name, loc) for name, (key, loc) in found.items() if key.expert is None}
        per_expert = {(key.expert, key.part): (name, loc) for name, (key, loc) in found.items()
                      if key.expert is not None}
        if fused and per_expert:
            raise InconsistentExperts(layer, None, f"mixes fused {sorted(fused)} and per-expert tensors")
        if fused:
            self.forms[layer] = "fused"
            self._index_fused(layer, fused)
        else:
            self.forms[layer] = "per_expert"
            self._index_per_expert(layer, per_expert)
        roles = self.spec.layout.roles
        for expert in range(self.num_experts):
            ranges = {r.role: r for r in self._ranges[(layer, expert)]}
            self._ranges[(layer, expert)] = [ranges[role] for role in roles]
            reference = self._ranges[(layer, 0)]
            for got, ref in zip(self._ranges[(layer, expert)], reference):
                if got.element_type != ref.element_type:
                    raise InconsistentExperts(layer, expert, f"{got.role.name} is {got.element_type.name}, "
                                              f"expert 0 has {ref.element_type.name}")

    def _element_type(self, name: str, located: LocatedTensor) -> ElementType:
        try:
            return ELEMENT_TYPES[located.entry.dtype]
        except KeyError:
            raise UnsupportedDtype(
                f"routed expert tensor {name!r} is {located.entry.dtype}; supported: {sorted(ELEMENT_TYPES)}"
            ) from None

    def _check_shape(self, layer: int, expert: int | None, role: Role, shape: tuple, name: str) -> None:
        expected = self._shapes[role]
        if tuple(shape) != expected:
            raise InconsistentExperts(
                layer, expert, f"{role.name} from {name!r} has shape {tuple(shape)}, config implies {expected}"
            )

    def _index_per_expert(self, layer: int, found: dict[tuple[int, str], tuple[str, LocatedTensor]]) -> None:
        parts = self.spec.per_expert_parts
        for expert, part in found:
            if expert >= self.num_experts:
                raise InconsistentExperts(layer, expert, f"expert id beyond num_experts={self.num_experts}")
        for expert in range(self.num_experts):
            ranges = []
            for part, role in parts.items():
                if (expert, part) not in found:
                    raise MissingExpert(layer, expert, f"{role.name} ({self.spec.per_expert_key(layer, expert, role)})")
                name, loc = found[(expert, part)]
                self._check_shape(layer, expert, role, loc.entry.shape, name)
                ranges.append(RoleRange(role, self._element_type(name, loc), loc.entry.shape, loc.file,
                                        loc.data_start + loc.entry.begin, loc.entry.nbytes, name))
            self._ranges[(layer, expert)] = ranges

    def _index_fused(self, layer: int, found: dict[str, tuple[str, LocatedTensor]]) -> None:
        for part in self.spec.fused_parts:
            if part not in found:
                raise MissingExpert(layer, None, f"fused tensor {self.spec.fused_key(layer, part)}")
        for expert in range(self.num_experts):
            self._ranges[(layer, expert)] = []
        for part, fused in self.spec.fused_parts.items():
            name, loc = found[part]
            shape = loc.entry.shape
            if not shape or shape[0] != self.num_experts:
                raise InconsistentExperts(
                    layer, None, f"fused {name!r} has shape {shape}, expected {self.num_experts} experts in dim 0"
                )
            if shape[1] % fused.splits:
                raise InconsistentExperts(layer, None,
                                          f"fused {name!r} dim 1 of {shape} does not split in {fused.splits}")
            role_shape = (shape[1] // fused.splits, *shape[2:])
            element_type = self._element_type(name, loc)
            expert_nbytes = loc.entry.nbytes // self.num_experts  # bytes of one [*, ...] expert slice
            role_nbytes = expert_nbytes // fused.splits  # a contiguous run of rows of that slice
            for role in fused.roles:
                self._check_shape(layer, None, role, role_shape, name)
            for expert in range(self.num_experts):
                for chunk, role in enumerate(fused.roles):
                    offset = loc.data_start + loc.entry.begin + expert * expert_nbytes + chunk * role_nbytes
                    self._ranges[(layer, expert)].append(
                        RoleRange(role, element_type, role_shape, loc.file, offset, role_nbytes, name)
                    )
