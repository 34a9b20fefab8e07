"""Helpers for storaged tests: small real bundles, configs, and a real daemon subprocess.

Imported by the tests as `storaged_testkit` (pytest puts this directory on sys.path), like
tests/inference/dequant_cases.py; the fixtures built on them live in conftest.py.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from packformat import ElementType, PackWriter, Role

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable

# Test bundle geometry: non-contiguous MoE layers (a dense layer 0 and a gap at 3), and per-role
# F16 / Q8_0 bytes of random content (storaged never interprets them, it moves them).
TEST_LAYERS = (1, 2, 4)
TEST_EXPERTS = 8
HIDDEN, INTERMEDIATE = 64, 32
TEST_ROLES = (  # (role, element type, shape)
    (Role.GATE, ElementType.Q8_0, (INTERMEDIATE, HIDDEN)),  # 32 rows x 2 blocks x 34 B = 2176 B
    (Role.UP, ElementType.Q8_0, (INTERMEDIATE, HIDDEN)),
    (Role.DOWN, ElementType.F16, (HIDDEN, INTERMEDIATE)),  # 64 x 32 x 2 B = 4096 B
)


def role_nbytes(etype: ElementType, shape: tuple[int, ...]) -> int:
    from packformat.constants import tensor_nbytes
    return tensor_nbytes(etype, shape)


def write_bundle(directory: Path, *, layers=TEST_LAYERS, experts=TEST_EXPERTS, seed: int = 0,
                 model_type: str = "qwen3_moe", top_k: int | None = None) -> dict[tuple[int, int], bytes]:
    """Write a complete bundle; returns {(layer, expert): object payload bytes}."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = PackWriter(directory / "experts.pack", layers, experts, len(TEST_ROLES))
    payloads: dict[tuple[int, int], bytes] = {}
    for layer in layers:
        for expert in range(experts):
            roles = [(role, etype, shape, rng.bytes(role_nbytes(etype, shape)))
                     for role, etype, shape in TEST_ROLES]
            writer.add_object(layer, expert, roles)
    header = writer.close()
    from packformat import PackReader
    with PackReader(directory / "experts.pack") as reader:
        for entry in reader:
            payloads[(entry.layer, entry.expert)] = reader.read_object(entry.layer, entry.expert)
    config = {"model_type": model_type, "num_experts": experts, "hidden_size": HIDDEN,
              "moe_intermediate_size": INTERMEDIATE, "num_hidden_layers": max(layers) + 1}
    config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
    (directory / "config.json").write_bytes(config_bytes)
    (directory / "dense.safetensors").write_bytes(b"\0" * 64)  # storaged never reads it
    manifest = {
        "format": "expertpack-bundle", "version": 1, "model_type": model_type,
        "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
        "pack": {"file": "experts.pack", "size": header.file_size, "index_crc32": header.index_crc32,
                 "object_stride": header.object_stride},
        "dense": {"file": "dense.safetensors", "size": 64, "tensors": 0},
        "experts": {"moe_layers": list(layers), "num_experts": experts,
                    **({"top_k": top_k} if top_k is not None else {})},
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return payloads


def corrupt_object(bundle: Path, layer: int, expert: int) -> None:
    """Flip one payload byte of an object (its index checksum no longer matches)."""
    from packformat import PackReader
    with PackReader(bundle / "experts.pack") as reader:
        offset = reader.entry(layer, expert).offset
    with open(bundle / "experts.pack", "r+b") as f:
        f.seek(offset + 7)
        byte = f.read(1)
        f.seek(offset + 7)
        f.write(bytes([byte[0] ^ 0xFF]))


def disk_tmp_root() -> Path:
    """A directory on a real disk (O_DIRECT capable), unlike tmpfs /tmp on many machines."""
    for candidate in (Path("/var/tmp"), REPO / ".pytest_cache"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            return candidate
        except OSError:
            continue
    raise RuntimeError("no writable disk directory for O_DIRECT tests")


@dataclass
class BuiltBundle:
    path: Path
    payloads: dict[tuple[int, int], bytes]


def write_config(path: Path, **fields) -> Path:
    """A storaged TOML file from keyword fields (models is a {name: dir} dict)."""
    lines = []
    models = fields.pop("models", {})
    for key, value in fields.items():
        lines.append(f"{key} = {_toml(value)}")
    lines.append("[models]")
    for name, directory in models.items():
        lines.append(f"{name} = {_toml(str(directory))}")
    path.write_text("\n".join(lines) + "\n")
    return path


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return json.dumps(str(value))


def daemon_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.update(extra)
    return env


class Daemon:
    """A storaged subprocess on a temp socket; stderr is collected for assertions. `prefix`: a
    command the daemon runs under (e.g. setpriv, to run it as another user)."""

    def __init__(self, config: Path, socket: Path, *extra_args: str, env: dict | None = None,
                 prefix: tuple[str, ...] = ()):
        self.socket = socket
        self.process = subprocess.Popen(
            [*prefix, PYTHON, "-m", "storaged", "--config", str(config), *extra_args],
            cwd=REPO, env=env or daemon_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def wait_serving(self, timeout: float = 30.0) -> None:
        from grpc_health.v1 import health_pb2
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"storaged exited with {self.process.returncode}: {self.stderr()}")
            if self.socket.exists():
                try:
                    if self.health() == health_pb2.HealthCheckResponse.SERVING:
                        return
                except Exception:  # noqa: BLE001 - not listening yet
                    pass
            time.sleep(0.05)
        raise TimeoutError(f"storaged not SERVING after {timeout}s")

    def health(self) -> int:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        with grpc.insecure_channel(f"unix:{self.socket}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2).status

    def stderr(self) -> str:
        if self.process.poll() is None:
            return "(still running)"
        return self.process.stderr.read() if self.process.stderr else ""

    def stop(self, timeout: float = 20.0) -> int:
        if self.process.poll() is None:
            self.process.terminate()
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise


def run_daemon_expecting_failure(config: Path, *extra_args: str, timeout: float = 30.0
                                 ) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, "-m", "storaged", "--config", str(config), *extra_args],
                          cwd=REPO, env=daemon_env(), capture_output=True, text=True, timeout=timeout)


def start_daemon(directory: Path, models: dict[str, Path], *extra_args: str, env: dict | None = None,
                 socket_path: Path | None = None, prefix: tuple[str, ...] = (), **fields) -> Daemon:
    """Write a config under `directory` and start a daemon (socket in `directory` unless given);
    waits until it reports SERVING."""
    socket = socket_path or directory / "storaged.sock"
    fields.setdefault("metrics_address", "off")
    fields.setdefault("vram_cache_bytes", 10 * SLOT_BYTES)
    config = write_config(directory / "storaged.toml", models=models, socket=str(socket), **fields)
    daemon = Daemon(config, socket, *extra_args, env=env, prefix=prefix)
    try:
        daemon.wait_serving()
    except BaseException:
        daemon.stop()
        raise
    return daemon


# Slot size of the test bundle: its largest object (3 roles, 8704 bytes) padded to 4096.
SLOT_BYTES = 12288
