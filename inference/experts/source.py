"""Where the experts implementation gets expert objects from.

An expert source hands back, for one layer and a list of expert ids, each expert's whole object
(all its roles, exactly the pack's bytes) as a uint8 tensor on the compute device. The storaged
client serves these from its slot arena; `LocalPackSource` reads them straight from the pack and
is the reference the storaged-backed source must agree with.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from inference.experts.errors import ExpertLayoutError
from packformat import RoleEntry
from packformat.bundle import Bundle


@runtime_checkable
class ExpertSource(Protocol):
    def acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        """One uint8 tensor per requested expert, in request order, on the compute device.

        Each tensor holds at least the object's payload (role offsets index into it). The
        tensors stay valid until the next `acquire` for the same layer.
        """

    def layout(self, layer: int) -> Sequence[RoleEntry]:
        """The role entries every object of `layer` shares (role, type, offset, nbytes, shape)."""


@dataclasses.dataclass(frozen=True)
class SlotRows:
    """Acquired objects as rows of one byte tensor, for kernels that read slots in place.

    Object i of the request starts at byte `index[i] * stride` of `arena` (uint8, 1-D, on the
    compute device). A storaged source hands out its shared arena and the slot ids; a source
    without an arena packs the objects it read into a fresh tensor.
    """

    arena: torch.Tensor
    stride: int
    index: tuple[int, ...]
    # inference.kernels.ops.HostSlots when some of `index` are host-tier slots (from host.first
    # on), which only the fused GEMV reads (inference.experts.host_reads); None: all arena rows
    host: object | None = None

    @property
    def row_count(self) -> int:
        return self.arena.numel() // self.stride

    def rows(self) -> torch.Tensor:
        """uint8 [row_count, stride] view of the arena."""
        return self.arena[: self.row_count * self.stride].view(self.row_count, self.stride)


ROW_ALIGNMENT = 256  # rows of packed objects keep every role 256-byte aligned, like arena slots


def rows_of_objects(objects: Sequence[torch.Tensor]) -> SlotRows:
    """SlotRows holding copies of `objects` (uint8 1-D tensors on one device), one per row."""
    if not objects:
        raise ValueError("rows_of_objects needs at least one object")
    stride = -(-max(o.numel() for o in objects) // ROW_ALIGNMENT) * ROW_ALIGNMENT
    arena = torch.zeros(len(objects) * stride, dtype=torch.uint8, device=objects[0].device)
    rows = arena.view(len(objects), stride)
    for i, obj in enumerate(objects):
        rows[i, : obj.numel()] = obj
    return SlotRows(arena, stride, tuple(range(len(objects))))


def acquire_rows(source: ExpertSource, layer: int, experts: list[int]) -> SlotRows:
    """The source's own acquire_rows when it has one, else its objects packed into rows."""
    method = getattr(source, "acquire_rows", None)
    if method is not None:
        return method(layer, experts)
    return rows_of_objects(source.acquire(layer, experts))


def uniform_layout(bundle: Bundle, layer: int) -> tuple[RoleEntry, ...]:
    """The role entries of `layer`'s objects, checked to be identical for every expert.

    Batched dequantization treats a layer's experts as one tensor per role, which is only
    sound when every expert has the same types, shapes and offsets.
    """
    pack = bundle.pack
    if not pack.has_layer(layer):
        raise ExpertLayoutError(layer, f"{pack.path} has no routed experts for this layer "
                                f"(its layers: {list(pack.layers)})")
    first = pack.entry(layer, 0).roles
    for expert in range(1, pack.header.expert_count):
        roles = pack.entry(layer, expert).roles
        if roles != first:
            raise ExpertLayoutError(layer, f"expert {expert}'s roles {roles} differ from expert 0's {first}; "
                                    "a layer's experts must share one layout")
    return first


class LocalPackSource:
    """Reads objects from the bundle's pack with pread, checksum verified, and copies them to `device`.

    No cache: every acquire reads the objects again (the page cache absorbs repeats). It is the
    reference source for tests and single-process use, not a substitute for storaged.
    """

    def __init__(self, bundle: Bundle, device: torch.device | str):
        self.bundle = bundle
        self.device = torch.device(device)
        self._layouts: dict[int, tuple[RoleEntry, ...]] = {}

    def layout(self, layer: int) -> tuple[RoleEntry, ...]:
        if layer not in self._layouts:
            self._layouts[layer] = uniform_layout(self.bundle, layer)
        return self._layouts[layer]

    def acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        rows = self.acquire_rows(layer, experts)
        return [rows.arena[i * rows.stride: i * rows.stride + self.bundle.pack.entry(layer, e).size]
                for i, e in zip(rows.index, experts, strict=True)]

    def acquire_rows(self, layer: int, experts: list[int]) -> SlotRows:
        """The objects read into one host buffer, then copied to the device at once."""
        sizes = [self.bundle.pack.entry(layer, expert).size for expert in experts]
        stride = -(-max(sizes) // ROW_ALIGNMENT) * ROW_ALIGNMENT
        host = torch.zeros(len(experts) * stride, dtype=torch.uint8)  # [n * stride] bytes
        for i, expert in enumerate(experts):
            payload = self.bundle.pack.read_object(layer, expert, verify=True)  # raises ObjectChecksumError
            host[i * stride: i * stride + sizes[i]] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return SlotRows(host.to(self.device), stride, tuple(range(len(experts))))
