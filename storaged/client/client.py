"""StorageClient: the synchronous client inference links against (no server imports).

    client = StorageClient("/run/expertpack/storaged.sock")
    session = client.attach("qwen3-30b")
    slots = session.acquire(layer=3, experts=[5, 17, 40])   # pinned until layer 3's next acquire
    slots = session.acquire(4, [1, 2], release_other_layers=True)  # layer 3's pins dropped too
    weights = session.slot_bytes(slots[0], nbytes)          # uint8 view into the mapped arena
    session.close(); client.close()

All of a session's Acquire calls travel on one long-lived bidirectional stream (a request
iterator fed by a queue), so a call costs one message each way rather than a new RPC. If the
stream fails (the server aborts it with a status code), the session's pins are gone and a fresh
stream is opened for the same session. The session ends when this stream ends: close() or the
death of this process.
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import grpc

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.client import replies
from storaged.client.errors import ClientClosed, StorageError, Unavailable, from_rpc_error
from storaged.client.dataplane import DataPlaneClient, StepFence, receive_arena_fd, receive_host_tier_fd
from storaged.client.layout import (LayerLayout, ObjectLayout, SlotMapView, arena_from_proto, layers_from_proto,
                                    slot_map_from_proto)
from storaged.device.client_arena import ClientArena, map_arena
from storaged.device.client_host_tier import ClientHostTier
from storaged.device.descriptor import KIND_MEMFD
from storaged.wire import dataplane as wire
from storaged.wire.session import SESSION_METADATA_KEY
from storaged.wire.status import StatusCode

_END = object()  # ends a stream's request iterator


class _AcquireStream:
    """One Acquire RPC: requests go in through a queue, replies come back in order."""

    def __init__(self, stub: pb_grpc.ExpertStorageStub, session_id: str):
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._replies: Iterator[pb.AcquireResponse] = stub.Acquire(
            iter(self._requests.get, _END), metadata=((SESSION_METADATA_KEY, session_id),))

    def call(self, request: pb.AcquireRequest) -> pb.AcquireResponse:
        self._requests.put(request)
        try:
            return next(self._replies)
        except StopIteration:
            raise StorageError(StatusCode.UNKNOWN, "the server ended the Acquire stream without "
                               "a status", rpc="Acquire") from None

    def close(self) -> None:
        """Half-close and wait for the server to end the stream (it releases the pins)."""
        self._requests.put(_END)
        try:
            for _ in self._replies:
                pass
        except grpc.RpcError:
            pass  # the stream already failed; its pins are gone either way

    def cancel(self) -> None:
        self._requests.put(_END)
        self._replies.cancel()  # type: ignore[attr-defined]

    def ended(self) -> bool:
        """Whether the RPC is over (the server ended it, or its connection dropped)."""
        return self._replies.done()  # type: ignore[attr-defined]


class Session:
    """A model attached in the daemon: the mapped arena, the slot layout, and the channel its
    Acquire, Prefetch and Release travel on: the data plane when the daemon offers it (a round
    trip of tens of microseconds), else a gRPC Acquire stream (hundreds)."""

    def __init__(self, client: StorageClient, model: str, reply: pb.AttachResponse, *, data_plane: bool = True):
        self._client = client
        self.model = model
        self.id = reply.session_id
        self.slot_size = reply.slot_bytes
        self.slot_count = reply.slot_count
        self.layers: dict[int, LayerLayout] = layers_from_proto(reply.layout)
        self.slot_map_view: SlotMapView | None = slot_map_from_proto(reply)
        self._plane: DataPlaneClient | None = None
        self._stream: _AcquireStream | None = None
        self._host_tier: ClientHostTier | None = None
        self._data_plane_path = reply.data_plane.socket_path if reply.HasField("data_plane") else None
        try:
            offered = reply.HasField("data_plane") and reply.data_plane.version == wire.VERSION
            self.arena: ClientArena = self._map(arena_from_proto(reply.arena, reply.slot_bytes, reply.slot_count),
                                                reply, offered)
            if data_plane and offered:
                # Opened now, not at the first acquire: the session's lifetime is this connection's.
                self._plane = DataPlaneClient(reply.data_plane.socket_path, self.id, timeout=client.timeout)
        except BaseException:
            with contextlib.suppress(StorageError):
                client._call("Detach", pb.DetachRequest(session_id=self.id))  # nothing bound yet: end it
            raise
        self._lock = threading.Lock()  # pairs each request with its reply on the shared channel
        self._next_request = 0
        self._closed = False
        if self._plane is None:
            # Opened now, not at the first acquire: the session's lifetime is this stream's.
            self._stream = _AcquireStream(client._stub, self.id)

    def _map(self, descriptor, reply: pb.AttachResponse, offered: bool) -> ClientArena:
        if descriptor.kind != KIND_MEMFD:
            return map_arena(descriptor)
        if not offered:
            raise StorageError(StatusCode.FAILED_PRECONDITION, "the arena is a memfd handed out on the data "
                               f"plane, which this daemon does not offer at version {wire.VERSION}", rpc="Attach")
        fd = receive_arena_fd(reply.data_plane.socket_path, self.id, timeout=self._client.timeout)
        try:
            return map_arena(descriptor, fd)
        finally:
            os.close(fd)  # the mapping keeps the memory

    @property
    def fence(self) -> StepFence | None:
        """The step fence that makes reading the slot map on the device safe (data plane only)."""
        return self._plane.fence if self._plane is not None else None

    def slot_map(self):
        """int32 [rows, experts] view of this model's slot map in the arena (rows: slot_map_view.layers),
        or None when the daemon publishes none. Read it only inside a `fence.step()`."""
        view = self.slot_map_view
        if view is None or self.arena.descriptor.map_entries == 0:
            return None
        first = view.offset_bytes // 4
        entries = len(view.layers) * view.experts_per_row
        return self.arena.slot_map()[first:first + entries].view(len(view.layers), view.experts_per_row)

    def host_map(self):
        """int32 [rows, experts] view of this model's host map (object -> host tier slot, -1: not
        there; rows as slot_map's), or None when the daemon shares no host tier. Read it, and the
        host slots it names, only inside a `fence.step()`."""
        view = self.slot_map_view
        host_map = self.arena.host_map() if view is not None else None
        if host_map is None:
            return None
        first = view.offset_bytes // 4
        entries = len(view.layers) * view.experts_per_row
        return host_map[first:first + entries].view(len(view.layers), view.experts_per_row)

    def host_tier(self) -> ClientHostTier | None:
        """The daemon's host tier, mapped read-only on first call (a HOST_TIER exchange on the data
        plane), or None when it shares none or offers no data plane."""
        with self._lock:
            self._check_open()
            if self._host_tier is None and self.arena.descriptor.host_slots and self._plane is not None:
                fd = receive_host_tier_fd(self._data_plane_path, self.id, timeout=self._client.timeout)
                try:
                    self._host_tier = ClientHostTier(fd, self.slot_size, self.arena.descriptor.host_slots)
                finally:
                    os.close(fd)  # the mapping keeps the memory
            return self._host_tier

    def connection_lost(self) -> str | None:
        """Why this session's channel (its data plane connection, else its Acquire stream) is gone,
        or None while it is open. Local: nothing is sent, so it is cheap and safe from any thread.
        A lost channel means the daemon stopped, restarted or ended the session: attach again."""
        if self._closed:
            return f"session {self.id} was closed"
        plane, stream = self._plane, self._stream
        if plane is not None and plane.peer_closed():
            return f"the daemon closed the data plane connection of session {self.id}"
        if stream is not None and stream.ended():
            return f"the Acquire stream of session {self.id} ended"
        return None

    def _check_open(self) -> None:
        if self._closed:
            raise ClientClosed(f"session {self.id} of model {self.model!r} is closed")

    def acquire(self, layer: int, experts: Sequence[int], *, stream=None,
                release_other_layers: bool = False) -> list[int]:
        """Slot ids of `experts` of `layer`, in order; pinned until the layer's next acquire.

        On a CUDA arena, `stream` (default: the current stream) is made to wait for copies
        still in flight, so work queued on it afterwards sees the slots' bytes.
        `release_other_layers`: the daemon first drops this session's pins on every other layer
        (atomically: not if this acquire fails), so only this layer's demand must fit in its
        cache. Pass it only once nothing reads the other layers' slots any more (on CUDA: no
        queued kernel either), since their slots may be overwritten from then on.
        """
        slots, events = self.acquire_raw(layer, experts, release_other_layers=release_other_layers)
        for event in {e for e in events if e >= 0}:
            self.arena.wait_event(event, stream)
        return slots

    def acquire_raw(self, layer: int, experts: Sequence[int], *,
                    release_other_layers: bool = False) -> tuple[list[int], list[int]]:
        """(slots, ready_events): each event index must be waited on before reading that slot
        (-1: already complete). For callers that manage their own streams."""
        with self._lock:
            self._check_open()
            if self._plane is not None:
                return self._plane.acquire(layer, experts, release_other_layers=release_other_layers)
            self._next_request += 1
            request = pb.AcquireRequest(session_id=self.id, layer=layer, experts=experts,
                                        request_id=self._next_request,
                                        release_other_layers=release_other_layers)
            if self._stream is None:
                self._stream = _AcquireStream(self._client._stub, self.id)
            try:
                reply = self._stream.call(request)
            except (grpc.RpcError, StorageError) as exc:
                # A failed stream is finished (the server released the pins); the session lives
                # on if the server ended it with an error, so open its next stream right away.
                self._stream = _AcquireStream(self._client._stub, self.id)
                raise (from_rpc_error(exc, "Acquire") if isinstance(exc, grpc.RpcError) else exc) from None
        assert reply.request_id == request.request_id, (reply.request_id, request.request_id)
        return list(reply.slots), list(reply.ready_events)

    def release(self, layer: int | None = None) -> None:
        """Unpin `layer`'s slots, or every slot of the session."""
        with self._lock:
            self._check_open()
            if self._plane is not None:
                self._plane.release(layer)
                return
        self._client._call("Release", pb.ReleaseRequest(session_id=self.id, layer=layer))

    def prefetch(self, layer: int, experts: Sequence[int]) -> None:
        """Hint that `experts` of `layer` will be acquired soon. On the data plane it returns without
        waiting for the reply (an error in it is raised by the next call that waits)."""
        with self._lock:
            self._check_open()
            if self._plane is not None:
                self._plane.prefetch(layer, experts)
                return
        self._client._call("Prefetch", pb.PrefetchRequest(session_id=self.id, layer=layer, experts=experts))

    def object_layout(self, layer: int, expert: int) -> ObjectLayout:
        """Where each role of (layer, expert) lies inside its slot."""
        layout = self.layers.get(layer)
        if layout is None:
            raise KeyError(f"model {self.model!r}: layer {layer} has no routed experts "
                           f"(MoE layers: {sorted(self.layers)})")
        return layout.object(expert)

    def slot_bytes(self, slot: int, nbytes: int | None = None):
        """uint8 tensor view of the slot's first nbytes (whole slot by default); read-only use."""
        return self.arena.slot_view(slot, nbytes)

    def role_bytes(self, slot: int, layer: int, expert: int, role: int):
        """uint8 tensor view of one role's bytes of (layer, expert), held in `slot`."""
        where = self.object_layout(layer, expert).role(role)
        return self.arena.slot_view(slot, where.end)[where.offset:]  # [nbytes] at the role's offset

    def close(self) -> None:
        """End the Acquire stream (releasing the pins), detach, and unmap. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            stream, self._stream = self._stream, None
            plane, self._plane = self._plane, None
        if stream is not None:
            stream.close()
        if plane is not None:
            plane.close()  # the daemon ends the session when its data plane connection closes
        try:
            self._client._call("Detach", pb.DetachRequest(session_id=self.id))
        except (StorageError, ClientClosed):
            pass  # the daemon is gone or already forgot the session: nothing left to free
        self.arena.close()
        if self._host_tier is not None:
            self._host_tier.close()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class StorageClient:
    """A connection to storaged over its Unix socket. Thread-safe; sessions are not shared."""

    def __init__(self, socket_path: str, *, timeout: float = 60.0):
        self.socket_path = str(socket_path)
        self.timeout = timeout  # seconds for unary calls
        self._channel = grpc.insecure_channel(f"unix:{self.socket_path}")
        self._stub = pb_grpc.ExpertStorageStub(self._channel)
        self._closed = False

    def _call(self, rpc: str, request):
        if self._closed:
            raise ClientClosed(f"client of {self.socket_path} is closed")
        try:
            return getattr(self._stub, rpc)(request, timeout=self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, rpc) from None

    def info(self) -> replies.ServerInfo:
        return replies.server_info(self._call("Info", pb.InfoRequest()))

    def stats(self) -> replies.Stats:
        return replies.stats(self._call("Stats", pb.StatsRequest()))

    def attach(self, model: str, *, data_plane: bool = True) -> Session:
        """A new session on `model`; its requests use the data plane unless `data_plane` is False
        or the daemon does not offer it (then a gRPC Acquire stream)."""
        return Session(self, model, self._call("Attach", pb.AttachRequest(model=model)), data_plane=data_plane)

    def wait_until_serving(self, timeout: float = 30.0) -> None:
        """Poll the standard health service until the daemon reports SERVING."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        health = health_pb2_grpc.HealthStub(self._channel)
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                status = health.Check(health_pb2.HealthCheckRequest(), timeout=1.0).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(status)
            except grpc.RpcError as exc:
                last = f"{exc.code().name}: {exc.details()}"
            time.sleep(0.05)
        raise Unavailable(StatusCode.UNAVAILABLE, f"{self.socket_path} not SERVING after {timeout}s "
                          f"(last: {last})", rpc="Health.Check")

    def close(self) -> None:
        self._closed = True
        self._channel.close()

    def __enter__(self) -> StorageClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
