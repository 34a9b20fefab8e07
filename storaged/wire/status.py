"""StatusCode: the status of a failed storaged request, as plain Python.

The numbers are gRPC's canonical codes, so the gRPC edge converts by value and the data plane's
ERROR frames carry the same numbers; the storaged client's errors carry this enum, so callers
that inspect a failure never handle a grpc type.
"""

from __future__ import annotations

import enum


class StatusCode(enum.IntEnum):
    """gRPC's canonical status codes (grpc.StatusCode), by name and number."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16

    @classmethod
    def of(cls, number: int) -> StatusCode:
        """The code numbered `number`; UNKNOWN for a number gRPC does not define (as gRPC does)."""
        try:
            return cls(number)
        except ValueError:
            return cls.UNKNOWN
