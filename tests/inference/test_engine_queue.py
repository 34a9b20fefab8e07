"""The engine's queue and worker: concurrency, order, cancellation, shutdown, an expert source that goes
away and comes back, and the metrics all of that records."""

from __future__ import annotations

import asyncio
import queue
import time

import pytest
import torch
from test_engine_fixtures import FlakyDaemonSource, engine, loaded, qwen_bundle  # noqa: F401

from inference.engine import (
    Choice,
    Engine,
    EngineClosedError,
    EngineError,
    EngineInternalError,
    ExpertSourceUnavailableError,
    Finished,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
    SamplingParams,
    TextDelta,
    encode_completion_prompt,
)
from inference.model import load_model
from storaged.client.errors import Unavailable

pytestmark = pytest.mark.usefixtures("one_thread")


def sample(name: str, engine: Engine, **labels) -> float:
    value = engine.metrics.registry.get_sample_value(f"expertpack_inference_{name}",
                                                     {"model": engine.metrics.model, **labels})
    return 0.0 if value is None else value


def finish(engine: Engine, prompt_ids, **params) -> Finished:
    return list(engine.generate(prompt_ids, SamplingParams(**params)))[-1]


@pytest.fixture
def prompt_ids(loaded):
    return encode_completion_prompt(loaded.tokenizer, "A cache is useful only when")


def test_concurrent_streams_all_finish_with_their_own_tokens(engine, prompt_ids):
    requests = [dict(max_tokens=12, temperature=0)] + [dict(max_tokens=12, temperature=1.0, seed=s) for s in range(5)]
    expected = [finish(engine, prompt_ids, **r).token_ids for r in requests]
    tokens_before = sample("generated_tokens_total", engine)
    ttft_before = sample("time_to_first_token_seconds_count", engine)

    async def one(request):
        events = [e async for e in engine.stream(prompt_ids, SamplingParams(**request))]
        assert "".join(e.text for e in events[:-1]) == events[-1].text
        return events[-1].token_ids

    async def all_at_once():
        return await asyncio.gather(*(one(r) for r in requests))

    assert asyncio.run(all_at_once()) == expected
    assert sample("generated_tokens_total", engine) - tokens_before == 12 * len(requests)
    assert sample("time_to_first_token_seconds_count", engine) - ttft_before == len(requests)
    assert sample("decode_seconds_total", engine) > 0
    assert sample("queue_depth", engine) == 0 and sample("requests_running", engine) == 0


def test_with_one_sequence_requests_run_one_at_a_time_in_submission_order(limited, prompt_ids):
    engine = limited(max_num_seqs=1)
    ends: queue.SimpleQueue = queue.SimpleQueue()
    names = ["a", "b", "c", "d"]
    for tokens, name in zip((12, 3, 9, 1), names):  # one at a time: ends in order whatever the lengths
        engine.submit(prompt_ids, SamplingParams(max_tokens=tokens, temperature=0),
                      lambda event, name=name: isinstance(event, Finished) and ends.put(name), request_id=name)
    assert [ends.get(timeout=30) for _ in names] == names


def test_a_cancelled_request_stops_and_the_next_one_runs(engine, prompt_ids):
    events: queue.SimpleQueue = queue.SimpleQueue()
    job = None

    def sink(event):
        events.put(event)
        if isinstance(event, TextDelta):
            job.cancel()

    job = engine.submit(prompt_ids, SamplingParams(max_tokens=1000, temperature=0), sink)
    while not isinstance(last := events.get(timeout=30), Finished):
        pass
    assert last.finish_reason == "cancelled" and last.usage.completion_tokens < 1000
    assert finish(engine, prompt_ids, max_tokens=3, temperature=0).usage.completion_tokens == 3


def test_closing_the_async_stream_early_cancels_the_request(engine, prompt_ids):
    async def read_one_then_leave():
        stream = engine.stream(prompt_ids, SamplingParams(max_tokens=2000, temperature=0))
        first = await anext(stream)
        await stream.aclose()
        return first

    started = time.monotonic()
    assert isinstance(asyncio.run(read_one_then_leave()), TextDelta)
    finish(engine, prompt_ids, max_tokens=1, temperature=0)  # queued behind the cancelled one
    assert time.monotonic() - started < 2.0  # 2000 tokens take several seconds


@pytest.fixture
def flaky(qwen_bundle):
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=FlakyDaemonSource) as model:
        engine = Engine.from_loaded(model)
        yield engine, model.expert_source
        engine.close()


def health(engine: Engine):
    return asyncio.run(engine.health())


def wait_healthy(engine: Engine, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not (report := health(engine)).ok:
        assert time.monotonic() < deadline, report
        time.sleep(0.02)


def test_unavailable_source_fails_the_request_then_recovers(flaky, prompt_ids, engine):
    flaky_engine, source = flaky
    reference = finish(engine, prompt_ids, max_tokens=8, temperature=0).token_ids
    source.up = False
    with pytest.raises(ExpertSourceUnavailableError, match="expert source is unavailable") as caught:
        finish(flaky_engine, prompt_ids, max_tokens=8, temperature=0)
    assert isinstance(caught.value.__cause__, Unavailable)
    assert source.reconnects == 1  # asked right after the failure
    report = health(flaky_engine)
    assert not report.ok and "unavailable" in report.reason
    with pytest.raises(ExpertSourceUnavailableError):  # still down: refused after another reconnect try
        finish(flaky_engine, prompt_ids, max_tokens=8, temperature=0)
    assert source.reconnects >= 2
    assert sample("expert_source_unavailable_total", flaky_engine) == 2

    source.up = True
    wait_healthy(flaky_engine)  # health itself gets the engine to reconnect
    assert finish(flaky_engine, prompt_ids, max_tokens=8, temperature=0).token_ids == reference


def test_source_lost_mid_request_keeps_the_text_so_far_then_recovers(flaky, prompt_ids):
    flaky_engine, source = flaky
    source.fail_after = source.acquires + 2 * 3  # two MoE layers: prefill and two decode steps succeed
    seen = []
    with pytest.raises(ExpertSourceUnavailableError):
        for event in flaky_engine.generate(prompt_ids, SamplingParams(max_tokens=50, temperature=0)):
            seen.append(event)
    assert seen and all(isinstance(e, TextDelta) for e in seen)
    source.up = True
    assert finish(flaky_engine, prompt_ids, max_tokens=4, temperature=0).usage.completion_tokens == 4


def test_other_source_faults_are_internal_errors_and_the_engine_goes_on(flaky, prompt_ids):
    flaky_engine, source = flaky
    source.broken = OSError(5, "Input/output error")
    with pytest.raises(EngineInternalError, match="OSError.*Input/output error"):
        finish(flaky_engine, prompt_ids, max_tokens=4, temperature=0)
    assert health(flaky_engine).ok  # not an availability problem
    source.broken = None
    assert finish(flaky_engine, prompt_ids, max_tokens=4, temperature=0).finish_reason == "length"


def test_expert_wait_seconds_come_from_the_source_hook(flaky, prompt_ids):
    flaky_engine, source = flaky
    before_metric, before_source = sample("expert_wait_seconds_total", flaky_engine), source.wait_seconds
    finish(flaky_engine, prompt_ids, max_tokens=5, temperature=0)
    assert source.wait_seconds > before_source
    assert sample("expert_wait_seconds_total", flaky_engine) - before_metric == pytest.approx(
        source.wait_seconds - before_source)


def test_close_fails_queued_requests_and_refuses_new_ones(loaded, prompt_ids):
    closing = Engine.from_loaded(loaded, max_num_seqs=1)  # the second one waits
    outcomes: dict[str, queue.SimpleQueue] = {name: queue.SimpleQueue() for name in ("long", "queued")}
    closing.submit(prompt_ids, SamplingParams(max_tokens=3000, temperature=0), outcomes["long"].put)
    closing.submit(prompt_ids, SamplingParams(max_tokens=5, temperature=0), outcomes["queued"].put)
    first = outcomes["long"].get(timeout=30)  # the long one is running
    assert isinstance(first, TextDelta)
    closing.close()
    while not isinstance(last := outcomes["long"].get(timeout=30), Finished):
        pass
    assert last.finish_reason == "cancelled"
    assert isinstance(outcomes["queued"].get(timeout=30), EngineClosedError)
    with pytest.raises(EngineClosedError):
        closing.submit(prompt_ids, SamplingParams(max_tokens=5), lambda e: None)
    assert not health(closing).ok


# --- choices, limits, timeouts, liveness ---------------------------------------------------

def collect(engine: Engine, choices) -> list:
    async def run():
        return [e async for e in engine.stream_choices(choices)]
    return asyncio.run(run())


def test_choices_run_in_order_each_with_its_own_index(engine, prompt_ids):
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=40)
    alone = [finish(engine, prompt_ids, max_tokens=8, temperature=1.0, seed=40 + i).token_ids for i in range(3)]
    events = collect(engine, [Choice(prompt_ids, params.for_choice(i)) for i in range(3)])
    ends = [e for e in events if isinstance(e, Finished)]
    assert [e.index for e in ends] == [0, 1, 2] and [e.token_ids for e in ends] == alone
    for i, end in enumerate(ends):
        assert "".join(e.text for e in events if isinstance(e, TextDelta) and e.index == i) == end.text


@pytest.fixture
def limited(loaded):
    engines = []

    def make(**limits) -> Engine:
        engines.append(Engine.from_loaded(loaded, **limits))
        return engines[-1]
    yield make
    for made in engines:
        made.close()


def blocker(engine: Engine, prompt_ids) -> tuple:
    """A long request that is running when this returns; cancel it to free the worker."""
    events: queue.SimpleQueue = queue.SimpleQueue()
    job = engine.submit(prompt_ids, SamplingParams(max_tokens=3000, temperature=0), events.put)
    assert isinstance(events.get(timeout=30), TextDelta)
    return job, events


def test_a_full_queue_refuses_with_a_retry_hint(limited, prompt_ids):
    engine = limited(max_queue=2, max_num_seqs=1)
    job, _ = blocker(engine, prompt_ids)
    waiting = [queue.SimpleQueue() for _ in range(2)]
    for sink in waiting:
        engine.submit(prompt_ids, SamplingParams(max_tokens=2, temperature=0), sink.put)
    with pytest.raises(QueueFullError) as caught:
        engine.submit(prompt_ids, SamplingParams(max_tokens=2, temperature=0), lambda e: None)
    assert caught.value.retry_after > 0 and sample("queue_full_total", engine) == 1
    assert engine.waiting == 2
    job.cancel()
    for sink in waiting:
        while not isinstance(sink.get(timeout=30), Finished):
            pass
    assert sample("finish_reason_total", engine, finish_reason="cancelled") == 1
    assert sample("finish_reason_total", engine, finish_reason="length") == 2


def test_timeouts_while_generating_and_while_waiting(limited, prompt_ids):
    engine = limited(request_timeout=0.3, max_num_seqs=1)
    with pytest.raises(RequestTimeoutError, match="while generating"):
        finish(engine, prompt_ids, max_tokens=3000, temperature=0)
    engine.request_timeout = None
    job, _ = blocker(engine, prompt_ids)  # no deadline of its own
    engine.request_timeout = 0.2
    events: queue.SimpleQueue = queue.SimpleQueue()
    engine.submit(prompt_ids, SamplingParams(max_tokens=2, temperature=0), events.put)
    time.sleep(0.4)
    job.cancel()
    error = events.get(timeout=30)
    assert isinstance(error, RequestTimeoutError) and "while waiting" in str(error)
    assert sample("finish_reason_total", engine, finish_reason="timeout") == 2
    assert sample("time_to_first_token_seconds_count", engine) == 2  # the timed-out and the cancelled one


def test_max_model_len_bounds_the_context(loaded, prompt_ids):
    engine = Engine.from_loaded(loaded, max_model_len=len(prompt_ids) + 4)
    try:
        assert engine.runner.context_length == len(prompt_ids) + 4
        assert engine.runner.room_after(prompt_ids) == 4
        with pytest.raises(InvalidRequestError, match="exceed"):
            engine.submit(prompt_ids, SamplingParams(max_tokens=5), lambda e: None)
    finally:
        engine.close()
    with pytest.raises(EngineError, match="larger than this model's context"):
        Engine.from_loaded(loaded, max_model_len=10**6)


def test_liveness_moves_while_generating_and_is_idle_otherwise(engine, prompt_ids):
    idle = engine.liveness()
    assert idle.alive and not idle.busy
    job, _ = blocker(engine, prompt_ids)
    try:
        first = engine.liveness()
        time.sleep(0.05)
        second = engine.liveness()
        assert first.busy and second.busy and first.progress != second.progress
    finally:
        job.cancel()
