"""Tools through a live `inference serve` and the official openai client. The bundle's chat template
is Qwen3-like (tools rendered, `<tool_call>` calls); with random weights the model never calls a
tool by itself, so the calls here are forced (tool_choice "required" or a named function), which
exercises the template, the grammar, the parser and both response shapes end to end."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from test_server_fixtures import MODEL as TINY_MODEL
from test_server_fixtures import openai_client, post, rich_bundle, serving

MODEL = "rich-moe"
CHAT = [{"role": "user", "content": "What is the weather in Oslo?"}]
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 7}},
           "required": ["city", "days"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "clock", "parameters": {
             "type": "object", "properties": {}, "additionalProperties": False}}}]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with serving(rich_bundle(tmp_path_factory, {}), model_name=MODEL) as process:
        yield process


def chat(client, **kwargs):
    return client.chat.completions.create(**{"model": MODEL, "messages": CHAT, "max_tokens": 600, "seed": 1,
                                             "tools": TOOLS, **kwargs})


def check_calls(calls, names=None):
    assert calls
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), PARAMETERS[call.function.name])
    if names is not None:
        assert [c.function.name for c in calls] == names
    assert len({c.id for c in calls}) == len(calls)


@pytest.mark.parametrize("seed", range(5))
def test_required_gives_tool_calls(client, seed):
    reply = chat(client, tool_choice="required", seed=seed)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    check_calls(choice.message.tool_calls)


def test_a_named_function_is_called(client):
    choice = chat(client, tool_choice={"type": "function", "function": {"name": "weather"}}).choices[0]
    check_calls(choice.message.tool_calls, ["weather"])
    assert choice.finish_reason == "tool_calls"


def test_parallel_tool_calls_false_gives_one_call(client):
    for seed in range(3):
        calls = chat(client, tool_choice="required", parallel_tool_calls=False, seed=seed).choices[0].message.tool_calls
        assert len(calls) == 1
        check_calls(calls)


def test_tool_calls_stream_as_deltas(client):
    whole = chat(client, tool_choice="required", temperature=0).choices[0].message.tool_calls
    stream = chat(client, tool_choice="required", temperature=0, stream=True)
    calls, content, reasons = {}, [], []
    for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": delta.id, "name": "", "arguments": ""})
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
    assert "".join(content) == "" and reasons[-1] == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c.function.name, json.loads(c.function.arguments)) for c in whole]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_auto_and_none_give_content_when_the_model_calls_nothing(client):
    for choice in ("auto", "none", None):
        kwargs = {} if choice is None else {"tool_choice": choice}
        reply = chat(client, max_tokens=8, temperature=0, **kwargs).choices[0]
        assert reply.message.tool_calls is None and reply.message.content
        assert reply.finish_reason in ("length", "stop")


def test_tools_reach_the_template(server, client):
    status, tokens = post(server.base_url + "/tokenize", {"model": MODEL, "messages": CHAT})
    assert status == 200
    with_tools = chat(client, max_tokens=1).usage.prompt_tokens
    assert with_tools > tokens["count"]  # the tool definitions are in the prompt


def test_a_forced_call_and_its_result_go_round_the_conversation(client):
    call = chat(client, tool_choice={"type": "function", "function": {"name": "clock"}}).choices[0].message.tool_calls[0]
    messages = CHAT + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                       {"role": "tool", "tool_call_id": call.id, "content": "12:00"}]
    assert chat(client, messages=messages, max_tokens=4, tool_choice="none").choices[0].message.content


BAD = [
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "none"}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "extra": 1}}]}, "tools[0].function.extra"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "objectx"}}}]}, "tool_choice"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"tools": None, "tool_choice": "auto"}, "tool_choice"),
    ({"tools": None, "parallel_tool_calls": True}, "parallel_tool_calls"),
    ({"extra_body": {"skip_special_tokens": True}}, "skip_special_tokens"),
]


@pytest.mark.parametrize("extra, param", BAD, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_tool_requests_get_a_400_naming_the_field(client, extra, param):
    kwargs = dict(extra)
    if kwargs.get("tools", TOOLS) is None:
        kwargs.pop("tools")
        kwargs = {"extra_body": {"tools": None, **kwargs}}
    with pytest.raises(openai.BadRequestError) as caught:
        chat(client, max_tokens=4, **kwargs)
    assert caught.value.body["param"] == param, caught.value.body


def test_a_model_whose_template_renders_no_tools_refuses_them(tiny_server):
    with openai_client(tiny_server) as plain:  # the tiny bundle's template renders no tools
        with pytest.raises(openai.BadRequestError) as caught:
            plain.chat.completions.create(model=TINY_MODEL, messages=CHAT, max_tokens=4, tools=TOOLS,
                                          tool_choice="none")
        assert caught.value.body["param"] == "tools" and "does not render tools" in caught.value.message
