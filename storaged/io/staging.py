"""StagingPool: aligned host buffers that O_DIRECT reads land in before their copy to a slot.

Used for reads that do not land in a host-tier slot (host tier off or full). Buffers are lent
FIFO to asyncio callers; a caller that finds none free waits, so the pool bounds how much read
memory is in flight. All methods must be called from the event loop's thread.

A buffer may be released only after every copy that reads it has completed (on CUDA,
`await copy_handle.wait()`): a non-blocking H2D copy reads the buffer after copy_in returns.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import AsyncIterator

from packformat.constants import ALIGNMENT, align_up
from storaged.io.errors import StorageIOError
from storaged.io.host_memory import AlignedBuffer, HostMemory


class StagingPoolError(StorageIOError):
    """A buffer was released twice, or released to a pool that did not lend it."""


class StagingPool:
    """`count` aligned buffers of at least `buffer_bytes` each (rounded up to 4096)."""

    def __init__(self, count: int, buffer_bytes: int, *, pin: bool = False):
        self._memory = HostMemory(count, align_up(buffer_bytes, ALIGNMENT), pin=pin, what="staging")
        self._free: collections.deque[AlignedBuffer] = collections.deque(self._memory.buffers)
        self._lent: set[int] = set()  # indices of buffers out on loan
        self._waiters: collections.deque[asyncio.Future[AlignedBuffer]] = collections.deque()

    @property
    def count(self) -> int:
        return self._memory.count

    @property
    def buffer_bytes(self) -> int:
        return self._memory.buffer_bytes

    @property
    def pinned(self) -> bool:
        return self._memory.pinned

    @property
    def free_count(self) -> int:
        return len(self._free)

    def try_acquire(self) -> AlignedBuffer | None:
        """A free buffer, or None when all are lent or someone is already waiting."""
        self._check_open()
        if self._free and not self._waiters:
            return self._lend(self._free.popleft())
        return None

    async def acquire(self) -> AlignedBuffer:
        """A free buffer; waits (FIFO) while all are lent."""
        buffer = self.try_acquire()
        if buffer is not None:
            return buffer
        waiter: asyncio.Future[AlignedBuffer] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(waiter.result())  # handed over just as we were cancelled: pass it on
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def release(self, buffer: AlignedBuffer) -> None:
        """Return a lent buffer; the longest waiter gets it."""
        if buffer.index not in self._lent or buffer is not self._memory.buffers[buffer.index]:
            raise StagingPoolError(f"staging buffer {buffer.index} at {buffer.address:#x} is not on loan "
                                   "from this pool (released twice?)")
        self._lent.discard(buffer.index)
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(self._lend(buffer))
                return
        self._free.append(buffer)

    @contextlib.asynccontextmanager
    async def borrow(self) -> AsyncIterator[AlignedBuffer]:
        """`async with pool.borrow() as buffer:` — released on exit, also on error."""
        buffer = await self.acquire()
        try:
            yield buffer
        finally:
            self.release(buffer)

    def _lend(self, buffer: AlignedBuffer) -> AlignedBuffer:
        self._lent.add(buffer.index)
        return buffer

    def _check_open(self) -> None:
        if self._memory.closed:
            raise StagingPoolError("staging pool is closed")

    def close(self) -> None:
        """Unpin and drop the buffers; waiting acquirers get StagingPoolError. Idempotent."""
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(StagingPoolError("staging pool closed while waiting for a buffer"))
        self._waiters.clear()
        self._free.clear()
        self._memory.close()
