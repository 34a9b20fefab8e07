"""Time inference.dequant per element type against the device's copy bandwidth (the roofline).

Workload: one MoE layer's selected experts, each with gate and up [rows, cols] and down
[cols, rows], dequantized role by role with dequantize_many (one launch per role). For each
type and backend it prints the median time, GB/s of output written and of input read, their
sum, and that sum as a share of a device-to-device copy (read + write) of a buffer the size
of the output. On CUDA it times with triton.testing.do_bench_cudagraph (GPU time alone: the
roofline columns use it) and do_bench (eager: what a caller without CUDA graphs sees, host
launch overhead included), and reports the host time one dequantize_many call takes to issue;
on CPU it times with perf_counter.

    python bench/dequant_bench.py                      # CUDA, 8 experts of [2048, 4096]
    python bench/dequant_bench.py --device cpu --rows 256 --cols 512 --experts 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from inference.dequant import dequantize_many, triton_backend  # noqa: E402
from packformat.constants import SELF_CONTAINED_TYPES, ElementType, tensor_nbytes  # noqa: E402
from packtools.quants import random_blocks  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--experts", type=int, default=8, help="experts per launch (N)")
    parser.add_argument("--rows", type=int, default=2048, help="intermediate size I")
    parser.add_argument("--cols", type=int, default=4096, help="hidden size H")
    parser.add_argument("--types", default="all", help="comma-separated type names, or all")
    parser.add_argument("--out-dtypes", default="bfloat16,float32", help="comma-separated")
    parser.add_argument("--repeats", type=int, default=20, help="CPU timing repetitions")
    return parser.parse_args(argv)


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int, graph: bool = True) -> float:
    """Median time of fn in milliseconds (after a warm-up call); on CUDA in a CUDA graph
    (GPU time) or eagerly (launch overhead included)."""
    if device.type == "cuda":
        import triton.testing  # only on CUDA: CPU runs never import triton

        bench = triton.testing.do_bench_cudagraph if graph else triton.testing.do_bench
        return float(bench(fn, return_mode="median"))
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 100) -> float:
    """Host time to issue one call, in microseconds (CUDA: launches are queued, not waited on;
    100 calls stay far below the launch queue's depth)."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return elapsed / calls * 1e6


def copy_bandwidth(nbytes: int, device: torch.device, repeats: int) -> float:
    """GB/s (bytes read + written) of a device-to-device copy of an nbytes buffer."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    ms = median_ms(lambda: target.copy_(source), device, repeats)
    return 2 * nbytes / (ms * 1e-3) / 1e9


def role_shapes(rows: int, cols: int) -> list[tuple[int, int]]:
    return [(rows, cols), (rows, cols), (cols, rows)]  # gate, up, down


def make_roles(qtype: ElementType, args: argparse.Namespace, device: torch.device) -> list[torch.Tensor]:
    """Random valid bytes of every role: uint8 [experts, role bytes] each, on the device."""
    rng = np.random.default_rng(int(qtype))
    roles = []
    for shape in role_shapes(args.rows, args.cols):
        raw = random_blocks(qtype, (args.experts, *shape), rng)  # uint8 [E, rows, row bytes]
        roles.append(torch.from_numpy(raw.reshape(args.experts, -1)).to(device))
    return roles


def bench_type(qtype: ElementType, args: argparse.Namespace, device: torch.device,
               out_dtype: torch.dtype, copy_gbps: float) -> list[list[str]]:
    roles = make_roles(qtype, args, device)
    shapes = role_shapes(args.rows, args.cols)
    in_bytes = sum(role.numel() for role in roles)
    assert in_bytes == args.experts * sum(tensor_nbytes(qtype, shape) for shape in shapes)
    out_bytes = args.experts * sum(r * c for r, c in shapes) * out_dtype.itemsize
    module = triton_backend() if device.type == "cuda" else None
    backends = ["torch"] + (["triton"] if module is not None and qtype in module.TRITON_TYPES else [])

    def run(backend: str) -> list[torch.Tensor]:
        return [dequantize_many(role, qtype, shape, out_dtype, backend=backend)
                for role, shape in zip(roles, shapes)]

    results = {backend: run(backend) for backend in backends}
    same = "-" if "triton" not in results else "yes" if all(
        torch.equal(a.view(torch.int8), b.view(torch.int8))
        for a, b in zip(results["torch"], results["triton"])
    ) else "NO"
    del results
    lines = []
    for backend in backends:
        ms = median_ms(lambda: run(backend), device, args.repeats)
        eager_ms = median_ms(lambda: run(backend), device, args.repeats, graph=False)
        host_us = host_us_per_call(
            lambda: dequantize_many(roles[0], qtype, shapes[0], out_dtype, backend=backend), device)
        seconds = ms * 1e-3
        out_gbps, in_gbps = out_bytes / seconds / 1e9, in_bytes / seconds / 1e9
        total = out_gbps + in_gbps
        lines.append([qtype.name, backend, f"{ms:.3f}", f"{eager_ms:.3f}", f"{host_us:.0f}",
                      f"{out_gbps:.1f}", f"{in_gbps:.1f}", f"{total:.1f}",
                      f"{100 * total / copy_gbps:.0f}%", same])
    return lines


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
    for row in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(cell).rjust(width) for cell, width in zip(row, widths)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu", file=sys.stderr)
        return 2
    names = sorted(t.name for t in SELF_CONTAINED_TYPES) if args.types == "all" else args.types.split(",")
    qtypes = [ElementType[name.strip()] for name in names]
    print(f"device {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"{args.experts} experts x gate/up [{args.rows}, {args.cols}] + down "
          f"[{args.cols}, {args.rows}] per launch set")
    for dtype_name in args.out_dtypes.split(","):
        out_dtype = DTYPES[dtype_name.strip()]
        out_bytes = args.experts * 3 * args.rows * args.cols * out_dtype.itemsize
        copy_gbps = copy_bandwidth(out_bytes, device, args.repeats)
        print(f"\nout dtype {dtype_name}: roofline = copy of {out_bytes / 1e6:.1f} MB at "
              f"{copy_gbps:.0f} GB/s (read + write)")
        rows = []
        for qtype in qtypes:
            rows.extend(bench_type(qtype, args, device, out_dtype, copy_gbps))
            if device.type == "cuda":
                torch.cuda.empty_cache()
        print_table(["type", "backend", "ms", "eager ms", "host us/call", "out GB/s", "in GB/s",
                     "in+out GB/s", "of copy", "torch==triton"], rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
