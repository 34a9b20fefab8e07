"""Constants of the expert pack format v1 (minor 1): the single source of truth.

docs/pack-format.md describes the same numbers in prose; a change here is a change there.
Element types and their block shapes: one record per type in packformat.quant_types (re-exported).
"""

from __future__ import annotations

import enum
import math
import struct

# The element types live in their registry; they are re-exported here, beside the rest of the format.
from packformat.quant_types import (  # noqa: F401
    PACK_TYPE_BASE,
    QUANT_TYPES,
    SCALE_TYPES,
    SCALED_WEIGHT_TYPES,
    SELF_CONTAINED_TYPES,
    SUPPORTED_TYPES,
    ElementType,
    QuantType,
    ScaleRule,
    block_shape,
    is_ggml_type,
)

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
_SINCE_MINOR_TYPES = {t: q.since_minor for t, q in QUANT_TYPES.items() if q.since_minor}


def minor_version_needed(role: int, element_type: int) -> int:
    """The least format minor version a reader must know to read a role of this kind."""
    return max(_SINCE_MINOR_ROLES.get(role, 0), _SINCE_MINOR_TYPES.get(element_type, 0))


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
