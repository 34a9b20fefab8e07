"""Where the experts implementation gets expert objects from.

An expert source hands back, for one layer and a list of expert ids, each expert's whole object
(all its roles, exactly the pack's bytes) as a uint8 tensor on the compute device. The storaged
client serves these from its slot arena; `LocalPackSource` reads them straight from the pack and
is the reference the storaged-backed source must agree with.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch

from inference.experts.errors import ExpertLayoutError
from packtools.bundle import Bundle
from packtools.pack import RoleEntry


@runtime_checkable
class ExpertSource(Protocol):
    def acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        """One uint8 tensor per requested expert, in request order, on the compute device.

        Each tensor holds at least the object's payload (role offsets index into it). The
        tensors stay valid until the next `acquire` for the same layer.
        """

    def layout(self, layer: int) -> Sequence[RoleEntry]:
        """The role entries every object of `layer` shares (role, type, offset, nbytes, shape)."""


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
        objects = []
        for expert in experts:
            payload = self.bundle.pack.read_object(layer, expert, verify=True)  # raises ObjectChecksumError
            host = torch.frombuffer(bytearray(payload), dtype=torch.uint8)  # [size] bytes
            objects.append(host.to(self.device))
        return objects
