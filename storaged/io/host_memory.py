"""Page-aligned host memory: the O_DIRECT read target and the source of host-to-device copies.

One anonymous mmap (page-aligned, hence 4096-aligned) is cut into equal buffers whose size is a
multiple of 4096, so every buffer start is aligned too; each address is still checked, and a
misaligned one fails closed rather than letting O_DIRECT return EINVAL mid-run. With pin=True
the whole mapping is page-locked with cudaHostRegister, so H2D copies from it run at DMA speed
and are truly asynchronous.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
from dataclasses import dataclass

import torch

from packformat.constants import ALIGNMENT
from storaged.io.errors import BufferAlignmentError, HostPinError


def check_alignment(what: str, address: int, nbytes: int, alignment: int = ALIGNMENT) -> None:
    """Raise BufferAlignmentError unless address and nbytes are multiples of alignment."""
    if address % alignment or nbytes % alignment or nbytes <= 0:
        raise BufferAlignmentError(what, address, nbytes, alignment)


@dataclass(frozen=True, eq=False)
class AlignedBuffer:
    """One aligned host buffer. `view` and `tensor` are the same bytes."""

    index: int  # position in its HostMemory
    address: int  # virtual address of byte 0, ALIGNMENT-aligned
    view: memoryview  # writable, `nbytes` long: the preadv target
    tensor: torch.Tensor  # uint8 [nbytes] on the CPU: the copy source / destination

    @property
    def nbytes(self) -> int:
        return self.view.nbytes


# fcntl seals (Linux; Python's fcntl names only some of them)
F_SEAL_FUTURE_WRITE = 0x0010  # Linux 5.1: no new writable mapping or write() through any fd
MFD_NOEXEC_SEAL = 0x0008  # Linux 6.3: the memfd can never be made executable
# what a memory file shared with clients is sealed with: read-only mappings only, fixed size
SHARED_SEALS = F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def sealable_memfd(name: str) -> int:
    """An anonymous memory file that accepts seals (and, on Linux 6.3+, can never be executable)."""
    try:
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | MFD_NOEXEC_SEAL)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)  # a kernel before 6.3


MADV_POPULATE_WRITE = 23  # Linux 5.14+; Python 3.11's mmap module does not name it


def _prefault(mapping: mmap.mmap) -> None:
    """Ask for transparent huge pages, then fault every page in now rather than on a hot read.

    Huge pages mean fewer TLB misses for the DMA engine and a faster cudaHostRegister of a
    large tier; the advice must come before the pages exist. Both calls are best effort: an
    older kernel refuses them and the pages then fault in on first use (or when pinned).
    """
    for advice in (getattr(mmap, "MADV_HUGEPAGE", None), MADV_POPULATE_WRITE):
        if advice is not None:
            try:
                mapping.madvise(advice)
            except OSError:
                pass


def _shared_file(nbytes: int, what: str) -> int:
    """A sealable memory file of nbytes, its pages reserved (a shortage fails here, not as a
    SIGBUS on a later write)."""
    try:
        fd = sealable_memfd("expertpack-host-tier")
    except OSError as exc:
        raise HostPinError(f"{what}: memfd_create failed: {exc.strerror}") from None
    try:
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)
    except OSError as exc:
        os.close(fd)
        raise HostPinError(f"{what}: cannot reserve {nbytes} bytes of shared memory: {exc.strerror}") from None
    return fd


def _cuda_error_code(result) -> int:
    # torch's cudart binding returns a pybind enum (cudaError); int() gives the raw value.
    return int(result)


class HostMemory:
    """`count` aligned buffers of `buffer_bytes` each, in one mapping, optionally CUDA-pinned.

    With shared=True the mapping is of a memory file (`fd`) sealed like a CPU arena once mapped
    here: another process may map it read-only (the host tier that clients read in place), and
    only this process's mapping can change the bytes.

    Close only after every copy that reads or writes these buffers has completed: unpinning
    memory under an in-flight DMA is undefined behaviour.
    """

    def __init__(self, count: int, buffer_bytes: int, *, pin: bool = False, shared: bool = False,
                 what: str = "host memory"):
        if count <= 0:
            raise ValueError(f"{what}: buffer count must be > 0, got {count}")
        if buffer_bytes <= 0 or buffer_bytes % ALIGNMENT:
            raise ValueError(f"{what}: buffer size {buffer_bytes} is not a positive multiple of {ALIGNMENT}")
        self.what = what
        self.count = count
        self.buffer_bytes = buffer_bytes
        self.total_bytes = count * buffer_bytes
        self.pinned = False
        self.fd: int | None = None
        if shared:
            self.fd = fd = _shared_file(self.total_bytes, what)
            try:
                self._mmap = mmap.mmap(fd, self.total_bytes, flags=mmap.MAP_SHARED,
                                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SHARED_SEALS)
            except OSError as exc:
                os.close(fd)
                raise HostPinError(f"{what}: cannot map and seal a {self.total_bytes}-byte shared memory file "
                                   f"({exc.strerror}; sealing needs Linux 5.1 or later)") from None
        else:
            self._mmap = mmap.mmap(-1, self.total_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                                   prot=mmap.PROT_READ | mmap.PROT_WRITE)
        _prefault(self._mmap)
        self._tensor = torch.frombuffer(self._mmap, dtype=torch.uint8)  # [total_bytes]
        self.address = self._tensor.data_ptr()
        view = self._view = memoryview(self._mmap)
        buffers = []
        for i in range(count):
            start = i * buffer_bytes  # byte offset of buffer i inside the mapping
            address = self.address + start
            check_alignment(f"{what} buffer {i}", address, buffer_bytes)
            buffers.append(AlignedBuffer(i, address, view[start:start + buffer_bytes],
                                         self._tensor[start:start + buffer_bytes]))
        self.buffers: tuple[AlignedBuffer, ...] = tuple(buffers)
        if pin:
            self._pin()

    def _pin(self) -> None:
        if not torch.cuda.is_available():
            self.close()
            raise HostPinError(f"{self.what}: pin=True but CUDA is not available")
        result = torch.cuda.cudart().cudaHostRegister(self.address, self.total_bytes, 0)
        code = _cuda_error_code(result)
        if code != 0:
            self.close()
            raise HostPinError(f"{self.what}: cudaHostRegister({self.address:#x}, {self.total_bytes} bytes) "
                               f"failed with cudaError {code}", code)
        self.pinned = True

    def close(self) -> None:
        """Unpin and unmap. Idempotent. Raises HostPinError if unpinning fails."""
        if self._mmap is None:
            return
        error = None
        if self.pinned:
            code = _cuda_error_code(torch.cuda.cudart().cudaHostUnregister(self.address))
            self.pinned = False
            if code != 0:
                error = HostPinError(f"{self.what}: cudaHostUnregister({self.address:#x}) failed with "
                                     f"cudaError {code}", code)
        # Released views make any late use of a buffer's memoryview fail loudly. The mapping is
        # not closed explicitly: torch.frombuffer tensors do not pin the buffer export, so
        # mmap.close() would leave them dangling; it is unmapped when its last tensor is freed.
        for buffer in self.buffers:
            buffer.view.release()
        self._view.release()
        self.buffers = ()
        self._tensor = None
        self._mmap = None
        if self.fd is not None:  # mapped clients keep their pages
            os.close(self.fd)
            self.fd = None
        if error is not None:
            raise error

    @property
    def closed(self) -> bool:
        return self._mmap is None

    def __enter__(self) -> HostMemory:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
