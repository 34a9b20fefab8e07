"""Bad-input rows for the bundles storaged is given: a good bundle with one thing broken.

Each row edits a copy of a good test bundle; storaged must refuse to start (exit 1) with one line
naming the model, the file and what is wrong in it. Pack edits other than deliberate checksum
damage re-seal the header and index checksums, so the edit itself is what the reader must find.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bad_input_config import EXIT_STARTUP, Row
from packformat import constants as C

Edit = Callable[[Path], None]


@dataclass(frozen=True)
class BundleRow(Row):
    edit: Edit | None = None  # applied to a copy of the good bundle


# ---- edits -----------------------------------------------------------------------------------------

def remove(name: str) -> Edit:
    def edit(bundle: Path) -> None:
        (bundle / name).unlink()
    return edit


def replace_with_directory(name: str) -> Edit:
    def edit(bundle: Path) -> None:
        (bundle / name).unlink()
        (bundle / name).mkdir()
    return edit


def dangling_symlink(name: str) -> Edit:
    def edit(bundle: Path) -> None:
        (bundle / name).unlink()
        (bundle / name).symlink_to(bundle / "nowhere")
    return edit


def write(name: str, data: bytes) -> Edit:
    def edit(bundle: Path) -> None:
        (bundle / name).write_bytes(data)
    return edit


def append(name: str, data: bytes) -> Edit:
    def edit(bundle: Path) -> None:
        with open(bundle / name, "ab") as f:
            f.write(data)
    return edit


def truncate(name: str, size: int | None = None, *, by: int = 0) -> Edit:
    def edit(bundle: Path) -> None:
        path = bundle / name
        os.truncate(path, size if size is not None else path.stat().st_size - by)
    return edit


def manifest(change: Callable[[dict], None]) -> Edit:
    def edit(bundle: Path) -> None:
        data = json.loads((bundle / "manifest.json").read_text())
        change(data)
        (bundle / "manifest.json").write_text(json.dumps(data))
    return edit


def config_json(change: Callable[[dict], None]) -> Edit:
    def edit(bundle: Path) -> None:
        data = json.loads((bundle / "config.json").read_text())
        change(data)
        (bundle / "config.json").write_text(json.dumps(data))
    return edit


def _entry_offset(fields: list, n: int) -> int:
    """File offset of object entry n in the index."""
    layers, roles = fields[6], fields[8]
    entry = C.OBJECT_STRUCT.size + roles * C.ROLE_STRUCT.size
    return fields[10] + C.align_up(layers * C.LAYER_STRUCT.size, 8) + n * entry


def pack(change: Callable[[bytearray, list], None], *, reseal: bool = True) -> Edit:
    """Apply `change(file bytes, header fields)`; then (reseal) recompute both checksums."""
    def edit(bundle: Path) -> None:
        path = bundle / "experts.pack"
        data = bytearray(path.read_bytes())
        original = list(C.HEADER_STRUCT.unpack_from(data, 0))
        fields = list(original)
        change(data, fields)
        if reseal:
            start, size = fields[10], fields[11]
            fields[15] = zlib.crc32(data[start:start + size])
            fields[16] = zlib.crc32(C.HEADER_STRUCT.pack(*fields)[:C.HEADER_CRC_SPAN])
        if fields != original:  # else a flipped header byte would be written back
            C.HEADER_STRUCT.pack_into(data, 0, *fields)
        path.write_bytes(bytes(data))
    return edit


def header_field(index: int, value: int) -> Edit:
    def change(data: bytearray, fields: list) -> None:
        fields[index] = value
    return pack(change)


def object_field(n: int, field: int, value: Callable[[int], int]) -> Edit:
    """Object entry n's field (0 layer, 1 expert, 2 offset, 3 size, 4 crc32, 5 role_count)."""
    def change(data: bytearray, fields: list) -> None:
        at = _entry_offset(fields, n)
        values = list(C.OBJECT_STRUCT.unpack_from(data, at))
        values[field] = value(values[field])
        C.OBJECT_STRUCT.pack_into(data, at, *values)
    return pack(change)


def role_field(n: int, role: int, field: int, value: Callable[[int], int]) -> Edit:
    """Role `role` of object entry n: field 0 role id, 1 type, 2 offset, 3 nbytes, 4 ndim, 6.. dims."""
    def change(data: bytearray, fields: list) -> None:
        at = _entry_offset(fields, n) + C.OBJECT_STRUCT.size + role * C.ROLE_STRUCT.size
        values = list(C.ROLE_STRUCT.unpack_from(data, at))
        values[field] = value(values[field])
        C.ROLE_STRUCT.pack_into(data, at, *values)
    return pack(change)


def swap_layers(data: bytearray, fields: list) -> None:
    first, second = C.LAYER_STRUCT.unpack_from(data, fields[10]), C.LAYER_STRUCT.unpack_from(data, fields[10] + 4)
    C.LAYER_STRUCT.pack_into(data, fields[10], *second)
    C.LAYER_STRUCT.pack_into(data, fields[10] + 4, *first)


def flip(offset: Callable[[list], int]) -> Edit:
    def change(data: bytearray, fields: list) -> None:
        data[offset(fields)] ^= 0x01
    return pack(change, reseal=False)


# ---- rows -------------------------------------------------------------------------------------------

def _row(id_: str, edit: Edit, *needles: str) -> BundleRow:
    return BundleRow("bundles", id_, EXIT_STARTUP, ("storaged: error: model 'tiny'", *needles), edit)


def _gone(bundle: Path) -> None:
    shutil.rmtree(bundle)


def _a_file(bundle: Path) -> None:
    shutil.rmtree(bundle)
    bundle.write_text("not a directory")


M, P, D, CFG = "manifest.json", "experts.pack", "dense.safetensors", "config.json"

BUNDLE_ROWS: list[BundleRow] = [
    _row("no-directory", _gone, "not a bundle directory"),
    _row("a-file", _a_file, "not a bundle directory"),
    *[_row(f"no-{name}", remove(name), name, "missing") for name in (M, P, D, CFG)],
    *[_row(f"{name}-a-directory", replace_with_directory(name), name, "missing") for name in (M, P)],
    _row("manifest-dangling-symlink", dangling_symlink(M), M, "missing"),
    _row("manifest-not-json", write(M, b'{"format": "expertpack-bundle",'), M, "not valid JSON"),
    _row("manifest-empty", write(M, b""), M, "not valid JSON"),
    _row("manifest-not-utf8", write(M, b'{"format": "\xff"}'), M, "not valid JSON"),
    _row("manifest-a-list", write(M, b"[1, 2]"), M, "expected a JSON object"),
    _row("manifest-format", manifest(lambda m: m.update(format="other")), M, "format is 'other'"),
    _row("manifest-no-format", manifest(lambda m: m.pop("format")), M, "format is None"),
    _row("manifest-version-2", manifest(lambda m: m.update(version=2)), M, "bundle version 2"),
    _row("manifest-version-string", manifest(lambda m: m.update(version="1")), M, "bundle version '1'"),
    _row("manifest-pack-size", manifest(lambda m: m["pack"].update(size=m["pack"]["size"] + 4096)), M, "pack size"),
    _row("manifest-pack-size-string", manifest(lambda m: m["pack"].update(size=str(m["pack"]["size"]))), M,
         "pack size"),
    _row("manifest-index-crc", manifest(lambda m: m["pack"].update(index_crc32=m["pack"]["index_crc32"] ^ 1)), M,
         "pack index crc32"),
    _row("manifest-no-pack", manifest(lambda m: m.pop("pack")), M, "pack size is None"),
    _row("manifest-layers", manifest(lambda m: m["experts"].update(moe_layers=[1, 2])), M, "moe layers"),
    _row("manifest-layers-string", manifest(lambda m: m["experts"].update(moe_layers="1,2,4")), M, "moe layers"),
    _row("manifest-experts", manifest(lambda m: m["experts"].update(num_experts=5)), M, "experts per layer"),
    _row("manifest-experts-string", manifest(lambda m: m["experts"].update(num_experts="8")), M, "experts per layer"),
    _row("manifest-dense-size", manifest(lambda m: m["dense"].update(size=65)), D, "manifest says 65"),
    _row("manifest-config-hash", manifest(lambda m: m.update(config_sha256="0" * 64)), CFG, "config_sha256"),
    _row("manifest-model-type", manifest(lambda m: m.update(model_type="mixtral")), CFG, "model_type"),
    _row("config-not-json", write(CFG, b"{"), CFG, "not valid JSON"),
    _row("config-a-list", write(CFG, b"[]"), CFG, "expected a JSON object"),
    _row("config-edited", config_json(lambda c: c.update(hidden_size=65)), CFG, "config_sha256"),
    _row("dense-longer", append(D, b"\0" * 8), D, "manifest says 64"),
    _row("pack-truncated", truncate(P, by=4096), P, "truncated"),
    _row("pack-shorter-than-header", truncate(P, 10), P, "shorter than the header"),
    _row("pack-empty", truncate(P, 0), P, "shorter than the header"),
    _row("pack-trailing-bytes", append(P, b"\0" * 4096), P, "trailing bytes"),
    _row("pack-bad-magic", pack(lambda d, f: f.__setitem__(0, b"NOTAPACK"), reseal=False), P, "bad magic"),
    _row("pack-header-crc", flip(lambda f: 30), P, "header checksum mismatch"),
    _row("pack-index-crc", flip(lambda f: f[10] + 40), P, "index checksum mismatch"),
    _row("pack-version-2", header_field(1, 2), P, "format version 2"),
    _row("pack-header-size", header_field(3, 8192), P, "header_size 8192"),
    _row("pack-alignment", header_field(4, 512), P, "alignment 512 != 4096"),
    _row("pack-role-alignment", header_field(5, 128), P, "role_alignment 128"),
    _row("pack-no-experts", header_field(7, 0), P, "expert_count must be > 0"),
    _row("pack-roles-per-object", header_field(8, 0), P, "roles_per_object 0"),
    _row("pack-flags", header_field(9, 4), P, "unknown flags 0x4"),
    _row("pack-index-offset", header_field(10, 8192), P, "index_offset 8192"),
    _row("pack-stride", header_field(13, 100), P, "object_stride 100 unaligned"),
    _row("pack-layers-unordered", pack(swap_layers), P, "not strictly increasing"),
    _row("pack-entry-order", object_field(1, 1, lambda e: 0), P, "index entry 1", "out of order"),
    _row("pack-object-unaligned", object_field(1, 2, lambda o: o + 512), P, "expert 1", "not 4096-aligned"),
    _row("pack-object-overlap", object_field(1, 2, lambda o: o - 4096), P, "expert 1", "overlaps"),
    _row("pack-object-outside", object_field(23, 2, lambda o: o + (1 << 20)), P, "expert 7", "outside the file"),
    _row("pack-object-empty", object_field(0, 3, lambda s: 0), P, "expert 0", "outside the file"),
    _row("pack-role-count", object_field(0, 5, lambda n: 2), P, "expert 0", "role_count 2"),
    _row("pack-role-id", role_field(0, 0, 0, lambda r: 99), P, "expert 0", "unknown role id 99"),
    _row("pack-element-type", role_field(0, 0, 1, lambda t: 9999), P, "expert 0", "unknown element type id 9999"),
    _row("pack-role-nbytes", role_field(0, 0, 3, lambda n: n + 1), P, "expert 0", "nbytes"),
    _row("pack-role-unaligned", role_field(0, 1, 2, lambda o: o + 16), P, "expert 0", "unaligned"),
    _row("pack-role-shape", role_field(0, 0, 6, lambda d: 0), P, "expert 0", "bad shape"),
]
