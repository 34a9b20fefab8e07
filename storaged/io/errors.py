"""Typed errors of storaged's I/O layer. Each names the file, buffer or object that is wrong.

Checksum mismatches are the pack format's own ObjectChecksumError (packformat.errors, re-exported
by storaged.io), so a caller handles a bad object the same way whether packformat's reader or
storaged read it.
"""

from __future__ import annotations

from packformat.errors import PackError


class StorageIOError(Exception):
    """Base of storaged's I/O errors other than pack format and checksum errors."""


class DirectIOUnsupported(StorageIOError):
    """The file's filesystem refuses O_DIRECT; storaged never falls back to buffered reads."""

    def __init__(self, path: str, filesystem: str, reason: str):
        super().__init__(
            f"{path}: O_DIRECT is not supported on this file's filesystem ({filesystem}): {reason}. "
            "Put the pack on a filesystem with direct I/O (ext4, xfs, btrfs on NVMe) or set "
            "direct_io=False explicitly to accept page-cache reads."
        )
        self.path = path
        self.filesystem = filesystem


class BufferAlignmentError(StorageIOError):
    """A host buffer's address or size is not a multiple of the required alignment."""

    def __init__(self, what: str, address: int, nbytes: int, alignment: int):
        super().__init__(f"{what}: address {address:#x}, {nbytes} bytes is not {alignment}-aligned "
                         "(O_DIRECT needs aligned targets)")
        self.address = address
        self.nbytes = nbytes
        self.alignment = alignment


class BufferTooSmallError(StorageIOError):
    """A read target is smaller than the object's padded size."""


class HostPinError(StorageIOError):
    """Host memory could not be page-locked (cudaHostRegister failed, or no CUDA to ask)."""

    def __init__(self, message: str, code: int | None = None):
        super().__init__(message)
        self.code = code  # the cudaError value, when CUDA returned one


class ObjectReadError(PackError, StorageIOError):
    """The OS failed a read of one object (EIO, short read at end of file, ...)."""

    def __init__(self, path: str, layer: int, expert: int, offset: int, message: str,
                 errno: int | None = None):
        super().__init__(f"{path}: object (layer {layer}, expert {expert}) at byte {offset}: {message}")
        self.path = path
        self.layer = layer
        self.expert = expert
        self.offset = offset
        self.errno = errno


class UnknownPackError(StorageIOError, KeyError):
    """A read names a pack id that was never registered with the executor."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class ExecutorClosedError(StorageIOError):
    """A read was submitted to, or was still queued in, a closed ReadExecutor."""
