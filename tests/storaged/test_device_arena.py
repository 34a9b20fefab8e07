"""CPU arena (a sealed memfd), client mapping from another process, host tier, descriptors and copy handles."""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
from arena_attacks import attacks

from storaged.device import (ArenaClosedError, ArenaDescriptor, ArenaDescriptorError, ArenaError, ArenaMapError,
                             CopySizeError, CpuArena, CudaArena, CudaUnavailableError, HostTier,
                             SlotRangeError, create_arena, map_arena)
from storaged.device.arena import ARENA_SEALS
from storaged.io import HostMemory

REPO = Path(__file__).resolve().parents[2]
SLOT = 2 * 4096

# Maps the arena in a fresh interpreter, from the descriptor on stdin and the arena's fd (argv[2],
# inherited): prints the sha256 of every slot, waits for a line on stdin, prints them again (the
# server rewrites a slot in between), then reports whether grpc was imported. With "write" it
# writes into a slot view instead, which must fault.
CLIENT = """
import hashlib, json, sys
from storaged.device.client_arena import map_arena
from storaged.device.descriptor import ArenaDescriptor
def decode(value):
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return [decode(v) for v in value] if isinstance(value, list) else value
fields = {k: decode(v) for k, v in json.loads(sys.stdin.readline()).items()}
arena = map_arena(ArenaDescriptor(**fields), int(sys.argv[2]))
if sys.argv[1] == "write":
    arena.slot_view(0, 16).fill_(7)
    print("wrote", flush=True)
    sys.exit(0)
def hashes():
    return [hashlib.sha256(arena.slot_view(s).numpy().tobytes()).hexdigest() for s in range(arena.slot_count)]
print(json.dumps(hashes()), flush=True)
sys.stdin.readline()
print(json.dumps(hashes()), flush=True)
print(json.dumps("grpc" in sys.modules), flush=True)
"""


def _client(mode: str, fd: int) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", CLIENT, mode, str(fd)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                            pass_fds=(fd,))


def encode_descriptor(descriptor: ArenaDescriptor) -> str:
    """One JSON line; bytes fields become {"hex": ...} (CLIENT decodes them)."""
    def encode(value):
        if isinstance(value, bytes):
            return {"hex": value.hex()}
        return [encode(v) for v in value] if isinstance(value, (list, tuple)) else value
    return json.dumps({k: encode(v) for k, v in asdict(descriptor).items()}) + "\n"


def _slot_hashes(arena) -> list[str]:
    return [hashlib.sha256(arena.slot_tensor(s).numpy().tobytes()).hexdigest() for s in range(arena.slot_count)]


def test_cpu_arena_copies_from_every_host_source_kind():
    memory = HostMemory(1, SLOT)
    memory.buffers[0].view[:] = os.urandom(SLOT)
    tensor = torch.randint(0, 256, (SLOT,), dtype=torch.uint8)
    view = memoryview(bytearray(os.urandom(100)))
    cases = [(0, memory.buffers[0], SLOT, bytes(memory.buffers[0].view)),
             (1, tensor, 5000, tensor.numpy().tobytes()[:5000]),
             (3, view, 100, bytes(view))]
    with CpuArena(4, SLOT) as arena:
        for slot, source, nbytes, expected in cases:
            handle = arena.copy_in(slot, source, nbytes)
            assert handle.done and handle.event_index is None
            assert arena.slot_tensor(slot, nbytes).numpy().tobytes() == expected
        out = torch.zeros(SLOT, dtype=torch.uint8)
        arena.copy_out(0, out, SLOT).synchronize()
        assert torch.equal(out, memory.buffers[0].tensor)
        assert not arena.slot_tensor(2).any()  # untouched slots stay zero
    memory.close()


def test_second_process_maps_the_arena_and_sees_live_bytes():
    with CpuArena(3, SLOT) as arena:
        for slot in range(3):
            arena.copy_in(slot, torch.frombuffer(bytearray(os.urandom(SLOT)), dtype=torch.uint8), SLOT)
        client = _client("read", arena.client_fd)
        client.stdin.write(encode_descriptor(arena.descriptor()))
        client.stdin.flush()
        assert json.loads(client.stdout.readline()) == _slot_hashes(arena)
        arena.copy_in(1, torch.full((SLOT,), 9, dtype=torch.uint8), SLOT)  # rewrite while mapped
        client.stdin.write("\n")
        client.stdin.flush()
        after = json.loads(client.stdout.readline())
        assert after == _slot_hashes(arena) and after[1] == hashlib.sha256(bytes([9]) * SLOT).hexdigest()
        assert json.loads(client.stdout.readline()) is False  # the client side never imports grpc
        assert client.wait(timeout=60) == 0, client.stderr.read()


def test_client_mapping_is_read_only():
    with CpuArena(1, SLOT) as arena:
        client = _client("write", arena.client_fd)
        out, err = client.communicate(encode_descriptor(arena.descriptor()), timeout=60)
        assert client.returncode == -signal.SIGSEGV and "wrote" not in out
        assert not arena.slot_tensor(0).any()


def test_the_arena_is_a_sealed_memfd_that_no_path_names():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    arena = CpuArena(2, SLOT)
    fd = arena.client_fd
    assert os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:expertpack-arena")
    assert (set(os.listdir("/dev/shm")) if before else set()) == before  # no file anywhere
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & ARENA_SEALS == ARENA_SEALS, hex(seals)
    info = os.fstat(fd)
    assert info.st_size == arena.allocation_bytes and info.st_blocks * 512 >= 2 * SLOT  # reserved, not sparse
    client = map_arena(arena.descriptor(), fd)
    arena.copy_in(1, torch.full((10,), 3, dtype=torch.uint8), 10)  # the daemon's own mapping still writes
    assert bytes(arena.host_view(1, 10)) == bytes([3] * 10)
    arena.close()
    assert client.slot_view(1, 10).tolist() == [3] * 10  # an existing mapping outlives the arena
    with pytest.raises(ArenaClosedError):
        arena.slot_tensor(0)
    with pytest.raises(OSError):
        os.fstat(fd)  # closed with the arena
    client.close()
    with pytest.raises(ArenaClosedError):
        client.slot_view(0)


def test_no_descriptor_of_the_arena_can_change_its_bytes():
    """The kernel refuses every write path, to root too; only the daemon's own mapping writes."""
    with CpuArena(2, SLOT) as arena:
        arena.copy_in(0, torch.full((SLOT,), 7, dtype=torch.uint8), SLOT)
        outcomes = attacks(arena.client_fd, arena.allocation_bytes)
        assert [name for name, o in outcomes.items() if not o.startswith("refused")] == [], outcomes
        assert len(outcomes) == 8
        assert arena.slot_tensor(0).eq(7).all() and os.fstat(arena.client_fd).st_size == arena.allocation_bytes


def test_a_kernel_that_refuses_the_write_seal_gets_no_arena(monkeypatch):
    import storaged.device.arena as arena_module

    # what a kernel before 5.1 answers to F_SEAL_FUTURE_WRITE: EINVAL for a seal it does not know
    monkeypatch.setattr(arena_module, "ARENA_SEALS", arena_module.ARENA_SEALS | 0x8000)
    with pytest.raises(ArenaError, match="refusing to share a writable arena"):
        CpuArena(1, SLOT)


def test_mapping_needs_the_right_descriptor():
    with CpuArena(2, SLOT) as arena, CpuArena(1, SLOT) as small:
        with pytest.raises(ArenaMapError, match="file descriptor"):
            map_arena(arena.descriptor())
        with pytest.raises(ArenaMapError, match="at least"):
            map_arena(arena.descriptor(), small.client_fd)
        with pytest.raises(ArenaMapError):
            map_arena(arena.descriptor(), 987654)  # not open
        cuda = ArenaDescriptor(kind="cuda_ipc", slot_bytes=SLOT, slot_count=1, device_index=0,
                               ipc_handle=b"h" * 64, ref_counter_handle=b"/torch_1", storage_size_bytes=SLOT)
        with pytest.raises(ArenaDescriptorError, match="not mapped from a file descriptor"):
            map_arena(cuda, arena.client_fd)


def test_two_arenas_are_distinct_files():
    with CpuArena(1, SLOT) as a, CpuArena(1, SLOT) as b:
        assert os.fstat(a.client_fd).st_ino != os.fstat(b.client_fd).st_ino


@pytest.mark.parametrize(("slot", "nbytes"), [(-1, 10), (4, 10), (0, SLOT + 1), (0, -1)])
def test_slot_ranges_are_checked_everywhere(slot, nbytes):
    with CpuArena(4, SLOT) as arena:
        client = map_arena(arena.descriptor(), arena.client_fd)
        source = torch.zeros(SLOT + 1, dtype=torch.uint8)
        for call in (lambda: arena.slot_tensor(slot, nbytes), lambda: arena.copy_in(slot, source, nbytes),
                     lambda: client.slot_view(slot, nbytes), lambda: arena.host_view(slot, nbytes)):
            with pytest.raises(SlotRangeError, match=f"slot {slot} of 4"):
                call()


@pytest.mark.parametrize(("source", "error"), [
    (torch.zeros(10, dtype=torch.uint8), CopySizeError),  # smaller than the copy
    (torch.zeros(100, dtype=torch.float32), TypeError),
    (memoryview(b"\0" * 100), TypeError),  # read-only
    (b"\0" * 100, TypeError),
])
def test_bad_copy_sources_are_refused(source, error):
    with CpuArena(1, SLOT) as arena, pytest.raises(error):
        arena.copy_in(0, source, 64)


@pytest.mark.parametrize(("fields", "message"), [
    (dict(kind="nvme", slot_bytes=SLOT, slot_count=1), "kind"),
    (dict(kind="shm", slot_bytes=SLOT, slot_count=1), "kind"),  # path-named arenas are gone
    (dict(kind="memfd", slot_bytes=1000, slot_count=1), "multiple of 4096"),
    (dict(kind="memfd", slot_bytes=SLOT, slot_count=0), "slot_count"),
    (dict(kind="cuda_ipc", slot_bytes=SLOT, slot_count=1, device_index=0), "IPC handle"),
    (dict(kind="cuda_ipc", slot_bytes=SLOT, slot_count=2, device_index=0, ipc_handle=b"h",
          ref_counter_handle=b"r", storage_size_bytes=SLOT), "cannot hold"),
])
def test_descriptor_validation(fields, message):
    with pytest.raises(ArenaDescriptorError, match=message):
        ArenaDescriptor(**fields)


def test_host_tier_fills_from_staging_and_copies_to_the_arena():
    staging = HostMemory(1, SLOT)
    staging.buffers[0].view[:] = os.urandom(SLOT)
    with HostTier(3, SLOT) as tier, CpuArena(2, SLOT) as arena:
        assert tier.slot(2).address % 4096 == 0 and not tier.pinned and tier.tier_bytes == 3 * SLOT
        tier.copy_from(2, staging.buffers[0], 6000)
        handle = tier.copy_to_arena(2, arena, 1, 6000)
        asyncio.run(handle.wait())
        assert bytes(arena.slot_tensor(1, 6000).numpy()) == bytes(staging.buffers[0].view[:6000])
        with pytest.raises(SlotRangeError, match="slot 3 of 3"):
            tier.slot(3)
    with pytest.raises(ArenaClosedError):
        tier.slot(0)
    staging.close()


def test_create_arena_kinds():
    arena = create_arena("auto" if not torch.cuda.is_available() else "cpu", 2, SLOT)
    assert isinstance(arena, CpuArena) and arena.descriptor().kind == "memfd"
    arena.close()
    with pytest.raises(ValueError, match="'tpu'"):
        create_arena("tpu", 2, SLOT)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA failure")
def test_cuda_paths_fail_closed_without_cuda():
    with pytest.raises(CudaUnavailableError):
        CudaArena(2, SLOT)
    descriptor = ArenaDescriptor(kind="cuda_ipc", slot_bytes=SLOT, slot_count=1, device_index=0,
                                 ipc_handle=b"h" * 64, ref_counter_handle=b"/torch_1", storage_size_bytes=SLOT)
    with pytest.raises(CudaUnavailableError):
        map_arena(descriptor)


def test_host_address_names_the_first_byte_and_refuses_a_short_buffer():
    import pytest
    import torch

    from storaged.device.arena import host_address
    from storaged.device.errors import CopySizeError
    from storaged.io import HostMemory

    with HostMemory(2, 8192) as memory:
        buffer = memory.buffers[1]
        assert host_address(buffer, 8192, "copy") == (buffer.address, buffer)  # no view made
        with pytest.raises(CopySizeError, match="copy: host buffer holds 8192 bytes, the copy needs 8193"):
            host_address(buffer, 8193, "copy")
    tensor = torch.zeros(4096, dtype=torch.uint8)
    address, keepalive = host_address(tensor, 100, "copy")
    assert address == tensor.data_ptr() and keepalive.numel() == 100
    with pytest.raises(CopySizeError, match="holds 4096 bytes"):
        host_address(tensor, 4097, "copy")
