"""Engine: one model, requests queued FIFO and generated in a continuous batch by one worker thread.

The worker schedules (inference.engine.scheduler): up to `max_num_seqs` choices run together,
each joining and leaving the batch at a token boundary, their forwards run in lockstep on a
thread pool (inference.engine.batch). Callers submit from any thread and receive events through
a sink (an asyncio queue for `stream`, a plain queue for `generate`). Requests never fail because
others are running: when the batch is full they wait their turn, up to `max_queue` of them (more
are refused with QueueFullError), each for at most `request_timeout` seconds from submission
(RequestTimeoutError). A request's choices (n > 1, or several prompts) run as separate sequences.

When the expert source reports itself unavailable (storaged down or restarting) the request in
flight fails with ExpertSourceUnavailableError, the engine asks the source to reconnect, and
until a reconnect succeeds every request is first preceded by another reconnect attempt. An
expert object that fails its integrity check (ExpertDataLossError) or a cache with no room for a
step's experts (ExpertCapacityExhaustedError) fails only the request at hand: the source is not
marked unavailable. A
connection found lost before a request starts (storaged restarted while idle) is reconnected
first, so that request runs rather than fails; /health reports it (503) and has it reconnected.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence

from inference.engine import sampling, source_hooks
from inference.engine.errors import (
    EngineClosedError,
    EngineError,
    EngineInternalError,
    ExpertCapacityExhaustedError,
    ExpertDataLossError,
    ExpertSourceUnavailableError,
    QueueFullError,
)
from inference.engine.events import async_events, blocking_events
from inference.engine.generate import FINISH_CANCELLED, ModelRunner, context_length_of, eos_token_ids
from inference.engine.job import Choice, Job, Sink
from inference.engine.metrics import EngineMetrics
from inference.engine.params import GenerationEvent, SamplingParams
from inference.engine.scheduler import DEFAULT_MAX_NUM_SEQS, DEFAULT_PREFILL_CHUNK, Scheduler
from inference.engine.tokenizer_guard import SerializedTokenizer

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT = 60.0  # half of ops/systemd/inference.service's WatchdogSec


@dataclasses.dataclass(frozen=True)
class Health:
    ok: bool
    reason: str


@dataclasses.dataclass(frozen=True)
class Liveness:
    """What a watchdog needs: is the worker there, is it busy, and a marker that moves with progress
    (tokens generated, requests ended, time spent acquiring experts)."""

    alive: bool
    busy: bool
    progress: tuple


_RECONNECT = object()  # worker instruction: try to reconnect the expert source
_STOP = object()  # worker instruction: exit


def context_limit(model_context: int | None, max_model_len: int | None) -> int | None:
    """The context the engine allows: the model's, or less when max_model_len says so."""
    if max_model_len is None:
        return model_context
    if model_context is not None and max_model_len > model_context:
        raise EngineError(f"max_model_len {max_model_len} is larger than this model's context of "
                          f"{model_context} tokens")
    return max_model_len


class Engine:
    def __init__(self, runner: ModelRunner, expert_source, *, metrics: EngineMetrics | None = None,
                 max_queue: int | None = None, request_timeout: float | None = None,
                 stall_timeout: float | None = DEFAULT_STALL_TIMEOUT, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK):
        self.runner = runner
        self.expert_source = expert_source
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self.max_queue = max_queue
        self.request_timeout = request_timeout
        self.stall_timeout = stall_timeout  # busy this long without progress: /health reports a hang
        self._jobs: queue.Queue = queue.Queue()
        self._closed = False
        self._unavailable_reason: str | None = None  # set while the source is known to be down
        self._reconnect_pending = threading.Event()
        self._waiting = 0  # jobs queued, not yet taken by the worker
        self._waiting_lock = threading.Lock()
        self._busy = False
        self._steps = 0  # generation steps ever started: the watchdog's sign of progress
        self._ended = 0  # jobs ever ended
        self._progress_at = time.monotonic()  # the worker's last step, request start or end
        self._waited_seen: float | None = None  # stalled_for(): the expert wait total it last saw...
        self._waited_moved_at = self._progress_at  # ...and when it last saw it grow (inside a long step)
        self._scheduler = Scheduler(self, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk)
        self._worker = threading.Thread(target=self._work, name="inference-engine", daemon=True)
        self._worker.start()

    @classmethod
    def from_loaded(cls, loaded, *, metrics: EngineMetrics | None = None, max_model_len: int | None = None,
                    max_queue: int | None = None, request_timeout: float | None = None,
                    stall_timeout: float | None = DEFAULT_STALL_TIMEOUT, static_cache_len: int = 0, cpu_experts=None,
                    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                    prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK) -> Engine:
        """An engine for an inference.model.LoadedModel (static_cache_len: see ModelRunner)."""
        if loaded.tokenizer is None:
            raise EngineError(f"bundle {loaded.bundle.path} has no tokenizer; text generation needs one")
        runner = ModelRunner(loaded.model, SerializedTokenizer(loaded.tokenizer),
                             eos_ids=eos_token_ids(loaded.tokenizer, loaded.model.generation_config),
                             context_length=context_limit(context_length_of(loaded.config), max_model_len),
                             expert_source=loaded.expert_source, static_cache_len=static_cache_len,
                             cpu_experts=cpu_experts)
        if runner.decoder is not None:  # before the server reports ready, not in the first request
            runner.decoder.prepare()
            sampling.warm_up(runner.device, runner.vocab_size)
        if metrics is not None and getattr(loaded, "hint_policy", None) is not None:
            metrics.watch_hints(loaded.hint_policy)
        if metrics is not None and runner.decoder is not None:
            metrics.watch_static_decoder(runner.decoder)
            if cpu_experts is not None:
                metrics.watch_cpu_experts(runner.decoder)
        return cls(runner, loaded.expert_source, metrics=metrics, max_queue=max_queue,
                   request_timeout=request_timeout, stall_timeout=stall_timeout, max_num_seqs=max_num_seqs,
                   prefill_chunk=prefill_chunk)

    @property
    def tokenizer(self):
        return self.runner.tokenizer

    # --- submitting -------------------------------------------------------------------------

    def submit(self, prompt_ids: list[int], params: SamplingParams, sink: Sink, *,
               request_id: str | None = None) -> Job:
        """Queue a one-choice request (see submit_choices)."""
        return self.submit_choices([Choice(list(prompt_ids), params)], sink, request_id=request_id)

    def submit_choices(self, choices: Sequence[Choice], sink: Sink, *, request_id: str | None = None) -> Job:
        """Queue a request of one or more choices, generated in order; the sink gets each choice's
        TextDelta events and Finished (its `index` says which). Checked first: raises
        InvalidRequestError, QueueFullError or EngineClosedError."""
        if self._closed:
            raise EngineClosedError("the engine is shutting down")
        if not choices:
            raise ValueError("a request needs at least one choice")
        for choice in choices:
            self.runner.check_request(choice.prompt_ids, choice.params)
        request_id = request_id or uuid.uuid4().hex
        now = time.monotonic()
        timeout = self.request_timeout
        job = Job(request_id, tuple(choices), sink, now, None if timeout is None else now + timeout, timeout)
        with self._waiting_lock:
            if self.max_queue is not None and self._waiting >= self.max_queue:
                self.metrics.queue_full.inc()
                raise QueueFullError(request_id, self.max_queue, self._scheduler.mean_service_seconds)
            self._waiting += 1
            self.metrics.queue_depth.inc()
        self._jobs.put(job)
        return job

    def stream(self, prompt_ids: list[int], params: SamplingParams, *,
               request_id: str | None = None) -> AsyncIterator[GenerationEvent]:
        """A one-choice stream_choices."""
        return self.stream_choices([Choice(list(prompt_ids), params)], request_id=request_id)

    def stream_choices(self, choices: Sequence[Choice], *,
                       request_id: str | None = None) -> AsyncIterator[GenerationEvent]:
        """TextDelta events, and a Finished per choice; raises the EngineError a failed request ends
        with (submission errors included, at the first iteration). Closing the iterator early (a
        client that went away) cancels the request."""
        return async_events(lambda sink: self.submit_choices(choices, sink, request_id=request_id), len(choices))

    def generate(self, prompt_ids: list[int], params: SamplingParams, *,
                 request_id: str | None = None) -> Iterator[GenerationEvent]:
        """The blocking counterpart of `stream`, for threads without an event loop."""
        return blocking_events(lambda sink: self.submit(prompt_ids, params, sink, request_id=request_id), 1)

    # --- health, liveness and shutdown -------------------------------------------------------

    async def health(self) -> Health:
        if self._closed or not self._worker.is_alive():
            return Health(False, "the engine is stopped")
        stalled = self.stalled_for()
        if stalled is not None:
            return Health(False, f"the generation worker has made no progress for {stalled:.0f} s")
        if self._unavailable_reason is not None:
            self._request_reconnect()  # so that health recovers without waiting for a request
            return Health(False, f"expert source unavailable: {self._unavailable_reason}")
        lost = source_hooks.connection_problem(self.expert_source)
        if lost is not None:
            self._request_reconnect()
            return Health(False, f"expert source connection lost, reconnecting: {lost}")
        if not await asyncio.to_thread(source_hooks.probe_available, self.expert_source):
            return Health(False, "expert source unreachable")
        return Health(True, "ok")

    def liveness(self) -> Liveness:
        """Cheap and thread-safe: for a watchdog that must tell a hung worker from a busy one."""
        wait = source_hooks.expert_wait_seconds(self.expert_source)  # moves once per MoE layer acquired
        return Liveness(self._worker.is_alive(), self._busy, (self._steps, self._ended, wait))

    def stalled_for(self) -> float | None:
        """Seconds the busy worker has gone without progress, when that exceeds stall_timeout; else None.

        The worker stamps each step and each request's start and end. Inside one long step (a long
        prompt's prefill) the expert source's wait total grows as layers acquire their experts: a
        polling caller (a health check) sees it grow between its calls."""
        live = self.liveness()
        now = time.monotonic()
        waited = live.progress[2]
        if waited is not None and self._waited_seen is not None and waited > self._waited_seen:
            self._waited_moved_at = now
        self._waited_seen = waited
        if not live.busy or self.stall_timeout is None:
            return None
        idle_for = now - max(self._progress_at, self._waited_moved_at)
        return idle_for if idle_for > self.stall_timeout else None

    @property
    def waiting(self) -> int:
        return self._waiting

    @property
    def running(self) -> int:
        """Requests started and not ended (some of their choices may wait for room in the batch)."""
        return len(self._scheduler.runs)

    def close(self, timeout: float = 30.0) -> None:
        """Fail queued requests, cancel the running ones, and stop the worker."""
        self._closed = True
        while True:
            try:
                item = self._jobs.get_nowait()
            except queue.Empty:
                break
            if isinstance(item, Job):
                self._dequeued()
                self.end_unstarted(item, FINISH_CANCELLED,
                                   EngineClosedError(f"request {item.request_id}: the engine shut down before it ran"))
        self._jobs.put(_STOP)  # the worker cancels what runs
        self._worker.join(timeout)
        decoder = getattr(self.runner, "decoder", None)
        if decoder is not None and not self._worker.is_alive():  # no step runs any more: stop its CPU threads
            decoder.close()

    # --- the worker -------------------------------------------------------------------------

    def _request_reconnect(self) -> None:
        if not self._reconnect_pending.is_set():
            self._reconnect_pending.set()
            self._jobs.put(_RECONNECT)

    def _dequeued(self) -> None:
        with self._waiting_lock:
            self._waiting -= 1
            self.metrics.queue_depth.dec()

    def _next_item(self):
        """The next queued item: waited for when nothing runs; taken only if there is one and the
        batch has room while something runs; None then."""
        scheduler = self._scheduler
        if not scheduler.busy:
            return self._jobs.get()
        if not scheduler.has_room() and not self._closed:  # closing: find the stop instruction now
            return None
        try:
            return self._jobs.get_nowait()
        except queue.Empty:
            return None

    def _work(self) -> None:
        scheduler = self._scheduler
        while True:
            item = self._next_item()
            if item is _STOP:
                scheduler.stop_all()
                return
            self._busy = True
            self._progress_at = time.monotonic()
            if item is _RECONNECT:
                self._reconnect_pending.clear()
                if self._unavailable_reason is not None or self._connection_lost():
                    self._try_reconnect()
            elif item is not None:
                self._dequeued()
                if item.cancelled:
                    self.end_unstarted(item, FINISH_CANCELLED, None)
                else:
                    scheduler.start(item)
                self._busy = scheduler.busy
                continue  # take what else waits while there is room, then step
            if scheduler.busy:
                self._steps += 1
                try:
                    scheduler.step()
                except Exception as exc:  # a bug here must not kill the only worker and hang every request
                    log.exception("engine failure in a batch step")
                    for run in list(scheduler.runs):
                        scheduler.fail_internal(run, exc)
                self._progress_at = time.monotonic()
            self._busy = scheduler.busy

    def job_ended(self) -> None:
        self._ended += 1
        self._progress_at = time.monotonic()

    def end_unstarted(self, job: Job, reason: str, error: EngineError | None) -> None:
        self.metrics.record_finish(reason, len(job.choices))
        self.metrics.e2e_latency.observe(time.monotonic() - job.submitted_at)
        self.job_ended()
        if error is not None:
            job.sink(error)

    def source_problem(self, job: Job) -> EngineError | None:
        """Before a request starts: None when the expert source is usable (reconnected first when
        it was lost), else the error to end the request with."""
        if (self._unavailable_reason is not None or self._connection_lost()) and not self._try_reconnect():
            return self._unavailable_error(job, self._unavailable_reason, None)
        return None

    def _connection_lost(self) -> bool:
        """Whether the source's connection is gone (then it is the reason until a reconnect)."""
        lost = source_hooks.connection_problem(self.expert_source)
        if lost is None:
            return False
        log.info("expert source connection lost: %s; reconnecting", lost)
        self._unavailable_reason = lost
        return True

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

    def _unavailable_error(self, job: Job, reason: str, cause: BaseException | None) -> EngineError:
        self.metrics.expert_source_unavailable.inc()
        error = ExpertSourceUnavailableError(f"request {job.request_id}: the expert source is unavailable "
                                             f"({reason}); retry later")
        error.__cause__ = cause
        return error

    def _storage_failure(self, job: Job, error: Exception) -> EngineError | None:
        """Data loss or a full cache in the expert source: counted, logged with the source's own
        words (which object, which file), answered without them; the source stays healthy."""
        lost = source_hooks.find_data_loss(error, self.expert_source)
        if lost is not None:
            self.metrics.expert_data_loss.inc()
            log.error("request %s: expert data loss: %s", job.request_id, lost)
            return ExpertDataLossError(job.request_id)
        full = source_hooks.find_capacity_exhausted(error, self.expert_source)
        if full is not None:
            self.metrics.expert_capacity_exhausted.inc()
            log.warning("request %s: the expert cache has no room: %s", job.request_id, full)
            return ExpertCapacityExhaustedError(job.request_id)
        return None

    def failure(self, job: Job, error: Exception) -> EngineError:
        """The error a request that failed with `error` ends with: the expert source unavailable
        (then reconnected once), data loss or a full cache, or an internal error."""
        source = self.expert_source
        unavailable = source_hooks.find_unavailable(error, source)
        if unavailable is None:
            storage = self._storage_failure(job, error)
            if storage is not None:
                return storage
            log.error("request %s failed", job.request_id, exc_info=error)
            return EngineInternalError(job.request_id, error)
        self._unavailable_reason = str(unavailable)
        log.warning("request %s: expert source unavailable: %s", job.request_id, unavailable)
        self._try_reconnect()  # before answering, so that a client retrying at once finds it done
        return self._unavailable_error(job, str(unavailable), error)
