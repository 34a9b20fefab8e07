"""Typed errors of the generation engine; the server maps each to an HTTP status.

InvalidRequestError -> 400, ExpertSourceUnavailableError and EngineClosedError -> 503,
EngineInternalError -> 500.
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


class EngineClosedError(EngineError):
    """The engine is shutting down and takes no more requests (or dropped a queued one)."""


class EngineInternalError(EngineError):
    """Generation failed for a reason other than the request or the expert source being down."""

    def __init__(self, request_id: str, cause: BaseException):
        super().__init__(f"request {request_id}: generation failed: {type(cause).__name__}: {cause}")
        self.request_id = request_id
