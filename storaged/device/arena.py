"""Arena: one allocation cut into equal slots that clients map; CpuArena is its host-memory form.

The server copies object bytes into slots (copy_in) and publishes a slot to a client only once
that copy has completed (`await handle.wait()`), or hands the client `handle.event_index` so the
client's stream waits for the copy instead. The CUDA form lives in cuda_arena.py.
"""

from __future__ import annotations

import abc
import asyncio
import fcntl
import mmap
import os

import torch

from packformat.constants import ALIGNMENT
from storaged.device.descriptor import KIND_MEMFD, ArenaDescriptor, map_region_bytes, map_region_entries
from storaged.device.errors import ArenaClosedError, ArenaError, CopySizeError, SlotRangeError
from storaged.io.host_memory import SHARED_SEALS, AlignedBuffer, sealable_memfd

HostSource = AlignedBuffer | torch.Tensor | memoryview
ABSENT = -1  # slot map value of an object that is not resident (storaged.policy.slot_map.ABSENT)


def host_bytes(source: HostSource, nbytes: int, what: str) -> torch.Tensor:
    """The first nbytes of a host buffer as a uint8 CPU tensor sharing its memory (no copy)."""
    if isinstance(source, AlignedBuffer):
        tensor = source.tensor
    elif isinstance(source, torch.Tensor):
        if source.device.type != "cpu" or source.dtype != torch.uint8 or not source.is_contiguous():
            raise TypeError(f"{what}: host tensor must be contiguous uint8 on the CPU, got "
                            f"{source.dtype} on {source.device}")
        tensor = source.reshape(-1)
    elif isinstance(source, memoryview):
        if source.readonly:
            raise TypeError(f"{what}: memoryview is read-only; pass a writable staging view")
        tensor = torch.frombuffer(source, dtype=torch.uint8)
    else:
        raise TypeError(f"{what}: expected AlignedBuffer, uint8 tensor or memoryview, got {type(source).__name__}")
    _check_host_size(what, tensor.numel(), nbytes)
    return tensor[:nbytes]


def host_address(source: HostSource, nbytes: int, what: str) -> tuple[int, object]:
    """(address of the host buffer's first byte, the object that keeps its memory alive), for
    copies issued by address; an AlignedBuffer (staging, host tier) needs no tensor view."""
    if isinstance(source, AlignedBuffer):
        _check_host_size(what, source.nbytes, nbytes)
        return source.address, source
    host = host_bytes(source, nbytes, what)
    return host.data_ptr(), host


def _check_host_size(what: str, have: int, nbytes: int) -> None:
    if have < nbytes:
        raise CopySizeError(f"{what}: host buffer holds {have} bytes, the copy needs {nbytes}")


class CopyHandle:
    """Completion of one copy into or out of a slot.

    `event_index` is None when the copy was complete on return (CPU) or is a copy out (no
    client waits for one); otherwise it indexes the descriptor's event_handles, and a client
    stream that waits on that event sees the bytes.
    Events are reused round-robin; a reused event only makes a waiter wait for a later copy on
    the same in-order copy stream, never too little.
    """

    def __init__(self, event=None, event_index: int | None = None, keepalive=(), waiter=None):
        self._event = event  # torch.cuda.Event, a DriverEvent, or None
        self.event_index = event_index
        self._keepalive = keepalive  # source/destination tensors the DMA still touches
        self._waiter = waiter  # executor that runs blocking synchronizes off the event loop

    @property
    def done(self) -> bool:
        return self._event is None or self._event.query()

    def synchronize(self) -> None:
        """Block this thread until the copy completed. Thread-safe."""
        if self._event is not None:
            self._event.synchronize()
        self._keepalive = ()

    async def wait(self) -> None:
        """Wait without blocking the event loop."""
        if self.done:
            self._keepalive = ()
            return
        await asyncio.get_running_loop().run_in_executor(self._waiter, self.synchronize)


COMPLETED = CopyHandle()


class Arena(abc.ABC):
    """slot_count slots of slot_bytes (a multiple of 4096) in one allocation, followed by the
    slot map: `map_entries` int32 entries (storaged.policy.slot_map), -1 until published. With
    `host_slots`, a host map of as many entries follows it: entry `host_index(i)` names the host
    tier slot holding entry i's object (clients read those bytes in place), under the same rule.

    The map is what lets a client find hits on the device without a round trip, so its writes
    follow one rule: an entry names a slot only while that slot's bytes are the object's.
    `publish` is called once a copy into the slot has completed, `unpublish` before the slot is
    reused. `unpublish` returns once the cleared entries are visible to every later reader;
    `publish` may become visible a little after it returns (a reader that does not see it yet
    only misses a hit), but always before a later `unpublish` of the same entry returns.
    """

    kind: str

    def __init__(self, slot_count: int, slot_bytes: int, map_entries: int = 0, host_slots: int = 0):
        if slot_count <= 0:
            raise ValueError(f"slot_count must be > 0, got {slot_count}")
        if slot_bytes <= 0 or slot_bytes % ALIGNMENT:
            raise ValueError(f"slot_bytes {slot_bytes} is not a positive multiple of {ALIGNMENT}")
        if map_entries < 0:
            raise ValueError(f"map_entries must be >= 0, got {map_entries}")
        if host_slots < 0 or (host_slots and not map_entries):
            raise ValueError(f"host_slots must be >= 0, and 0 without a slot map, got {host_slots}")
        self.slot_count = slot_count
        self.slot_bytes = slot_bytes
        self.map_entries = map_entries
        self.host_slots = host_slots
        self.region_entries = map_region_entries(map_entries, host_slots)  # int32 entries of both maps
        self._tensor: torch.Tensor | None = None  # uint8 [allocation_bytes]: slots, then the map

    @property
    def arena_bytes(self) -> int:
        """Bytes of the slots."""
        return self.slot_count * self.slot_bytes

    @property
    def allocation_bytes(self) -> int:
        """Bytes of the whole allocation: the slots and the slot map."""
        return self.arena_bytes + map_region_bytes(self.region_entries)

    def _map_view(self) -> torch.Tensor:
        """int32 [region_entries] view of the map region of the allocation (both maps)."""
        tensor = self._live()
        return tensor[self.arena_bytes:self.arena_bytes + 4 * self.region_entries].view(torch.int32)

    def host_index(self, index: int) -> int:
        """The region index of slot map entry `index`'s host map entry."""
        if not self.host_slots:
            raise IndexError("this arena has no host map (host_slots is 0)")
        return self.map_entries + index

    def _live(self) -> torch.Tensor:
        if self._tensor is None:
            raise ArenaClosedError(f"{self.kind} arena is closed")
        return self._tensor

    def read_map(self, index: int) -> int:
        """The published value of one region entry (tests and diagnostics)."""
        self._check_map_index(index)
        return int(self._map_view()[index].item())

    def _check_map_index(self, index: int) -> None:
        if not 0 <= index < self.region_entries:
            raise IndexError(f"slot map entry {index} outside [0, {self.region_entries})")

    def _check_published(self, index: int, slot: int) -> None:
        """A value `slot` that region entry `index` may hold: an arena slot in the slot map, a
        host tier slot in the host map."""
        self._check_map_index(index)
        if index < self.map_entries:
            if not 0 <= slot < self.slot_count:
                raise SlotRangeError(f"{self.kind} arena", slot, self.slot_count)
        elif not 0 <= slot < self.host_slots:
            raise SlotRangeError(f"{self.kind} arena's host map", slot, self.host_slots)

    @abc.abstractmethod
    def publish(self, index: int, slot: int) -> None:
        """Region entry `index` (a slot map entry, or a `host_index`) names `slot` from now on
        (visible soon after, and before any later unpublish of it returns); call only once the
        slot's bytes are complete."""

    @abc.abstractmethod
    def unpublish(self, indices: list[int]) -> None:
        """Region entries `indices` read -1 from now on (visible before this returns)."""

    def slot_tensor(self, slot: int, nbytes: int | None = None) -> torch.Tensor:
        """uint8 [nbytes] view of slot's first nbytes (whole slot by default), in this process."""
        nbytes = self.slot_bytes if nbytes is None else nbytes
        start = self._slot_offset(slot, nbytes)
        return self._live()[start:start + nbytes]

    def _slot_offset(self, slot: int, nbytes: int) -> int:
        """Byte offset of `slot` in the arena; SlotRangeError unless slot and nbytes fit."""
        if not 0 <= slot < self.slot_count or not 0 <= nbytes <= self.slot_bytes:
            raise SlotRangeError(f"{self.kind} arena", slot, self.slot_count, nbytes, self.slot_bytes)
        return slot * self.slot_bytes

    @property
    def client_fd(self) -> int | None:
        """The descriptor a client maps the arena by (handed over the data plane, read-only for
        anyone but this process), or None where the descriptor alone names the memory (CUDA IPC)."""
        return None

    def host_view(self, slot: int, nbytes: int) -> memoryview | None:
        """Slot's first nbytes readable on the host without a copy, or None (device memory)."""
        return None

    @abc.abstractmethod
    def descriptor(self) -> ArenaDescriptor:
        """What a client passes to map_arena; on CUDA each call is a fresh export for one client."""

    @abc.abstractmethod
    def copy_in(self, slot: int, source: HostSource, nbytes: int) -> CopyHandle:
        """Copy nbytes from a host buffer into slot. The source must stay untouched until done."""

    @abc.abstractmethod
    def copy_out(self, slot: int, destination: HostSource, nbytes: int) -> CopyHandle:
        """Copy slot's first nbytes into a host buffer."""

    def synchronize(self) -> None:
        """Wait for every copy issued so far."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release the allocation (idempotent); clients that mapped it keep their own mapping."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


ARENA_SEALS = SHARED_SEALS


class CpuArena(Arena):
    """An anonymous memory file (memfd) that no path names, mapped read-write by this process only.

    Once mapped here, the file is sealed (F_SEAL_FUTURE_WRITE, F_SEAL_SHRINK, F_SEAL_GROW,
    F_SEAL_SEAL): the seals belong to the file, not to a descriptor, so through any descriptor of
    it, ours handed out over the data plane (`client_fd`) or one reopened through /proc, a write(),
    a writable shared mapping, a truncation or a hole punched are refused by the kernel, for root
    too. Only the mapping made before sealing, this process's, can change the bytes. A kernel
    that refuses the write seal (before Linux 5.1) gets no CPU arena rather than a writable one.

    Copies are CPU memcpys (torch's, which release the GIL) and complete before copy_in returns.
    """

    kind = KIND_MEMFD

    def __init__(self, slot_count: int, slot_bytes: int, *, map_entries: int = 0, host_slots: int = 0):
        super().__init__(slot_count, slot_bytes, map_entries, host_slots)
        what = f"a {self.allocation_bytes}-byte CPU arena"
        try:
            fd = sealable_memfd("expertpack-arena")
        except OSError as exc:
            raise ArenaError(f"cannot create {what} (memfd_create): {exc.strerror}") from None
        try:
            os.ftruncate(fd, self.allocation_bytes)
            # Reserve the pages now: memory that is not there should fail here, not SIGBUS a later copy.
            os.posix_fallocate(fd, 0, self.allocation_bytes)
            self._mmap = mmap.mmap(fd, self.allocation_bytes, flags=mmap.MAP_SHARED,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot create {what}: {exc.strerror}") from None
        try:
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
        except OSError as exc:
            os.close(fd)
            raise ArenaError(f"cannot seal {what} against writes by other processes (F_SEAL_FUTURE_WRITE: "
                             f"{exc.strerror}; Linux 5.1 or later is needed); refusing to share a writable "
                             "arena") from None
        self._fd = fd
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)  # [allocation_bytes]
        self._map_view().fill_(ABSENT)

    @property
    def client_fd(self) -> int:
        if self._tensor is None:
            raise ArenaClosedError("CPU arena is closed")
        return self._fd

    def host_view(self, slot: int, nbytes: int) -> memoryview:
        self.slot_tensor(slot, nbytes)  # range check
        start = slot * self.slot_bytes
        return memoryview(self._mmap)[start:start + nbytes]

    def descriptor(self) -> ArenaDescriptor:
        if self._tensor is None:
            raise ArenaClosedError("CPU arena is closed")
        return ArenaDescriptor(kind=KIND_MEMFD, slot_bytes=self.slot_bytes, slot_count=self.slot_count,
                               map_entries=self.map_entries, host_slots=self.host_slots)

    def publish(self, index: int, slot: int) -> None:
        self._check_published(index, slot)
        self._map_view()[index] = slot  # an aligned 4-byte store: readers see old or new, never a mix

    def unpublish(self, indices: list[int]) -> None:
        for index in indices:
            self._check_map_index(index)
        view = self._map_view()
        for index in indices:
            view[index] = ABSENT

    def copy_in(self, slot: int, source: HostSource, nbytes: int) -> CopyHandle:
        self.slot_tensor(slot, nbytes).copy_(host_bytes(source, nbytes, f"copy into slot {slot}"))
        return COMPLETED

    def copy_out(self, slot: int, destination: HostSource, nbytes: int) -> CopyHandle:
        host_bytes(destination, nbytes, f"copy out of slot {slot}").copy_(self.slot_tensor(slot, nbytes))
        return COMPLETED

    def close(self) -> None:
        if self._tensor is None:
            return
        # Not mmap.close(): tensors from slot_tensor() would dangle. The mapping goes with the
        # last of them; closing the descriptor stops new clients, mapped clients keep their pages.
        self._tensor = None
        self._mmap = None
        os.close(self._fd)
