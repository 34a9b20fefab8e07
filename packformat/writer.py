"""PackWriter: writes experts.pack object by object with bounded memory.

States, as in gguf-py's writer: OPEN (objects being appended in (layer, expert) order)
→ CLOSED (index and header written). The index space is reserved up front because its
size is known from the counts; the header is written last, so a pack whose writer did not
finish has no valid header and is refused by the reader.
"""

from __future__ import annotations

import enum
import os
import zlib
from collections.abc import Sequence
from pathlib import Path

from packformat import constants as C
from packformat.errors import PackWriterError
from packformat.index import ObjectEntry, PackHeader, RoleEntry, encode_index, index_size
from packformat.scales import ScalePairError, check_scale_pairs


class WriterState(enum.Enum):
    OPEN = "open"
    CLOSED = "closed"


class PackWriter:
    def __init__(self, path: str | os.PathLike, layers: Sequence[int], expert_count: int,
                 roles_per_object: int):
        if not layers or list(layers) != sorted(set(layers)) or min(layers) < 0:
            raise PackWriterError(f"layers must be unique ascending non-negative ints, got {list(layers)}")
        if expert_count <= 0 or not 1 <= roles_per_object <= 16:
            raise PackWriterError(f"bad counts: experts {expert_count}, roles {roles_per_object}")
        self.path = Path(path)
        self.layers = tuple(layers)
        self.expert_count = expert_count
        self.roles_per_object = roles_per_object
        self._index_size = index_size(len(self.layers), expert_count, roles_per_object)
        self._data_offset = C.align_up(C.HEADER_SIZE + self._index_size, C.ALIGNMENT)
        self._objects: list[ObjectEntry] = []
        self._file = open(self.path, "wb")  # noqa: SIM115 - closed in close()/abort()
        self._file.truncate(self._data_offset)
        self._file.seek(self._data_offset)
        self._pos = self._data_offset
        # A pack records the least minor version that covers what it holds, so packs without
        # 1.1 features stay readable by 1.0 readers.
        self._minor = 0
        self.state = WriterState.OPEN

    def _expected_next(self) -> tuple[int, int]:
        n = len(self._objects)
        return self.layers[n // self.expert_count], n % self.expert_count

    def add_object(self, layer: int, expert: int,
                   roles: Sequence[tuple[int, int, tuple[int, ...], bytes | memoryview]]) -> ObjectEntry:
        """Append one object; roles are (role, element_type, shape, payload) in object order."""
        if self.state is not WriterState.OPEN:
            raise PackWriterError(f"add_object on a {self.state.value} writer")
        if len(self._objects) == len(self.layers) * self.expert_count:
            raise PackWriterError(f"all {len(self._objects)} objects already written")
        if (layer, expert) != self._expected_next():
            raise PackWriterError(f"objects must come in order: expected {self._expected_next()}, "
                                  f"got (layer {layer}, expert {expert})")
        if len(roles) != self.roles_per_object:
            raise PackWriterError(f"(layer {layer}, expert {expert}): {len(roles)} roles, "
                                  f"pack has {self.roles_per_object} per object")
        for role, etype, shape, payload in roles:
            self._check_role(layer, expert, role, etype, shape, payload)
        try:
            check_scale_pairs((role, etype, tuple(shape)) for role, etype, shape, _ in roles)
        except ScalePairError as exc:
            raise PackWriterError(f"(layer {layer}, expert {expert}): {exc}") from None
        entries, crc, rel = [], 0, 0
        for role, etype, shape, payload in roles:
            self._minor = max(self._minor, C.minor_version_needed(role, etype))
            pad = C.align_up(rel, C.ROLE_ALIGNMENT) - rel
            if pad:
                crc = zlib.crc32(b"\0" * pad, crc)
                self._file.write(b"\0" * pad)
                rel += pad
            view = memoryview(payload).cast("B")
            entries.append(RoleEntry(int(role), int(etype), rel, view.nbytes, tuple(int(d) for d in shape)))
            crc = zlib.crc32(view, crc)
            self._file.write(view)
            rel += view.nbytes
        tail = C.align_up(rel, C.ALIGNMENT) - rel
        self._file.write(b"\0" * tail)  # padding is zero and outside the checksum
        entry = ObjectEntry(layer, expert, self._pos, rel, crc, tuple(entries))
        self._objects.append(entry)
        self._pos += entry.padded_size
        return entry

    def _check_role(self, layer, expert, role, etype, shape, payload) -> None:
        where = f"(layer {layer}, expert {expert}) role {role}"
        try:
            C.Role(role)
            etype_enum = C.ElementType(etype)
        except ValueError as exc:
            raise PackWriterError(f"{where}: {exc}") from None
        if etype_enum not in C.SUPPORTED_TYPES:
            raise PackWriterError(f"{where}: element type {etype_enum.name} is not supported in packs")
        if not 1 <= len(shape) <= C.MAX_DIMS or min(shape) <= 0:
            raise PackWriterError(f"{where}: bad shape {tuple(shape)}")
        try:
            expected = C.tensor_nbytes(etype, tuple(shape))
        except ValueError as exc:
            raise PackWriterError(f"{where}: {exc}") from None
        nbytes = memoryview(payload).nbytes
        if nbytes != expected:
            raise PackWriterError(f"{where}: payload is {nbytes} bytes, {etype_enum.name} "
                                  f"{tuple(shape)} needs {expected}")

    def close(self) -> PackHeader:
        """Write the index and header; the pack is complete only after this returns."""
        if self.state is not WriterState.OPEN:
            raise PackWriterError(f"close on a {self.state.value} writer")
        total = len(self.layers) * self.expert_count
        if len(self._objects) != total:
            nxt = self._expected_next()
            raise PackWriterError(f"only {len(self._objects)} of {total} objects written; "
                                  f"next missing is (layer {nxt[0]}, expert {nxt[1]})")
        index = encode_index(self.layers, self._objects, self.roles_per_object)
        assert len(index) == self._index_size
        sizes = {o.padded_size for o in self._objects}
        header = PackHeader(
            version_major=C.VERSION_MAJOR, version_minor=self._minor,
            header_size=C.HEADER_SIZE, alignment=C.ALIGNMENT, role_alignment=C.ROLE_ALIGNMENT,
            layer_count=len(self.layers), expert_count=self.expert_count,
            roles_per_object=self.roles_per_object, flags=0,
            index_offset=C.HEADER_SIZE, index_size=len(index), data_offset=self._data_offset,
            object_stride=sizes.pop() if len(sizes) == 1 else 0,
            file_size=self._pos, index_crc32=zlib.crc32(index),
        )
        self._file.seek(C.HEADER_SIZE)
        self._file.write(index)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.seek(0)
        self._file.write(header.encode())
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        self.state = WriterState.CLOSED
        return header

    def abort(self) -> None:
        """Close without writing a header, and remove the partial file."""
        if self.state is WriterState.OPEN:
            self._file.close()
            self.state = WriterState.CLOSED
            self.path.unlink(missing_ok=True)
