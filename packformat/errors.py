"""Typed errors of the pack format. Each names the object or byte offset that is wrong."""

from __future__ import annotations


class PackError(Exception):
    """Base of every error about a pack file."""


class PackFormatError(PackError):
    """The pack's structure is wrong: magic, version, sizes, alignment, index, bounds."""

    def __init__(self, path: str, message: str, *, offset: int | None = None):
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"{path}: {message}{where}")
        self.path = path
        self.offset = offset


class PackVersionError(PackFormatError):
    """The pack was written by an incompatible format version."""


class PackIndexError(PackFormatError):
    """An index entry is inconsistent; names the (layer, expert) entry."""

    def __init__(self, path: str, message: str, *, layer: int | None = None,
                 expert: int | None = None, offset: int | None = None):
        entry = f"object (layer {layer}, expert {expert}): " if layer is not None else ""
        super().__init__(path, entry + message, offset=offset)
        self.layer = layer
        self.expert = expert


class ObjectChecksumError(PackError):
    """An object's bytes do not match the checksum in the index."""

    def __init__(self, path: str, layer: int, expert: int, offset: int, expected: int, actual: int):
        super().__init__(
            f"{path}: object (layer {layer}, expert {expert}) at byte {offset}: checksum "
            f"mismatch (index crc32 {expected:#010x}, data crc32 {actual:#010x})"
        )
        self.path = path
        self.layer = layer
        self.expert = expert
        self.offset = offset


class PackWriterError(PackError):
    """The writer was used out of order or given data that cannot be written."""
