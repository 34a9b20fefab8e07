"""Constants of the expert pack format v1: the single source of truth.

docs/pack-format.md describes the same numbers in prose; a change here is a change there.
Element types reuse GGML's type ids (gguf.GGMLQuantizationType) so a GGUF role keeps its id.
"""

from __future__ import annotations

import enum
import math
import struct

import gguf

MAGIC = b"EXPTPACK"
VERSION_MAJOR = 1
VERSION_MINOR = 0

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


ElementType = gguf.GGMLQuantizationType

# Types a pack may hold. Others are refused by the writer and the reader.
SUPPORTED_TYPES: frozenset[ElementType] = frozenset(
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


def block_shape(element_type: int) -> tuple[int, int]:
    """(elements per block, bytes per block) of a type, from gguf-py's table."""
    return gguf.GGML_QUANT_SIZES[ElementType(element_type)]


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
