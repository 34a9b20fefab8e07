"""OpenAI chat messages to what chat templates read, every field checked and named when refused.

An assistant turn's `tool_calls` and a tool turn's `tool_call_id` reach the template; tool-call
arguments (a JSON string in OpenAI's API) are decoded to an object, which is what Hugging Face
chat templates (Qwen3, DeepSeek, Kimi...) render, as vLLM does.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from inference.engine import InvalidRequestError
from servicekit.echo import shown

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "reasoning")  # vLLM's and OpenRouter's names for a turn's thinking
KNOWN_KEYS = frozenset({"role", "content", "name", "tool_calls", "tool_call_id", "refusal", *REASONING_KEYS})


def _refuse(param: str, message: str):
    raise InvalidRequestError(f"{param}: {message}", param=param)


def _content(param: str, message: dict) -> str:
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                _refuse(f"{param}[{j}]", f"only text parts are supported, got a {shown(kind)} part")
            texts.append(part["text"])
        return "".join(texts)
    _refuse(param, f"must be a string or a list of text parts, got {shown(content)}")


def _tool_call(param: str, call) -> dict:
    if not isinstance(call, dict):
        _refuse(param, f"must be an object, got {shown(call)}")
    if call.get("type", "function") != "function":
        _refuse(f"{param}.type", f"only 'function' tool calls exist, got {shown(call.get('type'))}")
    function = call.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        _refuse(f"{param}.function", f"must be an object with a 'name', got {shown(function)}")
    arguments = function.get("arguments")
    if arguments is None or arguments == "":
        arguments = {}
    elif isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError as exc:
            _refuse(f"{param}.function.arguments", f"is not valid JSON: {exc}")
        except RecursionError:
            _refuse(f"{param}.function.arguments", "is not valid JSON here: nested too deeply")
    if not isinstance(arguments, dict):
        _refuse(f"{param}.function.arguments", f"must encode a JSON object, got {shown(arguments)}")
    parsed = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if call.get("id") is not None:
        if not isinstance(call["id"], str):
            _refuse(f"{param}.id", f"must be a string, got {shown(call['id'])}")
        parsed["id"] = call["id"]
    return parsed


def _message(i: int, message, unknown: Callable[[list[str]], None]) -> dict:
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        _refuse(param, f"must be an object, got {shown(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        _refuse(f"{param}.role", f"must be one of {', '.join(CHAT_ROLES)}, got {shown(role)}")
    parsed = {"role": role, "content": _content(f"{param}.content", message)}
    name = message.get("name")
    if name is not None:
        if not isinstance(name, str):
            _refuse(f"{param}.name", f"must be a string, got {shown(name)}")
        parsed["name"] = name
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            _refuse(f"{param}.tool_calls", f"only assistant messages carry tool calls, not {shown(role)} ones")
        if not isinstance(calls, list):
            _refuse(f"{param}.tool_calls", f"must be a list, got {shown(calls)}")
        if calls:
            parsed["tool_calls"] = [_tool_call(f"{param}.tool_calls[{j}]", c) for j, c in enumerate(calls)]
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            _refuse(f"{param}.tool_call_id",
                    f"a tool message needs the id of the call it answers, got {shown(call_id)}")
        parsed["tool_call_id"] = call_id
    for key in REASONING_KEYS:
        if message.get(key) is not None:
            if role != "assistant" or not isinstance(message[key], str):
                _refuse(f"{param}.{key}", "only an assistant message's reasoning, as a string")
            parsed["reasoning_content"] = message[key]
    refusal = message.get("refusal")
    if refusal is not None and (role != "assistant" or not isinstance(refusal, str)):
        _refuse(f"{param}.refusal", "only an assistant message's refusal, as a string")
    if refusal and not parsed["content"]:
        parsed["content"] = refusal  # what the assistant said, for the next turn's context
    unknown([f"messages[].{key}" for key in message if key not in KNOWN_KEYS])
    return parsed


def parse_messages(body: dict, unknown: Callable[[list[str]], None] = lambda names: None) -> list[dict]:
    """The checked messages of a chat request; `unknown` hears of message keys nobody reads."""
    messages = body.get("messages")
    if messages is None:
        _refuse("messages", "is required")
    if not isinstance(messages, list) or not messages:
        _refuse("messages", f"must be a non-empty list, got {shown(messages)}")
    return [_message(i, m, unknown) for i, m in enumerate(messages)]
