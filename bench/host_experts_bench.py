"""How fast the CPU experts pool (inference/kernels/host_experts.c) computes whole experts, against
the memory's rate for the same threads and, optionally, another revision of the kernels.

Each job is what one decode step hands the pool for a layer: `--pairs` experts of one token
(gate/up rows, the activation, down rows), on objects laid out as the pack holds them (gate, up,
down roles of random valid blocks), rotating over enough objects that they come from memory, not
the caches. Per expert type and thread count it prints the pool's rate in GB/s of expert bytes
(the best job and the median), a plain sum over the same bytes on the same number of threads
(torch's reduction: the memory's ceiling for those threads) and the pool's share of it; with
`--baseline FILE` (a host_experts.c of another revision, e.g. `git show REV:inference/kernels/
host_experts.c > old.c`) the baseline's rate in the same run and the ratio, after checking that
both give the same outputs.

    python bench/host_experts_bench.py --threads 1 2 --json out.json
    python bench/host_experts_bench.py --types Q4_K --baseline old.c

Shapes: Q4_K as the Qwen3-like bench model's experts (hidden 2048, intermediate 768), MXFP4 as
the DeepSeek-V4-Flash-like one's (4096, 2048). Pools run one at a time: a pool's threads spin
after each job, and two would take each other's cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.cpu_expert_probe import _sum_gbps  # noqa: E402
from inference.kernels.host_experts import SOURCE, HostExpertsPool, HostExpertsUnavailable  # noqa: E402
from inference.kernels.ops import gemv_weight  # noqa: E402
from packformat import ElementType, Role, RoleEntry  # noqa: E402
from packformat.constants import tensor_nbytes  # noqa: E402

SHAPES = {"Q4_K": (2048, 768), "MXFP4": (4096, 2048)}  # expert type -> (hidden, intermediate)


class BenchError(RuntimeError):
    pass


def host_objects(element_type: ElementType, hidden: int, inter: int, count: int, seed: int = 0):
    """(uint8 tensor of `count` objects, object stride, gate/up GemvWeight, down GemvWeight, expert bytes)."""
    from packtools.quants import random_blocks

    rng = np.random.default_rng(seed)
    shapes = [(Role.GATE, (inter, hidden)), (Role.UP, (inter, hidden)), (Role.DOWN, (hidden, inter))]
    entries, offset = [], 0
    for role, shape in shapes:
        nbytes = tensor_nbytes(element_type, shape)
        entries.append(RoleEntry(role, int(element_type), offset, nbytes, shape))
        offset = -(-(offset + nbytes) // 4096) * 4096  # bytes: roles 4096-aligned, as the pack writer does
    stride = offset
    objects = torch.empty(count * stride, dtype=torch.uint8)
    for i in range(count):
        for e in entries:
            blocks = random_blocks(element_type, e.shape, rng).reshape(-1)
            objects[i * stride + e.offset:i * stride + e.offset + e.nbytes] = torch.from_numpy(np.ascontiguousarray(blocks))
    up = gemv_weight(entries[:2], rows=2 * inter, cols=hidden)
    down = gemv_weight(entries[2:], rows=hidden, cols=inter)
    return objects, stride, up, down, sum(e.nbytes for e in entries)


def time_pool(source: Path, objects: torch.Tensor, stride: int, up, down, hidden: int, threads: int, pairs: int,
              seconds: float) -> tuple[list[float], torch.Tensor]:
    """Seconds of each job over `seconds`, and the first job's outputs."""
    count = objects.numel() // stride
    pool = HostExpertsPool(host_address=objects.data_ptr(), host_slots=count, slot_bytes=stride, max_pairs=pairs,
                           max_cols=hidden, max_rows=hidden, threads=threads, pinned=False, source=source)
    try:
        kind = pool.add_kind((up,), down)
        pool.start()
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(1)).bfloat16()
        first = pool.run(kind, list(range(pairs)), x, top_k=pairs)
        times, job, deadline = [], 0, time.perf_counter() + seconds
        while time.perf_counter() < deadline or len(times) < 3:
            slots = [(job * pairs + i) % count for i in range(pairs)]
            started = time.perf_counter()
            pool.run(kind, slots, x, top_k=pairs)
            times.append(time.perf_counter() - started)
            job += 1
        return times, first
    finally:
        pool.close()


def bench_type(name: str, thread_counts: list[int], pairs: int, objects_mib: float, seconds: float,
               baseline: Path | None) -> list[dict]:
    element_type = ElementType[name]
    hidden, inter = SHAPES[name]
    one = tensor_nbytes(element_type, (inter, hidden)) * 3
    count = max(2 * pairs, int(objects_mib * 2**20 // one))
    objects, stride, up, down, expert_bytes = host_objects(element_type, hidden, inter, count)
    rows = []
    for threads in thread_counts:
        times, outputs = time_pool(SOURCE, objects, stride, up, down, hidden, threads, pairs, seconds)
        job_bytes = expert_bytes * pairs
        row = {"type": name, "hidden": hidden, "intermediate": inter, "threads": threads, "pairs": pairs,
               "objects": count, "jobs": len(times), "best_us": 1e6 * min(times),
               "median_us": 1e6 * statistics.median(times), "gbps_best": job_bytes / min(times) / 1e9,
               "gbps_median": job_bytes / statistics.median(times) / 1e9,
               "memory_sum_gbps": _sum_gbps(objects.numpy(), threads)}
        row["of_memory"] = row["gbps_median"] / row["memory_sum_gbps"]
        if baseline is not None:
            base_times, base_outputs = time_pool(baseline, objects, stride, up, down, hidden, threads, pairs, seconds)
            if not torch.equal(base_outputs, outputs):
                worst = (base_outputs.float() - outputs.float()).abs().max().item()
                scale = outputs.float().abs().max().item()
                if worst > scale * 2**-6:  # summation order may round a row differently, no more
                    raise BenchError(f"{name}: the baseline's outputs differ by {worst:.3g} (largest {scale:.3g})")
            row["baseline_gbps_median"] = job_bytes / statistics.median(base_times) / 1e9
            row["baseline_gbps_best"] = job_bytes / min(base_times) / 1e9
            row["over_baseline"] = row["gbps_median"] / row["baseline_gbps_median"]
        rows.append(row)
    return rows


def report(rows: list[dict], kernel: str) -> str:
    baseline = any("baseline_gbps_median" in r for r in rows)
    head = "| type | threads | experts a job | job µs (median) | GB/s median (best) | memory sum GB/s | of memory |"
    rule = "|---|---:|---:|---:|---:|---:|---:|"
    if baseline:
        head += " baseline GB/s median (best) | ÷ baseline |"
        rule += "---:|---:|"
    lines = [f"kernels: {kernel}", "", head, rule]
    for r in rows:
        line = (f"| {r['type']} | {r['threads']} | {r['pairs']} | {r['median_us']:.0f} | {r['gbps_median']:.2f} "
                f"({r['gbps_best']:.2f}) | {r['memory_sum_gbps']:.1f} | {r['of_memory']:.2f} |")
        if baseline:
            line += f" {r['baseline_gbps_median']:.2f} ({r['baseline_gbps_best']:.2f}) | {r['over_baseline']:.2f}× |"
        lines.append(line)
    return "\n".join(lines)


CPU_FLAGS = ("avx2", "avx512f", "avx512bw", "avx512_bf16", "amx_bf16")  # what the kernels could use


def host_cpu(cpuinfo: str | None = None) -> dict:
    """The host's CPU as /proc/cpuinfo names it: model, logical CPUs, and which of CPU_FLAGS it has
    (the kernels' speed differs by vendor and generation more than by clock)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return {"model": None, "logical_cpus": os.cpu_count(), "flags": []}
    pairs = [tuple(part.strip() for part in line.split(":", 1)) for line in cpuinfo.splitlines() if ":" in line]
    model = next((value for key, value in pairs if key == "model name"), None)
    flags = set(next((value.split() for key, value in pairs if key == "flags"), []))
    return {"model": model, "logical_cpus": sum(1 for key, _ in pairs if key == "processor"),
            "flags": [flag for flag in CPU_FLAGS if flag in flags]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--types", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--pairs", type=int, default=4, help="experts a job (one token's share of a layer)")
    parser.add_argument("--objects-mib", type=float, default=256.0, help="expert bytes the jobs rotate over")
    parser.add_argument("--seconds", type=float, default=2.0, help="timing per type, thread count and kernel")
    parser.add_argument("--baseline", type=Path, default=None, help="another host_experts.c to time beside this one")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if any(t < 1 for t in args.threads) or args.pairs < 1 or args.seconds <= 0 or args.objects_mib <= 0:
        parser.error("--threads, --pairs, --seconds and --objects-mib must be positive")
    if args.baseline is not None and not args.baseline.is_file():
        parser.error(f"--baseline {args.baseline}: no such file")
    try:
        rows = [row for name in args.types
                for row in bench_type(name, args.threads, args.pairs, args.objects_mib, args.seconds, args.baseline)]
        from inference.kernels.host_experts import build_library

        kernel = build_library().host_experts_kernel().decode()
    except (BenchError, HostExpertsUnavailable) as exc:
        print(f"host_experts_bench: {exc}", file=sys.stderr)
        return 1
    cpu = host_cpu()
    print(f"CPU: {cpu['model']}, {cpu['logical_cpus']} logical CPUs, {' '.join(cpu['flags']) or 'none of ' + str(CPU_FLAGS)}")
    print(report(rows, kernel))
    if args.json is not None:
        args.json.write_text(json.dumps({"kernel": kernel, "cpu": cpu,
                                         "baseline": str(args.baseline) if args.baseline else None,
                                         "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
