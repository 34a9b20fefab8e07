"""Which status code each request error maps to: one table for the gRPC servicer and the data plane."""

from __future__ import annotations

import grpc

from storaged.policy import CapacityExhausted, InvalidRequest
from storaged.server.engine import EmptyRequest, LoadError, ObjectDataLoss, ObjectReadFailed, TooManyIds
from storaged.server.sessions import SessionBusy, SessionNotFound

# Errors a request may end with; anything else is a bug (INTERNAL, with a traceback in the log).
REQUEST_ERRORS: tuple[type[Exception], ...] = (SessionNotFound, InvalidRequest, EmptyRequest, TooManyIds,
                                               CapacityExhausted, LoadError, SessionBusy)


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code a request error maps to; None for errors that are bugs (INTERNAL)."""
    if isinstance(error, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND
    if isinstance(error, (InvalidRequest, EmptyRequest, TooManyIds)):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, CapacityExhausted):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, ObjectDataLoss):
        return grpc.StatusCode.DATA_LOSS
    if isinstance(error, SessionBusy):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, ObjectReadFailed):
        # the disk failed the read (EIO, a short read of a truncated pack): the object is not
        # available now; the proto lists UNAVAILABLE for this, not INTERNAL
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, LoadError):
        return grpc.StatusCode.INTERNAL
    return None
