"""A pack bundle on disk: manifest.json, experts.pack, dense.safetensors, config.json, tokenizer.

`staged_bundle` gives a temporary directory beside the target that becomes the bundle only by
one rename at the end, so an interrupted build never leaves something that looks complete.
`open_bundle` is the one way storaged, inference and packtools open a bundle: it checks the
manifest against the pack and the files before anyone reads an expert.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from packformat import PackError, PackReader

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
    """The output exists and --force was not given (or another build made it meanwhile)."""


class BundleWriteError(OSError):
    """The filesystem refused the bundle's bytes (full, over quota, file too large); names the output."""


# errors of writing, not of reading the source: they are about the output's filesystem
_WRITE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


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
        if in_manifest == in_pack:
            continue
        if in_manifest not in (None, []) and _json_type(in_manifest) != _json_type(in_pack):
            # "is '32' but ... has 32" reads as a contradiction: name the types
            raise BundleError(f"{where}: {what} must be a JSON {_json_type(in_pack)} ({root / PACK} has "
                              f"{in_pack!r}), not the {_json_type(in_manifest)} {in_manifest!r}")
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


def _json_type(value: object) -> str:
    """'integer', 'string', 'array of integers'...: what a manifest value is, in JSON's words."""
    if isinstance(value, list):
        items = {_json_type(v) for v in value}
        return f"array of {items.pop()}s" if len(items) == 1 else "array"
    kinds = ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (dict, "object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), type(value).__name__)


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
        try:
            yield staging
            _fsync_dir(staging)
        except OSError as exc:
            if exc.errno in _WRITE_ERRNOS:  # raised by a write() that names no file: name the output
                raise BundleWriteError(exc.errno, f"{target}: cannot write the bundle into {target.parent}: "
                                       f"{exc.strerror}; nothing was left behind") from exc
            raise
        _publish(staging, target, force=force)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _made_meanwhile(target: Path) -> BundleExistsError:
    return BundleExistsError(f"{target}: another build created it while this one ran; this build's output was "
                             "discarded (run it again with --force to replace that one)")


def _publish(staging: Path, target: Path, *, force: bool) -> None:
    """Rename the finished staging directory to `target`; a concurrent build into the same output
    that finished first keeps it, unless this build was asked to replace it (--force)."""
    if target.exists():
        if not force:
            raise _made_meanwhile(target)
        if not _replaceable(target):
            raise BundleExistsError(f"{target}: exists and is not a bundle (no {MANIFEST}) nor an empty directory; "
                                    "--force only replaces a bundle, remove it yourself if it is meant to go")
        # Replace in two renames so a crash leaves either the old or the new bundle.
        old = target.parent / f".{target.name}.old-{os.getpid()}"
        os.rename(target, old)
        try:
            os.rename(staging, target)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                os.rename(old, target)
                raise
            shutil.rmtree(old, ignore_errors=True)  # replaced, by the other build
            raise _made_meanwhile(target) from None
        shutil.rmtree(old, ignore_errors=True)
    else:
        try:
            os.rename(staging, target)
        except OSError as exc:
            # rename(2) onto a directory another build has just filled: "Directory not empty"
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise _made_meanwhile(target) from None
            raise
    _fsync_dir(target.parent)


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
