"""bench/disk_probe.py on this machine's disk at tiny sizes: every pattern is measured and written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_probe_measures_every_pattern(tmp_path):
    out = tmp_path / "probe.json"
    done = subprocess.run([sys.executable, "bench/disk_probe.py", "--pack-gib", "0.03", "--object-mib", "0.25",
                           "--seconds", "0.05", "--depths", "1", "2", "--batches", "2", "3", "--chunks-kib", "0", "64",
                           "--dir", "/var/tmp", "--json", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    results = json.loads(out.read_text())
    assert [row["depth"] for row in results["stream"]] == [1, 2]
    assert [(row["objects"], row["chunk_bytes"]) for row in results["batch"]] == [(2, 0), (2, 65536), (3, 0), (3, 65536)]
    assert all(row["gbps"] > 0 and row["batches"] >= 1 for row in results["batch"])
    assert results["batch"][1]["threads"] == 2 * -(-results["pack"]["object_bytes"] // 65536)
    assert not Path(results["pack"]["path"]).exists()  # the written pack is removed


def test_probe_refuses_unaligned_chunks():
    done = subprocess.run([sys.executable, "bench/disk_probe.py", "--chunks-kib", "6"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "--chunks-kib 6" in done.stderr
