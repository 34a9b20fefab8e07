"""Objects of a served bundle corrupted on disk one at a time: each read is DATA_LOSS, counted, and
everything else is still served intact.

The daemon serves two models: `victim`, whose pack is damaged while the daemon runs, and
`control`, never touched. For each sampled victim object (one at a time, in random order): a few
bytes at random offsets inside its payload are flipped in the pack file; the object has never
been loaded, so neither the VRAM tier nor the host tier holds a copy and the read goes to the
disk. Two Acquires of it must both fail with DATA_LOSS and add 2 to checksum_failures_total on
/metrics; every control object and every victim object already restored must still be served
byte-identical; then the bytes are restored and the object itself is served intact (a failed
load is not cached).
"""

from __future__ import annotations

import os
import random

import pytest

from packformat import PackReader
from reliability_kit import daemon_device, free_port, scale, scrape
from storaged.client import DataLoss, StorageClient
from storaged_testkit import SLOT_BYTES, TEST_EXPERTS, start_daemon, write_bundle


def _flip(pack, entry, rng: random.Random, count: int) -> list[tuple[int, bytes]]:
    """XOR `count` random payload bytes of `entry`; returns (offset, original byte) to undo it."""
    undo = []
    with open(pack, "r+b") as f:
        for offset in rng.sample(range(entry.offset, entry.offset + entry.size), count):
            f.seek(offset)
            original = f.read(1)
            f.seek(offset)
            f.write(bytes([original[0] ^ rng.randrange(1, 256)]))
            undo.append((offset, original))
        f.flush()
        os.fsync(f.fileno())
    return undo


def _undo(pack, undo: list[tuple[int, bytes]]) -> None:
    with open(pack, "r+b") as f:
        for offset, original in undo:
            f.seek(offset)
            f.write(original)
        f.flush()
        os.fsync(f.fileno())


def _serves(session, payloads, objects) -> int:
    """How many of `objects` (layer, expert) are served byte-identical, one layer at a time."""
    identical = 0
    for layer in sorted({layer for layer, _ in objects}):
        experts = sorted(e for l, e in objects if l == layer)
        for expert, slot in zip(experts, session.acquire(layer, experts, release_other_layers=True)):
            data = payloads[(layer, expert)]
            identical += session.slot_bytes(slot, len(data)).cpu().numpy().tobytes() == data
    return identical


@pytest.mark.parametrize("size", [pytest.param("default"), pytest.param("slow", marks=pytest.mark.slow)])
def test_corrupted_objects_are_data_loss_and_the_others_are_served(disk_dir, size, figures):
    experts = TEST_EXPERTS if size == "default" else 16
    victim = disk_dir / f"victim-{size}"
    victim_payloads = write_bundle(victim, experts=experts, seed=5)
    control_payloads = write_bundle(disk_dir / f"control-{size}", seed=6)
    sample = scale(20, len(victim_payloads), "EXPERTPACK_RELIABILITY_CORRUPT", size)
    rng = random.Random(7)
    targets = rng.sample(sorted(victim_payloads), sample)
    with PackReader(victim / "experts.pack") as reader:
        entries = {key: reader.entry(*key) for key in targets}
    directory = disk_dir / f"corrupt-{size}"
    directory.mkdir()
    metrics = f"127.0.0.1:{free_port()}"
    daemon = start_daemon(directory, {"victim": victim, "control": disk_dir / f"control-{size}"},
                          vram_cache_bytes=2 * experts * SLOT_BYTES, host_cache_bytes=8 * SLOT_BYTES,
                          metrics_address=metrics, **daemon_device())
    data_loss = other_failures = 0
    restored: list[tuple[int, int]] = []
    counted = []
    try:
        with StorageClient(str(daemon.socket)) as client, client.attach("victim") as session, \
                client.attach("control") as control:
            for key in targets:
                undo = _flip(victim / "experts.pack", entries[key], rng, rng.randint(1, 4))
                before = scrape(metrics)["checksum_failures_total"]
                for _ in range(2):
                    try:
                        session.acquire(key[0], [key[1]], release_other_layers=True)
                    except DataLoss as exc:
                        assert f"layer {key[0]}, expert {key[1]}" in str(exc), exc
                        data_loss += 1
                counted.append(scrape(metrics)["checksum_failures_total"] - before)
                other_failures += len(control_payloads) - _serves(control, control_payloads, control_payloads)
                other_failures += len(restored) - _serves(session, victim_payloads, restored)
                _undo(victim / "experts.pack", undo)
                assert _serves(session, victim_payloads, [key]) == 1, f"{key} not served once restored"
                restored.append(key)
        assert daemon.process.poll() is None, daemon.stderr()
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    figures.record(f"corruption_{size}", objects=len(victim_payloads), corrupted=len(targets),
                   data_loss=data_loss, reads=2 * len(targets), counted=int(sum(counted)),
                   other_failures=other_failures, control_objects=len(control_payloads))
    assert data_loss == 2 * len(targets)
    assert counted == [2] * len(targets)
    assert other_failures == 0
