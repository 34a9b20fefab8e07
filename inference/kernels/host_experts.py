"""Host-tier experts computed on the CPU: the thread pool (host_experts.c) and its mailbox.

When VRAM holds half of the experts and host RAM the other half, the GPU reads the host tier's
experts over the link, which bounds a decode step. The CPU's cores can compute part of them from
the same bytes at the same time (as llama.cpp computes the layers it keeps in RAM). The device
hands a job to the pool through a mailbox in page-locked host memory and spins until the pool
reports it done (inference.kernels.handoff launches the device side):

    pool = HostExpertsPool(host_address=..., host_slots=..., slot_bytes=..., max_pairs=64,
                           max_cols=2048, max_rows=2048, threads=12)
    kind = pool.add_kind(fused.up, fused.down, limit=None)   # a layer's gate/up and down GemvWeights
    pool.start()
    out = pool.run(kind, slots=[3, -1], x=x, top_k=2)      # host-side job (tests): [pairs, H] bf16

The pool computes whole experts (gate/up, the activation, down): one handoff a layer.

Mailbox (bytes): int64 words: the ticket (word 0, written last by the device), `done` (word 8,
the pool), the expert kind id, pair count and top-k (words 16-18), then each pair's host slot (-1:
not the CPU's) from word 24 on; then x rows (bfloat16 [max_pairs, max_cols]: hidden states) and
the outputs (bfloat16 [max_pairs, max_rows]: the experts' down rows).

The library is compiled on first use with the system C compiler for this CPU (-march=native) and
cached by the hash of its source and flags; HostExpertsUnavailable names what is missing.
"""

from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from inference.kernels.ops import GemvWeight
from packformat.constants import ElementType

KERNELS_DIR = Path(__file__).parent
SOURCE = KERNELS_DIR / "host_experts.c"
# element type -> the C kernel's kind code (host_experts.c KIND_*)
KINDS = {ElementType.Q4_K: 1, ElementType.MXFP4: 2}
HOST_TYPES = frozenset(KINDS)
W_TICKET, W_DONE, W_PROJECTION, W_PAIRS, W_TOP_K, W_SLOTS = 0, 8, 16, 17, 18, 24
MAX_PAIRS = 1024  # host_experts.c's job table


class HostExpertsUnavailable(RuntimeError):
    """The CPU experts pool cannot run here (no compiler, a failed build, a bad argument)."""


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "expertpack" / "host_experts"


def compile_library(source: Path, flags: Sequence[str], cache_dir: Path) -> Path:
    """`source` compiled with the system C compiler and `flags` into a shared library, once per
    source, compiler and flags (cached in `cache_dir` by their hash); its path."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise HostExpertsUnavailable(f"no C compiler (cc or gcc) on PATH to build {source.name}")
    # this package's headers (mailbox_wait.h) are found for a source anywhere (a revision under
    # test or bench elsewhere), and count in the cache key with those beside the source
    flags = [*flags, f"-I{KERNELS_DIR}", "-shared", "-fPIC"]
    headers = b"".join(h.read_bytes() for h in sorted({*source.parent.glob("*.h"), *KERNELS_DIR.glob("*.h")}))
    digest = hashlib.sha256(source.read_bytes() + headers + " ".join([compiler, *flags]).encode()).hexdigest()[:16]
    library = cache_dir / f"{source.stem}-{digest}.so"
    if not library.exists():
        cache_dir.mkdir(parents=True, exist_ok=True)
        partial = library.with_suffix(f".{os.getpid()}.partial")
        done = subprocess.run([compiler, *flags, str(source), "-o", str(partial)], capture_output=True, text=True)
        if done.returncode != 0:
            raise HostExpertsUnavailable(f"{compiler} failed on {source.name}: {done.stderr.strip()[-500:]}")
        partial.replace(library)
    return library


def build_library(cache_dir: Path | None = None, march: str = "native", source: Path = SOURCE) -> ctypes.CDLL:
    """host_experts.c (or another revision of it: `source`, for benchmarks) compiled for `march`
    (once per source and flags) and loaded."""
    # -ffp-contract=off: weights dequantize as gguf-py does, a multiply then a subtract, no FMA
    library = compile_library(source, ["-O3", f"-march={march}", "-ffp-contract=off", "-pthread"],
                              cache_dir or default_cache_dir())
    lib = ctypes.CDLL(str(library))
    p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
    lib.host_experts_kernel.restype = ctypes.c_char_p
    lib.host_experts_kernel.argtypes = []
    lib.host_experts_create.restype = p
    lib.host_experts_create.argtypes = [p, i64, i64, i64, i64, i64, p, i64, i64]
    lib.host_experts_add_kind.restype = i32
    lib.host_experts_add_kind.argtypes = [p, i32, p, p, p, p, p, p, i64, i64, i32, ctypes.c_float]
    lib.host_experts_activate.restype = ctypes.c_int
    lib.host_experts_activate.argtypes = [p, i32, i64, p, p]
    lib.host_experts_start.restype = ctypes.c_int
    lib.host_experts_start.argtypes = [p, ctypes.c_int]
    lib.host_experts_stats.restype = None
    lib.host_experts_stats.argtypes = [p, p]
    lib.host_experts_destroy.restype = None
    lib.host_experts_destroy.argtypes = [p]
    return lib


def readable(weights: Sequence[GemvWeight]) -> str | None:
    """None when the pool can compute these projection segments, else why not."""
    for w in weights:
        if w.element_type not in KINDS:
            return (f"{ElementType(w.element_type).name} weights (the CPU kernels read "
                    f"{', '.join(sorted(t.name for t in HOST_TYPES))})")
    if len({w.cols for w in weights}) != 1:
        return "segments of different widths"
    return None


@dataclasses.dataclass(frozen=True)
class HostExpertsStats:
    jobs: int  # jobs served
    failed_jobs: int  # jobs refused as malformed (the device then redoes the step)
    busy_seconds: float  # the leader's time from seeing a ticket to reporting it done


class HostExpertsPool:
    """The pool's threads, its mailbox (page-locked where CUDA is available, so the device writes
    and reads it in place) and the expert kinds it knows."""

    def __init__(self, *, host_address: int, host_slots: int, slot_bytes: int, max_pairs: int, max_cols: int,
                 max_rows: int, threads: int, pinned: bool | None = None, cache_dir: Path | None = None,
                 source: Path = SOURCE, march: str = "native"):
        if not 1 <= max_pairs <= MAX_PAIRS:
            raise HostExpertsUnavailable(f"max_pairs {max_pairs} outside 1..{MAX_PAIRS}")
        if threads < 1 or host_slots < 1 or slot_bytes < 1 or max_cols < 1 or max_rows < 1:
            raise HostExpertsUnavailable(f"threads {threads}, host_slots {host_slots}, slot_bytes {slot_bytes}, "
                                         f"max_cols {max_cols}, max_rows {max_rows}: each must be positive")
        self.lib = build_library(cache_dir, march=march, source=source)
        self.kernel = self.lib.host_experts_kernel().decode()
        self.threads, self.max_pairs = threads, max_pairs
        self.max_cols = -(-max_cols // 32) * 32  # elements: rows start 64-byte aligned
        self.max_rows = -(-max_rows // 32) * 32
        self.x_offset = 8 * (W_SLOTS + max_pairs)  # bytes
        self.x_offset = -(-self.x_offset // 64) * 64
        self.out_offset = self.x_offset + 2 * max_pairs * self.max_cols
        nbytes = self.out_offset + 2 * max_pairs * self.max_rows
        pinned = torch.cuda.is_available() if pinned is None else pinned
        self.mailbox = torch.zeros(nbytes // 8, dtype=torch.int64, pin_memory=pinned)  # int64 words
        raw = self.mailbox.view(torch.uint8)
        self.words = self.mailbox  # [nbytes / 8] int64
        self.x = raw[self.x_offset:self.out_offset].view(torch.bfloat16).view(max_pairs, self.max_cols)
        self.out = raw[self.out_offset:].view(torch.bfloat16).view(max_pairs, self.max_rows)
        self._pool = self.lib.host_experts_create(self.mailbox.data_ptr(), max_pairs, self.x_offset, self.max_cols,
                                                  self.out_offset, self.max_rows, host_address, host_slots,
                                                  slot_bytes)
        if not self._pool:
            raise HostExpertsUnavailable("host_experts_create failed")
        self.kind_rows: list[int] = []  # each kind's output row (down rows, H)
        self.kind_intermediate: list[int] = []
        self.started = False

    def add_kind(self, up: Sequence[GemvWeight], down: GemvWeight, limit: float | None = None) -> int:
        """Register a layer's experts: `up` the gate/up weights (gate rows then up rows, 2I), `down`
        [H, I]; the activation SiLU(gate) * up, with gate clamped to <= limit and up to [-limit,
        limit] when a limit is given. Its id."""
        weights = (*up, down)
        why = readable(up) or readable((down,))
        if why is not None:
            raise HostExpertsUnavailable(f"the CPU experts kernels cannot read {why}")
        hidden, intermediate = up[0].cols, down.cols
        if hidden > self.max_cols or down.rows > self.max_rows:
            raise HostExpertsUnavailable(f"experts of hidden size {hidden} (down rows {down.rows}) do not fit the "
                                         f"mailbox's {self.max_rows} x {self.max_cols}")
        n = len(weights)
        arrays = [(ctypes.c_int32 * n)(*[KINDS[w.element_type] for w in weights])]
        for field in ("rows", "row_bytes", "first_offset", "second_offset", "split"):
            arrays.append((ctypes.c_int64 * n)(*[getattr(w, field) for w in weights]))
        kind = self.lib.host_experts_add_kind(self._pool, len(up), *[ctypes.addressof(a) for a in arrays], hidden,
                                              intermediate, limit is not None, 0.0 if limit is None else limit)
        if kind < 0:
            raise HostExpertsUnavailable(f"the pool refused experts of gate/up {sum(w.rows for w in up)} x {hidden}, "
                                         f"down {down.rows} x {intermediate} (started: {self.started})")
        self.kind_rows.append(down.rows)
        self.kind_intermediate.append(intermediate)
        return kind

    def activate(self, kind: int, gate_up: torch.Tensor) -> torch.Tensor:
        """bf16 [n, I]: the pool's activation of gate/up rows (bf16 [n, 2I]) on this thread."""
        gate_up = gate_up.to("cpu", torch.bfloat16).contiguous()
        out = torch.empty(gate_up.shape[0], self.kind_intermediate[kind], dtype=torch.bfloat16)
        assert gate_up.shape[1] == 2 * out.shape[1]
        if self.lib.host_experts_activate(self._pool, kind, gate_up.shape[0], gate_up.data_ptr(), out.data_ptr()):
            raise HostExpertsUnavailable(f"unknown expert kind {kind}")
        return out

    def start(self) -> None:
        if self.lib.host_experts_start(self._pool, self.threads) != 0:
            raise HostExpertsUnavailable(f"starting {self.threads} CPU experts threads failed")
        self.started = True

    def stats(self) -> HostExpertsStats:
        out = (ctypes.c_int64 * 3)()
        self.lib.host_experts_stats(self._pool, ctypes.addressof(out))
        return HostExpertsStats(out[0], out[1], out[2] / 1e9)

    def run(self, kind: int, slots: Sequence[int], x: torch.Tensor, top_k: int,
            timeout: float = 10.0) -> torch.Tensor:
        """One job from the host (tests and tools; the device posts its own): bf16 [pairs, H] with
        row p = the expert at host slot slots[p] applied to x[p // top_k] where slots[p] >= 0
        (other rows untouched)."""
        pairs = len(slots)
        assert self.started and 0 < pairs <= self.max_pairs and x.dtype == torch.bfloat16
        self.x[: x.shape[0], : x.shape[1]] = x
        words = self.words
        words[W_SLOTS:W_SLOTS + pairs] = torch.tensor(list(slots), dtype=torch.int64)
        words[W_PROJECTION], words[W_PAIRS], words[W_TOP_K] = kind, pairs, top_k
        ticket = int(words[W_TICKET]) + 1
        words[W_TICKET] = ticket  # after the inputs: a plain store, ordered on x86
        deadline = time.monotonic() + timeout
        while int(words[W_DONE]) not in (ticket, -ticket):
            if time.monotonic() > deadline:
                raise HostExpertsUnavailable(f"the CPU experts pool did not answer job {ticket} in {timeout} s")
            time.sleep(0)
        if int(words[W_DONE]) == -ticket:
            raise HostExpertsUnavailable(f"the CPU experts pool refused job {ticket} (a slot outside the host tier "
                                         "or an unknown expert kind)")
        return self.out[:pairs, : self.kind_rows[kind]].clone()

    def close(self) -> None:
        """Stop the threads (the device must not post jobs any more)."""
        if getattr(self, "_pool", None):  # None too when __init__ failed before it
            self.lib.host_experts_destroy(self._pool)
            self._pool = None

    def __del__(self) -> None:
        self.close()
