"""How fast the CPU computes Q4_K experts from their quantized bytes, against its memory bandwidth.

At a 50% budget a decode step reads half of its experts from the host tier, over the link, at
~40 GB/s (bench/host_read_probe.py: the SMs pull at most ~50); the host's cores read the same
memory at ~100 GB/s. Computing part of the host-tier experts on the CPU beside the GPU (llama.cpp's
way) is worth what a CPU kernel reaches. This times bench/cpu_experts/q4k_gemv.c (built here with
the system C compiler: -O3 -march=native -fopenmp), one token's experts of a layer of the
Qwen3-like shape (gate+up [2I, H], down [H, I], Q4_K), rotating over `--experts` objects, per
thread count, beside a plain sum over the same bytes (the memory's ceiling for those threads).

    python bench/cpu_expert_probe.py --threads 1 2 4 8 16 --json out.json
    python bench/cpu_expert_probe.py --gpu-link-load     # also while the GPU reads host memory in place
    python bench/cpu_expert_probe.py --gpu-link-load --link-mode copy-engine   # or the copy engine does

Both draw on the same host memory: with --gpu-link-load (CUDA) each thread count is timed again
while a CUDA stream sums another registered host buffer over the link without pause, as the
GPU's share of the host-tier experts would be read, and the link's rate during it is printed
beside its rate alone: together, what splitting host-tier experts between the two could reach.
`--link-mode copy-engine` keeps the copy engine moving a page-locked host buffer to VRAM instead
(what a host agent copying the GPU's share of the experts ahead of its GEMV would draw on the same
memory: 52.6 GB/s alone on the H200, against ~40 for the SMs' reads in place).

The kernel's output is checked against gguf-py's dequantization and a float64 product first
(exit status 1 when it is off by more than float32 rounding), so a fast wrong kernel never
reports a rate.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402

from packformat.constants import ElementType  # noqa: E402

Q4_K = ElementType.Q4_K
SOURCE = REPO / "bench" / "cpu_experts" / "q4k_gemv.c"
BLOCK_WEIGHTS, BLOCK_BYTES = 256, 144  # Q4_K
SHAPE = (2048, 768, 8)  # hidden, intermediate, top-k: the Qwen3-like bench shape
TOLERANCE = 1e-4  # relative to the largest |output|: float32 sums of 2048 products, any order


class KernelUnavailable(RuntimeError):
    """No C compiler, or the kernel did not build: the probe cannot run here."""


def build_kernel(cache_dir: Path, march: str = "native") -> ctypes.CDLL:
    """Compiles q4k_gemv.c for `march` (native: AVX2 and FMA where the CPU has them, else the
    portable loop) once per source and flags (cached by their hash) and loads it."""
    from inference.kernels.host_experts import HostExpertsUnavailable, compile_library

    try:
        library = compile_library(SOURCE, ["-O3", f"-march={march}", "-fopenmp"], cache_dir)
    except HostExpertsUnavailable as exc:
        raise KernelUnavailable(str(exc)) from None
    kernel = ctypes.CDLL(str(library))
    kernel.q4k_gemv_many.restype = None
    kernel.q4k_gemv_many.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    return kernel


def _pointers(arrays) -> ctypes.Array:
    return (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])


def gemv_many(kernel: ctypes.CDLL, weights: list[np.ndarray], xs: list[np.ndarray], rows: int, cols: int,
              threads: int, out: list[np.ndarray] | None = None) -> list[np.ndarray]:
    """y[m] = W_m · x[m] for Q4_K matrices W_m (uint8 [rows, cols / 256 * 144]) and float32 x[m] [cols]."""
    assert cols % BLOCK_WEIGHTS == 0 and all(w.shape == (rows, cols // BLOCK_WEIGHTS * BLOCK_BYTES) for w in weights)
    sums = [x.reshape(-1, 32).sum(axis=1, dtype=np.float32) for x in xs]  # [cols / 32]: shared by every row
    out = out if out is not None else [np.empty(rows, dtype=np.float32) for _ in weights]
    kernel.q4k_gemv_many(len(weights), _pointers(weights), _pointers(xs), _pointers(sums), _pointers(out),
                         rows, cols, threads)
    return out


def check(kernel: ctypes.CDLL, rng: np.random.Generator, rows: int = 96, cols: int = 1024) -> float:
    """Largest error of the kernel against gguf-py's dequantization and a float64 product, relative
    to the largest |output|; raises AssertionError above TOLERANCE."""
    from gguf import GGMLQuantizationType, quants

    from packtools.quants.random_fill import random_blocks

    weights = [random_blocks(Q4_K, (rows, cols), rng) for _ in range(3)]
    xs = [rng.standard_normal(cols).astype(np.float32) for _ in weights]
    worst = 0.0
    for threads in (1, 3):
        for w, x, y in zip(weights, xs, gemv_many(kernel, weights, xs, rows, cols, threads)):
            dense = quants.dequantize(w, GGMLQuantizationType.Q4_K).astype(np.float64)  # [rows, cols]
            reference = dense @ x.astype(np.float64)
            worst = max(worst, float(np.abs(y - reference).max() / np.abs(reference).max()))
    assert worst <= TOLERANCE, f"q4k_gemv is off by {worst:.2e} of the largest output (tolerance {TOLERANCE:.0e})"
    return worst


def _sum_gbps(data: np.ndarray, threads: int) -> float:
    import torch

    words = torch.from_numpy(data.view(np.int64))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        words.sum()
        start = time.perf_counter()
        for _ in range(3):
            words.sum()
        return data.nbytes * 3 / (time.perf_counter() - start) / 1e9
    finally:
        torch.set_num_threads(before)


def probe(kernel: ctypes.CDLL, experts: int, thread_counts: list[int], seconds: float) -> dict:
    hidden, inter, top_k = SHAPE
    rng = np.random.default_rng(0)
    from packtools.quants.random_fill import random_blocks

    one_up = random_blocks(Q4_K, (2 * inter, hidden), rng)  # [2I, H / 256 * 144]
    one_down = random_blocks(Q4_K, (hidden, inter), rng)  # [H, I / 256 * 144]
    down_cols = inter
    # every object its own copy: the rotation must come from memory, not from the caches
    arena = np.concatenate([np.concatenate([one_up.reshape(-1), one_down.reshape(-1)]) for _ in range(experts)])
    object_bytes = one_up.nbytes + one_down.nbytes
    ups = [arena[e * object_bytes:e * object_bytes + one_up.nbytes].reshape(one_up.shape) for e in range(experts)]
    downs = [arena[e * object_bytes + one_up.nbytes:(e + 1) * object_bytes].reshape(one_down.shape)
             for e in range(experts)]
    x = rng.standard_normal(hidden).astype(np.float32)
    h = [rng.standard_normal(down_cols).astype(np.float32) for _ in range(top_k)]
    up_out = [np.empty(2 * inter, dtype=np.float32) for _ in range(top_k)]
    down_out = [np.empty(hidden, dtype=np.float32) for _ in range(top_k)]
    rows = []
    for threads in thread_counts:
        calls, start, first = 0, time.perf_counter(), 0
        while True:
            chosen = [(first + j) % experts for j in range(top_k)]
            gemv_many(kernel, [ups[e] for e in chosen], [x] * top_k, 2 * inter, hidden, threads, up_out)
            gemv_many(kernel, [downs[e] for e in chosen], h, hidden, down_cols, threads, down_out)
            calls, first = calls + 1, (first + top_k) % experts
            elapsed = time.perf_counter() - start
            if elapsed >= seconds and calls >= 3:
                break
        us = elapsed / calls * 1e6
        rows.append({"threads": threads, "us_per_layer": us, "gbps": top_k * object_bytes / us / 1e3,
                     "memory_sum_gbps": _sum_gbps(arena, threads)})
    return {"type": "Q4_K", "hidden": hidden, "intermediate": inter, "top_k": top_k, "object_bytes": object_bytes,
            "experts": experts, "rows": rows}


LINK_MODES = ("in-place", "copy-engine")


class LinkLoad:
    """`nbytes` of host memory which `running()` keeps the GPU reading for the block, on a stream of
    its own: in place (registered with the device, a sum over it again and again) or through the
    copy engine (page-locked, copied to a VRAM buffer again and again)."""

    def __init__(self, nbytes: int, mode: str = "in-place"):
        import torch

        from bench.host_read_probe import MappedView
        from storaged.device.cuda_driver import DriverApi

        if mode not in LINK_MODES:
            raise ValueError(f"link mode {mode!r}: expected one of {', '.join(LINK_MODES)}")
        self.mode = mode
        self._driver = self._words = self._vram = None
        if mode == "copy-engine":  # page-locked by the allocator, so a non-blocking copy is one DMA
            self._host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(1)
            self._vram = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            return
        self._host = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # pages touched: real memory
        self._driver = DriverApi(torch.cuda.current_device())
        address = self._driver.register_mapped(self._host.data_ptr(), nbytes)
        self._words = torch.as_tensor(MappedView(address, nbytes), device="cuda")  # [n / 8] int64, read in place

    @contextlib.contextmanager
    def running(self) -> Iterator[dict]:
        """→ {"gbps": the link's read rate over the block}, filled in when the block ends."""
        import torch

        stop, rate = threading.Event(), {"gbps": 0.0}

        def run() -> None:
            stream, moved, start = torch.cuda.Stream(), 0, time.perf_counter()
            with torch.cuda.stream(stream):
                while not stop.is_set():
                    if self._vram is not None:
                        self._vram.copy_(self._host, non_blocking=True)
                    else:
                        self._words.sum()
                    stream.synchronize()
                    moved += self._host.numel()
            rate["gbps"] = moved / (time.perf_counter() - start) / 1e9

        thread = threading.Thread(target=run, name="link load", daemon=True)
        thread.start()
        try:
            yield rate
        finally:
            stop.set()
            thread.join()

    def close(self) -> None:
        import torch

        torch.cuda.synchronize()
        if self._driver is not None:
            self._driver.unregister(self._host.data_ptr())
            self._driver.close()


def link_rates(kernel: ctypes.CDLL, experts: int, thread_counts: list[int], seconds: float,
               nbytes: int = 1 << 29, mode: str = "in-place") -> dict:
    """The link's rate alone, then per thread count the CPU's rate with the link busy and the link's meanwhile."""
    load = LinkLoad(nbytes, mode)
    try:
        with load.running() as alone:
            time.sleep(seconds)
        rows = []
        for threads in thread_counts:
            with load.running() as link:
                cpu = probe(kernel, experts, [threads], seconds)["rows"][0]
            rows.append({"threads": threads, "cpu_gbps": cpu["gbps"], "link_gbps": link["gbps"],
                         "together_gbps": cpu["gbps"] + link["gbps"]})
        return {"link_mode": mode, "link_alone_gbps": alone["gbps"], "buffer_bytes": nbytes, "rows": rows}
    finally:
        load.close()


def report(result: dict) -> str:
    lines = [f"Q4_K experts of {result['object_bytes'] / 1e6:.2f} MB (hidden {result['hidden']}, intermediate "
             f"{result['intermediate']}), {result['top_k']} a layer, rotating over {result['experts']}; "
             f"kernel off by at most {result['max_relative_error']:.1e} of the largest output"]
    for r in result["rows"]:
        lines.append(f"  {r['threads']:3d} threads: {r['us_per_layer']:9.1f} us a layer's experts, {r['gbps']:6.1f} GB/s "
                     f"of weights | a plain sum over the same bytes {r['memory_sum_gbps']:6.1f} GB/s "
                     f"({r['gbps'] / r['memory_sum_gbps']:.2f} of it)")
    link = result.get("link")
    if link:
        how = "through the copy engine" if link.get("link_mode") == "copy-engine" else "in place"
        lines.append(f"  the GPU reading {link['buffer_bytes'] / 1e6:.0f} MB of host memory {how}: "
                     f"{link['link_alone_gbps']:.1f} GB/s alone")
        for r in link["rows"]:
            lines.append(f"  {r['threads']:3d} threads beside it: CPU {r['cpu_gbps']:6.1f} GB/s, link {r['link_gbps']:6.1f} "
                         f"GB/s, together {r['together_gbps']:6.1f} GB/s")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=None,
                        help="thread counts to time (default: 1, then powers of two up to the CPU count)")
    parser.add_argument("--experts", type=int, default=64, help="distinct objects the calls rotate over")
    parser.add_argument("--seconds", type=float, default=1.0, help="timing per thread count")
    parser.add_argument("--gpu-link-load", action="store_true",
                        help="time each thread count again while the GPU reads host memory (CUDA)")
    parser.add_argument("--link-mode", choices=LINK_MODES, default=None,
                        help="how --gpu-link-load reads: in place by the SMs (default) or by the copy engine")
    parser.add_argument("--cache-dir", type=Path, default=Path(tempfile.gettempdir()) / "expertpack-cpu-kernels")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    cpus = os.cpu_count() or 1
    threads = args.threads or sorted({1, *[2 ** i for i in range(1, cpus.bit_length()) if 2 ** i <= cpus], cpus})
    if any(t < 1 for t in threads) or args.experts < SHAPE[2] or args.seconds <= 0:
        parser.error("--threads must be >= 1, --experts at least the top-k (8), --seconds > 0")
    if args.link_mode is not None and not args.gpu_link_load:
        parser.error("--link-mode says how --gpu-link-load reads; it needs --gpu-link-load")
    try:
        kernel = build_kernel(args.cache_dir)
    except KernelUnavailable as exc:
        print(f"cpu_expert_probe: {exc}", file=sys.stderr)
        return 2
    try:
        error = check(kernel, np.random.default_rng(1))
    except AssertionError as exc:
        print(f"cpu_expert_probe: {exc}", file=sys.stderr)
        return 1
    result = probe(kernel, args.experts, threads, args.seconds) | {"max_relative_error": error, "cpu_count": cpus}
    if args.gpu_link_load:
        import torch

        if not torch.cuda.is_available():
            print("cpu_expert_probe: --gpu-link-load needs CUDA", file=sys.stderr)
            return 2
        result["link"] = link_rates(kernel, args.experts, threads, args.seconds, mode=args.link_mode or "in-place")
    print(report(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
