"""storaged stopped (SIGKILL, SIGTERM) and restarted on the same socket, under StoragedExpertSource and the engine."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch
from test_storaged_source_fixtures import (
    PROMPT,
    StoragedDaemon,
    greedy,
    qwen_case,  # noqa: F401  (the fixture)
    cases_dir,  # noqa: F401  (the fixture)
)

from inference.engine import Engine, ExpertSourceUnavailableError, Finished, SamplingParams
from inference.engine.source_hooks import find_unavailable
from inference.experts import LocalPackSource
from inference.experts.storaged_source import StoragedExpertSource
from inference.model import load_model
from storaged.client import Unavailable

pytestmark = pytest.mark.usefixtures("one_thread")
PARAMS = SamplingParams(max_tokens=24, temperature=0.0)


def engine_text(engine: Engine, params: SamplingParams = PARAMS) -> str:
    text = []
    for event in engine.generate(PROMPT[0], params):
        if not isinstance(event, Finished):
            text.append(event.text)
    return "".join(text)


@pytest.fixture(scope="module")
def expected(qwen_case):
    with load_model(qwen_case.bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        engine = Engine.from_loaded(local)
        try:
            return greedy(local.model), engine_text(engine)
        finally:
            engine.close()


@pytest.mark.slow  # daemons stopped and restarted under a loaded model: 12-18 s
def test_killed_daemon_is_unavailable_until_restarted_then_reconnect_matches_again(qwen_case, expected):
    daemon = StoragedDaemon({"qwen": qwen_case.bundle})
    loaded = load_model(qwen_case.bundle, device="cpu", dtype=torch.float32,
                        expert_source=lambda bundle, device: StoragedExpertSource(str(daemon.socket), "qwen",
                                                                                  bundle, device))
    source = loaded.expert_source
    try:
        assert greedy(loaded.model) == expected[0]
        first_session = source._session
        daemon.kill()
        assert daemon.process.returncode == -signal.SIGKILL
        with pytest.raises(Exception) as failure:  # noqa: PT011 - whatever transformers wraps it in
            greedy(loaded.model)
        assert isinstance(find_unavailable(failure.value, source), Unavailable), failure.value
        assert not source.is_available()
        with pytest.raises(Unavailable):
            source.reconnect()  # still down
        with pytest.raises(Unavailable, match="no session"):
            greedy(loaded.model)  # the failed reconnect left no session behind
        daemon.start()
        source.reconnect()
        assert source.is_available()
        assert source._session.arena is not first_session.arena  # the new daemon's arena is mapped
        assert greedy(loaded.model) == expected[0]
        assert daemon.stats().sessions == 1
    finally:
        source.close()
        loaded.close()
        daemon.stop()


@pytest.mark.slow  # daemons stopped and restarted under a loaded model: 12-18 s
def test_engine_fails_the_request_in_flight_with_503_cause_and_recovers_after_restart(qwen_case, expected):
    daemon = StoragedDaemon({"qwen": qwen_case.bundle})
    loaded = load_model(qwen_case.bundle, device="cpu", dtype=torch.float32,
                        expert_source=lambda bundle, device: StoragedExpertSource(str(daemon.socket), "qwen",
                                                                                  bundle, device))
    engine = Engine.from_loaded(loaded)
    try:
        assert engine_text(engine) == expected[1]
        events = engine.generate(PROMPT[0], SamplingParams(max_tokens=2000, temperature=0.0))
        for _ in range(3):
            next(events)
        daemon.kill()  # mid-request: the next layer's acquire finds the stream gone
        with pytest.raises(ExpertSourceUnavailableError) as failure:
            for _ in events:
                pass
        assert isinstance(find_unavailable(failure.value.__cause__, loaded.expert_source), Unavailable)
        with pytest.raises(ExpertSourceUnavailableError):
            engine_text(engine)  # still down: refused after one more reconnect attempt
        daemon.start()
        assert engine_text(engine) == expected[1]  # the engine reconnected before running it
        assert engine.metrics.expert_source_unavailable._value.get() == 2
    finally:
        engine.close()
        loaded.expert_source.close()
        loaded.close()
        daemon.stop()


@pytest.mark.slow  # daemons stopped and restarted under a loaded model: 12-18 s
@pytest.mark.parametrize("stop", ["terminate", "kill"])
def test_idle_restart_is_reported_by_health_and_the_next_request_reattaches(qwen_case, expected, stop):
    """storaged stopped (SIGTERM or SIGKILL) and restarted while nothing runs: /health says so and
    reconnects, and a request arriving after the restart re-attaches first instead of failing."""
    daemon = StoragedDaemon({"qwen": qwen_case.bundle})
    loaded = load_model(qwen_case.bundle, device="cpu", dtype=torch.float32,
                        expert_source=lambda bundle, device: StoragedExpertSource(str(daemon.socket), "qwen",
                                                                                  bundle, device))
    source = loaded.expert_source
    engine = Engine.from_loaded(loaded)
    try:
        assert engine_text(engine) == expected[1]
        assert asyncio.run(engine.health()).ok
        first_session = source._session.id
        getattr(daemon, stop)()
        assert source.connection_problem() is not None  # seen at once, without sending anything
        health = asyncio.run(engine.health())
        assert not health.ok and "connection lost" in health.reason and str(daemon.socket) in health.reason
        daemon.start()
        # /health had a reconnect queued: it reports ok once the worker re-attached.
        deadline = time.monotonic() + 60
        while not (health := asyncio.run(engine.health())).ok:
            assert time.monotonic() < deadline, health
            time.sleep(0.05)
        assert source._session.id != first_session and source.connection_problem() is None
        assert engine_text(engine) == expected[1]
        # Again, with no /health in between: the request itself re-attaches, then runs.
        second_session = source._session.id
        getattr(daemon, stop)()
        daemon.start()
        assert engine_text(engine) == expected[1]
        assert source._session.id != second_session
        assert engine.metrics.expert_source_unavailable._value.get() == 0  # no request failed
        assert daemon.stats().sessions == 1
    finally:
        engine.close()
        source.close()
        loaded.close()
        daemon.stop()
