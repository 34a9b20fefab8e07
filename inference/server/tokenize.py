"""POST /tokenize and /detokenize, with vLLM's request and response shapes.

/tokenize takes a completions-style `prompt` or chat-style `messages` (through the chat template,
as /v1/chat/completions would encode them) and answers {"count", "max_model_len", "tokens",
"token_strs"}; /detokenize takes {"tokens"} and answers {"prompt"}.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from inference.engine import InvalidRequestError, encode_chat, encode_completion_prompt
from inference.engine.prompt import check_prompt_chars, check_template_kwargs, text_chars
from inference.server.generation import check_model, engine_of, json_body
from inference.server.messages import parse_messages
from inference.server.state import STATE
from servicekit.echo import shown

TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt",
                             "continue_final_message", "chat_template_kwargs", "return_token_strs"})


def _flag(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise InvalidRequestError(f"'{name}' must be a boolean, got {shown(value)}", param=name)
    return value


def _object(body) -> dict:
    if not isinstance(body, dict):
        raise InvalidRequestError("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequestError(f"'model' must be a string, got {shown(model)}", param="model")
    return body


def _encode(tokenizer, body: dict, context_length: int | None) -> list[int]:
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give either 'prompt' or 'messages'", param="prompt")
    if "prompt" in body:
        prompt = body["prompt"]
        if not isinstance(prompt, str):
            raise InvalidRequestError(f"'prompt' must be a string, got {shown(prompt)}", param="prompt")
        check_prompt_chars(tokenizer, context_length, len(prompt), param="prompt")
        return encode_completion_prompt(tokenizer, prompt, add_special_tokens=_flag(body, "add_special_tokens", True))
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise InvalidRequestError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    check_template_kwargs(tokenizer, kwargs)
    messages = parse_messages(body)
    check_prompt_chars(tokenizer, context_length, text_chars(messages), param="messages")
    return encode_chat(tokenizer, messages, template_kwargs=kwargs,
                       add_generation_prompt=_flag(body, "add_generation_prompt", True),
                       continue_final_message=_flag(body, "continue_final_message", False),
                       add_special_tokens=_flag(body, "add_special_tokens", False))


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _object(await json_body(request))
    unknown = sorted(set(body) - TOKENIZE_FIELDS)
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}", param=unknown[0])
    check_model(state, body.get("model"))
    engine = engine_of(state)
    tokens = await asyncio.to_thread(_encode, engine.tokenizer, body, engine.runner.context_length)
    token_strs = None
    if _flag(body, "return_token_strs", False):
        token_strs = await asyncio.to_thread(engine.tokenizer.convert_ids_to_tokens, tokens)
    return web.json_response({"count": len(tokens), "max_model_len": engine.runner.context_length,
                              "tokens": tokens, "token_strs": token_strs})


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    body = _object(await json_body(request))
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise InvalidRequestError(f"unknown field(s) {', '.join(unknown)}", param=unknown[0])
    check_model(state, body.get("model"))
    engine = engine_of(state)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise InvalidRequestError(f"'tokens' must be a list of token ids, got {shown(tokens)}", param="tokens")
    bad = [t for t in tokens if not 0 <= t < engine.runner.vocab_size]
    if bad:
        raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {engine.runner.vocab_size})",
                                  param="tokens")
    text = await asyncio.to_thread(engine.tokenizer.decode, tokens)
    return web.json_response({"prompt": text})
