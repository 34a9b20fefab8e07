"""Where every routed expert role lies in a Hugging Face safetensors checkpoint.

Works on safetensors headers only: the result is, per (layer, expert, role), a file and an
absolute byte range. Per-expert tensors give a whole tensor per role; a fused [E, ...] tensor
gives expert e's slice, and a gate-first [E, 2I, H] gate_up_proj splits into GATE rows [0:I]
and UP rows [I:2I] of that slice, both contiguous, so every role is still a verbatim byte range.
A block-scaled per-expert projection (ArchSpec.block_scaled) gives two ranges: its packed FP4
data as a F4_E2M1X2 weight role and its scale tensor as the matching UE8M0 scale role.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from transformers import PretrainedConfig

from packformat.constants import SCALE_ROLE_OF, SCALED_WEIGHT_TYPES, ElementType, Role, tensor_nbytes
from packformat.scales import scale_group_size
from packtools.arch.errors import InconsistentExperts, MissingExpert, UnexpectedTensor, UnsupportedDtype
from packtools.arch.spec import ArchSpec, ExpertKey
from packtools.safetensors_stream import TensorEntry
from packtools.sources.base import ExpertLayout

ELEMENT_TYPES = {"F32": ElementType.F32, "F16": ElementType.F16, "BF16": ElementType.BF16}
# safetensors dtypes of packed FP4 data -> whether the header shape counts bytes (two codes each)
# rather than FP4 elements ("F4" is torch.float4_e2m1fn_x2, whose safetensors shape is logical)
PACKED_FP4_DTYPES = {"I8": True, "U8": True, "F4": False}
SCALE_DTYPES = frozenset({"F8_E8M0", "U8"})  # torch.float8_e8m0fnu, or its raw bytes
_FP4_RULE = SCALED_WEIGHT_TYPES[ElementType.F4_E2M1X2]


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
        self._role_order: tuple[Role, ...] | None = None  # object roles, the same in every layer
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

    @property
    def layout(self) -> ExpertLayout:
        """The spec's layout, with the scale roles of block-scaled projections after its weights."""
        return dataclasses.replace(self.spec.layout, roles=self._role_order or self.spec.layout.roles)

    def roles(self, layer: int, expert: int) -> list[RoleRange]:
        try:
            return self._ranges[(layer, expert)]
        except KeyError:
            raise KeyError(f"no routed expert ({layer}, {expert}); MoE layers {self.layers}, "
                           f"{self.num_experts} experts") from None

    # ---- building ----
    def _index_layer(self, layer: int, found: dict[str, tuple[ExpertKey, LocatedTensor]]) -> None:
        fused = {key.part: (name, loc) for name, (key, loc) in found.items() if key.expert is None}
        per_expert = {(key.expert, key.part, key.suffix): (name, loc) for name, (key, loc) in found.items()
                      if key.expert is not None}
        if fused and per_expert:
            raise InconsistentExperts(layer, None, f"mixes fused {sorted(fused)} and per-expert tensors")
        if fused:
            self.forms[layer] = "fused"
            self._index_fused(layer, fused)
        else:
            self.forms[layer] = "per_expert"
            self._index_per_expert(layer, per_expert)
        base = self.spec.layout.roles
        first = {r.role for r in self._ranges[(layer, 0)]}
        roles = (*base, *(SCALE_ROLE_OF[r] for r in base if r in SCALE_ROLE_OF and SCALE_ROLE_OF[r] in first))
        if self._role_order is None:
            self._role_order = roles
        elif roles != self._role_order:
            raise InconsistentExperts(layer, None, f"roles {[r.name for r in roles]} differ from the first MoE "
                                      f"layer's {[r.name for r in self._role_order]}")
        for expert in range(self.num_experts):
            ranges = {r.role: r for r in self._ranges[(layer, expert)]}
            if set(ranges) != set(roles):
                raise InconsistentExperts(layer, expert, f"roles {sorted(r.name for r in ranges)} differ from "
                                          f"expert 0's {sorted(r.name for r in roles)}")
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

    def _index_per_expert(self, layer: int, found: dict[tuple[int, str, str], tuple[str, LocatedTensor]]) -> None:
        for expert, _, _ in found:
            if expert >= self.num_experts:
                raise InconsistentExperts(layer, expert, f"expert id beyond num_experts={self.num_experts}")
        for expert in range(self.num_experts):
            ranges = []
            for part, role in self.spec.per_expert_parts.items():
                ranges += self._per_expert_role(layer, expert, part, role, found)
            self._ranges[(layer, expert)] = ranges

    def _per_expert_role(self, layer: int, expert: int, part: str, role: Role,
                         found: dict[tuple[int, str, str], tuple[str, LocatedTensor]]) -> list[RoleRange]:
        """The role's range, or its F4_E2M1X2 data and UE8M0 scale ranges when block-scaled."""
        scaled = self.spec.block_scaled
        plain = found.get((expert, part, "weight"))
        data = found.get((expert, part, scaled.data_suffix)) if scaled else None
        scale = found.get((expert, part, scaled.scale_suffix)) if scaled else None
        if data is not None and (data is not plain or data[1].entry.dtype in PACKED_FP4_DTYPES):
            if plain is not None and plain is not data:
                raise InconsistentExperts(layer, expert, f"{role.name} has both {plain[0]!r} and {data[0]!r}")
            if scale is None:
                wanted = self.spec.per_expert_key(layer, expert, role, scaled.scale_suffix)
                raise MissingExpert(layer, expert, f"{role.name} block scales ({wanted}) for {data[0]!r}")
            return self._block_scaled_ranges(layer, expert, role, data, scale)
        if scale is not None:
            raise InconsistentExperts(layer, expert, f"{scale[0]!r} scales {role.name}, whose data is "
                                      + (f"{plain[0]!r} of dtype {plain[1].entry.dtype}, not packed FP4"
                                         if plain else "missing"))
        if plain is None:
            raise MissingExpert(layer, expert, f"{role.name} ({self.spec.per_expert_key(layer, expert, role)})")
        name, loc = plain
        self._check_shape(layer, expert, role, loc.entry.shape, name)
        return [RoleRange(role, self._element_type(name, loc), loc.entry.shape, loc.file,
                          loc.data_start + loc.entry.begin, loc.entry.nbytes, name)]

    def _block_scaled_ranges(self, layer: int, expert: int, role: Role, data: tuple[str, LocatedTensor],
                             scale: tuple[str, LocatedTensor]) -> list[RoleRange]:
        (data_name, data_loc), (scale_name, scale_loc) = data, scale
        data_entry, scale_entry = data_loc.entry, scale_loc.entry
        counts_bytes = PACKED_FP4_DTYPES.get(data_entry.dtype)
        if counts_bytes is None:
            raise UnsupportedDtype(f"block-scaled expert tensor {data_name!r} is {data_entry.dtype}; packed FP4 "
                                   f"data must be one of {sorted(PACKED_FP4_DTYPES)}")
        if scale_entry.dtype not in SCALE_DTYPES:
            raise UnsupportedDtype(f"block scales {scale_name!r} are {scale_entry.dtype}; UE8M0 scales must be "
                                   f"one of {sorted(SCALE_DTYPES)}")
        shape = tuple(data_entry.shape)
        if counts_bytes and shape:
            shape = (*shape[:-1], 2 * shape[-1])  # [out, in/2] bytes -> [out, in] FP4 elements
        self._check_shape(layer, expert, role, shape, data_name)
        scale_shape = tuple(scale_entry.shape)
        if scale_group_size(shape, scale_shape) not in _FP4_RULE.group_sizes:
            raise InconsistentExperts(layer, expert, f"scales {scale_name!r} of shape {scale_shape} do not scale "
                                      f"{role.name} {shape} in groups of {sorted(_FP4_RULE.group_sizes)}")
        ranges = [
            RoleRange(role, ElementType.F4_E2M1X2, shape, data_loc.file, data_loc.data_start + data_entry.begin,
                      data_entry.nbytes, data_name),
            RoleRange(SCALE_ROLE_OF[role], _FP4_RULE.scale_type, scale_shape, scale_loc.file,
                      scale_loc.data_start + scale_entry.begin, scale_entry.nbytes, scale_name),
        ]
        for rng in ranges:
            if rng.nbytes != tensor_nbytes(rng.element_type, rng.shape):
                raise InconsistentExperts(layer, expert, f"{rng.tensor!r} spans {rng.nbytes} bytes; "
                                          f"{rng.element_type.name} {rng.shape} needs "
                                          f"{tensor_nbytes(rng.element_type, rng.shape)}")
        return ranges

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
