"""OpenAI request bodies to engine inputs, without a server: what is accepted, how it is read, what
is refused (naming the field), and the response shapes."""

from __future__ import annotations

import json
import logging

import pytest
from test_engine_fixtures import qwen_bundle  # noqa: F401  (fixture)
from transformers import AutoTokenizer

from inference.engine import Finished, InvalidRequestError, TextDelta, TokenLogprob, Usage
from inference.engine.generation_defaults import GenerationConfigError, read_generation_defaults
from inference.server.fields import CHAT, FIELDS, REFUSED, UnknownFieldLog
from inference.server.protocol import parse_request
from inference.server.responses import CompletionShape
from inference.server.token_text import TokenTexts

USER = [{"role": "user", "content": "hi"}]


def params_of(body: dict, *, chat: bool = True, defaults: dict | None = None):
    return parse_request(body, chat=chat).sampling_params(16, defaults)


@pytest.mark.parametrize("body, field, expected", [
    ({"messages": USER}, "max_tokens", None),
    ({"messages": USER, "max_tokens": 5}, "max_tokens", 5),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}, "max_tokens", 7),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}, "max_tokens_param", "max_completion_tokens"),
    ({"messages": USER, "n": 3}, "n", 3),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": True}}, "include_usage", True),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}},
     "continuous_usage", True),
    ({"messages": USER, "logprobs": True}, "logprobs", 0),
    ({"messages": USER, "logprobs": True, "top_logprobs": 5}, "logprobs", 5),
    ({"messages": USER, "logprobs": False, "top_logprobs": 0}, "logprobs", None),
    ({"messages": USER, "chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "low"},
     "template_kwargs", {"enable_thinking": False, "reasoning_effort": "low"}),
    ({"messages": USER, "user": "alice", "metadata": {"team": "a"}}, "tags",
     {"user": "alice", "metadata": {"team": "a"}}),
    ({"messages": USER}, "add_special_tokens", False),
    ({"messages": USER, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message",
     True),
    ({"messages": USER, "request_id": "abc-1"}, "request_id", "abc-1"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     "messages", [{"role": "user", "content": "ab"}]),
    ({"messages": [{"role": "assistant", "content": None}, *USER]}, "messages",
     [{"role": "assistant", "content": ""}, *USER]),
    ({"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "-3 C"}]}, "messages",
     [*USER, {"role": "assistant", "content": "", "tool_calls": [
         {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]},
      {"role": "tool", "content": "-3 C", "tool_call_id": "call_1"}]),
    ({"messages": [{"role": "assistant", "content": "x", "reasoning_content": "think"}]}, "messages",
     [{"role": "assistant", "content": "x", "reasoning_content": "think"}]),
])
def test_chat_fields_are_read_as_openai_defines_them(body, field, expected):
    assert getattr(parse_request(body, chat=True), field) == expected


@pytest.mark.parametrize("body, field, expected", [
    ({}, "temperature", 1.0),
    ({"temperature": 0}, "temperature", 0.0),
    ({"stop": "x"}, "stop", ("x",)),
    ({"stop": ["x", "yz"]}, "stop", ("x", "yz")),
    ({"stop": None}, "stop", ()),
    ({"seed": -5}, "seed", -5),
    ({"top_k": -1}, "top_k", 0),
    ({"top_k": 1}, "top_k", 1),
    ({"min_p": 0.1}, "min_p", 0.1),
    ({"repetition_penalty": 1.3}, "repetition_penalty", 1.3),
    ({"presence_penalty": -0.5, "frequency_penalty": 1}, "frequency_penalty", 1.0),
    ({"logit_bias": {"7": 5, "3": -100}}, "logit_bias", ((3, -100.0), (7, 5.0))),
    ({"stop_token_ids": [2, 9]}, "stop_token_ids", (2, 9)),
    ({"ignore_eos": True}, "ignore_eos", True),
    ({"min_tokens": 4}, "min_tokens", 4),
    ({"skip_special_tokens": False}, "skip_special_tokens", False),
])
def test_sampling_fields_reach_the_engine(body, field, expected):
    assert getattr(params_of({"messages": USER, **body}), field) == expected


def test_generation_config_defaults_fill_only_what_the_request_omits():
    defaults = {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 100}
    inherited = params_of({"messages": USER, "top_k": 5}, defaults=defaults)
    assert (inherited.temperature, inherited.top_p, inherited.top_k, inherited.max_tokens) == (0.6, 0.95, 5, 16)
    assert params_of({"messages": USER, "temperature": 0}, defaults=defaults).temperature == 0.0


def test_generation_config_keys_are_read_only_when_written_and_checked(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_k": 20, "top_p": None, "max_new_tokens": 64, "do_sample": True, "eos_token_id": 2}))
    assert read_generation_defaults(tmp_path) == {"temperature": 0.6, "top_k": 20, "max_tokens": 64}
    assert read_generation_defaults(tmp_path / "elsewhere") == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 5}))
    with pytest.raises(GenerationConfigError, match="generation_config.json.*temperature"):
        read_generation_defaults(tmp_path)


@pytest.mark.parametrize("prompt, expected", [
    ("text", ("text",)),
    (["text"], ("text",)),
    ([1, 2, 3], ((1, 2, 3),)),
    ([[1, 2, 3]], ((1, 2, 3),)),
    (["a", [4, 5]], ("a", (4, 5))),
])
def test_completion_prompts(prompt, expected):
    parsed = parse_request({"prompt": prompt}, chat=False)
    assert parsed.prompts == expected and parsed.messages is None and parsed.prompt_param == "prompt"
    assert parsed.add_special_tokens  # completions: BOS as the tokenizer adds it


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER, "stream": True, "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ({"messages": USER, "stream": True, "stream_options": {"include_obfuscation": True}},
     "stream_options.include_obfuscation"),
    ({"messages": USER, "stream": True, "stream_options": {"fast": True}}, "stream_options.fast"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": USER, "tool_choice": "auto"}, "tool_choice"),
    ({"messages": USER, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"messages": USER, "response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"messages": USER, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "objectx"}}}}, "response_format.json_schema.schema"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "n": 129}, "n"),
    ({"messages": USER, "top_p": True}, "top_p"),
    ({"messages": USER, "top_logprobs": 3}, "top_logprobs"),
    ({"messages": USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"messages": USER, "logprobs": 3}, "logprobs"),
    ({"messages": USER, "logit_bias": {"x": 1}}, "logit_bias"),
    ({"messages": USER, "logit_bias": {"1": "up"}}, "logit_bias"),
    ({"messages": USER, "stop_token_ids": [1.5]}, "stop_token_ids"),
    ({"messages": USER, "chat_template_kwargs": ["x"]}, "chat_template_kwargs"),
    ({"messages": USER, "guided_json": {"type": "object"}}, "guided_json"),
    ({"messages": USER, "priority": 1}, "priority"),
    ({"messages": USER, "request_id": "a\nb"}, "request_id"),
    ({"messages": [USER[0], "hi"]}, "messages[1]"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"type": "function", "function": {"name": "f", "arguments": "{nope"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "best_of": 2}, "best_of"),
    ({"prompt": "x", "suffix": "end"}, "suffix"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
    ({"prompt": ["a", 5]}, "prompt"),
    ({"prompt": ["a", "b"], "n": 65}, "n"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(body, chat="messages" in body)
    assert caught.value.param == param


@pytest.mark.parametrize("field", [f for f in FIELDS if f.status == REFUSED], ids=lambda f: f.name)
def test_every_refused_field_accepts_its_off_value_and_refuses_the_rest(field):
    chat = "chat" in field.endpoints
    base = {"messages": USER} if chat else {"prompt": "x"}
    for off in (None, False, 0, "", [], {}):
        if field.accepted(off):
            parse_request({**base, field.name: off}, chat=chat)
            break
    with pytest.raises(InvalidRequestError) as caught:
        parse_request({**base, field.name: {"asks": "for something"}}, chat=chat)
    assert caught.value.param == field.name


ONE_ENDPOINT = [f for f in FIELDS if len(f.endpoints) == 1]


@pytest.mark.parametrize("field", ONE_ENDPOINT, ids=lambda f: f.name)
def test_a_field_of_the_other_endpoint_is_refused_naming_it_unless_null(field):
    chat = CHAT not in field.endpoints  # sent where it does not belong
    base = {"messages": USER} if chat else {"prompt": "x"}
    heard = []
    parse_request({**base, field.name: None}, chat=chat, unknown=heard.extend)
    assert heard == []  # known to the server, not "unknown": null asks for nothing
    for value in ({"asks": "for something"}, False, [], "none"):
        with pytest.raises(InvalidRequestError, match=f"'{field.name}' is a field of /v1/") as caught:
            parse_request({**base, field.name: value}, chat=chat, unknown=heard.extend)
        assert caught.value.param == field.name


def test_unknown_fields_are_logged_once_per_name(caplog):
    log = UnknownFieldLog()
    with caplog.at_level(logging.WARNING, logger="inference.server"):
        for _ in range(3):
            parse_request({"messages": USER, "frobnicate": 1, "zzz": 2}, chat=True,
                          unknown=lambda names: log("/v1/chat/completions", names))
    assert log.seen == {"frobnicate", "zzz"}
    assert sum("frobnicate" in r.message for r in caplog.records) == 1


# --- responses ------------------------------------------------------------------------------

def test_response_shapes_follow_openai():
    finished = Finished("stop", "hello", Usage(3, 2), (5, 2), 0.01, 0.02)
    chat = CompletionShape(chat=True, model="m", include_usage=True, prompt_tokens=3)
    body = chat.full([finished])
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                        "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    final = chat.finish_chunks(finished)[-1]
    assert final["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert final["usage"] is None
    assert chat.usage_chunk()["choices"] == [] and chat.usage_chunk()["usage"]["total_tokens"] == 5
    text = CompletionShape(chat=False, model="m", request_id="r1")
    assert text.opening_chunks() == [] and "usage" not in text.text_chunk(TextDelta("x"))
    assert text.full([finished])["choices"][0]["text"] == "hello" and text.id == "cmpl-r1"


def test_n_choices_share_the_prompt_in_usage_and_keep_their_index():
    shape = CompletionShape(chat=True, model="m", prompt_tokens=4, choices=2)
    body = shape.full([Finished("length", "b", Usage(4, 3), (1, 2, 3), 0.1, 0.2, index=1),
                       Finished("stop", "a", Usage(4, 1), (2,), 0.1, 0.2, index=0)])
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 4, "total_tokens": 8}
    assert [c["choices"][0]["index"] for c in shape.opening_chunks()] == [0, 1]


@pytest.fixture(scope="module")
def tokenizer(qwen_bundle):
    return AutoTokenizer.from_pretrained(qwen_bundle)


def test_logprob_shapes_chat_and_completions(tokenizer):
    snowman = tokenizer("☃", add_special_tokens=False).input_ids  # byte-level: 3 bytes over several tokens
    entries = tuple(TokenLogprob(t, -0.5, ((t, -0.5), (7, -2.0))) for t in snowman)
    finished = Finished("length", "☃", Usage(1, len(snowman)), tuple(snowman), 0.1, 0.2, logprobs=entries)
    texts = TokenTexts(tokenizer)
    chat = CompletionShape(chat=True, model="m", logprobs=2, token_texts=texts).full([finished])
    content = chat["choices"][0]["logprobs"]["content"]
    assert bytes(b for item in content for b in item["bytes"]) == "☃".encode()  # exact bytes, not U+FFFD's
    assert [len(item["top_logprobs"]) for item in content] == [2] * len(snowman)
    second = {"token": texts.text(7), "logprob": -2.0, "bytes": texts.text_and_bytes(7)[1]}
    assert content[0]["top_logprobs"][1] == second
    text = CompletionShape(chat=False, model="m", logprobs=1, token_texts=texts).full([finished])["choices"][0]
    logprobs = text["logprobs"]
    assert logprobs["token_logprobs"] == [-0.5] * len(snowman) and len(logprobs["tokens"]) == len(snowman)
    assert logprobs["text_offset"][0] == 0 and logprobs["top_logprobs"][0][texts.text(7)] == -2.0


def test_streamed_logprobs_are_sent_once_each():
    entries = tuple(TokenLogprob(t, -1.0) for t in (10, 11, 2))
    shape = CompletionShape(chat=False, model="m", logprobs=0, choices=1,
                            token_texts=type("T", (), {"text": lambda self, t: f"<{t}>"})())
    first = shape.text_chunk(TextDelta("ab", 0, entries[:2], 2))["choices"][0]["logprobs"]
    assert first["tokens"] == ["<10>", "<11>"] and first["text_offset"] == [0, 4]
    final = Finished("stop", "ab", Usage(1, 3), (10, 11, 2), 0.1, 0.1, logprobs=entries)
    tail = shape.finish_chunks(final)[-1]["choices"][0]["logprobs"]
    assert tail["tokens"] == ["<2>"] and tail["text_offset"] == [8]  # only the EOS no delta carried
