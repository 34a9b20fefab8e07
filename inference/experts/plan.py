"""How one layer's expert objects become the weights its transformers experts module computes with.

A `LayerPlan` is made once at load time from the layer's role entries, the bundle's orientation
and gate/up layout, and the experts module (its flags and its meta-device parameter shapes), and
is checked against all of them there. Each forward it gathers the acquired objects' role bytes
into one batch per weight and dequantizes each weight for all experts at once.

Weights are kept in the pack's orientation and the matmul follows it (`F.linear` for out_in,
`x @ W` for in_out, as transformers' eager forwards do), so nothing is transposed per forward.
Split gate/up roles of the same type in out_in orientation are concatenated byte-wise into the
fused [2I, H] matrix transformers uses: GGML blocks never cross a row, so the bytes of gate rows
followed by up rows are exactly the bytes of the concatenated matrix. A block-scaled weight
(F4_E2M1X2 with its UE8M0 scale role) travels with its scales: their rows are concatenated the
same way, so row r of the fused scales still scales row r of the fused weight.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from inference.experts.errors import ExpertLayoutError
from inference.experts.role_dequant import dequantize_roles, dequantize_scaled_roles
from packformat import RoleEntry
from packformat.constants import SCALE_ROLES, WEIGHT_ROLE_OF, Role
from packformat.scales import ScalePairError, check_scale_pairs

ORIENTATIONS = ("out_in", "in_out")
Which = int | torch.Tensor | None  # an expert, one row per expert, or grouped rows (cumulative counts)
GATE_UP_LAYOUTS = ("concat", "interleaved")


@dataclasses.dataclass(frozen=True)
class WeightGroup:
    """One weight of the computation: the roles whose bytes, concatenated, form it."""

    name: str
    roles: tuple[RoleEntry, ...]
    shape: tuple[int, ...]  # per-expert logical shape of the concatenation
    scales: tuple[RoleEntry | None, ...] = ()  # block-scale role of each of `roles` (None: unscaled)

    def __post_init__(self) -> None:
        if not self.scales:
            object.__setattr__(self, "scales", (None,) * len(self.roles))
        assert len(self.scales) == len(self.roles), (self.name, len(self.scales), len(self.roles))

    @property
    def scaled(self) -> bool:
        return self.scales[0] is not None

    @property
    def scale_shape(self) -> tuple[int, ...]:
        """Per-expert shape of the concatenated scales (rows follow the weight's rows)."""
        first = self.scales[0]
        assert first is not None, self.name
        return (sum(s.shape[0] for s in self.scales), *first.shape[1:])

    @property
    def byte_concatenable(self) -> bool:
        if len({r.element_type for r in self.roles}) != 1:
            return False
        if all(s is None for s in self.scales):
            return True
        # every role scaled alike: same scale type and the same group along the row
        return None not in self.scales and len({(s.element_type, s.shape[1:]) for s in self.scales}) == 1


@dataclasses.dataclass(frozen=True)
class Projection:
    """x -> x·Wᵀ (+ b) for out_in weights, x·W (+ b) for in_out ones."""

    weight: WeightGroup
    bias: WeightGroup | None


@dataclasses.dataclass(frozen=True)
class ModuleShape:
    """What the transformers experts module expects, read from its (meta) parameters and flags."""

    num_experts: int
    hidden: int
    intermediate: int
    has_gate: bool
    has_bias: bool
    gate_up_layout: str  # "concat" or "interleaved": what the module's _apply_gate reads
    dtype: torch.dtype

    @classmethod
    def of(cls, module: torch.nn.Module) -> ModuleShape:
        down = module.down_proj  # [E, H, I], or [E, I, H] when transposed
        num_experts, rows, cols = down.shape
        hidden, intermediate = (cols, rows) if module.is_transposed else (rows, cols)
        return cls(num_experts, hidden, intermediate, bool(module.has_gate), bool(module.has_bias),
                   "concat" if getattr(module, "is_concatenated", True) else "interleaved", down.dtype)


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    layer: int
    orientation: str
    # Up side: one projection whose output is already gate_up (fused), or gate and up apart.
    fused_up: Projection | None
    fused_output_layout: str  # layout of fused_up's output columns
    gate: Projection | None
    up: Projection | None
    down: Projection
    target: ModuleShape

    @property
    def groups(self) -> list[WeightGroup]:
        found = []
        for projection in (self.fused_up, self.gate, self.up, self.down):
            if projection is not None:
                found += [g for g in (projection.weight, projection.bias) if g is not None]
        return found

    def materialize(self, objects: Sequence[torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every weight of the plan for these experts: name -> [n, *shape] in the module's dtype."""
        return {group.name: _dequantize_group(group, lambda entries: _gather(objects, entries), self.target.dtype)
                for group in self.groups}

    def materialize_rows(self, rows: torch.Tensor) -> dict[str, torch.Tensor]:
        """Like materialize, for objects that are the rows of one uint8 [n, >= object bytes] tensor
        (e.g. arena slots picked with index_select): no per-object Python work, so it can run
        inside a captured CUDA graph."""
        return {group.name: _dequantize_group(group, lambda entries: _gather_rows(rows, entries), self.target.dtype)
                for group in self.groups}

    def materialize_group_rows(self, group: WeightGroup, rows: torch.Tensor) -> torch.Tensor:
        """One weight of materialize_rows: [n, *group.shape] in the module's dtype."""
        return _dequantize_group(group, lambda entries: _gather_rows(rows, entries), self.target.dtype)

    def up_output(self, x: torch.Tensor, weights: dict[str, torch.Tensor], i: Which) -> torch.Tensor:
        """The up side: [T, 2I] gate_up in the module's layout (or [T, I] without a gate).

        i: the expert (x holds its tokens); None for one row per expert (x is [n, H]); or a
        tensor of cumulative row counts (x holds every expert's rows, grouped, in order).
        """
        if self.fused_up is not None:
            out = self._project(self.fused_up, x, weights, i)
            return _relayout(out, self.fused_output_layout, self.target.gate_up_layout)
        up = self._project(self.up, x, weights, i)
        if self.gate is None:
            return up
        gate = self._project(self.gate, x, weights, i)
        if self.target.gate_up_layout == "concat":
            return torch.cat([gate, up], dim=-1)
        return torch.stack([gate, up], dim=-1).flatten(-2)  # [T, I, 2] -> gate0, up0, gate1, ...

    def down_output(self, h: torch.Tensor, weights: dict[str, torch.Tensor], i: Which) -> torch.Tensor:
        return self._project(self.down, h, weights, i)

    def _project(self, projection: Projection, x: torch.Tensor, weights: dict[str, torch.Tensor],
                 i: Which) -> torch.Tensor:
        weight = weights[projection.weight.name]  # [n, out, in] (out_in) or [n, in, out] (in_out)
        bias = weights[projection.bias.name] if projection.bias is not None else None  # [n, out]
        if isinstance(i, torch.Tensor):  # grouped rows: one GEMM over every expert's rows
            in_out = weight if self.orientation == "in_out" else weight.transpose(-2, -1)  # [n, in, out]
            out = grouped_mm(x, in_out, i)
            if bias is not None:
                counts = torch.diff(i, prepend=i.new_zeros(1))  # [n] rows per expert
                out = out + torch.repeat_interleave(bias, counts, dim=0, output_size=x.shape[0])
            return out
        if i is not None:  # eager's op: one expert, its tokens
            out = F.linear(x, weight[i]) if self.orientation == "out_in" else x @ weight[i]
        elif self.orientation == "out_in":  # row e of x through expert e, all in one bmm
            out = torch.bmm(weight, x.unsqueeze(-1)).squeeze(-1)  # [n, out]
        else:
            out = torch.bmm(x.unsqueeze(1), weight).squeeze(1)  # [n, out]
        if bias is not None:
            out = out + (bias[i] if i is not None else bias)
        return out


def grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """[S, out]: rows offsets[g-1]:offsets[g] of x [S, in] times weight[g] [in, out]; one grouped
    GEMM where torch has one for these operands (bfloat16 on CUDA), else one matmul per group."""
    if x.is_cuda and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        grouped = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
        if grouped is not None:
            return grouped(x, weight, offs=offsets.to(torch.int32))
    out = x.new_empty((x.shape[0], weight.shape[-1]))
    start = 0
    for group, end in enumerate(offsets.tolist()):  # host sync: only off the fast path
        out[start:end] = x[start:end] @ weight[group]
        start = end
    return out


def _relayout(gate_up: torch.Tensor, have: str, want: str) -> torch.Tensor:
    """Reorder [T, 2I] gate_up columns between concat and interleaved (activations, not weights)."""
    if have == want:
        return gate_up
    tokens, width = gate_up.shape
    if have == "concat":  # [g..., u...] -> [g0, u0, g1, u1, ...]
        return gate_up.view(tokens, 2, width // 2).transpose(1, 2).reshape(tokens, width)
    return gate_up.view(tokens, width // 2, 2).transpose(1, 2).reshape(tokens, width)


def _gather(objects: Sequence[torch.Tensor], entries: Sequence[RoleEntry]) -> torch.Tensor:
    """uint8 [n, sum of nbytes]: each object's bytes of `entries`, concatenated in order."""
    pieces = [obj[e.offset : e.offset + e.nbytes] for obj in objects for e in entries]
    return torch.cat(pieces).view(len(objects), -1)


def _gather_rows(rows: torch.Tensor, entries: Sequence[RoleEntry]) -> torch.Tensor:
    """uint8 [n, sum of nbytes]: each row's bytes of `entries`, concatenated in order."""
    if len(entries) == 1:
        return rows[:, entries[0].offset : entries[0].offset + entries[0].nbytes]  # a strided view
    return torch.cat([rows[:, e.offset : e.offset + e.nbytes] for e in entries], dim=1)


Gather = Callable[[Sequence[RoleEntry]], torch.Tensor]  # role entries -> uint8 [n, their bytes]


def _dequantize_group(group: WeightGroup, gather: Gather, dtype: torch.dtype) -> torch.Tensor:
    if group.byte_concatenable:
        raw = gather(group.roles)  # uint8 [n, group bytes]
        if not group.scaled:
            return dequantize_roles(raw, group.roles[0].element_type, group.shape, dtype)
        scales = gather(group.scales)  # uint8 [n, group scale bytes], rows as the weight's
        return dequantize_scaled_roles(raw, scales, group.roles[0].element_type, group.shape,
                                       group.scales[0].element_type, group.scale_shape, dtype)
    parts = []
    for role, scale in zip(group.roles, group.scales):  # mixed: dequantize each role, concatenate values
        raw = gather((role,))  # uint8 [n, nbytes]
        if scale is None:
            parts.append(dequantize_roles(raw, role.element_type, role.shape, dtype))
        else:
            parts.append(dequantize_scaled_roles(raw, gather((scale,)), role.element_type, role.shape,
                                                 scale.element_type, scale.shape, dtype))
    return torch.cat(parts, dim=1)


def build_layer_plan(layer: int, roles: Sequence[RoleEntry], orientation: str, gate_up_layout: str,
                     module: torch.nn.Module) -> LayerPlan:
    """Check `roles` against the experts module and decide how each forward computes with them."""
    if orientation not in ORIENTATIONS:
        raise ExpertLayoutError(layer, f"unknown orientation {orientation!r} (expected one of {ORIENTATIONS})")
    if gate_up_layout not in GATE_UP_LAYOUTS:
        raise ExpertLayoutError(layer, f"unknown gate_up layout {gate_up_layout!r} (expected one of {GATE_UP_LAYOUTS})")
    target = ModuleShape.of(module)
    by_role: dict[Role, RoleEntry] = {}
    for entry in roles:
        role = Role(entry.role)
        if role in by_role:
            raise ExpertLayoutError(layer, f"role {role.name} appears twice")
        by_role[role] = entry
    try:
        check_scale_pairs((e.role, e.element_type, tuple(e.shape)) for e in by_role.values())
    except ScalePairError as exc:
        raise ExpertLayoutError(layer, str(exc)) from None
    scale_of = {WEIGHT_ROLE_OF[r]: by_role.pop(r) for r in list(by_role) if r in SCALE_ROLES}
    _check_role_set(layer, set(by_role), target)
    _check_shapes(layer, by_role, orientation, target)

    def group(name: str, *members: Role) -> WeightGroup:
        entries = tuple(by_role[m] for m in members)
        first = entries[0].shape
        return WeightGroup(name, entries, (sum(e.shape[0] for e in entries), *first[1:]),
                           tuple(scale_of.get(m) for m in members))

    def bias(name: str, *members: Role) -> WeightGroup | None:
        return group(name, *members) if target.has_bias else None

    down = Projection(group("down", Role.DOWN), bias("down_bias", Role.DOWN_BIAS))
    fused_up = gate = up = None
    fused_layout = target.gate_up_layout
    if Role.GATE_UP in by_role:
        fused_up = Projection(group("gate_up", Role.GATE_UP), bias("gate_up_bias", Role.GATE_UP_BIAS))
        fused_layout = gate_up_layout
    elif target.has_gate and orientation == "out_in" and group("gate_up", Role.GATE, Role.UP).byte_concatenable:
        # rows of gate then rows of up: the concat layout, whatever the module wants (relayout after)
        fused_up = Projection(group("gate_up", Role.GATE, Role.UP), bias("gate_up_bias", Role.GATE_BIAS, Role.UP_BIAS))
        fused_layout = "concat"
    else:
        up = Projection(group("up", Role.UP), bias("up_bias", Role.UP_BIAS))
        if target.has_gate:
            gate = Projection(group("gate", Role.GATE), bias("gate_bias", Role.GATE_BIAS))
    return LayerPlan(layer, orientation, fused_up, fused_layout, gate, up, down, target)


def _check_role_set(layer: int, present: set[Role], target: ModuleShape) -> None:
    if target.has_gate:
        options = [{Role.GATE_UP}, {Role.GATE, Role.UP}]
        bias_options = [{Role.GATE_UP_BIAS}, {Role.GATE_BIAS, Role.UP_BIAS}]
    else:
        options, bias_options = [{Role.UP}], [{Role.UP_BIAS}]
    allowed = []
    for i, weights in enumerate(options):
        biases = bias_options[i] | {Role.DOWN_BIAS} if target.has_bias else set()
        allowed.append(weights | {Role.DOWN} | biases)
    if present not in allowed:
        names = sorted(r.name for r in present)
        wanted = " or ".join(str(sorted(r.name for r in a)) for a in allowed)
        raise ExpertLayoutError(layer, f"roles {names} do not fit the experts module "
                                f"(has_gate={target.has_gate}, has_bias={target.has_bias}); expected {wanted}")


def _check_shapes(layer: int, by_role: dict[Role, RoleEntry], orientation: str, target: ModuleShape) -> None:
    hidden, inter = target.hidden, target.intermediate

    def matrix(out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, in_features) if orientation == "out_in" else (in_features, out_features)

    expected = {
        Role.GATE: matrix(inter, hidden), Role.UP: matrix(inter, hidden), Role.DOWN: matrix(hidden, inter),
        Role.GATE_UP: matrix(2 * inter, hidden), Role.GATE_BIAS: (inter,), Role.UP_BIAS: (inter,),
        Role.DOWN_BIAS: (hidden,), Role.GATE_UP_BIAS: (2 * inter,),
    }
    for role, entry in by_role.items():
        if tuple(entry.shape) != expected[role]:
            raise ExpertLayoutError(layer, f"role {role.name} has shape {tuple(entry.shape)}; the model "
                                    f"(hidden {hidden}, expert intermediate {inter}, {orientation}) needs "
                                    f"{expected[role]}")
