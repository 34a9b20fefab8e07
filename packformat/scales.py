"""Object-level rules of format 1.1: a scaled weight role and its block-scale role come in pairs.

A weight role of a type in SCALED_WEIGHT_TYPES (F4_E2M1X2) is meaningless without the scales of
its blocks, so an object that holds one must hold the matching scale role (GATE -> GATE_SCALE,
...), and a scale role must sit next to such a weight, with the weight's shape divided by one
group size along the last dimension. The writer and the reader share these checks.
"""

from __future__ import annotations

from collections.abc import Iterable

from packformat import constants as C


class ScalePairError(ValueError):
    """A scale role and its weight role do not fit together; names the roles."""


def _name(role: int) -> str:
    try:
        return C.Role(role).name.lower()
    except ValueError:
        return f"role id {role}"


def scale_group_size(weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> int | None:
    """Weight elements per scale along the last dim, or None when the shapes do not pair."""
    if len(weight_shape) != len(scale_shape) or weight_shape[:-1] != scale_shape[:-1]:
        return None
    if scale_shape[-1] <= 0 or weight_shape[-1] % scale_shape[-1]:
        return None
    return weight_shape[-1] // scale_shape[-1]


def check_scale_pairs(roles: Iterable[tuple[int, int, tuple[int, ...]]]) -> None:
    """Raise ScalePairError unless every scaled weight has its scale role and vice versa.

    roles: (role id, element type id, logical shape) of one object, in any order; role ids and
    type ids are already known to be valid.
    """
    by_role = {}
    for role, etype, shape in roles:
        by_role.setdefault(int(role), (int(etype), tuple(shape)))
    for role, (etype, shape) in by_role.items():
        if role in C.SCALE_ROLES:
            _check_scale_role(by_role, role, etype, shape)
        elif etype in C.SCALE_TYPES:
            raise ScalePairError(f"{_name(role)}: {C.ElementType(etype).name} is a scale type; "
                                 f"it may only be held by a scale role")
        elif etype in C.SCALED_WEIGHT_TYPES:
            scale_role = C.SCALE_ROLE_OF.get(C.Role(role))
            if scale_role is None:
                raise ScalePairError(f"{_name(role)}: {C.ElementType(etype).name} needs block scales, "
                                     f"and this role has no scale role")
            if scale_role not in by_role:
                raise ScalePairError(f"{_name(role)}: {C.ElementType(etype).name} needs its "
                                     f"{_name(scale_role)} role, which this object lacks")


def _check_scale_role(by_role: dict, role: int, etype: int, shape: tuple[int, ...]) -> None:
    weight_role = C.WEIGHT_ROLE_OF[C.Role(role)]
    if weight_role not in by_role:
        raise ScalePairError(f"{_name(role)}: scales without their {_name(weight_role)} role")
    weight_type, weight_shape = by_role[weight_role]
    rule = C.SCALED_WEIGHT_TYPES.get(weight_type)
    if rule is None:
        raise ScalePairError(f"{_name(role)}: {_name(weight_role)} is {C.ElementType(weight_type).name}, "
                             f"a type that takes no scale role")
    if etype != rule.scale_type:
        raise ScalePairError(f"{_name(role)}: {C.ElementType(weight_type).name} weights take "
                             f"{rule.scale_type.name} scales, not {C.ElementType(etype).name}")
    group = scale_group_size(weight_shape, shape)
    if group not in rule.group_sizes:
        wanted = " or ".join(f"{weight_shape[:-1] + (weight_shape[-1] // g,)}" for g in sorted(rule.group_sizes)
                             if weight_shape[-1] % g == 0) or f"a last dim dividing {weight_shape[-1]}"
        raise ScalePairError(f"{_name(role)}: shape {shape} does not scale {_name(weight_role)} "
                             f"{weight_shape} in groups of {sorted(rule.group_sizes)}; expected {wanted}")
