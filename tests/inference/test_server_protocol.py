"""OpenAI request bodies to engine inputs, without a server: what is accepted and how it is read."""

from __future__ import annotations

import pytest

from inference.engine import Finished, InvalidRequestError, Usage
from inference.server.protocol import parse_request
from inference.server.responses import CompletionShape

USER = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("body, field, expected", [
    ({"messages": USER}, "max_tokens", None),
    ({"messages": USER, "max_tokens": 5}, "max_tokens", 5),
    ({"messages": USER, "max_tokens": 5, "max_completion_tokens": 7}, "max_tokens", 7),
    ({"messages": USER}, "temperature", 1.0),
    ({"messages": USER, "temperature": 0}, "temperature", 0.0),
    ({"messages": USER, "stop": "x"}, "stop", ("x",)),
    ({"messages": USER, "stop": ["x", "yz"]}, "stop", ("x", "yz")),
    ({"messages": USER, "stop": None}, "stop", ()),
    ({"messages": USER, "seed": -5}, "seed", -5),
    ({"messages": USER, "n": 1, "logprobs": False, "presence_penalty": 0, "response_format": {"type": "text"}},
     "stream", False),
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": True}}, "include_usage", True),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
     "messages", [{"role": "user", "content": "ab"}]),
    ({"messages": [{"role": "assistant", "content": None}, *USER]}, "messages",
     [{"role": "assistant", "content": ""}, *USER]),
])
def test_chat_fields_are_read_as_openai_defines_them(body, field, expected):
    assert getattr(parse_request(body, chat=True), field) == expected


@pytest.mark.parametrize("prompt, expected", [
    ("text", "text"),
    (["text"], "text"),
    ([1, 2, 3], [1, 2, 3]),
    ([[1, 2, 3]], [1, 2, 3]),
])
def test_completion_prompts(prompt, expected):
    parsed = parse_request({"prompt": prompt}, chat=False)
    assert parsed.prompt == expected and parsed.messages is None and parsed.prompt_param == "prompt"


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": USER, "n": 0}, "n"),
    ({"messages": USER, "top_p": True}, "top_p"),
    ({"messages": [USER[0], "hi"]}, "messages[1]"),
])
def test_refusals_name_the_field(body, param):
    with pytest.raises(InvalidRequestError) as caught:
        parse_request(body, chat=True)
    assert caught.value.param == param


def test_response_shapes_follow_openai():
    finished = Finished("stop", "hello", Usage(3, 2), (5, 2), 0.01, 0.02)
    chat = CompletionShape(chat=True, model="m", include_usage=True)
    body = chat.full(finished)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant",
                                                                                        "content": "hello"}
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    closing = chat.closing_chunks("stop", finished.usage)
    assert closing[0]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}
    assert closing[0]["usage"] is None and closing[1]["choices"] == [] and closing[1]["usage"]["total_tokens"] == 5
    text = CompletionShape(chat=False, model="m")
    assert text.opening_chunks() == [] and "usage" not in text.text_chunk("x")
    assert text.full(finished)["choices"][0]["text"] == "hello" and text.id.startswith("cmpl-")
