"""storaged.io — reading pack objects from disk into aligned host memory, off the event loop.

- `HostMemory(count, buffer_bytes, *, pin=False)`: one anonymous mmap cut into `count`
  `AlignedBuffer`s (`index`, `address`, `view` memoryview, `tensor` uint8 CPU tensor, `nbytes`);
  every address checked 4096-aligned (`BufferAlignmentError` otherwise); pin=True page-locks it
  with cudaHostRegister (`HostPinError` on failure) and close() unregisters.
- `StagingPool(count, buffer_bytes, *, pin=False)`: buffers of at least the largest padded
  object, lent to asyncio callers: `await acquire()`, `try_acquire()`, `release(buffer)`,
  `async with borrow() as buffer`, `free_count`, `close()`. Event-loop thread only.
- `DirectPackFile(path, *, direct_io=True, verify=True)`: O_DIRECT pack file (probed at open;
  `DirectIOUnsupported` names file and filesystem, never a silent fallback).
  `read_into(entry, buffer) -> memoryview` of the payload (entry.size bytes) after reading
  entry.padded_size bytes into buffer and checking the crc32 (`ObjectChecksumError`);
  `read_raw` skips the check; OS failures raise `ObjectReadError`. `direct_io_active`, `close()`.
- `ReadExecutor(*, workers=8, prefetch_share=0.5, metrics=None, start=True)`: `add_pack(id, file)`,
  `await read(id, entry, buffer, priority=ReadPriority.DEMAND) -> memoryview`, `submit(...) ->
  concurrent.futures.Future`, `close()`. Demand reads are dispatched before any waiting prefetch
  read; prefetch reads use at most `max(1, int(workers * prefetch_share))` workers. With
  metrics, records read bytes/latency, io errors and checksum failures.
- `filesystem_of(path) -> str`: "<fstype> at <mount point>".
"""

from packformat.errors import ObjectChecksumError
from storaged.io.direct import DirectPackFile, filesystem_of
from storaged.io.errors import (BufferAlignmentError, BufferTooSmallError, DirectIOUnsupported,
                                ExecutorClosedError, HostPinError, ObjectReadError, StorageIOError,
                                UnknownPackError)
from storaged.io.executor import PriorityDispatch, ReadExecutor, ReadPriority
from storaged.io.host_memory import AlignedBuffer, HostMemory, check_alignment
from storaged.io.staging import StagingPool, StagingPoolError

__all__ = [
    "AlignedBuffer", "BufferAlignmentError", "BufferTooSmallError", "DirectIOUnsupported",
    "DirectPackFile", "ExecutorClosedError", "HostMemory", "HostPinError", "ObjectChecksumError",
    "ObjectReadError", "PriorityDispatch", "ReadExecutor", "ReadPriority", "StagingPool",
    "StagingPoolError", "StorageIOError", "UnknownPackError", "check_alignment", "filesystem_of",
]
