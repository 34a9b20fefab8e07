"""storaged's Acquire without a client: the daemon's own cost per Acquire, in-process.

Builds a daemon's runtime (planner, arena, host tier, read executor, engine; no servers) on a
synthetic bundle and drives `StorageEngine.acquire` from one event loop the way a decoding
client does: for each token, one Acquire per MoE layer of `top_k` random distinct experts, each
dropping the session's pins on the other layers. With the VRAM tier at `--vram-share` of the
experts and the host tier at `--host-share`, the tiers fill during a warm-up, after which the
misses are host-tier promotions and demotions (no disk reads with --host-share 1). Prints the mean
µs per Acquire (best of `--repeats` timed rounds) and the daemon's own phase split
(acquire_phase_seconds_total); `--profile N` adds cProfile's top N functions.

What it isolates: the event loop's Python and the arena's copy issue, without the data plane,
the client or the GPU's scheduling. On CPU the copies are memcpys done inside copy_in.

    python bench/engine_bench.py                       # CPU arena, Qwen3-like 12 x 128 top-8, 50% + 100%
    python bench/engine_bench.py --device cuda:0 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import pstats
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import BenchError, PackGeometry, write_bench_bundle  # noqa: E402

PHASES = ("plan", "unmap", "issue", "join")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (the arena's device)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=32,
                        help="expert intermediate size (a multiple of 32); 32 makes 204 KiB objects")
    parser.add_argument("--vram-share", type=float, default=0.5, help="VRAM tier, share of the experts")
    parser.add_argument("--host-share", type=float, default=1.0, help="host tier, share of the experts (0: off)")
    parser.add_argument("--tokens", type=int, default=30, help="tokens per timed round")
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (the best is reported)")
    parser.add_argument("--profile", type=int, default=0, help="print cProfile's top N functions of one round")
    parser.add_argument("--dir", type=Path, help="where to write the bundle (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if min(args.layers, args.experts, args.top_k, args.tokens, args.repeats) < 1 or args.top_k > args.experts:
        raise BenchError("--layers, --experts, --tokens and --repeats must be positive, 1 <= --top-k <= --experts")
    if args.intermediate < 32 or args.intermediate % 32:
        raise BenchError(f"--intermediate {args.intermediate}: must be a positive multiple of 32")
    if not 0 < args.vram_share <= 1 or not 0 <= args.host_share <= 1:
        raise BenchError(f"--vram-share {args.vram_share} must be in (0, 1], --host-share {args.host_share} in [0, 1]")
    return args


def run(args: argparse.Namespace) -> dict:
    from storaged.config import StoragedConfig
    from storaged.server.models import open_models
    from storaged.server.runtime import build_runtime
    from storaged.server.sessions import SessionRegistry

    geometry = PackGeometry(args.layers, args.experts, args.intermediate)
    directory = Path(tempfile.mkdtemp(prefix="engine-bench-", dir=args.dir))
    try:
        bundle = directory / "bundle"
        write_bench_bundle(bundle, geometry)
        models = open_models({"bench": bundle})
        objects, slot = geometry.objects, geometry.padded_object_bytes
        config = StoragedConfig(models={"bench": bundle}, socket=directory / "unused.sock", metrics_address="off",
                                device=args.device, vram_cache_bytes=max(args.top_k, int(objects * args.vram_share)) * slot,
                                host_cache_bytes=int(objects * args.host_share) * slot)
        runtime = build_runtime(config, models)
        try:
            return asyncio.run(_measure(args, runtime, SessionRegistry().open(models["bench"])))
        finally:
            runtime.close()
            for model in models.values():
                model.close()
    finally:
        shutil.rmtree(directory, ignore_errors=True)


async def _measure(args: argparse.Namespace, runtime, session) -> dict:
    rng = random.Random(0)
    engine, metrics = runtime.engine, runtime.metrics

    async def tokens(count: int) -> None:
        for _ in range(count):
            for layer in range(args.layers):
                await engine.acquire(session, layer, tuple(rng.sample(range(args.experts), args.top_k)),
                                     release_other_layers=True)
            await asyncio.sleep(0)  # the client computes between steps: copies complete, slots publish

    await tokens(max(args.tokens, 2 * args.experts // args.top_k))  # fill both tiers
    await engine.drain(60)
    before = _phase_totals(metrics)
    best = float("inf")
    for _ in range(args.repeats):
        started = time.perf_counter()
        await tokens(args.tokens)
        best = min(best, time.perf_counter() - started)
    acquires = args.repeats * args.tokens * args.layers
    after = _phase_totals(metrics)
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "acquire_us_best_round_mean": best / (args.tokens * args.layers) * 1e6,
               "phase_us_mean": {p: (after[p] - before[p]) / acquires * 1e6 for p in PHASES},
               "host_tier": runtime.host_tier is not None, "vram_slots": runtime.geometry.slot_count}
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
        await tokens(args.tokens)
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(args.profile)
        results["profile"] = text.getvalue()
    await engine.drain(60)
    return results


def _phase_totals(metrics) -> dict[str, float]:
    by_phase = metrics.snapshot()["acquire_phase_seconds_total"]  # {phase: seconds}
    return {phase: by_phase.get(phase, 0.0) for phase in PHASES}


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
        results = run(args)
    except BenchError as exc:
        print(f"engine_bench: {exc}", file=sys.stderr)
        return 2
    phases = ", ".join(f"{p} {v:.0f}" for p, v in results["phase_us_mean"].items())
    print(f"{results['acquire_us_best_round_mean']:.0f} µs an Acquire (best round of {args.repeats}); "
          f"phases (mean µs): {phases}")
    if "profile" in results:
        print(results["profile"])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
