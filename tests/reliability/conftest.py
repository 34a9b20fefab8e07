"""Fixtures for the fault suite (helpers: reliability_kit.py, on the path from here).

Like tests/ops, this directory is not on pyproject's pythonpath; it is added before collection,
and the storaged fixtures (a small bundle on a real, O_DIRECT-capable disk) are built like
tests/storaged's.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

import pytest

from storaged_testkit import BuiltBundle, disk_tmp_root, write_bundle

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)

from reliability_kit import Figures  # noqa: E402 - needs the path above


@pytest.fixture(scope="module")
def disk_dir():
    path = Path(tempfile.mkdtemp(prefix="reliability-", dir=disk_tmp_root()))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(disk_dir) -> BuiltBundle:
    path = disk_dir / "bundle"
    return BuiltBundle(path, write_bundle(path))


@pytest.fixture(scope="session")
def figures():
    recorded = Figures()
    yield recorded
    recorded.write()
