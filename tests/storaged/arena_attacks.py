"""Every way a process holding a descriptor of the CPU arena could try to change its bytes.

Used in-process by test_device_arena.py, and imported by the attacker processes of the tamper
test (test_server_arena_integrity.py), which receive the descriptor from a real daemon over the
data plane like any client (or, refused by the allow-list, try to).

Each attack returns "refused: <errno name>" when the kernel refused it, or "WROTE" when it
succeeded in something that could change what another process reads.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import socket

FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
PROT_READ_WRITE = mmap.PROT_READ | mmap.PROT_WRITE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)
_libc.mprotect.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _check(result: int) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def _mmap_shared_writable(fd: int, size: int) -> None:
    mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=PROT_READ_WRITE)
    mapping[0:16] = b"\xa5" * 16
    mapping.close()


def _write(fd: int, size: int) -> None:
    os.pwrite(fd, b"\xa5" * 16, 0)


def _ftruncate_shrink(fd: int, size: int) -> None:
    os.ftruncate(fd, 0)


def _ftruncate_grow(fd: int, size: int) -> None:
    os.ftruncate(fd, size + (1 << 20))


def _punch_hole(fd: int, size: int) -> None:
    # zero-filled pages would replace the bytes every session reads
    _check(_libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, 0, min(size, 4096)))


def _reopen_read_write(path: str) -> None:
    reopened = os.open(path, os.O_RDWR)
    try:
        os.pwrite(reopened, b"\xa5" * 16, 0)
    finally:
        os.close(reopened)


def _mprotect_read_only_mapping(fd: int, size: int) -> None:
    mapping = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        address = _address_of(mapping)
        _check(_libc.mprotect(address, 4096, PROT_READ_WRITE))
        ctypes.memmove(address, b"\xa5" * 16, 16)
    finally:
        mapping.close()


def _address_of(mapping: mmap.mmap) -> int:
    import numpy as np

    return np.frombuffer(mapping, dtype=np.uint8).ctypes.data


def _madvise_remove(fd: int, size: int) -> None:
    mapping = mmap.mmap(fd, 4096, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    try:
        mapping.madvise(mmap.MADV_REMOVE, 0, 4096)  # frees the file's pages: reads would see zeros
    finally:
        mapping.close()


def attacks(fd: int, size: int, daemon_pid: int | None = None) -> dict[str, str]:
    """Run every attack on `fd` (the arena, `size` bytes); {name: outcome}."""
    plans = {
        "mmap MAP_SHARED PROT_WRITE": lambda: _mmap_shared_writable(fd, size),
        "write()": lambda: _write(fd, size),
        "ftruncate to 0": lambda: _ftruncate_shrink(fd, size),
        "ftruncate larger": lambda: _ftruncate_grow(fd, size),
        "fallocate PUNCH_HOLE": lambda: _punch_hole(fd, size),
        "mprotect a read-only mapping writable": lambda: _mprotect_read_only_mapping(fd, size),
        "madvise MADV_REMOVE": lambda: _madvise_remove(fd, size),
        "reopen /proc/self/fd/N read-write, write": lambda: _reopen_read_write(f"/proc/self/fd/{fd}"),
    }
    if daemon_pid is not None:
        plans.update(daemon_attacks(daemon_pid))
    outcomes = {}
    for name, attack in plans.items():
        try:
            attack()
        except OSError as exc:
            outcomes[name] = f"refused: {errno.errorcode.get(exc.errno, exc.errno)}"
        else:
            outcomes[name] = "WROTE"
    return outcomes


def daemon_attacks(pid: int) -> dict:
    """Attacks through the daemon's own process: its descriptors and its memory in /proc."""

    def reopen_daemon_fds() -> None:
        # the daemon's arena descriptor, found by its memfd name
        directory = f"/proc/{pid}/fd"
        names = os.listdir(directory)  # PermissionError (EACCES) when the daemon is not dumpable
        arena = [n for n in names if os.readlink(f"{directory}/{n}").startswith("/memfd:expertpack-arena")]
        if not arena:
            raise OSError(errno.ENOENT, f"no arena descriptor among {len(names)} of pid {pid}")
        for name in arena:
            _reopen_read_write(f"{directory}/{name}")

    def write_daemon_memory() -> None:
        with open(f"/proc/{pid}/maps") as maps:  # PermissionError when the daemon is not dumpable
            lines = [line for line in maps if "/memfd:expertpack-arena" in line]
        if not lines:
            raise OSError(errno.ENOENT, f"no arena mapping in pid {pid}'s maps")
        start = int(lines[0].split("-", 1)[0], 16)
        with open(f"/proc/{pid}/mem", "r+b", buffering=0) as memory:
            memory.seek(start)
            memory.write(b"\xa5" * 16)

    return {"reopen /proc/<daemon>/fd/N read-write, write": reopen_daemon_fds,
            "write /proc/<daemon>/mem at the arena": write_daemon_memory}


def raw_arena_exchange(data_socket: str, session_id: str) -> dict:
    """Ask the data plane for the arena (ARENA) without the client library: what came back,
    {"kind": frame kind, "code": status code of an ERROR or None, "descriptors": how many fds}."""
    from storaged.wire import dataplane as wire

    received: list[int] = []
    data = b""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(data_socket)
        sock.sendall(wire.frame(wire.Kind.ARENA, 0, wire.U32.pack(wire.VERSION) + session_id.encode()))
        while True:
            try:
                chunk, fds, _, _ = socket.recv_fds(sock, 65536, 8)
            except ConnectionResetError:
                break
            received += fds
            if not chunk:
                break
            data += chunk
    for fd in received:
        os.close(fd)
    _, kind, _, _ = wire.HEADER.unpack_from(data)
    code = wire.ERROR_HEAD.unpack_from(data, wire.HEADER.size)[0] if kind == wire.Kind.ERROR else None
    return {"kind": kind, "code": code, "descriptors": len(received)}
