"""bench/storaged_bench.py end to end on the CPU with tiny sizes, its synthetic bundle, its daemon
runner's failure path, and the syntax of scripts/gpu_checks.sh (the one script the GPU run uses)."""

from __future__ import annotations

import json
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # bench/ is a directory of scripts, not an installed package

from bench.common import BenchError, PackGeometry, plan_geometry, scratch_directory, write_bench_bundle  # noqa: E402
from bench.storaged_runs import StoragedProcess  # noqa: E402

DISK_DIR = Path("/var/tmp")


def _direct_io_problem(directory: Path) -> str | None:
    """Why O_DIRECT reads cannot be benchmarked in directory, or None when they work."""
    probe = directory / f".odirect-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * 4096)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        try:
            buffer = mmap.mmap(-1, 4096)  # page-aligned
            os.preadv(fd, [buffer], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT does not work in {directory}: {exc}"
    finally:
        probe.unlink(missing_ok=True)
    return None


@pytest.fixture
def disk_dir():
    problem = _direct_io_problem(DISK_DIR) if DISK_DIR.is_dir() else f"{DISK_DIR} does not exist"
    if problem:
        pytest.skip(problem)
    path = Path(tempfile.mkdtemp(prefix="storaged-bench-test-", dir=DISK_DIR))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "bench" / "storaged_bench.py"), *args],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # storaged_bench.py with a daemon in a subprocess: ~20 s
def test_bench_reports_the_three_figures_on_cpu(disk_dir):
    out = disk_dir / "results.json"
    done = _run_bench("--device", "cpu", "--dir", str(disk_dir), "--pack-gib", "0.05", "--object-mib", "0.25",
                      "--seconds", "0.5", "--hit-acquires", "300", "--json", str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads(out.read_text())
    assert results["errors"] == []
    figures = results["figures"]
    raw_limit = figures["raw_odirect_best_gbps"]
    assert 0.01 < raw_limit < 1000
    assert [run["queue_depth"] for run in results["raw_odirect"]["runs"]] == [1, 4, 16]
    assert all(run["reads"] > 0 for run in results["raw_odirect"]["runs"])
    assert 0 < figures["miss_path_gbps"] <= 2 * raw_limit
    assert figures["miss_path_ratio_to_raw"] == pytest.approx(figures["miss_path_gbps"] / raw_limit)
    runs = results["miss_path"]["runs"]
    assert [run["sessions"] for run in runs] == [1, 4]
    for run in runs:  # a pack of 256 objects against an arena of 40 slots: all misses
        assert run["acquires"] > 0
        assert run["miss_ratio"] > 0.9, run
        assert run["read_vs_acquired"] == pytest.approx(1.0, abs=0.1), run
    hit = results["hit_acquire"]
    assert hit["acquires"] == 300 and hit["vram_hits"] == 300 * 8
    assert 0 < figures["hit_acquire_p50_us"] <= figures["hit_acquire_p99_us"] < 1e6
    assert figures["pinned_h2d_gbps"] is None  # CUDA only
    assert results["pack"]["objects"] == 256 and results["pack"]["pack_bytes"] > 0.04 * 2**30
    assert not (disk_dir / "bundle").exists(), "the bundle is removed unless --keep"
    assert "machine limit (best raw)" in done.stdout and "acquire on hits p50 / p99" in done.stdout


@pytest.mark.parametrize(("args", "message"), [
    (("--pack-gib", "0.001", "--object-mib", "1"), "raise --pack-gib"),  # fewer objects than top-k
    (("--sessions", "0"), "must be positive"),
])
def test_bad_arguments_fail_loudly(disk_dir, args, message):
    out = disk_dir / "results.json"
    done = _run_bench("--device", "cpu", "--dir", str(disk_dir), "--json", str(out), *args)
    assert done.returncode != 0
    assert message in done.stderr
    assert message in json.loads(out.read_text())["errors"][0]


@pytest.mark.parametrize(("pack_gib", "object_mib", "layers", "experts", "intermediate"), [
    (8.0, 13.0, 10, 64, 2080),  # the GPU default: ~13.6 MB experts, 640 of them
    (0.05, 0.25, 4, 64, 32),  # the smoke test's pack
    (0.05, 1.0, 1, 51, 160),  # fewer objects than 64: one layer of all of them
    (0.001, 0.0001, 1, 5, 32),  # the smallest expert is one MXFP4 block of rows
])
def test_plan_geometry(pack_gib, object_mib, layers, experts, intermediate):
    geometry = plan_geometry(pack_gib, object_mib, top_k=4)
    assert (geometry.layers, geometry.experts, geometry.intermediate) == (layers, experts, intermediate)
    assert geometry.padded_object_bytes % 4096 == 0
    assert geometry.objects * geometry.padded_object_bytes <= pack_gib * 2**30 * 1.1


@pytest.mark.parametrize(("pack_gib", "object_mib"), [(0.001, 1.0), (0, 1.0), (1.0, -1.0)])
def test_plan_geometry_refuses(pack_gib, object_mib):
    with pytest.raises(BenchError):
        plan_geometry(pack_gib, object_mib, top_k=8)


def test_written_bundle_opens_and_every_object_checks_out(tmp_path):
    from packformat.bundle import open_bundle

    geometry = PackGeometry(layers=3, experts=5, intermediate=64)
    write_bench_bundle(tmp_path / "bundle", geometry, seed=3)
    with open_bundle(tmp_path / "bundle") as bundle:
        assert list(bundle.pack.layers) == [0, 1, 2] and bundle.pack.header.expert_count == 5
        assert bundle.pack.verify_all() == []
        entry = bundle.pack.entry(2, 4)
        assert entry.size == geometry.object_bytes == 3 * 64 * 4096 // 32 * 17
        assert [(r.role, r.shape) for r in entry.roles] == [(1, (64, 4096)), (2, (64, 4096)), (3, (4096, 64))]
        payloads = {bundle.pack.read_object(0, e) for e in range(5)}
        assert len(payloads) == 4  # objects cycle through four random images


def test_scratch_directory_takes_a_disk_with_room(disk_dir):
    assert scratch_directory(disk_dir, need_bytes=1 << 20) == disk_dir
    with pytest.raises(BenchError, match="bytes free, the pack needs"):
        scratch_directory(disk_dir, need_bytes=1 << 60)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_scratch_directory_refuses_memory(tmp_path):
    shm = Path(tempfile.mkdtemp(prefix="storaged-bench-test-", dir="/dev/shm"))
    try:
        with pytest.raises(BenchError, match="memory, not a disk"):
            scratch_directory(shm, need_bytes=1)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_daemon_that_cannot_start_fails_loudly(tmp_path):
    with pytest.raises(BenchError, match="storaged exited with status 1") as failure:
        StoragedProcess(tmp_path / "no-such-bundle", model="bench", device="cpu", vram_bytes=1 << 20,
                        io_parallelism=2, staging_buffers=2, log_path=tmp_path / "daemon.log", start_seconds=60)
    assert "no-such-bundle" in str(failure.value)  # the daemon's own message, from its log


def test_gpu_checks_script_is_valid_bash():
    done = subprocess.run(["bash", "-n", str(REPO / "scripts" / "gpu_checks.sh")], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
