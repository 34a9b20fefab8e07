"""When `inference serve` may tell systemd's watchdog it is alive: the event loop runs (it sends the
pings) and the engine's worker is either idle or has made progress since the previous check.

A worker stuck inside one step (a hung expert read, a deadlocked kernel) stops the pings and
systemd restarts the service; a long request does not, as long as its tokens (or, during a long
prefill, its layers' expert acquisitions) keep coming.
"""

from __future__ import annotations

import logging

from inference.server.state import ServerState

log = logging.getLogger("inference.server")


class EngineWatchdog:
    def __init__(self, state: ServerState):
        self.state = state
        self._last_progress: tuple | None = None
        self._stalled = False

    def alive(self) -> bool:
        """One check, made before each would-be ping: False withholds the ping."""
        engine = self.state.engine
        if engine is None:  # loading: READY=1 is not sent yet, so systemd's watchdog is not armed
            return True
        live = engine.liveness()
        moved = live.progress != self._last_progress
        self._last_progress = live.progress
        ok = live.alive and (moved or not live.busy)
        if ok != (not self._stalled):
            self._stalled = not ok
            if self._stalled:
                log.error("engine worker %s: withholding the watchdog ping",
                          "is dead" if not live.alive else "made no progress since the last check")
            else:
                log.warning("engine worker is making progress again")
        return ok
