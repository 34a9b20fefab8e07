"""create_arena: the arena of the kind the daemon's configuration names.

Apart from arena.py so that the base module does not import its CUDA subclass.
"""

from __future__ import annotations

import torch

from storaged.device.arena import Arena, CpuArena
from storaged.device.cuda_arena import CudaArena


def create_arena(kind: str, slot_count: int, slot_bytes: int, *, map_entries: int = 0, host_slots: int = 0,
                 device: int = 0, event_count: int = 256) -> Arena:
    """kind 'cpu' (a sealed memfd), 'cuda' (device `device`) or 'auto' (cuda when available)."""
    if kind == "auto":
        kind = "cuda" if torch.cuda.is_available() else "cpu"
    if kind == "cpu":
        return CpuArena(slot_count, slot_bytes, map_entries=map_entries, host_slots=host_slots)
    if kind == "cuda":
        return CudaArena(slot_count, slot_bytes, map_entries=map_entries, host_slots=host_slots, device=device,
                         event_count=event_count)
    raise ValueError(f"arena kind {kind!r} is not one of 'cpu', 'cuda', 'auto'")
