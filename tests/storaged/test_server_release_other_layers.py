"""Acquire(release_other_layers=True) against a real storaged subprocess whose cache holds
exactly one layer's demand: a session walking the layers needs only that, and the refusals stay
RESOURCE_EXHAUSTED with nothing changed for the other sessions.
"""

from __future__ import annotations

import pytest

from storaged.client import CapacityExhausted, StorageClient
from storaged_testkit import SLOT_BYTES, TEST_LAYERS, start_daemon

LAYER_DEMAND = 4  # experts per acquire, and the whole cache's slot count


@pytest.fixture(scope="module")
def served(disk_dir, bundle):
    directory = disk_dir / "one-layer-cache"
    directory.mkdir()
    daemon = start_daemon(directory, {"tiny": bundle.path}, direct_io=True,
                          vram_cache_bytes=LAYER_DEMAND * SLOT_BYTES)
    yield daemon, bundle.payloads
    assert daemon.stop() == 0, daemon.stderr()


@pytest.fixture
def client(served):
    daemon, _ = served
    with StorageClient(str(daemon.socket)) as client:
        yield client


def _bytes_of(session, slot: int, nbytes: int) -> bytes:
    return session.slot_bytes(slot, nbytes).numpy().tobytes()


def test_walking_every_layer_fits_a_one_layer_cache(client, served):
    _, payloads = served
    experts = [7, 0, 5, 2]
    before = client.stats()
    with client.attach("tiny") as session:
        for step, layer in enumerate(TEST_LAYERS * 2):  # twice round: every acquire misses
            slots = session.acquire(layer, experts, release_other_layers=True)
            assert sorted(slots) == list(range(LAYER_DEMAND))
            for expert, slot in zip(experts, slots):
                assert _bytes_of(session, slot, len(payloads[(layer, expert)])) == payloads[(layer, expert)]
            assert client.stats().pins == LAYER_DEMAND, f"step {step}: only layer {layer} stays pinned"
    after = client.stats()
    acquires = 2 * len(TEST_LAYERS)
    vram_before, vram_after = before.tiers["vram"], after.tiers["vram"]
    assert after.acquires - before.acquires == acquires
    assert after.capacity_exhausted == before.capacity_exhausted
    assert vram_after.misses - vram_before.misses == acquires * LAYER_DEMAND
    # Every acquire but the first evicts the whole previous layer (the cache may start full).
    evicted = vram_after.evictions - vram_before.evictions
    assert (acquires - 1) * LAYER_DEMAND <= evicted <= acquires * LAYER_DEMAND


@pytest.mark.parametrize("data_plane", [True, False], ids=["data plane", "grpc stream"])
def test_without_the_flag_the_second_layer_is_resource_exhausted(client, data_plane):
    with client.attach("tiny", data_plane=data_plane) as session:
        first = session.acquire(TEST_LAYERS[0], [0, 1, 2, 3])
        with pytest.raises(CapacityExhausted, match=r"4 slot\(s\) needed but only 0") as info:
            session.acquire(TEST_LAYERS[1], [0, 1, 2, 3])
        assert info.value.code.name == "RESOURCE_EXHAUSTED"
        # An error reply on the data plane leaves the connection, and the pins, as they were; a
        # failed gRPC stream drops the session's pins. Either way the session lives on.
        assert client.stats().pins == (4 if data_plane else 0)
        assert session.acquire(TEST_LAYERS[0], [0, 1, 2, 3]) == first


def test_the_flag_never_releases_another_sessions_pins(client, served):
    _, payloads = served
    with client.attach("tiny") as holder, client.attach("tiny") as walker:
        held = holder.acquire(TEST_LAYERS[0], [6])  # another session's pin: never a victim
        walker.acquire(TEST_LAYERS[1], [0, 1, 2], release_other_layers=True)
        refused = client.stats().capacity_exhausted
        with pytest.raises(CapacityExhausted, match=r"4 slot\(s\) needed but only 3"):
            walker.acquire(TEST_LAYERS[2], [0, 1, 2, 3], release_other_layers=True)
        assert client.stats().capacity_exhausted == refused + 1
        assert walker.acquire(TEST_LAYERS[2], [0, 1, 2], release_other_layers=True)
        assert client.stats().pins == 1 + 3
        expected = payloads[(TEST_LAYERS[0], 6)]
        assert _bytes_of(holder, held[0], len(expected)) == expected
