"""OpenAI request bodies to engine inputs: every field checked, each refusal naming its `param`."""

from __future__ import annotations

import dataclasses
import numbers

from inference.engine import InvalidRequestError, SamplingParams

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")
# fields we cannot honour: refused rather than silently ignored when they ask for something
UNSUPPORTED_WHEN_SET = ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias",
                        "presence_penalty", "frequency_penalty", "response_format")


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """One /v1/completions or /v1/chat/completions request, checked, prompt not yet tokenized."""

    model: str | None
    prompt: str | list[int] | None  # completions
    messages: list[dict[str, str]] | None  # chat
    max_tokens: int | None  # None: as many as the context leaves
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool

    @property
    def prompt_param(self) -> str:
        return "messages" if self.messages is not None else "prompt"

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """The engine's parameters; `max_tokens` is the request's own or, when it gave none, the room left."""
        return SamplingParams(max_tokens=max_tokens, temperature=self.temperature, top_p=self.top_p,
                              seed=self.seed, stop=self.stop)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _field(body: dict, name: str, check, expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise InvalidRequestError(f"'{name}' must be {expected}, got {value!r}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(f"'stop' must be a non-empty string or a list of them, got {stop!r}", param="stop")
    return tuple(stop)


def _message_content(index: int, message: dict) -> str:
    content = message.get("content")
    if content is None and message["role"] == "assistant":
        return ""  # an assistant turn that only called tools
    if isinstance(content, str):
        return content
    if isinstance(content, list) and content:
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise InvalidRequestError(f"messages[{index}].content: only text parts are supported, got "
                                          f"{part!r}", param=f"messages[{index}].content")
            texts.append(part["text"])
        return "".join(texts)
    raise InvalidRequestError(f"messages[{index}].content must be a string or a list of text parts, got "
                              f"{content!r}", param=f"messages[{index}].content")


def _messages(body: dict) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise InvalidRequestError("'messages' is required", param="messages")
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError(f"'messages' must be a non-empty list, got {messages!r}", param="messages")
    parsed = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {message!r}", param=f"messages[{i}]")
        role = message.get("role")
        if role not in CHAT_ROLES:
            raise InvalidRequestError(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}",
                                      param=f"messages[{i}].role")
        parsed.append({"role": role, "content": _message_content(i, message)})
    return parsed


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("'prompt' is required", param="prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [int(t) for t in prompt]
    raise InvalidRequestError("'prompt' must be a string or a list of token ids (one prompt per request), got "
                              f"{prompt!r}", param="prompt")


def _asks_for_something(value) -> bool:
    """False for the values clients send to mean "off": null, false, 0, empty, {"type": "text"}."""
    if value is None or value is False or (_is_number(value) and value == 0):
        return False
    if isinstance(value, (str, list, dict)) and not value:
        return False
    return value != {"type": "text"}


def _check_supported(body: dict) -> None:
    n = _field(body, "n", _is_int, "an integer", 1)
    if n != 1:
        raise InvalidRequestError(f"only n=1 is supported, got n={n}", param="n")
    best_of = _field(body, "best_of", _is_int, "an integer", 1)
    if best_of != 1:
        raise InvalidRequestError(f"only best_of=1 is supported, got {best_of}", param="best_of")
    for name in UNSUPPORTED_WHEN_SET:
        if _asks_for_something(body.get(name)):
            raise InvalidRequestError(f"'{name}' is not supported by this server", param=name)


def parse_request(body, *, chat: bool) -> ParsedRequest:
    """Check a decoded JSON body of /v1/chat/completions (chat) or /v1/completions."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    messages = _messages(body) if chat else None
    prompt = None if chat else _prompt(body)
    _check_supported(body)
    max_tokens = _field(body, "max_tokens", _is_int, "an integer")
    if chat and body.get("max_completion_tokens") is not None:
        max_tokens = _field(body, "max_completion_tokens", _is_int, "an integer")
    for name in ("max_tokens", "max_completion_tokens"):
        if body.get(name) is not None and body[name] < 1:
            raise InvalidRequestError(f"'{name}' must be at least 1, got {body[name]}", param=name)
    temperature = _field(body, "temperature", _is_number, "a number", 1.0)
    if not 0.0 <= temperature <= 2.0:
        raise InvalidRequestError(f"'temperature' must be in [0, 2], got {temperature}", param="temperature")
    top_p = _field(body, "top_p", _is_number, "a number", 1.0)
    if not 0.0 < top_p <= 1.0:
        raise InvalidRequestError(f"'top_p' must be in (0, 1], got {top_p}", param="top_p")
    seed = _field(body, "seed", _is_int, "an integer")
    stream = _field(body, "stream", lambda v: isinstance(v, bool), "a boolean", False)
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is not None and not stream:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    include_usage = (options or {}).get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise InvalidRequestError(f"'stream_options.include_usage' must be a boolean, got {include_usage!r}",
                                  param="stream_options.include_usage")
    return ParsedRequest(model, prompt, messages, max_tokens, float(temperature), float(top_p), seed, _stop(body),
                         stream, include_usage)
