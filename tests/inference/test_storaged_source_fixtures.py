"""Real storaged daemons and real bundles for the StoragedExpertSource tests.

Imported by test_storaged_source*.py (pytest puts this directory on sys.path); the tests at the
bottom check the helpers themselves. Daemons run on the CPU (shared-memory arena) with buffered
reads, so the tests run on any filesystem; the demo exercises O_DIRECT.
"""

from __future__ import annotations

import glob
import threading
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from packtools.build import build_bundle
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf
from packtools.synth.hf import synth_hf
from packtools.tokenizer_synth import build_tokenizer
from storaged.client import StorageClient, StorageError

warnings.filterwarnings("ignore", message=".*fla.*|.*causal_conv1d.*|.*fast path.*")
REPO = Path(__file__).resolve().parents[2]
NEW_TOKENS = 32
PROMPT = [[3, 17, 42, 99, 7, 250, 11]]  # token ids below every tiny vocabulary
LONG_PROMPT = [list(range(5, 69))]  # 64 tokens: routes to every expert of every layer


@dataclass
class ModelCase:
    name: str  # the daemon's model name
    bundle: Path
    source: Path  # the checkpoint the bundle was built from (.gguf file or HF directory)

    def reference(self) -> torch.nn.Module:
        """The plain transformers model the bundle must equal, fully resident, float32."""
        if self.source.suffix == ".gguf":
            gguf = GGUFSource(self.source)
            try:
                return load_reference_model(gguf)
            finally:
                gguf.close()
        return AutoModelForCausalLM.from_pretrained(self.source, dtype=torch.float32).eval()


_build_lock = threading.Lock()


def build_case(root: Path, name: str, arch: str, fmt: str, *, seed: int = 0) -> ModelCase:
    """A bundle built by packtools from a synthetic HF checkpoint (float32) or GGUF file (Q4_K);
    built once under `root` (a session-wide directory) and reused by every test module."""
    with _build_lock:
        root.mkdir(parents=True, exist_ok=True)
        source = root / (f"{name}.gguf" if fmt == "gguf" else f"{name}-hf")
        if (root / name / "manifest.json").exists():
            return ModelCase(name, root / name, source)
        if fmt == "gguf":
            model = tiny_random_model(arch, seed=seed, hidden_size=256, moe_intermediate_size=256)  # K-quant rows
            (source,) = synth_gguf(arch, source, model=model, expert_type="Q4_K",
                                   tokenizer=build_tokenizer(model.config.vocab_size))
        else:
            synth_hf(arch, source, seed=seed, dtype="float32")
        build_bundle(source, root / name, progress=False)
        return ModelCase(name, root / name, source)


def greedy(model: torch.nn.Module, prompt=PROMPT, new_tokens: int = NEW_TOKENS) -> list[int]:
    """The generated ids (prompt excluded); min_new_tokens keeps an early EOS from shortening it."""
    with torch.no_grad():
        out = model.generate(torch.tensor(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False)
    return out[0, len(prompt[0]):].tolist()


class StoragedDaemon:
    """`python -m storaged` on a socket of its own (CPU arena by default), buffered reads; output kept in a file.

    Its directory (socket, log) is under /tmp, so the socket path stays well below the 107 bytes of
    sun_path; stop() removes it. kill() then start() restarts it on the same socket.
    """

    def __init__(self, models: dict[str, Path], *, vram_cache_bytes: int | str = "64MiB", device: str = "cpu",
                 host_cache_bytes: int | str = 0):
        self.directory = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
        self.models = models
        self.vram_cache_bytes = vram_cache_bytes
        self.host_cache_bytes = host_cache_bytes
        self.device = device
        self.socket = self.directory / "sd.sock"
        self.process: subprocess.Popen | None = None
        self.start()

    def start(self) -> None:
        command = [sys.executable, "-m", "storaged", "--socket", str(self.socket), "--device", self.device,
                   "--vram-cache-bytes", str(self.vram_cache_bytes), "--host-cache-bytes", str(self.host_cache_bytes),
                   "--metrics-address", "off", "--no-direct-io",
                   *(arg for name, path in self.models.items() for arg in ("--model", f"{name}={path}"))]
        self.log = open(self.directory / "storaged.log", "a")  # noqa: SIM115 - closed in stop()
        self.process = subprocess.Popen(command, cwd=REPO, stdout=self.log, stderr=subprocess.STDOUT)
        with StorageClient(str(self.socket)) as client:
            try:
                client.wait_until_serving(60)
            except StorageError:
                self.stop()
                raise RuntimeError(f"storaged did not start:\n{self.output()}") from None

    def __enter__(self) -> StoragedDaemon:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def info(self):
        with StorageClient(str(self.socket)) as client:
            return client.info()

    def output(self) -> str:
        log = self.directory / "storaged.log"
        return log.read_text() if log.exists() else "(log removed by stop())"

    def stats(self):
        with StorageClient(str(self.socket)) as client:
            return client.stats()

    def kill(self) -> None:
        """SIGKILL, as a crash would (the arena is a memfd: nothing is left behind to sweep)."""
        self.process.send_signal(signal.SIGKILL)
        self.process.wait(30)
        self.log.close()

    def terminate(self) -> None:
        """SIGTERM (a clean shutdown: the daemon removes its socket and arena); start() may follow."""
        self.process.terminate()
        self.process.wait(60)
        self.log.close()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()
        self.log.close()
        shutil.rmtree(self.directory, ignore_errors=True)


@pytest.fixture(scope="module")
def cases_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "storaged-source-cases"


@pytest.fixture(scope="module")
def qwen_case(cases_dir) -> ModelCase:
    return build_case(cases_dir, "qwen-q4k", "qwen3_moe", "gguf")


# --- the helpers' own tests -------------------------------------------------------------------


def test_daemon_serves_the_bundle_and_leaves_nothing_behind(qwen_case):
    daemon = StoragedDaemon({"m": qwen_case.bundle})
    try:
        with StorageClient(str(daemon.socket)) as client:
            assert client.info().models["m"].bundle_path == str(qwen_case.bundle)
    finally:
        daemon.stop()
    assert daemon.process.returncode == 0, daemon.output()
    assert not glob.glob(f"/dev/shm/expertpack-arena-{daemon.process.pid}-*")  # no path ever names the arena
    assert not daemon.directory.exists()
