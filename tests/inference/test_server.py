"""The OpenAI-compatible server as a real subprocess, driven with the official openai client (the
`server` and `client` fixtures: test_server_fixtures.py)."""

from __future__ import annotations

import concurrent.futures
import threading
import time

import openai
import pytest
from test_server_fixtures import MODEL, get, metric_values, post, request

CHAT = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Tell me about the weather."}]
PROMPT = "The market opens early. Farmers bring"


def test_models_list_names_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL


def test_chat_non_stream_reports_text_and_usage(client):
    reply = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, temperature=0)
    choice = reply.choices[0]
    assert reply.object == "chat.completion" and reply.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant" and isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert reply.usage.completion_tokens == 12
    assert reply.usage.prompt_tokens > 10 and reply.usage.total_tokens == reply.usage.prompt_tokens + 12


def test_chat_stream_equals_non_stream_and_ends_with_usage(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **args))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.model_dump() == whole.usage.model_dump() | {
        "completion_tokens_details": None, "prompt_tokens_details": None}
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_completions_stream_equals_non_stream(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=20, temperature=0)
    whole = client.completions.create(**args)
    chunks = list(client.completions.create(stream=True, **args))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason == "length"
    assert whole.usage.completion_tokens == 20


def test_stop_truncates_before_the_stop_string(client):
    args = dict(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
    full = client.completions.create(**args).choices[0].text
    stop = full[10:13]
    stopped = client.completions.create(stop=[stop, "not in there"], **args)
    assert stopped.choices[0].text == full[:full.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(stop=stop, stream=True, **args))
    assert "".join(c.choices[0].text for c in streamed) == full[:full.index(stop)]


def test_seed_makes_sampling_reproducible(client):
    def sampled(seed):
        return client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=16, temperature=1.0,
                                              top_p=0.9, seed=seed).choices[0].message.content

    assert sampled(7) == sampled(7)
    assert sampled(7) != sampled(8)


def test_concurrent_requests_all_succeed(client):
    expected = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text

    def one(i):
        if i % 2:
            chunks = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in chunks)
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0).choices[0].text

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, range(8))) == [expected] * 8


STREAMS = 8  # concurrent streams; the server's default --max-num-seqs (16) runs them in one batch
BATCH_PROMPTS = [f"Request {i}: the river {'runs ' * i}past the mill and" for i in range(STREAMS)]


def timed_stream(client, prompt: str, start: threading.Event | None = None) -> dict:
    """One greedy completion of 32 tokens streamed: its text and when its first and last chunks came."""
    if start is not None:
        start.wait()
    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=32, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    texts, first = [], None
    for chunk in chunks:
        if chunk.choices and chunk.choices[0].text:
            first = first if first is not None else time.monotonic()
            texts.append(chunk.choices[0].text)
    return {"text": "".join(texts), "first": first, "end": time.monotonic()}


def test_eight_concurrent_streams_overlap_and_each_equals_its_text_alone(client):
    alone = [timed_stream(client, prompt)["text"] for prompt in BATCH_PROMPTS]
    start = threading.Event()
    with concurrent.futures.ThreadPoolExecutor(STREAMS) as pool:
        futures = [pool.submit(timed_stream, client, prompt, start) for prompt in BATCH_PROMPTS]
        start.set()
        together = [f.result() for f in futures]
    assert [t["text"] for t in together] == alone  # float32 on the CPU: batching changes no greedy token
    # the 8th stream's first token came before the 1st stream (any stream) ended: they ran together
    assert max(t["first"] for t in together) < min(t["end"] for t in together)


CHAT_URL, COMPLETIONS_URL = "/v1/chat/completions", "/v1/completions"
GOOD_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
GOOD_COMPLETION = {"model": MODEL, "prompt": "hi"}
INVALID_REQUESTS = [
    # url, body, status, param
    (CHAT_URL, b"{not json", 400, None),
    (CHAT_URL, b"[1, 2]", 400, None),
    (CHAT_URL, {"model": MODEL}, 400, "messages"),
    (CHAT_URL, {**GOOD_CHAT, "messages": []}, 400, "messages"),
    (CHAT_URL, {**GOOD_CHAT, "messages": "hi"}, 400, "messages"),
    (CHAT_URL, {**GOOD_CHAT, "messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT_URL, {**GOOD_CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content"),
    (CHAT_URL, {**GOOD_CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]"),
    (CHAT_URL, {**GOOD_CHAT, "model": "gpt-4"}, 404, "model"),
    (CHAT_URL, {**GOOD_CHAT, "model": 3}, 400, "model"),
    (CHAT_URL, {**GOOD_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT_URL, {**GOOD_CHAT, "max_tokens": "ten"}, 400, "max_tokens"),
    (CHAT_URL, {**GOOD_CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens"),
    (CHAT_URL, {**GOOD_CHAT, "max_tokens": 5000}, 400, "max_tokens"),
    (CHAT_URL, {**GOOD_CHAT, "temperature": 2.5}, 400, "temperature"),
    (CHAT_URL, {**GOOD_CHAT, "temperature": -1}, 400, "temperature"),
    (CHAT_URL, {**GOOD_CHAT, "temperature": "hot"}, 400, "temperature"),
    (CHAT_URL, {**GOOD_CHAT, "top_p": 0}, 400, "top_p"),
    (CHAT_URL, {**GOOD_CHAT, "top_p": 1.1}, 400, "top_p"),
    (CHAT_URL, {**GOOD_CHAT, "n": 0}, 400, "n"),
    (CHAT_URL, {**GOOD_CHAT, "seed": "x"}, 400, "seed"),
    (CHAT_URL, {**GOOD_CHAT, "stop": 5}, 400, "stop"),
    (CHAT_URL, {**GOOD_CHAT, "stop": [""]}, 400, "stop"),
    (CHAT_URL, {**GOOD_CHAT, "stream": "yes"}, 400, "stream"),
    (CHAT_URL, {**GOOD_CHAT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (CHAT_URL, {**GOOD_CHAT, "logprobs": 3}, 400, "logprobs"),
    (CHAT_URL, {**GOOD_CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tools"),
    (CHAT_URL, {**GOOD_CHAT, "reasoning_effort": "high"}, 400, "reasoning_effort"),  # the template never reads it
    (CHAT_URL, {**GOOD_CHAT, "chat_template_kwargs": {"enable_thinking": False}}, 400,
     "chat_template_kwargs.enable_thinking"),
    (COMPLETIONS_URL, {"model": MODEL}, 400, "prompt"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "prompt": ["a", 5]}, 400, "prompt"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "prompt": [1, 100000]}, 400, "prompt"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "prompt": []}, 400, "prompt"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "prompt": [1.5]}, 400, "prompt"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "best_of": 3}, 400, "best_of"),
    (COMPLETIONS_URL, {**GOOD_COMPLETION, "echo": True}, 400, "echo"),
]


@pytest.mark.parametrize("url, body, status, param", INVALID_REQUESTS)
def test_invalid_requests_get_openai_errors(server, url, body, status, param):
    got_status, reply = post(server.base_url + url, body)
    assert got_status == status, reply
    error = reply["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert isinstance(error["message"], str) and error["message"]


def test_openai_client_raises_its_own_error_types(client):
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.create(model="gpt-4", messages=CHAT)
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:
        client.chat.completions.create(model=MODEL, messages=CHAT, response_format={"type": "yaml"})
    assert "response_format" in bad.value.message and bad.value.body["param"] == "response_format.type"


def test_unknown_routes_and_methods_are_json_errors(server):
    assert post(server.base_url + "/v1/embeddings", {})[0] == 404
    status, reply = get(server.base_url + "/v1/chat/completions")
    assert status == 405 and reply["error"]["type"] == "invalid_request_error"
    assert request("OPTIONS", server.base_url + "/v1/chat/completions")[0] == 204  # not a CORS preflight


def test_health(server):
    assert get(server.base_url + "/health") == (200, {"status": "ok", "reason": "ok"})


def test_metrics_are_exposed_and_move(server, client):
    before = metric_values(get(server.base_url + "/metrics")[1])
    client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0)
    post(server.base_url + CHAT_URL, {**GOOD_CHAT, "n": 0})
    status, text = get(server.base_url + "/metrics")
    assert status == 200
    after = metric_values(text)
    label = f'model="{MODEL}"'
    chat_ok = f'expertpack_inference_requests_total{{endpoint="/v1/chat/completions",{label},status="200"}}'
    chat_bad = f'expertpack_inference_requests_total{{endpoint="/v1/chat/completions",{label},status="400"}}'
    assert after[chat_ok] == before.get(chat_ok, 0) + 1
    assert after[chat_bad] == before.get(chat_bad, 0) + 1
    for name, least in [("generated_tokens_total", 6), ("time_to_first_token_seconds_count", 1),
                        ("e2e_request_latency_seconds_count", 1), ("request_queue_time_seconds_count", 1),
                        ("inter_token_latency_seconds_count", 5), ("decode_seconds_total", 0),
                        ("expert_wait_seconds_total", 0), ("prompt_tokens_total", 1)]:
        key = f"expertpack_inference_{name}{{{label}}}"
        assert after[key] - before.get(key, 0) >= least and after[key] > before.get(key, 0), name
    length = f'expertpack_inference_finish_reason_total{{finish_reason="length",{label}}}'
    assert after[length] == before.get(length, 0) + 1
    assert after[f"expertpack_inference_queue_depth{{{label}}}"] == 0


def test_without_max_tokens_generation_runs_until_eos(client):
    # greedy on this tiny model's "The weather" reaches EOS after a few dozen tokens
    reply = client.completions.create(model=MODEL, prompt="The weather", temperature=0)
    assert reply.choices[0].finish_reason == "stop"
    assert 0 < reply.usage.completion_tokens < 200
