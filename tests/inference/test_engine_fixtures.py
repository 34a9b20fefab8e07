"""Shared by the engine, server and CLI tests: tiny bundles, a loaded engine, a flaky expert source.

Other test modules import from here (pytest puts this directory on sys.path); the tests at the
bottom check the helpers themselves.
"""

from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch

from inference.engine import Engine
from inference.experts import LocalPackSource
from inference.model import load_model
from packtools.build import build_bundle
from packtools.synth.hf import synth_hf
from storaged.client import StatusCode
from storaged.client.errors import Unavailable

warnings.filterwarnings("ignore", message=".*fla.*|.*causal_conv1d.*|.*fast path.*")
_build_lock = threading.Lock()


def tiny_bundle(tmp_path_factory: pytest.TempPathFactory, arch: str = "qwen3_moe") -> Path:
    """A float32 bundle of a tiny random `arch` with the synthetic tokenizer, built once per session."""
    root = tmp_path_factory.getbasetemp() / f"engine-bundle-{arch}"
    bundle = root / "bundle"
    with _build_lock:
        if not (bundle / "manifest.json").exists():
            synth_hf(arch, root / "checkpoint", seed=0, dtype="float32")
            build_bundle(root / "checkpoint", bundle, progress=False)
    return bundle


@pytest.fixture(scope="module")
def qwen_bundle(tmp_path_factory) -> Path:
    return tiny_bundle(tmp_path_factory, "qwen3_moe")


@pytest.fixture(scope="module")
def loaded(qwen_bundle):
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as model:
        yield model


@pytest.fixture(scope="module")
def engine(loaded):
    engine = Engine.from_loaded(loaded)
    yield engine
    engine.close()


def unavailable(message: str = "connect: connection refused") -> Unavailable:
    return Unavailable(StatusCode.UNAVAILABLE, message, rpc="Acquire")


class FlakyDaemonSource:
    """Test double of the storaged daemon: a LocalPackSource behind an "up" switch.

    While down, `acquire` and `reconnect` raise storaged's real Unavailable error, as the storaged
    client does when its daemon is stopped or restarting. `fail_after` lets a given number of
    acquires succeed first, so a request can fail part way through. While `flowing` is cleared,
    `acquire` blocks (a daemon that hangs instead of failing).
    """

    def __init__(self, bundle, device):
        self.inner = LocalPackSource(bundle, device)
        self.up = True
        self.fail_after: int | None = None
        self.broken: Exception | None = None  # raised by acquire: a fault that is not unavailability
        self.acquires = 0
        self.reconnects = 0
        self.wait_seconds = 0.0
        self.flowing = threading.Event()  # cleared: acquire blocks, as against a hung daemon
        self.flowing.set()

    def layout(self, layer: int):
        return self.inner.layout(layer)

    def acquire(self, layer: int, experts: list[int]):
        self.flowing.wait()
        self.acquires += 1
        if self.fail_after is not None and self.acquires > self.fail_after:
            self.up = False
            self.fail_after = None
        if not self.up:
            raise unavailable()
        if self.broken is not None:
            raise self.broken
        self.wait_seconds += 0.001  # a daemon reports its own acquire time; a fixed step is checkable
        return self.inner.acquire(layer, experts)

    def reconnect(self) -> None:
        self.reconnects += 1
        if not self.up:
            raise unavailable("reconnect: connection refused")

    def is_available(self) -> bool:
        return self.up

    def expert_wait_seconds(self) -> float:
        return self.wait_seconds


def test_tiny_bundle_is_built_once_and_loads(tmp_path_factory):
    first = tiny_bundle(tmp_path_factory)
    mtime = (first / "manifest.json").stat().st_mtime_ns
    assert tiny_bundle(tmp_path_factory) == first
    assert (first / "manifest.json").stat().st_mtime_ns == mtime
    with load_model(first, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as model:
        assert model.tokenizer.eos_token_id == 2 and model.tokenizer.chat_template


def test_flaky_source_raises_storaged_unavailable_only_while_down(qwen_bundle):
    with load_model(qwen_bundle, device="cpu", dtype=torch.float32, expert_source=FlakyDaemonSource) as model:
        source = model.expert_source
        assert len(source.acquire(0, [1, 2])) == 2
        source.up = False
        with pytest.raises(Unavailable, match="UNAVAILABLE"):
            source.acquire(0, [1])
        with pytest.raises(Unavailable):
            source.reconnect()
        source.up = True
        source.reconnect()
        source.fail_after = source.acquires + 1
        source.acquire(0, [1])
        with pytest.raises(Unavailable):
            source.acquire(0, [1])
        assert not source.up
