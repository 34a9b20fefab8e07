"""storaged as the benchmarks drive it: the daemon as a subprocess, and the timed client loops
(miss-path throughput, Acquire round trip on hits), plus the pinned host-to-device copy rate."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import BenchError, PackGeometry, percentile, stop_process

REPO = Path(__file__).resolve().parents[1]
HIT_WARMUP_ACQUIRES = 50  # untimed: the stream and the code paths warm up first


class StoragedProcess:
    """`python -m storaged` serving one bundle as `model`; output to `log_path`; `client` connected.

    Raises BenchError when it exits, is not SERVING within `start_seconds`, or lacks O_DIRECT or
    checksum verification; stop() raises it when the daemon does not exit 0 on SIGTERM.
    """

    def __init__(self, bundle: Path, *, model: str, device: str, vram_bytes: int, io_parallelism: int,
                 staging_buffers: int, log_path: Path, host_bytes: int = 0, start_seconds: float = 180.0,
                 extra_args: tuple[str, ...] = ()):
        from storaged.client import StorageClient, Unavailable

        self.socket_dir = Path(tempfile.mkdtemp(prefix="spb-", dir="/tmp"))  # short: sun_path limit
        self.log_path = log_path
        socket = self.socket_dir / "s.sock"
        command = [sys.executable, "-m", "storaged", "--model", f"{model}={bundle}", "--socket", str(socket),
                   "--device", device, "--vram-cache-bytes", str(vram_bytes), "--host-cache-bytes", str(host_bytes),
                   "--io-parallelism", str(io_parallelism), "--staging-buffers", str(staging_buffers),
                   "--direct-io", "--verify-checksums", "--metrics-address", "off", *extra_args]
        env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, cwd=REPO, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.client = StorageClient(str(socket))
        try:
            deadline = time.monotonic() + start_seconds
            while True:
                self.check_alive()
                try:
                    self.client.wait_until_serving(timeout=1.0)
                    break
                except Unavailable:
                    if time.monotonic() > deadline:
                        raise BenchError(f"storaged not SERVING after {start_seconds:.0f} s; "
                                         f"log {log_path}:\n{self.log_tail()}") from None
            info = self.client.info()
            if not {"DIRECT_IO", "CHECKSUM_VERIFY"} <= info.capabilities:
                raise BenchError(f"storaged lacks DIRECT_IO or CHECKSUM_VERIFY: {sorted(info.capabilities)}")
        except BaseException:
            self.stop(check=False)
            raise
        self.slot_count = info.slot_count

    def log_tail(self, lines: int = 40) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise BenchError(f"storaged exited with status {self.process.returncode}; "
                             f"log {self.log_path}:\n{self.log_tail()}")

    def stop(self, *, check: bool = True) -> None:
        """SIGTERM and wait; with check, a daemon that does not exit 0 raises BenchError."""
        self.client.close()
        stop_process(self.process)
        self._log.close()
        shutil.rmtree(self.socket_dir, ignore_errors=True)
        if check and self.process.returncode != 0:
            raise BenchError(f"storaged ended with status {self.process.returncode}; "
                             f"log {self.log_path}:\n{self.log_tail()}")


def synchronize(device: str) -> None:
    """Wait for the copies the client's streams were told to wait on (nothing to do on CPU)."""
    if device != "cpu":
        import torch
        torch.cuda.synchronize()


def miss_schedule(geometry: PackGeometry, top_k: int, seed: int):
    """Endless (layer, top_k distinct experts), cycling through one random order of all objects:
    an expert comes back only after every other one was acquired, so with an arena far smaller
    than the pack (least recently used evicted first) every acquire misses."""
    rng, groups = random.Random(seed), []
    for layer in range(geometry.layers):
        experts = rng.sample(range(geometry.experts), geometry.experts)
        groups += [(layer, experts[i:i + top_k]) for i in range(0, geometry.experts - top_k + 1, top_k)]
    rng.shuffle(groups)
    while True:
        yield from groups


def miss_run(daemon: StoragedProcess, model: str, geometry: PackGeometry, *, sessions: int, top_k: int,
             seconds: float, device: str) -> dict:
    """`sessions` client threads, one session each, acquire and release groups of the shared miss
    schedule for `seconds`; bytes are the padded sizes of the experts acquired."""
    schedule, schedule_lock = miss_schedule(geometry, top_k, seed=sessions), threading.Lock()
    handles = [daemon.client.attach(model) for _ in range(sessions)]  # arena mapped before the clock
    counts = [0] * sessions  # acquires per session
    # Untimed first: every arena slot gets written once (first-touch page faults, the daemon's
    # threads and code paths warm up) before the clock starts.
    warmup = -(-daemon.slot_count // (top_k * sessions)) + 1
    ready, go = threading.Barrier(sessions + 1), threading.Barrier(sessions + 1)
    errors: list[BaseException] = []

    def acquire_next(n: int) -> None:
        with schedule_lock:
            layer, experts = next(schedule)
        handles[n].acquire(layer, experts)
        handles[n].release(layer)  # one acquire's pins at a time: everything else stays evictable

    def loop(n: int) -> None:
        try:
            for _ in range(warmup):
                acquire_next(n)
            ready.wait()
            go.wait()
            while time.perf_counter() < deadline:
                acquire_next(n)
                counts[n] += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised on the main thread
            errors.append(exc)
            for barrier in (ready, go):
                barrier.abort()

    threads = [threading.Thread(target=loop, args=(n,), name=f"miss-session-{n}") for n in range(sessions)]
    for thread in threads:
        thread.start()
    try:
        ready.wait()
        synchronize(device)
        before = daemon.client.stats()
        began = time.perf_counter()
        deadline = began + seconds
        go.wait()
    except threading.BrokenBarrierError:
        pass  # a session failed during warm-up: reported below
    for thread in threads:
        thread.join()
    synchronize(device)
    elapsed = time.perf_counter() - began if not errors else 0.0
    after = daemon.client.stats()
    for handle in handles:
        handle.close()
    daemon.check_alive()
    if errors:  # the first failure; the others usually repeat it
        raise BenchError(f"miss run with {sessions} session(s) failed: {errors[0]!r}") from errors[0]
    if after.io_errors or after.checksum_failures:
        raise BenchError(f"storaged reported {after.io_errors} I/O errors and {after.checksum_failures} "
                         f"checksum failures; log {daemon.log_path}")
    acquired = sum(counts) * top_k * geometry.padded_object_bytes
    read = after.bytes_read - before.bytes_read
    hits = after.tiers["vram"].hits - before.tiers["vram"].hits
    misses = after.tiers["vram"].misses - before.tiers["vram"].misses
    return {"sessions": sessions, "acquires": sum(counts), "seconds": elapsed, "acquired_bytes": acquired,
            "daemon_read_bytes": read, "gbps": acquired / elapsed / 1e9, "daemon_read_gbps": read / elapsed / 1e9,
            "vram_hits": hits, "vram_misses": misses, "miss_ratio": misses / max(1, hits + misses),
            "read_vs_acquired": read / acquired if acquired else 0.0,
            "daemon_read_latency_mean_us": after.read_latency_mean_us}


def hit_run(daemon: StoragedProcess, model: str, geometry: PackGeometry, *, acquires: int, top_k: int,
            device: str, layer: int = 0) -> dict:
    """Make all of `layer` resident, then time `acquires` Acquires of top_k of its experts."""
    experts, rng = list(range(geometry.experts)), random.Random(1)
    with daemon.client.attach(model) as session:
        for i in range(0, len(experts), top_k):  # warm the whole layer, pins released
            session.acquire(layer, experts[i:i + top_k])
            session.release(layer)
        synchronize(device)
        for _ in range(HIT_WARMUP_ACQUIRES):
            session.acquire(layer, rng.sample(experts, top_k))
        before = daemon.client.stats()
        samples = []
        for _ in range(acquires):
            chosen = rng.sample(experts, top_k)
            started = time.perf_counter_ns()
            session.acquire(layer, chosen)
            samples.append((time.perf_counter_ns() - started) / 1000)  # µs
        after = daemon.client.stats()
    misses = after.tiers["vram"].misses - before.tiers["vram"].misses
    if misses:
        raise BenchError(f"{misses} misses during the hit run: the arena of {daemon.slot_count} slots did "
                         f"not keep layer {layer}'s {geometry.experts} experts resident")
    samples.sort()
    return {"acquires": len(samples), "top_k": top_k, "p50_us": percentile(samples, 50),
            "p99_us": percentile(samples, 99), "mean_us": sum(samples) / len(samples), "max_us": samples[-1],
            "vram_hits": after.tiers["vram"].hits - before.tiers["vram"].hits}


def pinned_h2d_gbps(copies: int = 20, nbytes: int = 64 << 20) -> float:
    """Host-to-device rate of `nbytes` copies from pinned memory (after three warm-up copies)."""
    import torch

    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(copies):
        target.copy_(source, non_blocking=True)
    torch.cuda.synchronize()
    return copies * nbytes / (time.perf_counter() - started) / 1e9
