"""preload = true: a real daemon process (CPU arena) fills VRAM and then the host tier with its
models' experts at start, each layer an equal share, the bytes the packs hold, and serves them as
hits; without it the daemon reads nothing until asked."""

from __future__ import annotations

import time

import pytest
from storaged_testkit import SLOT_BYTES, TEST_EXPERTS, TEST_LAYERS, start_daemon, write_bundle

from storaged.client import StorageClient

SLOTS, HOST_SLOTS = 4, 3
ROUND_ROBIN = [(layer, expert) for expert in range(TEST_EXPERTS) for layer in TEST_LAYERS]


def _settled(client, predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        stats = client.stats()
        if predicate(stats) or time.monotonic() > deadline:
            return stats
        time.sleep(0.02)


def _held(session) -> dict[tuple[int, int], tuple[str, int]]:
    """{(layer, expert): (tier, slot)} of every published slot map and host map entry."""
    view, slot_map, host_map = session.slot_map_view, session.slot_map(), session.host_map()
    held = {}
    for layer in TEST_LAYERS:
        for expert in range(TEST_EXPERTS):
            if int(slot_map[view.row(layer), expert]) >= 0:
                held[(layer, expert)] = ("vram", int(slot_map[view.row(layer), expert]))
            if host_map is not None and int(host_map[view.row(layer), expert]) >= 0:
                held[(layer, expert)] = ("host", int(host_map[view.row(layer), expert]))
    return held


def test_preload_fills_vram_then_the_host_tier_with_the_packs_bytes(disk_dir):
    bundle = disk_dir / "preload-bundle"
    payloads = write_bundle(bundle)
    daemon = start_daemon(disk_dir, {"tiny": bundle}, "--preload", vram_cache_bytes=SLOTS * SLOT_BYTES,
                          host_cache_bytes=HOST_SLOTS * SLOT_BYTES, socket_path=disk_dir / "preload.sock")
    try:
        with StorageClient(str(daemon.socket)) as client:
            stats = _settled(client, lambda s: s["preloading"] == 0 and s.tiers["host"].resident_experts == HOST_SLOTS)
            assert (stats.tiers["vram"].resident_experts, stats.tiers["host"].resident_experts) == (SLOTS, HOST_SLOTS)
            assert stats.reads == stats["preload_loads_total"] == SLOTS + HOST_SLOTS  # nothing dropped, read once
            assert stats.tiers["host"].evictions == 0 and stats.acquires == 0
            with client.attach("tiny") as session:
                held = _held(session)
                assert set(held) == set(ROUND_ROBIN[:SLOTS + HOST_SLOTS])  # every layer its share, in id order
                assert sorted(tier for tier, _ in held.values()) == ["host"] * HOST_SLOTS + ["vram"] * SLOTS
                tier = session.host_tier()
                for key, (where, slot) in held.items():
                    view = session.arena.slot_view(slot) if where == "vram" else tier.slot_view(slot)
                    assert view.numpy().tobytes()[:len(payloads[key])] == payloads[key], key
                vram_keys = [key for key, (where, _) in held.items() if where == "vram"]
                layer, expert = vram_keys[0]
                session.acquire(layer, [expert])  # served as a hit: no read
                after = client.stats()
                assert (after.reads, after.tiers["vram"].hits) == (stats.reads, stats.tiers["vram"].hits + 1)
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    log = daemon.stderr()
    assert f"preload: {SLOTS + HOST_SLOTS} experts read in" in log and "the tiers are full" in log, log


@pytest.mark.parametrize("preload", [True, False])
def test_preload_of_a_model_the_arena_holds_whole_or_none(disk_dir, preload):
    bundle = disk_dir / f"preload-whole-{preload}"
    write_bundle(bundle)
    experts = len(TEST_LAYERS) * TEST_EXPERTS
    daemon = start_daemon(disk_dir, {"tiny": bundle}, "--preload" if preload else "--no-preload",
                          vram_cache_bytes=(experts + 2) * SLOT_BYTES, socket_path=disk_dir / f"whole-{preload}.sock")
    try:
        with StorageClient(str(daemon.socket)) as client:
            if preload:
                stats = _settled(client, lambda s: s.tiers["vram"].resident_experts == experts and s["preloading"] == 0)
                assert stats.reads == experts and stats["preload_loads_total"] == experts
            else:
                time.sleep(0.3)  # a preload would have read some by now (24 objects of 12 KiB)
                stats = client.stats()
                assert stats.reads == 0 and stats.tiers["vram"].resident_experts == 0
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    assert ("every expert is cached" in daemon.stderr()) == preload


def test_a_daemon_stopped_while_preloading_exits_cleanly(disk_dir):
    bundle = disk_dir / "preload-stop"
    write_bundle(bundle, experts=256)  # 768 objects read one at a time: still preloading when stopped
    daemon = start_daemon(disk_dir, {"tiny": bundle}, "--preload", vram_cache_bytes=800 * SLOT_BYTES,
                          io_parallelism=1, socket_path=disk_dir / "preload-stop.sock")
    with StorageClient(str(daemon.socket)) as client:
        stats = client.stats()
    assert daemon.stop() == 0, daemon.stderr()
    log = daemon.stderr()
    assert "Traceback" not in log and "error" not in log.lower(), log
    if stats["preload_loads_total"] < 768:  # most runs stop it midway
        assert "preload: stopped with the daemon after starting" in log, log
