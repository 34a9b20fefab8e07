"""Fixtures for the ops tests, and their helper module on the path.

The tests import their helpers as `ops_testkit` (like storaged_testkit in tests/storaged); this
directory is not on pyproject's pythonpath, so it is added here, before collection. The storaged
fixtures (a small bundle on a real disk) are built like tests/storaged's.
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


@pytest.fixture(scope="module")
def disk_dir():
    path = Path(tempfile.mkdtemp(prefix="ops-test-", dir=disk_tmp_root()))
    path.chmod(0o755)  # other users' clients must reach sockets made in here
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def bundle(disk_dir) -> BuiltBundle:
    path = disk_dir / "bundle"
    return BuiltBundle(path, write_bundle(path))
