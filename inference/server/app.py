"""The OpenAI-compatible aiohttp application: /v1/models, /v1/completions, /v1/chat/completions,
/health and /metrics over one Engine.

A streamed response's headers are sent with its first event, so a request that fails before
producing anything (expert source down, engine shutting down) still gets a proper status code;
a failure after that ends the stream with an error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time

from aiohttp import web

from inference.engine import (
    Engine,
    EngineClosedError,
    EngineMetrics,
    Finished,
    InvalidRequestError,
    encode_chat,
    encode_completion_prompt,
)
from inference.engine.generate import FINISH_CANCELLED
from inference.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from inference.server.errors import (
    INVALID_REQUEST,
    SERVER_ERROR,
    ModelNotLoadedError,
    error_response,
    status_and_body,
)
from inference.server.protocol import ParsedRequest, parse_request
from inference.server.responses import SSE_DONE, CompletionShape, error_body, model_card, models_list, sse

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 * 1024 * 1024  # long prompts; aiohttp's default is 1 MiB
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics")


@dataclasses.dataclass
class ServerState:
    """What the handlers share; `engine` is None until the model has loaded."""

    model_name: str
    metrics: EngineMetrics
    engine: Engine | None = None
    load_error: str | None = None
    created: int = dataclasses.field(default_factory=lambda: int(time.time()))


STATE = web.AppKey("state", ServerState)


def _endpoint_label(request: web.Request) -> str:
    path = request.path.rstrip("/") or "/"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ENDPOINTS else "other"


@web.middleware
async def _errors_and_metrics(request: web.Request, handler):
    state = request.app[STATE]
    try:
        response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = INVALID_REQUEST if exc.status < 500 else SERVER_ERROR
        response = web.json_response(error_body(f"{exc.reason}: {request.method} {request.path}", type_=type_),
                                     status=exc.status)
    except Exception as exc:
        status, _ = status_and_body(exc)
        if status >= 500 and status != 503:
            log.exception("%s %s failed", request.method, request.path)
        response = error_response(exc)
    state.metrics.record_request(_endpoint_label(request), response.status)
    return response


def _engine(state: ServerState) -> Engine:
    if state.engine is None:
        detail = f"failed to load: {state.load_error}" if state.load_error else "still loading"
        raise ModelNotLoadedError(f"model {state.model_name!r} is {detail}")
    return state.engine


async def _json_body(request: web.Request):
    try:
        return await request.json(loads=json.loads)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from exc


def _check_model(state: ServerState, parsed: ParsedRequest) -> None:
    if parsed.model is not None and parsed.model != state.model_name:
        raise InvalidRequestError(f"the model {parsed.model!r} does not exist; this server serves "
                                  f"{state.model_name!r}", param="model", code="model_not_found")


def _check_not_cancelled(finished: Finished) -> None:
    # the engine cancels a running request only when it shuts down under it
    if finished.finish_reason == FINISH_CANCELLED:
        raise EngineClosedError("the request was cancelled: the server is shutting down")


async def _generate(request: web.Request, *, chat: bool) -> web.StreamResponse:
    state = request.app[STATE]
    parsed = parse_request(await _json_body(request), chat=chat)
    _check_model(state, parsed)
    engine = _engine(state)
    if chat:  # off the event loop: a long prompt takes a while to tokenize
        prompt_ids = await asyncio.to_thread(encode_chat, engine.tokenizer, parsed.messages)
    else:
        prompt_ids = await asyncio.to_thread(encode_completion_prompt, engine.tokenizer, parsed.prompt)
    max_tokens = parsed.max_tokens if parsed.max_tokens is not None else engine.runner.room_after(prompt_ids)
    params = parsed.sampling_params(max_tokens)
    engine.runner.check_request(prompt_ids, params, prompt_param=parsed.prompt_param)
    shape = CompletionShape(chat=chat, model=state.model_name, include_usage=parsed.include_usage)
    events = engine.stream(prompt_ids, params, request_id=shape.id)
    if parsed.stream:
        return await _stream_response(request, shape, events)
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Finished):
                _check_not_cancelled(event)
                return web.json_response(shape.full(event))
    raise AssertionError("the engine's stream ended without a Finished event")


async def _stream_response(request: web.Request, shape: CompletionShape, events) -> web.StreamResponse:
    response: web.StreamResponse | None = None
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
                    for chunk in shape.closing_chunks(event.finish_reason, event.usage):
                        await response.write(sse(chunk))
                elif event.text:
                    await response.write(sse(shape.text_chunk(event.text)))
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
    return response


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=True)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _generate(request, chat=False)


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_list(state.model_name, state.created))


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_name:
        raise InvalidRequestError(f"the model {name!r} does not exist", param="model", code="model_not_found")
    return web.json_response(model_card(state.model_name, state.created))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is None:
        reason = f"model failed to load: {state.load_error}" if state.load_error else "model loading"
        return web.json_response({"status": "unavailable", "reason": reason}, status=503)
    report = await state.engine.health()
    return web.json_response({"status": "ok" if report.ok else "unavailable", "reason": report.reason},
                             status=200 if report.ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response = web.Response(body=state.metrics.exposition())
    response.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return response


def create_app(state: ServerState) -> web.Application:
    """The application; the caller sets `state.engine` once the model is loaded and closes it afterwards."""
    app = web.Application(middlewares=[_errors_and_metrics], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app
