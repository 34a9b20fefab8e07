"""`inference serve --storaged SOCKET` as a real subprocess, answering the official openai client."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time

import openai
import pytest
import torch
from test_server_fixtures import get, metric, metric_values
from test_storaged_source_fixtures import (
    REPO,
    StoragedDaemon,
    qwen_case,  # noqa: F401  (the fixture)
    cases_dir,  # noqa: F401  (the fixture)
)

from inference.engine import Engine, Finished, SamplingParams, encode_chat
from inference.experts import LocalPackSource
from inference.model import load_model

STARTUP_SECONDS = 120  # importing torch and transformers on a loaded 2-core CI machine
MESSAGES = [{"role": "user", "content": "Say something about experts."}]
MAX_TOKENS = 12


class StoragedServer:
    """`python -m inference serve --storaged SOCKET --port 0`, its address read from its output."""

    def __init__(self, bundle, socket, model_name: str):
        command = [sys.executable, "-m", "inference", "serve", "--bundle", str(bundle), "--storaged", str(socket),
                   "--storaged-model", model_name, "--port", "0", "--dtype", "float32", "--torch-threads", "1"]
        self.process = subprocess.Popen(command, cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self.base_url = ""
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.monotonic() + STARTUP_SECONDS
        while not self.base_url or get(self.base_url + "/health")[0] != 200:
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.process.kill()
                raise RuntimeError("server never became healthy:\n" + "".join(self.lines))
            time.sleep(0.1)

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            match = re.search(r"serving '[^']*' on (http://\S+)", line)
            if match:
                self.base_url = match.group(1)

    def stop(self) -> int:
        self.process.terminate()
        return self.process.wait(60)


def local_answer(bundle) -> str:
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        engine = Engine.from_loaded(local)
        try:
            events = engine.generate(encode_chat(engine.tokenizer, MESSAGES),
                                     SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))
            return "".join(e.text for e in events if not isinstance(e, Finished))
        finally:
            engine.close()


@pytest.fixture(scope="module")
def daemon(qwen_case):
    daemon = StoragedDaemon({"demo-model": qwen_case.bundle})
    yield daemon
    daemon.stop()


@pytest.mark.slow  # a daemon and a server process: ~18 s; test_storaged_source.py and the storage-fault server keep storaged-backed inference in the fast loop
def test_serve_with_storaged_answers_the_openai_client_like_the_local_pack(qwen_case, daemon):
    server = StoragedServer(qwen_case.bundle, daemon.socket, "demo-model")
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120)
        reply = client.chat.completions.create(model=qwen_case.name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                               temperature=0)
        assert reply.choices[0].message.content == local_answer(qwen_case.bundle)
        assert reply.usage.completion_tokens == MAX_TOKENS
        stats = daemon.stats()
        assert stats.sessions == 1 and stats.acquires > 0
        metrics = metric_values(get(server.base_url + "/metrics")[1])
        assert metric(metrics, "expertpack_inference_expert_wait_seconds_total") > 0
        assert server.stop() == 0, "".join(server.lines)
        assert daemon.stats().sessions == 0  # the server's exit ended its session
    finally:
        if server.process.poll() is None:
            server.process.kill()


@pytest.mark.slow
def test_idle_restarts_of_storaged_first_request_after_health_succeeds(qwen_case):
    """10 cycles: storaged stopped while the server is idle (SIGTERM and SIGKILL in turn) and
    restarted on the same socket. /health answers 503 while it is down, then 200 once the server
    re-attached; the first request after that succeeds with the fault-free run's tokens."""
    daemon = StoragedDaemon({"demo-model": qwen_case.bundle})
    server = StoragedServer(qwen_case.bundle, daemon.socket, "demo-model")
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", timeout=120, max_retries=0)

    def answer() -> tuple[str, int, tuple]:
        """The reply's text, its token count, and its tokens (each token's text and bytes)."""
        reply = client.chat.completions.create(model=qwen_case.name, messages=MESSAGES, max_tokens=MAX_TOKENS,
                                               temperature=0, logprobs=True)
        choice = reply.choices[0]
        tokens = tuple((t.token, tuple(t.bytes)) for t in choice.logprobs.content)
        return choice.message.content, reply.usage.completion_tokens, tokens

    try:
        fault_free = answer()
        assert fault_free[:2] == (local_answer(qwen_case.bundle), MAX_TOKENS) and len(fault_free[2]) == MAX_TOKENS
        outcomes = []
        for cycle in range(10):
            if cycle % 2:
                daemon.kill()
            else:
                daemon.terminate()
            status, body = get(server.base_url + "/health")
            assert status == 503 and "connection lost" in body["reason"], body  # seen at once, while idle
            daemon.start()
            deadline = time.monotonic() + 60
            while (health := get(server.base_url + "/health"))[0] != 200:
                assert time.monotonic() < deadline, health
                time.sleep(0.05)
            outcomes.append(answer())  # raises on a 503: the first request after /health 200
        assert outcomes == [fault_free] * 10
        metrics = metric_values(get(server.base_url + "/metrics")[1])
        assert metric(metrics, "expertpack_inference_expert_source_unavailable_total") == 0
        assert daemon.stats().sessions == 1
        assert server.stop() == 0, "".join(server.lines)
    finally:
        client.close()
        if server.process.poll() is None:
            server.process.kill()
        daemon.stop()
