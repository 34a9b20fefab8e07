"""TimedExpertSource: gives a source without its own timing the optional expert_wait_seconds hook."""

from __future__ import annotations

import threading
import time


class TimedExpertSource:
    """Wraps an ExpertSource, adding up the wall time spent in its `acquire`.

    Everything else (layout, reconnect, is_available, unavailable_errors...) is the wrapped
    source's own. On an asynchronous device the time covers issuing the copies, not their end.
    """

    def __init__(self, source):
        self.source = source
        self._seconds = 0.0
        self._lock = threading.Lock()  # acquire runs on the worker, metrics are read elsewhere

    def layout(self, layer: int):
        return self.source.layout(layer)

    def acquire(self, layer: int, experts: list[int]):
        started = time.perf_counter()
        try:
            return self.source.acquire(layer, experts)
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._seconds += elapsed

    def acquire_rows(self, layer: int, experts: list[int]):
        from inference.experts.source import acquire_rows

        started = time.perf_counter()
        try:
            return acquire_rows(self.source, layer, experts)
        finally:
            elapsed = time.perf_counter() - started
            with self._lock:
                self._seconds += elapsed

    def expert_wait_seconds(self) -> float:
        with self._lock:
            return self._seconds

    def __getattr__(self, name: str):
        # only reached for attributes not defined here: the optional hooks of the wrapped source
        return getattr(self.source, name)
