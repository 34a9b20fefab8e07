"""StorageEngine in-process: single flight, failure fan-out, prefetch promotion, cancellation.

These drive real components (bundles, the shared-memory arena, the O_DIRECT read executor, the
planner) from one event loop, so interleavings that a daemon subprocess cannot pin down are
deterministic: the second of two `gather`ed Acquires always finds the first one's load in flight.
"""

from __future__ import annotations

import asyncio
import shutil

import pytest

from storaged.policy import ExpertKey
from storaged.server.engine import ObjectDataLoss
from storaged.server.stats import stats_response
from storaged_testkit import SLOT_BYTES, corrupt_object


def _slot_bytes(runtime, slot: int, nbytes: int) -> bytes:
    return runtime.arena.slot_tensor(slot, nbytes).numpy().tobytes()


def test_concurrent_acquires_of_one_expert_read_it_once(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path)
    first, second = sessions.open(model), sessions.open(model)

    async def scenario():
        return await asyncio.gather(runtime.engine.acquire(first, 2, (3, 5)),
                                    runtime.engine.acquire(second, 2, (5, 3)))

    (slots_a, _), (slots_b, _) = asyncio.run(scenario())
    assert slots_a == tuple(reversed(slots_b))
    for expert, slot in zip((3, 5), slots_a):
        assert _slot_bytes(runtime, slot, len(bundle.payloads[(2, expert)])) == bundle.payloads[(2, expert)]
    stats = stats_response(sync)
    assert stats.reads == 2  # one read per expert, not per request
    assert stats.tiers[0].coalesced == 2
    assert stats.pins == 4  # both sessions hold both experts


def test_a_failed_load_fails_every_waiter_and_is_not_cached(runtime_of, bundle, tmp_path):
    corrupt = tmp_path / "corrupt"
    shutil.copytree(bundle.path, corrupt)
    corrupt_object(corrupt, 1, 4)
    runtime, sessions, model, sync = runtime_of(corrupt)
    first, second = sessions.open(model), sessions.open(model)

    async def scenario():
        return await asyncio.gather(runtime.engine.acquire(first, 1, (4,)),
                                    runtime.engine.acquire(second, 1, (0, 4)), return_exceptions=True)

    results = asyncio.run(scenario())
    assert all(isinstance(r, ObjectDataLoss) for r in results), results
    assert "(layer 1, expert 4)" in str(results[0])
    stats = stats_response(sync)
    assert stats.checksum_failures == 1 and stats.reads == 2  # expert 4 once, expert 0 once
    assert runtime.planner.loading() == ()
    assert runtime.planner.held(second.id) == {(0, 1): (ExpertKey(0, 1, 0),)}  # expert 0 stays pinned
    # The failed expert left no slot behind: asking again reads (and fails) again.
    with pytest.raises(ObjectDataLoss):
        asyncio.run(runtime.engine.acquire(first, 1, (4,)))
    assert stats_response(sync).checksum_failures == 2


def test_demand_joining_a_prefetch_promotes_it(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path, io_parallelism=1)
    session = sessions.open(model)

    async def scenario():
        # The planner lets prefetch hold at most a quarter of the 10 slots: 2 loads in flight.
        started = runtime.engine.prefetch(session, 4, (1, 6, 2))
        await asyncio.sleep(0)  # the loads submit their reads: 1 runs, 6 waits (one worker)
        slots, _ = await runtime.engine.acquire(session, 4, (6,))  # joins the queued prefetch
        await runtime.engine.drain(10)
        return started, slots

    started, slots = asyncio.run(scenario())
    assert started == 2
    assert _slot_bytes(runtime, slots[0], len(bundle.payloads[(4, 6)])) == bundle.payloads[(4, 6)]
    stats = stats_response(sync)
    assert stats.prefetch_issued == 2 and stats.prefetch_used == 1
    assert stats.reads == 2  # the promoted read was requeued, not read twice
    assert runtime.planner.loading() == ()


def test_a_cancelled_request_does_not_cancel_its_load(runtime_of, bundle):
    runtime, sessions, model, sync = runtime_of(bundle.path)
    leaving, staying = sessions.open(model), sessions.open(model)

    async def scenario():
        gone = asyncio.create_task(runtime.engine.acquire(leaving, 1, (7,)))
        await asyncio.sleep(0)  # the load is started
        gone.cancel()
        runtime.engine.close_session(leaving)  # what the servicer does when a client vanishes
        return await runtime.engine.acquire(staying, 1, (7,))

    slots, _ = asyncio.run(scenario())
    assert _slot_bytes(runtime, slots[0], len(bundle.payloads[(1, 7)])) == bundle.payloads[(1, 7)]
    assert stats_response(sync).reads == 1
    assert runtime.planner.held(leaving.id) == {}


def _acquire_without_yielding(engine, session, layer: int, experts: tuple[int, ...]):
    """Run one Acquire coroutine a single step: its result if it finished without giving the
    event loop a turn, None if it had to wait."""
    coroutine = engine.acquire(session, layer, experts, release_other_layers=True)
    try:
        coroutine.send(None)
    except StopIteration as finished:
        return finished.value
    coroutine.close()
    return None


@pytest.mark.parametrize("mid_step", [False, True])
def test_host_tier_promotions_are_issued_within_the_acquire(runtime_of, bundle, mid_step):
    """An Acquire whose misses are all in the host tier issues their copies itself and answers
    without a loop turn; one whose victim slot a session may still be reading (a fence mid-step)
    must wait instead, and still gets the right bytes once the step finishes."""
    runtime, sessions, model, sync = runtime_of(bundle.path, vram_cache_bytes=4 * SLOT_BYTES,
                                             host_cache_bytes=32 * SLOT_BYTES)
    session = sessions.open(model)
    reader = runtime.fences.open("reader")

    async def scenario():
        await runtime.engine.acquire(session, 1, (0, 1), release_other_layers=True)  # read from the pack
        # Needs all four slots, whatever the replacement rule: layer 1's two are demoted.
        await runtime.engine.acquire(session, 2, (0, 1, 2, 3), release_other_layers=True)
        await runtime.engine.drain(10)
        if mid_step:
            reader._words[0], reader._words[1] = 5, 4  # STARTED 5, FINISHED 4: in step 5
        answered = _acquire_without_yielding(runtime.engine, session, 1, (0, 1))
        if mid_step:
            assert answered is None
            reader._words[1] = 5  # the step finished
            answered = await runtime.engine.acquire(session, 1, (0, 1), release_other_layers=True)
        await runtime.engine.drain(10)
        return answered

    slots, _ = asyncio.run(scenario())
    for expert, slot in zip((0, 1), slots):
        assert _slot_bytes(runtime, slot, len(bundle.payloads[(1, expert)])) == bundle.payloads[(1, expert)]
    stats = stats_response(sync)
    host = next(tier for tier in stats.tiers if tier.tier == "host")
    assert (stats.reads, host.hits) == (6, 2)  # layer 1's experts came back from the host tier
