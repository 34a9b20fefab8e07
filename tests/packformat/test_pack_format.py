"""The pack writer and the validating reader: round trip, and every structural rule."""

from __future__ import annotations

import struct
import zlib

import numpy as np
import pytest

from packformat import (
    ElementType,
    ObjectChecksumError,
    PackFormatError,
    PackIndexError,
    PackReader,
    PackVersionError,
    PackWriter,
    PackWriterError,
    Role,
)
from packformat import constants as C

LAYERS = (1, 3)
EXPERTS = 4
SHAPES = {Role.GATE: (16, 64), Role.UP: (16, 64), Role.DOWN: (64, 16)}
TYPES = {Role.GATE: ElementType.Q8_0, Role.UP: ElementType.F16, Role.DOWN: ElementType.Q4_K}


def _roles(rng, down_cols=None):
    out = []
    for role in (Role.GATE, Role.UP, Role.DOWN):
        shape = SHAPES[role] if role is not Role.DOWN else (64, 256)
        nbytes = C.tensor_nbytes(TYPES[role], shape)
        out.append((role, TYPES[role], shape, rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()))
    return out


@pytest.fixture
def pack(tmp_path):
    rng = np.random.default_rng(7)
    path = tmp_path / "experts.pack"
    writer = PackWriter(path, LAYERS, EXPERTS, 3)
    payloads = {}
    for layer in LAYERS:
        for expert in range(EXPERTS):
            roles = _roles(rng)
            payloads[layer, expert] = roles
            writer.add_object(layer, expert, roles)
    writer.close()
    return path, payloads


def test_round_trip_bytes_and_layout(pack):
    path, payloads = pack
    with PackReader(path) as reader:
        assert reader.layers == LAYERS
        assert reader.header.object_stride and reader.header.object_stride % C.ALIGNMENT == 0
        for (layer, expert), roles in payloads.items():
            obj = reader.entry(layer, expert)
            assert obj.offset % C.ALIGNMENT == 0
            data = reader.read_object(layer, expert)
            for (role, etype, shape, payload), entry in zip(roles, obj.roles):
                assert (entry.role, entry.element_type, entry.shape) == (role, etype, shape)
                assert entry.offset % C.ROLE_ALIGNMENT == 0
                assert data[entry.offset: entry.offset + entry.nbytes] == payload
        assert reader.verify_all() == []
        with pytest.raises(KeyError):
            reader.entry(2, 0)
        with pytest.raises(KeyError):
            reader.entry(1, EXPERTS)


def test_object_offsets_are_computable_from_header(pack):
    path, _ = pack
    with PackReader(path) as reader:
        h = reader.header
        for n, obj in enumerate(reader):
            assert obj.offset == h.data_offset + n * h.object_stride


def _patch(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def _rewrite_header(path, **changes):
    """Change header fields and fix the header checksum so only the named rule fails."""
    raw = bytearray(path.read_bytes()[: C.HEADER_STRUCT.size])
    fields = list(C.HEADER_STRUCT.unpack(raw))
    names = ["magic", "major", "minor", "header_size", "alignment", "role_alignment", "layer_count",
             "expert_count", "roles_per_object", "flags", "index_offset", "index_size", "data_offset",
             "object_stride", "file_size", "index_crc32", "header_crc32"]
    for key, value in changes.items():
        fields[names.index(key)] = value
    packed = C.HEADER_STRUCT.pack(*fields)
    crc = zlib.crc32(packed[: C.HEADER_CRC_SPAN])
    _patch(path, 0, packed[: C.HEADER_CRC_SPAN] + struct.pack("<I", crc))


def _rewrite_index(path, mutate):
    """Apply mutate(bytearray index) and fix the index checksum in the header."""
    with PackReader(path) as reader:
        h = reader.header
    raw = bytearray(path.read_bytes()[h.index_offset: h.index_offset + h.index_size])
    mutate(raw)
    _patch(path, h.index_offset, bytes(raw))
    _rewrite_header(path, index_crc32=zlib.crc32(raw))


def _first_entry_pos(raw_layers=len(LAYERS)):
    return C.align_up(raw_layers * 4, 8)


def _entry_pos(n):
    return _first_entry_pos() + n * (C.OBJECT_STRUCT.size + 3 * C.ROLE_STRUCT.size)


def _set_u64(raw, pos, value):
    raw[pos: pos + 8] = struct.pack("<Q", value)


def _set_u32(raw, pos, value):
    raw[pos: pos + 4] = struct.pack("<I", value)


BAD_PACKS = [
    ("wrong magic", lambda p: _patch(p, 0, b"NOTAPACK"), PackFormatError, "bad magic"),
    ("newer major version", lambda p: _rewrite_header(p, major=2), PackVersionError, "format version 2"),
    ("header checksum", lambda p: _patch(p, 24, b"\x09"), PackFormatError, "header checksum"),
    ("wrong alignment", lambda p: _rewrite_header(p, alignment=512), PackFormatError, "alignment 512"),
    ("truncated pack", lambda p: p.write_bytes(p.read_bytes()[:-4096]), PackFormatError, "truncated"),
    ("trailing bytes", lambda p: p.write_bytes(p.read_bytes() + b"\0"), PackFormatError, "trailing"),
    ("shorter than header", lambda p: p.write_bytes(b"EXPTPACK"), PackFormatError, "shorter than the header"),
    ("index checksum", lambda p: _patch(p, C.HEADER_SIZE + 40, b"\xff"), PackFormatError, "index checksum"),
    ("index size vs counts", lambda p: _rewrite_header(p, expert_count=5), PackFormatError, "index_size"),
    ("unaligned object", lambda p: _rewrite_index(p, lambda r: _set_u64(r, _entry_pos(1) + 8, 8192 + 4096 * 2 + 512)),
     PackIndexError, "not 4096-aligned"),
    ("overlapping objects", lambda p: _rewrite_index(p, lambda r: _set_u64(r, _entry_pos(1) + 8, 8192)),
     PackIndexError, "overlaps"),
    ("object out of bounds", lambda p: _rewrite_index(p, lambda r: _set_u64(r, _entry_pos(7) + 8, 1 << 40)),
     PackIndexError, "outside the file"),
    ("missing expert", lambda p: _rewrite_index(p, lambda r: _set_u32(r, _entry_pos(2) + 4, 3)),
     PackIndexError, "expected (layer 1, expert 2)"),
    ("layer table order", lambda p: _rewrite_index(p, lambda r: _set_u32(r, 0, 5)),
     PackFormatError, "strictly increasing"),
    ("unknown role", lambda p: _rewrite_index(p, lambda r: _set_u32(r, _entry_pos(0) + 32, 99)),
     PackIndexError, "unknown role id 99"),
    ("unsupported type", lambda p: _rewrite_index(p, lambda r: _set_u32(r, _entry_pos(0) + 36, int(ElementType.IQ2_XXS))),
     PackIndexError, "IQ2_XXS"),
    ("nbytes vs shape", lambda p: _rewrite_index(p, lambda r: _set_u64(r, _entry_pos(0) + 32 + 16, 32)),
     PackIndexError, "needs"),
    ("dims past ndim", lambda p: _rewrite_index(p, lambda r: _set_u64(r, _entry_pos(0) + 32 + 56, 7)),
     PackIndexError, "bad shape"),
]


@pytest.mark.parametrize("name,corrupt,error,message", BAD_PACKS, ids=[b[0] for b in BAD_PACKS])
def test_reader_rejects_bad_structure(pack, name, corrupt, error, message):
    path, _ = pack
    corrupt(path)
    with pytest.raises(error) as info:
        PackReader(path)
    assert message in str(info.value)
    assert str(path) in str(info.value)


def test_flipped_byte_names_the_object(pack):
    path, _ = pack
    with PackReader(path) as reader:
        victim = reader.entry(3, 2)
    _patch(path, victim.offset + 100, bytes([path.read_bytes()[victim.offset + 100] ^ 0x01]))
    with PackReader(path) as reader:  # structure is still valid
        failures = reader.verify_all()
        assert [(f.layer, f.expert) for f in failures] == [(3, 2)]
        assert f"byte {victim.offset}" in str(failures[0])
        with pytest.raises(ObjectChecksumError):
            reader.read_object(3, 2)
        reader.read_object(3, 1)  # neighbours unaffected


WRITER_MISUSE = [
    ("out of order", lambda w, r: w.add_object(1, 1, r), "expected (1, 0)"),
    ("wrong role count", lambda w, r: w.add_object(1, 0, r[:2]), "2 roles"),
    ("payload size", lambda w, r: w.add_object(1, 0, [r[0], r[1], (Role.DOWN, ElementType.Q4_K, (64, 256), b"x")]),
     "needs"),
    ("partial block", lambda w, r: w.add_object(1, 0, [r[0], r[1], (Role.DOWN, ElementType.Q4_K, (64, 100), b"")]),
     "not a multiple"),
    ("unsupported type", lambda w, r: w.add_object(1, 0, [r[0], r[1], (Role.DOWN, ElementType.Q8_1, (1, 32), b"")]),
     "not supported"),
    ("close incomplete", lambda w, r: w.close(), "next missing is (layer 1, expert 0)"),
]


@pytest.mark.parametrize("name,misuse,message", WRITER_MISUSE, ids=[m[0] for m in WRITER_MISUSE])
def test_writer_refuses_misuse(tmp_path, name, misuse, message):
    writer = PackWriter(tmp_path / "p.pack", LAYERS, EXPERTS, 3)
    with pytest.raises(PackWriterError, match=message.replace("(", r"\(").replace(")", r"\)")):
        misuse(writer, _roles(np.random.default_rng(0)))
    writer.abort()
    assert not (tmp_path / "p.pack").exists()


def test_unfinished_pack_has_no_valid_header(tmp_path):
    path = tmp_path / "p.pack"
    writer = PackWriter(path, LAYERS, EXPERTS, 3)
    writer.add_object(1, 0, _roles(np.random.default_rng(0)))
    writer._file.flush()  # a crash now leaves this on disk
    with pytest.raises(PackFormatError, match="bad magic"):
        PackReader(path)
    writer.abort()
