"""DirectPackFile and ReadExecutor against real packs on a disk that enforces O_DIRECT rules."""

from __future__ import annotations

import asyncio
import concurrent.futures
import errno
import mmap
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest

from packformat import ElementType, ObjectChecksumError, PackReader, PackWriter, Role
from storaged.io import (AlignedBuffer, BufferAlignmentError, BufferTooSmallError, DirectIOUnsupported,
                         DirectPackFile, ExecutorClosedError, HostMemory, ObjectReadError, PriorityDispatch,
                         ReadExecutor, ReadPriority, UnknownPackError)
from storaged.metrics import StoragedMetrics

LAYERS, EXPERTS = (0, 3), 4


def _enforces_direct_io(directory: Path) -> bool:
    """O_DIRECT opens, an aligned read works and one at an unaligned file offset fails."""
    probe = directory / ".odirect-probe"
    try:
        probe.write_bytes(b"\0" * 8192)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        page = mmap.mmap(-1, 4096)
        os.preadv(fd, [page], 0)
        try:
            os.preadv(fd, [page], 1)
        except OSError as exc:
            return exc.errno == errno.EINVAL
        return False
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.fixture
def disk_dir(tmp_path):
    for candidate in (tmp_path, Path("/var/tmp"), Path(__file__).resolve().parent):
        if candidate.is_dir() and _enforces_direct_io(candidate):
            directory = Path(tempfile.mkdtemp(prefix="storaged-io-test-", dir=candidate))
            yield directory
            shutil.rmtree(directory)
            return
    pytest.skip("no writable directory here enforces O_DIRECT alignment (all tmpfs?)")


@pytest.fixture
def pack_path(disk_dir):
    """Objects of 3 to 11 pages of random bytes, none a whole number of pages."""
    path = disk_dir / "experts.pack"
    rng = np.random.default_rng(7)
    writer = PackWriter(path, layers=list(LAYERS), expert_count=EXPERTS, roles_per_object=3)
    for layer in LAYERS:
        for expert in range(EXPERTS):
            rows = 16 * (expert + 1)  # gate+up: rows*64*4 bytes each
            writer.add_object(layer, expert, [
                (Role.GATE, ElementType.F32, (rows, 64), rng.random((rows, 64), dtype=np.float32).tobytes()),
                (Role.UP, ElementType.F32, (rows, 64), rng.random((rows, 64), dtype=np.float32).tobytes()),
                (Role.DOWN, ElementType.Q8_0, (64, 32 * (layer + 1)),
                 rng.integers(0, 255, 64 * 34 * (layer + 1), dtype=np.uint8).tobytes()),
            ])
    writer.close()
    return path


@pytest.fixture
def reader(pack_path):
    with PackReader(pack_path) as pack:
        yield pack


def _buffers(reader, count):
    size = max(o.padded_size for o in reader)
    return HostMemory(count, size)


def test_direct_reads_are_byte_identical_and_exactly_padded_size(pack_path, reader):
    memory = _buffers(reader, 1)
    buffer = memory.buffers[0]
    with DirectPackFile(pack_path) as file:
        assert file.direct_io_active
        for entry in reader:
            buffer.view[:] = b"\xab" * buffer.nbytes
            payload = file.read_into(entry, buffer)
            assert bytes(payload) == reader.read_object(entry.layer, entry.expert)
            assert bytes(buffer.view[entry.size:entry.padded_size]) == bytes(entry.padded_size - entry.size)
            assert bytes(buffer.view[entry.padded_size:]) == b"\xab" * (buffer.nbytes - entry.padded_size)
    assert min(o.padded_size for o in reader) > 4096 and all(o.size % 4096 for o in reader)
    memory.close()


def test_o_direct_is_really_used(pack_path):
    with DirectPackFile(pack_path) as direct, DirectPackFile(pack_path, direct_io=False) as buffered:
        assert direct.direct_io_active and not buffered.direct_io_active
        page = mmap.mmap(-1, 8192)
        with pytest.raises(OSError) as caught:  # the kernel enforces block alignment on this descriptor
            os.preadv(direct.fileno(), [memoryview(page)[:4096]], 1)
        assert caught.value.errno == errno.EINVAL
        assert os.preadv(buffered.fileno(), [memoryview(page)[:4096]], 1) == 4096


def test_unaligned_target_is_refused_before_reading(pack_path, reader):
    memory = HostMemory(1, 4 * 4096)
    whole = memory.buffers[0]
    shifted = AlignedBuffer(0, whole.address + 512, whole.view[512:], whole.tensor[512:])
    with DirectPackFile(pack_path) as file, pytest.raises(BufferAlignmentError, match=hex(whole.address + 512)):
        file.read_into(reader.entry(0, 0), shifted)
    memory.close()


def test_buffer_too_small(pack_path, reader):
    memory = HostMemory(1, 4096)
    big = max(reader, key=lambda o: o.padded_size)
    with DirectPackFile(pack_path) as file, pytest.raises(BufferTooSmallError, match=f"expert {big.expert}"):
        file.read_into(big, memory.buffers[0])
    memory.close()


def test_corrupt_byte_fails_only_that_object(pack_path, reader):
    bad = reader.entry(3, 2)
    with open(pack_path, "r+b") as raw:
        raw.seek(bad.offset + bad.size // 2)
        original = raw.read(1)
        raw.seek(-1, os.SEEK_CUR)
        raw.write(bytes([original[0] ^ 0x40]))
    memory = _buffers(reader, 1)
    with DirectPackFile(pack_path) as file:
        with pytest.raises(ObjectChecksumError, match="layer 3, expert 2") as caught:
            file.read_into(bad, memory.buffers[0])
        assert caught.value.offset == bad.offset
        for entry in reader:
            if entry is not bad:
                assert bytes(file.read_into(entry, memory.buffers[0])) == reader.read_object(entry.layer,
                                                                                             entry.expert)
    with DirectPackFile(pack_path, verify=False) as unchecked:
        assert len(unchecked.read_into(bad, memory.buffers[0])) == bad.size
    memory.close()


def test_truncated_pack_raises_object_read_error(pack_path, reader):
    last = reader.entry(LAYERS[-1], EXPERTS - 1)
    os.truncate(pack_path, last.offset + 4096)  # keeps the first page of a multi-page object
    memory = _buffers(reader, 1)
    with DirectPackFile(pack_path) as file, pytest.raises(ObjectReadError, match="end of file after 4096"):
        file.read_into(last, memory.buffers[0])
    memory.close()


def test_filesystem_without_o_direct_is_refused_by_name():
    with pytest.raises(DirectIOUnsupported, match=r"/proc/version: .*\(proc at /proc\)"):
        DirectPackFile("/proc/version")


def test_tmpfs_pack_is_refused_or_really_direct(tmp_path):
    """Older kernels refuse O_DIRECT on tmpfs (DirectIOUnsupported); 6.6+ accept it for real."""
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    path = Path(tempfile.mkstemp(dir="/dev/shm", prefix="storaged-test-")[1])
    try:
        path.write_bytes(b"\0" * 8192)
        try:
            kernel_accepts = os.close(os.open(path, os.O_RDONLY | os.O_DIRECT)) is None
        except OSError:
            kernel_accepts = False
        if kernel_accepts:
            with DirectPackFile(path) as file:
                assert file.direct_io_active
        else:
            with pytest.raises(DirectIOUnsupported, match="tmpfs"):
                DirectPackFile(path)
    finally:
        path.unlink()


# ---- priority dispatch ----------------------------------------------------------------------------

D, P = ReadPriority.DEMAND, ReadPriority.PREFETCH


@pytest.mark.parametrize(("max_prefetch", "puts", "takes"), [
    (1, [("p1", P), ("p2", P), ("d1", D)], ["d1", "p1", None]),  # demand jumps the queue; 1 prefetch max
    (2, [("p1", P), ("p2", P), ("p3", P)], ["p1", "p2", None]),
    (0, [("p1", P), ("d1", D)], ["d1", None]),  # prefetch off
    (1, [("d1", D), ("d2", D), ("d3", D)], ["d1", "d2", "d3", None]),  # demand is never budgeted
])
def test_priority_dispatch_rules(max_prefetch, puts, takes):
    dispatch = PriorityDispatch(max_prefetch)
    for item, priority in puts:
        dispatch.put(item, priority)
    got = [dispatch.take(timeout=0) for _ in takes]
    assert [g[0] if g else None for g in got] == takes


def test_finished_prefetch_frees_its_budget():
    dispatch = PriorityDispatch(1)
    dispatch.put("p1", P)
    dispatch.put("p2", P)
    assert dispatch.take(timeout=0) == ("p1", P) and dispatch.take(timeout=0) is None
    dispatch.done(P)
    assert dispatch.take(timeout=0) == ("p2", P)
    assert dispatch.close() == [] and dispatch.take() is None


def test_demand_reads_overtake_a_prefetch_flood(pack_path, reader):
    entries = list(reader)
    memory = _buffers(reader, len(entries))
    executor = ReadExecutor(workers=1, start=False)
    executor.add_pack("pack", DirectPackFile(pack_path))
    finished, futures = [], []
    plan = [(entry, P) for entry in entries[:6]] + [(entries[6], D), (entries[7], D)]
    for n, (entry, priority) in enumerate(plan):
        future = executor.submit("pack", entry, memory.buffers[n], priority)
        future.add_done_callback(lambda f, name=(entry.layer, entry.expert, priority.name): finished.append(name))
        futures.append(future)
    assert executor.queued(P) == 6 and executor.queued(D) == 2
    executor.start()
    _, pending = concurrent.futures.wait(futures, timeout=60)
    executor.close()
    assert not pending
    prefetch_order = [(e.layer, e.expert, "PREFETCH") for e in entries[:6]]
    assert finished == [(3, 2, "DEMAND"), (3, 3, "DEMAND"), *prefetch_order]
    for n, (entry, _) in enumerate(plan):
        assert bytes(futures[n].result()) == reader.read_object(entry.layer, entry.expert)
    memory.close()


def test_prefetch_never_takes_more_than_its_share_of_workers(pack_path, reader):
    executor = ReadExecutor(workers=4, prefetch_share=0.5, start=False)
    assert executor.max_prefetch_running == 2
    assert ReadExecutor(workers=3, prefetch_share=0.1, start=False).max_prefetch_running == 1
    assert ReadExecutor(workers=3, prefetch_share=0.0, start=False).max_prefetch_running == 0
    executor.close()


def test_async_reads_record_metrics_and_failures(pack_path, reader):
    bad = reader.entry(0, 1)
    with open(pack_path, "r+b") as raw:
        raw.seek(bad.offset)
        raw.write(b"\xff\xfe")
    metrics = StoragedMetrics()
    memory = _buffers(reader, 2)

    async def scenario():
        with ReadExecutor(workers=2, metrics=metrics) as executor:
            executor.add_pack("p", DirectPackFile(pack_path))
            good = reader.entry(3, 3)
            payload = await executor.read("p", good, memory.buffers[0])
            assert bytes(payload) == reader.read_object(3, 3)
            with pytest.raises(ObjectChecksumError, match="layer 0, expert 1"):
                await executor.read("p", bad, memory.buffers[1], ReadPriority.PREFETCH)
            with pytest.raises(UnknownPackError, match="'nope'"):
                await executor.read("nope", good, memory.buffers[0])
            return good, bad

    good, bad = asyncio.run(scenario())
    figures = metrics.snapshot().series()
    assert figures["read_bytes_total"] == good.padded_size + bad.padded_size
    assert figures["read_seconds_count"] == 2 and figures["checksum_failures_total"] == 1
    assert figures["io_errors_total"] == 0
    memory.close()


def test_io_errors_are_counted(pack_path, reader):
    last = reader.entry(LAYERS[-1], EXPERTS - 1)
    os.truncate(pack_path, last.offset)
    metrics = StoragedMetrics()
    memory = _buffers(reader, 1)
    with ReadExecutor(workers=1, metrics=metrics) as executor:
        executor.add_pack("p", DirectPackFile(pack_path))
        with pytest.raises(ObjectReadError, match="end of file after 0"):
            executor.submit("p", last, memory.buffers[0]).result()
    assert metrics.snapshot()["io_errors_total"] == 1
    memory.close()


def test_cancelled_queued_read_never_runs_and_close_fails_the_rest(pack_path, reader):
    memory = _buffers(reader, 2)
    for buffer in memory.buffers:
        buffer.view[:8] = b"untouchd"
    executor = ReadExecutor(workers=1, start=False)
    executor.add_pack("p", DirectPackFile(pack_path))

    async def scenario():
        task = asyncio.create_task(executor.read("p", reader.entry(0, 0), memory.buffers[0]))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(scenario())
    leftover = executor.submit("p", reader.entry(0, 1), memory.buffers[1])
    executor.close()
    with pytest.raises(ExecutorClosedError, match="layer 0, expert 1"):
        leftover.result()
    assert [bytes(b.view[:8]) for b in memory.buffers] == [b"untouchd"] * 2
    with pytest.raises(ExecutorClosedError):
        executor.submit("p", reader.entry(0, 0), memory.buffers[0])
    memory.close()
