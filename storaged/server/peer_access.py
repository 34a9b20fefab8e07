"""Who may use the daemon: allowed_uids / allowed_gids, checked with the kernel's peer credentials.

gRPC Python cannot tell a servicer who is on the other end of a Unix socket: `context.peer()`
is just "unix:", the auth context carries no credentials even with local_server_credentials
(grpc/grpc#15511, #28755), and the C core's "add a connection from an fd" entry point is not
exported to Python. So when an allow-list is configured, the daemon owns the public socket
itself: it accepts each connection, reads SO_PEERCRED (uid, gid, pid) and SO_PEERGROUPS
(supplementary groups) from the kernel, and splices the connection byte for byte to one of two
gRPC listeners in a private 0700 directory next to the socket:

    client ──▶ public socket (0660) ──▶ PeerGate ──admitted──▶ .storaged-XXXX/admitted.sock (the servicer)
                                                 └─refused───▶ .storaged-XXXX/refused.sock  (PERMISSION_DENIED)

so a refused client gets a proper PERMISSION_DENIED status on every call, and an admitted one
talks to the real server unchanged. The same gate tells the servicer who each call comes from:
every upstream connection is bound to a name of its own in the private directory (unlinked once
connected), which gRPC reports as the call's peer (`context.peer()`), and `peer_of` maps that
name back to the credentials (used to bound sessions per uid, max_sessions_per_peer).

The splice costs one extra hop per message in each direction (the data plane, which carries the
per-layer traffic, does not cross it), which is why it only exists when peers must be identified
(an allow-list, or max_sessions_per_peer > 0); otherwise gRPC listens on the public socket
directly and the socket's mode and group are the access control.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
import socket
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import grpc

from storaged.config import StoragedConfig

log = logging.getLogger("storaged")

SO_PEERGROUPS = getattr(socket, "SO_PEERGROUPS", 59)  # Linux >= 4.13, asm-generic value
_MAX_GETSOCKOPT_BYTES = 1024  # CPython's getsockopt buffer limit: the first 256 groups
_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
LISTEN_BACKLOG = 128
MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes including the terminating NUL
_PRIVATE_DIR_PREFIX = ".storaged-"
_LONGEST_PRIVATE_SUFFIX = len(f"/{_PRIVATE_DIR_PREFIX}XXXXXXXX/admitted.sock")  # mkdtemp adds 8 characters
_UPSTREAM_NAMES = 16**12  # "c" + 12 hex digits: never longer than "admitted.sock"
REFUSAL = "access denied: this client's uid and groups are not in storaged's allowed_uids/allowed_gids"


class PrivateListenerError(OSError):
    """The private directory for the gate's gRPC listeners cannot be made next to the socket."""


class PeerCredentialsUnavailable(OSError):
    """The kernel gave no credentials for a connection (not a Unix socket, or already gone)."""


@dataclass(frozen=True)
class PeerCredentials:
    pid: int
    uid: int
    gid: int  # effective gid at connect()
    groups: tuple[int, ...]  # supplementary groups at connect() (empty where the kernel can't say)

    def __str__(self) -> str:
        return f"pid {self.pid} uid {self.uid} gid {self.gid} groups {list(self.groups)}"


def peer_credentials(sock) -> PeerCredentials:
    """The credentials the kernel recorded when the peer of connected Unix socket `sock` connected."""
    try:
        pid, uid, gid = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    except OSError as exc:
        raise PeerCredentialsUnavailable(exc.errno, f"SO_PEERCRED on fd {sock.fileno()}: {exc.strerror}") from None
    if pid == 0:  # Linux answers non-Unix sockets with zeros rather than an error
        raise PeerCredentialsUnavailable(errno.EINVAL, f"fd {sock.fileno()} has no peer credentials")
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, SO_PEERGROUPS, _MAX_GETSOCKOPT_BYTES)
        groups = struct.unpack(f"{len(raw) // 4}I", raw)
    except OSError as exc:
        # ERANGE: more groups than fit; ENOPROTOOPT: an old kernel. The primary gid still counts.
        log.warning("supplementary groups of peer pid %d (uid %d) unknown (%s); checking its gid only",
                    pid, uid, exc.strerror)
        groups = ()
    return PeerCredentials(pid, uid, gid, tuple(groups))


@dataclass(frozen=True)
class AccessPolicy:
    """A peer is admitted when its uid is in `uids`, or its gid or one of its groups is in `gids`."""

    uids: frozenset[int]
    gids: frozenset[int]

    @classmethod
    def from_config(cls, config: StoragedConfig) -> AccessPolicy | None:
        """None when neither list is set: everyone the socket's permissions let in is admitted."""
        if config.allowed_uids is None and config.allowed_gids is None:
            return None
        return cls(frozenset(config.allowed_uids or ()), frozenset(config.allowed_gids or ()))

    def __str__(self) -> str:
        return f"allowed_uids {sorted(self.uids)}, allowed_gids {sorted(self.gids)}"

    def admits(self, peer: PeerCredentials) -> bool:
        return peer.uid in self.uids or peer.gid in self.gids or not self.gids.isdisjoint(peer.groups)


class _Splice(asyncio.Protocol):
    """One end of a spliced pair: what arrives here is written to the partner's transport.
    Back-pressure crosses over: when our writes back up, the partner stops reading."""

    def __init__(self, partner: _Splice | None = None):
        self.transport: asyncio.Transport | None = None
        self.partner = partner
        self.saw_eof = False
        self._early: list[bytes] = []  # arrived before the partner was connected

    def connection_made(self, transport) -> None:
        self.transport = transport

    @property
    def _linked(self) -> bool:
        return self.partner is not None and self.partner.transport is not None

    def data_received(self, data: bytes) -> None:
        if self._linked:
            self.partner.transport.write(data)
        else:
            self._early.append(data)  # pause_reading() can come after a read already queued

    def eof_received(self) -> bool:
        self.saw_eof = True
        if self._linked:
            self._forward_eof()
        return True  # keep our write side open: the partner may still have bytes for us

    def _forward_eof(self) -> None:
        if self.partner.saw_eof:
            self.close_pair()
        elif self.partner.transport.can_write_eof():
            self.partner.transport.write_eof()

    def link(self, partner: _Splice) -> None:
        """Start forwarding to `partner` (connected), first what arrived while it was connecting."""
        self.partner = partner
        for data in self._early:
            partner.transport.write(data)
        self._early.clear()
        if self.saw_eof:
            self._forward_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.partner is not None and self.partner.transport is not None:
            self.partner.transport.close()

    def pause_writing(self) -> None:
        self.partner.transport.pause_reading()

    def resume_writing(self) -> None:
        self.partner.transport.resume_reading()

    def close_pair(self) -> None:
        for end in (self, self.partner):
            if end is not None and end.transport is not None:
                end.transport.close()


class _ClientEnd(_Splice):
    """The accepted end: paused until the gate has checked the peer and connected upstream."""

    def __init__(self, gate: PeerGate):
        super().__init__()
        self.gate = gate
        self.upstream_name: str | None = None  # the gRPC peer string of its upstream connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        transport.pause_reading()
        self.gate._accepted(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gate._pairs.discard(self)
        self.gate._peers.pop(self.upstream_name, None)
        super().connection_lost(exc)


def _refuse_everything() -> grpc.GenericRpcHandler:
    async def refuse(request_iterator, context):
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, REFUSAL)

    class RefuseEverything(grpc.GenericRpcHandler):
        def service(self, handler_call_details):
            # A stream-stream handler answers unary calls too: the status ends the call either way.
            return grpc.stream_stream_rpc_method_handler(refuse)

    return RefuseEverything()


class PeerGate:
    """The public socket's listener when peers are identified (see the module docstring).

    Construct before the gRPC server starts (it picks the private listener paths), add
    `admitted_address` to the server, start the server, then `await start()`. `policy` None
    admits every peer (the gate then only identifies them).
    """

    def __init__(self, public_path: Path, policy: AccessPolicy | None, *, socket_mode: int):
        self.public_path = public_path
        self.policy = policy
        self.socket_mode = socket_mode
        needed = len(os.fsencode(public_path.parent)) + _LONGEST_PRIVATE_SUFFIX
        if needed > MAX_SOCKET_PATH:
            raise PrivateListenerError(errno.ENAMETOOLONG, f"the gate's private sockets next to {public_path} "
                                       f"would need {needed} bytes (Unix sockets allow {MAX_SOCKET_PATH}); "
                                       "use a shorter socket path")
        try:
            self.private_dir = Path(tempfile.mkdtemp(prefix=_PRIVATE_DIR_PREFIX, dir=public_path.parent))  # 0700
        except OSError as exc:
            raise PrivateListenerError(exc.errno, f"cannot create the gate's private directory in "
                                       f"{public_path.parent}: {exc.strerror}") from None
        self.admitted_path = self.private_dir / "admitted.sock"
        self.refused_path = self.private_dir / "refused.sock"
        self._refuser: grpc.aio.Server | None = None
        self._listener: asyncio.AbstractServer | None = None
        self._pairs: set[_Splice] = set()
        self._connects: set[asyncio.Task] = set()
        self._peers: dict[str, PeerCredentials] = {}  # gRPC peer string of an upstream → its client
        self._next_name = 0

    def peer_of(self, grpc_peer: str) -> PeerCredentials | None:
        """The credentials of the client whose call gRPC reports as coming from `grpc_peer`
        (`context.peer()`); None when that connection is gone or not ours."""
        return self._peers.get(grpc_peer)

    @property
    def admitted_address(self) -> str:
        return f"unix:{self.admitted_path}"

    async def start(self) -> None:
        self._refuser = grpc.aio.server()
        self._refuser.add_generic_rpc_handlers((_refuse_everything(),))
        self._refuser.add_insecure_port(f"unix:{self.refused_path}")
        await self._refuser.start()
        listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            listening.bind(os.fspath(self.public_path))
            os.chmod(self.public_path, self.socket_mode)  # before listen(): nobody gets in early
            listening.listen(LISTEN_BACKLOG)
            listening.setblocking(False)
            self._listener = await asyncio.get_running_loop().create_unix_server(
                lambda: _ClientEnd(self), sock=listening)
        except BaseException:
            listening.close()
            raise

    def _accepted(self, client: _ClientEnd) -> None:
        task = asyncio.get_running_loop().create_task(self._connect_upstream(client))
        self._connects.add(task)
        task.add_done_callback(self._connects.discard)

    async def _connect_upstream(self, client: _ClientEnd) -> None:
        transport = client.transport
        if transport.is_closing():
            return  # the client hung up before we got to it
        try:
            peer = peer_credentials(transport.get_extra_info("socket"))
        except PeerCredentialsUnavailable as exc:
            log.warning("closing a connection without peer credentials: %s", exc)
            transport.close()
            return
        admitted = self.policy is None or self.policy.admits(peer)
        if not admitted:
            log.warning("refusing %s: not in %s", peer, self.policy)
        upstream = _Splice(partner=client)
        try:
            name, sock = await self._connect_named(self.admitted_path if admitted else self.refused_path)
            await asyncio.get_running_loop().create_unix_connection(lambda: upstream, sock=sock)
        except OSError as exc:
            log.warning("closing the connection of %s: cannot reach the private listener: %s", peer, exc)
            transport.close()
            return
        client.link(upstream)
        if transport.is_closing():  # the client hung up while we connected
            upstream.close_pair()
        else:
            client.upstream_name = f"unix:{name}"  # how gRPC names the peer of this connection's calls
            self._peers[client.upstream_name] = peer
            self._pairs.add(client)
            transport.resume_reading()

    async def _connect_named(self, target: Path) -> tuple[str, socket.socket]:
        """A socket connected to `target` from a name of its own in the private directory (unlinked
        once connected: the kernel keeps the address, which the server side sees as the peer)."""
        self._next_name = (self._next_name + 1) % _UPSTREAM_NAMES
        name = os.fspath(self.private_dir / f"c{self._next_name:x}")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.bind(name)
            try:
                await asyncio.get_running_loop().sock_connect(sock, os.fspath(target))
            finally:
                os.unlink(name)
        except BaseException:
            sock.close()
            raise
        return name, sock

    def stop_accepting(self) -> None:
        """Close the public listener (connections already spliced carry on)."""
        if self._listener is not None:
            self._listener.close()  # not wait_closed(): from Python 3.12 it waits for every connection
            self._listener = None

    def remove_private_dir(self) -> None:
        shutil.rmtree(self.private_dir, ignore_errors=True)

    async def close(self) -> None:
        """After the gRPC server stopped: drop every spliced connection, the refuser, the private dir."""
        self.stop_accepting()
        for task in list(self._connects):
            task.cancel()
        for client in list(self._pairs):
            client.close_pair()
        if self._refuser is not None:
            await self._refuser.stop(None)
        self.remove_private_dir()
