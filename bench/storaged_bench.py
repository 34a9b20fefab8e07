"""storaged against the machine: miss-path read throughput as a share of raw O_DIRECT bandwidth of
the same pack file, and the Acquire round trip on hits.

Figures (all measured by this script, in this run, on one synthetic bundle of MXFP4 objects):
  1. raw O_DIRECT GB/s: threads at queue depth 1, 4 and 16 preadv random whole objects into
     aligned buffers; re-measured at the best depth after the storaged runs (drift check);
     the best of all of them is the machine limit.
  2. miss path GB/s: a real daemon (subprocess) with O_DIRECT, checksums on, host tier off,
     and an arena only big enough for the pins in flight; 1 and 4 client sessions acquire
     top-k distinct experts per call, cycling through one random order of all objects so every
     expert misses, releasing each layer after its acquire. Bytes are the padded sizes of
     the experts acquired, cross-checked with the daemon's read bytes.
  3. hit round trip: a second daemon whose arena holds a whole layer; after warming it, N
     Acquires of top-k resident experts, p50/p99 of time.perf_counter_ns around acquire.
  Context: pinned host-to-device GB/s (64 MiB copies) on CUDA.

    python bench/storaged_bench.py --device cuda --json out.json        # ~1 min on the lent H200
    python bench/storaged_bench.py --device cpu --pack-gib 0.05 --object-mib 0.25 --seconds 1 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import (BenchError, PackGeometry, drop_page_cache, plan_geometry, raw_direct_reads,  # noqa: E402
                          scratch_directory, write_bench_bundle)
from bench.storaged_runs import StoragedProcess, hit_run, miss_run, pinned_h2d_gbps  # noqa: E402

MODEL = "bench"
RAW_QUEUE_DEPTHS = (1, 4, 16)
MIN_MISS_RATIO = 0.9  # below this the miss run measured the cache, not the disk path
_STARTED = time.perf_counter()


def progress(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:6.1f} s] {message}", flush=True)


def checkpoint(args: argparse.Namespace, results: dict) -> None:
    """Write what is known so far: a run killed by a time limit still leaves its figures."""
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--dir", type=Path, help="directory on the disk under test, where O_DIRECT must work "
                        "(default: expertpack-bench in the first of /var/tmp, /root, /opt, /tmp where it does)")
    parser.add_argument("--pack-gib", type=float, default=8.0, help="pack size in GiB")
    parser.add_argument("--object-mib", type=float, default=13.0, help="expert object size in MiB")
    parser.add_argument("--seconds", type=float, default=5.0, help="duration of each throughput run")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--top-k", type=int, default=8, help="experts per acquire")
    parser.add_argument("--sessions", type=int, nargs="+", default=[1, 4], help="concurrent sessions per miss run")
    parser.add_argument("--io-parallelism", type=int, default=16, help="the daemon's reads in flight")
    parser.add_argument("--hit-acquires", type=int, default=2000, help="timed acquires on hits")
    parser.add_argument("--keep", action="store_true", help="keep the bundle afterwards")
    return parser.parse_args(argv)


def start_daemon(args: argparse.Namespace, bundle: Path, slots: int, slot_bytes: int, name: str) -> StoragedProcess:
    device = "cpu" if args.device == "cpu" else (args.device if ":" in args.device else "cuda:0")
    return StoragedProcess(bundle, model=MODEL, device=device, vram_bytes=slots * slot_bytes,
                           io_parallelism=args.io_parallelism,
                           staging_buffers=max(args.io_parallelism, max(args.sessions) * args.top_k),
                           log_path=args.dir / f"storaged-{name}.log")


def context(args: argparse.Namespace) -> dict:
    import torch

    from storaged.io import filesystem_of
    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
            "torch": torch.__version__, "device": args.device, "dir": str(args.dir),
            "filesystem": filesystem_of(args.dir)}
    if args.device != "cpu":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def run(args: argparse.Namespace, results: dict) -> None:
    if args.device != "cpu":
        import torch
        if not torch.cuda.is_available():
            raise BenchError(f"--device {args.device} but torch.cuda is not available")
    if min(args.sessions) < 1 or args.top_k < 1 or args.seconds <= 0 or args.hit_acquires < 1:
        raise BenchError(f"--sessions {args.sessions}, --top-k {args.top_k}, --seconds {args.seconds} and "
                         f"--hit-acquires {args.hit_acquires} must be positive")
    geometry = plan_geometry(args.pack_gib, args.object_mib, top_k=args.top_k)
    need = geometry.objects * geometry.padded_object_bytes + (256 << 20)  # + index, logs, slack
    args.dir = scratch_directory(args.dir, need)
    results["context"] = context(args)
    bundle = args.dir / "bundle"
    try:
        progress(f"writing {geometry.objects} objects of {geometry.padded_object_bytes} bytes to {bundle}")
        seconds = write_bench_bundle(bundle, geometry)
        pack_bytes = (bundle / "experts.pack").stat().st_size
        results["pack"] = {**geometry.as_dict(), "path": str(bundle), "pack_bytes": pack_bytes,
                           "write_seconds": seconds, "write_gbps": pack_bytes / seconds / 1e9,
                           "page_cache_dropped": drop_page_cache()}
        checkpoint(args, results)
        _measure(args, results, geometry, bundle)
    finally:
        if not args.keep:
            shutil.rmtree(bundle, ignore_errors=True)


def _attempt(results: dict, what: str, step):
    """Run one measurement; a failure is recorded (the run then exits non-zero) and the others go on,
    so one bad phase does not cost the figures of the rest."""
    try:
        return step()
    except Exception as exc:  # noqa: BLE001 - recorded, printed, and turned into the exit status
        traceback.print_exc()
        results["errors"].append(f"{what}: {exc}")
        progress(f"FAILED: {what}: {exc}")
        return None


def _miss_path(args: argparse.Namespace, results: dict, geometry: PackGeometry, bundle: Path) -> None:
    daemon = start_daemon(args, bundle, (max(args.sessions) + 1) * args.top_k, geometry.padded_object_bytes, "miss")
    try:
        results["miss_path"] = {"arena_slots": daemon.slot_count, "io_parallelism": args.io_parallelism, "runs": []}
        for sessions in args.sessions:
            progress(f"  {sessions} session(s)")
            run_result = _attempt(results, f"miss path, {sessions} session(s)",
                                  lambda n=sessions: miss_run(daemon, MODEL, geometry, sessions=n, top_k=args.top_k,
                                                             seconds=args.seconds, device=args.device))
            if run_result is not None:
                results["miss_path"]["runs"].append(run_result)
            checkpoint(args, results)
    finally:
        daemon.stop()


def _compare(results: dict, limit: float) -> None:
    """Ratios of the miss runs to the machine limit, and warnings where a run was not all misses."""
    runs = results.get("miss_path", {}).get("runs", [])
    for run_result in runs:
        run_result["ratio_to_raw"] = run_result["gbps"] / limit
        if run_result["miss_ratio"] < MIN_MISS_RATIO or abs(run_result["read_vs_acquired"] - 1) > 0.1:
            results["warnings"].append(f"miss run with {run_result['sessions']} session(s): miss ratio "
                                       f"{run_result['miss_ratio']:.3f}, daemon read / acquired bytes "
                                       f"{run_result['read_vs_acquired']:.3f}: not a pure miss-path figure")
    if runs:
        best = max(runs, key=lambda r: r["gbps"])
        results["miss_path"].update(best_gbps=best["gbps"], best_sessions=best["sessions"],
                                    ratio_to_raw=best["gbps"] / limit)


def _hits(args: argparse.Namespace, results: dict, geometry: PackGeometry, bundle: Path) -> None:
    daemon = start_daemon(args, bundle, geometry.experts + args.top_k, geometry.padded_object_bytes, "hit")
    try:
        results["hit_acquire"] = hit_run(daemon, MODEL, geometry, acquires=args.hit_acquires, top_k=args.top_k,
                                         device=args.device)
    finally:
        daemon.stop()


def _measure(args: argparse.Namespace, results: dict, geometry: PackGeometry, bundle: Path) -> None:
    from packformat import PackReader

    pack = bundle / "experts.pack"
    with PackReader(pack) as reader:
        entries = list(reader)
        reader.read_object(entries[-1].layer, entries[-1].expert)  # its crc32 must match
    raw = []  # raw reads are the reference: their failure (O_DIRECT refused...) ends the run
    for depth in RAW_QUEUE_DEPTHS:
        progress(f"raw O_DIRECT reads at queue depth {depth}")
        raw.append(raw_direct_reads(pack, entries, depth, args.seconds))
    results["raw_odirect"] = {"runs": [vars(r) | {"gbps": r.gbps} for r in raw]}
    if not all(r.o_direct_reported for r in raw):
        results["warnings"].append(f"{pack}: opened with O_DIRECT, but /proc/self/fdinfo does not show the flag")
    checkpoint(args, results)
    progress("storaged miss path")
    _attempt(results, "miss path daemon", lambda: _miss_path(args, results, geometry, bundle))
    best_depth = max(raw, key=lambda r: r.gbps).queue_depth
    progress(f"raw O_DIRECT reads at queue depth {best_depth} again (drift check)")
    again = raw_direct_reads(pack, entries, best_depth, args.seconds, seed=1)
    limit = max(r.gbps for r in [*raw, again])
    results["raw_odirect"].update(after_storaged=vars(again) | {"gbps": again.gbps}, best_gbps=limit,
                                  best_queue_depth=best_depth)
    _compare(results, limit)
    checkpoint(args, results)
    progress(f"acquire round trip on hits ({args.hit_acquires} acquires)")
    _attempt(results, "hit round trip", lambda: _hits(args, results, geometry, bundle))
    if args.device != "cpu":
        results["pinned_h2d_gbps"] = _attempt(results, "pinned H2D", pinned_h2d_gbps)


def figures(results: dict) -> dict:
    """The headline numbers; None where that measurement failed or does not apply."""
    raw, miss, hit = (results.get(k) or {} for k in ("raw_odirect", "miss_path", "hit_acquire"))
    return {"raw_odirect_best_gbps": raw.get("best_gbps"), "miss_path_gbps": miss.get("best_gbps"),
            "miss_path_ratio_to_raw": miss.get("ratio_to_raw"), "hit_acquire_p50_us": hit.get("p50_us"),
            "hit_acquire_p99_us": hit.get("p99_us"), "pinned_h2d_gbps": results.get("pinned_h2d_gbps")}


def table(results: dict) -> str:
    raw, miss, hit = (results.get(k) or {} for k in ("raw_odirect", "miss_path", "hit_acquire"))
    pack = results.get("pack") or {}
    rows = []
    if pack:
        rows.append(("pack", f"{pack['pack_bytes'] / 2**30:.2f} GiB", f"{pack['objects']} objects of "
                     f"{pack['padded_object_bytes']} B, written at {pack['write_gbps']:.2f} GB/s"))
    rows += [(f"raw O_DIRECT QD{r['queue_depth']}", f"{r['gbps']:.3f} GB/s", f"{r['reads']} reads")
             for r in raw.get("runs", [])]
    if "after_storaged" in raw:
        after = raw["after_storaged"]
        rows.append((f"raw O_DIRECT QD{after['queue_depth']} after storaged", f"{after['gbps']:.3f} GB/s",
                     "drift check"))
        rows.append(("machine limit (best raw)", f"{raw['best_gbps']:.3f} GB/s", ""))
    for r in miss.get("runs", []):
        ratio = f"{r['ratio_to_raw']:.1%} of raw; " if "ratio_to_raw" in r else ""
        rows.append((f"storaged miss path, {r['sessions']} session(s)", f"{r['gbps']:.3f} GB/s",
                     f"{ratio}miss ratio {r['miss_ratio']:.3f}; daemon read {r['daemon_read_gbps']:.3f} GB/s"))
    if hit:
        rows.append(("acquire on hits p50 / p99", f"{hit['p50_us']:.0f} / {hit['p99_us']:.0f} us",
                     f"{hit['acquires']} acquires of {hit['top_k']}"))
    if results.get("pinned_h2d_gbps") is not None:
        rows.append(("pinned H2D (64 MiB copies)", f"{results['pinned_h2d_gbps']:.1f} GB/s", "context"))
    width = max((len(r[0]) for r in rows), default=0)
    return "\n".join(f"{a:<{width}}  {b:>18}  {c}" for a, b, c in rows)


def _exit_on_sigterm(signum, frame) -> None:
    # A time limit (timeout(1)) sends SIGTERM: unwind through the finally blocks so the daemon
    # subprocess is stopped and the bundle removed, rather than dying with them left behind.
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    results: dict = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                     "warnings": [], "errors": []}
    try:
        run(args, results)
    except BenchError as exc:
        results["errors"].append(str(exc))
    except Exception as exc:  # noqa: BLE001 - recorded in the JSON, then a non-zero exit
        traceback.print_exc()
        results["errors"].append(repr(exc))
    results["figures"] = figures(results)
    checkpoint(args, results)
    print(json.dumps({"context": results.get("context"), "figures": results["figures"]}, indent=1))
    print(table(results))
    for warning in results["warnings"]:
        print(f"WARNING: {warning}")
    for error in results["errors"]:
        print(f"storaged_bench: error: {error}", file=sys.stderr)
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
