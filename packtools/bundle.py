"""A pack bundle on disk: manifest.json, experts.pack, dense.safetensors, config.json, tokenizer.

`staged_bundle` gives a temporary directory beside the target that becomes the bundle only by
one rename at the end, so an interrupted build never leaves something that looks complete.
`open_bundle` is the one way storaged, inference and packtools open a bundle: it checks the
manifest against the pack and the files before anyone reads an expert.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from packtools.pack import PackError, PackReader

FORMAT_NAME = "expertpack-bundle"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
PACK = "experts.pack"
DENSE = "dense.safetensors"
CONFIG = "config.json"
REQUIRED_FILES = (MANIFEST, PACK, DENSE, CONFIG)


class BundleError(Exception):
    """A bundle directory is missing, incomplete or inconsistent; names the file."""


class BundleExistsError(BundleError):
    """The output exists and --force was not given."""


@dataclasses.dataclass
class Bundle:
    path: Path
    manifest: dict
    config: dict
    pack: PackReader

    @property
    def experts(self) -> dict:
        return self.manifest["experts"]

    def close(self) -> None:
        self.pack.close()

    def __enter__(self) -> Bundle:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _load_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise BundleError(f"{path}: missing") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BundleError(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BundleError(f"{path}: expected a JSON object")
    return data


def open_bundle(path: str | os.PathLike) -> Bundle:
    """Open and structurally validate a bundle. Raises BundleError or a PackError."""
    root = Path(path)
    if not root.is_dir():
        raise BundleError(f"{root}: not a bundle directory (does not exist or is not a directory)")
    for name in REQUIRED_FILES:
        if not (root / name).is_file():
            raise BundleError(f"{root / name}: missing; a bundle needs {', '.join(REQUIRED_FILES)}")
    manifest = _load_json(root / MANIFEST)
    if manifest.get("format") != FORMAT_NAME:
        raise BundleError(f"{root / MANIFEST}: format is {manifest.get('format')!r}, not {FORMAT_NAME!r}")
    if manifest.get("version") != FORMAT_VERSION:
        raise BundleError(f"{root / MANIFEST}: bundle version {manifest.get('version')!r}; "
                          f"this build reads version {FORMAT_VERSION}")
    config = _load_json(root / CONFIG)
    pack = PackReader(root / PACK)
    try:
        _check_consistency(root, manifest, config, pack)
    except BaseException:
        pack.close()
        raise
    return Bundle(root, manifest, config, pack)


def _check_consistency(root: Path, manifest: dict, config: dict, pack: PackReader) -> None:
    where = root / MANIFEST
    pack_info, experts = manifest.get("pack", {}), manifest.get("experts", {})
    expected = {
        "pack size": (pack_info.get("size"), pack.header.file_size),
        "pack index crc32": (pack_info.get("index_crc32"), pack.header.index_crc32),
        "moe layers": (experts.get("moe_layers"), list(pack.layers)),
        "experts per layer": (experts.get("num_experts"), pack.header.expert_count),
    }
    for what, (in_manifest, in_pack) in expected.items():
        if in_manifest != in_pack:
            raise BundleError(f"{where}: {what} is {in_manifest!r} but {root / PACK} has {in_pack!r} "
                              "(the manifest belongs to another pack)")
    dense_size = manifest.get("dense", {}).get("size")
    if dense_size != (root / DENSE).stat().st_size:
        raise BundleError(f"{root / DENSE}: {(root / DENSE).stat().st_size} bytes, manifest says {dense_size}")
    config_hash = hashlib.sha256((root / CONFIG).read_bytes()).hexdigest()
    if manifest.get("config_sha256") != config_hash:
        raise BundleError(f"{root / CONFIG}: does not match the manifest's config_sha256")
    if config.get("model_type") != manifest.get("model_type"):
        raise BundleError(f"{root / CONFIG}: model_type {config.get('model_type')!r}, manifest says "
                          f"{manifest.get('model_type')!r}")


@contextlib.contextmanager
def staged_bundle(output: str | os.PathLike, *, force: bool) -> Iterator[Path]:
    """Yield a temporary directory; on success rename it to `output`, on any failure delete it."""
    target = Path(output).absolute()
    if target.exists() and not force:
        raise BundleExistsError(f"{target}: already exists; pass --force to replace it")
    if target.exists() and not _replaceable(target):
        # --force deletes the old output: never a file or a directory that is not a bundle (a typo
        # such as `-o .` or `-o <the checkpoint>` would otherwise delete the user's data).
        raise BundleExistsError(f"{target}: exists and is not a bundle (no {MANIFEST}) nor an empty directory; "
                                "--force only replaces a bundle, remove it yourself if it is meant to go")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = target.parent / f".{target.name}.partial-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        yield staging
        _fsync_dir(staging)
        if target.exists():
            # Replace in two renames so a crash leaves either the old or the new bundle.
            old = target.parent / f".{target.name}.old-{os.getpid()}"
            os.rename(target, old)
            os.rename(staging, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(staging, target)
        _fsync_dir(target.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _replaceable(target: Path) -> bool:
    if target.is_symlink() or not target.is_dir():
        return False
    return (target / MANIFEST).is_file() or not any(target.iterdir())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, data: dict) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")


__all__ = ["Bundle", "BundleError", "BundleExistsError", "open_bundle", "staged_bundle", "write_json",
           "sha256_file", "PackError"]
