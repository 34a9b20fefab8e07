"""Fixtures for storaged's server, client and config tests (helpers: storaged_testkit.py)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from storaged_testkit import BuiltBundle, disk_tmp_root, write_bundle


@pytest.fixture(scope="module")
def disk_dir(tmp_path_factory) -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="storaged-test-", dir=disk_tmp_root()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(disk_dir) -> BuiltBundle:
    path = disk_dir / "bundle"
    return BuiltBundle(path, write_bundle(path))
