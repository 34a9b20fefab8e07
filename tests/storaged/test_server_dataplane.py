"""The data plane, the slot map and the step fences, through a real daemon process (CPU arena).

The hot-path contract: hits can be found by reading the slot map (no round trip), and a slot a
client may still be reading in a step it has started is never overwritten — not while it is
mid-step, and not before its process is gone if it dies mid-step.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import subprocess
import threading
import time

import grpc
import pytest
from storaged_testkit import (PYTHON, REPO, SLOT_BYTES, Daemon, daemon_env, start_daemon, write_bundle,
                              write_config)

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.client import (CapacityExhausted, InvalidRequest, NotFound, SessionBusy, StorageClient,
                             StorageError)
from storaged.client.dataplane import DataPlaneClient, FenceRevoked
from storaged.wire import dataplane as wire

SLOTS = 4


@pytest.fixture(scope="module")
def served(disk_dir):
    bundle = disk_dir / "dp-bundle"
    payloads = write_bundle(bundle)
    daemon = start_daemon(disk_dir, {"tiny": bundle}, vram_cache_bytes=SLOTS * SLOT_BYTES,
                          host_cache_bytes=3 * SLOT_BYTES, fence_timeout_seconds=3.0,
                          socket_path=disk_dir / "dp.sock")
    yield daemon, payloads
    assert daemon.stop() == 0, daemon.stderr()


@pytest.fixture
def client(served):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client:
        yield client


def _bytes(session, slot: int, n: int) -> bytes:
    return session.slot_bytes(slot, n).numpy().tobytes()


def _drain_cache(session, layer: int = 4) -> None:
    """Fill the arena with layer-4 objects (unpinned afterwards), so later loads evict."""
    session.acquire(layer, [4, 5, 6, 7])
    session.release(layer)


def test_attach_offers_the_data_plane_and_the_slot_map(client, served):
    daemon, _ = served
    with client.attach("tiny") as session:
        assert session.fence is not None  # requests go over the data plane
        view = session.slot_map_view
        assert view.layers == (1, 2, 4) and view.experts_per_row == 8
        slot_map = session.slot_map()
        assert slot_map.shape == (3, 8) and slot_map.dtype.is_floating_point is False
    info = client.info()
    assert {"DATA_PLANE", "SLOT_MAP", "TIERED_DEMOTION"} <= set(info.capabilities)


def test_slot_map_follows_residency(client, served):
    _, payloads = served
    with client.attach("tiny") as session:
        slots = session.acquire(2, [6, 0, 3])
        slot_map = session.slot_map()
        row = session.slot_map_view.row(2)
        assert [int(slot_map[row, e]) for e in (6, 0, 3)] == slots  # published once complete
        for expert, slot in zip((6, 0, 3), slots):
            assert _bytes(session, slot, len(payloads[(2, expert)])) == payloads[(2, expert)]
        session.release(2)
        session.acquire(1, [0, 1, 2, 3])  # 4 slots: every layer-2 object is evicted
        assert [int(slot_map[row, e]) for e in (6, 0, 3)] == [-1, -1, -1]
        assert sorted(int(slot_map[0, e]) for e in range(4)) == sorted(session.acquire(1, [0, 1, 2, 3]))


def test_victims_are_demoted_and_copied_back_up_byte_identical(client, served):
    _, payloads = served
    with client.attach("tiny") as session:
        _drain_cache(session, layer=1)
        before = client.stats()
        slots = session.acquire(2, [0, 1, 2])  # evicts three layer-1 objects: demoted to the host tier
        session.release(2)
        back = session.acquire(1, [4, 5, 6])  # they come back from host RAM, not from the pack
        for expert, slot in zip((4, 5, 6), back):
            assert _bytes(session, slot, len(payloads[(1, expert)])) == payloads[(1, expert)]
        after = client.stats()
    assert after.demotions - before.demotions >= 3
    assert after.reads - before.reads == 3  # only layer 2's three objects were read from disk
    assert after.tiers["host"].hits - before.tiers["host"].hits == 3
    assert len(slots) == 3


@pytest.mark.parametrize("release, error, code", [
    (struct.pack("<II", 1, 3), InvalidRequest, "INVALID_ARGUMENT"),  # layer 3 has no experts
    (struct.pack("<II", 1, 2 ** 32 - 1), InvalidRequest, "INVALID_ARGUMENT"),
])
def test_release_of_a_layer_without_experts_is_refused(client, release, error, code):
    with client.attach("tiny") as session:
        with pytest.raises(error, match=code):
            session._plane._call(wire.Kind.RELEASE, release, wire.Kind.RELEASE_OK, "Release")
        session.acquire(1, [0])  # the connection is still usable
    with client.attach("tiny", data_plane=False) as session, pytest.raises(InvalidRequest, match="layer 3"):
        session.release(3)  # gRPC Release refuses it too


@pytest.mark.parametrize("layer, experts, match", [
    (1, [8], "expert 8 out of range"), (1, [1, 1], "expert 1 requested twice"), (7, [0], "layer 7"),
    (2 ** 32 - 1, [0], "layer 4294967295"), (1, [], "names no experts"),
])
def test_bad_acquires_are_invalid_argument_and_the_session_survives(client, layer, experts, match):
    with client.attach("tiny") as session:
        with pytest.raises(InvalidRequest, match=match):
            session.acquire(layer, experts)
        assert len(session.acquire(1, [0])) == 1


def _raw(daemon, frames: bytes) -> bytes:
    """Send raw bytes to the data plane and read until it closes (at most 2 s)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        sock.connect(wire.socket_path_for(str(daemon.socket)))
        sock.sendall(frames)
        data = b""
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except TimeoutError:
            pass
    return data


def _first_error(data: bytes) -> tuple[int, str]:
    length, kind, _, _ = wire.HEADER.unpack_from(data)
    body = data[wire.HEADER.size:wire.HEADER.size + length]
    assert kind == wire.Kind.ERROR, kind
    return grpc.StatusCode(next(c for c in grpc.StatusCode if c.value[0] == struct.unpack_from("<I", body)[0])), \
        body[4:].decode()


@pytest.mark.parametrize("frames, code, match", [
    (wire.frame(wire.Kind.HELLO, 0, struct.pack("<I", 99) + b"x"), grpc.StatusCode.INVALID_ARGUMENT, "version 99"),
    (wire.frame(wire.Kind.HELLO, 0, struct.pack("<I", 1) + b"x"), grpc.StatusCode.INVALID_ARGUMENT, "version 1 "),
    (wire.frame(wire.Kind.HELLO, 0, struct.pack("<I", wire.VERSION) + b"no-such-session"), grpc.StatusCode.NOT_FOUND,
     "unknown"),
    (wire.frame(wire.Kind.ARENA, 0, struct.pack("<I", wire.VERSION) + b"no-such-session"), grpc.StatusCode.NOT_FOUND,
     "unknown"),
    (wire.frame(wire.Kind.ARENA, 0, struct.pack("<I", 99) + b"x"), grpc.StatusCode.INVALID_ARGUMENT, "version 99"),
    (wire.frame(wire.Kind.ACQUIRE, 0, b""), grpc.StatusCode.INVALID_ARGUMENT, "expected a HELLO"),
    (wire.HEADER.pack(1 << 30, wire.Kind.HELLO, 0, 0), grpc.StatusCode.INVALID_ARGUMENT, "expected a HELLO"),
    (wire.frame(wire.Kind.HELLO, 0, struct.pack("<I", wire.VERSION) + b"\xff\xfe"), grpc.StatusCode.INVALID_ARGUMENT,
     "UTF-8"),
])
def test_bad_hellos_are_refused_with_a_status(served, frames, code, match):
    daemon, _ = served
    got_code, message = _first_error(_raw(daemon, frames))
    assert got_code == code and match in message


@pytest.mark.parametrize("request_frame, match", [
    (wire.frame(wire.Kind.ACQUIRE, 1, struct.pack("<III", 1, 0, 3) + struct.pack("<I", 0)), "3 experts"),
    (wire.frame(wire.Kind.ACQUIRE, 1, struct.pack("<III", 1, 2, 1) + struct.pack("<I", 0)), "unknown bits"),
    (wire.frame(wire.Kind.RELEASE, 1, b"\x00"), "RELEASE body"),
    (wire.frame(99, 1, b""), "not a request"),
    (wire.HEADER.pack(wire.MAX_BODY + 1, wire.Kind.ACQUIRE, 0, 1), "exceeds the limit"),
])
def test_malformed_requests_are_invalid_argument_and_close_the_connection(client, served, request_frame, match):
    daemon, _ = served
    reply = client._call("Attach", pb.AttachRequest(model="tiny"))  # a session with no channel bound yet
    hello = wire.frame(wire.Kind.HELLO, 0, struct.pack("<I", wire.VERSION) + reply.session_id.encode())
    data = _raw(daemon, hello + request_frame)
    length = wire.HEADER.unpack_from(data)[0]
    code, message = _first_error(data[wire.HEADER.size + length:])
    assert code == grpc.StatusCode.INVALID_ARGUMENT and match in message


def test_a_session_has_one_channel(client):
    with client.attach("tiny") as session:
        with pytest.raises(SessionBusy):
            DataPlaneClient(wire.socket_path_for(client.socket_path), session.id)


def test_closing_the_connection_ends_the_session_and_its_pins(client):
    session = client.attach("tiny")
    session.acquire(1, [0, 1])
    assert client.stats().pins == 2
    session.close()
    deadline = time.monotonic() + 5
    while client.stats().pins and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.stats().pins == 0
    with pytest.raises(NotFound):
        DataPlaneClient(wire.socket_path_for(client.socket_path), session.id)


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGKILL], ids=["terminate", "kill"])
def test_a_stopped_daemon_shows_as_a_lost_connection_without_a_request(disk_dir, stop):
    """Session.connection_lost() sees the daemon's end on the session's own channel (the data plane
    connection, else the Acquire stream) while the session is idle, and sends nothing to see it."""
    directory = disk_dir / f"lost-{stop.name}"
    directory.mkdir()
    write_bundle(directory / "bundle")
    daemon = start_daemon(directory, {"tiny": directory / "bundle"}, vram_cache_bytes=SLOTS * SLOT_BYTES)
    try:
        with StorageClient(str(daemon.socket)) as client:
            plane = client.attach("tiny")
            stream = client.attach("tiny", data_plane=False)
            plane.acquire(1, [0])
            plane.prefetch(2, [1])  # its reply stays unread: readable is not closed
            stream.acquire(1, [1])
            assert plane._plane._sock.recv(1, socket.MSG_PEEK)  # blocks until the hint's reply is there
            assert plane.connection_lost() is None and stream.connection_lost() is None
            daemon.process.send_signal(stop)
            daemon.process.wait(30)
            assert "closed the data plane connection" in plane.connection_lost()
            deadline = time.monotonic() + 30  # gRPC learns of the dropped transport on its own thread
            while stream.connection_lost() is None and time.monotonic() < deadline:
                time.sleep(0.01)
            assert "Acquire stream" in stream.connection_lost()
            for session in (plane, stream):
                session.close()
                assert "was closed" in session.connection_lost()
    finally:
        daemon.stop()


def test_refused_peer_gets_permission_denied(disk_dir):
    directory = disk_dir / "refuse"
    directory.mkdir()
    write_bundle(directory / "bundle")
    config = write_config(directory / "storaged.toml", models={"tiny": directory / "bundle"},
                          socket=str(directory / "s.sock"), vram_cache_bytes=4 * SLOT_BYTES, metrics_address="off",
                          allowed_uids=[os.getuid() + 12345])
    daemon = Daemon(config, directory / "s.sock")  # its health check refuses us too: wait for the socket
    try:
        deadline = time.monotonic() + 30
        while not daemon.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        code, message = _first_error(_raw(daemon, b""))
        assert code == grpc.StatusCode.PERMISSION_DENIED and "allowed_uids" in message
    finally:
        daemon.stop()


# ---- step fences: a slot a client may read is never reused under it ------------------------------

def _acquire_in_thread(session, layer, experts):
    result: dict = {}

    def run():
        try:
            result["slots"] = session.acquire(layer, experts)
        except StorageError as exc:  # noqa: PERF203
            result["error"] = exc
    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def test_a_mid_step_reader_holds_back_reuse_of_what_it_may_read(client, served):
    _, payloads = served
    with client.attach("tiny") as reader, client.attach("tiny") as writer:
        slots = reader.acquire(2, [0, 1, 2, 3])  # fills the 4 slots
        reader.release(2)  # unpinned: only the map says where they are
        row = reader.slot_map_view.row(2)
        fence = reader.fence
        fence.begin()  # a device step would now read map entries and slots of layer 2
        snapshot = {e: _bytes(reader, s, len(payloads[(2, e)])) for e, s in zip(range(4), slots)}
        thread, result = _acquire_in_thread(writer, 1, [0, 1])  # needs two of those slots
        time.sleep(0.5)
        assert thread.is_alive(), "a slot was reused while a session that may read it was mid-step"
        assert sum(int(reader.slot_map()[row, e]) == -1 for e in range(4)) == 2  # unmapped first
        for expert, slot in zip(range(4), slots):  # ... but the bytes are untouched
            assert _bytes(reader, slot, len(payloads[(2, expert)])) == snapshot[expert]
        fence.end()
        thread.join(5)
        assert not thread.is_alive() and "slots" in result, result
    stats = client.stats()
    assert stats.fence_waits >= 1


def test_two_steps_in_flight_hold_back_reuse_until_the_newer_one_finished(client, served):
    """A decoder launches step n + 1 before step n settled: a reuse seen while both are open waits
    for the newer step, not only for the older one."""
    _, payloads = served
    with client.attach("tiny") as reader, client.attach("tiny") as writer:
        slots = reader.acquire(2, [0, 1, 2, 3])
        reader.release(2)
        fence = reader.fence
        first, second = fence.begin(), fence.begin()
        assert second == first + 1 and fence.open_steps == 2
        snapshot = {e: _bytes(reader, s, len(payloads[(2, e)])) for e, s in zip(range(4), slots)}
        thread, result = _acquire_in_thread(writer, 1, [0, 1])  # needs two of those slots
        time.sleep(0.3)
        fence.end(first)
        time.sleep(0.3)
        assert thread.is_alive(), "a slot was reused while the session's second step was open"
        for expert, slot in zip(range(4), slots):
            assert _bytes(reader, slot, len(payloads[(2, expert)])) == snapshot[expert]
        fence.end(second)
        thread.join(5)
        assert not thread.is_alive() and "slots" in result, result
        assert not fence.open


@pytest.mark.parametrize("calls, error", [
    (("begin", "begin", "begin"), "2 steps open"),
    (("end",), "open steps are 1..0"),
    (("begin", "end:2"), "end\\(2\\)"),
    (("begin", "begin", "end:2", "end:1"), "end\\(1\\)"),
], ids=["a third open step", "end with none open", "end of a step not begun", "ends out of order"])
def test_a_step_fence_refuses_what_breaks_its_order(calls, error):
    fd = os.memfd_create("fence-test")
    os.ftruncate(fd, wire.FENCE_BYTES)
    from storaged.client.dataplane import StepFence

    fence = StepFence(fd)
    os.close(fd)
    try:
        *ok, last = calls
        for call in ok:
            _fence_call(fence, call)
        with pytest.raises(RuntimeError, match=error):
            _fence_call(fence, last)
    finally:
        fence.close()


def _fence_call(fence, call: str) -> None:
    name, _, step = call.partition(":")
    getattr(fence, name)(*([int(step)] if step else []))


_MID_STEP_CLIENT = """
import sys, time
from storaged.client import StorageClient
client = StorageClient(sys.argv[1])
session = client.attach("tiny")
session.acquire(2, [4, 5, 6, 7])
session.release(2)
session.fence.begin()
print("mid-step", flush=True)
time.sleep(60)
"""


def test_a_client_killed_mid_step_holds_back_reuse_until_its_process_is_gone(client, served):
    daemon, _ = served
    child = subprocess.Popen([PYTHON, "-c", _MID_STEP_CLIENT, str(daemon.socket)], cwd=REPO, env=daemon_env(),
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "mid-step"
        with client.attach("tiny") as writer:
            thread, result = _acquire_in_thread(writer, 1, [4, 5])
            time.sleep(0.5)
            assert thread.is_alive(), "reused a slot a live mid-step client may read"
            child.send_signal(signal.SIGKILL)
            thread.join(5)
            assert not thread.is_alive() and "slots" in result, result
    finally:
        child.kill()
        child.wait()


def test_a_client_stuck_mid_step_is_revoked_after_the_fence_timeout(client):
    with client.attach("tiny") as stuck, client.attach("tiny") as writer:
        stuck.acquire(2, [0, 1, 2, 3])
        stuck.release(2)
        before = client.stats().fence_revocations
        stuck.fence.begin()
        started = time.monotonic()
        writer.acquire(4, [0, 1])  # waits for the fence timeout (3 s here), then goes ahead
        assert 2.5 < time.monotonic() - started < 10
        with pytest.raises(FenceRevoked, match="outlived the daemon's fence timeout"):
            stuck.fence.end()
        with pytest.raises(FenceRevoked, match="revoked"):
            stuck.fence.begin()
    assert client.stats().fence_revocations == before + 1


def test_capacity_exhausted_while_others_pin_everything(client):
    with client.attach("tiny") as holder, client.attach("tiny") as other:
        holder.acquire(1, [0, 1, 2, 3])
        with pytest.raises(CapacityExhausted):
            other.acquire(2, [0])
