"""Typed client errors: one per gRPC status code storaged uses, carrying the server's message."""

from __future__ import annotations

import grpc


class StorageError(Exception):
    """An RPC to storaged failed; `code` is the gRPC status, the message is the server's."""

    def __init__(self, code: grpc.StatusCode, message: str, *, rpc: str = ""):
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


_BY_CODE: dict[grpc.StatusCode, type[StorageError]] = {
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequest,
    grpc.StatusCode.RESOURCE_EXHAUSTED: CapacityExhausted,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.FAILED_PRECONDITION: SessionBusy,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
}


def from_rpc_error(error: grpc.RpcError, rpc: str) -> StorageError:
    """The typed exception for a failed call (grpc.RpcError raised by a stub)."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return _BY_CODE.get(code, StorageError)(code, details or "", rpc=rpc)


_CODES_BY_VALUE: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


def from_status(code: int, message: str, rpc: str) -> StorageError:
    """The typed exception for a status the data plane returned (gRPC's numeric code)."""
    status = _CODES_BY_VALUE.get(code, grpc.StatusCode.UNKNOWN)
    return _BY_CODE.get(status, StorageError)(status, message, rpc=rpc)
