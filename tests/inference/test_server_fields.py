"""Every request field of docs/inference.md's table, through the official openai client against a live
`inference serve`: each honoured field changes what it should, each refused one gets a 400 naming it.

The server's bundle has a Qwen3-like chat template (tool calls, enable_thinking, reasoning_effort)
and a generation_config.json with top_k 1 and max_new_tokens 24: requests that omit top_k are
greedy here, so the sampling tests set top_k=0 to sample.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from test_server_fixtures import REPO, access_lines, post, rich_bundle, serving

from inference.server.fields import FIELDS, HONOURED, REFUSED, TAG, markdown_table

MODEL = "rich-moe"
PROMPT = "The market opens early. Farmers bring"
LOOP = "hello world"  # greedy never reaches EOS from here
CHAT = [{"role": "user", "content": "Tell me about the weather."}]
EOS = 2
COVERED: dict[str, str] = {}  # field -> the test that shows it honoured


def covers(*names: str):
    def register(test):
        for name in names:
            COVERED[name] = test.__name__
        return test
    return register


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(rich_bundle(tmp_path_factory, {"top_k": 1, "max_new_tokens": 24}), model_name=MODEL) as process:
        yield process


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 12, **kwargs})


def complete(client, **kwargs):
    return client.completions.create(**{"model": MODEL, "prompt": PROMPT, "max_tokens": 12, **kwargs})


def tokenize(server, **body) -> dict:
    status, reply = post(server.base_url + "/tokenize", {"model": MODEL, **body})
    assert status == 200, reply
    return reply


def detokenize(server, tokens) -> str:
    status, reply = post(server.base_url + "/detokenize", {"model": MODEL, "tokens": tokens})
    assert status == 200, reply
    return reply["prompt"]


def one_token(server, text: str) -> int:
    tokens = tokenize(server, prompt=text, add_special_tokens=False)["tokens"]
    assert len(tokens) == 1, tokens
    return tokens[0]


# --- the request itself ---------------------------------------------------------------------

@covers("model")
def test_model_must_be_the_served_one(client):
    assert chat(client).model == MODEL
    with pytest.raises(openai.NotFoundError) as caught:
        chat(client, model="gpt-4o")
    assert caught.value.body["param"] == "model"


@covers("messages")
def test_tool_calls_in_the_history_reach_the_template(server, client):
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Oslo"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]
    tokenized = tokenize(server, messages=messages)
    text = detokenize(server, tokenized["tokens"])
    assert '<tool_call>{"name": "weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert '<tool_response id="call_1">-3 C</tool_response>' in text
    assert chat(client, messages=messages, max_tokens=2).usage.prompt_tokens == tokenized["count"]


@covers("prompt")
def test_several_prompts_give_a_choice_set_each(client):
    prompts = [PROMPT, "The weather this morning"]
    alone = [complete(client, prompt=p, max_tokens=6, temperature=0) for p in prompts]
    both = complete(client, prompt=prompts, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert both.usage.prompt_tokens == sum(r.usage.prompt_tokens for r in alone)
    assert both.usage.completion_tokens == 4 * 6


@covers("max_tokens", "max_completion_tokens")
def test_max_tokens_and_the_model_default(client):
    assert complete(client, prompt=LOOP, max_tokens=7).usage.completion_tokens == 7
    assert chat(client, max_tokens=None, max_completion_tokens=5).usage.completion_tokens == 5
    default = complete(client, prompt=LOOP, max_tokens=None)  # generation_config.json's max_new_tokens
    assert default.usage.completion_tokens == 24 and default.choices[0].finish_reason == "length"


@covers("temperature", "seed", "top_p")
def test_temperature_seed_and_top_p(client):
    def sampled(**kw):
        return chat(client, temperature=1.0, extra_body={"top_k": 0}, **kw).choices[0].message.content

    assert sampled(seed=7) == sampled(seed=7) != sampled(seed=8)
    greedy = chat(client, temperature=0).choices[0].message.content
    assert sampled(seed=7, top_p=1e-9) == sampled(seed=8, top_p=1e-9) == greedy


@covers("top_k")
def test_top_k_1_is_greedy_whatever_the_seed_and_the_model_default_applies(client):
    greedy = chat(client, temperature=0).choices[0].message.content
    explicit = {chat(client, temperature=1.0, extra_body={"top_k": 1}, seed=s).choices[0].message.content
                for s in (1, 2, 3)}
    inherited = {chat(client, temperature=1.0, seed=s).choices[0].message.content for s in (1, 2, 3)}
    free = {chat(client, temperature=1.0, extra_body={"top_k": 0}, seed=s).choices[0].message.content
            for s in (1, 2, 3)}
    assert explicit == inherited == {greedy} and len(free) == 3


@covers("min_p")
def test_min_p_1_keeps_only_the_top_token(client):
    greedy = chat(client, temperature=0).choices[0].message.content
    kept = {chat(client, temperature=1.0, extra_body={"top_k": 0, "min_p": 1.0}, seed=s).choices[0].message.content
            for s in (1, 2)}
    assert kept == {greedy}


@covers("stop")
def test_stop_ends_before_the_string(client):
    full = complete(client, max_tokens=30, temperature=0).choices[0].text
    stop = full[10:13]
    stopped = complete(client, max_tokens=30, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[:full.index(stop)] and stopped.choices[0].finish_reason == "stop"


@covers("n")
def test_n_choices_are_seeded_seed_plus_index(client):
    alone = [chat(client, temperature=1.0, extra_body={"top_k": 0}, seed=5 + i).choices[0].message.content
             for i in range(3)]
    many = chat(client, temperature=1.0, extra_body={"top_k": 0}, seed=5, n=3)
    assert [c.message.content for c in many.choices] == alone
    assert many.usage.prompt_tokens == chat(client, temperature=0).usage.prompt_tokens  # the prompt counts once


@covers("stream", "stream_options")
def test_stream_with_usage_in_every_chunk_and_n_choices(client):
    args = dict(temperature=1.0, seed=3, n=2, extra_body={"top_k": 0})
    whole = chat(client, **args)
    chunks = list(chat(client, stream=True, stream_options={"include_usage": True}, **args))
    for i in range(2):
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i)
        assert text == whole.choices[i].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    continuous = list(chat(client, stream=True, stream_options={"include_usage": True},
                           extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}}))
    counts = [c.usage.completion_tokens for c in continuous]
    assert all(c.usage is not None for c in continuous) and counts == sorted(counts) and counts[-1] == 12


@covers("presence_penalty", "frequency_penalty")
def test_penalties_break_greedy_loops(client):
    def distinct(**kw) -> int:
        reply = complete(client, prompt=LOOP, max_tokens=30, temperature=0, logprobs=0, **kw)
        return len(set(reply.choices[0].logprobs.tokens))

    plain = distinct()
    assert distinct(frequency_penalty=2.0) > plain and distinct(presence_penalty=2.0) > plain


@covers("repetition_penalty")
def test_repetition_penalty_changes_greedy_output(client):
    plain = complete(client, prompt=LOOP, max_tokens=30, temperature=0, logprobs=0).choices[0].logprobs.tokens
    penalised = complete(client, prompt=LOOP, max_tokens=30, temperature=0, logprobs=0,
                         extra_body={"repetition_penalty": 2.0}).choices[0].logprobs.tokens
    assert len(set(penalised)) > len(set(plain))


@covers("logit_bias")
def test_logit_bias_forces_a_token(server, client):
    token = one_token(server, "a")
    reply = complete(client, max_tokens=4, temperature=0, logit_bias={str(token): 100})
    assert reply.choices[0].text == detokenize(server, [token] * 4)
    banned = complete(client, max_tokens=1, temperature=0, logprobs=0).choices[0].logprobs.tokens[0]
    first = one_token(server, banned)
    other = complete(client, max_tokens=1, temperature=0, logprobs=0, logit_bias={str(first): -100})
    assert other.choices[0].logprobs.tokens[0] != banned


@covers("stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens")
def test_stop_token_ids_ignore_eos_min_tokens_skip_special_tokens(server, client):
    forced = {"logit_bias": {str(EOS): 100}}
    ended = complete(client, max_tokens=5, temperature=0, **forced)
    assert (ended.choices[0].finish_reason, ended.usage.completion_tokens, ended.choices[0].text) == ("stop", 1, "")
    ignored = complete(client, max_tokens=5, temperature=0, extra_body={"ignore_eos": True}, **forced)
    assert (ignored.choices[0].finish_reason, ignored.usage.completion_tokens) == ("length", 5)
    shown = complete(client, max_tokens=2, temperature=0, extra_body={"ignore_eos": True,
                                                                     "skip_special_tokens": False}, **forced)
    assert shown.choices[0].text == "<|eos|><|eos|>"
    late = complete(client, max_tokens=8, temperature=0, extra_body={"min_tokens": 3}, **forced)
    assert (late.choices[0].finish_reason, late.usage.completion_tokens) == ("stop", 4)
    token = one_token(server, "a")
    stopped = complete(client, max_tokens=8, temperature=0, logit_bias={str(token): 100},
                       extra_body={"stop_token_ids": [token]})
    assert (stopped.choices[0].finish_reason, stopped.usage.completion_tokens, stopped.choices[0].text) == \
        ("stop", 1, "")


@covers("logprobs", "top_logprobs")
def test_logprobs_in_both_shapes_streamed_or_not(client):
    reply = chat(client, temperature=0, logprobs=True, top_logprobs=3)
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens
    for item in content:
        assert [t.logprob for t in item.top_logprobs] == sorted((t.logprob for t in item.top_logprobs), reverse=True)
        assert item.top_logprobs[0].token == item.token and item.top_logprobs[0].logprob == item.logprob
    assert "".join(i.token for i in content) == reply.choices[0].message.content
    streamed = [c for c in chat(client, temperature=0, logprobs=True, top_logprobs=3, stream=True) if c.choices]
    assert [i.model_dump() for c in streamed if c.choices[0].logprobs for i in c.choices[0].logprobs.content] == \
        [i.model_dump() for i in content]
    text = complete(client, temperature=0, logprobs=2).choices[0]
    assert len(text.logprobs.tokens) == len(text.logprobs.token_logprobs) == len(text.logprobs.top_logprobs) == 12
    assert all(len(top) <= 3 for top in text.logprobs.top_logprobs) and text.logprobs.text_offset[0] == 0
    assert chat(client).choices[0].logprobs is None


@covers("chat_template_kwargs")
def test_chat_template_kwargs_reach_the_template_or_are_refused(server, client):
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    no_thinking = chat(client, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = tokenize(server, messages=CHAT, chat_template_kwargs={"enable_thinking": False})
    assert no_thinking.usage.prompt_tokens == rendered["count"] > plain
    assert detokenize(server, rendered["tokens"]).endswith("<think>\n\n</think>\n\n")
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, extra_body={"chat_template_kwargs": {"enable_thinkin": False}})
    assert caught.value.body["param"] == "chat_template_kwargs.enable_thinkin"


@covers("reasoning_effort")
def test_reasoning_effort_reaches_a_template_that_reads_it(server, client):
    reply = chat(client, max_tokens=1, reasoning_effort="high")
    rendered = tokenize(server, messages=CHAT, chat_template_kwargs={"reasoning_effort": "high"})
    assert reply.usage.prompt_tokens == rendered["count"]
    assert "Reasoning: high" in detokenize(server, rendered["tokens"])


@covers("add_generation_prompt", "continue_final_message")
def test_continuing_the_last_assistant_message(server, client):
    messages = [*CHAT, {"role": "assistant", "content": "It was cold and"}]
    body = {"add_generation_prompt": False, "continue_final_message": True}
    reply = chat(client, messages=messages, max_tokens=1, extra_body=body)
    rendered = tokenize(server, messages=messages, **body)
    assert reply.usage.prompt_tokens == rendered["count"]
    assert detokenize(server, rendered["tokens"]).endswith("It was cold and")
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, messages=messages, extra_body={"continue_final_message": True})  # generation prompt too
    assert caught.value.body["param"] == "continue_final_message"


@covers("add_special_tokens")
def test_add_special_tokens_controls_bos(client):
    with_bos = complete(client, max_tokens=1).usage.prompt_tokens
    assert complete(client, max_tokens=1, extra_body={"add_special_tokens": False}).usage.prompt_tokens == with_bos - 1


@covers("request_id", "user", "safety_identifier", "metadata", "prompt_cache_key", "cache_salt")
def test_request_id_and_tags_reach_the_access_log(server, client):
    reply = chat(client, max_tokens=2, user="alice", safety_identifier="sid-9", metadata={"team": "infra"},
                 prompt_cache_key="conv-3", extra_body={"request_id": "req-42", "cache_salt": "s"})
    assert reply.id == "chatcmpl-req-42"
    deadline = time.monotonic() + 30  # the line is written after the reply is sent, and read by another thread
    while not any("chatcmpl-req-42" in line for line in access_lines(server.lines)) and time.monotonic() < deadline:
        time.sleep(0.05)
    line = next(line for line in access_lines(server.lines) if "chatcmpl-req-42" in line)
    for shown in ("user=alice", "safety_identifier=sid-9", 'metadata="{\\"team\\":\\"infra\\"}"',
                  "prompt_cache_key=conv-3", "prompt_tokens=", "completion_tokens=2"):
        assert shown in line, line


@covers("response_format")
def test_response_format_json_schema_on_both_endpoints(client):
    schema = {"type": "object", "properties": {"sky": {"enum": ["clear", "grey"]}}, "required": ["sky"],
              "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    assert json.loads(chat(client, max_tokens=20, response_format=fmt).choices[0].message.content)["sky"] in (
        "clear", "grey")
    assert json.loads(complete(client, max_tokens=20, extra_body={"response_format": fmt}).choices[0].text)["sky"] in (
        "clear", "grey")
    assert chat(client, max_tokens=4, response_format={"type": "text"}).choices[0].message.content
    # tests/inference/test_server_structured.py: 50 seeded schemas, streaming, json_object, refusals


@covers("tools", "tool_choice", "parallel_tool_calls")
def test_tools_forced_by_tool_choice_come_back_as_tool_calls(client):
    tools = [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {},
                                                                               "additionalProperties": False}}}]
    reply = chat(client, max_tokens=120, tools=tools, tool_choice="required", parallel_tool_calls=False).choices[0]
    assert reply.finish_reason == "tool_calls" and reply.message.content is None
    assert [(c.function.name, c.function.arguments) for c in reply.message.tool_calls] == [("clock", "{}")]
    assert chat(client, max_tokens=4, tools=tools, tool_choice="none").choices[0].message.tool_calls is None
    # tests/inference/test_server_tools.py: named functions, streaming deltas, auto, refusals;
    # tests/inference/test_server_tool_formats.py: Qwen3's, DeepSeek's and Kimi's formats


# --- refusals, coverage and the documented table ---------------------------------------------

REFUSED_CASES = [(f.name, endpoint) for f in FIELDS if f.status == REFUSED for endpoint in sorted(f.endpoints)]


@pytest.mark.parametrize("name, endpoint", REFUSED_CASES, ids=[f"{n}-{e}" for n, e in REFUSED_CASES])
def test_refused_fields_get_a_400_naming_them(client, name, endpoint):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            chat(client, extra_body={name: {"asks": "for something"}})
        else:
            complete(client, extra_body={name: {"asks": "for something"}})
    assert caught.value.body["param"] == name and name in caught.value.message


# what a client of one endpoint may send to the other by mistake: refused, never silently dropped
OTHER_ENDPOINT_CASES = [
    ("completions", "tools", [{"type": "function", "function": {"name": "clock", "parameters": {"type": "object"}}}]),
    ("completions", "tool_choice", "auto"),
    ("completions", "parallel_tool_calls", False),
    ("completions", "messages", CHAT),
    ("completions", "max_completion_tokens", 4),
    ("completions", "chat_template_kwargs", {"enable_thinking": False}),
    ("chat", "suffix", "and so on"),
    ("chat", "best_of", 1),
    ("chat", "prompt", PROMPT),
    ("chat", "prompt_embeds", "AAAA"),
]


@pytest.mark.parametrize("endpoint, name, value", OTHER_ENDPOINT_CASES,
                         ids=[f"{n}-to-{e}" for e, n, _ in OTHER_ENDPOINT_CASES])
def test_a_field_of_the_other_endpoint_gets_a_400_naming_it(client, endpoint, name, value):
    with pytest.raises(openai.BadRequestError) as caught:
        if endpoint == "chat":
            chat(client, max_tokens=1, extra_body={name: value})
        else:
            complete(client, max_tokens=1, extra_body={name: value})
    assert caught.value.body["param"] == name
    assert f"'{name}' is a field of /v1/" in caught.value.message


def test_unknown_fields_are_logged_once(server, client):
    for _ in range(3):
        chat(client, max_tokens=1, extra_body={"frobnicate_level": 3})
    warnings = [line for line in server.lines if "'frobnicate_level'" in line and "not known" in line]
    assert len(warnings) == 1


def test_every_honoured_field_has_a_test():
    shown = {f.name for f in FIELDS if f.status in (HONOURED, TAG)}
    assert shown - set(COVERED) == set()


def test_docs_list_the_table():
    docs = (Path(REPO) / "docs" / "inference.md").read_text()
    assert markdown_table() in docs  # rendered from inference.server.fields: change it there, then paste
