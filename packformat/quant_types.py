"""The element types a pack may hold: one record per quant type, the registry all tables derive from.

A record holds what the format says about a type: its block shape, the gguf-py/llama.cpp type of
the same layout, the llama.cpp file type of a model whose experts are of it, and whether it needs
(or is) a block-scale role. What other layers attach to a type (torch and Triton dequantizers in
inference.dequant.registry, quantizer and random fill in packtools.quants.registry) is keyed by
ElementType and checked against QUANT_TYPES with `require_entries`, so a type missing from one of
those tables fails on import. docs/pack-format.md, "Adding an element type", lists the steps.

Element type ids: GGML's (gguf.GGMLQuantizationType) keep their ids so a GGUF role keeps its id;
the pack's own types (formats GGML has no type for) take ids from PACK_TYPE_BASE up, a range
GGML's 32-bit type field will not reach, so the two tables never collide.
"""

from __future__ import annotations

import dataclasses
import enum
import types
from collections.abc import Collection, Iterable, Mapping

import gguf

PACK_TYPE_BASE = 256  # first id of the pack's own element types
_PACK_OWN_TYPES = {
    # Two FP4 E2M1 values per byte; element 2j is the low nibble of byte j (see docs/pack-format.md).
    "F4_E2M1X2": 256,
    # One unsigned power-of-two exponent per byte: 2**(b - 127); 0xFF is NaN.
    "UE8M0": 257,
}
assert max(int(t) for t in gguf.GGMLQuantizationType) < PACK_TYPE_BASE

# Every GGML type under its GGML name and id, plus the pack's own types: one enum, so
# ElementType(id).name works for any id a pack may hold, and a member compares and hashes
# equal to the gguf.GGMLQuantizationType member of the same id.
ElementType = enum.IntEnum(  # type: ignore[misc]
    "ElementType",
    [(t.name, int(t)) for t in gguf.GGMLQuantizationType] + list(_PACK_OWN_TYPES.items()),
    module="packformat.constants",  # constants re-exports it: reprs and pickles name that module
)
ElementType.__doc__ = "Element type ids of a pack role: GGML's (< 256) and the pack's own (>= 256)."


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """How a weight type that needs a companion scale role is scaled."""

    scale_type: ElementType
    group_sizes: frozenset[int]  # weight elements per scale along the last dim


@dataclasses.dataclass(frozen=True)
class QuantType:
    """What the pack format says about one element type."""

    element_type: ElementType
    block_elements: int  # elements per block along the last dim
    block_bytes: int  # bytes per block
    gguf_type: gguf.GGMLQuantizationType | None  # the GGML type of this layout; None for the pack's own
    file_type: gguf.LlamaFileType | None  # general.file_type of a GGUF whose experts are of this type
    scale_rule: ScaleRule | None = None  # set for weights meaningless without their scale role
    is_scale: bool = False  # a block-scale type: appears only in scale roles
    since_minor: int = 0  # the format minor version that introduced it

    def __post_init__(self) -> None:
        if self.block_elements <= 0 or self.block_bytes <= 0:
            raise ValueError(f"{self.element_type.name}: block shape must be positive, "
                             f"got ({self.block_elements}, {self.block_bytes})")
        if self.gguf_type is not None:
            if int(self.gguf_type) != int(self.element_type):
                raise ValueError(f"{self.element_type.name}: GGML type {self.gguf_type.name} has another id")
            if gguf.GGML_QUANT_SIZES[self.gguf_type] != (self.block_elements, self.block_bytes):
                raise ValueError(f"{self.element_type.name}: block shape differs from gguf-py's "
                                 f"{gguf.GGML_QUANT_SIZES[self.gguf_type]}")
        elif int(self.element_type) < PACK_TYPE_BASE:
            raise ValueError(f"{self.element_type.name}: a GGML id needs its gguf_type")
        if self.scale_rule is not None and self.is_scale:
            raise ValueError(f"{self.element_type.name}: a type is either scaled or a scale, not both")

    @property
    def self_contained(self) -> bool:
        """Its role bytes dequantize on their own as weights (neither scaled nor a scale)."""
        return self.scale_rule is None and not self.is_scale


def _ggml(name: str, file_type: gguf.LlamaFileType) -> QuantType:
    gguf_type = gguf.GGMLQuantizationType[name]
    block_elements, block_bytes = gguf.GGML_QUANT_SIZES[gguf_type]
    return QuantType(ElementType[name], block_elements, block_bytes, gguf_type, file_type)


def _registry(records: Iterable[QuantType]) -> Mapping[ElementType, QuantType]:
    table: dict[ElementType, QuantType] = {}
    for record in records:
        if record.element_type in table:
            raise ValueError(f"element type {record.element_type.name} is registered twice")
        table[record.element_type] = record
    for record in table.values():
        rule = record.scale_rule
        if rule is not None and (rule.scale_type not in table or not table[rule.scale_type].is_scale):
            raise ValueError(
                f"{record.element_type.name}: scale type {rule.scale_type.name} is not a registered scale type"
            )
    return types.MappingProxyType(table)


_LFT = gguf.LlamaFileType
# The registry: every type a pack may hold, one record each; others are refused by the writer and
# the reader. Order is the order tools list them in.
QUANT_TYPES: Mapping[ElementType, QuantType] = _registry([
    _ggml("F32", _LFT.ALL_F32),
    _ggml("F16", _LFT.MOSTLY_F16),
    _ggml("BF16", _LFT.MOSTLY_BF16),
    _ggml("Q8_0", _LFT.MOSTLY_Q8_0),
    _ggml("Q4_0", _LFT.MOSTLY_Q4_0),
    _ggml("Q4_1", _LFT.MOSTLY_Q4_1),
    _ggml("Q5_0", _LFT.MOSTLY_Q5_0),
    _ggml("Q5_1", _LFT.MOSTLY_Q5_1),
    _ggml("Q2_K", _LFT.MOSTLY_Q2_K),
    _ggml("Q3_K", _LFT.MOSTLY_Q3_K_M),
    _ggml("Q4_K", _LFT.MOSTLY_Q4_K_M),
    _ggml("Q5_K", _LFT.MOSTLY_Q5_K_M),
    _ggml("Q6_K", _LFT.MOSTLY_Q6_K),
    _ggml("MXFP4", _LFT.MOSTLY_MXFP4_MOE),
    QuantType(ElementType.F4_E2M1X2, 2, 1, None, None,
              scale_rule=ScaleRule(ElementType.UE8M0, frozenset({32})), since_minor=1),
    QuantType(ElementType.UE8M0, 1, 1, None, None, is_scale=True, since_minor=1),
])

# Derived views of the registry.
# Types whose role bytes dequantize on their own: the types of format 1.0, all GGML's.
SELF_CONTAINED_TYPES: frozenset[ElementType] = frozenset(t for t, q in QUANT_TYPES.items() if q.self_contained)
# Weight types that are only meaningful with a scale role next to them.
SCALED_WEIGHT_TYPES: Mapping[ElementType, ScaleRule] = types.MappingProxyType(
    {t: q.scale_rule for t, q in QUANT_TYPES.items() if q.scale_rule is not None}
)
SCALE_TYPES: frozenset[ElementType] = frozenset(t for t, q in QUANT_TYPES.items() if q.is_scale)
SUPPORTED_TYPES: frozenset[ElementType] = frozenset(QUANT_TYPES)


def require_entries(table: str, keys: Collection[int], expected: Iterable[ElementType]) -> None:
    """Refuse a per-type table of another layer whose keys are not exactly `expected`.

    Called where such a table is built, so a type added to QUANT_TYPES without its entry there
    (or an entry for a type the format does not have) fails on import, naming the types.
    """
    expected = frozenset(expected)
    missing = sorted(expected - set(keys))
    extra = sorted(set(keys) - expected)
    if missing or extra:
        def names(ids):
            return ", ".join(ElementType(i).name if i in ElementType._value2member_map_ else str(i)
                             for i in ids) or "none"

        raise LookupError(f"{table} does not match packformat.quant_types.QUANT_TYPES: "
                          f"missing {names(missing)}; not registered {names(extra)}")


def is_ggml_type(element_type: int) -> bool:
    """True for GGML's ids (gguf-py knows the block layout), False for the pack's own."""
    return 0 <= int(element_type) < PACK_TYPE_BASE


def block_shape(element_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type: its record, or gguf-py's table for GGML ids."""
    etype = ElementType(element_type)
    record = QUANT_TYPES.get(etype)
    if record is not None:
        return record.block_elements, record.block_bytes
    if is_ggml_type(etype):
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(etype))]
    raise KeyError(f"element type {etype.name} has no record in packformat.quant_types.QUANT_TYPES")
