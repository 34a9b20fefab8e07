"""The disk as the miss path sees it: O_DIRECT GB/s of random expert objects, by access pattern.

storaged_bench.py's raw figure is free-running threads reading whole objects. A decode step does
not read that way: a layer's routing names a few objects at once (the misses), the layer waits
for the slowest of them, and the next layer's batch starts only then. This probe measures, on one
pack file, O_DIRECT reads of random objects
  stream   `depth` threads each reading whole random objects back to back (storaged_bench's figure),
  batch    `objects` distinct random objects at once, each cut into chunks of `chunk` bytes read
           in parallel (up to 64 threads), the next batch started when the last chunk lands:
           GB/s over the batches, and each batch's latency (p50, p99),
so the disk bound of a run can be stated for the pattern the run makes, and the chunk size and
read parallelism that reach the disk's limit are known.

    python bench/disk_probe.py --object-mib 2.53 --pack-gib 6 --json out.json     # Qwen3-like Q4_K experts
    python bench/disk_probe.py --pack /path/to/experts.pack --json out.json         # an existing pack
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import (BenchError, drop_page_cache, percentile, plan_geometry,  # noqa: E402
                          raw_direct_reads, scratch_directory, write_bench_bundle)

ALIGN = 4096
MAX_THREADS = 64


def _parse_sizes(values: list[str]) -> list[int]:
    """Chunk sizes in KiB, or 0 for whole objects."""
    sizes = []
    for value in values:
        kib = int(value)
        if kib < 0 or (kib * 1024) % ALIGN:
            raise BenchError(f"--chunks-kib {value}: a chunk must be 0 (whole object) or a multiple of 4 KiB")
        sizes.append(kib * 1024)
    return sizes


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pack", type=Path, help="an existing pack file to read (else one is written)")
    parser.add_argument("--dir", type=Path, help="where to write the pack (default: a scratch dir where O_DIRECT works)")
    parser.add_argument("--pack-gib", type=float, default=6.0, help="size of the written pack")
    parser.add_argument("--object-mib", type=float, default=2.53,
                        help="object size of the written pack (2.53: a Qwen3-30B-A3B Q4_K expert)")
    parser.add_argument("--seconds", type=float, default=1.5, help="duration of each measurement")
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 4, 16, 32], help="stream: threads")
    parser.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16], help="batch: objects at once")
    parser.add_argument("--chunks-kib", nargs="+", default=["0", "1024", "512", "256"],
                        help="batch: chunk sizes in KiB (0 = one read per object)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    args.chunks = _parse_sizes(args.chunks_kib)
    if args.seconds <= 0 or min(args.depths) < 1 or min(args.batches) < 1:
        raise BenchError("--seconds, --depths and --batches must be positive")
    return args


def batch_reads(pack_path: Path, entries: list, objects: int, chunk: int, seconds: float, *, seed: int = 0) -> dict:
    """Batches of `objects` distinct random objects, each read as chunks of `chunk` bytes (0: whole)."""
    from storaged.io import DirectPackFile, HostMemory

    if objects > len(entries):
        raise BenchError(f"a batch of {objects} objects but the pack holds {len(entries)}")
    padded = max(e.padded_size for e in entries)
    pack = DirectPackFile(pack_path, direct_io=True, verify=False)
    memory = HostMemory(objects, padded, what="probe buffers")
    rng = random.Random(seed)
    pieces_per_object = 1 if chunk == 0 else -(-padded // chunk)
    threads = min(MAX_THREADS, objects * pieces_per_object)
    fd = pack.fileno()
    latencies, total_bytes, batches = [], 0, 0

    def read(buffer, offset: int, start: int, stop: int) -> None:
        view = buffer.view
        while start < stop:  # O_DIRECT short reads stay aligned on a regular file
            count = os.preadv(fd, [view[start:stop]], offset + start)
            if count <= 0:
                raise BenchError(f"{pack_path}: read at {offset + start} returned {count}")
            start += count

    try:
        with concurrent.futures.ThreadPoolExecutor(threads) as pool:
            began = time.perf_counter()
            while time.perf_counter() - began < seconds:
                chosen = rng.sample(entries, objects)
                t0 = time.perf_counter()
                futures = []
                for buffer, entry in zip(memory.buffers, chosen):
                    step = entry.padded_size if chunk == 0 else chunk
                    for start in range(0, entry.padded_size, step):
                        futures.append(pool.submit(read, buffer, entry.offset, start,
                                                   min(start + step, entry.padded_size)))
                for future in futures:
                    future.result()
                latencies.append(time.perf_counter() - t0)
                total_bytes += sum(e.padded_size for e in chosen)
                batches += 1
            elapsed = time.perf_counter() - began
    finally:
        memory.close()
        pack.close()
    latencies.sort()
    return {"objects": objects, "chunk_bytes": chunk, "threads": threads, "batches": batches,
            "bytes": total_bytes, "seconds": elapsed, "gbps": total_bytes / elapsed / 1e9,
            "batch_p50_ms": percentile(latencies, 50) * 1e3, "batch_p99_ms": percentile(latencies, 99) * 1e3}


def run(args: argparse.Namespace) -> dict:
    from packformat import PackReader

    results: dict = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}}
    written = None
    if args.pack is None:
        geometry = plan_geometry(args.pack_gib, args.object_mib, top_k=max(args.batches))
        directory = scratch_directory(args.dir, geometry.objects * geometry.padded_object_bytes + (256 << 20))
        written = directory / "probe-bundle"
        seconds = write_bench_bundle(written, geometry)
        args.pack = written / "experts.pack"
        results["written"] = {**geometry.as_dict(), "write_seconds": seconds}
    try:
        results["page_cache_dropped"] = drop_page_cache()
        with PackReader(args.pack) as reader:
            entries = list(reader)
        results["pack"] = {"path": str(args.pack), "objects": len(entries),
                           "object_bytes": max(e.padded_size for e in entries),
                           "pack_bytes": args.pack.stat().st_size}
        results["stream"] = []
        for depth in args.depths:
            raw = raw_direct_reads(args.pack, entries, depth, args.seconds, seed=depth)
            results["stream"].append({"depth": depth, "reads": raw.reads, "gbps": raw.gbps})
            print(f"stream depth {depth:3d}: {raw.gbps:6.3f} GB/s ({raw.reads} reads)", flush=True)
        results["batch"] = []
        for objects in args.batches:
            for chunk in args.chunks:
                row = batch_reads(args.pack, entries, objects, chunk, args.seconds, seed=objects * 7 + chunk)
                results["batch"].append(row)
                size = f"{chunk >> 10} KiB" if chunk else "whole"
                print(f"batch {objects:3d} objects, chunk {size:>8}, {row['threads']:2d} threads: "
                      f"{row['gbps']:6.3f} GB/s, batch p50 {row['batch_p50_ms']:.1f} ms, "
                      f"p99 {row['batch_p99_ms']:.1f} ms", flush=True)
        best = max([r["gbps"] for r in results["stream"]] + [r["gbps"] for r in results["batch"]])
        results["best_gbps"] = best
    finally:
        if written is not None:
            shutil.rmtree(written, ignore_errors=True)
    return results


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        results = run(args)
    except BenchError as exc:
        print(f"disk_probe: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    print(f"best: {results['best_gbps']:.3f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
