"""Step fences: which slots a client that reads the slot map on the device may still be reading.

A client on the data plane gets one fence page (a memfd of storaged.wire.dataplane.FENCE_BYTES,
passed over the socket, mapped by both) and writes STARTED = n before launching step n, and
FINISHED = n once that step's device work completed. Before a slot whose map entry was cleared
is written again, the engine takes a `snapshot` of the sessions that are mid-step right after
the clear became visible, and waits until each of them finished that step (`wait_quiesced`).
A step launched after the snapshot read the cleared entry and cannot touch the slot.

A session that ends mid-step (its process died, or it closed its connection between STARTED and
FINISHED) keeps holding back reuse until its process has exited (its pidfd is readable: the
kernel has torn down its device context by then), or, where no pidfd is available, for a grace
period. A session that stays mid-step longer than `timeout` is revoked (REVOKED set, counted,
no longer waited for): one stuck client must not stop the daemon from serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import time

from storaged.wire.dataplane import FENCE_BYTES, FENCE_FINISHED, FENCE_REVOKED, FENCE_STARTED

log = logging.getLogger("storaged")

DEAD_PEER_GRACE_SECONDS = 1.0  # without a pidfd: how long a vanished mid-step client is waited for
_SPIN_SECONDS = 0.002  # yield to the loop this long before sleeping between checks


class FencePage:
    """One session's fence page, owned by the daemon."""

    def __init__(self, session_id: str):
        self.session_id = session_id
        self.fd = os.memfd_create(f"expertpack-fence-{session_id[:8]}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        os.ftruncate(self.fd, FENCE_BYTES)
        # The client may not shrink it under our mapping (a read past the end would be SIGBUS).
        import fcntl

        fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        self._mmap = mmap.mmap(self.fd, FENCE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._mmap).cast("Q")  # aligned 8-byte loads and stores
        self.gone = False  # no longer waited for: revoked, or closed

    @property
    def started(self) -> int:
        return self._words[FENCE_STARTED // 8]

    @property
    def finished(self) -> int:
        return self._words[FENCE_FINISHED // 8]

    def mid_step(self) -> bool:
        return not self.gone and self.started > self.finished

    def revoke(self) -> None:
        self._words[FENCE_REVOKED // 8] = 1
        self.gone = True

    def close(self) -> None:
        self.gone = True
        self._words.release()
        self._mmap.close()
        os.close(self.fd)


Snapshot = list[tuple[FencePage, int]]  # (page, the step it was in) for pages mid-step


class FenceTable:
    """Every live fence page. Used from the event loop thread only."""

    def __init__(self, timeout: float = 10.0):
        self.timeout = timeout  # seconds a session may stay mid-step while reuse waits for it
        self._pages: dict[str, FencePage] = {}
        self.revocations = 0  # sessions revoked for staying mid-step too long
        self.waits = 0  # quiescence waits that had to wait at all
        self.wait_seconds = 0.0

    def __len__(self) -> int:
        return len(self._pages)

    def open(self, session_id: str) -> FencePage:
        page = FencePage(session_id)
        self._pages[session_id] = page
        return page

    def release(self, session_id: str, pidfd: int | None) -> None:
        """The session ended. Its page is dropped at once unless it is mid-step; then it is
        honoured until its process exits (pidfd readable) or, without a pidfd, a grace period."""
        page = self._pages.get(session_id)
        if page is None:
            return
        if not page.mid_step():
            self._drop(page)
            return
        loop = asyncio.get_running_loop()
        if pidfd is not None:
            def exited() -> None:
                loop.remove_reader(pidfd)
                self._drop(page)
            loop.add_reader(pidfd, exited)
        else:
            loop.call_later(DEAD_PEER_GRACE_SECONDS, self._drop, page)

    def _drop(self, page: FencePage) -> None:
        if self._pages.get(page.session_id) is page:
            del self._pages[page.session_id]
            page.close()

    def snapshot(self) -> Snapshot:
        """The pages mid-step now; call right after a map clear became visible."""
        return [(page, page.started) for page in self._pages.values() if page.mid_step()]

    @staticmethod
    def quiesced(snapshot: Snapshot) -> bool:
        return all(page.gone or page.finished >= step for page, step in snapshot)

    async def wait_quiesced(self, snapshot: Snapshot) -> None:
        """Until every page of the snapshot finished the step it was in (or was revoked)."""
        if self.quiesced(snapshot):
            return
        self.waits += 1
        started = time.monotonic()
        while not self.quiesced(snapshot):
            waited = time.monotonic() - started
            if waited > self.timeout:
                for page, step in snapshot:
                    if not (page.gone or page.finished >= step):
                        self._revoke(page, step, waited)
                break
            # Steps last milliseconds: yield at first, then poll at the loop's timer granularity.
            await asyncio.sleep(0 if waited < _SPIN_SECONDS else 0.0005)
        self.wait_seconds += time.monotonic() - started

    def _revoke(self, page: FencePage, step: int, waited: float) -> None:
        log.warning("session %s stayed in step %d for %.1f s while a slot it may read waited for reuse; "
                    "its fence is revoked (its later steps are refused)", page.session_id[:8], step, waited)
        self.revocations += 1
        page.revoke()  # stays in the table (not waited for) until its session ends

    def close(self) -> None:
        for page in list(self._pages.values()):
            page.close()
        self._pages.clear()
