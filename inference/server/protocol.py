"""OpenAI request bodies to engine inputs: every field checked, each refusal naming its `param`.

What each field does is in inference.server.fields; here they are read and type-checked. Ranges
are checked by SamplingParams when the engine's parameters are built, which names the field too.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping

from inference.engine import InvalidRequestError, SamplingParams
from inference.engine.params import MAX_LOGPROBS
from inference.server.fields import BY_NAME, CHAT, REFUSED, fields_for
from inference.server.messages import parse_messages
from inference.server.structured import response_format_grammar
from inference.server.tools import ToolRequest, parse_tools
from servicekit.echo import shown

MAX_CHOICES = 128  # prompts x n in one request; OpenAI's n is at most 128 too
SEED_RANGE = (-2**63, 2**63 - 1)  # OpenAI's seed is an int64; the generator would fold others modulo 2^64
TAG_FIELDS = ("user", "safety_identifier", "metadata", "prompt_cache_key")
# request fields passed to SamplingParams under the same name
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty", "seed", "ignore_eos", "min_tokens", "skip_special_tokens")


@dataclasses.dataclass(frozen=True)
class ParsedRequest:
    """One /v1/completions or /v1/chat/completions request, checked, prompts not yet tokenized."""

    chat: bool
    model: str | None
    prompts: tuple[str | tuple[int, ...], ...] | None  # completions: one or more
    messages: list[dict] | None  # chat
    template_kwargs: Mapping[str, object]  # chat: chat_template_kwargs, plus reasoning_effort when given
    add_generation_prompt: bool
    continue_final_message: bool
    add_special_tokens: bool
    n: int
    max_tokens: int | None  # None: the server's default
    max_tokens_param: str  # the field it came from, for errors
    sampling: Mapping[str, object]  # SamplingParams fields the request set (max_tokens aside)
    stream: bool
    include_usage: bool
    continuous_usage: bool
    logprobs: int | None  # the engine's: None, or how many top tokens per position
    tags: Mapping[str, object]  # user, safety_identifier...: for the access log
    request_id: str | None
    tools: ToolRequest | None = None  # chat: the request's tools and tool_choice

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def sampling_params(self, max_tokens: int, defaults: Mapping[str, object] | None = None) -> SamplingParams:
        """The engine's parameters: the model's defaults for the fields the request left out, then the request's."""
        inherited = {k: v for k, v in (defaults or {}).items() if k != "max_tokens" and k not in self.sampling}
        return SamplingParams(max_tokens=max_tokens, logprobs=self.logprobs, **inherited, **self.sampling)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _is_bool(value) -> bool:
    return isinstance(value, bool)


def _field(body: dict, name: str, check, expected: str, default=None):
    value = body.get(name)
    if value is None:
        return default
    if not check(value):
        raise InvalidRequestError(f"'{name}' must be {expected}, got {shown(value)}", param=name)
    return value


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequestError(f"'stop' must be a non-empty string or a list of them, got {shown(stop)}",
                                  param="stop")
    return tuple(stop)


def _prompts(body: dict) -> tuple[str | tuple[int, ...], ...]:
    prompt = body.get("prompt")
    if prompt is None:
        raise InvalidRequestError("'prompt' is required", param="prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt)):
        prompt = [prompt]  # one prompt
    if not isinstance(prompt, list) or not prompt:
        raise InvalidRequestError(f"'prompt' must be a string, a list of token ids, or a non-empty list of either, "
                                  f"got {shown(prompt)}", param="prompt")
    prompts = []
    for i, p in enumerate(prompt):
        if isinstance(p, str):
            prompts.append(p)
        elif isinstance(p, list) and p and all(_is_int(t) for t in p):
            prompts.append(tuple(int(t) for t in p))
        else:
            raise InvalidRequestError(f"prompt[{i}] must be a string or a non-empty list of token ids, got {shown(p)}",
                                      param="prompt")
    return tuple(prompts)


ENDPOINT_PATHS = {True: "/v1/chat/completions", False: "/v1/completions"}


def _check_catalogue(body: dict, chat: bool, unknown: Callable[[list[str]], None]) -> None:
    known = fields_for(chat)
    for name, value in body.items():
        field = known.get(name)
        if field is not None and field.status == REFUSED and not field.accepted(value):
            raise InvalidRequestError(f"'{name}' is not supported by this server ({field.note}), got {shown(value)}",
                                      param=name)
        if field is None and name in BY_NAME and value is not None:
            # a field of the other endpoint (`tools` on completions, `suffix` on chat): ignoring it
            # would answer a request other than the one the client meant
            other = ENDPOINT_PATHS[CHAT in BY_NAME[name].endpoints]
            raise InvalidRequestError(f"'{name}' is a field of {other}, not of {ENDPOINT_PATHS[chat]}", param=name)
    unknown([name for name in body if name not in BY_NAME])


def _logit_bias(body: dict) -> tuple[tuple[int, float], ...]:
    bias = _field(body, "logit_bias", lambda v: isinstance(v, dict), "an object of token id: bias", {})
    pairs = []
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"'logit_bias' keys must be token ids, got {shown(key)}",
                                      param="logit_bias") from None
        if not _is_number(value):
            raise InvalidRequestError(f"'logit_bias' values must be numbers, got {shown(value)}", param="logit_bias")
        pairs.append((token, value))
    return tuple(pairs)


def _logprobs(body: dict, chat: bool) -> int | None:
    if not chat:  # completions: how many top tokens, as an integer
        return _field(body, "logprobs", _is_int, "an integer (how many most likely tokens to return)")
    wanted = _field(body, "logprobs", _is_bool, "a boolean", False)
    top = _field(body, "top_logprobs", _is_int, "an integer")
    if top is not None and not 0 <= top <= MAX_LOGPROBS:
        raise InvalidRequestError(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {top}", param="top_logprobs")
    if top and not wanted:
        raise InvalidRequestError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    return (top or 0) if wanted else None


def _stream_options(body: dict, stream: bool) -> tuple[bool, bool]:
    options = _field(body, "stream_options", lambda v: isinstance(v, dict), "an object")
    if options is None:
        return False, False
    if not stream:
        raise InvalidRequestError("'stream_options' is only allowed when 'stream' is true", param="stream_options")
    for key, value in options.items():
        param = f"stream_options.{key}"
        if key not in ("include_usage", "continuous_usage_stats", "include_obfuscation"):
            raise InvalidRequestError(f"'{param}' is not a stream option this server knows", param=param)
        if value is not None and not isinstance(value, bool):
            raise InvalidRequestError(f"'{param}' must be a boolean, got {shown(value)}", param=param)
    if options.get("continuous_usage_stats") and not options.get("include_usage"):
        raise InvalidRequestError("'stream_options.continuous_usage_stats' needs 'include_usage': true (as in vLLM)",
                                  param="stream_options.continuous_usage_stats")
    if options.get("include_obfuscation"):
        raise InvalidRequestError("'stream_options.include_obfuscation' is not supported (only false)",
                                  param="stream_options.include_obfuscation")
    return bool(options.get("include_usage")), bool(options.get("continuous_usage_stats"))


def _template_kwargs(body: dict) -> dict:
    kwargs = _field(body, "chat_template_kwargs", lambda v: isinstance(v, dict), "an object", {})
    if not all(isinstance(k, str) and k for k in kwargs):
        raise InvalidRequestError("'chat_template_kwargs' keys must be variable names", param="chat_template_kwargs")
    kwargs = dict(kwargs)
    effort = _field(body, "reasoning_effort", lambda v: isinstance(v, str), "a string")
    if effort is not None:
        kwargs["reasoning_effort"] = effort
    return kwargs


def _max_tokens(body: dict, chat: bool) -> tuple[int | None, str]:
    name = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    for field in ("max_tokens", "max_completion_tokens"):
        value = _field(body, field, _is_int, "an integer")
        if value is not None and value < 1:
            raise InvalidRequestError(f"'{field}' must be at least 1, got {value}", param=field)
    return body.get(name), name


def _sampling(body: dict) -> dict:
    checks = {"seed": (_is_int, "an integer"), "top_k": (_is_int, "an integer"),
              "min_tokens": (_is_int, "an integer"), "ignore_eos": (_is_bool, "a boolean"),
              "skip_special_tokens": (_is_bool, "a boolean")}
    sampling = {}
    for name in SAMPLING_FIELDS:
        check, expected = checks.get(name, (_is_number, "a number"))
        value = _field(body, name, check, expected)
        if value is not None:
            sampling[name] = float(value) if expected == "a number" else value
    seed = sampling.get("seed")
    if seed is not None and not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise InvalidRequestError(f"'seed' must be a 64-bit signed integer, in [-2^63, 2^63 - 1], got {shown(seed)}",
                                  param="seed")
    stop_ids = _field(body, "stop_token_ids", lambda v: isinstance(v, list) and all(_is_int(t) for t in v),
                      "a list of token ids", [])
    sampling.update(stop=_stop(body), stop_token_ids=tuple(stop_ids), logit_bias=_logit_bias(body))
    return sampling


def parse_request(body, *, chat: bool, unknown: Callable[[list[str]], None] = lambda names: None) -> ParsedRequest:
    """Check a decoded JSON body of /v1/chat/completions (chat) or /v1/completions; `unknown` hears
    the names of fields this server does not know."""
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = _field(body, "model", lambda v: isinstance(v, str), "a string")
    messages = parse_messages(body, unknown) if chat else None
    prompts = None if chat else _prompts(body)
    _check_catalogue(body, chat, unknown)
    n = _field(body, "n", _is_int, "an integer", 1)
    if not 1 <= n * len(prompts or [0]) <= MAX_CHOICES:
        raise InvalidRequestError(f"'n' x the number of prompts must be in [1, {MAX_CHOICES}], got n={n}", param="n")
    max_tokens, max_tokens_param = _max_tokens(body, chat)
    stream = _field(body, "stream", _is_bool, "a boolean", False)
    include_usage, continuous_usage = _stream_options(body, stream)
    add_generation_prompt = _field(body, "add_generation_prompt", _is_bool, "a boolean", True)
    continue_final = _field(body, "continue_final_message", _is_bool, "a boolean", False)
    add_special = _field(body, "add_special_tokens", _is_bool, "a boolean", not chat)
    request_id = _field(body, "request_id", lambda v: isinstance(v, str) and v.isprintable() and 0 < len(v) <= 128,
                        "a printable string of at most 128 characters")
    tags = {name: body[name] for name in TAG_FIELDS if body.get(name) is not None}
    sampling = _sampling(body)
    grammar = response_format_grammar(body)
    if grammar is not None:
        sampling["grammar"] = grammar
    tools = parse_tools(body) if chat else None
    if tools is not None and tools.parses:
        if grammar is not None and tools.choice in ("required", "function"):
            raise InvalidRequestError("'tool_choice' cannot force a tool call together with a JSON "
                                      "'response_format'", param="tool_choice")
        if sampling.get("skip_special_tokens"):  # the formats' markers may be special tokens
            raise InvalidRequestError("'skip_special_tokens' must be false when tool calls are read back "
                                      "(tool_choice other than 'none')", param="skip_special_tokens")
        sampling["skip_special_tokens"] = False
    return ParsedRequest(chat, model, prompts, messages, _template_kwargs(body) if chat else {},
                         add_generation_prompt, continue_final, add_special, n, max_tokens, max_tokens_param,
                         sampling, stream, include_usage, continuous_usage, _logprobs(body, chat), tags,
                         request_id, tools)
