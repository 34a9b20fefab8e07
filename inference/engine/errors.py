"""Typed errors of the generation engine; the server maps each to an HTTP status.

InvalidRequestError -> 400, QueueFullError -> 429, RequestTimeoutError -> 408,
ExpertSourceUnavailableError, ExpertCapacityExhaustedError and EngineClosedError -> 503,
ExpertDataLossError -> 502, EngineInternalError -> 500.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base class of everything the engine refuses or fails with."""


class InvalidRequestError(EngineError):
    """A request the engine cannot run as asked; `param` names the offending field (OpenAI's `param`)."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ExpertSourceUnavailableError(EngineError):
    """The expert source (storaged) could not serve experts; the request was abandoned.

    Expert sources may raise it themselves; the engine also raises it in place of a source's own
    "unavailable" exception (see inference.engine.source_hooks), which it keeps as __cause__.
    """


class ExpertDataLossError(EngineError):
    """An expert object the request needed failed its integrity check (storaged's DATA_LOSS, or a
    checksum mismatch read from a local pack); the request was abandoned, others go on. The
    message names neither the object's file nor its place: the server's log does."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id}: an expert object this request needs failed its integrity "
                         "check in the expert storage (data loss); the server's log names it")
        self.request_id = request_id


class ExpertCapacityExhaustedError(EngineError):
    """The expert cache had no room for the experts one step needed at once (other sessions of the
    daemon pin the rest); the request was abandoned and may be retried."""

    def __init__(self, request_id: str):
        super().__init__(f"request {request_id}: the expert cache has no room for this request's experts now "
                         "(other clients hold its slots); retry later")
        self.request_id = request_id


class EngineClosedError(EngineError):
    """The engine is shutting down and takes no more requests (or dropped a queued one)."""


class QueueFullError(EngineError):
    """As many requests as the queue admits are already waiting; the client should retry later."""

    def __init__(self, request_id: str, limit: int, retry_after: float = 1.0):
        super().__init__(f"request {request_id}: {limit} requests are already waiting (the server's "
                         f"queue limit); retry later")
        self.request_id = request_id
        self.limit = limit
        self.retry_after = retry_after  # seconds: about one request's time, when a place frees up


class RequestTimeoutError(EngineError):
    """The request ran past its time limit (waiting included) and was stopped."""

    def __init__(self, request_id: str, limit_seconds: float, *, waiting: bool):
        where = "while waiting in the queue" if waiting else "while generating"
        super().__init__(f"request {request_id}: exceeded the server's request timeout of {limit_seconds:g} s {where}")
        self.request_id = request_id
        self.limit_seconds = limit_seconds


class EngineInternalError(EngineError):
    """Generation failed for a reason other than the request or the expert source being down."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id}: generation failed: {type(cause).__name__}: {cause}")
        self.request_id = request_id
