"""What verify_hits costs on Acquire hits: hit round trip with verify_hits = 0 and with 1.0.

Two real daemons (subprocesses) serve the same synthetic bundle, objects about the size of a
Qwen3-30B-A3B Q4_K expert (2.6 MB by default), each with an arena that holds the whole layer.
After warming both, blocks of Acquires of top-k resident experts alternate between the two
daemons, so drift of the machine touches both alike; each acquire is timed by the client
(time.perf_counter_ns around Session.acquire, on the data plane). Every timed acquire must be
all hits, and the verifying daemon must have verified every one of them.

    python bench/verify_hits_bench.py --device cpu --json out.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import BenchError, percentile, plan_geometry, scratch_directory, write_bench_bundle  # noqa: E402
from bench.storaged_runs import StoragedProcess, synchronize  # noqa: E402

MODEL = "bench"
WARMUP_ACQUIRES = 50  # per daemon, untimed


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default), cuda or cuda:N")
    parser.add_argument("--dir", type=Path, help="directory for the bundle, on a disk where O_DIRECT works")
    parser.add_argument("--object-mib", type=float, default=2.53, help="expert object size in MiB (default 2.53: "
                        "three Q4_K [768, 2048] matrices)")
    parser.add_argument("--experts", type=int, default=64, help="experts in the layer (all resident)")
    parser.add_argument("--top-k", type=int, default=8, help="experts per acquire")
    parser.add_argument("--acquires", type=int, default=1000, help="timed acquires per daemon")
    parser.add_argument("--block", type=int, default=50, help="acquires in a row on one daemon")
    parser.add_argument("--json", type=Path, help="write the results here")
    return parser.parse_args(argv)


def _timed(daemon: StoragedProcess, session, rng: random.Random, experts: list[int], top_k: int,
           count: int, device: str) -> list[float]:
    samples = []
    for _ in range(count):
        chosen = rng.sample(experts, top_k)
        started = time.perf_counter_ns()
        session.acquire(0, chosen)
        samples.append((time.perf_counter_ns() - started) / 1000)  # µs
    synchronize(device)
    return samples


def _summary(samples: list[float]) -> dict:
    ordered = sorted(samples)
    return {"acquires": len(ordered), "p50_us": percentile(ordered, 50), "p99_us": percentile(ordered, 99),
            "mean_us": sum(ordered) / len(ordered)}


def run(args: argparse.Namespace) -> dict:
    if args.top_k < 1 or args.top_k > args.experts or args.acquires < 1 or args.block < 1:
        raise BenchError(f"--top-k {args.top_k} (at most --experts {args.experts}), --acquires {args.acquires} "
                         f"and --block {args.block} must be positive")
    probe = plan_geometry(1.0, args.object_mib, top_k=args.top_k)
    geometry = type(probe)(1, args.experts, probe.intermediate)  # one layer of --experts objects
    directory = scratch_directory(args.dir, geometry.objects * geometry.padded_object_bytes + (64 << 20))
    bundle = directory / "verify-hits-bundle"
    device = "cpu" if args.device == "cpu" else (args.device if ":" in args.device else "cuda:0")
    daemons: dict[str, StoragedProcess] = {}
    try:
        write_bench_bundle(bundle, geometry)
        for name, rate in (("off", "0"), ("every hit", "1.0")):
            daemons[name] = StoragedProcess(
                bundle, model=MODEL, device=device, vram_bytes=args.experts * geometry.padded_object_bytes,
                io_parallelism=4, staging_buffers=max(4, args.top_k), log_path=directory / f"storaged-{rate}.log",
                extra_args=("--verify-hits", rate))
        experts = list(range(args.experts))
        sessions = {name: daemon.client.attach(MODEL) for name, daemon in daemons.items()}
        rng = random.Random(1)
        for name, session in sessions.items():  # the whole layer resident, then untimed warm-up
            for first in range(0, args.experts, args.top_k):
                session.acquire(0, experts[first:first + args.top_k])
            _timed(daemons[name], session, rng, experts, args.top_k, WARMUP_ACQUIRES, device)
        before = {name: daemon.client.stats() for name, daemon in daemons.items()}
        samples: dict[str, list[float]] = {name: [] for name in daemons}
        while min(map(len, samples.values())) < args.acquires:
            for name, session in sessions.items():
                count = min(args.block, args.acquires - len(samples[name]))
                samples[name] += _timed(daemons[name], session, rng, experts, args.top_k, count, device)
        results = {"device": device, "object_bytes": geometry.object_bytes, "top_k": args.top_k,
                   "experts": args.experts}
        for name, daemon in daemons.items():
            after = daemon.client.stats()
            hits = after.tiers["vram"].hits - before[name].tiers["vram"].hits
            verified = after.hits_verified - before[name].hits_verified
            if after.tiers["vram"].misses != before[name].tiers["vram"].misses:
                raise BenchError(f"daemon '{name}' missed during the timed run: the arena did not hold the layer")
            expected = hits if name == "every hit" else 0
            if verified != expected or after.hit_mismatches:
                raise BenchError(f"daemon '{name}': {verified} of {hits} hits verified, {after.hit_mismatches} "
                                 f"mismatches; expected {expected} and 0")
            results[name] = {**_summary(samples[name]), "hits": hits, "hits_verified": verified}
        for session in sessions.values():
            session.close()
        results["p50_ratio"] = results["every hit"]["p50_us"] / results["off"]["p50_us"]
        results["verify_us_per_hit_p50"] = (results["every hit"]["p50_us"] - results["off"]["p50_us"]) / args.top_k
        return results
    finally:
        for daemon in daemons.values():
            daemon.stop(check=False)
        shutil.rmtree(bundle, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = run(args)
    except BenchError as exc:
        print(f"verify_hits_bench: error: {exc}", file=sys.stderr)
        return 1
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=1))
    off, every = results["off"], results["every hit"]
    print(f"top-{results['top_k']} hit Acquire, objects of {results['object_bytes']} bytes on {results['device']}: "
          f"p50 {off['p50_us']:.0f} us with verify_hits = 0, {every['p50_us']:.0f} us with 1.0: "
          f"ratio {results['p50_ratio']:.2f}x ({results['verify_us_per_hit_p50']:.0f} us per verified hit)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
