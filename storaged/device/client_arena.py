"""Client side of an arena: map it from an ArenaDescriptor and view slots as tensors.

Imports torch only (never grpc), so the inference process can use it without the server's
dependencies.

    arena = map_arena(descriptor, fd)       # once per session (fd: memfd arenas, from the data plane)
    arena.wait_event(event_index, stream)   # CUDA: the stream waits for the slot's copy
    weights = arena.slot_view(slot, nbytes) # uint8 [nbytes], on the arena's device
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings

import torch

from storaged.device.descriptor import KIND_CUDA_IPC, KIND_MEMFD, ArenaDescriptor
from storaged.device.errors import (ArenaClosedError, ArenaDescriptorError, ArenaMapError,
                                    CudaUnavailableError, EventIndexError, SlotRangeError)


class ClientArena:
    """A mapped arena. slot_view returns views into the shared memory (no copy)."""

    def __init__(self, descriptor: ArenaDescriptor, tensor: torch.Tensor):
        self.descriptor = descriptor
        self.slot_bytes = descriptor.slot_bytes
        self.slot_count = descriptor.slot_count
        self._tensor: torch.Tensor | None = tensor  # uint8 [mapped_bytes]: the slots, then the slot map

    @property
    def device(self) -> torch.device:
        return self._live().device

    def _live(self) -> torch.Tensor:
        if self._tensor is None:
            raise ArenaClosedError(f"{self.descriptor.kind} client arena is closed")
        return self._tensor

    def slot_view(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """uint8 [nbytes] view of slot's first nbytes (whole slot by default). Read-only use."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        if not 0 <= slot < self.slot_count or not 0 <= nbytes <= self.slot_bytes:
            raise SlotRangeError("client arena", slot, self.slot_count, nbytes, self.slot_bytes)
        start = slot * self.slot_bytes  # byte offset of the slot in the arena
        return self._live()[start:start + nbytes]

    def slots(self) -> torch.Tensor:
        """uint8 [slot_count * slot_bytes]: every slot, for kernels that index slots themselves."""
        return self._live()[: self.descriptor.arena_bytes]

    def slot_map(self) -> torch.Tensor:
        """int32 [map_entries]: the daemon's slot map (storaged.policy.slot_map), read-only use.
        An entry may change at any time; a reader is protected by its session's step fence."""
        d = self.descriptor
        return self._live()[d.map_offset:d.map_offset + 4 * d.map_entries].view(torch.int32)

    def host_map(self) -> torch.Tensor | None:
        """int32 [map_entries]: the daemon's host map (object -> host tier slot, -1: not there),
        or None when it shares no host tier. Read like the slot map, under the step fence."""
        d = self.descriptor
        if not d.host_slots:
            return None
        return self._live()[d.host_map_offset:d.host_map_offset + 4 * d.map_entries].view(torch.int32)

    def wait_event(self, index: int, stream=None) -> None:
        """Make `stream` wait for the copy that recorded event `index`. No-op for memfd arenas."""

    def close(self) -> None:
        """Drop this mapping; views already taken stay valid until they are freed."""
        self._tensor = None


class MemfdClientArena(ClientArena):
    """The daemon's sealed memory file, mapped read-only (the only way the kernel lets a client map
    it). torch has no read-only tensors: a write through a view faults (SIGSEGV) instead of
    changing what other sessions read, so nothing here or in inference ever writes a view."""

    def __init__(self, descriptor: ArenaDescriptor, fd: int):
        try:
            info = os.fstat(fd)
        except OSError as exc:
            raise ArenaMapError(f"arena descriptor {fd}: {exc.strerror}") from None
        if not stat.S_ISREG(info.st_mode) or info.st_size < descriptor.mapped_bytes:
            raise ArenaMapError(f"arena descriptor {fd} is not a memory file of at least "
                                f"{descriptor.mapped_bytes} bytes (size {info.st_size})")
        try:
            mapping = mmap.mmap(fd, descriptor.mapped_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        except OSError as exc:
            raise ArenaMapError(f"cannot map the arena read-only: {exc.strerror}") from None
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*not writable.*", category=UserWarning)
            tensor = torch.frombuffer(mapping, dtype=torch.uint8)  # [mapped_bytes], never written
        super().__init__(descriptor, tensor)


class CudaIpcClientArena(ClientArena):
    """The server's device allocation, opened with cudaIpcOpenMemHandle through torch."""

    def __init__(self, descriptor: ArenaDescriptor):
        if not torch.cuda.is_available():
            raise CudaUnavailableError("this descriptor names a CUDA arena but CUDA is not available here")
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        d = descriptor
        # The same call torch.multiprocessing makes when a CUDA tensor crosses processes: it
        # caches the opened handle, makes the current stream wait on the export event, and
        # decrements the server's refcount when this storage is freed.
        try:
            tensor = rebuild_cuda_tensor(
                torch.Tensor, torch.Size([d.mapped_bytes]), (1,), 0, torch.storage.TypedStorage,
                torch.uint8, d.device_index, d.ipc_handle, d.storage_size_bytes, d.storage_offset_bytes,
                False, d.ref_counter_handle, d.ref_counter_offset, d.export_event_handle,
                d.export_event_sync_required)
        except RuntimeError as exc:
            raise ArenaMapError(f"cannot open CUDA IPC arena on device {d.device_index}: {exc}") from exc
        super().__init__(descriptor, tensor)
        self._events: dict[int, torch.cuda.Event] = {}

    def wait_event(self, index: int, stream=None) -> None:
        if not 0 <= index < len(self.descriptor.event_handles):
            raise EventIndexError(f"copy event {index} is outside the pool of "
                                  f"{len(self.descriptor.event_handles)}")
        event = self._events.get(index)
        if event is None:
            event = torch.cuda.Event.from_ipc_handle(self.device, self.descriptor.event_handles[index])
            self._events[index] = event
        event.wait(stream if stream is not None else torch.cuda.current_stream(self.device))

    def close(self) -> None:
        self._events.clear()
        super().close()


def map_arena(descriptor: ArenaDescriptor, fd: int | None = None) -> ClientArena:
    """Map the arena a server described; raises ArenaMapError when it cannot be mapped.

    fd: a memfd arena's file descriptor, received over the data plane (the caller keeps and
    closes it; the mapping outlives it). Refused for kinds that need none.
    """
    if descriptor.kind == KIND_MEMFD:
        if fd is None:
            raise ArenaMapError("a memfd arena is mapped from the file descriptor the data plane hands out; "
                                "none was given")
        return MemfdClientArena(descriptor, fd)
    if fd is not None:
        raise ArenaDescriptorError(f"a {descriptor.kind} arena is not mapped from a file descriptor")
    if descriptor.kind == KIND_CUDA_IPC:
        return CudaIpcClientArena(descriptor)
    raise ArenaDescriptorError(f"unknown arena kind {descriptor.kind!r}")
