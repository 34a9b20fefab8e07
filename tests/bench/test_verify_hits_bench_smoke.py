"""bench/verify_hits_bench.py end to end on the CPU with tiny sizes: two real daemons, every timed
acquire all hits, every hit of the verifying daemon verified, the ratio reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DISK_DIR = Path("/var/tmp")


@pytest.mark.slow  # two daemons measured in a subprocess: ~15 s
def test_bench_measures_both_daemons_on_cpu(tmp_path):
    if not DISK_DIR.is_dir() or not os.access(DISK_DIR, os.W_OK):
        pytest.skip(f"{DISK_DIR} is not a writable directory")
    out = tmp_path / "verify.json"
    scratch = Path(tempfile.mkdtemp(prefix="verify-hits-bench-test-", dir=DISK_DIR))
    try:
        result = subprocess.run(
            [sys.executable, str(REPO / "bench" / "verify_hits_bench.py"), "--device", "cpu", "--object-mib", "0.1",
             "--experts", "8", "--top-k", "2", "--acquires", "20", "--block", "5", "--dir", str(scratch),
             "--json", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=300)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if "O_DIRECT read refused" in result.stderr:
        pytest.skip(result.stderr.strip())
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(out.read_text())
    assert figures["off"]["acquires"] == figures["every hit"]["acquires"] == 20
    assert figures["off"]["hits"] == figures["every hit"]["hits"] == 40
    assert (figures["off"]["hits_verified"], figures["every hit"]["hits_verified"]) == (0, 40)
    assert figures["p50_ratio"] > 0 and "ratio" in result.stdout
