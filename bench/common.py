"""Shared pieces of the storage benchmarks: a synthetic bundle written at disk speed, and raw
O_DIRECT reads of its objects (the machine's limit that storaged is measured against).

The bundle is real (open_bundle and storaged accept it, every object's crc32 is valid) but its
objects reuse a few random byte images, so writing 8 GiB costs one crc32 per image rather than
one per object, and the write runs at the disk's sequential speed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import math
import mmap
import os
import random
import shutil
import threading
import time
import zlib
from pathlib import Path

import numpy as np

from packformat import constants as C
from packformat.bundle import CONFIG, DENSE, FORMAT_NAME, FORMAT_VERSION, MANIFEST, PACK, staged_bundle, write_json
from packformat.index import ObjectEntry, PackHeader, RoleEntry, encode_index, index_size

MODEL_TYPE = "expertpack_bench"  # not a transformers architecture: storaged never builds the model
HIDDEN = 4096  # H of a DeepSeek-V4-Flash-size expert; I is chosen to reach the object size
MXFP4_BLOCK_ELEMS, MXFP4_BLOCK_BYTES = C.block_shape(C.ElementType.MXFP4)  # 32 elements in 17 bytes
IMAGE_VARIANTS = 4  # distinct random object images the pack cycles through
WRITE_CHUNK_OBJECTS = 8  # objects per writev: large sequential writes


class BenchError(RuntimeError):
    """The benchmark cannot produce a trustworthy figure (bad geometry, O_DIRECT refused, a failed
    daemon...); the message names what and where."""


@dataclasses.dataclass(frozen=True)
class PackGeometry:
    """Objects of three MXFP4 roles: gate and up [I, H], down [H, I], as in one routed expert."""

    layers: int
    experts: int  # per layer
    intermediate: int  # I, a multiple of the MXFP4 block

    @property
    def role_shapes(self) -> tuple[tuple[C.Role, tuple[int, int]], ...]:
        i, h = self.intermediate, HIDDEN
        return ((C.Role.GATE, (i, h)), (C.Role.UP, (i, h)), (C.Role.DOWN, (h, i)))

    @property
    def role_layout(self) -> tuple[RoleEntry, ...]:
        entries, offset = [], 0
        for role, shape in self.role_shapes:
            offset = C.align_up(offset, C.ROLE_ALIGNMENT)  # roles start 256-aligned in the object
            nbytes = C.tensor_nbytes(C.ElementType.MXFP4, shape)
            entries.append(RoleEntry(int(role), int(C.ElementType.MXFP4), offset, nbytes, shape))
            offset += nbytes
        return tuple(entries)

    @property
    def object_bytes(self) -> int:
        last = self.role_layout[-1]
        return last.offset + last.nbytes  # payload, unpadded

    @property
    def padded_object_bytes(self) -> int:
        return C.align_up(self.object_bytes, C.ALIGNMENT)

    @property
    def objects(self) -> int:
        return self.layers * self.experts

    def as_dict(self) -> dict:
        return {"layers": self.layers, "experts_per_layer": self.experts, "objects": self.objects,
                "intermediate": self.intermediate, "hidden": HIDDEN, "element_type": "MXFP4",
                "object_bytes": self.object_bytes, "padded_object_bytes": self.padded_object_bytes}


def plan_geometry(pack_gib: float, object_mib: float, *, top_k: int, max_experts: int = 64) -> PackGeometry:
    """Objects of about object_mib MiB filling about pack_gib GiB, at least top_k experts a layer."""
    if pack_gib <= 0 or object_mib <= 0:
        raise BenchError(f"pack size {pack_gib} GiB and object size {object_mib} MiB must be positive")
    bytes_per_i = 3 * HIDDEN // MXFP4_BLOCK_ELEMS * MXFP4_BLOCK_BYTES  # object bytes per unit of I
    blocks = max(1, round(object_mib * 2**20 / bytes_per_i / MXFP4_BLOCK_ELEMS))
    probe = PackGeometry(1, 1, blocks * MXFP4_BLOCK_ELEMS)
    objects = int(pack_gib * 2**30 // probe.padded_object_bytes)
    if objects < top_k:
        raise BenchError(f"a {pack_gib} GiB pack holds {objects} objects of {probe.padded_object_bytes} bytes; "
                         f"an acquire needs {top_k} distinct experts: raise --pack-gib or lower --object-mib")
    experts = min(max_experts, objects)
    return PackGeometry(max(1, round(objects / experts)), experts, probe.intermediate)


def _object_images(geometry: PackGeometry, seed: int) -> list[tuple[np.ndarray, int]]:
    """IMAGE_VARIANTS padded object images ([padded_object_bytes] uint8) and their payload crc32."""
    rng = np.random.default_rng(seed)
    images = []
    for _ in range(IMAGE_VARIANTS):
        image = np.zeros(geometry.padded_object_bytes, dtype=np.uint8)
        for role in geometry.role_layout:  # bytes between roles and after the last stay zero
            image[role.offset:role.offset + role.nbytes] = rng.integers(0, 256, role.nbytes, dtype=np.uint8)
        images.append((image, zlib.crc32(image[:geometry.object_bytes])))
    return images


def _write_all(fd: int, buffers: list, offset: int) -> None:
    want = sum(memoryview(b).nbytes for b in buffers)
    done = os.pwritev(fd, buffers, offset)
    if done != want:  # a regular file writes short only when the disk is full
        raise BenchError(f"write of {want} bytes at offset {offset} stopped after {done} (disk full?)")


def write_pack(path: Path, geometry: PackGeometry, seed: int) -> PackHeader:
    """experts.pack for `geometry`, objects cycling through a few random images."""
    layers = tuple(range(geometry.layers))
    roles = geometry.role_layout
    idx_size = index_size(len(layers), geometry.experts, len(roles))
    data_offset = C.align_up(C.HEADER_SIZE + idx_size, C.ALIGNMENT)
    images = _object_images(geometry, seed)
    stride = geometry.padded_object_bytes
    entries = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        pending: list[np.ndarray] = []
        chunk_offset = data_offset
        for n in range(geometry.objects):
            image, crc = images[n % len(images)]
            layer, expert = divmod(n, geometry.experts)
            entries.append(ObjectEntry(layer, expert, data_offset + n * stride, geometry.object_bytes, crc, roles))
            pending.append(image)
            if len(pending) == WRITE_CHUNK_OBJECTS or n == geometry.objects - 1:
                _write_all(fd, pending, chunk_offset)
                chunk_offset += len(pending) * stride
                pending = []
        index = encode_index(layers, entries, len(roles))
        header = PackHeader(
            # minor 0: the bench writes GGML types only, a 1.0 pack
            version_major=C.VERSION_MAJOR, version_minor=0, header_size=C.HEADER_SIZE,
            alignment=C.ALIGNMENT, role_alignment=C.ROLE_ALIGNMENT, layer_count=len(layers),
            expert_count=geometry.experts, roles_per_object=len(roles), flags=0,
            index_offset=C.HEADER_SIZE, index_size=len(index), data_offset=data_offset,
            object_stride=stride, file_size=chunk_offset, index_crc32=zlib.crc32(index))
        _write_all(fd, [index], C.HEADER_SIZE)
        os.fsync(fd)
        _write_all(fd, [header.encode()], 0)  # last: a pack without a valid header is refused
        os.fsync(fd)
    finally:
        os.close(fd)
    return header


def write_bench_bundle(output: Path, geometry: PackGeometry, *, seed: int = 0) -> float:
    """A complete bundle at `output` (replacing a previous one); returns the seconds it took."""
    from safetensors.numpy import save_file

    started = time.perf_counter()
    with staged_bundle(output, force=True) as staging:
        config = {"model_type": MODEL_TYPE, "hidden_size": HIDDEN, "moe_intermediate_size": geometry.intermediate,
                  "num_hidden_layers": geometry.layers, "n_routed_experts": geometry.experts}
        config_bytes = (json.dumps(config, indent=2, sort_keys=True) + "\n").encode()
        (staging / CONFIG).write_bytes(config_bytes)
        header = write_pack(staging / PACK, geometry, seed)
        save_file({"bench.placeholder": np.zeros(1, dtype=np.float32)}, str(staging / DENSE))
        write_json(staging / MANIFEST, {
            "format": FORMAT_NAME, "version": FORMAT_VERSION, "created_by": "bench/common.py",
            "model_type": MODEL_TYPE, "config_sha256": hashlib.sha256(config_bytes).hexdigest(),
            "pack": {"file": PACK, "size": header.file_size, "index_crc32": header.index_crc32,
                     "object_stride": header.object_stride},
            "dense": {"file": DENSE, "size": (staging / DENSE).stat().st_size, "tensors": 1},
            "experts": {"moe_layers": list(range(geometry.layers)), "num_experts": geometry.experts,
                        "top_k": 8, "roles": ["gate", "up", "down"], "element_types": ["MXFP4"],
                        "bytes_total": geometry.objects * geometry.object_bytes},
        })
    return time.perf_counter() - started


def drop_page_cache() -> bool:
    """Flush and drop the page cache when allowed (root); False when refused. O_DIRECT reads do not
    need it; it keeps buffered pages of the freshly written pack from skewing anything else."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")  # O_DIRECT may work there, but it measures RAM, not a disk
SCRATCH_CANDIDATES = ("/var/tmp", "/root", "/opt", "/tmp")


def direct_io_problem(directory: Path) -> str | None:
    """Why `directory` cannot hold the pack under test (no O_DIRECT, or RAM-backed), or None."""
    from storaged.io import filesystem_of

    filesystem = filesystem_of(directory)
    if filesystem.split(" ")[0] in MEMORY_FILESYSTEMS:
        return f"{directory} is on {filesystem}: memory, not a disk"
    probe = directory / f".odirect-probe-{os.getpid()}"
    try:
        probe.write_bytes(b"\0" * C.ALIGNMENT)
        fd = os.open(probe, os.O_RDONLY | os.O_DIRECT | os.O_CLOEXEC)
        try:
            os.preadv(fd, [mmap.mmap(-1, C.ALIGNMENT)], 0)  # page-aligned target
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT read refused in {directory} ({filesystem}): {exc.strerror}"
    finally:
        probe.unlink(missing_ok=True)
    return None


def scratch_directory(requested: Path | None, need_bytes: int) -> Path:
    """`requested`, or the first candidate on a disk where O_DIRECT works; either must have room
    for need_bytes. Raises BenchError naming every directory tried and why it was refused."""
    candidates = [requested] if requested is not None else [Path(c) / "expertpack-bench" for c in SCRATCH_CANDIDATES]
    refused = []
    for directory in candidates:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            refused.append(f"{directory}: {exc.strerror}")
            continue
        problem = direct_io_problem(directory)
        free = shutil.disk_usage(directory).free
        if problem is None and free < need_bytes:
            problem = f"{directory}: {free} bytes free, the pack needs {need_bytes}"
        if problem is None:
            return directory
        refused.append(problem)
    raise BenchError("no directory for the pack: " + "; ".join(refused))


@dataclasses.dataclass(frozen=True)
class RawReadResult:
    queue_depth: int
    reads: int
    bytes: int
    seconds: float
    # /proc/self/fdinfo shows O_DIRECT on the descriptor; a sandboxed kernel (gVisor) may accept
    # the flag without showing it, so False is a warning, not a failure
    o_direct_reported: bool

    @property
    def gbps(self) -> float:
        return self.bytes / self.seconds / 1e9


def raw_direct_reads(pack_path: Path, entries: list[ObjectEntry], queue_depth: int, seconds: float,
                     *, seed: int = 0) -> RawReadResult:
    """`queue_depth` threads each preadv random whole objects (padded, 4096-aligned) with O_DIRECT
    into their own aligned buffer until `seconds` pass; bytes over wall time to the last read."""
    from storaged.io import DirectIOUnsupported, DirectPackFile, HostMemory

    try:
        pack = DirectPackFile(pack_path, direct_io=True, verify=False)
    except DirectIOUnsupported as exc:
        raise BenchError(f"raw O_DIRECT reads refused: {exc}") from None
    memory = HostMemory(queue_depth, max(e.padded_size for e in entries), what="raw read buffers")
    try:
        try:
            reported = pack.direct_io_active
        except OSError:  # no /proc/self/fdinfo here
            reported = False
        totals = [(0, 0)] * queue_depth  # (reads, bytes) per thread
        start = threading.Barrier(queue_depth + 1)

        def worker(n: int) -> None:
            rng, buffer, reads, nbytes = random.Random(seed * 1000 + n), memory.buffers[n], 0, 0
            start.wait()
            while time.perf_counter() < deadline:
                entry = rng.choice(entries)
                pack.read_raw(entry, buffer)
                reads, nbytes = reads + 1, nbytes + entry.padded_size
            totals[n] = (reads, nbytes)

        with concurrent.futures.ThreadPoolExecutor(queue_depth) as pool:
            futures = [pool.submit(worker, n) for n in range(queue_depth)]
            began = time.perf_counter()
            deadline = began + seconds
            start.wait()
            for future in futures:
                future.result()  # re-raises a failed read
            elapsed = time.perf_counter() - began
    finally:
        memory.close()
        pack.close()
    return RawReadResult(queue_depth, sum(r for r, _ in totals), sum(b for _, b in totals), elapsed, reported)


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of an ascending list."""
    if not sorted_values:
        raise BenchError("percentile of no samples")
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def stop_process(process, timeout: float = 60.0) -> int:
    """SIGTERM a child process (if it still runs), then wait_or_kill. Its exit status."""
    if process.poll() is None:
        process.terminate()
    return wait_or_kill(process, timeout)


def wait_or_kill(process, timeout: float = 60.0) -> int:
    """Wait for a child process to exit; SIGKILL it after `timeout` s. Its exit status."""
    import subprocess

    try:
        process.wait(timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return process.returncode
