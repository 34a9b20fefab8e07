"""HostTier: the host-RAM cache tier, slot_count aligned (and, with CUDA, pinned) host slots.

A host slot is itself an O_DIRECT target: a miss that should populate the host tier reads
straight into `tier.slot(n)` (DirectPackFile.read_into / ReadExecutor.read), then
`tier.copy_to_arena(n, arena, vram_slot, nbytes)` moves it to the device at pinned speed.
`copy_from` fills a host slot from a staging buffer when the read went elsewhere first.
"""

from __future__ import annotations

import torch

from storaged.device.arena import Arena, CopyHandle, HostSource, host_bytes
from storaged.device.errors import ArenaClosedError, SlotRangeError
from storaged.io.host_memory import AlignedBuffer, HostMemory


class HostTier:
    """shared=True: the slots are in a sealed memory file that clients map read-only (`client_fd`,
    handed out over the data plane) to read objects in place, found through the arena's host map."""

    def __init__(self, slot_count: int, slot_bytes: int, *, pin: bool = False, shared: bool = False):
        self._memory = HostMemory(slot_count, slot_bytes, pin=pin, shared=shared, what="host tier")
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes

    @property
    def client_fd(self) -> int | None:
        """The memory file clients map (read-only), or None when the tier is not shared."""
        if self._memory.closed:
            raise ArenaClosedError("host tier is closed")
        return self._memory.fd

    @property
    def pinned(self) -> bool:
        return self._memory.pinned

    @property
    def tier_bytes(self) -> int:
        return self._memory.total_bytes

    def slot(self, slot: int) -> AlignedBuffer:
        """The whole slot as an aligned buffer (a read target or copy source)."""
        if self._memory.closed:
            raise ArenaClosedError("host tier is closed")
        if not 0 <= slot < self.slot_count:
            raise SlotRangeError("host tier", slot, self.slot_count)
        return self._memory.buffers[slot]

    def slot_tensor(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """uint8 [nbytes] CPU view of the slot's first nbytes (whole slot by default)."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= nbytes <= self.slot_bytes:
            raise SlotRangeError("host tier", slot, self.slot_count, nbytes, self.slot_bytes)
        return self.slot(slot).tensor[:nbytes]

    def copy_from(self, slot: int, source: HostSource, nbytes: int) -> None:
        """Host-to-host copy into slot; complete on return. torch's memcpy releases the GIL,
        so a caller on the event loop should run large ones in a worker thread."""
        self.slot_tensor(slot, nbytes).copy_(host_bytes(source, nbytes, f"copy into host slot {slot}"))

    def copy_to_arena(self, slot: int, arena: Arena, arena_slot: int, nbytes: int) -> CopyHandle:
        """Host slot → arena slot (H2D on CUDA); the host slot must not change until done."""
        return arena.copy_in(arena_slot, self.slot_tensor(slot, nbytes), nbytes)

    def close(self) -> None:
        """Unpin and drop the slots; call after every copy from them completed. Idempotent."""
        self._memory.close()

    def __enter__(self) -> HostTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
