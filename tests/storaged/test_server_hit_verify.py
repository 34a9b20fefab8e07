"""verify_hits: a hit whose bytes in the arena changed is detected, counted, reloaded from the pack
and never served; with the pack's copy bad too, DATA_LOSS.

Clients cannot write a CPU arena (test_server_arena_integrity.py), so the bytes are altered here
from the daemon's side, through the one writable mapping, in-process; what a CUDA client could
do to an IPC mapping. Real components (bundle, arena, O_DIRECT reads, planner, engine) on one
event loop, as in test_server_engine.py.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest
from storaged_testkit import corrupt_object, start_daemon

from storaged.client import StorageClient
from storaged.policy import ExpertKey
from storaged.server.engine import ObjectDataLoss
from storaged.server.stats import stats_response


def _served(runtime, slot: int, nbytes: int) -> bytes:
    return runtime.arena.slot_tensor(slot, nbytes).numpy().tobytes()


def _tamper(runtime, slot: int) -> None:
    """Flip 16 bytes of a cached slot through the daemon's own (the only writable) mapping."""
    runtime.arena.slot_tensor(slot, 64)[16:32].bitwise_not_()


def test_an_altered_hit_is_detected_counted_reloaded_and_served_correct(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path, verify_hits=1.0)
    victim, other = sessions.open(model), sessions.open(model)
    slots, _ = asyncio.run(runtime.engine.acquire(victim, 1, (3, 5)))
    _tamper(runtime, slots[0])
    assert _served(runtime, slots[0], len(bundle.payloads[(1, 3)])) != bundle.payloads[(1, 3)]
    before = stats_response(sync)

    again, events = asyncio.run(runtime.engine.acquire(other, 1, (3, 5)))
    assert again == slots and events == (-1, -1)  # reloaded in its own slot, complete on reply
    for expert, slot in zip((3, 5), again):
        assert _served(runtime, slot, len(bundle.payloads[(1, expert)])) == bundle.payloads[(1, expert)]
    after = stats_response(sync)
    assert (after.hits_verified - before.hits_verified, after.hit_mismatches - before.hit_mismatches) == (2, 1)
    assert after.reads - before.reads == 1 and after.checksum_failures == 0  # only expert 3 re-read
    assert runtime.arena.read_map(runtime.slot_map.index(ExpertKey(model.model_id, 1, 3))) == slots[0]  # re-published
    assert runtime.planner.held(victim.id) == runtime.planner.held(other.id)  # both keep their pins
    # The reloaded copy is a hit like any other again.
    asyncio.run(runtime.engine.acquire(victim, 1, (3,)))
    final = stats_response(sync)
    assert (final.hit_mismatches, final.reads) == (after.hit_mismatches, after.reads)


def test_without_verify_hits_the_altered_bytes_are_served(runtime_of, bundle):
    """What verify_hits is for (on CUDA, where clients can write the arena): a hit is trusted."""
    runtime, sessions, model, sync = runtime_of(bundle.path)
    session = sessions.open(model)
    slots, _ = asyncio.run(runtime.engine.acquire(session, 1, (3,)))
    _tamper(runtime, slots[0])
    again, _ = asyncio.run(runtime.engine.acquire(sessions.open(model), 1, (3,)))
    assert _served(runtime, again[0], len(bundle.payloads[(1, 3)])) != bundle.payloads[(1, 3)]
    assert stats_response(sync).hits_verified == 0


def test_an_altered_hit_whose_pack_copy_is_bad_too_is_data_loss(runtime_of, bundle, tmp_path):
    copy = tmp_path / "bundle"
    shutil.copytree(bundle.path, copy)
    runtime, sessions, model, sync = runtime_of(copy, verify_hits=1.0)
    victim = sessions.open(model)
    slots, _ = asyncio.run(runtime.engine.acquire(victim, 2, (4, 6)))
    corrupt_object(copy, 2, 4)  # the disk goes bad after the load...
    _tamper(runtime, slots[0])  # ...and the cached copy is altered
    with pytest.raises(ObjectDataLoss, match=r"\(layer 2, expert 4\)"):
        asyncio.run(runtime.engine.acquire(sessions.open(model), 2, (4, 6)))
    stats = stats_response(sync)
    assert (stats.hit_mismatches, stats.checksum_failures) == (1, 1)
    assert ExpertKey(model.model_id, 2, 4) not in runtime.planner.vram  # dropped, pins and all
    assert runtime.planner.held(victim.id) == {(model.model_id, 2): (ExpertKey(model.model_id, 2, 6),)}
    with pytest.raises(ObjectDataLoss):  # never served from the altered slot: read (and refused) again
        asyncio.run(runtime.engine.acquire(victim, 2, (4,)))


def test_concurrent_hits_of_an_altered_object_share_one_reload(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path, verify_hits=1.0)
    slots, _ = asyncio.run(runtime.engine.acquire(sessions.open(model), 4, (1,)))
    _tamper(runtime, slots[0])
    before = stats_response(sync)

    async def scenario():
        return await asyncio.gather(*(runtime.engine.acquire(sessions.open(model), 4, (1,)) for _ in range(3)))

    for got, _ in asyncio.run(scenario()):
        assert _served(runtime, got[0], len(bundle.payloads[(4, 1)])) == bundle.payloads[(4, 1)]
    after = stats_response(sync)
    assert after.reads - before.reads == 1  # one reload, whoever found the mismatch first
    assert after.hit_mismatches - before.hit_mismatches >= 1


def test_a_fraction_verifies_a_sample_of_the_hits(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path, verify_hits=0.5)
    session = sessions.open(model)

    async def scenario():
        for _ in range(200):
            await runtime.engine.acquire(session, 1, (0, 1))

    asyncio.run(scenario())
    stats = stats_response(sync)
    hits = stats.tiers[0].hits
    assert hits == 398 and 0 < stats.hits_verified < hits  # each hit sampled with probability 0.5
    assert stats.hit_mismatches == 0


def test_a_daemon_offers_and_counts_hit_verification(disk_dir, bundle):
    run = disk_dir / "verify-hits"
    run.mkdir()
    daemon = start_daemon(run, {"tiny": bundle.path}, verify_hits=1.0)
    try:
        with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
            assert "HIT_VERIFY" in client.info().capabilities
            session.acquire(1, [0, 1])
            session.acquire(2, [0], release_other_layers=True)  # layer 1's objects stay cached, unpinned
            (slot,) = session.acquire(1, [0], release_other_layers=True)  # a hit: verified
            assert bytes(session.slot_bytes(slot, len(bundle.payloads[(1, 0)]))) == bundle.payloads[(1, 0)]
            stats = client.stats()
            assert (stats.hits_verified, stats.hit_mismatches) == (1, 0)
    finally:
        assert daemon.stop() == 0, daemon.stderr()


def test_a_check_that_ends_after_the_reload_finished_does_not_reload_again(runtime_of, bundle, monkeypatch):
    """Two Acquires hash the same altered hit; the second to finish its hash does so after the
    first one's reload completed: the object is not read a second time (it was checked on load)."""
    runtime, sessions, model, sync = runtime_of(bundle.path, verify_hits=1.0)
    slots, _ = asyncio.run(runtime.engine.acquire(sessions.open(model), 4, (1,)))
    _tamper(runtime, slots[0])
    before = stats_response(sync)
    verifier, matches = runtime.engine.verifier, runtime.engine.verifier.matches
    calls = []

    async def scenario():
        hashed, release = asyncio.Event(), asyncio.Event()

        async def held_first(slot, entry):
            matched = await matches(slot, entry)  # the altered bytes, hashed now
            calls.append(matched)
            if len(calls) == 1:
                hashed.set()
                await release.wait()  # ...but reported only after the other's reload finished
            return matched

        monkeypatch.setattr(verifier, "matches", held_first)
        held = asyncio.create_task(runtime.engine.acquire(sessions.open(model), 4, (1,)))
        await hashed.wait()
        await runtime.engine.acquire(sessions.open(model), 4, (1,))  # mismatch: reloads
        while runtime.engine.loads_in_flight:
            await asyncio.sleep(0.001)
        release.set()
        return await held

    got, _ = asyncio.run(scenario())
    assert calls == [False, False]
    assert _served(runtime, got[0], len(bundle.payloads[(4, 1)])) == bundle.payloads[(4, 1)]
    assert stats_response(sync).reads - before.reads == 1
