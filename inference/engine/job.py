"""A submitted request as the engine's worker sees it: its choices, its sink, its clock."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from inference.engine.params import SamplingParams

Sink = Callable[[object], None]  # receives TextDelta, then Finished (one per choice) or an EngineError


@dataclasses.dataclass(frozen=True)
class Choice:
    """One sequence to generate: choice i of a request is the i-th of its (prompt, params) pairs."""

    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class Job:
    """A submitted request; its choices run one after another. `cancel()` makes the worker skip it or
    stop it at the next token; past `deadline` (time.monotonic()) it is stopped the same way."""

    request_id: str
    choices: tuple[Choice, ...]
    sink: Sink
    submitted_at: float
    deadline: float | None = None
    timeout: float | None = None  # the limit the deadline came from, for the error message
    started_at: float | None = None
    first_token_at: float | None = None
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def timed_out(self, now: float | None = None) -> bool:
        return self.deadline is not None and (time.monotonic() if now is None else now) >= self.deadline
