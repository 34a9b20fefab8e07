"""What every request goes through: API key, CORS, OpenAI-style errors, the requests metric and
one access log line.

A client that goes away before its answer (a non-streamed request cancelled by aiohttp) is still
counted and logged, with nginx's status 499 ("client closed request").
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError

from inference.server.errors import INVALID_REQUEST, SERVER_ERROR, UnauthorizedError, error_response, status_and_body
from inference.server.responses import error_body
from inference.server.state import STATE, ServerState
from servicekit.echo import ECHO_CHARS, shown

log = logging.getLogger("inference.server")
access_log = logging.getLogger("inference.access")

CLIENT_CLOSED = 499
OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})  # no key needed: probes and scrapers
ENDPOINTS = ("/v1/models", "/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/health",
             "/metrics", "/version")
PREFLIGHT_MAX_AGE = "600"  # seconds a browser may cache a preflight answer
CORS_METHODS = "GET, POST, OPTIONS"
CORS_DEFAULT_HEADERS = "Authorization, Content-Type"


class ParserErrorLog(logging.LoggerAdapter):
    """aiohttp's server log, less the traceback it writes for a request its HTTP parser refused (a
    header line of more than 8190 bytes, a malformed request line): that is the client's error,
    which aiohttp answers 400 itself; one warning line says what it was."""

    def exception(self, msg, *args, exc_info=True, **kwargs) -> None:
        if isinstance(exc_info, HttpProcessingError) and 400 <= exc_info.code < 500:
            what = " ".join(str(exc_info.message).split())
            self.warning(f"{msg}: %s: %s", *args, type(exc_info).__name__, what[:200], **kwargs)
        else:
            self.error(msg, *args, exc_info=exc_info, **kwargs)


PARSER_ERROR_LOG = ParserErrorLog(logging.getLogger("aiohttp.server"), {})

# what handlers leave on the request for the access log
USAGE = web.RequestKey("usage", dict)
RESPONSE_ID = web.RequestKey("response_id", str)
TAGS = web.RequestKey("tags", dict)


def endpoint_label(request: web.Request) -> str:
    path = request.path.rstrip("/") or "/"
    if path.startswith("/v1/models/"):
        return "/v1/models/{model}"
    return path if path in ENDPOINTS else "other"


def _check_api_key(state: ServerState, request: web.Request) -> None:
    if not state.api_keys or request.path in OPEN_PATHS:
        return
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise UnauthorizedError("this server needs an API key: send 'Authorization: Bearer <key>'")
    token = token.strip().encode()
    # every key compared, in constant time: no timing hint of how close a guess was
    if not any([hmac.compare_digest(token, key.encode()) for key in state.api_keys]):
        raise UnauthorizedError("the API key is not valid for this server")


def _origin_allowed(state: ServerState, origin: str | None) -> bool:
    return bool(origin) and ("*" in state.allowed_origins or origin in state.allowed_origins)


def _is_preflight(request: web.Request) -> bool:
    return (request.method == "OPTIONS" and "Origin" in request.headers
            and "Access-Control-Request-Method" in request.headers)


def _preflight(state: ServerState, request: web.Request) -> web.Response:
    origin = request.headers["Origin"]
    if not _origin_allowed(state, origin):
        return web.json_response(error_body(f"origin {shown(origin)} is not allowed (--allowed-origins)",
                                            type_=INVALID_REQUEST, code="cors_origin_not_allowed"), status=403)
    requested = request.headers.get("Access-Control-Request-Headers")
    return web.Response(status=204, headers={
        "Access-Control-Allow-Methods": CORS_METHODS,
        # the browser openai client sends its own x-stainless-* headers: allow what is asked
        "Access-Control-Allow-Headers": requested or CORS_DEFAULT_HEADERS,
        "Access-Control-Max-Age": PREFLIGHT_MAX_AGE,
    })


def _options(request: web.Request) -> web.Response:
    """A plain OPTIONS (no CORS preflight): the methods the path takes."""
    error = getattr(request.match_info, "http_exception", None)
    if isinstance(error, web.HTTPMethodNotAllowed):
        return web.Response(status=204, headers={"Allow": ", ".join(sorted({*error.allowed_methods, "OPTIONS"}))})
    raise error if error is not None else web.HTTPMethodNotAllowed("OPTIONS", [])


async def add_cors_headers(request: web.Request, response: web.StreamResponse) -> None:
    """on_response_prepare: runs before any response's headers leave, streamed ones included."""
    state = request.app[STATE]
    origin = request.headers.get("Origin")
    if not _origin_allowed(state, origin):
        return
    response.headers["Access-Control-Allow-Origin"] = "*" if "*" in state.allowed_origins else origin
    response.headers.add("Vary", "Origin")


def _cut(path: str) -> str:
    """A request path for an error message: at most ECHO_CHARS of it, as the client sent it."""
    return path if len(path) <= ECHO_CHARS else f"{path[:ECHO_CHARS]}... ({len(path)} characters)"


def _log_access(state: ServerState, request: web.Request, status: int, started: float) -> None:
    state.metrics.record_request(endpoint_label(request), status)
    if not state.access_log:
        return
    latency = time.monotonic() - started
    usage = request.get(USAGE) or {}
    fields = {"remote": request.remote, "method": request.method, "path": request.path, "status": status,
              "latency_seconds": round(latency, 6), "prompt_tokens": usage.get("prompt_tokens"),
              "completion_tokens": usage.get("completion_tokens"), "id": request.get(RESPONSE_ID),
              **(request.get(TAGS) or {}), "user_agent": request.headers.get("User-Agent")}
    access_log.info('%s "%s %s" %d %.3fs', request.remote, request.method, request.path, status, latency,
                    extra={"fields": fields, "in_message": ("remote", "method", "path", "status", "latency_seconds")})


@web.middleware
async def front(request: web.Request, handler):
    state = request.app[STATE]
    started = time.monotonic()
    try:
        if _is_preflight(request):
            response = _preflight(state, request)
        elif request.method == "OPTIONS":
            response = _options(request)
        else:
            _check_api_key(state, request)
            response = await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        type_ = INVALID_REQUEST if exc.status < 500 else SERVER_ERROR
        message = f"{exc.reason}: {request.method} {_cut(request.path)}"
        if exc.text and exc.text != f"{exc.status}: {exc.reason}":  # aiohttp says more (413: the limit)
            message += f" ({exc.text.rstrip('.')})"
        response = web.json_response(error_body(message, type_=type_),
                                     status=exc.status, headers={"Allow": exc.headers["Allow"]}
                                     if "Allow" in exc.headers else None)
    except asyncio.CancelledError:
        _log_access(state, request, CLIENT_CLOSED, started)
        raise
    except Exception as exc:
        status, _ = status_and_body(exc)
        if status == 500:  # a bug; 502 and 503 are the expert storage's, logged by the engine already
            log.exception("%s %s failed", request.method, request.path)
        response = error_response(exc)
    _log_access(state, request, response.status, started)
    return response
