"""Decode steps of a StaticDecoder launched without waiting for them (inference.engine.decode_ahead).

`launch` starts a step on the slot map without waiting for it: its input token may still be on
the device (the previous step's pick), and a second step may be launched before the first is
settled, so the host's work between steps (reading the token, emitting text) overlaps the
device's (inference.engine.decode_ahead). The steps settle in launch order; a step that met an
absent expert is undone together with every step launched after it, and run again with `redo`.

These are StaticDecoder's methods, kept apart: LaunchAhead is a mixin of it and uses its buffers,
graph, fence and cache.
"""

from __future__ import annotations

import dataclasses
import time

import torch

MAX_BACKOFF_STEPS = 32  # most steps decoded on the acquire path after misses before trying the graph again


@dataclasses.dataclass
class LaunchedStep:
    """A decode step launched on the slot map and not settled yet."""

    logits: torch.Tensor  # [V] the step's logits (the graph's buffer: read them before the next launch)
    fence_step: int  # its number in the session's step fence
    misses: torch.Tensor  # [1] int32 on the CPU: its absent experts, once `done` (pinned on CUDA)
    done: torch.cuda.Event | None  # recorded after its work; None off CUDA (the work has completed)
    launched_at: float  # time.perf_counter()


MAX_LAUNCHED_STEPS = 2  # steps launched and not settled: the one being read, and the next


class LaunchAhead:
    """StaticDecoder's steps not waited for (its `_launched`, oldest first)."""

    def can_launch(self) -> bool:
        """Whether the next step may be launched now: through the slot map (not backing off after
        misses), a free place in the cache and in the launch queue."""
        return (self.lookup_enabled and self._skip == 0 and len(self._launched) < MAX_LAUNCHED_STEPS
                and self.length < self.max_len and (self._graph is not None or not self.capture))

    def launch(self, token: torch.Tensor) -> LaunchedStep | None:
        """Launch the step that feeds `token` ([1] int64 on the device, e.g. a pick not yet read)
        at the next position, reading experts through the slot map, without waiting for it. None
        when it cannot (can_launch, or the fence was revoked): step() then. Settle it before reading
        its logits on the host; its logits buffer is the next launch's too."""
        if not self.can_launch():
            return None
        from storaged.client.dataplane import FenceRevoked

        if not self._launched:
            finish = getattr(self.source, "finish_resident_step", None)
            if callable(finish):  # a forward that failed midway may have left the source's resident step open
                finish()
        try:
            fence_step = self.fence.begin()
        except FenceRevoked:
            self._revoked()
            return None
        try:
            self.ids.copy_(token.view(1, 1))
            self.positions.fill_(self.length)
            if self._graph is not None:
                self._graph.replay()
                logits = self._graph_logits
            else:
                self._set_lookup(True)
                try:
                    logits = self._step_call()
                finally:
                    self._set_lookup(False)
            if self.misses.is_cuda:
                misses = self.misses.to("cpu", non_blocking=True)  # pinned: waits for this step's work alone
                done = torch.cuda.Event()
                done.record()
            else:
                misses, done = self.misses.clone(), None
        except BaseException:  # the request fails; the next start() resets the cache and its length
            self._synchronize()
            self.abandoned_steps += len(self._launched)
            self.steps -= len(self._launched)
            self._launched.clear()
            try:
                self.fence.end(fence_step)  # nothing of it runs any more; the steps before it ended with it
            except FenceRevoked:
                self._revoked()
            raise
        launched = LaunchedStep(logits, fence_step, misses, done, time.perf_counter())
        self._launched.append(launched)
        self.length += 1
        self.steps += 1
        return launched

    def settle(self, launched: LaunchedStep) -> bool:
        """Wait for the oldest launched step. True when it found every expert: its logits stand.
        False when one was absent (or the fence was revoked): it and every step launched after it
        are undone (the cache's write position moved back), and the caller runs it again with redo()."""
        from storaged.client.dataplane import FenceRevoked

        assert self._launched and self._launched[0] is launched, "settle() out of launch order"
        if launched.done is not None:
            launched.done.synchronize()
        absent = int(launched.misses[0])
        self._launched.popleft()
        try:
            self.fence.end(launched.fence_step)
        except FenceRevoked:
            self._revoked()
            absent = -1
        now = time.perf_counter()
        seconds = now - max(launched.launched_at, self._settled_at)  # with a step before it: from its end
        self._settled_at = now
        if absent == 0:
            self.lookup_steps += 1
            self._backoff = 0
            if self.cpu_experts is not None:  # the share's tuner learns from the steps' times
                self.cpu_experts.observe_step(seconds)
            return True
        self.redone_steps += 1
        self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF_STEPS)
        self._skip = self._backoff
        self.abandon()
        self._rewind(1)
        return False

    def redo(self, token: int) -> torch.Tensor:
        """Logits [V] of the step settle() found an expert absent in, run again for `token` on the
        acquire path (which loads what was missing)."""
        assert not self._launched, "redo() with launched steps not settled"
        self.ids.fill_(token)
        self.positions.fill_(self.length)
        self._set_lookup(False)
        logits = self._acquire_step()
        self.length += 1
        return logits

    def abandon(self) -> None:
        """Undo every launched step not settled (a request ended with one launched ahead): their
        work waited for, their fence steps ended, the cache's write position moved back."""
        if not self._launched:
            return
        from storaged.client.dataplane import FenceRevoked

        count = len(self._launched)
        last = self._launched[-1]
        if last.done is not None:
            last.done.synchronize()
        self._launched.clear()
        self.abandoned_steps += count
        self.steps -= count
        self._rewind(count)
        try:
            self.fence.end(last.fence_step)
        except FenceRevoked:
            self._revoked()

    def _rewind(self, count: int) -> None:
        for layer in self.cache.layers:  # the steps' positions are written again
            layer.cumulative_length.sub_(count)
        self.length -= count

    def _synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
