"""Exceptions to OpenAI-style error responses: {"error": {"message", "type", "param", "code"}}.

A server error's message never shows a path of the server's files (a bundle, a pack, a socket):
the exceptions behind 5xx answers carry them for the log, and `public` blanks them for clients.
"""

from __future__ import annotations

import logging
import math
import re

from aiohttp import web

from inference.engine import (
    EngineClosedError,
    EngineError,
    ExpertCapacityExhaustedError,
    ExpertDataLossError,
    ExpertSourceUnavailableError,
    InvalidRequestError,
    QueueFullError,
    RequestTimeoutError,
)
from inference.server.responses import error_body

log = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"
SERVICE_UNAVAILABLE = "service_unavailable_error"
RATE_LIMIT = "rate_limit_error"  # OpenAI's type for 429
TIMEOUT = "timeout_error"
SERVER_ERROR = "server_error"
RETRY_AFTER_SECONDS = "1"
HIDDEN_PATH = "<path>"
# an absolute, ~ or ./ path: not inside a word, a number or a URL (http://host/x), but after unix:
_PATH = re.compile(r"(?:(?<=unix:)|(?<![\w.:/~-]))(?:~|\.\.?)?/[^\s'\"()\[\]{},;:]*[^\s'\"()\[\]{},;:.]")


def public(message: str) -> str:
    """`message` with every filesystem path in it replaced by <path>, for a client's eyes."""
    return _PATH.sub(HIDDEN_PATH, message)


class ModelNotLoadedError(EngineError):
    """A generation request arrived while the model is still loading (or failed to load)."""


class UnauthorizedError(EngineError):
    """The request carries no API key, or one the server does not know (401)."""


def status_and_body(error: BaseException) -> tuple[int, dict]:
    """The HTTP status and OpenAI error body for an exception raised while serving a request."""
    if isinstance(error, InvalidRequestError):
        status = 404 if error.code == "model_not_found" else 400
        return status, error_body(error.message, type_=INVALID_REQUEST, param=error.param, code=error.code)
    if isinstance(error, UnauthorizedError):
        return 401, error_body(str(error), type_=INVALID_REQUEST, code="invalid_api_key")
    if isinstance(error, QueueFullError):
        return 429, error_body(str(error), type_=RATE_LIMIT, code="queue_full")
    if isinstance(error, RequestTimeoutError):
        return 408, error_body(str(error), type_=TIMEOUT, code="request_timeout")
    if isinstance(error, ExpertSourceUnavailableError):
        return 503, error_body(public(str(error)), type_=SERVICE_UNAVAILABLE, code="expert_source_unavailable")
    if isinstance(error, ExpertCapacityExhaustedError):
        return 503, error_body(public(str(error)), type_=SERVICE_UNAVAILABLE, code="expert_capacity_exhausted")
    if isinstance(error, ExpertDataLossError):
        # the expert storage behind this server answered, but without the intact object: a
        # gateway's failure of its upstream, and retrying does not repair the bundle
        return 502, error_body(public(str(error)), type_=SERVER_ERROR, code="expert_data_loss")
    if isinstance(error, EngineClosedError):
        return 503, error_body(public(str(error)), type_=SERVICE_UNAVAILABLE, code="shutting_down")
    if isinstance(error, ModelNotLoadedError):
        return 503, error_body(public(str(error)), type_=SERVICE_UNAVAILABLE, code="model_not_loaded")
    return 500, error_body(public(f"internal error: {type(error).__name__}: {error}"), type_=SERVER_ERROR)


def error_response(error: BaseException) -> web.Response:
    status, body = status_and_body(error)
    headers = {}
    if status == 503:
        headers["Retry-After"] = RETRY_AFTER_SECONDS
    if status == 429:
        headers["Retry-After"] = str(max(1, math.ceil(getattr(error, "retry_after", 1))))
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="inference"'
    return web.json_response(body, status=status, headers=headers or None)
