"""In-memory model of a pack's header and index, and their byte encoding.

Decoding does not validate semantics (bounds, overlaps, coverage): reader.py does that,
so an independent reader can be checked against the same rules in docs/pack-format.md.
"""

from __future__ import annotations

import dataclasses
import zlib

from packformat import constants as C


@dataclasses.dataclass(frozen=True)
class RoleEntry:
    role: int  # constants.Role value
    element_type: int  # constants.ElementType id (GGML's, or the pack's own from 256)
    offset: int  # bytes from the object's start, ROLE_ALIGNMENT-aligned
    nbytes: int
    shape: tuple[int, ...]  # logical element shape, last dim contiguous


@dataclasses.dataclass(frozen=True)
class ObjectEntry:
    layer: int  # model layer index (not the slot in the layer table)
    expert: int
    offset: int  # absolute file offset, ALIGNMENT-aligned
    size: int  # payload bytes; the object occupies align_up(size, ALIGNMENT) bytes
    crc32: int  # zlib.crc32 of the `size` payload bytes
    roles: tuple[RoleEntry, ...]

    @property
    def padded_size(self) -> int:
        return C.align_up(self.size, C.ALIGNMENT)

    def role(self, role: int) -> RoleEntry:
        for entry in self.roles:
            if entry.role == role:
                return entry
        raise KeyError(f"object (layer {self.layer}, expert {self.expert}) has no role {role}")


@dataclasses.dataclass(frozen=True)
class PackHeader:
    version_major: int
    version_minor: int
    header_size: int
    alignment: int
    role_alignment: int
    layer_count: int
    expert_count: int
    roles_per_object: int
    flags: int
    index_offset: int
    index_size: int
    data_offset: int
    object_stride: int  # bytes between consecutive objects when uniform, else 0
    file_size: int
    index_crc32: int
    header_crc32: int = 0

    def encode(self) -> bytes:
        """The HEADER_SIZE-byte header block, with header_crc32 computed."""
        fields = dataclasses.astuple(self)[:-1]
        body = C.HEADER_STRUCT.pack(C.MAGIC, *fields, 0)[: C.HEADER_CRC_SPAN]
        crc = zlib.crc32(body)
        return (body + crc.to_bytes(4, "little")).ljust(C.HEADER_SIZE, b"\0")

    @classmethod
    def decode(cls, raw: bytes) -> tuple[bytes, PackHeader, int]:
        """(magic, header, crc of the covered span) from the first HEADER_STRUCT.size bytes."""
        magic, *fields = C.HEADER_STRUCT.unpack_from(raw, 0)
        return magic, cls(*fields), zlib.crc32(raw[: C.HEADER_CRC_SPAN])


def index_size(layer_count: int, expert_count: int, roles_per_object: int) -> int:
    """Bytes of the index: the layer table padded to 8, then one entry per object."""
    layer_table = C.align_up(layer_count * C.LAYER_STRUCT.size, 8)
    entry = C.OBJECT_STRUCT.size + roles_per_object * C.ROLE_STRUCT.size
    return layer_table + layer_count * expert_count * entry


def encode_index(layers: tuple[int, ...], objects: list[ObjectEntry], roles_per_object: int) -> bytes:
    out = bytearray()
    for layer in layers:
        out += C.LAYER_STRUCT.pack(layer)
    out += b"\0" * (C.align_up(len(out), 8) - len(out))
    for obj in objects:
        out += C.OBJECT_STRUCT.pack(obj.layer, obj.expert, obj.offset, obj.size, obj.crc32, len(obj.roles))
        assert len(obj.roles) == roles_per_object
        for role in obj.roles:
            dims = tuple(role.shape) + (0,) * (C.MAX_DIMS - len(role.shape))
            out += C.ROLE_STRUCT.pack(role.role, role.element_type, role.offset, role.nbytes,
                                      len(role.shape), 0, *dims)
    return bytes(out)


@dataclasses.dataclass(frozen=True)
class RawObject:
    """An index entry as decoded, before validation (role_count may disagree, dims unchecked)."""

    entry: ObjectEntry
    role_count: int
    ndims: tuple[int, ...]
    unused_dims_zero: bool  # dims past ndim must be zero
    index_offset: int  # file offset of this entry inside the index


def decode_index(raw: bytes, header: PackHeader) -> tuple[tuple[int, ...], list[RawObject]]:
    """Layer table and object entries; raw must be exactly header.index_size bytes."""
    layers = tuple(
        C.LAYER_STRUCT.unpack_from(raw, i * C.LAYER_STRUCT.size)[0] for i in range(header.layer_count)
    )
    pos = C.align_up(header.layer_count * C.LAYER_STRUCT.size, 8)
    objects = []
    for _ in range(header.layer_count * header.expert_count):
        entry_pos = pos
        layer, expert, offset, size, crc, role_count = C.OBJECT_STRUCT.unpack_from(raw, pos)
        pos += C.OBJECT_STRUCT.size
        roles, ndims, unused_zero = [], [], True
        for _ in range(header.roles_per_object):
            role, etype, roff, nbytes, ndim, _reserved, *dims = C.ROLE_STRUCT.unpack_from(raw, pos)
            pos += C.ROLE_STRUCT.size
            ndims.append(ndim)
            unused_zero &= not any(dims[min(ndim, C.MAX_DIMS):])
            roles.append(RoleEntry(role, etype, roff, nbytes, tuple(dims[: min(ndim, C.MAX_DIMS)])))
        objects.append(RawObject(
            ObjectEntry(layer, expert, offset, size, crc, tuple(roles)),
            role_count, tuple(ndims), unused_zero, header.index_offset + entry_pos,
        ))
    return layers, objects
