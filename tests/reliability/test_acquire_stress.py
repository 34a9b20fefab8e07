"""16 client processes × N Acquires each, in two rounds: no errors, no wrong byte, a flat daemon RSS.

Each client acquires one or two random experts of a random layer (dropping its other layers' pins,
as the decoder does) and checks every slot's bytes against the pack's crc32. The bundle has more
objects than the two tiers hold, so the run mixes VRAM hits, host-tier hits and pack reads with
evictions and demotions. The daemon's anonymous memory (its heap: the arena and the host tier are
shared memory, counted apart) is sampled after each round: after the first round has warmed every
cache and pool, the second may not grow it by more than RSS_GROWTH_LIMIT.
"""

from __future__ import annotations

import pytest

from reliability_kit import acquire_worker, client_processes, crcs_of, daemon_device, process_memory, scale
from storaged.client import StorageClient
from storaged_testkit import SLOT_BYTES, write_bundle, start_daemon

CLIENTS = 16
ROUNDS = 2
EXPERTS = 16  # per layer: 48 objects over 40 VRAM slots and 16 host-tier slots
RSS_GROWTH_LIMIT = 8 << 20  # bytes of daemon heap the second round may add (allocator noise)


def _round(daemon, crcs, acquires: int, seed: int) -> dict:
    context = client_processes()
    results = context.Queue()
    processes = [context.Process(target=acquire_worker, daemon=True,
                                 args=(str(daemon.socket), "wide", crcs, acquires, seed + n, results))
                 for n in range(CLIENTS)]
    for process in processes:
        process.start()
    try:
        reports = [results.get(timeout=1800) for _ in processes]
    finally:
        for process in processes:
            process.join(30)
            if process.exitcode is None:
                process.kill()
    return {"errors": sum(r[1] for r in reports), "mismatches": sum(r[2] for r in reports),
            "acquires": sum(r[3] for r in reports), "first_error": next((r[4] for r in reports if r[4]), "")}


@pytest.mark.parametrize("size", [pytest.param("default"), pytest.param("slow", marks=pytest.mark.slow)])
def test_many_clients_many_acquires(disk_dir, size, figures):
    acquires = scale(100, 10_000, "EXPERTPACK_RELIABILITY_ACQUIRES", size)
    payloads = write_bundle(disk_dir / f"wide-{size}", experts=EXPERTS, seed=2)
    crcs = crcs_of(payloads)
    directory = disk_dir / f"stress-{size}"
    directory.mkdir()
    daemon = start_daemon(directory, {"wide": disk_dir / f"wide-{size}"}, vram_cache_bytes=40 * SLOT_BYTES,
                          host_cache_bytes=16 * SLOT_BYTES, **daemon_device())
    try:
        rounds, memory = [], [process_memory(daemon.process.pid)]
        for number in range(ROUNDS):
            rounds.append(_round(daemon, crcs, acquires, seed=1000 * number))
            memory.append(process_memory(daemon.process.pid))
        with StorageClient(str(daemon.socket)) as observer:
            stats = observer.stats()
        assert daemon.process.poll() is None, daemon.stderr()
    finally:
        assert daemon.stop() == 0, daemon.stderr()
    growth = memory[-1]["RssAnon"] - memory[1]["RssAnon"]
    figures.record(f"acquire_stress_{size}", clients=CLIENTS, acquires_per_client=acquires, rounds=ROUNDS,
                   errors=sum(r["errors"] for r in rounds), mismatches=sum(r["mismatches"] for r in rounds),
                   acquires=sum(r["acquires"] for r in rounds),
                   rss_anon_mib=[round(m["RssAnon"] / 2**20, 1) for m in memory],
                   rss_growth_last_round_mib=round(growth / 2**20, 2),
                   vram_hits=stats.tiers["vram"].hits, host_hits=stats.tiers["host"].hits, reads=stats.reads,
                   demotions=stats.demotions)
    for result in rounds:
        assert result["errors"] == 0, result["first_error"]
        assert result["mismatches"] == 0
        assert result["acquires"] == CLIENTS * acquires
    assert stats.pins == 0 and stats.sessions == 0
    assert stats.tiers["vram"].hits and stats.tiers["host"].hits and stats.reads  # every path was taken
    assert growth <= RSS_GROWTH_LIMIT, (growth, memory)
