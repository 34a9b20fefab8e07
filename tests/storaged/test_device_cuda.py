"""CUDA arena, pinned staging and the host tier on a real GPU; CUDA IPC into a second process."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from storaged.device import CudaArena, HostTier, create_arena
from storaged.io import HostMemory, StagingPool

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

REPO = Path(__file__).resolve().parents[2]
SLOT = 8 << 20  # 8 MiB: a copy long enough to still be in flight when the client looks
SLEEP_CYCLES = 2_000_000_000  # ~1 s of GPU clock: holds the copy stream busy

# Maps the arena from a descriptor, then for each stdin line [slot, nbytes, event or null]
# waits on the event (if any) on its current stream and prints the slot bytes' sha256.
CLIENT = """
import hashlib, json, sys, torch
from storaged.device.client_arena import map_arena
from storaged.device.descriptor import ArenaDescriptor
def decode(value):
    if isinstance(value, dict):
        return bytes.fromhex(value["hex"])
    return [decode(v) for v in value] if isinstance(value, list) else value
fields = {k: decode(v) for k, v in json.loads(sys.stdin.readline()).items()}
arena = map_arena(ArenaDescriptor(**fields))
print(json.dumps([str(arena.device), "grpc" in sys.modules]), flush=True)
for line in sys.stdin:
    slot, nbytes, event = json.loads(line)
    if event is not None:
        arena.wait_event(event, torch.cuda.current_stream())
    data = arena.slot_view(slot, nbytes).to("cpu")  # ordered after the wait on this stream
    print(json.dumps(hashlib.sha256(data.numpy().tobytes()).hexdigest()), flush=True)
arena.close()  # frees the mapping now, which returns the server's IPC refcount
"""


def encode_descriptor(descriptor) -> str:
    def encode(value):
        if isinstance(value, bytes):
            return {"hex": value.hex()}
        return [encode(v) for v in value] if isinstance(value, (list, tuple)) else value
    return json.dumps({k: encode(v) for k, v in asdict(descriptor).items()}) + "\n"


def _sha(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.cpu().numpy().tobytes()).hexdigest()


def _fill(buffer, seed: int) -> None:
    buffer.tensor.copy_(torch.randint(0, 256, (buffer.nbytes,), dtype=torch.uint8,
                                      generator=torch.Generator().manual_seed(seed)))


def test_pinned_staging_copies_in_and_out_asynchronously():
    pool = StagingPool(2, SLOT, pin=True)
    assert pool.pinned
    with CudaArena(3, SLOT, event_count=4) as arena:
        source, back = pool.try_acquire(), pool.try_acquire()
        assert source.tensor.is_pinned()
        _fill(source, 1)
        handle = arena.copy_in(2, source, SLOT - 4096)
        assert handle.event_index == 0
        asyncio.run(handle.wait())
        assert handle.done and _sha(arena.slot_tensor(2, SLOT - 4096)) == _sha(source.tensor[:SLOT - 4096])
        out = arena.copy_out(2, back, 4096)
        assert out.event_index is None  # copies out are the server's own: no client waits on them
        out.synchronize()
        assert torch.equal(back.tensor[:4096], source.tensor[:4096])
        indices = [arena.copy_in(0, source, 4096).event_index for _ in range(4)]
        assert indices == [1, 2, 3, 0]  # the event pool is reused round-robin
        arena.synchronize()
    pool.close()


def test_copies_into_and_out_of_one_slot_run_in_issue_order_across_the_two_streams():
    """A demotion (copy out) and the load that overwrites its slot (copy in) run on different
    streams; each is held back behind a busy stream so that, unordered, the other would win."""
    memory = HostMemory(4, SLOT, pin=True)
    old, new, back, again = memory.buffers
    _fill(old, 6)
    _fill(new, 7)
    with CudaArena(2, SLOT) as arena:
        arena.copy_in(0, old, SLOT).synchronize()
        with torch.cuda.stream(arena.out_stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the demotion starts late
        demotion = arena.copy_out(0, back, SLOT)
        load = arena.copy_in(0, new, SLOT)  # its stream is idle: unordered, it would land first
        load.synchronize()
        demotion.synchronize()
        assert _sha(back.tensor) == _sha(old.tensor)  # the demotion read the old bytes
        assert _sha(arena.slot_tensor(0)) == _sha(new.tensor)

        with torch.cuda.stream(arena.copy_stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # now the load starts late
        load = arena.copy_in(1, old, SLOT)
        read_back = arena.copy_out(1, again, SLOT)  # must see the load's bytes, not the slot's old ones
        read_back.synchronize()
        assert load.done
        assert _sha(again.tensor) == _sha(old.tensor)

        # Sources other than aligned buffers: a uint8 tensor and a writable memoryview.
        tensor = torch.arange(4096, dtype=torch.int32).to(torch.uint8).pin_memory()
        arena.copy_in(1, tensor, 4096).synchronize()
        view = memoryview(bytearray(4096))
        arena.copy_out(1, view, 4096).synchronize()
        assert bytes(view) == tensor.numpy().tobytes()
    memory.close()


def test_host_tier_pins_and_copies_to_the_arena():
    with HostTier(2, SLOT, pin=True) as tier, create_arena("cuda", 2, SLOT) as arena:
        assert tier.pinned and tier.slot(1).tensor.is_pinned()
        _fill(tier.slot(1), 2)
        tier.copy_to_arena(1, arena, 0, SLOT).synchronize()
        assert _sha(arena.slot_tensor(0)) == _sha(tier.slot_tensor(1))


def _start_client(descriptor) -> subprocess.Popen:
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    client = subprocess.Popen([sys.executable, "-c", CLIENT], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": path})
    client.stdin.write(encode_descriptor(descriptor))
    client.stdin.flush()
    return client


def _ask(client: subprocess.Popen, slot: int, nbytes: int, event: int | None) -> str:
    client.stdin.write(json.dumps([slot, nbytes, event]) + "\n")
    client.stdin.flush()
    return json.loads(client.stdout.readline())


def test_second_process_maps_the_arena_and_waits_on_copy_events():
    staging = HostMemory(2, SLOT, pin=True)
    _fill(staging.buffers[0], 3)
    _fill(staging.buffers[1], 4)
    with CudaArena(2, SLOT) as arena:
        arena.copy_in(0, staging.buffers[0], SLOT).synchronize()
        # One export per client session, as the server does on every Attach.
        clients = [_start_client(arena.descriptor()) for _ in range(2)]
        client = clients[0]
        try:
            for each in clients:
                assert json.loads(each.stdout.readline()) == [str(arena.device), False]
                assert _ask(each, 0, SLOT, None) == _sha(staging.buffers[0].tensor)

            # Hold the copy stream busy, then copy: only a client that waits on the event sees it.
            stale = _sha(arena.slot_tensor(1))
            with torch.cuda.stream(arena.copy_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            unwaited = arena.copy_in(1, staging.buffers[1], SLOT)
            assert _ask(client, 1, SLOT, None) == stale  # the negative control: no wait, old bytes
            unwaited.synchronize()

            _fill(staging.buffers[1], 5)
            with torch.cuda.stream(arena.copy_stream):
                torch.cuda._sleep(SLEEP_CYCLES)
            handle = arena.copy_in(1, staging.buffers[1], SLOT)
            assert not handle.done
            assert _ask(client, 1, SLOT, handle.event_index) == _sha(staging.buffers[1].tensor)
        finally:
            for each in clients:
                each.stdin.close()
                assert each.wait(timeout=120) == 0, each.stderr.read()
    staging.close()
