"""bench/llamacpp/build.sh and pack_source.sh: argument checks, reuse of a carried binary (and the
flavour check), the compressed split pieces of --out and their reassembly, and the source tarball.
A shell script stands in for llama-bench; the real build is exercised by test_llamacpp_smoke.py."""

from __future__ import annotations

import subprocess
import tarfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "bench" / "llamacpp" / "build.sh"
PACK_SOURCE = REPO / "bench" / "llamacpp" / "pack_source.sh"
CUDA_TOOLKIT = REPO / "bench" / "llamacpp" / "cuda_toolkit.sh"
SDIST = Path("/tmp/llama/llama_cpp_python-0.3.36.tar.gz")


def build(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(BUILD), "--log", str(tmp_path / "build.log"), "--work",
                           str(tmp_path / "work"), "--src", str(tmp_path / "no-source.tar.gz"), *args],
                          capture_output=True, text=True, timeout=120)


def fake_binary(directory: Path, flavour: str = "cpu", help_status: int = 0) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    binary = directory / "llama-bench"
    binary.write_text(f"#!/bin/sh\n# stands in for llama-bench\nexit {help_status}\n")
    binary.chmod(0o755)
    (directory / "BUILD_INFO").write_text(f"flavour={flavour}\ncommit=0c1e57098bba\n")
    return binary


@pytest.mark.parametrize(("args", "message"), [
    (["--jobs", "0"], "--jobs must be a positive integer, got '0'"),
    (["--jobs", "many"], "--jobs must be a positive integer, got 'many'"),
    (["--nice", "20"], "--nice must be an integer in -20..19, got '20'"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--out"], "option --out needs a value"),
    (["--cuda-root", "/nonexistent"], "--cuda-root '/nonexistent' has no bin/nvcc"),
])
def test_bad_arguments_are_refused_by_name(tmp_path, args, message):
    done = build(tmp_path, *args)
    assert done.returncode != 0 and message in done.stderr


def fake_cuda_root(directory: Path) -> Path:
    (directory / "bin").mkdir(parents=True)
    (directory / "bin" / "nvcc").write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0'\n")
    (directory / "bin" / "nvcc").chmod(0o755)
    return directory


def test_cuda_root_is_refused_with_the_cpu_flavour(tmp_path):
    done = build(tmp_path, "--cpu", "--cuda-root", str(fake_cuda_root(tmp_path / "cuda")))
    assert done.returncode != 0 and "--cuda-root builds the CUDA flavour; it cannot go with --cpu" in done.stderr


def test_a_cuda_build_made_without_a_gpu_is_packed_without_being_run(tmp_path):
    # --help would fail here (no driver): with --cuda-root the binary is taken as built and packed
    fake_binary(tmp_path / "bin", "cuda", help_status=1)
    out = tmp_path / "out"
    done = build(tmp_path, "--cuda-root", str(fake_cuda_root(tmp_path / "cuda")), "--bin-dir", str(tmp_path / "bin"),
                 "--pack-dir", str(tmp_path / "none"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert "cannot start here (no GPU driver)" in (tmp_path / "build.log").read_text()
    assert (out / "llamacpp-bin.tar.xz.part-00").exists()
    # where it is reassembled without --cuda-root (the GPU machine) it must start
    done = build(tmp_path, "--bin-dir", str(tmp_path / "copy"), "--pack-dir", str(out))
    assert done.returncode == 1 and "--help failed" in done.stderr


def test_a_carried_binary_of_the_right_flavour_is_reused(tmp_path):
    fake_binary(tmp_path / "bin", "cpu")
    done = build(tmp_path, "--cpu", "--bin-dir", str(tmp_path / "bin"), "--pack-dir", str(tmp_path / "none"))
    assert done.returncode == 0, done.stderr
    assert "using the existing" in (tmp_path / "build.log").read_text()


@pytest.mark.parametrize(("flavour", "help_status", "why"), [
    ("cpu", 0, "is not a cuda build (flavour=cpu)"),  # a CPU build carried to the GPU machine
    ("cuda", 1, "--help failed"),  # it does not start (missing libraries)
])
def test_an_unusable_binary_is_rebuilt_and_a_missing_source_is_named(tmp_path, flavour, help_status, why):
    fake_binary(tmp_path / "bin", flavour, help_status)
    done = build(tmp_path, "--bin-dir", str(tmp_path / "bin"), "--pack-dir", str(tmp_path / "none"))
    assert done.returncode == 1
    assert why in done.stderr
    assert f"source tarball '{tmp_path / 'no-source.tar.gz'}' not found" in done.stderr


def test_out_pieces_reassemble_into_a_usable_binary(tmp_path):
    binary = fake_binary(tmp_path / "bin", "cpu")
    out = tmp_path / "out"
    done = build(tmp_path, "--cpu", "--bin-dir", str(tmp_path / "bin"), "--out", str(out))
    assert done.returncode == 0, done.stderr
    pieces = sorted(out.glob("llamacpp-bin.tar.xz.part-*"))
    assert [p.name for p in pieces] == ["llamacpp-bin.tar.xz.part-00"]
    assert all(p.stat().st_size <= 15 * 2**20 for p in pieces)
    assert "sha256 " in (out / "REASSEMBLE.txt").read_text() and (out / "build.log").exists()

    copy = tmp_path / "copy"
    done = build(tmp_path, "--cpu", "--bin-dir", str(copy), "--pack-dir", str(out))
    assert done.returncode == 0, done.stderr
    assert "reassembled from" in (tmp_path / "build.log").read_text()
    assert (copy / "llama-bench").read_bytes() == binary.read_bytes()
    assert (copy / "BUILD_INFO").read_text().startswith("flavour=cpu")


def test_damaged_pieces_are_not_used(tmp_path):
    fake_binary(tmp_path / "bin", "cpu")
    out = tmp_path / "out"
    assert build(tmp_path, "--cpu", "--bin-dir", str(tmp_path / "bin"), "--out", str(out)).returncode == 0
    piece = out / "llamacpp-bin.tar.xz.part-00"
    piece.write_bytes(piece.read_bytes()[:-1] + b"\0")
    done = build(tmp_path, "--cpu", "--bin-dir", str(tmp_path / "copy"), "--pack-dir", str(out))
    assert done.returncode == 1
    assert "do not match their sha256" in done.stderr and not (tmp_path / "copy" / "llama-bench").exists()


@pytest.mark.parametrize(("args", "message"), [
    (["--frobnicate"], "unknown argument '--frobnicate'"),
    (["--dir"], "option --dir needs a value"),
    (["--wheels"], "option --wheels needs a value"),
])
def test_cuda_toolkit_refuses_bad_arguments_by_name(args, message):
    done = subprocess.run(["bash", str(CUDA_TOOLKIT), *args], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and message in done.stderr


def test_pack_source_names_a_missing_sdist(tmp_path):
    done = subprocess.run(["bash", str(PACK_SOURCE), "--sdist", str(tmp_path / "nope.tar.gz"), "--out",
                           str(tmp_path / "src.tar.gz")], capture_output=True, text=True)
    assert done.returncode == 1 and "nope.tar.gz' not found" in done.stderr


@pytest.mark.skipif(not SDIST.exists(), reason=f"{SDIST} not downloaded (pip download --no-deps --no-binary :all: "
                    "llama-cpp-python==0.3.36 -d /tmp/llama)")
def test_pack_source_keeps_what_the_build_needs_and_stays_small(tmp_path):
    out = tmp_path / "src.tar.gz"
    done = subprocess.run(["bash", str(PACK_SOURCE), "--sdist", str(SDIST), "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert out.stat().st_size < 20 * 2**20 and f"{out.stat().st_size} bytes" in done.stdout
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        commit = tar.extractfile("llama.cpp/LLAMACPP_COMMIT").read().decode().split()
    for needed in ("llama.cpp/CMakeLists.txt", "llama.cpp/tools/llama-bench/llama-bench.cpp",
                   "llama.cpp/ggml/src/ggml-cuda/CMakeLists.txt", "llama.cpp/ggml/src/ggml-cpu/CMakeLists.txt",
                   "llama.cpp/app/CMakeLists.txt", "llama.cpp/vendor/miniaudio/miniaudio.h"):
        assert needed in names, needed
    assert not any(n.startswith(("llama.cpp/models/", "llama.cpp/docs/", "llama.cpp/ggml/src/ggml-vulkan",
                                 "llama.cpp/tools/ui/", "llama.cpp/tests/")) for n in names)
    assert len(commit[0]) == 40 and commit[1] == SDIST.name
