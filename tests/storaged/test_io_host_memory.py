"""Aligned host memory and the staging pool: alignment checks, lending, waiting, misuse."""

from __future__ import annotations

import asyncio

import pytest
import torch

from storaged.io import (BufferAlignmentError, HostMemory, HostPinError, StagingPool, StagingPoolError,
                         check_alignment)


@pytest.mark.parametrize(("address", "nbytes", "ok"), [
    (0x10000, 4096, True),
    (0x10000, 8192, True),
    (0x10001, 4096, False),  # unaligned address
    (0x10800, 4096, False),  # 2 KiB aligned is not enough
    (0x10000, 4095, False),  # unaligned length
    (0x10000, 0, False),  # empty
])
def test_check_alignment(address, nbytes, ok):
    if ok:
        check_alignment("buffer", address, nbytes)
    else:
        with pytest.raises(BufferAlignmentError, match=f"{address:#x}"):
            check_alignment("buffer", address, nbytes)


def test_host_memory_buffers_are_aligned_disjoint_and_shared_with_their_tensors():
    with HostMemory(5, 3 * 4096) as memory:
        addresses = [b.address for b in memory.buffers]
        assert all(a % 4096 == 0 for a in addresses)
        assert addresses == [memory.address + i * 3 * 4096 for i in range(5)]
        for buffer in memory.buffers:
            assert buffer.nbytes == 3 * 4096 and buffer.tensor.data_ptr() == buffer.address
            buffer.view[:4] = bytes([buffer.index] * 4)
        assert [int(b.tensor[0]) for b in memory.buffers] == list(range(5))
        assert not memory.pinned


@pytest.mark.parametrize(("count", "nbytes"), [(0, 4096), (1, 0), (1, 100), (2, 4097)])
def test_host_memory_rejects_bad_sizes(count, nbytes):
    with pytest.raises(ValueError):
        HostMemory(count, nbytes)


def test_views_fail_loudly_after_close():
    memory = HostMemory(1, 4096)
    view = memory.buffers[0].view
    memory.close()
    memory.close()  # idempotent
    with pytest.raises(ValueError):
        view[0] = 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA failure")
def test_pinning_without_cuda_fails_closed():
    with pytest.raises(HostPinError, match="CUDA is not available"):
        HostMemory(1, 4096, pin=True)


def test_staging_pool_rounds_up_and_lends_each_buffer_once():
    async def scenario():
        pool = StagingPool(3, 5000)
        assert pool.buffer_bytes == 8192 and pool.free_count == 3
        lent = [await pool.acquire() for _ in range(3)]
        assert len({b.index for b in lent}) == 3 and pool.try_acquire() is None
        pool.release(lent[1])
        assert pool.try_acquire() is lent[1]
        pool.close()

    asyncio.run(scenario())


def test_staging_pool_waiters_are_served_fifo():
    async def scenario():
        pool = StagingPool(1, 4096)
        first = await pool.acquire()
        order = []

        async def take(name):
            async with pool.borrow() as buffer:
                order.append(name)
                assert buffer is first
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(take(n)) for n in ("a", "b", "c")]
        await asyncio.sleep(0)
        assert order == []  # all waiting
        pool.release(first)
        await asyncio.gather(*tasks)
        assert order == ["a", "b", "c"] and pool.free_count == 1
        pool.close()

    asyncio.run(scenario())


def test_cancelled_waiter_does_not_swallow_a_buffer():
    async def scenario():
        pool = StagingPool(1, 4096)
        held = await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        pool.release(held)  # handed to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert pool.free_count == 1 and pool.try_acquire() is held
        pool.close()

    asyncio.run(scenario())


def test_double_release_and_foreign_buffers_are_refused():
    async def scenario():
        pool, other = StagingPool(1, 4096), StagingPool(1, 4096)
        buffer = await pool.acquire()
        pool.release(buffer)
        with pytest.raises(StagingPoolError, match="not on loan"):
            pool.release(buffer)
        foreign = await other.acquire()
        with pytest.raises(StagingPoolError):
            pool.release(foreign)
        pool.close()
        other.close()

    asyncio.run(scenario())


def test_close_fails_waiters():
    async def scenario():
        pool = StagingPool(1, 4096)
        await pool.acquire()
        waiter = asyncio.create_task(pool.acquire())
        await asyncio.sleep(0)
        pool.close()
        with pytest.raises(StagingPoolError, match="closed"):
            await waiter
        with pytest.raises(StagingPoolError):
            pool.try_acquire()

    asyncio.run(scenario())
