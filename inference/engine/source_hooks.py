"""Optional capabilities of an expert source that the engine uses when they are present.

The ExpertSource protocol (inference.experts) only requires `layout` and `acquire`. A source
backed by a daemon (storaged) may also offer:

- `expert_wait_seconds() -> float`: cumulative seconds spent inside `acquire` since it was made;
  the engine turns increments into the expert_wait_seconds_total metric.
- `reconnect() -> None`: re-establish the connection after an "unavailable" error; raises the
  same unavailable error while the daemon is still down. Called on the engine's worker thread.
- `is_available() -> bool`: a cheap reachability probe for /health; called from another thread
  than the worker's, so it must be thread-safe.
- `connection_problem() -> str | None`: why the source's connection is gone (e.g. the daemon
  restarted while idle), or None while it is there; local and instant (no request), thread-safe.
  Checked by /health and before each request: a lost connection is reconnected first.
- `unavailable_errors: tuple[type[BaseException], ...]`: exception types that mean "the source
  is down or restarting" (storaged.client.errors.Unavailable is always recognized).
- `data_loss_errors`, `capacity_errors`: exception types that mean "an expert object failed its
  integrity check" and "the source has no room for one step's experts now" (storaged's DataLoss
  and CapacityExhausted, and packformat's ObjectChecksumError, are always recognized).
"""

from __future__ import annotations

from collections.abc import Iterator

from inference.engine.errors import ExpertSourceUnavailableError


def _storaged_unavailable() -> tuple[type[BaseException], ...]:
    try:  # grpc is a dependency, but an engine without storaged installed must still work
        from storaged.client.errors import Unavailable
    except ImportError:
        return ()
    return (Unavailable,)


def unavailable_error_types(source) -> tuple[type[BaseException], ...]:
    declared = tuple(getattr(source, "unavailable_errors", ()) or ())
    return (ExpertSourceUnavailableError, *_storaged_unavailable(), *declared)


def _storaged_storage_errors() -> tuple[tuple[type[BaseException], ...], tuple[type[BaseException], ...]]:
    """(data loss types, capacity types) of storaged's client and packformat's pack reader."""
    data_loss: tuple[type[BaseException], ...] = ()
    capacity: tuple[type[BaseException], ...] = ()
    try:
        from packformat.errors import ObjectChecksumError
        data_loss += (ObjectChecksumError,)
    except ImportError:
        pass
    try:
        from storaged.client.errors import CapacityExhausted, DataLoss
        data_loss += (DataLoss,)
        capacity += (CapacityExhausted,)
    except ImportError:
        pass
    return data_loss, capacity


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen = set()
    while error is not None and id(error) not in seen:  # transformers code may wrap exceptions
        seen.add(id(error))
        yield error
        error = error.__cause__ or error.__context__


def find_unavailable(error: BaseException, source) -> BaseException | None:
    """The "source unavailable" exception in `error`'s cause chain, or None."""
    kinds = unavailable_error_types(source)
    return next((e for e in _chain(error) if isinstance(e, kinds)), None)


def find_data_loss(error: BaseException, source) -> BaseException | None:
    """The "expert object failed its integrity check" exception in `error`'s cause chain, or None."""
    kinds = (*_storaged_storage_errors()[0], *(getattr(source, "data_loss_errors", ()) or ()))
    return next((e for e in _chain(error) if isinstance(e, kinds)), None)


def find_capacity_exhausted(error: BaseException, source) -> BaseException | None:
    """The "no room for this step's experts now" exception in `error`'s cause chain, or None."""
    kinds = (*_storaged_storage_errors()[1], *(getattr(source, "capacity_errors", ()) or ()))
    return next((e for e in _chain(error) if isinstance(e, kinds)), None)


def expert_wait_seconds(source) -> float | None:
    hook = getattr(source, "expert_wait_seconds", None)
    return float(hook()) if callable(hook) else None


def reconnect(source) -> None:
    """Ask the source to reconnect; a source without the hook is assumed to recover by itself."""
    hook = getattr(source, "reconnect", None)
    if callable(hook):
        hook()


def connection_problem(source) -> str | None:
    hook = getattr(source, "connection_problem", None)
    return hook() if callable(hook) else None


def probe_available(source) -> bool:
    hook = getattr(source, "is_available", None)
    return bool(hook()) if callable(hook) else True
