"""The packtools command line: `packtools.cli.main` in this process where a subprocess adds nothing
(the inputs, inspect), `python -m packtools ...` in a subprocess where the process is the point
(exit statuses of failed builds, signals, file-size limits).

Bad inputs must give a message naming the culprit, a non-zero exit and no output at all: neither
the -o path nor a `.NAME.partial-*` staging directory beside it. The bad builds run two at a time
(each subprocess spends seconds importing transformers, on a 2-core box).
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import io
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from packformat import PackReader
from packtools.cli import main
from packtools.inspect import validate
from packtools.synth.gguf_cli import synth_gguf_model
from packtools.synth.hf import synth_hf

from gguf_handmade import EXPERTS, HIDDEN, INTER, Q, handmade_kv, handmade_tensors, write_handmade

REPO = Path(__file__).resolve().parents[2]


def packtools(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


def packtools_here(*args: str) -> subprocess.CompletedProcess:
    """`packtools ARGS` run by packtools.cli.main in this process, with its exit status and output."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["packtools", *args], code, out.getvalue(), err.getvalue())


def leftovers(parent: Path, name: str) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith(f".{name}."))


# ---- inputs ----
@pytest.fixture(scope="module")
def good(tmp_path_factory) -> dict[str, Path]:
    """Valid sources, and a bundle built from one of them by `packtools synth` + `packtools build`."""
    root = tmp_path_factory.mktemp("good")
    synth = packtools_here("synth", "qwen3_moe", "--format", "gguf", "--expert-type", "Q4_K", "--experts", "4",
                      "--seed", "2", "-o", str(root / "model.gguf"))
    assert synth.returncode == 0, synth.stderr
    built = packtools_here("build", str(root / "model.gguf"), "-o", str(root / "bundle"))
    assert built.returncode == 0, built.stderr
    assert "wrote" in built.stdout and "experts: 100%" in built.stderr  # the progress bar ran to the end
    (root / "split").mkdir()
    split = synth_gguf_model("olmoe", root / "split" / "m.gguf", seed=1, num_experts=4, split_max_tensors=6)
    hf = synth_hf("qwen3_moe", root / "hf", seed=1, num_experts=4).out_dir
    sharded = synth_hf("mixtral", root / "sharded", seed=1, num_experts=4, stream_threshold_bytes=0,
                       max_shard_bytes=8 * 1024).out_dir
    return {"gguf": root / "model.gguf", "bundle": root / "bundle", "split": split[0], "hf": hf, "sharded": sharded}


def _copy(good: dict, key: str, where: Path) -> Path:
    source = good[key]
    if source.is_dir():
        return Path(shutil.copytree(source, where / source.name))
    if key == "split":
        for shard in source.parent.glob("*.gguf"):
            shutil.copy(shard, where / shard.name)
        return where / source.name
    return Path(shutil.copy(source, where / source.name))


def cut_gguf(fraction: float):
    def make(good, where):
        path = _copy(good, "gguf", where)
        data = path.read_bytes()
        path.write_bytes(data[: int(len(data) * fraction)])
        return path
    return make


def wrong_magic(good, where):
    path = _copy(good, "gguf", where)
    with open(path, "r+b") as f:
        f.write(b"GGML")
    return path


def handmade(arch: str = "qwen3moe", **tensors):
    def make(good, where):
        table = handmade_tensors(Q.Q8_0)
        table.update(tensors)
        return write_handmade(where / "hand.gguf", handmade_kv(arch), table, arch=arch)
    return make


def missing_shard(good, where):
    first = _copy(good, "split", where)
    second = sorted(where.glob("*-00002-of-*.gguf"))[0]
    second.unlink()
    return first


def edit_hf(key: str, edit: Callable[[Path], None]):
    def make(good, where):
        directory = _copy(good, key, where)
        edit(directory)
        return directory
    return make


def set_config(**changes):
    def edit(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        config.update(changes)
        (directory / "config.json").write_text(json.dumps(config))
    return edit


def expert_to_float8(directory: Path) -> None:
    state = load_file(directory / "model.safetensors")
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    state[name] = state[name].to(torch.float8_e4m3fn)
    save_file(state, directory / "model.safetensors", metadata={"format": "pt"})


def delete_shard(directory: Path) -> None:
    sorted(directory.glob("model-*.safetensors"))[-1].unlink()


def truncate_last(pattern: str):
    def edit(directory: Path) -> None:
        path = sorted(directory.glob(pattern))[-1]
        path.write_bytes(path.read_bytes()[:-100])
    return edit


_Q8_1_EXPERTS = np.zeros((EXPERTS, INTER, HIDDEN // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
_FEWER_EXPERTS = gguf.quants.quantize(np.zeros((EXPERTS - 1, INTER, HIDDEN), np.float32), Q.Q8_0)


def existing_bundle(good, out: Path) -> None:
    shutil.copytree(good["bundle"], out)


def existing_directory(good, out: Path) -> None:
    out.mkdir()
    (out / "notes.txt").write_text("keep me")


def existing_file(good, out: Path) -> None:
    out.write_text("keep me")


@dataclasses.dataclass(frozen=True)
class BadBuild:
    id: str
    make: Callable[[dict, Path], Path]  # (good inputs, an empty directory) -> the source to build
    says: tuple[str, ...]  # every one of these is in the error message
    existing: Callable[[dict, Path], None] | None = None  # puts something at the -o path first
    force: bool = False


BAD_BUILDS = [
    BadBuild("no-such-source", lambda good, where: where / "absent.gguf", ("absent.gguf", "no such file")),
    BadBuild("gguf-truncated-data", cut_gguf(0.6), ("model.gguf", "truncated", "data")),
    BadBuild("gguf-wrong-magic", wrong_magic, ("model.gguf", "not a GGUF file", "GGML")),
    BadBuild("gguf-unknown-architecture", handmade("bert"), ("hand.gguf", "unsupported GGUF architecture 'bert'")),
    BadBuild("hf-unknown-architecture", edit_hf("hf", set_config(model_type="llama")),
             ("model_type 'llama' is not supported", "experts interface", "qwen3_moe")),
    BadBuild("gguf-unsupported-type", handmade(**{"blk.0.ffn_gate_exps.weight": (_Q8_1_EXPERTS, Q.Q8_1)}),
             ("hand.gguf", "blk.0.ffn_gate_exps.weight", "Q8_1")),
    BadBuild("hf-unsupported-dtype", edit_hf("hf", expert_to_float8),
             ("model.layers.1.mlp.experts.2.up_proj.weight", "F8_E4M3")),
    BadBuild("gguf-missing-shard", missing_shard, ("m-00002-of-", "missing")),
    BadBuild("hf-missing-shard", edit_hf("sharded", delete_shard), ("missing checkpoint file", ".safetensors")),
    BadBuild("gguf-inconsistent-expert-counts", handmade(**{"blk.1.ffn_up_exps.weight": (_FEWER_EXPERTS, Q.Q8_0)}),
             ("blk.1.ffn_up_exps.weight", f"{EXPERTS - 1} experts", f"expert_count is {EXPERTS}")),
    BadBuild("hf-more-experts-than-checkpoint", edit_hf("hf", set_config(num_local_experts=EXPERTS + 1)),
             (f"expert {EXPERTS}", "missing", "gate_proj")),
    # fails only while the experts are being copied: exercises the staging clean-up
    BadBuild("hf-truncated-expert-shard", edit_hf("sharded", truncate_last("model-*.safetensors")),
             ("-of-", ".safetensors", "short read")),
    BadBuild("hf-truncated-file", edit_hf("hf", truncate_last("model.safetensors")), ("model.safetensors",)),
    BadBuild("existing-output-without-force", lambda good, where: good["hf"], ("already exists; pass --force",),
             existing=existing_bundle),
    BadBuild("force-over-a-directory-that-is-not-a-bundle", lambda good, where: good["hf"], ("is not a bundle",),
             existing=existing_directory, force=True),
    BadBuild("force-over-a-file", lambda good, where: good["hf"], ("is not a bundle",),
             existing=existing_file, force=True),
]


def snapshot(path: Path) -> dict[str, bytes] | None:
    if path.is_file():
        return {"": path.read_bytes()}
    if path.is_dir():
        return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}
    return None


@pytest.fixture(scope="module")
def bad_builds(good, tmp_path_factory) -> dict[str, tuple[subprocess.CompletedProcess, Path, dict | None]]:
    root = tmp_path_factory.mktemp("bad")
    jobs = {}
    for case in BAD_BUILDS:
        (root / case.id / "in").mkdir(parents=True)
        out = root / case.id / "bundle"
        if case.existing:
            case.existing(good, out)
        args = ["build", str(case.make(good, root / case.id / "in")), "-o", str(out)] + ["--force"] * case.force
        jobs[case.id] = (args, out, snapshot(out))
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        runs = pool.map(lambda job: packtools(*job[0]), jobs.values())
        return {case_id: (run, *jobs[case_id][1:]) for case_id, run in zip(jobs, runs)}


@pytest.mark.slow  # every bad build is a `python -m packtools` subprocess importing transformers: ~3 min in all
@pytest.mark.parametrize("case", BAD_BUILDS, ids=[c.id for c in BAD_BUILDS])
def test_bad_build_fails_cleanly(bad_builds, case):
    run, out, before = bad_builds[case.id]
    assert run.returncode == 2, (run.stdout, run.stderr)
    message = run.stderr.strip().splitlines()[-1]
    assert message.startswith("packtools build: error: ") and "Traceback" not in run.stderr
    for text in case.says:
        assert text in message, message
    assert snapshot(out) == before  # nothing written, or what was there untouched
    assert leftovers(out.parent, out.name) == []


@pytest.mark.slow  # a second build subprocess: ~10 s
def test_force_replaces_a_bundle(good, tmp_path):
    out = tmp_path / "bundle"
    shutil.copytree(good["bundle"], out)
    replaced = packtools("build", str(good["hf"]), "-o", str(out), "--force", "--quiet")
    assert replaced.returncode == 0, replaced.stderr
    assert "experts:" not in replaced.stderr  # --quiet: no progress bar
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["source"]["kind"] == "hf" and manifest["model_type"] == "qwen3_moe"
    assert packtools("validate", str(out), "--full").returncode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # no staging or old copy left


def _small_file_limit() -> None:
    # RLIMIT_FSIZE makes a write past 64 KiB fail (EFBIG once SIGXFSZ is ignored) exactly as a full
    # disk makes it fail with ENOSPC: through a write() that names no file
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 10, 64 << 10))


@pytest.mark.slow  # a build subprocess under a file-size limit: ~10 s each
@pytest.mark.parametrize("debug", [False, True], ids=["plain", "debug"])
def test_a_full_disk_names_the_output_and_debug_keeps_the_exit_status(good, tmp_path, debug):
    out = tmp_path / "bundle"
    run = subprocess.run([sys.executable, "-m", "packtools", *(["--debug"] * debug), "build", str(good["gguf"]),
                          "-o", str(out), "--quiet"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         preexec_fn=_small_file_limit)
    assert run.returncode == 2, run.stderr
    message = run.stderr.strip().splitlines()[-1]
    assert message == (f"packtools build: error: [Errno {errno.EFBIG}] {out}: cannot write the bundle into "
                       f"{tmp_path}: File too large; nothing was left behind"), message
    assert ("Traceback" in run.stderr) == debug  # --debug adds the traceback, and nothing else
    assert not out.exists() and leftovers(tmp_path, "bundle") == []


@pytest.mark.slow  # a build subprocess interrupted mid-way: 10-15 s each
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["ctrl-c", "sigterm"])
def test_interrupted_build_leaves_nothing(tmp_path, signum, code):
    (source,) = synth_gguf_model("qwen3_moe", tmp_path / "big.gguf", seed=3, expert_type="Q8_0", hidden_size=1024,
                                 moe_intermediate_size=1024, num_experts=96, num_layers=2, stream_threshold_bytes=0)
    out = tmp_path / "bundle"
    # a shell starts background jobs with SIGINT ignored, and Python then never turns it into
    # KeyboardInterrupt: the child gets the default disposition whatever ran the tests
    build = subprocess.Popen([sys.executable, "-m", "packtools", "build", str(source), "-o", str(out)], cwd=REPO,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size > 32 << 20 for p in tmp_path.glob(".bundle.partial-*/experts.pack")):
            assert build.poll() is None and time.monotonic() < deadline, "the build ended before it could be stopped"
            time.sleep(0.01)
        build.send_signal(signum)  # mid-way through the ~600 MB of experts
        _, stderr = build.communicate(timeout=60)
    finally:
        build.kill()
    source.unlink()  # ~600 MB
    assert build.returncode == code, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr
    assert not out.exists() and leftovers(tmp_path, "bundle") == []


# ---- validate (pack corruption cases are in tests/packformat/test_bundle.py) ----
def test_validate_without_full_does_not_read_objects(good):
    def bytes_read() -> int:
        return int(Path("/proc/self/io").read_text().split("rchar: ")[1].split()[0])

    with PackReader(good["bundle"] / "experts.pack") as pack:
        object_bytes = sum(o.size for o in pack)
    validate(good["bundle"], full=False)  # warm up imports
    before = bytes_read()
    assert validate(good["bundle"], full=False).ok
    quick = bytes_read() - before
    before = bytes_read()
    assert validate(good["bundle"], full=True).ok
    full = bytes_read() - before
    assert quick < object_bytes / 10 and full >= object_bytes, (quick, full, object_bytes)


# ---- inspect ----
def test_inspect_json_describes_the_bundle(good):
    run = packtools_here("inspect", str(good["bundle"]), "--json")
    assert run.returncode == 0, run.stderr
    summary = json.loads(run.stdout)
    bundle = good["bundle"]
    q4k_role = 256 * 256 // 256 * 144  # [256, 256] Q4_K: 144 bytes per 256-element block
    with safe_open(bundle / "dense.safetensors", framework="pt") as f:
        dense_count = len(list(f.keys()))  # noqa: SIM118
    assert summary == {
        "bundle": str(bundle),
        "model_type": "qwen3_moe",
        "architectures": ["Qwen3MoeForCausalLM"],
        "source": {"kind": "gguf"},
        "hidden_size": 256,
        "num_layers": 2,
        "moe_layers": [0, 1],
        "num_experts": 4,
        "top_k": 2,
        "roles": [{"role": role, "type": "Q4_K", "shape": [256, 256], "bytes": q4k_role}
                  for role in ("gate", "up", "down")],
        "element_types": ["Q4_K"],
        "orientation": "out_in",
        "gate_up": "concat",
        "bytes_per_expert": {"min": 3 * q4k_role, "max": 3 * q4k_role, "padded_max": 3 * q4k_role},
        "expert_bytes_total": 8 * 3 * q4k_role,
        # header 4096 + index (8 + 8 objects x (32 + 3 x 64) = 1800) aligned to 8192, then 8 whole-page objects
        "pack_file_bytes": 8192 + 8 * 3 * q4k_role,
        "dense_bytes": (bundle / "dense.safetensors").stat().st_size,
        "dense_tensors": dense_count,
        "tokenizer": "gguf-metadata",
        "pack_format": "1.0",  # no 1.1 feature (block-scaled FP4) in use
    }
    text = packtools_here("inspect", str(bundle))
    assert text.returncode == 0
    assert "qwen3_moe (Qwen3MoeForCausalLM), from gguf" in text.stdout and "4 per layer, top-2" in text.stdout


def test_inspect_of_a_missing_bundle_names_it(tmp_path):
    run = packtools("inspect", str(tmp_path / "nothing"))
    assert run.returncode == 2 and "nothing: not a bundle directory" in run.stderr
