"""Exceptions to OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import logging

from aiohttp import web

from inference.engine import EngineClosedError, EngineError, ExpertSourceUnavailableError, InvalidRequestError
from inference.server.responses import error_body

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"
SERVER_ERROR = "server_error"
RETRY_AFTER_SECONDS = "1"


class ModelNotLoadedError(EngineError):
    """A generation request arrived while the model is still loading (or failed to load)."""


def status_and_body(error: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for an exception raised while serving a request."""
    if isinstance(error, InvalidRequestError):
        status = 404 if error.code == "model_not_found" else 400
        return status, error_body(error.message, type_=INVALID_REQUEST, param=error.param, code=error.code)
    if isinstance(error, ExpertSourceUnavailableError):
        return 503, error_body(str(error), type_=SERVICE_UNAVAILABLE, code="expert_source_unavailable")
    if isinstance(error, EngineClosedError):
        return 503, error_body(str(error), type_=SERVICE_UNAVAILABLE, code="shutting_down")
    if isinstance(error, ModelNotLoadedError):
        return 503, error_body(str(error), type_=SERVICE_UNAVAILABLE, code="model_not_loaded")
    return 500, error_body(f"internal error: {type(error).__name__}: {error}", type_=SERVER_ERROR)


def error_response(error: BaseException) -> web.Response:
    status, body = status_and_body(error)
    headers = {"Retry-After": RETRY_AFTER_SECONDS} if status == 503 else None
    return web.json_response(body, status=status, headers=headers)
