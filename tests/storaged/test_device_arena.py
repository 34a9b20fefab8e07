"""CPU arena, client mapping from another process, host tier, descriptors and copy handles."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import stat
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from storaged.device import (ArenaClosedError, ArenaDescriptor, ArenaDescriptorError, ArenaMapError,
                             CopySizeError, CpuArena, CudaArena, CudaUnavailableError, HostTier,
                             SlotRangeError, create_arena, map_arena)
from storaged.io import HostMemory

REPO = Path(__file__).resolve().parents[2]
SLOT = 2 * 4096

# Maps the arena in a fresh interpreter: prints the sha256 of every slot, waits for a line on
# stdin, prints them again (the server rewrites a slot in between), then reports whether grpc
# was imported. With "write" it writes into a slot view instead, which must fault.
CLIENT = """
import hashlib, json, sys
from storaged.device.client_arena import map_arena
from storaged.device.descriptor import ArenaDescriptor
def decode(value):
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return [decode(v) for v in value] if isinstance(value, list) else value
fields = {k: decode(v) for k, v in json.loads(sys.stdin.readline()).items()}
arena = map_arena(ArenaDescriptor(**fields))
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


def _client(mode: str) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    return subprocess.Popen([sys.executable, "-c", CLIENT, mode], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)


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
        client = _client("read")
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
        client = _client("write")
        out, err = client.communicate(encode_descriptor(arena.descriptor()), timeout=60)
        assert client.returncode == -signal.SIGSEGV and "wrote" not in out
        assert not arena.slot_tensor(0).any()


@pytest.mark.parametrize("mode", [0o600, 0o660])
def test_shm_file_mode_and_unlink_on_close(mode):
    arena = CpuArena(2, SLOT, mode=mode)
    path = arena.descriptor().shm_path
    info = os.stat(path)
    assert path.startswith("/dev/shm/expertpack-arena-") and stat.S_IMODE(info.st_mode) == mode
    assert info.st_size == 2 * SLOT and info.st_blocks * 512 >= 2 * SLOT  # reserved, not sparse
    client = map_arena(arena.descriptor())
    arena.copy_in(1, torch.full((10,), 3, dtype=torch.uint8), 10)
    arena.close()
    assert not os.path.exists(path)
    assert client.slot_view(1, 10).tolist() == [3] * 10  # an existing mapping outlives the file
    with pytest.raises(ArenaMapError, match="cannot open"):
        map_arena(ArenaDescriptor(kind="shm", slot_bytes=SLOT, slot_count=2, shm_path=path))
    with pytest.raises(ArenaClosedError):
        arena.slot_tensor(0)
    client.close()
    with pytest.raises(ArenaClosedError):
        client.slot_view(0)


def test_two_arenas_get_distinct_names_and_bad_modes_are_refused():
    with CpuArena(1, SLOT) as a, CpuArena(1, SLOT) as b:
        assert a.path != b.path
    with pytest.raises(ValueError, match="0o644"):
        CpuArena(1, SLOT, mode=0o644)


@pytest.mark.parametrize(("slot", "nbytes"), [(-1, 10), (4, 10), (0, SLOT + 1), (0, -1)])
def test_slot_ranges_are_checked_everywhere(slot, nbytes):
    with CpuArena(4, SLOT) as arena:
        client = map_arena(arena.descriptor())
        source = torch.zeros(SLOT + 1, dtype=torch.uint8)
        for call in (lambda: arena.slot_tensor(slot, nbytes), lambda: arena.copy_in(slot, source, nbytes),
                     lambda: client.slot_view(slot, nbytes)):
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
    (dict(kind="shm", slot_bytes=1000, slot_count=1, shm_path="/dev/shm/x"), "multiple of 4096"),
    (dict(kind="shm", slot_bytes=SLOT, slot_count=0, shm_path="/dev/shm/x"), "slot_count"),
    (dict(kind="shm", slot_bytes=SLOT, slot_count=1), "shm_path"),
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
    assert isinstance(arena, CpuArena) and arena.descriptor().kind == "shm"
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


def test_arena_files_of_dead_daemons_are_removed_at_start(tmp_path):
    import subprocess

    from storaged.device.arena import ARENA_PREFIX, CpuArena

    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{ARENA_PREFIX}{dead.pid}-0123456789abcdef"
    alive = tmp_path / f"{ARENA_PREFIX}{os.getpid()}-fedcba9876543210"
    unrelated = tmp_path / "other-file"
    for path in (stale, alive, unrelated):
        path.write_bytes(b"x")
    arena = CpuArena(2, 4096, directory=str(tmp_path))
    try:
        assert not stale.exists()
        assert alive.exists() and unrelated.exists()
    finally:
        arena.close()
