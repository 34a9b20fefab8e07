"""`inference serve` as a process: graceful SIGTERM with a request in flight, and a failed load."""

from __future__ import annotations

import concurrent.futures
import signal
import subprocess
import sys
import time

import pytest

from test_engine_fixtures import tiny_bundle
from test_server_fixtures import REPO, ServerProcess, get, metric, post


@pytest.mark.slow  # a server process decoding 1500 tokens: ~30 s
def test_sigterm_lets_the_running_request_finish_then_exits_cleanly(tmp_path_factory):
    server = ServerProcess(tiny_bundle(tmp_path_factory))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            # greedy on the tiny random model falls into a loop that never emits EOS: ~2 s of decoding
            body = {"prompt": "hello world", "max_tokens": 1500, "temperature": 0}
            reply = pool.submit(post, server.base_url + "/v1/completions", body)
            deadline = time.monotonic() + 60
            while metric(get(server.base_url + "/metrics")[1], "expertpack_inference_requests_running") < 1:
                assert time.monotonic() < deadline and not reply.done()
                time.sleep(0.02)
            assert server.stop(signal.SIGTERM) == 0, "".join(server.lines)
            status, completion = reply.result(60)
        assert status == 200, completion
        assert completion["usage"]["completion_tokens"] == 1500
        assert completion["choices"][0]["finish_reason"] == "length"
        assert get(server.base_url + "/health")[0] == 0  # nobody listens any more
        assert any("shutting down" in line for line in server.lines)
    finally:
        server.kill()


@pytest.mark.slow  # `inference serve` in a subprocess: ~20 s
def test_a_model_that_cannot_load_ends_serve_with_status_1(tmp_path_factory):
    command = [sys.executable, "-m", "inference", "serve", "--bundle", str(tiny_bundle(tmp_path_factory)),
               "--port", "0", "--storaged", "/nonexistent/storaged.sock"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    assert "storaged expert source is not available" in result.stderr


@pytest.mark.slow  # a server process decoding until the second signal: ~20 s
def test_a_second_signal_exits_at_once(tmp_path_factory):
    server = ServerProcess(tiny_bundle(tmp_path_factory))
    try:
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            body = {"prompt": "hello world", "max_tokens": 3000, "temperature": 0}  # ~5 s of decoding
            reply = pool.submit(post, server.base_url + "/v1/completions", body)
            deadline = time.monotonic() + 60
            while metric(get(server.base_url + "/metrics")[1], "expertpack_inference_requests_running") < 1:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            server.process.send_signal(signal.SIGINT)
            time.sleep(0.2)
            assert server.stop(signal.SIGINT, timeout=10) == 130
            assert not reply.result(60)[0] == 200  # the connection died with the process
    finally:
        server.kill()
