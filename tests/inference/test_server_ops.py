"""What an operator relies on, live: API keys (401), CORS (preflight 204), one JSON access log line per
request, /tokenize and /detokenize, /version, abandoned requests in the metrics, and systemd's notify
protocol (READY=1, WATCHDOG=1 pings, STOPPING=1)."""

from __future__ import annotations

import json
import signal
import socket
import time
import urllib.parse

import openai
import pytest
from notify_testkit import NotifyReceiver
from test_engine_fixtures import tiny_bundle
from test_server_fixtures import (ServerProcess, access_lines, get, metric, openai_client, request_with_headers,
                                  settled_access_count)

from inference.cli import main as inference_main

MODEL = "ops-moe"
KEYS = {"flag": "k-flag-1", "file": "k-file-2", "env": "k-env-3"}
ORIGIN = "https://app.example.com"
WATCHDOG_USEC = 400_000  # pings every 0.2 s


@pytest.fixture(scope="module")
def notify(tmp_path_factory):
    receiver = NotifyReceiver(tmp_path_factory.mktemp("notify") / "notify.sock")
    yield receiver
    receiver.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory, notify):
    key_file = tmp_path_factory.mktemp("keys") / "keys"
    key_file.write_text(f"# rotated monthly\n{KEYS['file']}\n")
    process = ServerProcess(tiny_bundle(tmp_path_factory), "--api-key", KEYS["flag"], "--api-key-file", str(key_file),
                            "--allowed-origins", f"{ORIGIN},https://other.example", "--log-format", "json",
                            model_name=MODEL, healthy=False,
                            env={"INFERENCE_API_KEY": KEYS["env"], "NOTIFY_SOCKET": notify.path,
                                 "WATCHDOG_USEC": str(WATCHDOG_USEC)})
    process.wait_healthy()
    yield process
    if process.process.poll() is None:
        assert process.stop(signal.SIGINT) == 0, "".join(process.lines)


def call(server, method: str, path: str, body=None, key: str | None = KEYS["flag"], **headers):
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    return request_with_headers(method, server.base_url + path, data, headers)


def test_ready_is_sent_once_the_model_is_loaded(server, notify):
    ready = next(m for m in iter(notify.next, None) if "READY" in m)
    assert ready["READY"] == "1" and ready["STATUS"] == f"serving {MODEL} on {server.base_url}"


@pytest.mark.parametrize("key", list(KEYS.values()), ids=list(KEYS))
def test_each_configured_key_is_accepted(server, key):
    with openai_client(server, api_key=key) as client:
        reply = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0)
        assert reply.usage.completion_tokens == 2


def test_a_missing_or_wrong_key_gets_401(server):
    with openai_client(server, api_key="not-a-key") as client:
        with pytest.raises(openai.AuthenticationError) as caught:
            client.models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    for path, body in [("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
                       ("/v1/models", None), ("/tokenize", {"prompt": "x"}), ("/nowhere", None)]:
        status, reply, headers = call(server, "POST" if body else "GET", path, body, key=None)
        assert status == 401 and reply["error"]["code"] == "invalid_api_key", path
        assert headers["WWW-Authenticate"].startswith("Bearer")
    for path in ("/health", "/metrics", "/version"):  # probes and scrapers need no key
        assert call(server, "GET", path, key=None)[0] == 200


def test_cors_preflight_and_response_headers(server):
    status, _, headers = call(server, "OPTIONS", "/v1/chat/completions", key=None, Origin=ORIGIN,
                              **{"Access-Control-Request-Method": "POST",
                                 "Access-Control-Request-Headers": "authorization, content-type, x-stainless-os"})
    assert status == 204
    assert headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Headers"] == "authorization, content-type, x-stainless-os"
    refused = call(server, "OPTIONS", "/v1/chat/completions", key=None, Origin="https://evil.example",
                   **{"Access-Control-Request-Method": "POST"})
    assert refused[0] == 403 and "Access-Control-Allow-Origin" not in refused[2]
    ok = call(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}, Origin=ORIGIN)
    assert ok[0] == 200 and ok[2]["Access-Control-Allow-Origin"] == ORIGIN and "Origin" in ok[2]["Vary"]
    denied = call(server, "GET", "/v1/models", key=None, Origin=ORIGIN)  # the browser may read the error
    assert denied[0] == 401 and denied[2]["Access-Control-Allow-Origin"] == ORIGIN
    streamed = call(server, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stream": True}, Origin=ORIGIN)
    assert streamed[0] == 200 and streamed[2]["Access-Control-Allow-Origin"] == ORIGIN
    assert "Access-Control-Allow-Origin" not in call(server, "GET", "/health", key=None)[2]  # no Origin, no CORS


def test_one_json_access_line_per_request(server):
    before = settled_access_count(server.lines)
    completion = {"prompt": "hi", "max_tokens": 3, "temperature": 0, "user": "bob"}
    calls = [("POST", "/v1/completions", completion, KEYS["flag"]),
             ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, KEYS["flag"]),
             ("GET", "/v1/models", None, None), ("GET", "/health", None, None)]
    for method, path, body, key in calls:
        call(server, method, path, body, key=key)
    time.sleep(0.3)  # the server's output reaches the reader thread
    lines = [json.loads(line) for line in access_lines(server.lines)[before:]]
    assert [(e["method"], e["path"], e["status"]) for e in lines] == [
        ("POST", "/v1/completions", 200), ("POST", "/v1/completions", 400), ("GET", "/v1/models", 401),
        ("GET", "/health", 200)]
    first = lines[0]
    assert first["prompt_tokens"] > 0 and first["completion_tokens"] == 3 and first["user"] == "bob"
    assert first["level"] == "info" and first["logger"] == "inference.access" and first["latency_seconds"] > 0
    assert first["id"].startswith("cmpl-") and first["remote"] == "127.0.0.1"


def test_tokenize_and_detokenize_in_vllms_shapes(server):
    status, reply, _ = call(server, "POST", "/tokenize", {"model": MODEL, "prompt": "The old library",
                                                           "return_token_strs": True})
    assert status == 200 and set(reply) == {"count", "max_model_len", "tokens", "token_strs"}
    assert reply["count"] == len(reply["tokens"]) == len(reply["token_strs"]) and reply["max_model_len"] == 4096
    assert reply["tokens"][0] == 1  # BOS, as a completion prompt is encoded
    assert call(server, "POST", "/detokenize", {"tokens": reply["tokens"]})[1] == {"prompt": "<|bos|>The old library"}
    chat = call(server, "POST", "/tokenize", {"messages": [{"role": "user", "content": "hi"}]})[1]
    assert chat["token_strs"] is None
    assert call(server, "POST", "/detokenize", {"tokens": chat["tokens"]})[1]["prompt"] == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"  # special tokens shown: what the model reads
    refusals = [("/tokenize", {"prompt": 5}, "prompt"), ("/tokenize", {"prompt": "x", "messages": []}, "prompt"),
                ("/tokenize", {"prompt": "x", "tools": []}, "tools"), ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
                ("/detokenize", {"tokens": "1"}, "tokens")]
    for path, body, param in refusals:
        status, reply, _ = call(server, "POST", path, body)
        assert status == 400 and reply["error"]["param"] == param, (path, body)


def test_version_endpoint_and_command(server, capsys):
    assert call(server, "GET", "/version", key=None)[1] == {"version": "0.1.0"}
    # in this process: `python -m inference` itself is what every ServerProcess runs
    with pytest.raises(SystemExit) as exited:
        inference_main(["--version"])
    assert exited.value.code == 0 and capsys.readouterr().out.strip() == "inference 0.1.0"


def test_a_client_that_leaves_a_non_streamed_request_is_counted(server):
    def metrics():
        return get(server.base_url + "/metrics")[1]

    before = metrics()
    body = json.dumps({"model": MODEL, "prompt": "hello world", "max_tokens": 3000, "temperature": 0}).encode()
    url = urllib.parse.urlparse(server.base_url)
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {KEYS['flag']}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while metric(metrics(), "expertpack_inference_requests_running") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    deadline = time.monotonic() + 30
    while metric(metrics(), "expertpack_inference_requests_running") > 0:  # the engine stops the orphan
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = metrics()

    def grew(name, **labels):
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("expertpack_inference_requests_total", endpoint="/v1/completions", status="499") == 1
    assert grew("expertpack_inference_finish_reason_total", finish_reason="cancelled") == 1
    assert grew("expertpack_inference_time_to_first_token_seconds_count") == 1
    assert grew("expertpack_inference_e2e_request_latency_seconds_count") == 1
    assert 0 < grew("expertpack_inference_generated_tokens_total") < 3000


def test_watchdog_pings_then_stopping_on_sigterm(server, notify):
    notify.drain()
    messages = notify.collect(1.0)
    pings = [m for m in messages if m == {"WATCHDOG": "1"}]
    assert 2 <= len(pings) <= 8, messages  # about one per 0.2 s while idle
    server.process.send_signal(signal.SIGTERM)
    stopping = next(m for m in iter(notify.next, None) if "STOPPING" in m)
    assert stopping["STOPPING"] == "1" and stopping["STATUS"].startswith("draining")
    assert server.process.wait(30) == 0
