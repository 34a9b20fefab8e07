"""PackReader: opens experts.pack and validates its whole structure before anything is read.

Every rule in docs/pack-format.md § Validation is checked here, in the order listed there,
and each failure raises a typed error naming the entry and byte offset.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Iterator
from pathlib import Path

from packformat import constants as C
from packformat.errors import ObjectChecksumError, PackFormatError, PackIndexError, PackVersionError
from packformat.index import ObjectEntry, PackHeader, decode_index, index_size
from packformat.scales import ScalePairError, check_scale_pairs


class PackReader:
    """A validated, read-only view of one pack file. Reads use pread and are thread-safe."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._name = str(self.path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise PackFormatError(self._name, f"cannot open: {exc.strerror}") from None
        try:
            self.header = self._read_header()
            self.layers, self._objects = self._read_index()
        except BaseException:
            os.close(self._fd)
            raise
        self._slot_of_layer = {layer: i for i, layer in enumerate(self.layers)}

    # -- validation ------------------------------------------------------------------
    def _read_header(self) -> PackHeader:
        actual_size = os.fstat(self._fd).st_size
        raw = os.pread(self._fd, C.HEADER_STRUCT.size, 0)
        if len(raw) < C.HEADER_STRUCT.size:
            raise PackFormatError(self._name, f"file is {actual_size} bytes, shorter than the header")
        magic, header, crc = PackHeader.decode(raw)
        if magic != C.MAGIC:
            raise PackFormatError(self._name, f"bad magic {magic!r}, expected {C.MAGIC!r}", offset=0)
        # Any minor of our major is read: minors only add role and type ids, and every role's ids
        # are checked below, so a newer pack is refused by name only when it uses what we lack.
        if header.version_major != C.VERSION_MAJOR:
            raise PackVersionError(self._name, f"format version {header.version_major}."
                                   f"{header.version_minor}; this reader reads {C.VERSION_MAJOR}.x", offset=8)
        if crc != header.header_crc32:
            raise PackFormatError(self._name, f"header checksum mismatch (stored {header.header_crc32:#010x}, "
                                  f"computed {crc:#010x})", offset=84)
        checks = [
            (header.header_size == C.HEADER_SIZE, f"header_size {header.header_size} != {C.HEADER_SIZE}", 12),
            (header.alignment == C.ALIGNMENT, f"alignment {header.alignment} != {C.ALIGNMENT}", 16),
            (header.role_alignment == C.ROLE_ALIGNMENT,
             f"role_alignment {header.role_alignment} != {C.ROLE_ALIGNMENT}", 20),
            (header.layer_count > 0 and header.expert_count > 0, "layer_count and expert_count must be > 0", 24),
            (1 <= header.roles_per_object <= 16, f"roles_per_object {header.roles_per_object} not in 1..16", 32),
            (header.flags == 0, f"unknown flags {header.flags:#x}", 36),
            (header.index_offset == C.HEADER_SIZE, f"index_offset {header.index_offset} != {C.HEADER_SIZE}", 40),
            (header.index_size == index_size(header.layer_count, header.expert_count, header.roles_per_object),
             f"index_size {header.index_size} does not match the counts", 48),
            (header.data_offset == C.align_up(header.index_offset + header.index_size, C.ALIGNMENT),
             f"data_offset {header.data_offset} is not the aligned end of the index", 56),
            (header.object_stride % C.ALIGNMENT == 0, f"object_stride {header.object_stride} unaligned", 64),
        ]
        for ok, message, offset in checks:
            if not ok:
                raise PackFormatError(self._name, message, offset=offset)
        if actual_size != header.file_size:
            what = "truncated" if actual_size < header.file_size else "has trailing bytes"
            raise PackFormatError(self._name, f"file {what}: {actual_size} bytes on disk, header says "
                                  f"{header.file_size}", offset=min(actual_size, header.file_size))
        return header

    def _read_index(self) -> tuple[tuple[int, ...], list[ObjectEntry]]:
        h = self.header
        raw = os.pread(self._fd, h.index_size, h.index_offset)
        if len(raw) != h.index_size:
            raise PackFormatError(self._name, "index runs past the end of the file", offset=h.index_offset)
        if zlib.crc32(raw) != h.index_crc32:
            raise PackFormatError(self._name, f"index checksum mismatch (stored {h.index_crc32:#010x}, "
                                  f"computed {zlib.crc32(raw):#010x})", offset=h.index_offset)
        layers, raw_objects = decode_index(raw, h)
        if list(layers) != sorted(set(layers)):
            raise PackFormatError(self._name, f"layer table is not strictly increasing: {list(layers)}",
                                  offset=h.index_offset)
        objects, prev_end = [], h.data_offset
        for n, raw_obj in enumerate(raw_objects):
            obj = raw_obj.entry
            want_layer, want_expert = layers[n // h.expert_count], n % h.expert_count
            if (obj.layer, obj.expert) != (want_layer, want_expert):
                raise PackIndexError(self._name, f"index entry {n} is for (layer {obj.layer}, expert "
                                     f"{obj.expert}); expected (layer {want_layer}, expert {want_expert}) — "
                                     "missing or out of order", layer=want_layer, expert=want_expert,
                                     offset=raw_obj.index_offset)
            self._check_object(raw_obj, prev_end)
            prev_end = obj.offset + obj.padded_size
            objects.append(obj)
        return layers, objects

    def _check_object(self, raw_obj, prev_end: int) -> None:
        obj, h = raw_obj.entry, self.header

        def fail(message: str) -> PackIndexError:
            return PackIndexError(self._name, message, layer=obj.layer, expert=obj.expert,
                                  offset=raw_obj.index_offset)

        if raw_obj.role_count != h.roles_per_object:
            raise fail(f"role_count {raw_obj.role_count} != roles_per_object {h.roles_per_object}")
        if obj.offset % C.ALIGNMENT:
            raise fail(f"offset {obj.offset} is not {C.ALIGNMENT}-aligned")
        if obj.offset < prev_end:
            raise fail(f"offset {obj.offset} overlaps the previous object, which ends at {prev_end}")
        if obj.size == 0 or obj.offset + obj.padded_size > h.file_size:
            raise fail(f"bytes [{obj.offset}, {obj.offset + obj.padded_size}) are outside the file "
                       f"of {h.file_size} bytes")
        role_end = 0
        for ndim, role in zip(raw_obj.ndims, obj.roles):
            try:
                C.Role(role.role)
            except ValueError:
                raise fail(f"unknown role id {role.role}") from None
            try:
                etype = C.ElementType(role.element_type)
            except ValueError:
                raise fail(f"role {role.role}: unknown element type id {role.element_type}") from None
            if etype not in C.SUPPORTED_TYPES:
                raise fail(f"role {role.role}: element type {etype.name} is not supported")
            if not 1 <= ndim <= C.MAX_DIMS or min(role.shape) <= 0 or not raw_obj.unused_dims_zero:
                raise fail(f"role {role.role}: bad shape {role.shape} (ndim {ndim})")
            try:
                expected = C.tensor_nbytes(etype, role.shape)
            except ValueError as exc:
                raise fail(f"role {role.role}: {exc}") from None
            if role.nbytes != expected:
                raise fail(f"role {role.role}: nbytes {role.nbytes}, {etype.name} {role.shape} needs {expected}")
            since = C.minor_version_needed(role.role, etype)
            if since > h.version_minor:
                raise fail(f"role {C.Role(role.role).name.lower()} {etype.name} needs format 1.{since}, "
                           f"but the header says 1.{h.version_minor}")
            if role.offset % C.ROLE_ALIGNMENT or role.offset < role_end:
                raise fail(f"role {role.role}: offset {role.offset} is unaligned or overlaps the previous role")
            role_end = role.offset + role.nbytes
        if role_end != obj.size:
            raise fail(f"roles end at {role_end} but the object size is {obj.size}")
        try:
            check_scale_pairs((r.role, r.element_type, r.shape) for r in obj.roles)
        except ScalePairError as exc:
            raise fail(str(exc)) from None

    # -- access ----------------------------------------------------------------------
    @property
    def objects(self) -> list[ObjectEntry]:
        return list(self._objects)

    def __iter__(self) -> Iterator[ObjectEntry]:
        return iter(self._objects)

    def has_layer(self, layer: int) -> bool:
        return layer in self._slot_of_layer

    def entry(self, layer: int, expert: int) -> ObjectEntry:
        slot = self._slot_of_layer.get(layer)
        if slot is None or not 0 <= expert < self.header.expert_count:
            raise KeyError(f"{self._name}: no object (layer {layer}, expert {expert})")
        return self._objects[slot * self.header.expert_count + expert]

    @property
    def max_object_size(self) -> int:
        return max(o.size for o in self._objects)

    def read_object(self, layer: int, expert: int, *, verify: bool = True) -> bytes:
        """The object's payload bytes (buffered pread); checksum-verified unless verify=False."""
        obj = self.entry(layer, expert)
        data = os.pread(self._fd, obj.size, obj.offset)
        if len(data) != obj.size:
            raise PackFormatError(self._name, f"short read of object (layer {layer}, expert {expert})",
                                  offset=obj.offset)
        if verify:
            verify_object(self._name, obj, data)
        return data

    def verify_all(self) -> list[ObjectChecksumError]:
        """Checksum every object; returns the failures (empty when the pack is intact)."""
        failures = []
        for obj in self._objects:
            try:
                self.read_object(obj.layer, obj.expert, verify=True)
            except ObjectChecksumError as exc:
                failures.append(exc)
        return failures

    def fileno(self) -> int:
        return self._fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> PackReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def verify_object(path: str, obj: ObjectEntry, payload) -> None:
    """Raise ObjectChecksumError unless crc32(payload[:obj.size]) matches the index."""
    actual = zlib.crc32(memoryview(payload)[: obj.size])
    if actual != obj.crc32:
        raise ObjectChecksumError(path, obj.layer, obj.expert, obj.offset, obj.crc32, actual)
