"""Continuous batching: the running requests, their choices admitted as sequences, stepped together.

A request's choices join the running batch as sequences while fewer than `max_num_seqs` run, in
submission order (a request of n choices may have some running and some waiting for room). Each
step runs one forward of every running sequence (inference.engine.batch: a decode token, or the
next chunk of a prompt still being prefilled), then samples each; a sequence that ends leaves the
batch at once and the next waiting choice takes its place before the next step. Cancellation and
request timeouts are checked before every step.

The scheduler runs on the engine's worker thread only; the engine owns the queue, the expert
source's state and the failure classification, and calls `start`, `step` and `stop_all`.
"""

from __future__ import annotations

import collections
import dataclasses
import time

from inference.engine import source_hooks
from inference.engine.batch import BatchStepper
from inference.engine.errors import RequestTimeoutError
from inference.engine.job import Job
from inference.engine.sequence import FINISH_CANCELLED, Sequence

FINISH_TIMEOUT, FINISH_ERROR = "timeout", "error"  # finish reasons of the metrics only
SERVICE_TIME_WEIGHT = 0.2  # of the latest request in the moving average of run times
DEFAULT_MAX_NUM_SEQS = 16
DEFAULT_PREFILL_CHUNK = 512


@dataclasses.dataclass(eq=False)
class _Run:
    """A started request: choices waiting for room, those running, and how many have not ended."""

    job: Job
    waiting: collections.deque
    sequences: dict[int, Sequence]
    left: int
    ended: bool = False


class Scheduler:
    def __init__(self, engine, *, max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
                 prefill_chunk: int | None = DEFAULT_PREFILL_CHUNK):
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        self.engine = engine
        self.runner = engine.runner
        self.metrics = engine.metrics
        self.max_num_seqs = max_num_seqs
        self.prefill_chunk = prefill_chunk
        self.stepper = BatchStepper(self.runner.model, max_num_seqs)
        self.runs: list[_Run] = []  # started requests, in start order
        self.mean_service_seconds = 1.0  # moving average of a request's run time: a 429's Retry-After

    @property
    def busy(self) -> bool:
        return bool(self.runs)

    def sequences(self) -> int:
        return sum(len(run.sequences) for run in self.runs)

    def has_room(self) -> bool:
        """Whether another request may start now: a place is free once every started choice has
        one. Started choices are admitted in start order, so a request started now never runs
        before one started earlier; and every request that arrived while a step ran joins the next
        step together (their prefills share its expert reads), not one request per step."""
        return self.sequences() + sum(len(run.waiting) for run in self.runs) < self.max_num_seqs

    # --- requests starting and ending ---------------------------------------------------------

    def start(self, job: Job) -> None:
        """Start a dequeued request (its choices join the batch as room allows), or end it at once:
        timed out while waiting, or the expert source unavailable."""
        engine = self.engine
        if job.timed_out():
            engine.end_unstarted(job, FINISH_TIMEOUT, RequestTimeoutError(job.request_id, job.timeout, waiting=True))
            return
        problem = engine.source_problem(job)
        if problem is not None:
            engine.end_unstarted(job, FINISH_ERROR, problem)
            return
        job.started_at = time.monotonic()
        self.metrics.queue_time.observe(job.started_at - job.submitted_at)
        self.metrics.running.inc()
        self.runs.append(_Run(job, collections.deque(range(len(job.choices))), {}, len(job.choices)))

    def _end(self, run: _Run, last_event: object) -> None:
        # metrics first: whoever receives the last event may read them at once
        run.ended = True
        self.runs.remove(run)
        self.metrics.running.dec()
        ended = time.monotonic()
        job = run.job
        self.metrics.e2e_latency.observe(ended - job.submitted_at)
        self.mean_service_seconds += SERVICE_TIME_WEIGHT * (ended - job.started_at - self.mean_service_seconds)
        self.engine.job_ended()
        if last_event is not None:
            job.sink(last_event)

    def _record(self, outcome, reason: str | None = None) -> None:
        if outcome.index == 0 and outcome.time_to_first_token is not None:
            self.metrics.time_to_first_token.observe(outcome.time_to_first_token)
        self.metrics.record_choice(outcome, reason)

    def _choice_done(self, run: _Run, sequence: Sequence) -> None:
        outcome = sequence.finish()
        self._record(outcome)
        del run.sequences[sequence.index]
        run.left -= 1
        if run.left:
            run.job.sink(outcome)
        else:
            self._end(run, outcome)

    def _stop(self, run: _Run) -> None:
        """End a cancelled or timed-out request: its running choices end as they are."""
        job = run.job
        timed_out = job.timed_out() and not job.cancelled
        reason = FINISH_TIMEOUT if timed_out else FINISH_CANCELLED
        outcomes = []
        for sequence in run.sequences.values():
            sequence.cancel()
            outcomes.append(sequence.finish())
            self._record(outcomes[-1], reason)
        self.metrics.record_finish(reason, len(run.waiting))
        if timed_out:
            self._end(run, RequestTimeoutError(job.request_id, job.timeout, waiting=False))
        else:  # the client is gone (or the engine is shutting down): a cancelled end is all it gets
            self._end(run, outcomes[0] if outcomes else None)

    def _fail(self, run: _Run, error: Exception) -> None:
        for sequence in run.sequences.values():
            sequence.fail()
        self.metrics.record_finish(FINISH_ERROR, run.left)
        self._end(run, self.engine.failure(run.job, error))

    def fail_internal(self, run: _Run, error: Exception) -> None:
        """End a request after an unexpected failure of the step itself (a bug)."""
        if not run.ended:
            self._fail(run, error)

    def stop_all(self) -> None:
        """Cancel and end every started request (the engine is shutting down)."""
        for run in list(self.runs):
            run.job.cancel()
            self._stop(run)
        self.stepper.close()

    # --- one step -----------------------------------------------------------------------------

    def _admit(self) -> None:
        alone = self.sequences() == 0 and sum(len(r.waiting) for r in self.runs) == 1 and not self.engine.waiting
        admitted = 0
        for run in self.runs:
            while run.waiting and self.sequences() < self.max_num_seqs:
                index = run.waiting.popleft()
                choice = run.job.choices[index]
                run.sequences[index] = self.runner.sequence(
                    choice.prompt_ids, choice.params, emit=run.job.sink, submitted_at=run.job.submitted_at,
                    index=index, static=alone, prefill_chunk=self.prefill_chunk)
                admitted += 1
        if admitted and not alone:
            # A sequence admitted alone on the static decoder would step apart from the batch,
            # with expert acquisitions of its own every step: it joins the batch instead.
            for run in self.runs:
                for sequence in run.sequences.values():
                    if sequence.leave_static():
                        self.metrics.static_left.inc()

    def step(self) -> None:
        """Stop what was cancelled or timed out, fill free places, run one forward of every running
        sequence, then sample each; end the choices and requests that are done."""
        for run in [r for r in self.runs if r.job.cancelled or r.job.timed_out()]:
            self._stop(run)
        self._admit()
        running = [(run, sequence) for run in self.runs for sequence in run.sequences.values()]
        if not running:
            return
        source = self.engine.expert_source
        wait_before = source_hooks.expert_wait_seconds(source)
        failed = self.stepper.step([sequence for _, sequence in running])
        shared = next((e for e in failed.values() if source_hooks.find_unavailable(e, source) is not None), None)
        if shared is not None:  # the source every forward shares went away (or revoked the step): all void
            failed = {sequence: failed.get(sequence, shared) for _, sequence in running}
        wait_after = source_hooks.expert_wait_seconds(source)
        if wait_before is not None and wait_after is not None and wait_after > wait_before:
            self.metrics.expert_wait_seconds.inc(wait_after - wait_before)
        for run, sequence in running:
            if run.ended:  # a sibling choice failed this step
                continue
            if sequence in failed:
                self._fail(run, failed[sequence])
                continue
            try:
                sequence.advance()
            except Exception as exc:
                self._fail(run, exc)
                continue
            if sequence.done:
                self._choice_done(run, sequence)
