"""Session lifetime: idle sessions (no Acquire stream, no data plane connection) are closed after
session_idle_seconds, and each peer (uid) holds at most max_sessions_per_peer sessions.

The registry alone on a fake clock first, then real daemons and real client processes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
import urllib.request

import grpc
import pytest

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.client import CapacityExhausted, StorageClient
from storaged.server.models import ServedModel
from storaged.server.sessions import SessionNotFound, SessionRegistry, StreamAlreadyOpen, TooManySessions
from storaged.wire.session import SESSION_METADATA_KEY
from storaged_testkit import PYTHON, REPO, daemon_env, start_daemon

IDLE = 0.5  # session_idle_seconds of the daemons here


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


MODEL = ServedModel.__new__(ServedModel)  # the registry only carries it


def registry(idle: float = 10.0, bound: int | None = None) -> tuple[SessionRegistry, Clock]:
    clock = Clock()
    return SessionRegistry(idle_seconds=idle, max_per_owner=bound, clock=clock), clock


# ---- the registry ------------------------------------------------------------------------------


def test_idle_sessions_close_after_idle_seconds_in_idle_order():
    sessions, clock = registry(idle=10)
    first, second = sessions.open(MODEL), sessions.open(MODEL)
    clock.now += 5
    assert sessions.get(second.id) is second  # naming it restarts its idle time
    clock.now += 4.9
    assert sessions.close_idle() == []
    clock.now += 0.1
    assert sessions.close_idle() == [first] and first.closed and len(sessions) == 1
    clock.now += 5
    assert sessions.close_idle() == [second] and len(sessions) == 0


def test_a_bound_session_is_never_idle_closed_and_idles_again_when_unbound():
    sessions, clock = registry(idle=10)
    session = sessions.open(MODEL)
    assert sessions.bind_stream(session.id) is session
    clock.now += 1e6
    assert sessions.close_idle() == []
    sessions.unbind_stream(session)  # a stream the server ended with an error: the session survives it...
    clock.now += 9
    assert sessions.close_idle() == []
    assert sessions.bind_stream(session.id) is session  # ...and a new stream may bind it
    sessions.unbind_stream(session)
    clock.now += 10
    assert sessions.close_idle() == [session]  # ...but not forever


def test_idle_closed_ids_are_not_found_with_the_reason():
    sessions, clock = registry(idle=2)
    session = sessions.open(MODEL)
    clock.now += 2
    sessions.close_idle()
    for call in (sessions.get, sessions.bind_stream):
        with pytest.raises(SessionNotFound, match=r"closed after 2 s without an Acquire stream .*session_idle_seconds"):
            call(session.id)
    with pytest.raises(SessionNotFound, match="never attached, detached"):
        sessions.get("no-such-session")
    detached = sessions.open(MODEL)
    sessions.close(detached.id)
    with pytest.raises(SessionNotFound, match="never attached, detached"):
        sessions.get(detached.id)


def test_second_stream_is_refused():
    sessions, _ = registry()
    session = sessions.open(MODEL)
    sessions.bind_stream(session.id)
    with pytest.raises(StreamAlreadyOpen):
        sessions.bind_stream(session.id)


@pytest.mark.parametrize("bound, owners, refused", [
    (2, [7, 7, 7], [2]),  # the third of uid 7 is refused
    (2, [7, 8, 7, 8, 8, 7], [4, 5]),  # each uid its own count
    (1, [7, 7, None, None], [1]),  # peers that are not identified are not counted
    (None, [7] * 50, []),  # no bound
])
def test_sessions_per_owner_are_bounded(bound, owners, refused):
    sessions, _ = registry(bound=bound)
    outcome = []
    for index, owner in enumerate(owners):
        try:
            sessions.open(MODEL, owner)
        except TooManySessions as exc:
            assert (exc.owner, exc.count, exc.limit) == (owner, bound, bound)
            assert f"uid {owner} already holds {bound} sessions" in str(exc)
            assert f"max_sessions_per_peer ({bound})" in str(exc)
            outcome.append(index)
    assert outcome == refused


def test_closing_a_session_frees_its_owner_count():
    sessions, clock = registry(idle=1, bound=2)
    first, second = sessions.open(MODEL, 7), sessions.open(MODEL, 7)
    with pytest.raises(TooManySessions):
        sessions.open(MODEL, 7)
    sessions.close(first.id)
    third = sessions.open(MODEL, 7)
    sessions.bind_stream(third.id)
    clock.now += 1
    assert sessions.close_idle() == [second]  # idle closing frees the count too
    assert sessions.count_of(7) == 1
    sessions.open(MODEL, 7)
    assert sessions.count_of(7) == 2


# ---- a real daemon -------------------------------------------------------------------------------


def _wait_for(predicate, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def _free_port() -> int:
    import socket
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _metric(port: int, name: str) -> float:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    for line in body.splitlines():
        if line.startswith(f"expertpack_storaged_{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.fixture(scope="module")
def idle_daemon(disk_dir, bundle):
    """Short idle time, a per-peer bound high enough for the floods below, /metrics on."""
    port = _free_port()
    (disk_dir / "idle").mkdir()
    daemon = start_daemon(disk_dir / "idle", {"tiny": bundle.path}, session_idle_seconds=IDLE,
                          max_sessions_per_peer=20_000, metrics_address=f"127.0.0.1:{port}")
    daemon.metrics_port = port
    yield daemon
    assert daemon.stop() == 0, daemon.stderr()


@pytest.fixture
def stub(idle_daemon):
    with grpc.insecure_channel(f"unix:{idle_daemon.socket}") as channel:
        yield pb_grpc.ExpertStorageStub(channel)


def _sessions(stub) -> int:
    return stub.Stats(pb.StatsRequest(), timeout=10).sessions


@pytest.mark.slow
def test_20000_attaches_without_a_stream_leave_no_session(idle_daemon, stub):
    closed_before = _metric(idle_daemon.metrics_port, "sessions_idle_closed_total")
    for _ in range(20_000):
        stub.Attach(pb.AttachRequest(model="tiny"), timeout=10)
    _wait_for(lambda: _sessions(stub) == 0, timeout=10 * IDLE + 10)
    assert _metric(idle_daemon.metrics_port, "sessions_idle_closed_total") - closed_before == 20_000
    assert _metric(idle_daemon.metrics_port, "sessions") == 0
    assert stub.Stats(pb.StatsRequest(), timeout=10).pins == 0


# Waits for a line on stdin, attaches, reports its session, then keeps it alive by naming it (a
# Release of nothing) until killed: a client slow to open its stream, killed before it does.
_ATTACH_THEN_WAIT = r"""
import sys, time, grpc
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb, storage_pb2_grpc as pb_grpc
stub = pb_grpc.ExpertStorageStub(grpc.insecure_channel("unix:" + sys.argv[1]))
print("ready", flush=True)
sys.stdin.readline()
session = stub.Attach(pb.AttachRequest(model="tiny"), timeout=60).session_id
print(session, flush=True)
while True:
    stub.Release(pb.ReleaseRequest(session_id=session), timeout=60)
    time.sleep(float(sys.argv[2]))
"""
KILLED_IDLE = 3.0  # longer than IDLE: 100 clients keeping their sessions alive must not starve two cores


@pytest.mark.slow
def test_100_clients_killed_between_attach_and_stream_leave_no_session(disk_dir, bundle):
    port = _free_port()
    (disk_dir / "killed").mkdir()
    daemon = start_daemon(disk_dir / "killed", {"tiny": bundle.path}, session_idle_seconds=KILLED_IDLE,
                          metrics_address=f"127.0.0.1:{port}")
    clients = []
    try:
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
            stub = pb_grpc.ExpertStorageStub(channel)
            try:
                for _ in range(100):
                    clients.append(subprocess.Popen(
                        [PYTHON, "-c", _ATTACH_THEN_WAIT, str(daemon.socket), str(KILLED_IDLE / 6)], cwd=REPO,
                        env=daemon_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True))
                assert all(client.stdout.readline() == "ready\n" for client in clients)
                for client in clients:  # all started (imports done): now they attach together
                    client.stdin.write("go\n")
                    client.stdin.flush()
                ids = {client.stdout.readline().strip() for client in clients}
                assert len(ids) == 100 and "" not in ids
                time.sleep(2 * KILLED_IDLE)  # every session older than the idle time, alive because used
                assert _sessions(stub) == 100
            finally:
                for client in clients:
                    os.kill(client.pid, signal.SIGKILL)
                for client in clients:
                    client.wait()
                    client.stdin.close()
                    client.stdout.close()
            _wait_for(lambda: _sessions(stub) == 0, timeout=4 * KILLED_IDLE + 10)
            assert _metric(port, "sessions_idle_closed_total") == 100
            for session_id in ids:  # each id is gone, and the daemon says why
                with pytest.raises(grpc.RpcError) as gone:
                    stub.Release(pb.ReleaseRequest(session_id=session_id), timeout=10)
                assert gone.value.code() == grpc.StatusCode.NOT_FOUND
                assert "session_idle_seconds" in gone.value.details()
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def test_sessions_in_use_are_never_idle_closed(idle_daemon, stub, bundle):
    with StorageClient(str(idle_daemon.socket)) as client:
        plane = client.attach("tiny")  # a data plane connection
        stream = client.attach("tiny", data_plane=False)  # a gRPC Acquire stream, open from attach on
        try:
            for session in (plane, stream):
                (slot,) = session.acquire(1, [3])
                assert bytes(session.slot_bytes(slot, len(bundle.payloads[(1, 3)]))) == bundle.payloads[(1, 3)]
            time.sleep(8 * IDLE)  # many idle periods, with no request on either
            assert _sessions(stub) == 2
            for session in (plane, stream):
                (slot,) = session.acquire(2, [5])
                assert bytes(session.slot_bytes(slot, len(bundle.payloads[(2, 5)]))) == bundle.payloads[(2, 5)]
        finally:
            plane.close()
            stream.close()
    assert _sessions(stub) == 0


def test_session_whose_stream_the_server_ended_is_idle_closed(idle_daemon, stub):
    session_id = stub.Attach(pb.AttachRequest(model="tiny"), timeout=10).session_id
    metadata = ((SESSION_METADATA_KEY, session_id),)
    bad = pb.AcquireRequest(session_id=session_id, layer=99, experts=[0], request_id=1)
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Acquire(iter([bad]), metadata=metadata, timeout=10))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The server's error left the session open: a new stream takes it up and is served...
    good = pb.AcquireRequest(session_id=session_id, layer=1, experts=[0], request_id=2)
    replies = stub.Acquire(iter([good, bad]), metadata=metadata, timeout=10)
    assert next(replies).request_id == 2
    with pytest.raises(grpc.RpcError) as refused:
        next(replies)  # ...and ended by the server's error again: the session survives that too...
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # ...but left alone it ends after the idle time, like any session without a stream.
    _wait_for(lambda: _sessions(stub) == 0, timeout=10 * IDLE + 10)
    with pytest.raises(grpc.RpcError) as gone:
        list(stub.Acquire(iter([good]), metadata=metadata, timeout=10))
    assert gone.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"closed after {IDLE:g} s without an Acquire stream" in gone.value.details()


def test_idle_closed_session_is_not_found_for_every_rpc(idle_daemon, stub):
    session_id = stub.Attach(pb.AttachRequest(model="tiny"), timeout=10).session_id
    _wait_for(lambda: _sessions(stub) == 0, timeout=10 * IDLE + 10)
    calls = {
        "Release": lambda: stub.Release(pb.ReleaseRequest(session_id=session_id), timeout=10),
        "Prefetch": lambda: stub.Prefetch(pb.PrefetchRequest(session_id=session_id, layer=1, experts=[1]),
                                          timeout=10),
        "Detach": lambda: stub.Detach(pb.DetachRequest(session_id=session_id), timeout=10),
        "Acquire": lambda: list(stub.Acquire(iter([pb.AcquireRequest(session_id=session_id, layer=1, experts=[1],
                                                                     request_id=1)]), timeout=10)),
    }
    for rpc, call in calls.items():
        with pytest.raises(grpc.RpcError) as gone:
            call()
        assert gone.value.code() == grpc.StatusCode.NOT_FOUND, rpc
        assert "session_idle_seconds" in gone.value.details() and "attach again" in gone.value.details(), rpc


def test_sessions_per_peer_are_bounded(disk_dir, bundle):
    port = _free_port()
    (disk_dir / "bounded").mkdir()
    daemon = start_daemon(disk_dir / "bounded", {"tiny": bundle.path}, max_sessions_per_peer=3,
                          metrics_address=f"127.0.0.1:{port}")
    try:
        with grpc.insecure_channel(f"unix:{daemon.socket}") as channel, StorageClient(str(daemon.socket)) as client:
            stub = pb_grpc.ExpertStorageStub(channel)
            first = stub.Attach(pb.AttachRequest(model="tiny"), timeout=10).session_id
            session = client.attach("tiny")  # sessions of every kind count: this one has a data plane
            stub.Attach(pb.AttachRequest(model="tiny"), timeout=10)
            for _ in range(2):
                with pytest.raises(grpc.RpcError) as refused:
                    stub.Attach(pb.AttachRequest(model="tiny"), timeout=10)
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert f"peer uid {os.geteuid()} already holds 3 sessions" in refused.value.details()
                assert "max_sessions_per_peer (3)" in refused.value.details()
            with pytest.raises(CapacityExhausted, match="max_sessions_per_peer"):
                client.attach("tiny")  # the client library's error carries the same message
            assert _metric(port, "sessions_refused_total") == 3
            stub.Detach(pb.DetachRequest(session_id=first), timeout=10)
            stub.Attach(pb.AttachRequest(model="tiny"), timeout=10)  # a freed place is taken again
            session.close()  # the data plane's end frees its place too
            client.attach("tiny").close()
            assert client.stats().sessions == 2
        # The gate names each upstream connection in its private directory, and unlinks the name at once.
        (private,) = [p for p in (disk_dir / "bounded").iterdir() if p.name.startswith(".storaged-")]
        assert sorted(p.name for p in private.iterdir()) == ["admitted.sock", "refused.sock"]
    finally:
        assert daemon.stop() == 0, daemon.stderr()
