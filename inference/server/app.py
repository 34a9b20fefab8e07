"""The OpenAI-compatible aiohttp application over one Engine: /v1/models, /v1/completions,
/v1/chat/completions, vLLM's /tokenize and /detokenize, /health, /metrics and /version."""

from __future__ import annotations

from aiohttp import web

from inference import __version__
from inference.engine.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from inference.engine import InvalidRequestError
from inference.server.errors import public
from inference.server.generation import chat_completions, completions
from inference.server.middleware import add_cors_headers, front
from inference.server.responses import model_card, models_list
from inference.server.state import STATE, ServerState
from inference.server.tokenize import detokenize, tokenize
from servicekit.echo import shown

MAX_BODY_BYTES = 64 * 1024 * 1024  # long prompts; aiohttp's default is 1 MiB


def _max_model_len(state: ServerState) -> int | None:
    return state.engine.runner.context_length if state.engine is not None else None


async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE]
    return web.json_response(models_list(state.model_name, state.created, _max_model_len(state)))


async def get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    name = request.match_info["model"]
    if name != state.model_name:
        raise InvalidRequestError(f"the model {shown(name)} does not exist", param="model", code="model_not_found")
    return web.json_response(model_card(state.model_name, state.created, _max_model_len(state)))


async def health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is None:
        reason = f"model failed to load: {state.load_error}" if state.load_error else "model loading"
        return web.json_response({"status": "unavailable", "reason": public(reason)}, status=503)
    report = await state.engine.health()
    return web.json_response({"status": "ok" if report.ok else "unavailable", "reason": public(report.reason)},
                             status=200 if report.ok else 503)


async def metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    response = web.Response(body=state.metrics.exposition())
    response.headers["Content-Type"] = METRICS_CONTENT_TYPE
    return response


async def version(request: web.Request) -> web.Response:
    return web.json_response({"version": __version__})


def create_app(state: ServerState) -> web.Application:
    """The application; the caller sets `state.engine` once the model is loaded and closes it afterwards."""
    app = web.Application(middlewares=[front], client_max_size=MAX_BODY_BYTES)
    app[STATE] = state
    app.on_response_prepare.append(add_cors_headers)
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", get_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    return app
