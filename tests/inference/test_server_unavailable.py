"""The expert source goes away under the server: 503 with an OpenAI error, /health follows, recovery.

The server runs in this process (aiohttp on a thread of its own) so that the test can hold the
switch of its expert source, a test double of the storaged daemon raising storaged's real
Unavailable error.
"""

from __future__ import annotations

import asyncio
import threading
import time

import openai
import pytest
import torch
from aiohttp import web
from test_engine_fixtures import FlakyDaemonSource, qwen_bundle  # noqa: F401  (fixtures)
from test_server_fixtures import get, metric, metric_values, openai_client, post

from inference.engine import Engine, EngineMetrics
from inference.model import load_model
from inference.server import ServerState, create_app

MODEL = "flaky-moe"
CHAT = [{"role": "user", "content": "Is the disk up?"}]
pytestmark = pytest.mark.usefixtures("one_thread")


class InProcessServer:
    """create_app's application on 127.0.0.1:<free port>, served from a background event loop."""

    def __init__(self, state: ServerState):
        self.state = state
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        host, port = asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        self.base_url = f"http://{host}:{port}"

    async def _start(self):
        self._runner = web.AppRunner(create_app(self.state), handler_cancellation=True, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        return self._runner.addresses[0][:2]

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture
def flaky_server(qwen_bundle):
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=FlakyDaemonSource) as loaded:
        metrics = EngineMetrics()
        state = ServerState(model_name=MODEL, metrics=metrics, engine=Engine.from_loaded(loaded, metrics=metrics))
        server = InProcessServer(state)
        yield server, loaded.expert_source
        server.close()
        state.engine.close()


@pytest.fixture
def client(flaky_server):
    server, _ = flaky_server
    with openai_client(server) as client:
        yield client


def wait_for_health(base_url: str, status: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (reply := get(base_url + "/health"))[0] != status:
        assert time.monotonic() < deadline, reply
        time.sleep(0.02)
    return reply[1]


def test_daemon_down_gives_503_then_requests_succeed_again(flaky_server, client):
    server, source = flaky_server
    expected = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)

    source.up = False
    for stream in (False, True):
        with pytest.raises(openai.InternalServerError) as caught:
            reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0,
                                                   stream=stream)
            list(reply) if stream else None
        assert caught.value.status_code == 503
        assert caught.value.response.headers["Retry-After"] == "1"
        error = caught.value.body
        assert error["type"] == "service_unavailable_error" and error["code"] == "expert_source_unavailable"
        assert "expert source is unavailable" in error["message"] and "UNAVAILABLE" in error["message"]
    assert source.reconnects >= 2
    health = wait_for_health(server.base_url, 503)
    assert health["status"] == "unavailable" and "unavailable" in health["reason"]

    source.up = True  # the daemon is back: /health makes the engine reconnect
    wait_for_health(server.base_url, 200)
    again = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=8, temperature=0)
    assert again.choices[0].message.content == expected.choices[0].message.content

    metrics = metric_values(get(server.base_url + "/metrics")[1])
    assert metric(metrics, "expertpack_inference_requests_total", endpoint="/v1/chat/completions", status="503") == 2
    assert metric(metrics, "expertpack_inference_expert_source_unavailable_total") == 2
    assert metric(metrics, "expertpack_inference_expert_wait_seconds_total") == pytest.approx(source.wait_seconds)


def test_daemon_lost_mid_stream_ends_the_stream_with_an_error(flaky_server, client):
    server, source = flaky_server
    source.fail_after = 2 * 4  # two MoE layers: prefill and three decode steps succeed
    chunks = []
    with pytest.raises(openai.APIError, match="expert source is unavailable"):
        for chunk in client.completions.create(model=MODEL, prompt="The weather", max_tokens=50, temperature=0,
                                               stream=True):
            chunks.append(chunk)
    assert chunks and all(c.choices[0].finish_reason is None for c in chunks)
    source.up = True
    wait_for_health(server.base_url, 200)
    assert post(server.base_url + "/v1/completions", {"prompt": "x", "max_tokens": 3})[0] == 200


def test_health_is_503_while_the_model_loads(qwen_bundle):
    state = ServerState(model_name=MODEL, metrics=EngineMetrics())
    server = InProcessServer(state)
    try:
        status, reply = get(server.base_url + "/health")
        assert status == 503 and reply["reason"] == "model loading"
        status, reply = post(server.base_url + "/v1/completions", {"prompt": "x"})
        assert status == 503 and reply["error"]["code"] == "model_not_loaded"
        state.load_error = "DenseWeightsError: missing (1): model.norm.weight"
        assert "model.norm.weight" in get(server.base_url + "/health")[1]["reason"]
    finally:
        server.close()
