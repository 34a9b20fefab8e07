"""The systemd watchdog of `inference serve`: pings while the engine's worker is idle or makes
progress, none while it hangs inside a step (and /health says so), and they resume when it moves.

In-process: a real Engine over a real model whose expert source can hang (FlakyDaemonSource's
`flowing`), the real Notifier sending to a real datagram socket standing in for systemd.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest
import torch
from notify_testkit import NotifyReceiver
from test_engine_fixtures import FlakyDaemonSource, qwen_bundle  # noqa: F401  (fixtures)

from inference.engine import Engine, EngineMetrics, Finished, SamplingParams, encode_completion_prompt
from inference.model import load_model
from inference.server.state import ServerState
from inference.server.watchdog import EngineWatchdog
from servicekit.notify import Notifier

WATCHDOG_USEC = 200_000  # a check, and a ping if alive, every 0.1 s
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def watched(qwen_bundle, tmp_path):
    receiver = NotifyReceiver(tmp_path / "notify.sock")
    notifier = Notifier({"NOTIFY_SOCKET": receiver.path, "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=FlakyDaemonSource) as loaded:
        engine = Engine.from_loaded(loaded, stall_timeout=0.3)
        state = ServerState(model_name="m", metrics=EngineMetrics("m"), engine=engine)
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, daemon=True)
        thread.start()
        task = asyncio.run_coroutine_threadsafe(notifier.watchdog_forever(EngineWatchdog(state).alive), loop)
        try:
            yield engine, loaded.expert_source, receiver
        finally:
            loaded.expert_source.flowing.set()
            task.cancel()
            loop.call_soon_threadsafe(loop.stop)
            thread.join(10)
            engine.close()
            notifier.close()
            receiver.close()


def health(engine: Engine):
    return asyncio.run(engine.health())


def pings(receiver: NotifyReceiver, seconds: float) -> int:
    receiver.drain()
    return sum(m == {"WATCHDOG": "1"} for m in receiver.collect(seconds))


def test_pings_follow_the_workers_progress(watched):
    engine, source, receiver = watched
    assert pings(receiver, 0.5) >= 3  # idle
    prompt_ids = encode_completion_prompt(engine.tokenizer, "hello world")
    events: queue.SimpleQueue = queue.SimpleQueue()
    job = engine.submit(prompt_ids, SamplingParams(max_tokens=3000, temperature=0), events.put)
    events.get(timeout=30)  # generating
    assert pings(receiver, 0.5) >= 3  # busy, and every step moves the marker
    assert health(engine).ok
    source.flowing.clear()  # the next acquire hangs: the worker is stuck inside a step
    assert pings(receiver, 0.2) <= 2  # the check that saw the last progress may still ping once
    assert pings(receiver, 0.6) == 0
    health(engine)  # this poll may still see the acquisitions made since the previous one...
    time.sleep(0.4)
    report = health(engine)  # ...but none happened since: a hang
    assert not report.ok and "no progress" in report.reason
    source.flowing.set()
    assert pings(receiver, 0.5) >= 3
    assert health(engine).ok
    job.cancel()
    while not isinstance(events.get(timeout=30), Finished):
        pass
