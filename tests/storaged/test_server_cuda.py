"""storaged with a CUDA arena: slots reach another process by CUDA IPC, copies are fenced by
interprocess events. Needs a GPU; skipped elsewhere."""

from __future__ import annotations

import subprocess

import pytest
import torch

from storaged.client import StorageClient
from storaged_testkit import PYTHON, REPO, SLOT_BYTES, daemon_env, start_daemon, write_bundle

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def cuda_daemon(disk_dir):
    payloads = write_bundle(disk_dir / "bundle")
    # 10 VRAM slots for 16 experts: the second round evicts, and the host tier (16) has them all.
    daemon = start_daemon(disk_dir, {"tiny": disk_dir / "bundle"}, device="cuda:0",
                          vram_cache_bytes=10 * SLOT_BYTES, host_cache_bytes=16 * SLOT_BYTES)
    yield daemon, payloads
    assert daemon.stop() == 0, daemon.stderr()


def test_cuda_slots_hold_the_pack_bytes(cuda_daemon):
    daemon, payloads = cuda_daemon
    with StorageClient(str(daemon.socket)) as client, client.attach("tiny") as session:
        assert "CUDA_IPC_ARENA" in client.info().capabilities
        assert session.arena.device.type == "cuda"
        for round_ in range(2):  # misses (pack → host tier → VRAM), then host-tier or VRAM hits
            for layer in (1, 2):
                for experts in ([0, 1, 2, 3], [4, 5, 6, 7]):  # at most 4 pinned per layer
                    slots = session.acquire(layer, experts)  # the current stream waits for copies
                    for expert, slot in zip(experts, slots):
                        got = session.slot_bytes(slot, len(payloads[(layer, expert)])).cpu().numpy().tobytes()
                        assert got == payloads[(layer, expert)], (round_, layer, expert)
        stats = client.stats()
        assert stats.reads == 16 and stats.h2d_bytes > 0
        assert stats.tiers["host"].hits > 0 and stats.tiers["vram"].evictions > 0


_OTHER_PROCESS = """
import sys, torch
from storaged.client import StorageClient
session = StorageClient(sys.argv[1]).attach("tiny")
slots, events = session.acquire_raw(4, [0, 5])
for event in {e for e in events if e >= 0}:
    session.arena.wait_event(event)
print(b"".join(session.slot_bytes(s, int(sys.argv[2])).cpu().numpy().tobytes() for s in slots).hex())
session.close()
"""


def test_a_second_process_maps_the_same_cuda_arena(cuda_daemon):
    daemon, payloads = cuda_daemon
    nbytes = len(payloads[(4, 0)])
    result = subprocess.run([PYTHON, "-c", _OTHER_PROCESS, str(daemon.socket), str(nbytes)], cwd=REPO,
                            env=daemon_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert bytes.fromhex(result.stdout.strip()) == payloads[(4, 0)] + payloads[(4, 5)]
