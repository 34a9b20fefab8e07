"""Helpers for the fault suite: client processes to kill, daemon figures, recorded results.

Client processes are forked from a multiprocessing forkserver that imported the storaged client
(and torch) once, so a hundred real client processes start in seconds rather than minutes; each
one is a separate process with its own gRPC channel, data plane connection and arena mapping, and
SIGKILL ends it like any crash. The functions they run live here (a child imports them by module
name: pytest's importlib mode makes the test modules themselves unimportable).

Imported as `reliability_kit` (tests/reliability/conftest.py puts this directory on sys.path).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import socket
import time
import urllib.request
import zlib
from collections.abc import Callable
from pathlib import Path

# ---- client processes ----------------------------------------------------------------------------

_CONTEXT = None


def client_processes():
    """The multiprocessing context client processes are started from (a shared forkserver)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = multiprocessing.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["reliability_kit", "storaged.client"])
    return _CONTEXT


# What a killable client is doing, written by it to its slot of a shared array before each step.
STARTING, ATTACHED, OPENING, ACQUIRING, HOLDING, READING, CLOSING, MISMATCH = range(8)
PHASE_NAMES = {STARTING: "starting", ATTACHED: "between Attach and the stream", OPENING: "opening the stream",
               ACQUIRING: "mid-Acquire", HOLDING: "holding pins", READING: "mid-read",
               CLOSING: "closing", MISMATCH: "saw wrong bytes"}


def killable_client(socket_path: str, model: str, crcs: dict, phases, index: int, seed: int) -> None:
    """Attach, acquire, hold and read pinned experts in a loop until killed; every read is checked
    against the pack's crc32 (a wrong byte parks the client in MISMATCH for the parent to see).

    The Attach RPC is made on its own, before the session's stream (the data plane connection)
    is opened, so a kill can land between the two, where a session exists that no connection
    holds."""
    import grpc

    from storaged._proto.expertpack.storage.v1 import storage_pb2 as pb
    from storaged._proto.expertpack.storage.v1 import storage_pb2_grpc as pb_grpc
    from storaged.client import Session, StorageClient

    rng = random.Random(seed)
    by_layer: dict[int, list[int]] = {}
    for layer, expert in crcs:
        by_layer.setdefault(layer, []).append(expert)
    client = StorageClient(socket_path)
    control = pb_grpc.ExpertStorageStub(grpc.insecure_channel(f"unix:{socket_path}"))
    while True:
        phases[index] = STARTING
        reply = control.Attach(pb.AttachRequest(model=model), timeout=60)
        phases[index] = ATTACHED
        time.sleep(rng.uniform(0.05, 0.3))
        phases[index] = OPENING
        session = Session(client, model, reply)
        for _ in range(rng.randint(1, 3)):
            layer = rng.choice(sorted(by_layer))
            experts = rng.sample(by_layer[layer], rng.randint(1, min(4, len(by_layer[layer]))))
            phases[index] = ACQUIRING
            slots = session.acquire(layer, experts)
            phases[index] = HOLDING
            time.sleep(rng.uniform(0.05, 0.3))
            phases[index] = READING
            until = time.monotonic() + rng.uniform(0.05, 0.3)
            while time.monotonic() < until:
                for expert, slot in zip(experts, slots):
                    crc, size = crcs[(layer, expert)]
                    if zlib.crc32(session.slot_bytes(slot, size).cpu().numpy()) != crc:
                        phases[index] = MISMATCH
                        time.sleep(3600)  # stay here: the parent reads the phase before the kill
        phases[index] = CLOSING
        session.close()


def acquire_worker(socket_path: str, model: str, crcs: dict, acquires: int, seed: int, results) -> None:
    """`acquires` Acquires of random experts on one session, each slot's bytes checked against the
    pack's crc32; puts (seed, errors, mismatches, acquires done, first error) on `results`."""
    from storaged.client import StorageClient, StorageError

    rng = random.Random(seed)
    by_layer: dict[int, list[int]] = {}
    for layer, expert in crcs:
        by_layer.setdefault(layer, []).append(expert)
    layers = sorted(by_layer)
    errors = mismatches = done = 0
    first_error = ""
    try:
        with StorageClient(socket_path) as client, client.attach(model) as session:
            for _ in range(acquires):
                layer = rng.choice(layers)
                experts = rng.sample(by_layer[layer], rng.randint(1, 2))
                try:
                    slots = session.acquire(layer, experts, release_other_layers=True)
                except StorageError as exc:
                    errors += 1
                    first_error = first_error or str(exc)
                    continue
                done += 1
                for expert, slot in zip(experts, slots):
                    crc, size = crcs[(layer, expert)]
                    if zlib.crc32(session.slot_bytes(slot, size).cpu().numpy()) != crc:
                        mismatches += 1
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which fails the test with it
        errors += 1
        first_error = first_error or f"{type(exc).__name__}: {exc}"
    results.put((seed, errors, mismatches, done, first_error))


def crcs_of(payloads: dict[tuple[int, int], bytes]) -> dict[tuple[int, int], tuple[int, int]]:
    """(crc32, size) of every object's payload: what a client checks the slot bytes against."""
    return {key: (zlib.crc32(data), len(data)) for key, data in payloads.items()}


# ---- the daemon's figures ------------------------------------------------------------------------

def wait_for(predicate: Callable[[], bool], timeout: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def process_memory(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and RssShmem of a process, in bytes (/proc/<pid>/status)."""
    figures = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
                figures[key] = int(value.split()[0]) * 1024
    return figures


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(address: str) -> dict[str, float]:
    """The daemon's /metrics as {'name{label=value}': value}, names without the common prefix."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as response:
        text = response.read().decode()
    figures = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name.removeprefix("expertpack_storaged_")
            if sample.labels:
                key += "{" + ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items())) + "}"
            figures[key] = sample.value
    return figures


# ---- recorded figures ----------------------------------------------------------------------------

FIGURES_ENV = "EXPERTPACK_RELIABILITY_FIGURES"  # a JSON file the figures are written to (the report)


class Figures:
    """What the figure-producing cases measured, by case; written out as JSON when FIGURES_ENV
    names a file (scripts/reliability_report.py renders it as docs/reliability.md's table)."""

    def __init__(self) -> None:
        self.cases: dict[str, dict] = {}

    def record(self, case: str, **values) -> None:
        self.cases.setdefault(case, {}).update(values)

    def write(self) -> None:
        target = os.environ.get(FIGURES_ENV)
        if not target:
            return
        path = Path(target)
        existing = json.loads(path.read_text()) if path.exists() and path.stat().st_size else {}
        for case, values in self.cases.items():
            existing.setdefault(case, {}).update(values)
        path.write_text(json.dumps(existing, indent=2, sort_keys=True) + "\n")


def daemon_device() -> dict[str, str]:
    """The daemons' `device` field: EXPERTPACK_RELIABILITY_DEVICE (e.g. cuda:0, the GPU variant
    that scripts/gpu_checks.sh runs: the same faults against a CUDA arena), else the CPU arena."""
    return {"device": os.environ.get("EXPERTPACK_RELIABILITY_DEVICE") or "cpu"}


def scale(default: int, slow: int, env: str, size: str) -> int:
    """A case's size: `env` when set, else `slow` for the slow variant (size "slow"), else `default`."""
    if os.environ.get(env):
        return int(os.environ[env])
    return slow if size == "slow" else default
