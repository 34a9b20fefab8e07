"""DirectPackFile: reads pack objects with O_DIRECT straight into aligned host buffers.

With direct_io=True the pack is opened O_DIRECT and probed with one aligned read of its header
block; a filesystem that refuses either raises DirectIOUnsupported naming the file and the
filesystem. There is no silent fallback to the page cache: a daemon whose reads quietly go
through the page cache doubles its memory traffic and hides the disk's real behaviour.
direct_io=False (an explicit choice) reads the same way through the page cache.

Reads are positional (preadv), so one DirectPackFile may serve many threads at once.
"""

from __future__ import annotations

import errno
import mmap
import os
import re

from packformat.constants import ALIGNMENT
from packformat.index import ObjectEntry
from packformat.reader import verify_object
from storaged.io.errors import BufferTooSmallError, DirectIOUnsupported, ObjectReadError
from storaged.io.host_memory import AlignedBuffer, check_alignment

_DIRECT_IO_REFUSED = (errno.EINVAL, errno.EOPNOTSUPP)


def _unescape_mount_path(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo octal.
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), field)


def filesystem_of(path: str | os.PathLike) -> str:
    """'<fstype> at <mount point>' of the mount holding path, from /proc/self/mountinfo."""
    real = os.path.realpath(path)
    best_mount, best_type = "", "unknown filesystem"
    try:
        with open("/proc/self/mountinfo", encoding="utf-8") as mountinfo:
            lines = mountinfo.read().splitlines()
    except OSError:
        return best_type
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, fs_fields = left.split(), right.split()
        if len(fields) < 5 or not fs_fields:
            continue
        mount = _unescape_mount_path(fields[4])
        inside = real == mount or real.startswith(mount.rstrip("/") + "/")
        if inside and len(mount) >= len(best_mount):  # later mounts shadow earlier ones
            best_mount, best_type = mount, fs_fields[0]
    return f"{best_type} at {best_mount}" if best_mount else best_type


class DirectPackFile:
    """One open pack file. `read_into` fills an aligned buffer with one object's padded bytes."""

    def __init__(self, path: str | os.PathLike, *, direct_io: bool = True, verify: bool = True):
        self.path = os.fspath(path)
        self.direct_io = direct_io
        self.verify = verify
        flags = os.O_RDONLY | os.O_CLOEXEC | (os.O_DIRECT if direct_io else 0)
        try:
            self._fd = os.open(self.path, flags)
        except OSError as exc:
            if direct_io and exc.errno in _DIRECT_IO_REFUSED:
                raise DirectIOUnsupported(self.path, filesystem_of(self.path),
                                          f"open(O_DIRECT) failed: {exc.strerror}") from None
            raise
        if direct_io:
            try:
                self._probe()
            except BaseException:
                os.close(self._fd)
                raise

    def _probe(self) -> None:
        # Some filesystems accept O_DIRECT at open and refuse it at the first read.
        scratch = mmap.mmap(-1, ALIGNMENT)  # page-aligned
        try:
            os.preadv(self._fd, [scratch], 0)
        except OSError as exc:
            if exc.errno in _DIRECT_IO_REFUSED:
                raise DirectIOUnsupported(self.path, filesystem_of(self.path),
                                          f"an aligned {ALIGNMENT}-byte read failed: {exc.strerror}") from None
            raise
        finally:
            scratch.close()

    @property
    def direct_io_active(self) -> bool:
        """Whether the kernel reports O_DIRECT on this descriptor (from /proc/self/fdinfo)."""
        with open(f"/proc/self/fdinfo/{self.fileno()}", encoding="ascii") as fdinfo:
            for line in fdinfo:
                if line.startswith("flags:"):
                    return bool(int(line.split()[1], 8) & os.O_DIRECT)
        return False

    def fileno(self) -> int:
        if self._fd < 0:
            raise ValueError(f"{self.path}: pack file is closed")
        return self._fd

    def read_raw(self, entry: ObjectEntry, buffer: AlignedBuffer) -> memoryview:
        """Read the object's padded bytes into buffer; return the payload view (no checksum)."""
        need = entry.padded_size
        if buffer.nbytes < need:
            raise BufferTooSmallError(f"{self.path}: object (layer {entry.layer}, expert {entry.expert}) "
                                      f"needs {need} bytes, buffer {buffer.index} has {buffer.nbytes}")
        if self.direct_io:
            check_alignment(f"read target buffer {buffer.index}", buffer.address, need)
        fd, view, done = self.fileno(), buffer.view, 0
        while done < need:
            try:
                count = os.preadv(fd, [view[done:need]], entry.offset + done)
            except OSError as exc:
                raise ObjectReadError(self.path, entry.layer, entry.expert, entry.offset,
                                      f"read failed after {done} of {need} bytes: {exc.strerror}",
                                      exc.errno) from exc
            if count == 0:
                raise ObjectReadError(self.path, entry.layer, entry.expert, entry.offset,
                                      f"end of file after {done} of {need} bytes")
            done += count
            if self.direct_io and done % ALIGNMENT and done < need:
                # The next O_DIRECT read would start unaligned and fail with EINVAL.
                raise ObjectReadError(self.path, entry.layer, entry.expert, entry.offset,
                                      f"short read ended unaligned after {done} of {need} bytes")
        return view[:entry.size]

    def read_into(self, entry: ObjectEntry, buffer: AlignedBuffer) -> memoryview:
        """read_raw, then (when verify) raise ObjectChecksumError unless the crc32 matches."""
        payload = self.read_raw(entry, buffer)
        if self.verify:
            verify_object(self.path, entry, payload)
        return payload

    def close(self) -> None:
        """Close the descriptor; no read may be in flight. Idempotent."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> DirectPackFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
