"""open_bundle's consistency checks, `packtools validate` on broken packs, and staged_bundle's
all-or-nothing output.

Each broken bundle is a good one with one file changed; the error must be a BundleError (or,
through the CLI, a one-line message) that names the file, and the object where there is one.
"""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest

from packformat import PackReader
from packformat.bundle import BundleError, BundleExistsError, open_bundle, staged_bundle
from packtools.build import build_bundle
from packtools.synth.hf import synth_hf

REPO = Path(__file__).resolve().parents[2]
HEADER = struct.Struct("<8sHHIIIIIIIQQQQQII")  # docs/pack-format.md § Header, bytes 0-87


def packtools(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "packtools", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    """Bundles `a` and `twin` (same shapes, other weights) and `wider` (more experts)."""
    root = tmp_path_factory.mktemp("bundles")
    made = {}
    for name, seed, experts in (("a", 1, 4), ("twin", 2, 4), ("wider", 1, 8)):
        source = synth_hf("olmoe", root / f"{name}-hf", seed=seed, num_experts=experts).out_dir
        made[name] = build_bundle(source, root / name, progress=False).bundle
    return made


def test_good_bundle_opens(bundles):
    with open_bundle(bundles["a"]) as bundle:
        assert bundle.config["model_type"] == bundle.manifest["model_type"] == "olmoe"
        assert bundle.experts["num_experts"] == bundle.pack.header.expert_count == 4
        assert bundle.experts["moe_layers"] == list(bundle.pack.layers) == [0, 1]
        assert len(bundle.pack.objects) == 8


def copy_from(other: str, name: str):
    def edit(bundle: Path, bundles: dict) -> None:
        shutil.copyfile(bundles[other] / name, bundle / name)
    return edit


def write(name: str, text: str):
    def edit(bundle: Path, bundles: dict) -> None:
        (bundle / name).write_text(text)
    return edit


def edit_json(name: str, change: Callable[[dict], None]):
    def edit(bundle: Path, bundles: dict) -> None:
        data = json.loads((bundle / name).read_text())
        change(data)
        (bundle / name).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    return edit


def remove(name: str):
    def edit(bundle: Path, bundles: dict) -> None:
        (bundle / name).unlink()
    return edit


def append(name: str, data: bytes):
    def edit(bundle: Path, bundles: dict) -> None:
        with open(bundle / name, "ab") as f:
            f.write(data)
    return edit


BROKEN = [
    pytest.param(copy_from("twin", "manifest.json"), "manifest.json", "pack index crc32", id="manifest-of-twin"),
    pytest.param(copy_from("wider", "manifest.json"), "manifest.json", "pack size", id="manifest-of-wider"),
    pytest.param(copy_from("twin", "experts.pack"), "manifest.json", "belongs to another pack", id="pack-of-twin"),
    pytest.param(edit_json("config.json", lambda c: c.update(rms_norm_eps=1e-3)), "config.json",
                 "config_sha256", id="config-changed"),
    pytest.param(copy_from("wider", "config.json"), "config.json", "config_sha256", id="config-of-wider"),
    pytest.param(edit_json("manifest.json", lambda m: m.update(model_type="mixtral")), "config.json",
                 "model_type 'olmoe', manifest says 'mixtral'", id="model-type-mismatch"),
    pytest.param(append("dense.safetensors", b"\0" * 8), "dense.safetensors", "manifest says", id="dense-longer"),
    pytest.param(copy_from("wider", "dense.safetensors"), "dense.safetensors", "manifest says", id="dense-of-wider"),
    pytest.param(remove("manifest.json"), "manifest.json", "missing", id="no-manifest"),
    pytest.param(remove("experts.pack"), "experts.pack", "missing", id="no-pack"),
    pytest.param(remove("dense.safetensors"), "dense.safetensors", "missing", id="no-dense"),
    pytest.param(remove("config.json"), "config.json", "missing", id="no-config"),
    pytest.param(write("manifest.json", '{"format": "expertpack-bundle",'), "manifest.json", "not valid JSON",
                 id="manifest-bad-json"),
    pytest.param(write("config.json", "\xff\xfe"), "config.json", "not valid JSON", id="config-bad-json"),
    pytest.param(write("manifest.json", "[1, 2]"), "manifest.json", "expected a JSON object", id="manifest-a-list"),
    pytest.param(edit_json("manifest.json", lambda m: m.update(format="other")), "manifest.json",
                 "format is 'other'", id="wrong-format"),
    pytest.param(edit_json("manifest.json", lambda m: m.update(version=2)), "manifest.json", "bundle version 2",
                 id="newer-version"),
    pytest.param(edit_json("manifest.json", lambda m: m["experts"].update(num_experts=5)), "manifest.json",
                 "experts per layer", id="manifest-expert-count"),
    pytest.param(edit_json("manifest.json", lambda m: m["experts"].update(moe_layers=[1])), "manifest.json",
                 "moe layers", id="manifest-layers"),
    # the right value of the wrong JSON type: the message names both types instead of "'4' but ... has 4"
    pytest.param(edit_json("manifest.json", lambda m: m["experts"].update(num_experts="4")), "manifest.json",
                 "experts per layer must be a JSON integer", id="manifest-expert-count-a-string"),
    pytest.param(edit_json("manifest.json", lambda m: m["experts"].update(moe_layers=["0", "1"])), "manifest.json",
                 "moe layers must be a JSON array of integers", id="manifest-layers-strings"),
    pytest.param(edit_json("manifest.json", lambda m: m["pack"].update(size=str(m["pack"]["size"]))),
                 "manifest.json", "pack size must be a JSON integer", id="manifest-pack-size-a-string"),
]


@pytest.mark.parametrize("edit,culprit,says", BROKEN)
def test_broken_bundle_is_refused_naming_the_file(bundles, tmp_path, edit, culprit, says):
    bundle = Path(shutil.copytree(bundles["a"], tmp_path / "bundle"))
    edit(bundle, bundles)
    with pytest.raises(BundleError) as caught:
        open_bundle(bundle)
    message = str(caught.value)
    assert str(bundle / culprit) in message and says in message, message


def test_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("x")
    for path in (tmp_path / "absent", tmp_path / "file"):
        with pytest.raises(BundleError, match="not a bundle directory"):
            open_bundle(path)


# ---- validate through the CLI: a pack broken in one way, the message naming it ----
def patch_pack(pack: Path, edit: Callable[[bytearray, list], None]) -> None:
    """Apply `edit(file bytes, header fields)`, then re-seal both checksums so only the edit is wrong."""
    data = bytearray(pack.read_bytes())
    fields = list(HEADER.unpack_from(data, 0))
    edit(data, fields)
    index_offset, index_size = fields[10], fields[11]
    fields[15] = zlib.crc32(data[index_offset:index_offset + index_size])
    fields[16] = zlib.crc32(HEADER.pack(*fields)[:84])
    HEADER.pack_into(data, 0, *fields)
    pack.write_bytes(bytes(data))


def entry_at(fields: list, n: int) -> int:
    """File offset of object entry n in the index."""
    layers, roles = fields[6], fields[8]
    return fields[10] + (4 * layers + 7) // 8 * 8 + n * (32 + 64 * roles)


def set_header_alignment(data, fields):
    fields[4] = 512


def unalign_object(data, fields):
    at = entry_at(fields, 1) + 8
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + 512)


def unalign_role(data, fields):
    at = entry_at(fields, 0) + 32 + 64 + 8  # role 1's offset
    struct.pack_into("<Q", data, at, struct.unpack_from("<Q", data, at)[0] + 16)


def truncate(data, fields):
    del data[-4096:]


BAD_PACKS = [
    pytest.param(truncate, ("experts.pack", "truncated"), id="truncated"),
    pytest.param(set_header_alignment, ("experts.pack", "alignment 512 != 4096"), id="header-alignment"),
    pytest.param(unalign_object, ("layer 0, expert 1", "not 4096-aligned"), id="object-alignment"),
    pytest.param(unalign_role, ("layer 0, expert 0", "unaligned"), id="role-alignment"),
]


@pytest.mark.parametrize("edit,says", BAD_PACKS)
def test_validate_refuses_a_broken_pack(bundles, tmp_path, edit, says):
    bundle = Path(shutil.copytree(bundles["a"], tmp_path / "bundle"))
    patch_pack(bundle / "experts.pack", edit)
    for args in ((), ("--full",)):
        run = packtools("validate", str(bundle), *args)
        assert run.returncode == 2 and run.stdout == ""
        for text in says:
            assert text in run.stderr, run.stderr


def test_flipped_object_byte_is_found_by_full_validate_only(bundles, tmp_path):
    bundle = Path(shutil.copytree(bundles["a"], tmp_path / "bundle"))
    with PackReader(bundle / "experts.pack") as pack:
        victim = pack.entry(1, 2)
    with open(bundle / "experts.pack", "r+b") as f:
        f.seek(victim.offset + 1000)
        byte = f.read(1)
        f.seek(victim.offset + 1000)
        f.write(bytes([byte[0] ^ 0x10]))
    quick = packtools("validate", str(bundle))
    assert quick.returncode == 0 and "OK (structure of 8 objects)" in quick.stdout
    full = packtools("validate", str(bundle), "--full")
    assert full.returncode == 1
    bad_lines = [line for line in full.stderr.splitlines() if line.startswith("BAD ")]
    assert len(bad_lines) == 1 and "layer 1, expert 2" in bad_lines[0] and "checksum mismatch" in bad_lines[0]
    assert "1 of 8 objects are corrupt" in full.stderr


# ---- staged_bundle ----
def test_staged_bundle_publishes_only_on_success(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_bundle(target, force=False) as staging:
            (staging / "manifest.json").write_text("{}")
            assert staging.parent == tmp_path and staging.name.startswith(".out.partial-")
            raise RuntimeError("build failed half-way")
    assert list(tmp_path.iterdir()) == []
    with staged_bundle(target, force=False) as staging:
        (staging / "manifest.json").write_text("{}")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (target / "manifest.json").is_file()


def test_staged_bundle_replaces_only_bundles_and_empty_directories(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    with pytest.raises(BundleExistsError, match="pass --force"):
        with staged_bundle(target, force=False):
            pass
    with staged_bundle(target, force=True) as staging:  # empty: replaceable
        (staging / "manifest.json").write_text('{"new": 1}')
    with staged_bundle(target, force=True) as staging:  # a bundle: replaceable
        (staging / "manifest.json").write_text('{"new": 2}')
    assert json.loads((target / "manifest.json").read_text()) == {"new": 2}
    (target / "manifest.json").unlink()
    (target / "weights.bin").write_bytes(b"user data")
    with pytest.raises(BundleExistsError, match="not a bundle"):
        with staged_bundle(target, force=True):
            pass
    assert (target / "weights.bin").read_bytes() == b"user data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_a_concurrent_build_that_finished_first_keeps_the_output(tmp_path):
    target = tmp_path / "out"
    with pytest.raises(BundleExistsError, match="another build created it while this one ran; this build's "
                       "output was discarded"):
        with staged_bundle(target, force=False) as staging:
            (staging / "manifest.json").write_text('{"mine": true}')
            target.mkdir()  # the other build renames its complete bundle in first
            (target / "manifest.json").write_text('{"theirs": true}')
    assert json.loads((target / "manifest.json").read_text()) == {"theirs": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left


def test_the_rename_collision_of_two_builds_is_named(tmp_path, monkeypatch):
    """Both builds saw no output, then one renamed first: rename(2) onto its full directory fails
    with ENOTEMPTY ("Directory not empty"), which must read as the lost race it is."""
    target = tmp_path / "out"
    real_exists = Path.exists

    def blind_to_target(path: Path) -> bool:  # the check ran before the other build's rename
        return False if path == target else real_exists(path)

    with pytest.raises(BundleExistsError, match="another build created it while this one ran") as caught:
        with staged_bundle(target, force=False) as staging:
            (staging / "manifest.json").write_text('{"mine": true}')
            target.mkdir()
            (target / "manifest.json").write_text('{"theirs": true}')
            monkeypatch.setattr(Path, "exists", blind_to_target)
    monkeypatch.undo()
    assert "Directory not empty" not in str(caught.value)
    assert json.loads((target / "manifest.json").read_text()) == {"theirs": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_failed_replacement_keeps_the_old_bundle(tmp_path):
    target = tmp_path / "out"
    target.mkdir()
    (target / "manifest.json").write_text('{"old": true}')
    with pytest.raises(KeyboardInterrupt):
        with staged_bundle(target, force=True) as staging:
            (staging / "manifest.json").write_text('{"new": true}')
            raise KeyboardInterrupt
    assert json.loads((target / "manifest.json").read_text()) == {"old": True}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
