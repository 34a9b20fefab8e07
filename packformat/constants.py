"""Constants of the expert pack format v1 (minor 1): the single source of truth.

docs/pack-format.md describes the same numbers in prose; a change here is a change there.
Element types: GGML's type ids (gguf.GGMLQuantizationType) keep their ids so a GGUF role keeps
its id; the pack's own types (formats GGML has no type for) take ids from PACK_TYPE_BASE up, a
range GGML's 32-bit type field will not reach, so the two tables never collide.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import struct

import gguf

MAGIC = b"EXPTPACK"
VERSION_MAJOR = 1
VERSION_MINOR = 1  # the newest minor this code writes; a pack records the least minor it needs

HEADER_SIZE = 4096  # bytes; the header block, zero padded
ALIGNMENT = 4096  # every object starts on, and is padded to, this boundary (O_DIRECT)
ROLE_ALIGNMENT = 256  # every role starts on this boundary inside its object
MAX_DIMS = 4

# Header: magic, major, minor, header_size, alignment, role_alignment, layer_count,
# expert_count, roles_per_object, flags, index_offset, index_size, data_offset,
# object_stride, file_size, index_crc32, header_crc32 (crc of the 84 bytes before it).
HEADER_STRUCT = struct.Struct("<8sHHIIIIIIIQQQQQII")
HEADER_CRC_SPAN = HEADER_STRUCT.size - 4  # 84 bytes covered by header_crc32
assert HEADER_STRUCT.size == 88

LAYER_STRUCT = struct.Struct("<I")  # model layer index, one per MoE layer
# Object entry: layer, expert, offset, size (payload bytes, unpadded), crc32, role_count.
OBJECT_STRUCT = struct.Struct("<IIQQII")
assert OBJECT_STRUCT.size == 32
# Role entry: role, type, offset (inside the object), nbytes, ndim, reserved, dims[4].
ROLE_STRUCT = struct.Struct("<IIQQII4Q")
assert ROLE_STRUCT.size == 64


class Role(enum.IntEnum):
    """What a byte range inside an object is. Ids are stable; new roles get new ids."""

    GATE = 1  # [I, H]  gate projection, rows = output features
    UP = 2  # [I, H]
    DOWN = 3  # [H, I]
    GATE_UP = 4  # fused gate and up, layout given by the manifest's expert_layout
    GATE_BIAS = 5  # [I]
    UP_BIAS = 6  # [I]
    DOWN_BIAS = 7  # [H]
    GATE_UP_BIAS = 8  # [2I], same interleaving as GATE_UP
    # Since 1.1: block scales of the weight role of the same projection, [out, in / group].
    GATE_SCALE = 9
    UP_SCALE = 10
    DOWN_SCALE = 11
    GATE_UP_SCALE = 12


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
    module=__name__,
)
ElementType.__doc__ = "Element type ids of a pack role: GGML's (< 256) and the pack's own (>= 256)."

# (elements per block, bytes per block) of the pack's own types.
_OWN_BLOCK_SHAPES: dict[int, tuple[int, int]] = {
    ElementType.F4_E2M1X2: (2, 1),
    ElementType.UE8M0: (1, 1),
}

# Types whose role bytes dequantize on their own: the types of format 1.0, all GGML's.
SELF_CONTAINED_TYPES: frozenset[ElementType] = frozenset(
    {
        ElementType.F32,
        ElementType.F16,
        ElementType.BF16,
        ElementType.Q8_0,
        ElementType.Q4_0,
        ElementType.Q4_1,
        ElementType.Q5_0,
        ElementType.Q5_1,
        ElementType.Q2_K,
        ElementType.Q3_K,
        ElementType.Q4_K,
        ElementType.Q5_K,
        ElementType.Q6_K,
        ElementType.MXFP4,
    }
)


@dataclasses.dataclass(frozen=True)
class ScaleRule:
    """How a weight type that needs a companion scale role is scaled."""

    scale_type: ElementType
    group_sizes: frozenset[int]  # weight elements per scale along the last dim


# Weight types that are only meaningful with a scale role next to them.
SCALED_WEIGHT_TYPES: dict[ElementType, ScaleRule] = {
    ElementType.F4_E2M1X2: ScaleRule(ElementType.UE8M0, frozenset({32})),
}
SCALE_TYPES: frozenset[ElementType] = frozenset(rule.scale_type for rule in SCALED_WEIGHT_TYPES.values())

# Types a pack may hold. Others are refused by the writer and the reader.
SUPPORTED_TYPES: frozenset[ElementType] = SELF_CONTAINED_TYPES | frozenset(SCALED_WEIGHT_TYPES) | SCALE_TYPES

SCALE_ROLE_OF: dict[Role, Role] = {
    Role.GATE: Role.GATE_SCALE,
    Role.UP: Role.UP_SCALE,
    Role.DOWN: Role.DOWN_SCALE,
    Role.GATE_UP: Role.GATE_UP_SCALE,
}
WEIGHT_ROLE_OF: dict[Role, Role] = {scale: weight for weight, scale in SCALE_ROLE_OF.items()}
SCALE_ROLES: frozenset[Role] = frozenset(WEIGHT_ROLE_OF)

# The minor version that introduced a role or type; anything absent is from 1.0.
_SINCE_MINOR_ROLES = {role: 1 for role in SCALE_ROLES}
_SINCE_MINOR_TYPES = {ElementType[name]: 1 for name in _PACK_OWN_TYPES}


def minor_version_needed(role: int, element_type: int) -> int:
    """The least format minor version a reader must know to read a role of this kind."""
    return max(_SINCE_MINOR_ROLES.get(role, 0), _SINCE_MINOR_TYPES.get(element_type, 0))


def is_ggml_type(element_type: int) -> bool:
    """True for GGML's ids (gguf-py knows the block layout), False for the pack's own."""
    return 0 <= int(element_type) < PACK_TYPE_BASE


def block_shape(element_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type: gguf-py's table for GGML ids."""
    etype = ElementType(element_type)
    if is_ggml_type(etype):
        return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(int(etype))]
    return _OWN_BLOCK_SHAPES[etype]


def tensor_nbytes(element_type: int, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of this type and logical shape; the last dim is blocked.

    Raises ValueError when the last dim is not a whole number of blocks.
    """
    elems, type_size = block_shape(element_type)
    if not shape:
        raise ValueError("a tensor needs at least one dimension")
    if shape[-1] % elems:
        raise ValueError(
            f"last dimension {shape[-1]} is not a multiple of the {ElementType(element_type).name} "
            f"block of {elems} elements"
        )
    return math.prod(shape[:-1]) * (shape[-1] // elems) * type_size


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment
