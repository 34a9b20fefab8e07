"""CudaArena: the arena as one CUDA allocation, exported to clients with CUDA IPC.

Copies in run on a dedicated copy stream, each followed by an interprocess event from a fixed
pool, so a client stream can wait for exactly the copies it needs (CopyHandle.event_index)
while the server's own threads keep going. Copies out run on a second stream. Importable
without CUDA; constructing one without CUDA raises CudaUnavailableError.
"""

from __future__ import annotations

import concurrent.futures
import threading

import torch

from storaged.device.arena import ABSENT, Arena, CopyHandle, HostSource, host_address
from storaged.device.cuda_driver import DriverApi
from storaged.device.descriptor import KIND_CUDA_IPC, ArenaDescriptor
from storaged.device.errors import ArenaClosedError, CudaUnavailableError


class CudaArena(Arena):
    kind = KIND_CUDA_IPC

    def __init__(self, slot_count: int, slot_bytes: int, *, map_entries: int = 0, host_slots: int = 0,
                 device: int = 0, event_count: int = 256):
        super().__init__(slot_count, slot_bytes, map_entries, host_slots)
        if not torch.cuda.is_available():
            raise CudaUnavailableError("a CUDA arena needs a CUDA build of torch and a visible GPU")
        if not 0 <= device < torch.cuda.device_count():
            raise CudaUnavailableError(f"CUDA device {device} does not exist "
                                       f"({torch.cuda.device_count()} visible)")
        if event_count <= 0:
            raise ValueError(f"event_count must be > 0, got {event_count}")
        self.device = torch.device("cuda", device)
        with torch.cuda.device(self.device):
            # One caching-allocator block of its own: an export covers exactly this tensor.
            self._tensor = torch.empty(self.allocation_bytes, dtype=torch.uint8, device=self.device)
            self._device_map = self._map_view()  # int32 [region_entries], kept: one view, not one per write
            self._device_map.fill_(ABSENT)
            # The map's truth on the host, and a stream of its own for the writes, which are fill
            # kernels rather than copies: a copy would queue on the copy engine behind megabytes
            # of object copies (the event loop waited ~1 ms a write with 50 MB in flight).
            self._map_host = torch.full((self.region_entries,), ABSENT, dtype=torch.int32)
            self._map_stream = torch.cuda.Stream(self.device)
            torch.cuda.synchronize(self.device)
            self._copy_stream = torch.cuda.Stream(self.device)
            # blocking=True: a server thread in synchronize() sleeps instead of spinning a core.
            self._events = [torch.cuda.Event(blocking=True, interprocess=True) for _ in range(event_count)]
            self._event_handles = tuple(bytes(event.ipc_handle()) for event in self._events)
        # Copies are issued through the driver (storaged.device.cuda_driver: a few µs each, where
        # torch's copy_ costs tens on the event loop). Copies out (demotions, verification reads)
        # run on a stream of their own, so a layer's promotions do not queue behind its
        # demotions; copies into and out of one slot stay in issue order by stream waits.
        self._driver = DriverApi(self.device.index or 0)
        self._base = self._tensor.data_ptr()  # device address of slot 0
        self._copy_stream_handle = self._copy_stream.cuda_stream
        self._out_stream = torch.cuda.Stream(self.device)
        self._out_stream_handle = self._out_stream.cuda_stream
        self._out_events = [self._driver.create_event() for _ in range(event_count)]
        self._next_out = 0
        # slot → CUevent of the last copy into / out of it. Events are reused round-robin, and
        # a re-recorded event marks a later point of the same in-order stream: a wait on it
        # may wait longer than needed, never too little.
        self._slot_in: dict[int, int] = {}
        self._slot_out: dict[int, int] = {}
        self._next_event = 0
        self._lock = threading.Lock()  # pairs each copy with the event recorded right after it
        self._waiter = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix="storaged-copy-wait")

    @property
    def copy_stream(self) -> torch.cuda.Stream:
        """The stream every copy_in runs on, in issue order (copy_out runs on `out_stream`)."""
        return self._copy_stream

    @property
    def out_stream(self) -> torch.cuda.Stream:
        """The stream every copy_out runs on, in issue order."""
        return self._out_stream

    def descriptor(self) -> ArenaDescriptor:
        tensor = self._live_tensor()
        with torch.cuda.device(self.device):
            # Each export gets its own cross-process refcount, so every client's release is
            # counted and torch keeps the memory alive while any client still maps it.
            (device, handle, size, offset, ref_handle, ref_offset, event_handle,
             event_sync_required) = tensor.untyped_storage()._share_cuda_()
        return ArenaDescriptor(
            kind=KIND_CUDA_IPC, slot_bytes=self.slot_bytes, slot_count=self.slot_count,
            device_index=int(device), ipc_handle=bytes(handle), storage_size_bytes=int(size),
            storage_offset_bytes=int(offset), ref_counter_handle=bytes(ref_handle),
            ref_counter_offset=int(ref_offset), export_event_handle=bytes(event_handle or b""),
            export_event_sync_required=bool(event_sync_required), event_handles=self._event_handles,
            map_entries=self.map_entries, host_slots=self.host_slots,
        )

    def publish(self, index: int, slot: int) -> None:
        self._check_published(index, slot)
        # Not waited for: until the fill runs, a reader only misses a hit it could have had. The
        # wait would block the event loop until this context gets the GPU, which while a client's
        # kernels run is a time slice (~0.2 ms a publish, several a layer, in front of the next
        # Acquire).
        self._write_map([index], slot)

    def unpublish(self, indices: list[int]) -> None:
        for index in indices:
            self._check_map_index(index)
        if indices:
            self._write_map(indices, ABSENT)
            # Waited for: the slot is overwritten next, and a step launched after this returns
            # must read the cleared entry (the fence snapshot relies on it). The map stream is
            # in order, so earlier publishes of these entries are done too.
            self._map_stream.synchronize()

    def read_map(self, index: int) -> int:
        self._check_map_index(index)
        self._live_tensor()  # closed: ArenaClosedError
        self._map_stream.synchronize()  # publishes in flight land first
        return int(self._device_map[index].item())

    def _write_map(self, indices: list[int], value: int) -> None:
        """Set entries on the host copy, and on the device by fill kernels on the map stream."""
        if self._tensor is None:
            raise ArenaClosedError(f"CUDA arena on {self.device} is closed")
        device_map = self._device_map
        with torch.cuda.device(self.device), torch.cuda.stream(self._map_stream):
            for index in indices:
                self._map_host[index] = value
                device_map[index:index + 1].fill_(value)

    def _live_tensor(self) -> torch.Tensor:
        if self._tensor is None:
            raise ArenaClosedError(f"CUDA arena on {self.device} is closed")
        return self._tensor

    def _slot_address(self, slot: int, nbytes: int) -> int:
        offset = self._slot_offset(slot, nbytes)
        self._live_tensor()
        return self._base + offset  # device address of the slot's byte 0

    def copy_in(self, slot: int, source: HostSource, nbytes: int) -> CopyHandle:
        """Asynchronous H2D copy (truly async only from pinned memory) on the copy stream, after
        any copy out of the same slot, followed by an interprocess event clients may wait on."""
        address = self._slot_address(slot, nbytes)
        host, keepalive = host_address(source, nbytes, f"copy into slot {slot}")
        stream = self._copy_stream_handle
        with self._lock:
            pending_out = self._slot_out.pop(slot, None)
            if pending_out is not None:  # a demotion may still be reading the slot
                self._driver.wait(stream, pending_out)
            self._driver.copy_to_device(address, host, nbytes, stream)
            index = self._next_event
            self._next_event = (index + 1) % len(self._events)
            event = self._events[index]
            self._driver.record(event.cuda_event, stream)
            self._slot_in[slot] = event.cuda_event
        return CopyHandle(event, index, (keepalive,), self._waiter)

    def copy_out(self, slot: int, destination: HostSource, nbytes: int) -> CopyHandle:
        """Asynchronous D2H copy of a slot into a (pinned) host buffer, on the demotion stream
        (so it overlaps copies in, which use the other direction of the link), after any copy
        into the same slot."""
        address = self._slot_address(slot, nbytes)
        host, keepalive = host_address(destination, nbytes, f"copy out of slot {slot}")
        stream = self._out_stream_handle
        with self._lock:
            pending_in = self._slot_in.pop(slot, None)
            if pending_in is not None:
                self._driver.wait(stream, pending_in)
            self._driver.copy_to_host(host, address, nbytes, stream)
            event = self._out_events[self._next_out]
            self._next_out = (self._next_out + 1) % len(self._out_events)
            self._driver.record(event.cuda_event, stream)
            self._slot_out[slot] = event.cuda_event
        return CopyHandle(event, None, (keepalive,), self._waiter)

    def synchronize(self) -> None:
        self._copy_stream.synchronize()
        self._out_stream.synchronize()

    def close(self) -> None:
        if self._tensor is None:
            return
        self.synchronize()
        self._map_stream.synchronize()  # publishes are not waited for when issued
        self._waiter.shutdown(wait=True)
        for event in self._out_events:
            event.destroy()
        self._out_events = []
        self._driver.close()
        # torch frees the block only when every client released its mapping (IPC refcount).
        self._tensor = self._device_map = None
        self._events = []
