"""Fixtures for storaged's server, client and config tests (helpers: storaged_testkit.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from storaged.config import StoragedConfig
from storaged.server.models import open_models
from storaged.server.runtime import build_runtime
from storaged.server.sessions import SessionRegistry
from storaged.server.stats import MetricsSync
from storaged_testkit import SLOT_BYTES, BuiltBundle, disk_tmp_root, write_bundle


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="storaged-test-", dir=disk_tmp_root()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def short_tmp_path() -> Iterator[Path]:
    """A per-test directory with a short path: a Unix socket path holds at most 107 bytes, and
    storaged's gate sockets lie beside the socket (pytest's tmp_path is long, under xdist longer)."""
    path = Path(tempfile.mkdtemp(prefix="sd-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(disk_dir) -> BuiltBundle:
    path = disk_dir / "bundle"
    return BuiltBundle(path, write_bundle(path))


@pytest.fixture
def runtime_of(tmp_path):
    """build(bundle_path, **config fields) -> (runtime, sessions, served model, metrics sync): a
    daemon's runtime in this process, without its servers; everything built is closed after."""
    opened = []

    def build(bundle_path, **fields):
        config = StoragedConfig(models={"tiny": bundle_path}, socket=tmp_path / "unused.sock",
                                metrics_address="off", **{"vram_cache_bytes": 10 * SLOT_BYTES, **fields})
        models = open_models(config.models)
        runtime = build_runtime(config, models)
        opened.append((runtime, models))
        sessions = SessionRegistry()
        return runtime, sessions, models["tiny"], MetricsSync(runtime.engine, sessions)

    yield build
    for runtime, models in opened:
        runtime.close()
        for model in models.values():
            model.close()
