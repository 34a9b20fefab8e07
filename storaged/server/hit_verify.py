"""verify_hits: re-check Acquire hits against their object's checksum before they are served.

A hit is otherwise trusted: its bytes were verified when loaded and only the daemon writes a CPU
arena (a sealed memfd). A CUDA arena is different: an IPC mapping is always writable, so any
client that attached may change a cached object under every other session; and memory can go
bad. With verify_hits = r, each hit is checked with probability r (1.0: every hit), at random so
that a writer cannot aim at the hits left unchecked: the crc32 of the slot's bytes (CPU: read in
place; CUDA: copied to a staging buffer first) against the pack index's. A mismatch is counted
and logged, and the engine reloads the object from the pack into its slot rather than serve it.

The hashing runs on threads of its own (zlib releases the GIL), so the event loop keeps serving.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import zlib

from packformat.index import ObjectEntry
from packformat.reader import PackReader
from storaged.device.arena import Arena
from storaged.io.staging import StagingPool
from storaged.metrics import StoragedMetrics
from storaged.policy import ExpertStep, Source

log = logging.getLogger("storaged")

VERIFY_THREADS = 2


class HitVerifier:
    def __init__(self, rate: float, arena: Arena, staging: StagingPool, metrics: StoragedMetrics):
        if not 0 < rate <= 1:
            raise ValueError(f"verify_hits rate {rate} is not in (0, 1]")
        self.rate = rate
        self.arena = arena
        self.staging = staging
        self.metrics = metrics
        self._random = random.SystemRandom()
        self._threads = concurrent.futures.ThreadPoolExecutor(VERIFY_THREADS, thread_name_prefix="storaged-verify")

    def sampled(self) -> bool:
        """Whether to verify the next hit."""
        return self.rate >= 1.0 or self._random.random() < self.rate

    async def failures(self, steps: tuple[ExpertStep, ...], pack: PackReader) -> list[tuple[int, ExpertStep]]:
        """The sampled hits among an Acquire's steps whose bytes no longer match: (index, step)."""
        sampled = [(index, step) for index, step in enumerate(steps) if step.source is Source.READY and self.sampled()]
        if not sampled:
            return []
        matched = await asyncio.gather(*(self.matches(step.slot, pack.entry(step.key.layer, step.key.expert))
                                         for _, step in sampled))
        return [hit for hit, ok in zip(sampled, matched, strict=True) if not ok]

    async def matches(self, slot: int, entry: ObjectEntry) -> bool:
        """Whether the slot holds the object's bytes (counted; a mismatch is logged)."""
        crc = await self._crc32(slot, entry.size)
        matched = crc == entry.crc32
        self.metrics.record_hit_verified(mismatch=not matched)
        if not matched:
            log.warning("the cached copy of (layer %d, expert %d) in slot %d no longer matches its checksum "
                        "(crc32 %#010x, the pack's %#010x): something wrote the arena; reloading it from the pack",
                        entry.layer, entry.expert, slot, crc, entry.crc32)
        return matched

    async def _crc32(self, slot: int, nbytes: int) -> int:
        loop = asyncio.get_running_loop()
        view = self.arena.host_view(slot, nbytes)
        if view is not None:
            return await loop.run_in_executor(self._threads, zlib.crc32, view)
        buffer = await self.staging.acquire()
        try:
            handle = self.arena.copy_out(slot, buffer, nbytes)
            await handle.wait()
            return await loop.run_in_executor(self._threads, zlib.crc32, buffer.view[:nbytes])
        except asyncio.CancelledError:
            buffer = None  # a device copy may still be writing into it: never lend it again (shutdown only)
            raise
        finally:
            if buffer is not None:
                self.staging.release(buffer)

    def close(self) -> None:
        self._threads.shutdown(wait=True)
