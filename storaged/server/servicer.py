"""The ExpertStorage gRPC servicer: protobuf in, engine calls, protobuf out, errors as status codes.

Pins follow the Acquire stream: when the stream ends, however it ends, the session's pins are
released. When the client ends it (half-close, cancellation, or its process died, which the
server sees as the same end of input), the session is closed too. When the server ends it with
an error status, the session survives and the client may open a new stream for it, within
session_idle_seconds like any session without a stream (sessions.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping

import grpc

from servicekit.echo import shown
from storaged import __version__
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.config import StoragedConfig
from storaged.server import convert
from storaged.server.engine import LoadError, ObjectDataLoss, StorageEngine
from storaged.server.models import ServedModel
from storaged.server.runtime import Runtime
from storaged.server.peer_access import PeerGate
from storaged.server.sessions import ServerSession, SessionNotFound, SessionRegistry, TooManySessions
from storaged.server.stats import MetricsSync, stats_response
from storaged.server.status import REQUEST_ERRORS
from storaged.server.status import status_of as request_status_of
from storaged.wire import dataplane as wire
from storaged.wire.session import SESSION_METADATA_KEY

STOPPING = "storaged is stopping"


class StreamSessionMismatch(ValueError):
    """A request on a session's Acquire stream names another session."""

    def __init__(self, session_id: str, command: convert.AcquireCommand):
        super().__init__(f"this Acquire stream belongs to session {session_id!r}; request "
                         f"{command.request_id} names {shown(command.session_id)}")


def status_of(error: Exception) -> grpc.StatusCode | None:
    """The status code a request error maps to; None for errors that are bugs (INTERNAL)."""
    if isinstance(error, StreamSessionMismatch):
        return grpc.StatusCode.INVALID_ARGUMENT
    return request_status_of(error)


_REQUEST_ERRORS = (*REQUEST_ERRORS, StreamSessionMismatch)


def info_response(config: StoragedConfig, models: Mapping[str, ServedModel],
                  runtime: Runtime) -> pb.InfoResponse:
    cuda = config.cuda_device_index is not None
    capabilities = [pb.CAPABILITY_CUDA_IPC_ARENA if cuda else pb.CAPABILITY_MEMFD_ARENA, pb.CAPABILITY_PREFETCH,
                    pb.CAPABILITY_DATA_PLANE, pb.CAPABILITY_SLOT_MAP]
    if runtime.host_tier is not None:
        capabilities += [pb.CAPABILITY_HOST_CACHE, pb.CAPABILITY_TIERED_DEMOTION]
    if config.verify_checksums:
        capabilities.append(pb.CAPABILITY_CHECKSUM_VERIFY)
    if config.verify_hits:
        capabilities.append(pb.CAPABILITY_HIT_VERIFY)
    if config.direct_io:
        capabilities.append(pb.CAPABILITY_DIRECT_IO)
    return pb.InfoResponse(
        server_version=__version__, api_version=convert.API_VERSION, capabilities=capabilities,
        models=[convert.model_info(m) for m in models.values()], device=config.device,
        slot_bytes=runtime.geometry.slot_bytes, slot_count=runtime.geometry.slot_count,
        host_cache_bytes=runtime.geometry.host_slots * runtime.geometry.slot_bytes,
        max_ids_per_acquire=config.max_ids_per_acquire)


class ExpertStorageServicer(pb_grpc.ExpertStorageServicer):
    def __init__(self, config: StoragedConfig, models: Mapping[str, ServedModel], runtime: Runtime,
                 sessions: SessionRegistry, sync: MetricsSync, *, peers: PeerGate | None = None):
        """`peers`: the gate that knows each connection's credentials, when peers are identified."""
        self.models = dict(models)
        self.peers = peers
        self.runtime = runtime
        self.engine: StorageEngine = runtime.engine
        self.sessions = sessions
        self.sync = sync
        self.stopping = False
        self._info = info_response(config, models, runtime)
        self._layouts = {name: convert.model_layout(model) for name, model in models.items()}
        self._slot_maps = {name: convert.slot_map(runtime.slot_map, model) for name, model in models.items()}
        self._data_plane = pb.DataPlane(socket_path=wire.socket_path_for(str(config.socket)), version=wire.VERSION)
        self._idle_streams: set[asyncio.Task] = set()  # Acquire handlers waiting for a request

    def begin_shutdown(self) -> None:
        """Refuse new work; end Acquire streams that are waiting for a request."""
        self.stopping = True
        for task in list(self._idle_streams):
            task.cancel()

    async def _abort(self, context, error: Exception):
        code = status_of(error)
        if self.stopping and isinstance(error, LoadError) and not isinstance(error, ObjectDataLoss):
            code = grpc.StatusCode.UNAVAILABLE
        await context.abort(code or grpc.StatusCode.INTERNAL, str(error))

    async def _refuse_if_stopping(self, context) -> None:
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)

    async def _owner(self, context) -> int | None:
        """The uid of the call's peer, when peers are identified (else None)."""
        if self.peers is None:
            return None
        peer = self.peers.peer_of(context.peer())
        if peer is None:  # the client's connection closed while this call was queued
            await context.abort(grpc.StatusCode.UNAVAILABLE, "this call's connection is gone")
        return peer.uid

    # ---- unary ------------------------------------------------------------------------------

    async def Info(self, request: pb.InfoRequest, context) -> pb.InfoResponse:
        return self._info

    async def Attach(self, request: pb.AttachRequest, context) -> pb.AttachResponse:
        await self._refuse_if_stopping(context)
        model = self.models.get(request.model)
        if model is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"model {shown(request.model)} is not served "
                                f"(served: {', '.join(sorted(self.models))})")
        owner = await self._owner(context)
        descriptor = self.runtime.arena.descriptor()  # CUDA: a fresh IPC export for this client
        try:
            session = self.sessions.open(model, owner)
        except TooManySessions as exc:
            self.engine.metrics.add("sessions_refused_total")
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        geometry = self.runtime.geometry
        return pb.AttachResponse(session_id=session.id, arena=convert.arena_descriptor(descriptor),
                                 slot_bytes=geometry.slot_bytes, slot_count=geometry.slot_count,
                                 layout=self._layouts[model.name], slot_map=self._slot_maps[model.name],
                                 data_plane=self._data_plane)

    async def Release(self, request: pb.ReleaseRequest, context) -> pb.ReleaseResponse:
        command = convert.release_command(request)
        try:
            self.engine.release(self.sessions.get(command.session_id), command.layer)
        except _REQUEST_ERRORS as exc:
            await self._abort(context, exc)
        return pb.ReleaseResponse()

    async def Prefetch(self, request: pb.PrefetchRequest, context) -> pb.PrefetchResponse:
        await self._refuse_if_stopping(context)
        command = convert.prefetch_command(request)
        try:
            self.engine.prefetch(self.sessions.get(command.session_id), command.layer, command.experts)
        except _REQUEST_ERRORS as exc:
            await self._abort(context, exc)
        return pb.PrefetchResponse()

    async def Stats(self, request: pb.StatsRequest, context) -> pb.StatsResponse:
        return stats_response(self.sync)

    async def Detach(self, request: pb.DetachRequest, context) -> pb.DetachResponse:
        try:
            session = self.sessions.get(request.session_id)  # its error says why an id is unknown
        except SessionNotFound as exc:
            await self._abort(context, exc)
        self.sessions.close(session.id)
        self.engine.close_session(session)
        return pb.DetachResponse()

    # ---- Acquire stream ---------------------------------------------------------------------

    async def Acquire(self, request_iterator: AsyncIterator[pb.AcquireRequest],
                      context) -> AsyncIterator[pb.AcquireResponse]:
        task = asyncio.current_task()
        assert task is not None
        session: ServerSession | None = None
        server_error = False  # the stream ends with our error status: the session survives it
        try:
            # A client that names its session in the call's metadata binds the stream (and so
            # the session's lifetime) before its first request.
            bound = dict(context.invocation_metadata() or ()).get(SESSION_METADATA_KEY)
            if bound:
                try:
                    session = self.sessions.bind_stream(bound)
                except _REQUEST_ERRORS as exc:
                    server_error = True
                    await self._abort(context, exc)
            while True:
                if self.stopping:
                    server_error = True
                    await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
                self._idle_streams.add(task)
                try:
                    request = await anext(request_iterator, None)
                finally:
                    self._idle_streams.discard(task)
                if request is None:
                    return  # the client half-closed, or its connection dropped
                command = convert.acquire_command(request)
                try:
                    if session is None:
                        session = self.sessions.bind_stream(command.session_id)
                    elif session.closed:
                        raise SessionNotFound(session.id)
                    elif command.session_id != session.id:
                        raise StreamSessionMismatch(session.id, command)
                    slots, events = await self.engine.acquire(
                        session, command.layer, command.experts,
                        release_other_layers=command.release_other_layers)
                except _REQUEST_ERRORS as exc:
                    server_error = True
                    await self._abort(context, exc)
                yield convert.acquire_response(convert.AcquireResult(command.request_id, slots, events))
        except asyncio.CancelledError:
            if self.stopping:
                server_error = True
                await context.abort(grpc.StatusCode.UNAVAILABLE, STOPPING)
            raise
        finally:
            if session is not None:
                self._end_stream(session, close_session=not server_error)

    def _end_stream(self, session: ServerSession, *, close_session: bool) -> None:
        self.sessions.unbind_stream(session)
        self.engine.close_session(session)
        if close_session:
            self.sessions.close(session.id)
