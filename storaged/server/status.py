"""Which status code each request error maps to: one table for the gRPC servicer and the data plane."""

from __future__ import annotations

import grpc

from storaged.policy import InvalidExpertRequest, SlotsExhausted
from storaged.server.engine import EmptyRequest, LoadError, ObjectDataLoss, ObjectReadFailed, TooManyIds
from storaged.server.sessions import SessionNotFound, StreamAlreadyOpen

# Errors a request may end with; anything else is a bug (INTERNAL, with a traceback in the log).
REQUEST_ERRORS: tuple[type[Exception], ...] = (SessionNotFound, InvalidExpertRequest, EmptyRequest, TooManyIds,
                                               SlotsExhausted, LoadError, StreamAlreadyOpen)


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code a request error maps to; None for errors that are bugs (INTERNAL)."""
    if isinstance(error, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, (InvalidExpertRequest, EmptyRequest, TooManyIds)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, SlotsExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ObjectDataLoss):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(error, StreamAlreadyOpen):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, ObjectReadFailed):
        # the disk failed the read (EIO, a short read of a truncated pack): the object is not
        # available now; the proto lists UNAVAILABLE for this, not INTERNAL
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, LoadError):
        return grpc.StatusCode.INTERNAL
    return None
