"""ReadExecutor: pack reads on worker threads, demand before prefetch.

The event loop never blocks on the disk: `await executor.read(...)` queues the read and a worker
thread runs preadv and the crc32 check (zlib releases the GIL for large buffers), so reads
proceed `workers` at a time (the queue depth the disk sees).

Priority: a worker always takes the oldest waiting demand read first; a prefetch read runs only
when no demand read waits, and at most `max_prefetch_running` prefetch reads run at once, so at
least `workers - max_prefetch_running` workers are always free for demand. A running read is
never interrupted: a demand read waits for at most one read per worker, never for the prefetch
backlog.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import enum
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Generic, TypeVar

from packformat.errors import ObjectChecksumError
from packformat.index import ObjectEntry
from packformat.reader import verify_object
from storaged.io.direct import DirectPackFile
from storaged.io.errors import ExecutorClosedError, ObjectReadError, UnknownPackError
from storaged.io.host_memory import AlignedBuffer

if TYPE_CHECKING:
    from storaged.metrics import StoragedMetrics

Item = TypeVar("Item")


class ReadPriority(enum.IntEnum):
    DEMAND = 0  # an Acquire is waiting for these bytes
    PREFETCH = 1  # a hint; runs only on idle workers


class PriorityDispatch(Generic[Item]):
    """Thread-safe queue of two classes: demand items first, prefetch items on a budget.

    `take` hands out the oldest demand item; else the oldest prefetch item if fewer than
    `max_prefetch_running` prefetch items are taken and not yet `done`; else it waits.
    """

    def __init__(self, max_prefetch_running: int):
        if max_prefetch_running < 0:
            raise ValueError(f"max_prefetch_running must be >= 0, got {max_prefetch_running}")
        self.max_prefetch_running = max_prefetch_running
        self._queues = {priority: collections.deque() for priority in ReadPriority}
        self._prefetch_running = 0
        self._closed = False
        self._cond = threading.Condition()

    def put(self, item: Item, priority: ReadPriority) -> None:
        with self._cond:
            if self._closed:
                raise ExecutorClosedError("read queue is closed")
            self._queues[priority].append(item)
            self._cond.notify()

    def take(self, timeout: float | None = None) -> tuple[Item, ReadPriority] | None:
        """The next item and its priority; None when closed, or when `timeout` s pass first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._closed:
                if self._queues[ReadPriority.DEMAND]:
                    return self._queues[ReadPriority.DEMAND].popleft(), ReadPriority.DEMAND
                if self._queues[ReadPriority.PREFETCH] and self._prefetch_running < self.max_prefetch_running:
                    self._prefetch_running += 1
                    return self._queues[ReadPriority.PREFETCH].popleft(), ReadPriority.PREFETCH
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait(remaining)
            return None

    def done(self, priority: ReadPriority) -> None:
        """Mark a taken item finished; a prefetch slot opens."""
        if priority is ReadPriority.PREFETCH:
            with self._cond:
                assert self._prefetch_running > 0, "done(PREFETCH) without a running prefetch"
                self._prefetch_running -= 1
                self._cond.notify()

    def waiting(self, priority: ReadPriority) -> int:
        with self._cond:
            return len(self._queues[priority])

    def close(self) -> list[Item]:
        """Stop handing out items; wake every taker; return the items never taken."""
        with self._cond:
            self._closed = True
            left = [*self._queues[ReadPriority.DEMAND], *self._queues[ReadPriority.PREFETCH]]
            for queue in self._queues.values():
                queue.clear()
            self._cond.notify_all()
            return left


@dataclass(eq=False)
class _ReadRequest:
    file: DirectPackFile
    entry: ObjectEntry
    buffer: AlignedBuffer
    future: concurrent.futures.Future


class ReadExecutor:
    """Runs DirectPackFile reads on `workers` threads with demand-over-prefetch dispatch.

    Owns the pack files registered with add_pack and closes them in close().
    """

    def __init__(self, *, workers: int = 8, prefetch_share: float = 0.5,
                 metrics: StoragedMetrics | None = None, start: bool = True):
        if workers <= 0:
            raise ValueError(f"workers must be > 0, got {workers}")
        if not 0.0 <= prefetch_share <= 1.0:
            raise ValueError(f"prefetch_share must be in [0, 1], got {prefetch_share}")
        self.workers = workers
        # A positive share always allows one prefetch worker, else prefetch would never run.
        max_prefetch = 0 if prefetch_share == 0 else max(1, int(workers * prefetch_share))
        self._dispatch: PriorityDispatch[_ReadRequest] = PriorityDispatch(max_prefetch)
        self._metrics = metrics
        self._files: dict[str, DirectPackFile] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        if start:
            self.start()

    @property
    def max_prefetch_running(self) -> int:
        return self._dispatch.max_prefetch_running

    def add_pack(self, pack_id: str, file: DirectPackFile) -> None:
        if pack_id in self._files:
            raise ValueError(f"pack id {pack_id!r} is already registered")
        self._files[pack_id] = file

    def queued(self, priority: ReadPriority) -> int:
        return self._dispatch.waiting(priority)

    def start(self) -> None:
        """Start the worker threads (once). Reads submitted before start wait in the queue."""
        if self._threads or self._closed:
            return
        for n in range(self.workers):
            thread = threading.Thread(target=self._work, name=f"storaged-read-{n}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def submit(self, pack_id: str, entry: ObjectEntry, buffer: AlignedBuffer,
               priority: ReadPriority = ReadPriority.DEMAND) -> concurrent.futures.Future:
        """Queue a read; the future's result is the payload memoryview (buffer[:entry.size])."""
        if self._closed:
            raise ExecutorClosedError(f"read of object (layer {entry.layer}, expert {entry.expert}) "
                                      "submitted to a closed executor")
        file = self._files.get(pack_id)
        if file is None:
            raise UnknownPackError(f"no pack registered as {pack_id!r} (object layer {entry.layer}, "
                                   f"expert {entry.expert})")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._dispatch.put(_ReadRequest(file, entry, buffer, future), ReadPriority(priority))
        return future

    async def read(self, pack_id: str, entry: ObjectEntry, buffer: AlignedBuffer,
                   priority: ReadPriority = ReadPriority.DEMAND) -> memoryview:
        """Read one object into buffer from the event loop; raises what read_into raises.

        If the awaiting task is cancelled, a queued read is dropped; a running one is waited
        for before CancelledError propagates, so the caller may reuse `buffer` at once.
        """
        future = self.submit(pack_id, entry, buffer, priority)
        wrapped = asyncio.wrap_future(future)
        try:
            return await asyncio.shield(wrapped)
        except asyncio.CancelledError:
            if not future.cancel():
                await asyncio.wait([wrapped])  # a worker is writing into buffer right now
            raise

    def _work(self) -> None:
        while (taken := self._dispatch.take()) is not None:
            request, priority = taken
            try:
                if request.future.set_running_or_notify_cancel():
                    self._run(request)
            finally:
                self._dispatch.done(priority)

    def _run(self, request: _ReadRequest) -> None:
        file, entry, metrics = request.file, request.entry, self._metrics
        try:
            started = time.perf_counter()
            payload = file.read_raw(entry, request.buffer)
            if metrics is not None:
                metrics.observe_read(entry.padded_size, time.perf_counter() - started)
            if file.verify:
                verify_object(file.path, entry, payload)
        except ObjectChecksumError as exc:
            if metrics is not None:
                metrics.record_checksum_failure()
            request.future.set_exception(exc)
        except (ObjectReadError, OSError) as exc:
            if metrics is not None:
                metrics.record_io_error()
            request.future.set_exception(exc)
        except BaseException as exc:  # noqa: BLE001 - a worker must outlive any one bad read
            request.future.set_exception(exc)
        else:
            request.future.set_result(payload)

    def close(self) -> None:
        """Fail queued reads with ExecutorClosedError, wait for running ones, close the packs."""
        if self._closed:
            return
        self._closed = True
        for request in self._dispatch.close():
            if request.future.set_running_or_notify_cancel():
                request.future.set_exception(ExecutorClosedError(
                    f"{request.file.path}: read of object (layer {request.entry.layer}, expert "
                    f"{request.entry.expert}) dropped: executor closed"))
        for thread in self._threads:
            thread.join()
        for file in self._files.values():
            file.close()
        self._files.clear()

    def __enter__(self) -> ReadExecutor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
