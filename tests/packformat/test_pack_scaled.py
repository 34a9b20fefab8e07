"""Pack format 1.1: the pack's own element types, block-scale roles and the minor version."""

from __future__ import annotations

import struct
import zlib

import gguf
import numpy as np
import pytest

from packformat import (
    ElementType,
    PackIndexError,
    PackReader,
    PackWriter,
    PackWriterError,
    Role,
    ScalePairError,
    check_scale_pairs,
)
from packformat import constants as C

F4, UE8M0 = ElementType.F4_E2M1X2, ElementType.UE8M0
GATE_SHAPE, DOWN_SHAPE = (16, 64), (64, 32)


def _payload(etype, shape, rng):
    return rng.integers(0, 256, C.tensor_nbytes(etype, shape), dtype=np.uint8).tobytes()


def _role(role, etype, shape, rng):
    return (role, etype, shape, _payload(etype, shape, rng))


def _scaled_roles(rng):
    """gate and up FP4 with scales, down Q8_0: a mixed object."""
    return [_role(Role.GATE, F4, GATE_SHAPE, rng), _role(Role.UP, F4, GATE_SHAPE, rng),
            _role(Role.DOWN, ElementType.Q8_0, DOWN_SHAPE, rng),
            _role(Role.GATE_SCALE, UE8M0, (16, 2), rng), _role(Role.UP_SCALE, UE8M0, (16, 2), rng)]


def _write(path, make_roles, seed=0):
    rng = np.random.default_rng(seed)
    writer = PackWriter(path, (0, 2), 2, len(make_roles(rng)))
    written = {}
    for layer in (0, 2):
        for expert in range(2):
            written[layer, expert] = make_roles(rng)
            writer.add_object(layer, expert, written[layer, expert])
    writer.close()
    return written


def test_element_types_name_ggml_and_own_ids():
    assert all(ElementType[t.name] == t and ElementType(int(t)) == t for t in gguf.GGMLQuantizationType)
    assert ElementType.Q4_K == gguf.GGMLQuantizationType.Q4_K
    assert hash(ElementType.Q4_K) == hash(gguf.GGMLQuantizationType.Q4_K)  # interchangeable as dict keys
    assert (int(F4), int(UE8M0)) == (256, 257) and min(C.SCALE_TYPES | set(C.SCALED_WEIGHT_TYPES)) >= C.PACK_TYPE_BASE
    assert C.block_shape(F4) == (2, 1) and C.block_shape(UE8M0) == (1, 1)
    assert C.block_shape(ElementType.Q4_K) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q4_K]
    assert C.tensor_nbytes(F4, (16, 64)) == 512 and C.tensor_nbytes(UE8M0, (16, 2)) == 32
    with pytest.raises(ValueError, match="F4_E2M1X2 block of 2"):
        C.tensor_nbytes(F4, (4, 33))
    assert C.is_ggml_type(ElementType.MXFP4) and not C.is_ggml_type(F4)
    assert {F4, UE8M0} <= C.SUPPORTED_TYPES and not {F4, UE8M0} & C.SELF_CONTAINED_TYPES
    assert [int(r) for r in (Role.GATE_SCALE, Role.UP_SCALE, Role.DOWN_SCALE, Role.GATE_UP_SCALE)] == [9, 10, 11, 12]
    assert all(C.WEIGHT_ROLE_OF[C.SCALE_ROLE_OF[w]] == w for w in C.SCALE_ROLE_OF)


MINOR_CASES = [
    ((Role.GATE, ElementType.Q4_K), 0),
    ((Role.DOWN_BIAS, ElementType.F32), 0),
    ((Role.GATE, F4), 1),
    ((Role.GATE_UP_SCALE, UE8M0), 1),
]


@pytest.mark.parametrize(("role_and_type", "minor"), MINOR_CASES)
def test_minor_version_needed(role_and_type, minor):
    assert C.minor_version_needed(*role_and_type) == minor


def test_scaled_pack_round_trips_as_1_1(tmp_path):
    written = _write(tmp_path / "p.pack", _scaled_roles)
    with PackReader(tmp_path / "p.pack") as reader:
        assert (reader.header.version_major, reader.header.version_minor) == (1, 1)
        for (layer, expert), roles in written.items():
            data = reader.read_object(layer, expert)
            for (role, etype, shape, payload), entry in zip(roles, reader.entry(layer, expert).roles):
                assert (entry.role, entry.element_type, entry.shape) == (role, etype, shape)
                assert data[entry.offset: entry.offset + entry.nbytes] == payload


def test_pack_without_1_1_features_stays_1_0(tmp_path):
    _write(tmp_path / "p.pack", lambda rng: [_role(Role.GATE, ElementType.Q8_0, GATE_SHAPE, rng),
                                             _role(Role.DOWN, ElementType.F16, DOWN_SHAPE, rng)])
    with PackReader(tmp_path / "p.pack") as reader:
        assert reader.header.version_minor == 0


def _rewrite_header(path, **changes):
    raw = bytearray(path.read_bytes()[: C.HEADER_STRUCT.size])
    fields = list(C.HEADER_STRUCT.unpack(raw))
    for key, value in changes.items():
        fields[{"minor": 2, "index_crc32": 15}[key]] = value
    packed = C.HEADER_STRUCT.pack(*fields)[: C.HEADER_CRC_SPAN]
    with open(path, "r+b") as f:
        f.write(packed + struct.pack("<I", zlib.crc32(packed)))


def _rewrite_role_id(path, object_index, role_index, new_role):
    with PackReader(path) as reader:
        header = reader.header
    raw = bytearray(path.read_bytes()[header.index_offset: header.index_offset + header.index_size])
    pos = C.align_up(header.layer_count * 4, 8) + object_index * (C.OBJECT_STRUCT.size + header.roles_per_object
                                                                  * C.ROLE_STRUCT.size)
    pos += C.OBJECT_STRUCT.size + role_index * C.ROLE_STRUCT.size
    raw[pos: pos + 4] = struct.pack("<I", new_role)
    with open(path, "r+b") as f:
        f.seek(header.index_offset)
        f.write(raw)
    _rewrite_header(path, index_crc32=zlib.crc32(raw))


def test_reader_refuses_1_1_features_under_a_1_0_header(tmp_path):
    _write(tmp_path / "p.pack", _scaled_roles)
    _rewrite_header(tmp_path / "p.pack", minor=0)
    with pytest.raises(PackIndexError, match=r"object \(layer 0, expert 0\): role gate F4_E2M1X2 needs format 1.1"):
        PackReader(tmp_path / "p.pack")


def test_reader_accepts_a_newer_minor_that_uses_only_known_features(tmp_path):
    _write(tmp_path / "p.pack", _scaled_roles)
    _rewrite_header(tmp_path / "p.pack", minor=7)
    with PackReader(tmp_path / "p.pack") as reader:
        assert reader.header.version_minor == 7 and reader.verify_all() == []


def test_reader_refuses_an_fp4_weight_whose_scales_are_gone(tmp_path):
    _write(tmp_path / "p.pack", _scaled_roles)
    _rewrite_role_id(tmp_path / "p.pack", 3, 4, Role.DOWN_SCALE)  # up's scales relabelled as down's
    with pytest.raises(PackIndexError, match=r"object \(layer 2, expert 1\): up: F4_E2M1X2 needs its up_scale role"):
        PackReader(tmp_path / "p.pack")


SCALE_PAIR_CASES = [
    ("weight without scales", [(Role.GATE, F4, GATE_SHAPE)], "gate: F4_E2M1X2 needs its gate_scale role"),
    ("scales without weight",
     [(Role.UP, F4, GATE_SHAPE), (Role.UP_SCALE, UE8M0, (16, 2)), (Role.GATE_SCALE, UE8M0, (16, 2))],
     "gate_scale: scales without their gate role"),
    ("scales of a GGML weight", [(Role.GATE, ElementType.Q8_0, GATE_SHAPE), (Role.GATE_SCALE, UE8M0, (16, 2))],
     "gate is Q8_0, a type that takes no scale role"),
    ("group of 16", [(Role.GATE, F4, GATE_SHAPE), (Role.GATE_SCALE, UE8M0, (16, 4))], "expected (16, 2)"),
    ("rows differ", [(Role.GATE, F4, GATE_SHAPE), (Role.GATE_SCALE, UE8M0, (8, 2))], "does not scale gate (16, 64)"),
    ("ndim differs", [(Role.GATE, F4, GATE_SHAPE), (Role.GATE_SCALE, UE8M0, (32,))], "does not scale"),
    ("scale type F16", [(Role.GATE, F4, GATE_SHAPE), (Role.GATE_SCALE, ElementType.F16, (16, 2))],
     "F4_E2M1X2 weights take UE8M0 scales, not F16"),
    ("UE8M0 as a weight", [(Role.DOWN, UE8M0, DOWN_SHAPE)], "down: UE8M0 is a scale type"),
    ("FP4 bias", [(Role.GATE_BIAS, F4, (16,))],
     "gate_bias: F4_E2M1X2 needs block scales, and this role has no scale role"),
]


@pytest.mark.parametrize(("name", "roles", "message"), SCALE_PAIR_CASES, ids=[c[0] for c in SCALE_PAIR_CASES])
def test_scale_pairs_are_checked_by_rules_and_by_the_writer(tmp_path, name, roles, message):
    with pytest.raises(ScalePairError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_scale_pairs(roles)
    writer = PackWriter(tmp_path / "p.pack", (5,), 1, len(roles))
    rng = np.random.default_rng(0)
    with pytest.raises(PackWriterError) as caught:
        writer.add_object(5, 0, [_role(role, etype, shape, rng) for role, etype, shape in roles])
    assert "(layer 5, expert 0)" in str(caught.value) and message in str(caught.value)
    writer.abort()


def test_fused_gate_up_with_its_scales_is_a_valid_pair():
    check_scale_pairs([(Role.GATE_UP, F4, (32, 64)), (Role.GATE_UP_SCALE, UE8M0, (32, 2)),
                       (Role.DOWN, F4, DOWN_SHAPE), (Role.DOWN_SCALE, UE8M0, (64, 1))])
