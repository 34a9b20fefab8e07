"""POST /v1/completions and /v1/chat/completions: request -> engine choices -> JSON or SSE.

A streamed response's headers are sent with its first event, so a request that fails before
producing anything (queue full, expert source down, engine shutting down) still gets a proper
status code; a failure after that ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging

from aiohttp import web

from inference.engine import (
    Choice,
    EngineClosedError,
    Finished,
    InvalidRequestError,
    TextDelta,
    encode_chat,
    encode_completion_prompt,
)
from inference.engine.generate import FINISH_CANCELLED
from inference.engine.prompt import check_prompt_chars, check_template_kwargs, text_chars
from inference.server.errors import ModelNotLoadedError, status_and_body
from inference.server.middleware import RESPONSE_ID, TAGS, USAGE
from inference.server.protocol import ParsedRequest, parse_request
from inference.server.responses import SSE_DONE, CompletionShape, sse
from inference.server.state import STATE, ServerState
from inference.server.tools import ToolPlan, plan_tools
from servicekit.echo import shown

log = logging.getLogger("inference.server")


def engine_of(state: ServerState):
    if state.engine is None:
        detail = f"failed to load: {state.load_error}" if state.load_error else "still loading"
        raise ModelNotLoadedError(f"model {state.model_name!r} is {detail}")
    return state.engine


async def json_body(request: web.Request):
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc
    except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
        raise InvalidRequestError(f"the request body is not valid JSON here: {str(exc).split(';')[0]}") from exc
    except RecursionError:  # arrays or objects nested deeper than the decoder's recursion allows
        raise InvalidRequestError("the request body is not valid JSON here: nested too deeply") from None


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.model_name:
        raise InvalidRequestError(f"the model {shown(model)} does not exist; this server serves "
                                  f"{state.model_name!r}", param="model", code="model_not_found")


def _check_not_cancelled(finished: Finished) -> None:
    # the engine cancels a running request only when it shuts down under it
    if finished.finish_reason == FINISH_CANCELLED:
        raise EngineClosedError("the request was cancelled: the server is shutting down")


def check_prompt_lengths(engine, parsed: ParsedRequest) -> None:
    """Refuse a text prompt far longer than the context can hold before tokenizing it."""
    context, tokenizer = engine.runner.context_length, engine.tokenizer
    if parsed.chat:
        check_prompt_chars(tokenizer, context, text_chars(parsed.messages), param="messages")
        return
    for prompt in parsed.prompts:
        if isinstance(prompt, str):
            check_prompt_chars(tokenizer, context, len(prompt), param="prompt")


def _encode_prompts(engine, parsed: ParsedRequest) -> list[list[int]]:
    tokenizer = engine.tokenizer
    check_prompt_lengths(engine, parsed)
    if parsed.chat:  # reasoning_effort is a field of its own: a refusal names it, not chat_template_kwargs
        kwargs = dict(parsed.template_kwargs)
        effort = {"reasoning_effort": kwargs.pop("reasoning_effort")} if "reasoning_effort" in kwargs else {}
        check_template_kwargs(tokenizer, kwargs)
        check_template_kwargs(tokenizer, effort, param="reasoning_effort")
        return [encode_chat(tokenizer, parsed.messages, template_kwargs=parsed.template_kwargs,
                            add_generation_prompt=parsed.add_generation_prompt,
                            continue_final_message=parsed.continue_final_message,
                            add_special_tokens=parsed.add_special_tokens,
                            tools=list(parsed.tools.tools) if parsed.tools is not None else None)]
    return [encode_completion_prompt(tokenizer, p if isinstance(p, str) else list(p),
                                     add_special_tokens=parsed.add_special_tokens) for p in parsed.prompts]


def _max_tokens(state: ServerState, engine, parsed: ParsedRequest, prompt_ids: list[int]) -> int:
    """The request's max_tokens, checked against the server's cap; or the default: the model's
    max_new_tokens, the cap, and the context left, whichever is least."""
    cap = state.max_tokens
    if parsed.max_tokens is not None:
        if cap is not None and parsed.max_tokens > cap:
            raise InvalidRequestError(f"'{parsed.max_tokens_param}' is {parsed.max_tokens}; this server allows at "
                                      f"most {cap} (--max-tokens)", param=parsed.max_tokens_param)
        return parsed.max_tokens
    limits = [v for v in (cap, state.generation_defaults.get("max_tokens")) if v is not None]
    if engine.runner.context_length is not None or not limits:
        limits.append(engine.runner.room_after(prompt_ids))
    return min(limits)


def _choices(state: ServerState, engine, parsed: ParsedRequest, prompts: list[list[int]],
             tools: ToolPlan | None = None) -> list[Choice]:
    choices = []
    for prompt_ids in prompts:
        params = parsed.sampling_params(_max_tokens(state, engine, parsed, prompt_ids), state.generation_defaults)
        if tools is not None and tools.grammar is not None:
            params = dataclasses.replace(params, grammar=tools.grammar)
        engine.runner.check_request(prompt_ids, params, prompt_param=parsed.prompt_param)
        choices += [Choice(prompt_ids, params.for_choice(i)) for i in range(parsed.n)]
    return choices


async def generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_request(await json_body(request), chat=chat,
                           unknown=lambda names: state.unknown_fields(request.path, names))
    request[TAGS] = dict(parsed.tags)
    check_model(state, parsed.model)
    engine = engine_of(state)
    tools = plan_tools(engine.tokenizer, parsed.tools) if parsed.tools is not None else None
    prompts = await asyncio.to_thread(_encode_prompts, engine, parsed)  # long prompts take a while
    choices = _choices(state, engine, parsed, prompts, tools)
    shape = CompletionShape(chat=chat, model=state.model_name, include_usage=parsed.include_usage, tools=tools,
                            continuous_usage=parsed.continuous_usage, request_id=parsed.request_id,
                            prompt_tokens=sum(map(len, prompts)), choices=len(choices), logprobs=parsed.logprobs,
                            token_texts=state.token_texts() if parsed.logprobs is not None else None)
    request[RESPONSE_ID] = shape.id
    request[USAGE] = shape.usage(0)
    events = engine.stream_choices(choices, request_id=shape.id)
    if parsed.stream:
        return await _stream_response(request, shape, events)
    finished: list[Finished] = []
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                _check_not_cancelled(event)
                finished.append(event)
    body = shape.full(finished)
    request[USAGE] = body["usage"]
    return web.json_response(body)


async def _stream_response(request: web.Request, shape: CompletionShape, events) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    completion_tokens: dict[int, int] = {}
    async with contextlib.aclosing(events):  # leaving early cancels the request in the engine
        try:
            async for event in events:
                if response is None:  # first event: from here on the status is 200
                    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                                           "Cache-Control": "no-cache"})
                    await response.prepare(request)
                    for chunk in shape.opening_chunks():
                        await response.write(sse(chunk))
                if isinstance(event, Finished):
                    _check_not_cancelled(event)
                    completion_tokens[event.index] = event.usage.completion_tokens
                    request[USAGE] = shape.usage(sum(completion_tokens.values()))
                    for chunk in shape.finish_chunks(event):
                        await response.write(sse(chunk))
                elif isinstance(event, TextDelta):
                    completion_tokens[event.index] = event.completion_tokens
                    chunk = shape.text_chunk(event)
                    if chunk is not None:
                        await response.write(sse(chunk))
            usage = shape.usage_chunk()
            if usage is not None:
                await response.write(sse(usage))
            await response.write(SSE_DONE)
        except ConnectionResetError:
            log.info("request %s: the client went away", shape.id)
            return response
        except Exception as exc:
            if response is None:
                raise  # nothing sent yet: the middleware answers with the error's status
            log.warning("request %s failed mid-stream: %s", shape.id, exc)
            with contextlib.suppress(ConnectionResetError):
                await response.write(sse(status_and_body(exc)[1]))
                await response.write(SSE_DONE)
        finally:
            request[USAGE] = shape.usage(sum(completion_tokens.values()))
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await generate(request, chat=False)
