"""Engine: one model, requests queued FIFO and generated one at a time on a single worker thread.

Every torch call happens on the worker thread; callers submit from any thread and receive
events through a sink (an asyncio queue for `stream`, a plain queue for `generate`). Requests
never fail because others are running: they wait their turn.

When the expert source reports itself unavailable (storaged down or restarting) the request in
flight fails with ExpertSourceUnavailableError, the engine asks the source to reconnect, and
until a reconnect succeeds every request is first preceded by another reconnect attempt.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator

from inference.engine import source_hooks
from inference.engine.errors import EngineClosedError, EngineError, EngineInternalError, ExpertSourceUnavailableError
from inference.engine.generate import FINISH_CANCELLED, ModelRunner, context_length_of, eos_token_ids
from inference.engine.metrics import EngineMetrics
from inference.engine.params import Finished, GenerationEvent, SamplingParams
from inference.engine.tokenizer_guard import SerializedTokenizer

log = logging.getLogger(__name__)

Sink = Callable[[object], None]  # receives TextDelta, then Finished or an EngineError


@dataclasses.dataclass
class Job:
    """A submitted request; `cancel()` makes the worker skip or stop it at the next token."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink
    submitted_at: float
    _cancelled: threading.Event = dataclasses.field(default_factory=threading.Event)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclasses.dataclass(frozen=True)
class Health:
    ok: bool
    reason: str


_RECONNECT = object()  # worker instruction: try to reconnect the expert source
_STOP = object()  # worker instruction: exit


class Engine:
    def __init__(self, runner: ModelRunner, expert_source, *, metrics: EngineMetrics | None = None):
        self.runner = runner
        self.expert_source = expert_source
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._unavailable_reason: str | None = None  # set while the source is known to be down
        self._reconnect_pending = threading.Event()
        self._current: Job | None = None
        self._worker = threading.Thread(target=self._work, name="inference-engine", daemon=True)
        self._worker.start()

    @classmethod
    def from_loaded(cls, loaded, *, metrics: EngineMetrics | None = None, static_cache_len: int = 0) -> Engine:
        """An engine for an inference.model.LoadedModel (static_cache_len: see ModelRunner)."""
        if loaded.tokenizer is None:
            raise EngineError(f"bundle {loaded.bundle.path} has no tokenizer; text generation needs one")
        runner = ModelRunner(loaded.model, SerializedTokenizer(loaded.tokenizer),
                             eos_ids=eos_token_ids(loaded.tokenizer, loaded.model.generation_config),
                             context_length=context_length_of(loaded.config), expert_source=loaded.expert_source,
                             static_cache_len=static_cache_len)
        return cls(runner, loaded.expert_source, metrics=metrics)

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    # --- submitting -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *,
               request_id: str | None = None) -> Job:
        """Queue a request (checked first: raises InvalidRequestError or EngineClosedError)."""
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        self.runner.check_request(prompt_ids, params)
        job = Job(request_id or uuid.uuid4().hex, list(prompt_ids), params, sink, time.monotonic())
        self.metrics.queue_depth.inc()
        self._jobs.put(job)
        return job

    async def stream(self, prompt_ids: list[int], params: SamplingParams, *,
                     request_id: str | None = None) -> AsyncIterator[GenerationEvent]:
        """TextDelta events, then Finished; raises the EngineError a failed request ends with.

        Closing the iterator early (a client that went away) cancels the request.
        """
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job: Job | None = None

        def sink(event) -> None:
            try:
                loop.call_soon_threadsafe(events.put_nowait, event)
            except RuntimeError:  # the event loop is gone: nobody is listening any more
                job.cancel()

        job = self.submit(prompt_ids, params, sink, request_id=request_id)
        try:
            while True:
                event = await events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            job.cancel()  # no-op when finished

    def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                 request_id: str | None = None) -> Iterator[GenerationEvent]:
        """The blocking counterpart of `stream`, for threads without an event loop."""
        events: queue.SimpleQueue = queue.SimpleQueue()
        job = self.submit(prompt_ids, params, events.put, request_id=request_id)
        try:
            while True:
                event = events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if isinstance(event, Finished):
                    return
        finally:
            job.cancel()

    # --- health and shutdown ----------------------------------------------------------------

    async def health(self) -> Health:
        if self._closed or not self._worker.is_alive():
            return Health(False, "the engine is stopped")
        if self._unavailable_reason is not None:
            self._request_reconnect()  # so that health recovers without waiting for a request
            return Health(False, f"expert source unavailable: {self._unavailable_reason}")
        if not await asyncio.to_thread(source_hooks.probe_available, self.expert_source):
            return Health(False, "expert source unreachable")
        return Health(True, "ok")

    def close(self, timeout: float = 30.0) -> None:
        """Fail queued requests, cancel the running one, and stop the worker."""
        self._closed = True
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                self.metrics.queue_depth.dec()
                item.sink(EngineClosedError(f"request {item.request_id}: the engine shut down before it ran"))
        current = self._current
        if current is not None:
            current.cancel()
        self._jobs.put(_STOP)
        self._worker.join(timeout)

    # --- the worker -------------------------------------------------------------------------

    def _request_reconnect(self) -> None:
        if not self._reconnect_pending.is_set():
            self._reconnect_pending.set()
            self._jobs.put(_RECONNECT)

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            if item is _RECONNECT:
                self._reconnect_pending.clear()
                if self._unavailable_reason is not None:
                    self._try_reconnect()
                continue
            self.metrics.queue_depth.dec()
            if item.cancelled:
                continue
            self._current = item
            try:
                self._run(item)
            except Exception as exc:  # a bug here must not kill the only worker and hang every request
                log.exception("request %s: engine failure", item.request_id)
                item.sink(EngineInternalError(item.request_id, exc))
            finally:
                self._current = None

    def _try_reconnect(self) -> bool:
        try:
            source_hooks.reconnect(self.expert_source)
        except Exception as exc:
            if source_hooks.find_unavailable(exc, self.expert_source) is None:
                log.exception("expert source reconnect failed")
            self._unavailable_reason = f"reconnect failed: {exc}"
            return False
        log.info("expert source reconnected")
        self._unavailable_reason = None
        return True

    def _fail_unavailable(self, job: Job, reason: str, cause: BaseException) -> None:
        self.metrics.expert_source_unavailable.inc()
        error = ExpertSourceUnavailableError(f"request {job.request_id}: the expert source is unavailable "
                                             f"({reason}); retry later")
        error.__cause__ = cause
        job.sink(error)

    def _run(self, job: Job) -> None:
        source = self.expert_source
        if self._unavailable_reason is not None and not self._try_reconnect():
            self._fail_unavailable(job, self._unavailable_reason, None)
            return
        wait_before = source_hooks.expert_wait_seconds(source)
        self.metrics.running.inc()
        outcome: object
        try:
            outcome = self.runner.run(job.prompt_ids, job.params, emit=job.sink,
                                      cancelled=lambda: job.cancelled, submitted_at=job.submitted_at)
        except Exception as exc:
            outcome = exc
        self.metrics.running.dec()
        wait_after = source_hooks.expert_wait_seconds(source)
        if wait_before is not None and wait_after is not None and wait_after > wait_before:
            self.metrics.expert_wait_seconds.inc(wait_after - wait_before)
        # metrics first: whoever receives the last event may read them at once
        if isinstance(outcome, Finished):
            if outcome.finish_reason != FINISH_CANCELLED:
                self.metrics.record_finished(outcome.usage.prompt_tokens, outcome.usage.completion_tokens,
                                             outcome.time_to_first_token, outcome.generation_seconds)
            job.sink(outcome)
            return
        unavailable = source_hooks.find_unavailable(outcome, source)
        if unavailable is None:
            log.error("request %s failed", job.request_id, exc_info=outcome)
            job.sink(EngineInternalError(job.request_id, outcome))
            return
        self._unavailable_reason = str(unavailable)
        log.warning("request %s: expert source unavailable: %s", job.request_id, unavailable)
        self._try_reconnect()  # before answering, so that a client retrying at once finds it done
        self._fail_unavailable(job, str(unavailable), outcome)
