"""The data plane server: Acquire, Prefetch and Release on storaged's own framing over a second
Unix socket (protocol: storaged.wire.dataplane). One connection per session; it binds the
session like an Acquire stream does, and hands the client its step fence page. A connection
that opens with ARENA instead only receives the arena's memfd (CPU) and is closed.

Peer credentials are checked on accept against the same allow-list as the gRPC socket (here the
daemon owns the socket, so SO_PEERCRED is read directly): a refused peer gets no descriptor, of
the arena or of anything else. The client's pidfd is kept so a client that dies mid-step holds
back slot reuse only until its process is gone (fences.py).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import socket
import struct
from pathlib import Path

import grpc

from storaged.server.engine import StorageEngine
from storaged.server.fences import FenceTable
from storaged.server.peer_access import REFUSAL, AccessPolicy, PeerCredentialsUnavailable, peer_credentials
from storaged.server.sessions import ServerSession, SessionNotFound, SessionRegistry
from storaged.server.status import REQUEST_ERRORS, status_of
from storaged.wire import dataplane as wire
from storaged.wire.dataplane import Kind

log = logging.getLogger("storaged")

HELLO_TIMEOUT_SECONDS = 5.0
LINGER_SECONDS = 0.2  # after an error that ends a connection, how long unread input is drained
SOCKET_MODE = 0o660
STOPPING = "storaged is stopping"


class ProtocolError(ValueError):
    """A frame that is not what the protocol allows: the connection is answered and closed."""


class HostTierNotShared(RuntimeError):
    """A HOST_TIER request to a daemon without a host tier (FAILED_PRECONDITION)."""


class DataPlaneServer:
    def __init__(self, path: Path, engine: StorageEngine, sessions: SessionRegistry, fences: FenceTable,
                 policy: AccessPolicy | None):
        self.path = path
        self.engine = engine
        self.sessions = sessions
        self.fences = fences
        self.policy = policy
        self.stopping = False
        self._listener: socket.socket | None = None
        self._accepting: asyncio.Task | None = None
        self._connections: set[asyncio.Task] = set()

    async def start(self) -> None:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listener.bind(os.fspath(self.path))
            os.chmod(self.path, SOCKET_MODE)
            listener.listen(128)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self._listener = listener
        self._accepting = asyncio.create_task(self._accept_forever(), name="dataplane accept")

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            connection, _ = await loop.sock_accept(self._listener)
            task = asyncio.create_task(self._serve(connection), name="dataplane connection")
            self._connections.add(task)
            task.add_done_callback(self._connections.discard)

    def begin_shutdown(self) -> None:
        """Refuse new requests; connections answer UNAVAILABLE and close."""
        self.stopping = True

    async def close(self) -> None:
        if self._accepting is not None:
            self._accepting.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._accepting
        for task in list(self._connections):
            task.cancel()
        if self._connections:
            await asyncio.wait(set(self._connections))
        if self._listener is not None:
            self._listener.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)

    # ---- one connection ----------------------------------------------------------------------

    async def _serve(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        pidfd = None
        session: ServerSession | None = None
        try:
            try:
                peer = peer_credentials(sock)
            except PeerCredentialsUnavailable:
                return
            if self.policy is not None and not self.policy.admits(peer):
                await loop.sock_sendall(sock, _error(0, grpc.StatusCode.PERMISSION_DENIED, REFUSAL))
                await _linger(loop, sock)
                return
            try:
                session = await asyncio.wait_for(self._hello(sock), HELLO_TIMEOUT_SECONDS)
                if session is None:  # an ARENA exchange, answered: nothing to serve or bind
                    await _linger(loop, sock)
                    return
            except (TimeoutError, ProtocolError, ConnectionError, HostTierNotShared, *REQUEST_ERRORS) as exc:
                if not isinstance(exc, ConnectionError):
                    code = grpc.StatusCode.DEADLINE_EXCEEDED if isinstance(exc, TimeoutError) else (
                        grpc.StatusCode.FAILED_PRECONDITION if isinstance(exc, HostTierNotShared) else
                        status_of(exc) or grpc.StatusCode.INVALID_ARGUMENT)
                    with contextlib.suppress(OSError):
                        await loop.sock_sendall(sock, _error(0, code, str(exc) or "no HELLO in time"))
                        await _linger(loop, sock)
                return
            with contextlib.suppress(OSError):
                pidfd = os.pidfd_open(peer.pid)
            page = self.fences.open(session.id)
            hello_ok = wire.frame(Kind.HELLO_OK, 0, wire.U32.pack(wire.VERSION))
            # A fresh socket's send buffer is empty: this small message with its fd goes out whole.
            sock.sendmsg([hello_ok], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [page.fd]))])
            reader, writer = await asyncio.open_unix_connection(sock=sock)
            try:
                await self._requests(session, reader, writer)
                # ended by a malformed frame: let the client read the error before the close
                if writer.can_write_eof():
                    writer.write_eof()
                with contextlib.suppress(TimeoutError, ConnectionError):
                    await asyncio.wait_for(reader.read(wire.MAX_BODY), LINGER_SECONDS)
            finally:
                writer.close()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client went away: everything it held is released below
        finally:
            if session is not None:
                self.fences.release(session.id, pidfd)
                pidfd = None  # the fence table owns it now (closes it when done)
                self.engine.close_session(session)
                self.sessions.unbind_stream(session)
                self.sessions.close(session.id)
            if pidfd is not None:
                os.close(pidfd)
            sock.close()

    async def _hello(self, sock: socket.socket) -> ServerSession | None:
        """The session a HELLO binds; None after answering an ARENA (which binds nothing)."""
        loop = asyncio.get_running_loop()
        header = await _recv_exactly(loop, sock, wire.HEADER.size)
        length, kind, _, _ = wire.HEADER.unpack(header)
        if kind not in (Kind.HELLO, Kind.ARENA, Kind.HOST_TIER) or not 4 < length <= 4 + 1024:
            raise ProtocolError(f"expected a HELLO, ARENA or HOST_TIER frame of at most 1028 bytes, got kind {kind}, "
                                f"{length} bytes")
        body = await _recv_exactly(loop, sock, length)
        (version,) = wire.U32.unpack_from(body)
        if version != wire.VERSION:
            raise ProtocolError(f"data plane version {version} is not spoken here (this daemon: {wire.VERSION})")
        if self.stopping:
            raise ProtocolError(STOPPING)
        try:
            session_id = body[4:].decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError("the HELLO's session id is not UTF-8") from None
        if kind == Kind.ARENA:
            self._send_arena(sock, session_id)
            return None
        if kind == Kind.HOST_TIER:
            self._send_host_tier(sock, session_id)
            return None
        return self.sessions.bind_stream(session_id)

    def _send_arena(self, sock: socket.socket, session_id: str) -> None:
        self.sessions.get(session_id)  # SessionNotFound: the arena goes to an attached session's client
        fd = self.engine.arena.client_fd
        if fd is None:
            raise ProtocolError("this daemon's arena is CUDA IPC memory, mapped from the Attach reply's "
                                "descriptor alone; ARENA hands out memfd arenas only")
        _send_fd(sock, Kind.ARENA_OK, fd)
        self.engine.metrics.record_dataplane_request("arena")

    def _send_host_tier(self, sock: socket.socket, session_id: str) -> None:
        self.sessions.get(session_id)  # SessionNotFound, as for ARENA
        tier = self.engine.host_tier
        fd = tier.client_fd if tier is not None and self.engine.arena.host_slots else None
        if fd is None:
            raise HostTierNotShared("this daemon shares no host tier (host_cache_bytes is 0): "
                                    "its arena descriptor has host_slots 0")
        _send_fd(sock, Kind.HOST_TIER_OK, fd)
        self.engine.metrics.record_dataplane_request("host_tier")

    async def _requests(self, session: ServerSession, reader: asyncio.StreamReader,
                        writer: asyncio.StreamWriter) -> None:
        metrics = self.engine.metrics
        while True:
            header = await reader.readexactly(wire.HEADER.size)
            length, kind, _, request_id = wire.HEADER.unpack(header)
            if length > wire.MAX_BODY:
                writer.write(_error(request_id, grpc.StatusCode.INVALID_ARGUMENT,
                                    f"frame of {length} bytes exceeds the limit of {wire.MAX_BODY}"))
                await writer.drain()
                return
            body = await reader.readexactly(length)
            if self.stopping:
                writer.write(_error(request_id, grpc.StatusCode.UNAVAILABLE, STOPPING))
                await writer.drain()
                return
            try:
                reply = await self._dispatch(session, kind, request_id, body)
            except ProtocolError as exc:
                writer.write(_error(request_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
                await writer.drain()
                return
            except REQUEST_ERRORS as exc:
                code = status_of(exc) or grpc.StatusCode.INTERNAL
                reply = _error(request_id, code, str(exc))
            except Exception:  # a bug: say so, log it, and end this session (its state is suspect)
                log.exception("data plane request %d (kind %d) of session %s failed", request_id, kind, session.id[:8])
                writer.write(_error(request_id, grpc.StatusCode.INTERNAL, "internal error; see the daemon's log"))
                await writer.drain()
                return
            metrics.record_dataplane_request(_KIND_NAMES.get(kind, "other"))
            writer.write(reply)
            await writer.drain()

    async def _dispatch(self, session: ServerSession, kind: int, request_id: int, body: bytes) -> bytes:
        if session.closed:
            raise SessionNotFound(session.id)
        if kind == Kind.ACQUIRE:
            layer, flags, experts = _ids(body, wire.ACQUIRE_HEAD)
            if flags & ~wire.ACQUIRE_RELEASE_OTHER_LAYERS:
                raise ProtocolError(f"ACQUIRE flags {flags:#x} has unknown bits")
            slots, events = await self.engine.acquire(
                session, layer, experts, release_other_layers=bool(flags & wire.ACQUIRE_RELEASE_OTHER_LAYERS))
            return wire.frame(Kind.ACQUIRE_OK, request_id,
                              b"".join(wire.SLOT_EVENT.pack(s, e) for s, e in zip(slots, events, strict=True)))
        if kind == Kind.PREFETCH:
            layer, _, experts = _ids(body, wire.PREFETCH_HEAD)
            started = self.engine.prefetch(session, layer, experts)
            return wire.frame(Kind.PREFETCH_OK, request_id, wire.U32.pack(started))
        if kind == Kind.RELEASE:
            if len(body) != wire.RELEASE_BODY.size:
                raise ProtocolError(f"RELEASE body is {len(body)} bytes, not {wire.RELEASE_BODY.size}")
            has_layer, layer = wire.RELEASE_BODY.unpack(body)
            if has_layer not in (0, 1):
                raise ProtocolError(f"RELEASE has_layer is {has_layer}, not 0 or 1")
            self.engine.release(session, layer if has_layer else None)
            return wire.frame(Kind.RELEASE_OK, request_id)
        raise ProtocolError(f"frame kind {kind} is not a request")


_KIND_NAMES = {Kind.ACQUIRE: "acquire", Kind.PREFETCH: "prefetch", Kind.RELEASE: "release"}


def _send_fd(sock: socket.socket, kind: int, fd: int) -> None:
    # As for HELLO_OK: a fresh socket's empty send buffer takes this small frame and its fd whole.
    sock.sendmsg([wire.frame(kind, 0)], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


def _ids(body: bytes, head) -> tuple[int, int, tuple[int, ...]]:
    """(layer, flags or 0, expert ids) of an ACQUIRE or PREFETCH body."""
    if len(body) < head.size:
        raise ProtocolError(f"request body of {len(body)} bytes is shorter than its {head.size}-byte head")
    fields = head.unpack_from(body)
    layer, count = fields[0], fields[-1]
    flags = fields[1] if len(fields) == 3 else 0
    if len(body) != head.size + 4 * count:
        raise ProtocolError(f"request names {count} experts but carries {len(body) - head.size} bytes of ids")
    return layer, flags, struct.unpack_from(f"<{count}I", body, head.size)


def _error(request_id: int, code: grpc.StatusCode, message: str) -> bytes:
    text = message.encode("utf-8", "replace")[:4096]  # a client-controlled name never floods the reply
    return wire.frame(Kind.ERROR, request_id, wire.ERROR_HEAD.pack(code.value[0]) + text)


async def _linger(loop: asyncio.AbstractEventLoop, sock: socket.socket) -> None:
    """Half-close and read what the client still sends, briefly: closing with unread bytes would
    reset the connection, and the client could lose the error frame just sent."""
    sock.shutdown(socket.SHUT_WR)
    with contextlib.suppress(TimeoutError, OSError):
        await asyncio.wait_for(loop.sock_recv(sock, wire.MAX_BODY), LINGER_SECONDS)


async def _recv_exactly(loop: asyncio.AbstractEventLoop, sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = await loop.sock_recv(sock, n - len(data))
        if not chunk:
            raise ConnectionResetError("the client closed the connection")
        data += chunk
    return bytes(data)
