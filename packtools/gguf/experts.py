"""Routed expert tensors of a GGUF: discovery, validation, and per-expert byte ranges.

Expert e of an expert-major tensor [E, rows, cols] is the contiguous byte range
`data_offset + e * nbytes / E` .. `+ nbytes / E`; a RoleSlice reads exactly those bytes.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path

from packformat.constants import SUPPORTED_TYPES, ElementType, Role
from packtools.gguf.errors import ExpertLayoutError, GGUFTruncatedError, UnsupportedTensorTypeError
from packtools.gguf.expert_map import BIAS_ROLES, EXPERT_TENSORS, ROLE_ORDER, expert_tensor_name, role_shapes
from packtools.gguf.files import TensorLocation
from packtools.sources.base import RoleSlice

_SEPARATE = frozenset({Role.GATE, Role.UP, Role.DOWN})
_FUSED = frozenset({Role.GATE_UP, Role.DOWN})
_ROLE_PATTERNS = {
    role: re.compile("^" + re.escape(expert_tensor_name(role, 0)).replace(r"blk\.0\.", r"blk\.(\d+)\.") + "$")
    for role in EXPERT_TENSORS
}


@dataclasses.dataclass(frozen=True)
class ExpertTensor:
    role: Role
    location: TensorLocation
    count: int  # experts, numpy dim 0
    role_shape: tuple[int, ...]  # one expert, numpy order, logical elements

    @property
    def expert_nbytes(self) -> int:
        return self.location.nbytes // self.count


def find_expert_tensors(tensors: Mapping[str, TensorLocation]) -> dict[int, dict[Role, ExpertTensor]]:
    """layer -> role -> tensor, for every tensor named like a routed expert tensor."""
    layers: dict[int, dict[Role, ExpertTensor]] = {}
    for name, location in tensors.items():
        for role, pattern in _ROLE_PATTERNS.items():
            if match := pattern.match(name):
                shape = location.shape
                if len(shape) < 2:
                    raise ExpertLayoutError(f"{name}: expert tensor of shape {shape} has no expert dimension")
                layers.setdefault(int(match.group(1)), {})[role] = ExpertTensor(role, location, shape[0], shape[1:])
    return dict(sorted(layers.items()))


def validate_experts(
    layers: dict[int, dict[Role, ExpertTensor]], expert_count: int, hidden_size: int
) -> tuple[Role, ...]:
    """Check every layer has the same roles, counts and shapes; returns the roles in object order."""
    if not layers:
        raise ExpertLayoutError("no routed expert tensors (blk.N.ffn_*_exps.*) in the file")
    first_layer, first_roles = next(iter(layers.items()))
    roles = frozenset(first_roles)
    if roles - BIAS_ROLES not in (_SEPARATE, _FUSED):
        raise ExpertLayoutError(f"layer {first_layer}: expert roles {sorted(r.name for r in roles)} are neither "
                                "gate+up+down nor gate_up+down")
    down = first_roles[Role.DOWN]
    if len(down.role_shape) != 2 or down.role_shape[0] != hidden_size:
        raise ExpertLayoutError(
            f"{down.location.name}: per-expert shape {down.role_shape}, expected [{hidden_size}, I]"
        )
    inter = down.role_shape[1]
    expected = role_shapes(inter, hidden_size)
    for layer, by_role in layers.items():
        if frozenset(by_role) != roles:
            raise ExpertLayoutError(f"layer {layer}: expert roles {sorted(r.name for r in by_role)} differ from "
                                    f"layer {first_layer}'s {sorted(r.name for r in roles)}")
        for role, tensor in by_role.items():
            _check_type(tensor)
            if tensor.count != expert_count:
                raise ExpertLayoutError(f"{tensor.location.name}: {tensor.count} experts, but expert_count is "
                                        f"{expert_count} (and other tensors may differ)")
            if tensor.role_shape != expected[role]:
                raise ExpertLayoutError(f"{tensor.location.name}: per-expert shape {tensor.role_shape}, expected "
                                        f"{expected[role]} (hidden {hidden_size}, expert width {inter})")
    return tuple(role for role in ROLE_ORDER if role in roles)


def _check_type(tensor: ExpertTensor) -> None:
    kind = tensor.location.element_type
    if kind not in SUPPORTED_TYPES:
        raise UnsupportedTensorTypeError(
            tensor.location.shard.path, tensor.location.name, ElementType(kind).name,
            f"expert tensors must be one of {sorted(t.name for t in SUPPORTED_TYPES)}", offset=tensor.location.offset,
        )


def read_exact(fd: int, path: Path, offset: int, nbytes: int) -> bytes:
    """pread exactly nbytes at offset (pread may return less for large requests)."""
    parts, got = [], 0
    while got < nbytes:
        chunk = os.pread(fd, nbytes - got, offset + got)
        if not chunk:
            raise GGUFTruncatedError(
                path, "expert bytes", offset=offset, needed=offset + nbytes, file_size=offset + got
            )
        parts.append(chunk)
        got += len(chunk)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def role_slice(tensor: ExpertTensor, expert: int, open_fd: Callable[[Path], int]) -> RoleSlice:
    """Expert `expert` of `tensor`; `open_fd(path)` gives the shard's descriptor at read time
    (so a read after the source is closed fails instead of hitting a reused descriptor)."""
    nbytes = tensor.expert_nbytes
    offset = tensor.location.offset + expert * nbytes  # expert-major: expert e is one contiguous range
    path = tensor.location.shard.path
    return RoleSlice(
        role=tensor.role,
        element_type=int(tensor.location.element_type),
        shape=tensor.role_shape,
        nbytes=nbytes,
        read=lambda: read_exact(open_fd(path), path, offset, nbytes),
    )
