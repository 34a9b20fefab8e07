"""A real storaged subprocess (O_DIRECT reads from a bundle on disk) and real clients.

One daemon serves the whole module: 10 slots of 12 KiB on the CPU (shared-memory arena), a
test bundle with MoE layers (1, 2, 4) x 8 experts, and object (4, 7) corrupted on disk.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from packformat import Role
from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
from storaged.client import (CapacityExhausted, DataLoss, InvalidRequest, NotFound, StatusCode,
                             StorageClient)
from storaged_testkit import (PYTHON, REPO, SLOT_BYTES, TEST_EXPERTS, TEST_LAYERS, corrupt_object,
                                     daemon_env, start_daemon, write_bundle)

CORRUPT = (4, 7)
SLOT_COUNT = 10


@pytest.fixture(scope="module")
def served(disk_dir):
    bundle = disk_dir / "bundle"
    payloads = write_bundle(bundle)
    corrupt_object(bundle, *CORRUPT)
    daemon = start_daemon(disk_dir, {"tiny": bundle}, direct_io=True, vram_cache_bytes=SLOT_COUNT * SLOT_BYTES)
    yield daemon, payloads
    assert daemon.stop() == 0, daemon.stderr()


@pytest.fixture
def client(served):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client:
        yield client


def _bytes_of(session, slot: int, nbytes: int) -> bytes:
    return session.slot_bytes(slot, nbytes).numpy().tobytes()


def _wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"condition not met within {timeout}s")


def test_health_serving_and_reflection(served):
    daemon, _ = served
    assert daemon.health() == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    with grpc.insecure_channel(f"unix:{daemon.socket}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
    assert {"expertpack.storage.v1.ExpertStorage", "grpc.health.v1.Health"} <= names


def test_info(client):
    info = client.info()
    assert info.api_version == 1 and info.device == "cpu"
    assert info.slot_bytes == SLOT_BYTES and info.slot_count == SLOT_COUNT
    assert {"MEMFD_ARENA", "PREFETCH", "CHECKSUM_VERIFY", "DIRECT_IO"} <= info.capabilities
    assert not {"SHM_ARENA", "HIT_VERIFY"} & info.capabilities  # verify_hits is off by default
    model = info.models["tiny"]
    assert model.moe_layers == TEST_LAYERS and model.expert_count == TEST_EXPERTS
    assert model.model_type == "qwen3_moe" and model.max_object_bytes == 8704


def test_attach_layout_matches_pack(client, served):
    from packformat import PackReader
    with client.attach("tiny") as session, PackReader(served[0].socket.parent / "bundle" / "experts.pack") as pack:
        assert sorted(session.layers) == list(TEST_LAYERS)
        assert session.slot_size == SLOT_BYTES and session.slot_count == SLOT_COUNT
        for layer in TEST_LAYERS:
            for expert in range(TEST_EXPERTS):
                entry, layout = pack.entry(layer, expert), session.object_layout(layer, expert)
                assert layout.object_bytes == entry.size
                assert [(r.role, r.element_type, r.shape, r.offset, r.nbytes) for r in layout.roles] == \
                       [(r.role, r.element_type, r.shape, r.offset, r.nbytes) for r in entry.roles]


def test_attach_unknown_model_is_not_found(client):
    with pytest.raises(NotFound, match="'nope' is not served"):
        client.attach("nope")


def test_miss_then_hit_bytes_and_counters(client, served):
    _, payloads = served
    before = client.stats()
    with client.attach("tiny") as session:
        experts = [6, 0, 3]
        slots = session.acquire(2, experts)
        assert len(set(slots)) == 3
        for expert, slot in zip(experts, slots):
            assert _bytes_of(session, slot, len(payloads[(2, expert)])) == payloads[(2, expert)]
        down = session.object_layout(2, 6).role(Role.DOWN)
        assert session.role_bytes(slots[0], 2, 6, Role.DOWN).numpy().tobytes() == \
            payloads[(2, 6)][down.offset:down.end]
        middle = client.stats()
        again = session.acquire(2, experts)  # all hits now, same slots
        assert again == slots
        after = client.stats()
    vram = lambda s: s.tiers["vram"]  # noqa: E731
    assert vram(middle).misses - vram(before).misses == 3
    assert middle.reads - before.reads == 3
    assert middle.bytes_read - before.bytes_read == 3 * SLOT_BYTES  # padded objects
    assert vram(after).hits - vram(middle).hits == 3
    assert after.reads == middle.reads and after.bytes_read == middle.bytes_read
    assert after.acquires - before.acquires == 2
    # the phases partition each Acquire's time: the misses' spent issuing their reads
    phases = {p: after["acquire_phase_seconds_total"][p] - before["acquire_phase_seconds_total"].get(p, 0.0)
              for p in after["acquire_phase_seconds_total"]}
    assert set(phases) == {"plan", "unmap", "issue", "join"}
    assert sum(phases.values()) == pytest.approx(after["acquire_seconds"].sum - before["acquire_seconds"].sum)
    assert phases["issue"] > phases["plan"] > 0
    assert after.pins == 3  # still pinned until the stream ends (close above)
    assert _wait_for(lambda: client.stats().pins == 0) is True


@pytest.mark.parametrize("layer, experts, error, needle", [
    (3, [0], InvalidRequest, "layer 3 has no routed experts"),  # a dense layer between MoE layers
    (99, [0], InvalidRequest, "layer 99"),
    (1, [TEST_EXPERTS], InvalidRequest, f"expert {TEST_EXPERTS} out of range"),
    (1, [2, 5, 2], InvalidRequest, "expert 2 requested twice"),
    (1, list(range(TEST_EXPERTS)) + [0], InvalidRequest, "at most"),
    (1, [], InvalidRequest, "names no experts"),
])
def test_bad_acquire_gets_invalid_argument(client, layer, experts, error, needle):
    with client.attach("tiny") as session:
        with pytest.raises(error, match=needle) as info:
            session.acquire(layer, experts)
        assert info.value.code == StatusCode.INVALID_ARGUMENT
        assert session.acquire(1, [1]) == session.acquire(1, [1])  # a new stream serves the session


@pytest.mark.parametrize("rpc, request_", [
    ("Release", pb.ReleaseRequest(session_id="forged")),
    ("Prefetch", pb.PrefetchRequest(session_id="forged", layer=1, experts=[0])),
    ("Detach", pb.DetachRequest(session_id="forged")),
])
def test_unknown_session_is_not_found(served, rpc, request_):
    with grpc.insecure_channel(f"unix:{served[0].socket}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            getattr(pb_grpc.ExpertStorageStub(channel), rpc)(request_, timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "forged" in info.value.details()


def test_acquire_on_unknown_session_is_not_found(served):
    with grpc.insecure_channel(f"unix:{served[0].socket}") as channel:
        replies = pb_grpc.ExpertStorageStub(channel).Acquire(
            iter([pb.AcquireRequest(session_id="forged", layer=1, experts=[0])]))
        with pytest.raises(grpc.RpcError) as info:
            next(replies)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_second_stream_for_a_session_is_refused(client, served):
    with client.attach("tiny") as session:
        session.acquire(1, [0])  # opens the session's stream
        with grpc.insecure_channel(f"unix:{served[0].socket}") as channel:
            replies = pb_grpc.ExpertStorageStub(channel).Acquire(
                iter([pb.AcquireRequest(session_id=session.id, layer=1, experts=[1])]))
            with pytest.raises(grpc.RpcError) as info:
                next(replies)
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert session.acquire(1, [0])  # the first stream is unaffected


def test_pinned_demand_beyond_capacity_is_resource_exhausted(client):
    with client.attach("tiny") as holder, client.attach("tiny") as other:
        holder.acquire(1, list(range(TEST_EXPERTS)))  # 8 of the 10 slots pinned
        with pytest.raises(CapacityExhausted) as info:
            other.acquire(2, [0, 1, 2])
        assert info.value.code == StatusCode.RESOURCE_EXHAUSTED
        assert other.acquire(2, [0, 1])  # what fits is still served
        assert client.stats().capacity_exhausted >= 1


def test_release_unpins_a_layer_or_everything(client):
    with client.attach("tiny") as session:
        session.acquire(1, [0, 1])
        session.acquire(2, [0])
        assert client.stats().pins == 3
        session.release(1)
        assert client.stats().pins == 1
        session.release()
        assert client.stats().pins == 0


def test_next_acquire_of_a_layer_replaces_its_pins(client):
    with client.attach("tiny") as session:
        session.acquire(1, [0, 1, 2])
        session.acquire(1, [3])
        assert client.stats().pins == 1


def test_corrupt_object_is_data_loss_and_others_still_served(client, served):
    _, payloads = served
    before = client.stats()
    with client.attach("tiny") as session:
        with pytest.raises(DataLoss, match=r"object \(layer 4, expert 7\) at byte \d+: checksum mismatch"):
            session.acquire(CORRUPT[0], [0, CORRUPT[1]])
        slots = session.acquire(4, [0, 6])  # the same session goes on, on a new stream
        assert _bytes_of(session, slots[1], len(payloads[(4, 6)])) == payloads[(4, 6)]
        with pytest.raises(DataLoss):  # not cached as good: read and rejected again
            session.acquire(*CORRUPT[:1], [CORRUPT[1]])
    after = client.stats()
    assert after.checksum_failures - before.checksum_failures == 2
    assert after.io_errors == before.io_errors


def test_prefetch_then_acquire_uses_the_prefetched_slot(client, served):
    _, payloads = served
    with client.attach("tiny") as session:
        session.release()
        before = client.stats()
        session.prefetch(4, [5])
        _wait_for(lambda: client.stats().loads_in_flight == 0 and client.stats().reads > before.reads)
        slot = session.acquire(4, [5])[0]
        assert _bytes_of(session, slot, len(payloads[(4, 5)])) == payloads[(4, 5)]
        after = client.stats()
    assert after.prefetch_issued - before.prefetch_issued == 1
    assert after.prefetch_used - before.prefetch_used == 1
    assert after.reads - before.reads == 1


def test_bad_prefetch_is_invalid_argument_on_the_next_reply_over_the_data_plane(client):
    with client.attach("tiny") as session:
        session.prefetch(1, [9])  # a hint: its reply is not waited for...
        with pytest.raises(InvalidRequest, match="Prefetch: INVALID_ARGUMENT.*expert 9 out of range"):
            session.release(1)  # ...its error comes with the next reply that is


def test_bad_prefetch_is_invalid_argument_over_grpc(client):
    with client.attach("tiny", data_plane=False) as session, \
            pytest.raises(InvalidRequest, match="expert 9 out of range"):
        session.prefetch(1, [9])


_CLIENT_SCRIPT = """
import sys, time
from storaged.client import StorageClient
client = StorageClient(sys.argv[1])
session = client.attach("tiny")
layer, experts = int(sys.argv[2]), [int(e) for e in sys.argv[3].split(",")]
slots = session.acquire(layer, experts)
payload = b"".join(session.slot_bytes(s, int(sys.argv[4])).numpy().tobytes() for s in slots)
print(payload.hex(), flush=True)
if sys.argv[5] == "hold":
    time.sleep(60)
session.close()
"""


def _client_process(socket, layer, experts, nbytes, mode):
    return subprocess.Popen([PYTHON, "-c", _CLIENT_SCRIPT, str(socket), str(layer),
                             ",".join(map(str, experts)), str(nbytes), mode],
                            cwd=REPO, env=daemon_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_client_killed_mid_stream_leaves_no_pins(client, served):
    daemon, payloads = served
    sessions_before = client.stats().sessions
    holder = _client_process(daemon.socket, 1, list(range(TEST_EXPERTS)), 16, "hold")
    assert holder.stdout.readline(), holder.stderr.read()
    assert client.stats().pins == TEST_EXPERTS
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    _wait_for(lambda: client.stats().pins == 0)
    _wait_for(lambda: client.stats().sessions == sessions_before)  # the session died with its client
    with client.attach("tiny") as session:  # the whole capacity is usable again
        session.acquire(2, list(range(TEST_EXPERTS)))
        session.acquire(1, [0, 1])


def test_two_client_processes_share_hits(client, served):
    daemon, payloads = served
    experts, nbytes = [1, 4, 7], 8704
    first = _client_process(daemon.socket, 2, experts, nbytes, "once")
    out_first, err = first.communicate(timeout=60)
    assert first.returncode == 0, err
    before = client.stats()
    second = _client_process(daemon.socket, 2, experts, nbytes, "once")
    out_second, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    after = client.stats()
    expected = b"".join(payloads[(2, e)] for e in experts)
    assert bytes.fromhex(out_first.strip()) == bytes.fromhex(out_second.strip()) == expected
    assert after.tiers["vram"].hits - before.tiers["vram"].hits == 3
    assert after.reads == before.reads


def test_detached_session_is_not_found(client, served):
    session = client.attach("tiny")
    session_id = session.id
    session.close()
    with grpc.insecure_channel(f"unix:{served[0].socket}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            pb_grpc.ExpertStorageStub(channel).Release(pb.ReleaseRequest(session_id=session_id), timeout=5)
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


def test_sessions_gauge_counts_attached_sessions(client):
    base = client.stats().sessions
    with client.attach("tiny"), client.attach("tiny"):
        assert client.stats().sessions == base + 2
    assert client.stats().sessions == base


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
