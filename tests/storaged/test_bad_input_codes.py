"""Bad gRPC input, row by row, against a real daemon: the status code each row must get, a short
message, and no traceback in the daemon's log (a client's mistake is not the daemon's bug).

Requests are sent as raw bytes over a generic channel (identity serializers), so a row can hold
what no generated client would send: bytes that are not protobuf, a uint32 field carrying 2^32
(encoded by hand, as a client of the uint32 era would), strings of 100 KB.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import pytest
from grpc_health.v1 import health_pb2

from packformat import PackReader
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.client import InvalidRequest, StorageClient, Unavailable
from storaged_testkit import TEST_EXPERTS, start_daemon

SERVICE = "/expertpack.storage.v1.ExpertStorage/"
HEALTH = "/grpc.health.v1.Health/Check"
GARBAGE = b"\xff\xff\xff\xff\x0f"  # a tag of field 0 with a truncated varint: not any message
HUGE = "x" * 100_000  # far beyond gRPC's 16 KiB limit on a status message
MAX_MESSAGE = 512  # characters of a status message: short whatever the request held
LAYER_WRAPPING_TO_1 = 2**32 + 1  # cut to 32 bits it is layer 1, which the test bundle serves


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _uint(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)  # wire type 0


def _text(number: int, value: str | bytes) -> bytes:
    data = value.encode() if isinstance(value, str) else value
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _experts(number: int, *ids: int) -> bytes:
    return _text(number, b"".join(_varint(e) for e in ids))  # packed, as protoc writes repeated scalars


@dataclass(frozen=True)
class Row:
    name: str
    method: str  # full method path
    request: Callable[[str], bytes]  # the session id of a fresh session -> the request's bytes
    code: grpc.StatusCode
    needle: str  # in the status message
    stream: bool = False  # Acquire: the request is the first message of a stream


def _unary(method: str, request: Callable[[str], bytes], code: grpc.StatusCode, needle: str, name: str = "") -> Row:
    return Row(name or method, SERVICE + method, request, code, needle)


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
ROWS = [
    # bytes that are not the method's message
    *(_unary(m, lambda s: GARBAGE, INVALID, "not a valid message", f"{m}: garbage")
      for m in ("Info", "Attach", "Release", "Prefetch", "Stats", "Detach")),
    Row("Acquire: garbage", SERVICE + "Acquire", lambda s: GARBAGE, INVALID, "not a valid message", stream=True),
    Row("Health.Check: garbage", HEALTH, lambda s: GARBAGE, INVALID, "not a valid message"),
    _unary("Attach", lambda s: _text(1, b"\xff\xfe"), INVALID, "not a valid message", "Attach: model not UTF-8"),
    # client strings echoed in the message, cut short
    _unary("Attach", lambda s: _text(1, HUGE), NOT_FOUND, "(100000 characters) is not served", "Attach: 100 KB model"),
    _unary("Release", lambda s: _text(1, HUGE), NOT_FOUND, "(100000 characters) is unknown", "Release: 100 KB session"),
    _unary("Detach", lambda s: _text(1, HUGE), NOT_FOUND, "(100000 characters) is unknown", "Detach: 100 KB session"),
    # ids of 2^32 and more: whole on the wire, refused (cut to 32 bits they named layer 1, expert 0)
    Row("Acquire: layer 2^32 + 1", SERVICE + "Acquire",
        lambda s: _text(1, s) + _uint(2, LAYER_WRAPPING_TO_1) + _experts(3, 0), INVALID,
        f"layer {LAYER_WRAPPING_TO_1} has no routed experts", stream=True),
    Row("Acquire: expert 2^32", SERVICE + "Acquire", lambda s: _text(1, s) + _uint(2, 1) + _experts(3, 2**32),
        INVALID, f"expert {2**32} out of range", stream=True),
    Row("Acquire: expert 2^64 - 1", SERVICE + "Acquire", lambda s: _text(1, s) + _uint(2, 1) + _experts(3, 2**64 - 1),
        INVALID, f"expert {2**64 - 1} out of range", stream=True),
    _unary("Prefetch", lambda s: _text(1, s) + _uint(2, LAYER_WRAPPING_TO_1) + _experts(3, 0), INVALID,
           f"layer {LAYER_WRAPPING_TO_1} has no routed experts", "Prefetch: layer 2^32 + 1"),
    _unary("Prefetch", lambda s: _text(1, s) + _uint(2, 1) + _experts(3, 2**32 + TEST_EXPERTS - 1), INVALID,
           "out of range", "Prefetch: expert 2^32 + 7"),
    _unary("Release", lambda s: _text(1, s) + _uint(2, LAYER_WRAPPING_TO_1), INVALID,
           f"layer {LAYER_WRAPPING_TO_1} has no routed experts", "Release: layer 2^32 + 1"),
    # layers the model has no experts on
    _unary("Release", lambda s: _text(1, s) + _uint(2, 99), INVALID, "layer 99 has no routed experts",
           "Release: layer 99"),
    _unary("Release", lambda s: _text(1, s) + _uint(2, 3), INVALID, "layer 3 has no routed experts",
           "Release: a dense layer"),
    Row("Acquire: layer 99", SERVICE + "Acquire", lambda s: _text(1, s) + _uint(2, 99) + _experts(3, 0), INVALID,
        "layer 99", stream=True),
]


class DaemonLog:
    """The daemon's stderr read as it comes (non-blocking), so each row checks what it caused."""

    def __init__(self, daemon):
        self.fd = daemon.process.stderr.fileno()
        os.set_blocking(self.fd, False)
        self.text = ""

    def new(self) -> str:
        chunks = []
        while True:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk.decode(errors="replace"))
        fresh = "".join(chunks)
        self.text += fresh
        return fresh


@pytest.fixture(scope="module")
def served(disk_dir, bundle):
    daemon = start_daemon(disk_dir, {"tiny": bundle.path}, direct_io=False)
    yield daemon, DaemonLog(daemon)
    daemon.stop()


def _wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


IDENTITY = {"request_serializer": lambda data: data, "response_deserializer": lambda data: data}


def _attach(channel: grpc.Channel) -> str:
    request = pb.AttachRequest(model="tiny").SerializeToString()
    return pb.AttachResponse.FromString(channel.unary_unary(SERVICE + "Attach", **IDENTITY)(request, timeout=10)).session_id


def _detach(channel: grpc.Channel, session_id: str) -> None:
    try:
        channel.unary_unary(SERVICE + "Detach", **IDENTITY)(pb.DetachRequest(session_id=session_id).SerializeToString(),
                                                            timeout=10)
    except grpc.RpcError as exc:
        assert exc.code() == NOT_FOUND  # ended with its stream


def _call(channel: grpc.Channel, row: Row, request: bytes) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        if row.stream:
            list(channel.stream_stream(row.method, **IDENTITY)(iter([request]), timeout=10))
        else:
            channel.unary_unary(row.method, **IDENTITY)(request, timeout=10)
    return caught.value


@pytest.mark.parametrize("row", ROWS, ids=lambda row: row.name)
def test_bad_input_gets_its_status_and_no_traceback(served, row):
    daemon, log = served
    log.new()
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        session_id = _attach(channel)  # a session with no stream yet (the client library opens one)
        error = _call(channel, row, row.request(session_id))
        assert (error.code(), row.needle in error.details()) == (row.code, True), error.details()
        assert len(error.details()) <= MAX_MESSAGE, error.details()
        _detach(channel, session_id)
    with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
        assert session.acquire(1, [0]), "the daemon serves on"
    assert "Traceback" not in log.new()


def test_garbage_on_a_bound_acquire_stream_ends_it_and_its_session(served):
    daemon, log = served
    log.new()
    with StorageClient(str(daemon.socket)) as client, grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        before = client.stats().sessions
        session_id = _attach(channel)
        good = pb.AcquireRequest(session_id=session_id, layer=1, experts=[0], request_id=1).SerializeToString()
        replies = channel.stream_stream(SERVICE + "Acquire", **IDENTITY)(iter([good, GARBAGE]), timeout=10)
        assert pb.AcquireResponse.FromString(next(replies)).request_id == 1
        with pytest.raises(grpc.RpcError) as caught:
            next(replies)
        assert caught.value.code() == INVALID and "not a valid message" in caught.value.details()
        # like a client ending its stream: the pins are released and the session ends
        _wait_for(lambda: (client.stats().pins, client.stats().sessions) == (0, before))
    assert "Traceback" not in log.new()


def test_a_client_may_send_ids_of_2_to_the_32_with_the_generated_code(served):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client, client.attach("tiny", data_plane=False) as session:
        with pytest.raises(InvalidRequest, match=f"layer {LAYER_WRAPPING_TO_1} has no routed experts"):
            session.acquire(LAYER_WRAPPING_TO_1, [0])
        assert session.acquire(1, [0])


@pytest.mark.parametrize("call", [
    lambda s: s.acquire(LAYER_WRAPPING_TO_1, [0]),
    lambda s: s.acquire(1, [2**32]),
    lambda s: s.prefetch(1, [-1]),
    lambda s: s.release(2**32),
], ids=["acquire layer", "acquire expert", "prefetch expert", "release layer"])
def test_the_data_plane_client_refuses_ids_its_frames_cannot_carry(served, call):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
        with pytest.raises(InvalidRequest, match=r"out of range: layer and expert ids are integers in \[0, 2\^32\)"):
            call(session)
        assert session.acquire(1, [0])  # nothing was sent: the connection is intact


def test_a_short_read_of_a_truncated_pack_is_unavailable_and_counted(disk_dir, bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle.path, copy)
    daemon = start_daemon(tmp_path, {"tiny": copy}, direct_io=False)
    log = DaemonLog(daemon)
    try:
        with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
            with PackReader(copy / "experts.pack") as reader:
                last = reader.entry(4, TEST_EXPERTS - 1)
            os.truncate(copy / "experts.pack", last.offset + 100)  # the file shrank under the daemon
            before = client.stats()
            with pytest.raises(Unavailable, match="short read|end of file"):
                session.acquire(4, [TEST_EXPERTS - 1])
            after = client.stats()
            assert after.io_errors - before.io_errors == 1
            assert session.acquire(1, [0]), "the other objects are still served"
        assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    finally:
        assert daemon.stop() == 0
    assert "Traceback" not in log.new()
