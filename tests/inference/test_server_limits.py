"""The server's limits, live: --max-model-len, --max-tokens, --max-queue (429 with Retry-After under a
flood) and --request-timeout (408), through the official openai client."""

from __future__ import annotations

import concurrent.futures
import time

import openai
import pytest
from test_engine_fixtures import tiny_bundle
from test_server_fixtures import get, metric, openai_client, post, serving

MODEL = "tiny-moe"
LOOP = "hello world"  # greedy never reaches EOS from here
REQUEST_TIMEOUT = 4.0  # the 408 test's limit


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    with serving(tiny_bundle(tmp_path_factory), "--max-model-len", "256", "--max-tokens", "40",
                 "--log-level", "warning", model_name=MODEL) as process:
        yield process


@pytest.fixture(scope="module")
def queued(tmp_path_factory):
    with serving(tiny_bundle(tmp_path_factory), "--max-queue", "2", "--request-timeout", str(REQUEST_TIMEOUT),
                 model_name=MODEL) as process:
        yield process


@pytest.fixture(scope="module")
def flooded(tmp_path_factory):
    # no request timeout: on a loaded machine the two requests that wait behind the blocker can
    # take longer than the 408 test's few seconds to be served, and must not time out here
    # one sequence at a time: the blocker runs, two wait, the rest are refused
    with serving(tiny_bundle(tmp_path_factory), "--max-queue", "2", "--max-num-seqs", "1", model_name=MODEL) as process:
        yield process


def test_max_tokens_is_a_cap_and_the_default(capped):
    client = openai_client(capped)
    capped = client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=40)
    assert capped.usage.completion_tokens == 40
    default = client.completions.create(model=MODEL, prompt=LOOP, temperature=0)
    assert default.usage.completion_tokens == 40 and default.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=41)
    assert caught.value.body["param"] == "max_tokens" and "--max-tokens" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       max_completion_tokens=41)
    assert caught.value.body["param"] == "max_completion_tokens"


def test_max_model_len_bounds_prompt_and_completion(capped):
    client = openai_client(capped)
    assert [m.model_dump().get("max_model_len") for m in client.models.list().data] == [256]
    assert post(capped.base_url + "/tokenize", {"prompt": "hi"})[1]["max_model_len"] == 256
    prompt = [5] * 240
    filled = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, extra_body={"ignore_eos": True})
    assert filled.usage.completion_tokens == 16  # exactly the context
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=17)
    assert caught.value.body["code"] == "context_length_exceeded" and caught.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=MODEL, prompt=[5] * 256, max_tokens=1)
    assert caught.value.body["param"] == "prompt"


def test_log_level_warning_silences_the_info_lines(capped):
    assert get(capped.base_url + "/health")[0] == 200
    time.sleep(0.2)
    assert not any(" INFO " in line for line in capped.lines), "".join(capped.lines)


def wait_running(server) -> None:
    deadline = time.monotonic() + 30
    while metric(get(server.base_url + "/metrics")[1], "expertpack_inference_requests_running") < 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.slow  # starts its own server process and floods it: ~25 s
def test_a_flood_beyond_the_queue_gets_429_with_retry_after(flooded):
    queued = flooded
    client = openai_client(queued)
    before = metric(get(queued.base_url + "/metrics")[1], "expertpack_inference_queue_full_total")
    blocker = client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=3000, stream=True)
    next(iter(blocker))  # generating: the worker is busy until this stream is closed
    wait_running(queued)

    def one(i):
        try:
            reply = client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=4)
            return reply.usage.completion_tokens
        except openai.RateLimitError as error:
            return error

    with concurrent.futures.ThreadPoolExecutor(10) as pool:
        futures = [pool.submit(one, i) for i in range(10)]
        refused = [f.result(30) for f in concurrent.futures.as_completed(futures, timeout=30)][:8]
        blocker.close()  # the batch's one place goes to the two that wait, in turn
        results = [f.result(30) for f in futures]
    assert all(isinstance(r, openai.RateLimitError) for r in refused)
    limited = [r for r in results if isinstance(r, openai.RateLimitError)]
    assert len(limited) == 8 and sorted(r for r in results if not isinstance(r, Exception)) == [4, 4]
    for error in limited:
        assert error.status_code == 429 and int(error.response.headers["Retry-After"]) >= 1
        assert error.body["code"] == "queue_full" and error.body["type"] == "rate_limit_error"
    after = metric(get(queued.base_url + "/metrics")[1], "expertpack_inference_queue_full_total")
    assert after - before == 8


@pytest.mark.slow  # starts its own server process and waits out a request's time limit: ~25 s
def test_a_request_past_its_time_limit_gets_408(queued):
    client = openai_client(queued)
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=4000)
    assert caught.value.status_code == 408 and caught.value.body["code"] == "request_timeout"
    assert REQUEST_TIMEOUT <= time.monotonic() - started < REQUEST_TIMEOUT + 5
    stream = client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=4000, stream=True)
    with pytest.raises(openai.APIError, match="request timeout"):
        for _ in stream:
            pass
    metrics = get(queued.base_url + "/metrics")[1]
    assert metric(metrics, "expertpack_inference_finish_reason_total", finish_reason="timeout") >= 2
    assert client.completions.create(model=MODEL, prompt=LOOP, temperature=0, max_tokens=3).usage.completion_tokens == 3
