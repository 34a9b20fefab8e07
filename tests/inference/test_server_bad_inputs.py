"""Bad HTTP input, row by row, against a live `inference serve`: the status, `param` and `code` each
row must get, a short message whatever was sent, and no traceback in the server's log.

Integers out of every range (a seed past int64, 10^30 tokens, a 5000-digit number), strings of
100 KB, and prompts of 10 MB, which must be refused by their length before they are tokenized
(the message says so: a prompt refused after tokenizing is described in tokens, not characters).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_engine_fixtures import tiny_bundle
from test_server_fixtures import REPO, ServerProcess, request_with_headers, serving

MODEL = "tiny-moe"
CONTEXT = 256  # --max-model-len: the prompt length bound is a few tens of thousands of characters
TEN_MB = "ab " * (10_000_000 // 3)
HUGE = "x" * 100_000
MAX_MESSAGE = 600  # characters of an error message: short whatever the request held


KEY = "bad-input-table-key"
AUTHORIZED = {"Authorization": f"Bearer {KEY}"}


@dataclass(frozen=True)
class Row:
    name: str
    path: str
    body: dict | list | bytes | None
    status: int
    param: str | None = None
    code: str | None = None
    needle: str = ""
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = tuple(AUTHORIZED.items())


def completion(**fields) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 1, **fields}


def chat(content="hello", **fields) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 1, **fields}


def refused(name: str, path: str, body, param: str, needle: str = "") -> Row:
    """A 400 naming `param`, without an error code."""
    return Row(name, path, body, 400, param, None, needle)


COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
SEED_NEEDLE = "64-bit signed integer"
TOO_LONG = "context_length_exceeded"
ROWS = [
    # seed: OpenAI's int64, refused outside it instead of folded modulo 2^64
    Row("seed 2^63", COMPLETIONS, completion(seed=2**63, temperature=1), 400, "seed", None, SEED_NEEDLE),
    Row("seed -2^63 - 1", COMPLETIONS, completion(seed=-2**63 - 1, temperature=1), 400, "seed", None, SEED_NEEDLE),
    Row("chat seed 2^64", CHAT, chat(seed=2**64, temperature=1), 400, "seed", None, SEED_NEEDLE),
    Row("seed 2^63 - 1", COMPLETIONS, completion(seed=2**63 - 1, temperature=1), 200),
    Row("seed -2^63", COMPLETIONS, completion(seed=-2**63, temperature=1), 200),
    Row("seed of 5000 digits", COMPLETIONS, b'{"prompt": "hi", "seed": 1' + b"0" * 5000 + b"}", 400, None, None,
        "not valid JSON"),
    # other integers far out of range
    Row("max_tokens 10^30", COMPLETIONS, completion(max_tokens=10**30), 400, "max_tokens", TOO_LONG),
    Row("n 10^30", COMPLETIONS, completion(n=10**30), 400, "n"),
    Row("logprobs 10^30", COMPLETIONS, completion(logprobs=10**30), 400, "logprobs"),
    Row("top_logprobs 10^30", CHAT, chat(logprobs=True, top_logprobs=10**30), 400, "top_logprobs"),
    Row("top_k -2^70", COMPLETIONS, completion(top_k=-2**70), 400, "top_k"),
    Row("min_tokens 10^30", COMPLETIONS, completion(min_tokens=10**30), 400, "min_tokens"),
    Row("stop_token_ids 2^70", COMPLETIONS, completion(stop_token_ids=[2**70]), 400, "stop_token_ids", None,
        "outside the vocabulary"),
    Row("prompt token 2^70", COMPLETIONS, completion(prompt=[2**70]), 400, "prompt", None, "outside the vocabulary"),
    Row("logit_bias token 2^70", COMPLETIONS, completion(logit_bias={str(2**70): 1}), 400, "logit_bias", None,
        "outside the vocabulary"),
    # client strings echoed, cut short
    Row("100 KB model name", COMPLETIONS, completion(model=HUGE), 404, "model", "model_not_found",
        "(100000 characters) does not exist"),
    Row("100 KB temperature", COMPLETIONS, completion(temperature=HUGE), 400, "temperature", None,
        "(100000 characters)"),
    Row("100 KB role", CHAT, {"model": MODEL, "messages": [{"role": HUGE, "content": "hi"}]}, 400,
        "messages[0].role", None, "(100000 characters)"),
    # 10 MB prompts: refused by their length, before tokenizing
    Row("10 MB prompt", COMPLETIONS, completion(prompt=TEN_MB), 400, "prompt", TOO_LONG, "refused before tokenizing"),
    Row("10 MB second prompt", COMPLETIONS, completion(prompt=["hi", TEN_MB]), 400, "prompt", TOO_LONG,
        "refused before tokenizing"),
    Row("10 MB message", CHAT, chat(TEN_MB), 400, "messages", TOO_LONG, "refused before tokenizing"),
    Row("10 MB /tokenize prompt", "/tokenize", {"prompt": TEN_MB}, 400, "prompt", TOO_LONG,
        "refused before tokenizing"),
    Row("10 MB /tokenize messages", "/tokenize", {"messages": [{"role": "user", "content": TEN_MB}]}, 400,
        "messages", TOO_LONG, "refused before tokenizing"),
    # sampling fields out of their ranges, or of the wrong type
    refused("temperature -1", COMPLETIONS, completion(temperature=-1), "temperature", "[0, 2]"),
    refused("temperature 2.5", CHAT, chat(temperature=2.5), "temperature", "[0, 2]"),
    refused("temperature a string", COMPLETIONS, completion(temperature="hot"), "temperature", "a number"),
    refused("temperature true", COMPLETIONS, completion(temperature=True), "temperature", "a number"),
    refused("temperature NaN", COMPLETIONS, b'{"prompt": "hi", "temperature": NaN}', "temperature"),
    refused("temperature Infinity", COMPLETIONS, b'{"prompt": "hi", "temperature": Infinity}', "temperature"),
    refused("top_p 0", COMPLETIONS, completion(top_p=0), "top_p", "(0, 1]"),
    refused("top_p 1.5", CHAT, chat(top_p=1.5), "top_p", "(0, 1]"),
    refused("top_k 1.5", COMPLETIONS, completion(top_k=1.5), "top_k", "an integer"),
    refused("top_k -2", COMPLETIONS, completion(top_k=-2), "top_k"),
    refused("min_p 2", COMPLETIONS, completion(min_p=2), "min_p", "[0, 1]"),
    refused("min_p -0.1", CHAT, chat(min_p=-0.1), "min_p", "[0, 1]"),
    refused("repetition_penalty 0", COMPLETIONS, completion(repetition_penalty=0), "repetition_penalty"),
    refused("presence_penalty 3", COMPLETIONS, completion(presence_penalty=3), "presence_penalty", "[-2, 2]"),
    refused("frequency_penalty -3", CHAT, chat(frequency_penalty=-3), "frequency_penalty", "[-2, 2]"),
    refused("logit_bias value 1000", COMPLETIONS, completion(logit_bias={"1": 1000}), "logit_bias", "[-100, 100]"),
    refused("logit_bias key not a number", COMPLETIONS, completion(logit_bias={"abc": 1}), "logit_bias", "token ids"),
    refused("logit_bias value a string", CHAT, chat(logit_bias={"1": "x"}), "logit_bias", "numbers"),
    refused("logit_bias a list", COMPLETIONS, completion(logit_bias=[1, 2]), "logit_bias"),
    refused("seed 1.5", COMPLETIONS, completion(seed=1.5), "seed", "an integer"),
    refused("seed a string", CHAT, chat(seed="42"), "seed", "an integer"),
    refused("ignore_eos 1", COMPLETIONS, completion(ignore_eos=1), "ignore_eos", "a boolean"),
    refused("min_tokens above max_tokens", COMPLETIONS, completion(min_tokens=5), "min_tokens", "max_tokens=1"),
    refused("stop empty", COMPLETIONS, completion(stop=""), "stop"),
    refused("stop a number", CHAT, chat(stop=[1]), "stop"),
    refused("stop_token_ids a string", COMPLETIONS, completion(stop_token_ids="2"), "stop_token_ids"),
    # counts and lengths
    refused("max_tokens 0", COMPLETIONS, completion(max_tokens=0), "max_tokens", "at least 1"),
    refused("max_tokens -1", CHAT, chat(max_tokens=-1), "max_tokens", "at least 1"),
    refused("max_tokens a string", COMPLETIONS, completion(max_tokens="10"), "max_tokens", "an integer"),
    refused("max_completion_tokens 0", CHAT, chat(max_completion_tokens=0), "max_completion_tokens"),
    Row("max_tokens past the context", COMPLETIONS, completion(max_tokens=CONTEXT + 1), 400, "max_tokens", TOO_LONG),
    refused("n 0", COMPLETIONS, completion(n=0), "n"),
    refused("n 129", CHAT, chat(n=129), "n", "[1, 128]"),
    refused("n x prompts 130", COMPLETIONS, completion(prompt=["hi"] * 65, n=2), "n", "[1, 128]"),
    refused("logprobs 21", COMPLETIONS, completion(logprobs=21), "logprobs"),
    refused("chat logprobs 1", CHAT, chat(logprobs=1), "logprobs", "a boolean"),
    refused("top_logprobs without logprobs", CHAT, chat(top_logprobs=2), "top_logprobs", "needs 'logprobs'"),
    # streaming options
    refused("stream a string", COMPLETIONS, completion(stream="yes"), "stream", "a boolean"),
    refused("stream_options without stream", CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
    refused("stream_options unknown", CHAT, chat(stream=True, stream_options={"x": True}), "stream_options.x"),
    refused("stream_options.include_usage 1", COMPLETIONS, completion(stream=True, stream_options={"include_usage": 1}),
            "stream_options.include_usage", "a boolean"),
    refused("continuous_usage_stats alone", CHAT, chat(stream=True, stream_options={"continuous_usage_stats": True}),
            "stream_options.continuous_usage_stats"),
    # prompts
    refused("prompt missing", COMPLETIONS, {"model": MODEL}, "prompt"),
    refused("prompt empty list", COMPLETIONS, completion(prompt=[]), "prompt"),
    refused("prompt an object", COMPLETIONS, completion(prompt={"text": "hi"}), "prompt"),
    refused("prompt list with an empty list", COMPLETIONS, completion(prompt=[[]]), "prompt"),
    refused("prompt token -1", COMPLETIONS, completion(prompt=[-1]), "prompt", "outside the vocabulary"),
    refused("prompt token a float", COMPLETIONS, completion(prompt=[[1.5]]), "prompt"),
    Row("prompt of tokens past the context", COMPLETIONS, completion(prompt=[1] * (CONTEXT + 1)), 400, "prompt",
        TOO_LONG),
    # chat messages
    refused("messages missing", CHAT, {"model": MODEL}, "messages", "is required"),
    refused("messages empty", CHAT, chat() | {"messages": []}, "messages"),
    refused("messages a string", CHAT, chat() | {"messages": "hi"}, "messages"),
    refused("message not an object", CHAT, chat() | {"messages": ["hi"]}, "messages[0]"),
    refused("message without a role", CHAT, chat() | {"messages": [{"content": "hi"}]}, "messages[0].role"),
    refused("message role bogus", CHAT, chat() | {"messages": [{"role": "boss", "content": "hi"}]}, "messages[0].role"),
    refused("message content a number", CHAT, chat(content=7), "messages[0].content"),
    refused("message content empty list", CHAT, chat(content=[]), "messages[0].content"),
    refused("message image part", CHAT, chat(content=[{"type": "image_url", "image_url": {"url": "x"}}]),
            "messages[0].content[0]", "only text parts"),
    refused("message name a number", CHAT, chat() | {"messages": [{"role": "user", "content": "hi", "name": 3}]},
            "messages[0].name"),
    refused("user message with tool calls", CHAT,
            chat() | {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]}, "messages[0].tool_calls"),
    refused("tool calls not a list", CHAT,
            chat() | {"messages": [{"role": "assistant", "content": "", "tool_calls": {}}]}, "messages[0].tool_calls"),
    refused("tool call without a function", CHAT,
            chat() | {"messages": [{"role": "assistant", "tool_calls": [{"type": "function"}]}]},
            "messages[0].tool_calls[0].function"),
    refused("tool call arguments not JSON", CHAT,
            chat() | {"messages": [{"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
            "messages[0].tool_calls[0].function.arguments", "not valid JSON"),
    refused("tool call arguments nested 100,000 deep", CHAT,
            chat() | {"messages": [{"role": "assistant", "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "[" * 100_000 + "]" * 100_000}}]}]},
            "messages[0].tool_calls[0].function.arguments", "nested too deeply"),
    refused("tool message without a call id", CHAT, chat() | {"messages": [{"role": "tool", "content": "42"}]},
            "messages[0].tool_call_id"),
    refused("chat_template_kwargs a list", CHAT, chat(chat_template_kwargs=[1]), "chat_template_kwargs"),
    refused("add_generation_prompt a string", CHAT, chat(add_generation_prompt="no"), "add_generation_prompt"),
    # fields this server refuses, and fields of the wrong type
    refused("tools for a template that renders none", CHAT, chat(tools=[{"type": "function", "function": {"name": "f"}}]),
            "tools", "does not render tools"),
    refused("response_format an unknown schema type", CHAT, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}), "response_format.json_schema.schema", "Invalid type"),
    refused("echo true", COMPLETIONS, completion(echo=True), "echo"),
    refused("best_of 2", COMPLETIONS, completion(best_of=2), "best_of"),
    refused("suffix", COMPLETIONS, completion(suffix="end"), "suffix"),
    refused("use_beam_search", COMPLETIONS, completion(use_beam_search=True), "use_beam_search"),
    refused("guided_json", CHAT, chat(guided_json={"type": "object"}), "guided_json"),
    refused("model a number", COMPLETIONS, completion(model=3), "model", "a string"),
    refused("request_id 200 characters", COMPLETIONS, completion(request_id="r" * 200), "request_id"),
    refused("request_id with a newline", CHAT, chat(request_id="a\nb"), "request_id"),
    Row("another model", CHAT, chat(model="gpt-4o"), 404, "model", "model_not_found", "does not exist"),
    # /tokenize and /detokenize
    refused("/tokenize neither prompt nor messages", "/tokenize", {}, "prompt"),
    refused("/tokenize both", "/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    refused("/tokenize prompt a list", "/tokenize", {"prompt": [1, 2]}, "prompt"),
    refused("/tokenize unknown field", "/tokenize", {"prompt": "a", "temperature": 1}, "temperature", "unknown"),
    refused("/tokenize add_special_tokens a string", "/tokenize", {"prompt": "a", "add_special_tokens": "yes"},
            "add_special_tokens"),
    Row("/tokenize another model", "/tokenize", {"model": "x", "prompt": "a"}, 404, "model", "model_not_found"),
    refused("/detokenize tokens a string", "/detokenize", {"tokens": "1 2"}, "tokens"),
    refused("/detokenize token 2^70", "/detokenize", {"tokens": [2**70]}, "tokens", "outside the vocabulary"),
    refused("/detokenize token -1", "/detokenize", {"tokens": [-1]}, "tokens", "outside the vocabulary"),
    refused("/detokenize unknown field", "/detokenize", {"tokens": [1], "x": 1}, "x", "unknown"),
    # keys, methods and paths
    Row("no key", COMPLETIONS, completion(), 401, None, "invalid_api_key", headers=()),
    Row("a wrong key", COMPLETIONS, completion(), 401, None, "invalid_api_key",
        headers=(("Authorization", "Bearer nope"),)),
    Row("a 4 KB key", CHAT, chat(), 401, None, "invalid_api_key", headers=(("Authorization", "Bearer " + "k" * 4000),)),
    # aiohttp's parser refuses a header line of more than 8190 bytes itself, in a short text reply
    Row("a 100 KB key", CHAT, chat(), 400, None, None, "Got more than 8190 bytes",
        headers=(("Authorization", "Bearer " + HUGE),)),
    Row("GET a POST path", COMPLETIONS, None, 405, method="GET"),
    Row("DELETE a model", "/v1/models/" + MODEL, None, 405, method="DELETE"),
    Row("an unknown path", "/v1/embeddings", completion(), 404, None, None, "Not Found: POST /v1/embeddings"),
    Row("a 4 KB unknown path", "/v1/" + "p" * 4000, completion(), 404, None, None, "(4004 characters)"),
    Row("a 4 KB model path", "/v1/models/" + "m" * 4000, None, 404, "model", "model_not_found",
        "(4000 characters) does not exist", method="GET"),
    Row("a 100 KB model path", "/v1/models/" + "m" * 100_000, None, 400, None, None, "Got more than 8190 bytes",
        method="GET"),
    # not a request at all
    Row("a body over 64 MiB", COMPLETIONS, b'{"prompt": "' + b"a" * (64 << 20) + b'"}', 413, None, None,
        f"Maximum request body size {64 << 20} exceeded"),
    refused("an empty body", COMPLETIONS, b"", None, "not valid JSON"),
    refused("JSON null", CHAT, b"null", None, "must be a JSON object"),
    refused("a JSON string", COMPLETIONS, b'"hello"', None, "must be a JSON object"),
    refused("not UTF-8", CHAT, b'{"messages": "\xff\xfe"}', None, "not valid JSON"),
    refused("nested 100,000 deep", COMPLETIONS, b"[" * 100_000 + b"]" * 100_000, None, "nested too deeply"),
    refused("a prompt nested 100,000 deep", COMPLETIONS,
            b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
    Row("not JSON", COMPLETIONS, b"{prompt: hi", 400, None, None, "not valid JSON"),
    Row("a JSON list", COMPLETIONS, [1, 2], 400, None, None, "must be a JSON object"),
]


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return tiny_bundle(tmp_path_factory)


@pytest.fixture(scope="module")
def server(bundle):
    with serving(bundle, "--max-model-len", str(CONTEXT), "--api-key", KEY, model_name=MODEL) as process:
        yield process


def server_paths(bundle: Path) -> list[str]:
    """The server's own directories: none may appear in what a client reads."""
    return [str(bundle), str(bundle.parent), str(REPO)]


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_bad_input_gets_its_status_and_no_traceback(server, bundle, row):
    body = row.body if isinstance(row.body, bytes | None) else json.dumps(row.body).encode()
    seen = len(server.lines)
    status, reply, _ = request_with_headers(row.method, server.base_url + row.path, body, dict(row.headers))
    assert status == row.status, reply
    assert not [p for p in server_paths(bundle) if p in str(reply)], reply
    if isinstance(reply, str):  # refused by aiohttp's HTTP parser, before the application
        assert row.needle in reply and len(reply) <= MAX_MESSAGE, reply
    elif row.status != 200:
        error = reply["error"]
        assert (error["param"], error["code"]) == (row.param, row.code), error
        assert row.needle in error["message"] and len(error["message"]) <= MAX_MESSAGE, error["message"]
        assert (error["type"] == "server_error") == (row.status >= 500), error
    assert not [line for line in server.lines[seen:] if "Traceback" in line or " ERROR " in line]


def authorized_post(server: ServerProcess, path: str, body: dict) -> tuple[int, dict]:
    return request_with_headers("POST", server.base_url + path, json.dumps(body).encode(), AUTHORIZED)[:2]


def test_the_length_bound_names_its_limit(server):
    status, reply = authorized_post(server, COMPLETIONS, completion(prompt=TEN_MB))
    message = reply["error"]["message"]
    assert status == 400 and message.startswith(f"prompt: {len(TEN_MB)} characters cannot fit this model's "
                                                f"context of {CONTEXT} tokens (the limit is "), message
    limit = int(message.split("the limit is ")[1].split()[0])
    assert limit < len(TEN_MB)
    # a prompt under the bound is tokenized, and then refused in tokens if it is still too long
    status, reply = authorized_post(server, COMPLETIONS, completion(prompt="ab " * CONTEXT))
    assert status == 400 and "tokens; this model's context is" in reply["error"]["message"], reply
