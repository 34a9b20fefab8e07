"""The client library without a daemon: status mapping, decoding Attach, import hygiene, errors.

Everything that needs a daemon is in test_server*.py; these cover the client's own logic.
"""

from __future__ import annotations

import subprocess

import grpc
import pytest

from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged.client import (CapacityExhausted, ClientClosed, DataLoss, InvalidRequest, NotFound,
                             SessionBusy, StatusCode, StorageClient, StorageError, Unavailable)
from storaged.client.errors import from_rpc_error, from_status
from storaged.client.layout import arena_from_proto, layers_from_proto
from storaged.device.descriptor import KIND_CUDA_IPC, KIND_MEMFD
from storaged.device.errors import ArenaDescriptorError
from storaged_testkit import PYTHON, REPO


class _FailedCall(grpc.RpcError):
    """What a stub raises: an RpcError that is also a Call with code() and details()."""

    def __init__(self, code: grpc.StatusCode, details: str):
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize("code, error", [
    (grpc.StatusCode.NOT_FOUND, NotFound),
    (grpc.StatusCode.INVALID_ARGUMENT, InvalidRequest),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, CapacityExhausted),
    (grpc.StatusCode.DATA_LOSS, DataLoss),
    (grpc.StatusCode.FAILED_PRECONDITION, SessionBusy),
    (grpc.StatusCode.UNAVAILABLE, Unavailable),
    (grpc.StatusCode.INTERNAL, StorageError),
    (grpc.StatusCode.CANCELLED, StorageError),
])
def test_status_codes_map_to_typed_errors_with_the_server_message(code, error):
    mapped = from_rpc_error(_FailedCall(code, "layer 9 has no routed experts"), "Acquire")
    assert type(mapped) is error
    assert type(mapped.code) is StatusCode and mapped.code.name == code.name
    assert mapped.details == "layer 9 has no routed experts"
    assert str(mapped) == f"Acquire: {code.name}: layer 9 has no routed experts"
    # the data plane's ERROR frames carry the number; the same error comes out
    from_plane = from_status(code.value[0], "layer 9 has no routed experts", "Acquire")
    assert (type(from_plane), from_plane.code) == (error, mapped.code)


def test_the_status_codes_are_grpcs_by_name_and_number():
    assert {code.name: code.value for code in StatusCode} == {code.name: code.value[0] for code in grpc.StatusCode}


@pytest.mark.parametrize("number", [17, 99, -1])
def test_a_status_number_grpc_does_not_define_is_unknown(number):
    error = from_status(number, "what the frame said", "Acquire")
    assert (type(error), error.code) == (StorageError, StatusCode.UNKNOWN)


def test_a_client_error_refuses_a_grpc_status_code():
    with pytest.raises(TypeError, match="StatusCode"):
        NotFound(grpc.StatusCode.NOT_FOUND, "model 'x' is not served")


def test_no_daemon_is_unavailable(tmp_path):
    with StorageClient(str(tmp_path / "nobody.sock"), timeout=5) as client:
        with pytest.raises(Unavailable) as info:
            client.info()
        assert info.value.code == StatusCode.UNAVAILABLE
        with pytest.raises(Unavailable, match="not SERVING after 0.3s"):
            client.wait_until_serving(timeout=0.3)


def test_closed_client_refuses_calls(tmp_path):
    client = StorageClient(str(tmp_path / "x.sock"))
    client.close()
    with pytest.raises(ClientClosed):
        client.stats()


def _role(role, etype, shape, offset, nbytes):
    return pb.RoleLayout(role=role, element_type=etype, shape=shape, offset=offset, nbytes=nbytes)


def test_layout_decoding_with_an_override():
    common = [_role(pb.ROLE_GATE_UP, 12, (64, 256), 0, 9216), _role(pb.ROLE_DOWN, 12, (256, 32), 9216, 4608)]
    special = [_role(pb.ROLE_GATE_UP, 8, (64, 256), 0, 17408), _role(pb.ROLE_DOWN, 8, (256, 32), 17408, 8704)]
    reply = pb.ModelLayout(model="m", layers=[pb.LayerLayout(
        layer=3, expert_count=4, object_bytes=13824, roles=common,
        expert_overrides=[pb.ExpertLayout(expert=1, object_bytes=26112, roles=special)])])
    layers = layers_from_proto(reply)
    assert list(layers) == [3]
    assert layers[3].object(0).role(pb.ROLE_DOWN).offset == 9216
    assert layers[3].object(1).role(pb.ROLE_DOWN).end == 26112
    assert layers[3].object(1).object_bytes == 26112
    with pytest.raises(KeyError, match="has no role 5"):
        layers[3].object(0).role(pb.ROLE_GATE_BIAS)


def test_arena_descriptor_decoding():
    memfd = arena_from_proto(pb.ArenaDescriptor(memfd=pb.MemfdArena(), slot_map_entries=10), 8192, 4)
    assert (memfd.kind, memfd.arena_bytes, memfd.mapped_bytes) == (KIND_MEMFD, 32768, 32768 + 4096)
    cuda = arena_from_proto(pb.ArenaDescriptor(
        cuda_ipc=pb.CudaIpcArena(ipc_handle=b"h" * 64, device=1, storage_size_bytes=32768,
                                 ref_counter_handle=b"r", event_handle=b"e", event_sync_required=True),
        event_handles=[b"x" * 64, b"y" * 64]), 8192, 4)
    assert (cuda.kind, cuda.device_index, cuda.event_handles) == (KIND_CUDA_IPC, 1, (b"x" * 64, b"y" * 64))
    assert cuda.export_event_handle == b"e" and cuda.export_event_sync_required
    with pytest.raises(ArenaDescriptorError, match="no arena memory"):
        arena_from_proto(pb.ArenaDescriptor(), 8192, 4)
    with pytest.raises(ArenaDescriptorError, match="path-named shared-memory arena"):  # writable by its group
        arena_from_proto(pb.ArenaDescriptor(shm=pb.SharedMemoryArena(path="/dev/shm/a")), 8192, 4)


def test_client_imports_nothing_from_the_server():
    code = ("import sys, storaged.client; "
            "bad = sorted(m for m in sys.modules if m.startswith(('storaged.server', 'storaged.policy', "
            "'storaged.metrics', 'grpc_health.v1', 'grpc_reflection.v1alpha', 'uvloop', 'prometheus_client'))); "
            "print(bad)")
    result = subprocess.run([PYTHON, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
