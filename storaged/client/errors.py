"""Typed client errors: one per status code storaged uses, carrying the server's message.

`code` is storaged.wire.status.StatusCode, plain Python: the gRPC status of a failed call is
converted here, at the client's edge, so callers never handle a grpc type.
"""

from __future__ import annotations

import grpc

from storaged.wire.status import StatusCode


class StorageError(Exception):
    """A request to storaged failed; `code` is its StatusCode, the message is the server's."""

    def __init__(self, code: StatusCode, message: str, *, rpc: str = ""):
        if not isinstance(code, StatusCode):
            raise TypeError(f"{type(self).__name__} takes a storaged.wire.status.StatusCode, not {code!r}")
        where = f"{rpc}: " if rpc else ""
        super().__init__(f"{where}{code.name}: {message}")
        self.code = code
        self.details = message
        self.rpc = rpc


class NotFound(StorageError):
    """Unknown model or session (NOT_FOUND)."""


class InvalidRequest(StorageError):
    """Layer or expert out of range, duplicate or too many ids (INVALID_ARGUMENT)."""


class CapacityExhausted(StorageError):
    """The pinned demand exceeds the cache capacity (RESOURCE_EXHAUSTED)."""


class DataLoss(StorageError):
    """An object failed its checksum; its slot was not published (DATA_LOSS)."""


class SessionBusy(StorageError):
    """The session already has an Acquire stream open (FAILED_PRECONDITION)."""


class Unavailable(StorageError):
    """The daemon is not reachable, starting or stopping (UNAVAILABLE)."""


class ClientClosed(Exception):
    """The client or session was used after close()."""


_BY_CODE: dict[StatusCode, type[StorageError]] = {
    StatusCode.NOT_FOUND: NotFound,
    StatusCode.INVALID_ARGUMENT: InvalidRequest,
    StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    StatusCode.DATA_LOSS: DataLoss,
    StatusCode.FAILED_PRECONDITION: SessionBusy,
    StatusCode.UNAVAILABLE: Unavailable,
}


def from_rpc_error(error: grpc.RpcError, rpc: str) -> StorageError:
    """The typed exception for a failed call (grpc.RpcError raised by a stub)."""
    code = StatusCode.of(error.code().value[0]) if hasattr(error, "code") else StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return _BY_CODE.get(code, StorageError)(code, details or "", rpc=rpc)


def from_status(code: int, message: str, rpc: str) -> StorageError:
    """The typed exception for a status the data plane returned (gRPC's numeric code)."""
    status = StatusCode.of(code)
    return _BY_CODE.get(status, StorageError)(status, message, rpc=rpc)
