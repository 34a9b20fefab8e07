"""The "native GGUF path": an ExpertSource that maps the GGUF file and copies each selected
expert's role bytes straight out of it onto the device, every time, with no cache of its own.

It is the naive on-demand loader the benchmark compares storaged against: reads are page faults
on np.memmap (the kernel's readahead decides the I/O size), the page cache is the only cache, and
the host RAM limit of the benchmark's cgroup bounds that.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from inference.experts.errors import ExpertLayoutError
from inference.experts.source import uniform_layout
from packformat import RoleEntry
from packformat.bundle import Bundle
from packtools.gguf.experts import find_expert_tensors
from packtools.gguf.files import index_tensors, open_shards


class GGUFMmapSource:
    """acquire(layer, ids) -> one uint8 device tensor per expert, laid out as the bundle's pack objects
    (each role at its pack offset), filled from the GGUF's expert-major role tensors."""

    def __init__(self, gguf_path: str | Path, bundle: Bundle, device: torch.device | str):
        self.device = torch.device(device)
        self.bundle = bundle
        shards = open_shards(Path(gguf_path))
        # copy-on-write maps: writable views for torch.from_numpy, never written, so never copied
        self._maps = {shard.path: np.memmap(shard.path, dtype=np.uint8, mode="c") for shard in shards}
        self._tensors = find_expert_tensors(index_tensors(shards))
        self._layouts: dict[int, tuple[RoleEntry, ...]] = {}
        for layer in bundle.pack.layers:
            layout = uniform_layout(bundle, layer)
            by_role = self._tensors.get(layer, {})
            for entry in layout:
                tensor = by_role.get(entry.role)
                if tensor is None or tensor.expert_nbytes != entry.nbytes:
                    found = None if tensor is None else tensor.expert_nbytes
                    raise ExpertLayoutError(layer, f"{gguf_path}: role {entry.role} has {found} bytes per expert "
                                            f"in the GGUF, {entry.nbytes} in {bundle.pack.path}")
            self._layouts[layer] = layout

    def layout(self, layer: int) -> tuple[RoleEntry, ...]:
        if layer not in self._layouts:
            raise ExpertLayoutError(layer, f"no routed experts in this layer (layers: {list(self._layouts)})")
        return self._layouts[layer]

    def acquire(self, layer: int, experts: list[int]) -> list[torch.Tensor]:
        layout = self.layout(layer)
        object_bytes = layout[-1].offset + layout[-1].nbytes
        objects = []
        for expert in experts:
            target = torch.empty(object_bytes, dtype=torch.uint8, device=self.device)  # [object bytes]
            for entry in layout:
                tensor = self._tensors[layer][entry.role]
                start = tensor.location.offset + expert * entry.nbytes  # expert-major: one contiguous range
                host = torch.from_numpy(self._maps[tensor.location.shard.path][start:start + entry.nbytes])
                target[entry.offset:entry.offset + entry.nbytes].copy_(host)  # the page faults read the disk
            objects.append(target)
        return objects

    def close(self) -> None:
        self._maps.clear()  # the maps close when the last view of them is gone
