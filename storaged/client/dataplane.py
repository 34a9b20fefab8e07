"""The client end of the data plane (storaged.wire.dataplane): a blocking Unix socket, one per
session, no threads. Requests are answered in order; prefetch hints are sent without waiting,
and their replies are read (and checked) on the way to the next reply that is waited for.

    plane = DataPlaneClient("/run/expertpack/storaged.sock.data", session_id)
    slots, events = plane.acquire(layer, [5, 17], release_other_layers=True)
    plane.prefetch(layer + 1, [3, 9])            # returns at once
    with plane.fence.step():                      # brackets device work that reads the slot map
        ...
    fd = receive_arena_fd("/run/expertpack/storaged.sock.data", session_id)  # memfd arenas, at Attach
"""

from __future__ import annotations

import contextlib
import mmap
import numbers
import os
import select
import socket
import struct
from collections.abc import Sequence

from storaged.client.errors import ClientClosed, InvalidRequest, StorageError, Unavailable, from_status
from storaged.wire import dataplane as wire
from storaged.wire.dataplane import Kind
from storaged.wire.status import StatusCode


class FenceRevoked(StorageError):
    """The daemon stopped honouring this session's step fence: a step may have read slots that
    were overwritten, so its results must not be used."""


class StepFence:
    """This session's fence page: STARTED before a step's device work is launched, FINISHED once
    it completed (storaged.wire.dataplane).

    Up to MAX_OPEN_STEPS steps may be open at once (a decoder launching step n + 1 before it has
    read step n's result); they finish in the order they began. The daemon snapshots STARTED, so
    a reuse waits for the newest open step, and with it every older one."""

    MAX_OPEN_STEPS = 2

    def __init__(self, fd: int):
        self._mmap = mmap.mmap(fd, wire.FENCE_BYTES, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._words = memoryview(self._mmap).cast("Q")  # aligned 8-byte stores: never torn
        self._step = self._words[wire.FENCE_STARTED // 8]
        self._finished = self._step

    @property
    def open(self) -> bool:
        """Whether a step began and has not ended."""
        return self._step > self._finished

    @property
    def open_steps(self) -> int:
        return self._step - self._finished

    @property
    def revoked(self) -> bool:
        return self._words[wire.FENCE_REVOKED // 8] != 0

    def begin(self) -> int:
        """Mark step n started and return n; call before launching device work that reads the slot map."""
        if self.open_steps >= self.MAX_OPEN_STEPS:
            raise RuntimeError(f"begin() of a step fence with {self.open_steps} steps open (at most "
                               f"{self.MAX_OPEN_STEPS}): step {self._finished + 1} did not end")
        if self.revoked:
            raise FenceRevoked(StatusCode.FAILED_PRECONDITION, "the daemon revoked this session's step "
                               "fence (a step stayed open longer than its fence timeout); reconnect", rpc="fence")
        self._step += 1
        self._words[wire.FENCE_STARTED // 8] = self._step
        return self._step

    def end(self, step: int | None = None) -> None:
        """Mark step `step` (default: the last begun) and every step before it finished: call
        only once their device work completed (after a sync).
        Raises FenceRevoked if the daemon stopped waiting for it: its results are not to be trusted."""
        step = self._step if step is None else step
        if not self._finished < step <= self._step:
            raise RuntimeError(f"end({step}) of a step fence whose open steps are "
                               f"{self._finished + 1}..{self._step}")
        self._words[wire.FENCE_FINISHED // 8] = step
        self._finished = step
        if self.revoked:
            raise FenceRevoked(StatusCode.FAILED_PRECONDITION, f"step {step} outlived the daemon's "
                               "fence timeout and may have read overwritten slots", rpc="fence")

    @contextlib.contextmanager
    def step(self):
        self.begin()
        try:
            yield self._step
        finally:
            self.end()

    def close(self) -> None:
        self._words.release()
        self._mmap.close()


class DataPlaneClient:
    def __init__(self, path: str, session_id: str, *, timeout: float = 60.0):
        self.path = path
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.settimeout(timeout)
        self._buffer = bytearray()
        self._next_request = 0
        self._prefetches: set[int] = set()  # request ids of hints whose replies are not read yet
        self._closed = False
        try:
            self._sock.connect(path)
            self._sock.sendall(wire.frame(Kind.HELLO, 0, wire.U32.pack(wire.VERSION) + session_id.encode()))
            data, fds, _, _ = socket.recv_fds(self._sock, 4096, 1)
            self._buffer += data
            kind, _, body = self._read_frame()
            if kind == Kind.ERROR:
                raise _error(body, "HELLO")
            if kind != Kind.HELLO_OK or not fds:
                raise StorageError(StatusCode.INTERNAL, f"{path}: HELLO answered with frame kind {kind}"
                                   f"{'' if fds else ' and no fence page'}", rpc="HELLO")
            self.fence = StepFence(fds[0])
            for fd in fds:
                socket.close(fd)  # the mapping keeps the page
        except OSError as exc:
            self._sock.close()
            raise Unavailable(StatusCode.UNAVAILABLE, f"data plane {path}: {exc}", rpc="HELLO") from None
        except BaseException:
            self._sock.close()
            raise

    # ---- requests ---------------------------------------------------------------------------

    def acquire(self, layer: int, experts: Sequence[int], *, release_other_layers: bool = False
                ) -> tuple[list[int], list[int]]:
        """(slots, ready events) of `experts` of `layer`, in order (see Session.acquire_raw)."""
        flags = wire.ACQUIRE_RELEASE_OTHER_LAYERS if release_other_layers else 0
        try:
            body = wire.ACQUIRE_HEAD.pack(layer, flags, len(experts)) + wire.u32_array(experts)
        except struct.error:
            raise _out_of_range("Acquire", layer, experts) from None
        reply = self._call(Kind.ACQUIRE, body, Kind.ACQUIRE_OK, "Acquire")
        if len(reply) != 8 * len(experts):
            raise StorageError(StatusCode.INTERNAL, f"ACQUIRE_OK of {len(reply)} bytes for {len(experts)} "
                               "experts", rpc="Acquire")
        pairs = struct.unpack(f"<{2 * len(experts)}i", reply)
        return [p & 0xFFFFFFFF for p in pairs[0::2]], list(pairs[1::2])

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Send a hint and return at once; its reply is checked before the next awaited reply."""
        try:
            body = wire.PREFETCH_HEAD.pack(layer, len(experts)) + wire.u32_array(experts)
        except struct.error:
            raise _out_of_range("Prefetch", layer, experts) from None
        request_id = self._send(Kind.PREFETCH, body)
        self._prefetches.add(request_id)

    def release(self, layer: int | None) -> None:
        try:
            body = wire.RELEASE_BODY.pack(0 if layer is None else 1, 0 if layer is None else layer)
        except struct.error:
            raise _out_of_range("Release", layer, ()) from None
        self._call(Kind.RELEASE, body, Kind.RELEASE_OK, "Release")

    def peer_closed(self) -> bool:
        """Whether the daemon has closed this connection (it stopped, restarted, or ended the
        session); a poll that sends and reads nothing, so it may run while a request is waited for."""
        if self._closed:
            return True
        poller = select.poll()
        try:
            poller.register(self._sock, select.POLLRDHUP)  # POLLHUP, POLLERR and POLLNVAL are always reported
            ready = poller.poll(0)
        except (ValueError, OSError):  # closed by another thread meanwhile (its fileno is -1 now)
            return True
        # Unread replies (prefetch hints') only make it readable (POLLIN): not a sign of its end.
        return any(events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL)
                   for _, events in ready)

    def close(self) -> None:
        """Close the connection: the daemon releases the session's pins and ends it."""
        if self._closed:
            return
        self._closed = True
        self._sock.close()
        self.fence.close()

    # ---- framing ----------------------------------------------------------------------------

    def _send(self, kind: int, body: bytes) -> int:
        if self._closed:
            raise ClientClosed(f"data plane {self.path} is closed")
        self._next_request += 1
        try:
            self._sock.sendall(wire.frame(kind, self._next_request, body))
        except OSError as exc:
            raise Unavailable(StatusCode.UNAVAILABLE, f"data plane {self.path}: {exc}", rpc="send") from None
        return self._next_request

    def _call(self, kind: int, body: bytes, reply_kind: int, rpc: str) -> bytes:
        request_id = self._send(kind, body)
        while True:
            got_kind, got_id, reply = self._read_frame()
            if got_id in self._prefetches:  # a hint's reply on the way
                self._prefetches.discard(got_id)
                if got_kind == Kind.ERROR:
                    raise _error(reply, "Prefetch")
                continue
            if got_id != request_id:
                raise StorageError(StatusCode.INTERNAL, f"reply to request {got_id} while waiting for "
                                   f"{request_id}", rpc=rpc)
            if got_kind == Kind.ERROR:
                raise _error(reply, rpc)
            if got_kind != reply_kind:
                raise StorageError(StatusCode.INTERNAL, f"{rpc} answered with frame kind {got_kind}", rpc=rpc)
            return reply

    def _read_frame(self) -> tuple[int, int, bytes]:
        header = self._take(wire.HEADER.size)
        length, kind, _, request_id = wire.HEADER.unpack(header)
        return kind, request_id, self._take(length)

    def _take(self, n: int) -> bytes:
        while len(self._buffer) < n:
            try:
                chunk = self._sock.recv(max(65536, n - len(self._buffer)))
            except OSError as exc:
                raise Unavailable(StatusCode.UNAVAILABLE, f"data plane {self.path}: {exc}", rpc="recv") from None
            if not chunk:
                raise Unavailable(StatusCode.UNAVAILABLE, f"data plane {self.path}: the daemon closed the "
                                  "connection", rpc="recv")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data


def receive_arena_fd(path: str, session_id: str, *, timeout: float = 60.0) -> int:
    """The daemon's arena memfd for an attached session (an ARENA exchange on a connection of its
    own, which the daemon then closes); the caller owns the descriptor. It can be mapped
    read-only only: the daemon sealed the file against writes."""
    return _receive_fd(path, session_id, Kind.ARENA, Kind.ARENA_OK, "ARENA", timeout)


def receive_host_tier_fd(path: str, session_id: str, *, timeout: float = 60.0) -> int:
    """The daemon's host tier memfd (a HOST_TIER exchange, like ARENA); read-only, like the arena's.
    FAILED_PRECONDITION where the daemon shares no host tier."""
    return _receive_fd(path, session_id, Kind.HOST_TIER, Kind.HOST_TIER_OK, "HOST_TIER", timeout)


def _receive_fd(path: str, session_id: str, kind: int, ok_kind: int, rpc: str, timeout: float) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC) as sock:
        sock.settimeout(timeout)
        received: list[int] = []
        data = b""
        try:
            sock.connect(path)
            sock.sendall(wire.frame(kind, 0, wire.U32.pack(wire.VERSION) + session_id.encode()))
            while len(data) < wire.HEADER.size or len(data) < wire.HEADER.size + wire.HEADER.unpack_from(data)[0]:
                chunk, fds, _, _ = socket.recv_fds(sock, 65536, 1)
                received += fds
                if not chunk:
                    raise ConnectionResetError("the daemon closed the connection before answering")
                data += chunk
        except OSError as exc:
            for fd in received:
                os.close(fd)
            raise Unavailable(StatusCode.UNAVAILABLE, f"data plane {path}: {exc}", rpc=rpc) from None
    length, answer, _, _ = wire.HEADER.unpack_from(data)
    body = data[wire.HEADER.size:wire.HEADER.size + length]
    if answer == ok_kind and len(received) == 1:
        return received[0]
    for fd in received:
        os.close(fd)
    if answer == Kind.ERROR:
        raise _error(body, rpc)
    raise StorageError(StatusCode.INTERNAL, f"{path}: {rpc} answered with frame kind {answer} and "
                       f"{len(received)} descriptors", rpc=rpc)
def _out_of_range(rpc: str, layer: int, experts: Sequence[int]) -> StorageError:
    """The frames carry u32 ids: a request struct could not pack is refused as the daemon refuses
    it over gRPC (INVALID_ARGUMENT naming the value), not with a bare struct.error."""
    for what, value in (("layer", layer), *(("expert", e) for e in experts)):
        if not isinstance(value, numbers.Integral) or not 0 <= value <= wire.U32_MAX:
            return InvalidRequest(StatusCode.INVALID_ARGUMENT, f"{what} {value!r} is out of range: layer "
                                  "and expert ids are integers in [0, 2^32)", rpc=rpc)
    return InvalidRequest(StatusCode.INVALID_ARGUMENT, f"{len(experts)} expert ids cannot be framed", rpc=rpc)


def _error(body: bytes, rpc: str) -> StorageError:
    (code,) = wire.ERROR_HEAD.unpack_from(body)
    return from_status(code, body[wire.ERROR_HEAD.size:].decode("utf-8", "replace"), rpc)
