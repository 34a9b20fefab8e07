"""The element-type registry: records agree with gguf-py, the type sets derive from it, and a
per-type table of another layer that misses a type is refused."""

from __future__ import annotations

import gguf
import pytest

from packformat import constants as C
from packformat import quant_types as Q
from packformat.quant_types import QUANT_TYPES, ElementType, QuantType, ScaleRule

GGML_RECORDS = [q for q in QUANT_TYPES.values() if q.gguf_type is not None]


@pytest.mark.parametrize("record", GGML_RECORDS, ids=lambda q: q.element_type.name)
def test_ggml_record_matches_gguf_py(record: QuantType) -> None:
    assert int(record.gguf_type) == int(record.element_type)
    assert (record.block_elements, record.block_bytes) == gguf.GGML_QUANT_SIZES[record.gguf_type]
    assert Q.block_shape(record.element_type) == gguf.GGML_QUANT_SIZES[record.gguf_type]
    assert record.file_type is not None  # a GGUF whose experts are of it names a llama.cpp file type


def test_type_sets_derive_from_the_registry() -> None:
    assert C.SUPPORTED_TYPES == set(QUANT_TYPES)
    assert C.SELF_CONTAINED_TYPES == {t for t, q in QUANT_TYPES.items() if q.self_contained}
    assert dict(C.SCALED_WEIGHT_TYPES) == {t: q.scale_rule for t, q in QUANT_TYPES.items() if q.scale_rule}
    assert C.SCALE_TYPES == {t for t, q in QUANT_TYPES.items() if q.is_scale}
    # every type is exactly one of: self-contained, scaled weight, scale
    assert C.SELF_CONTAINED_TYPES | set(C.SCALED_WEIGHT_TYPES) | C.SCALE_TYPES == C.SUPPORTED_TYPES
    assert len(C.SELF_CONTAINED_TYPES) + len(C.SCALED_WEIGHT_TYPES) + len(C.SCALE_TYPES) == len(QUANT_TYPES)
    for etype, record in QUANT_TYPES.items():
        assert record.element_type is etype
        assert C.minor_version_needed(C.Role.GATE, etype) == record.since_minor
        assert (record.gguf_type is None) == (int(etype) >= C.PACK_TYPE_BASE)


def test_constants_reexports_the_registry_objects() -> None:
    assert C.ElementType is ElementType and C.QUANT_TYPES is QUANT_TYPES and C.block_shape is Q.block_shape
    assert ElementType.Q4_K == gguf.GGMLQuantizationType.Q4_K and ElementType(256).name == "F4_E2M1X2"


def test_registry_is_read_only() -> None:
    with pytest.raises(TypeError):
        QUANT_TYPES[ElementType.Q8_1] = QUANT_TYPES[ElementType.Q8_0]  # type: ignore[index]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(element_type=ElementType.Q8_0, block_elements=32, block_bytes=35,
              gguf_type=gguf.GGMLQuantizationType.Q8_0, file_type=None), "block shape differs"),
        (dict(element_type=ElementType.Q8_0, block_elements=32, block_bytes=34,
              gguf_type=gguf.GGMLQuantizationType.Q4_0, file_type=None), "has another id"),
        (dict(element_type=ElementType.Q8_0, block_elements=32, block_bytes=34,
              gguf_type=None, file_type=None), "needs its gguf_type"),
        (dict(element_type=ElementType.UE8M0, block_elements=0, block_bytes=1,
              gguf_type=None, file_type=None), "must be positive"),
        (dict(element_type=ElementType.UE8M0, block_elements=1, block_bytes=1, gguf_type=None, file_type=None,
              is_scale=True, scale_rule=ScaleRule(ElementType.UE8M0, frozenset({32}))), "not both"),
    ],
    ids=["shape", "id", "ggml-id-without-gguf-type", "empty-block", "scaled-and-scale"],
)
def test_record_refuses_inconsistent_fields(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        QuantType(**kwargs)


def test_registry_refuses_duplicates_and_unregistered_scale_types() -> None:
    q8 = QUANT_TYPES[ElementType.Q8_0]
    with pytest.raises(ValueError, match="Q8_0 is registered twice"):
        Q._registry([q8, q8])
    with pytest.raises(ValueError, match="scale type UE8M0 is not a registered scale type"):
        Q._registry([QUANT_TYPES[ElementType.F4_E2M1X2]])


def test_require_entries_names_missing_and_extra_types() -> None:
    expected = [ElementType.Q8_0, ElementType.Q4_0]
    Q.require_entries("t", {ElementType.Q8_0: 1, ElementType.Q4_0: 2}, expected)
    with pytest.raises(LookupError, match=r"t does not match .*missing Q4_0; not registered none"):
        Q.require_entries("t", {ElementType.Q8_0: 1}, expected)
    with pytest.raises(LookupError, match=r"missing none; not registered Q8_1"):
        Q.require_entries("t", {ElementType.Q8_0: 1, ElementType.Q4_0: 2, ElementType.Q8_1: 3}, expected)


def test_block_shape_of_an_unregistered_ggml_type_is_gguf_pys() -> None:
    assert Q.block_shape(ElementType.Q8_1) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
