"""The end-to-end matrix: for each shape, prepare a model sized to the disk and time left, then run
every contender at every VRAM budget inside a total time budget, writing results.json/results.md
after each contender (a run cut short by its time limit still leaves what it measured).

    python -m bench.e2e.main --device cuda --out OUT --seconds 420 --machine-json storaged_bench.json
    python -m bench.e2e.main --device cpu --tiny --out OUT --seconds 60 --tokens 3 --prompt-len 8
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.e2e.contenders import CONTENDERS  # noqa: E402
from bench.e2e.llamacpp_command import BIN_ENV, binary_summary, llama_bench_path, wait_for_build  # noqa: E402
from bench.e2e.measure import cgroup_v2_problem  # noqa: E402
from bench.e2e.prepare import prepare_model, remove_model  # noqa: E402
from bench.e2e.report import write_results  # noqa: E402
from bench.e2e.measure import RAM_SLACK_BYTES  # noqa: E402
from bench.e2e.runner import KILL_GRACE_SECONDS, run_contender_budgets  # noqa: E402
from bench.e2e.shapes import FULL_SHAPES, TINY_SHAPES, ShapeError, plan_layers  # noqa: E402

SAMPLE_SEED = 1234
PREPARE_SHARE = 0.35  # of the whole budget, split between the shapes
# time shares: accelerate's disk offload is the slowest per token, resident the fastest
# (storaged gets a full share: with balanced routing its low budgets are disk-bound too)
CONTENDER_WEIGHT = {"resident": 0.5, "accelerate": 1.5, "gguf_mmap": 1.0, "storaged": 1.0, "storaged_preload": 1.0,
                    "storaged_preload_cpu": 1.0, "storaged_no_lookahead": 1.0, "storaged_copy_up": 1.0, "storaged_io4": 1.0, "storaged_serial": 1.0,
                    "llamacpp": 1.0}
# run order: a contender's share is of the time left, so the slowest goes last and gets what the
# faster ones did not use
RUN_ORDER = ("resident", "storaged", "storaged_preload", "storaged_preload_cpu", "storaged_no_lookahead",
             "storaged_copy_up", "storaged_io4", "storaged_serial", "llamacpp", "gguf_mmap", "accelerate")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda or cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 (cuda default) or float32 (cpu default)")
    parser.add_argument("--out", type=Path, required=True, help="results.json and results.md go here")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/expertpack-e2e"),
                        help="models, logs and offload folders (on the disk under test)")
    parser.add_argument("--seconds", type=float, default=420.0, help="total time budget, preparation included")
    parser.add_argument("--shapes", nargs="+", default=list(FULL_SHAPES), choices=list(FULL_SHAPES))
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke-test sizes of the shapes")
    parser.add_argument("--layers", type=int, default=None,
                        help="fixed layer count (default: planned from disk and time; --tiny: 2 MoE layers)")
    parser.add_argument("--max-layers", type=int, default=48)
    parser.add_argument("--prepare-gbps", type=float, default=0.5,
                        help="GB/s the preparation (synth, build, dequantize) is assumed to write, for planning")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1.0])
    parser.add_argument("--contenders", nargs="+", default=list(CONTENDERS), choices=list(CONTENDERS))
    parser.add_argument("--tokens", type=int, default=32, help="decode tokens per run (fewer when too slow)")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--routing", choices=("balanced", "random"), default="balanced",
                        help="balanced: synthesize routers that spread tokens over the experts as a trained model's "
                             "do (packtools.synth.gguf_models.balance_routing); random: plain random weights, whose "
                             "routing collapses onto a few experts")
    parser.add_argument("--decode", choices=("greedy", "sample"), default="greedy",
                        help="sample: temperature 1 with a fixed seed, so routing varies token to token as with "
                             "real text (greedy decoding of random weights repeats one token and its experts)")
    parser.add_argument("--ram-overhead-gib", type=float, default=None,
                        help="host RAM allowed beyond the budget for the process itself (default 8 cuda, 3 cpu)")
    parser.add_argument("--torch-threads", type=int, default=None,
                        help="torch's threads on the CPU device, and llama-bench's -t (default: the cores available)")
    parser.add_argument("--machine-json", type=Path, default=None,
                        help="bench/storaged_bench.py's JSON: machine limits and storaged-alone figures")
    parser.add_argument("--keep", action="store_true", help="keep the prepared models")
    parser.add_argument("--layer-floor", action="store_true",
                        help="raise storaged's arena to one layer's experts where the budget is below that (default: "
                             "the budget as given; a layer touching more experts than the arena is computed in groups)")
    parser.add_argument("--llamacpp-bin", type=Path, default=None,
                        help=f"llama-bench for the llamacpp contender (default ${BIN_ENV}, else "
                             ".llamacpp/bin/llama-bench, where bench/llamacpp/build.sh puts it)")
    return parser.parse_args(argv)


def machine_figures(path: Path | None) -> dict:
    if path is None or not path.exists():
        return {}
    figures = json.loads(path.read_text()).get("figures") or {}
    return {"raw_odirect_gbps": figures.get("raw_odirect_best_gbps"), **figures}


def _plan(args, shape, prepare_seconds: float, want_bf16: bool) -> tuple[int, bool, str]:
    """(layers, with bf16 checkpoint, why)."""
    if args.layers is not None or args.tiny:
        layers = args.layers or 2 + shape.dense_layers  # tiny: two MoE layers
        return layers, want_bf16, f"{layers} layers, fixed"

    free = shutil.disk_usage(args.workdir).free
    common = dict(free_bytes=free, seconds=prepare_seconds, write_bytes_per_s=args.prepare_gbps * 1e9,
                  max_layers=args.max_layers, min_layers=2 + shape.dense_layers)
    if want_bf16:
        try:
            plan = plan_layers(shape, with_bf16_checkpoint=True, **common)
            return plan.layers, True, f"{plan.layers} layers, limited by {plan.reason} (bf16 checkpoint included)"
        except ShapeError as exc:
            reason = f"no bf16 checkpoint for accelerate: {exc}"
    else:
        reason = "no bf16 checkpoint (accelerate not among the contenders)"
    plan = plan_layers(shape, with_bf16_checkpoint=False, **common)
    return plan.layers, False, f"{plan.layers} layers, limited by {plan.reason}; {reason}"


def run(args: argparse.Namespace, results: dict) -> None:
    started = time.perf_counter()
    shapes = [(TINY_SHAPES if args.tiny else FULL_SHAPES)[key] for key in args.shapes]
    dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    overhead = int((args.ram_overhead_gib or (3 if args.device == "cpu" else 8)) * 2**30)
    cgroup_problem = cgroup_v2_problem()
    results["statements"] += [
        f"dtype {dtype}; {args.routing} routing; prompt {args.prompt_len} random tokens; {args.decode} decoding"
        + (f" (temperature 1, seed {SAMPLE_SEED})" if args.decode == "sample" else "") +
        f"; up to {args.tokens} decode tokens per run, fewer where a "
        f"contender is too slow for its share of the {args.seconds:.0f} s budget (stated per run)",
        "host RAM: " + (f"NOT limited ({cgroup_problem})" if cgroup_problem else
                        "every contender runs in a cgroup v2 (page cache included, swap off): memory.max = "
                        f"{overhead / 2**30:.1f} GiB + the budget while it loads and warms up, then, for the timed "
                        "run, what it holds itself (memory.current without page cache) + its VRAM budget's bytes "
                        f"(less its own host cache: storaged's host tier) + {RAM_SLACK_BYTES // 2**20} MiB slack, so "
                        "no contender keeps more than the budget of experts in host RAM"),
        "every budget is a cold start: page cache dropped, fresh daemon / model; one untimed 2-token forward warms "
        "the decode's kernels first; the prefill's grouped GEMM is compiled (triton) by the first prefill that "
        "needs it unless triton's cache already holds it, so the first such contender's prefill may include that",
        "experts from memory: 1 - objects storaged read from the pack while decoding ÷ routed experts (tokens × "
        "MoE layers × top-k), whichever tier served the rest (VRAM, or host RAM read in place or copied up)",
    ]
    if "llamacpp" in args.contenders:
        binary = llama_bench_path()
        results["statements"].append(f"llamacpp: {binary} ({binary_summary(binary)})")
    contenders = sorted(args.contenders, key=RUN_ORDER.index)
    for n, shape in enumerate(shapes):
        if _terminated:
            results["errors"].append(f"{shape.name}: not run, the time budget is spent")
            continue
        left = args.seconds - (time.perf_counter() - started)
        shape_seconds = left / (len(shapes) - n)
        shape_deadline = time.perf_counter() + shape_seconds
        layers, with_bf16, why = _plan(args, shape, PREPARE_SHARE * shape_seconds, "accelerate" in args.contenders)
        results["statements"].append(f"{shape.name}: {why}")
        model = prepare_model(shape, layers, args.workdir, with_bf16_checkpoint=with_bf16, device=args.device,
                              balanced_routing=args.routing == "balanced")
        results["e2e"]["models"].append(model.as_dict())
        write_results(results, args.out)
        try:
            for n_done, contender in enumerate(contenders):
                if contender == "llamacpp" and not _terminated:  # run_all.sh may still be building it
                    build_problem = wait_for_build(shape_deadline - KILL_GRACE_SECONDS - 10)
                    if build_problem:
                        results["warnings"].append(f"{shape.name} llamacpp: {build_problem}")
                left_for_shape = shape_deadline - time.perf_counter()
                if left_for_shape < 10 or _terminated:
                    results["errors"].append(f"{shape.name} {contender}: not run, the time budget is spent")
                    continue
                weights_left = sum(CONTENDER_WEIGHT[c] for c in contenders[n_done:])
                # the child may overrun its seconds by KILL_GRACE_SECONDS (shutdown, result file): the last
                # one must still end inside the shape's time, or run_all.sh's timeout loses its figures
                seconds = max(5.0, min(left_for_shape - KILL_GRACE_SECONDS - 5,
                                       left_for_shape * CONTENDER_WEIGHT[contender] / weights_left))
                # largest budget first: the fast runs finish even where a slow one runs out of time
                budgets = [1.0] if contender == "resident" else sorted(args.budgets, reverse=True)
                runs = run_contender_budgets(contender, model, budgets, tokens=args.tokens,
                                             prompt_len=args.prompt_len, seconds=seconds, device=args.device,
                                             dtype=dtype, workdir=args.workdir / "runs", ram_overhead_bytes=overhead,
                                             torch_threads=args.torch_threads, layer_floor=args.layer_floor,
                                             sample_seed=SAMPLE_SEED if args.decode == "sample" else None)
                results["e2e"]["runs"] += runs
                disturbed = [f"{run['budget_fraction']:.0%}" for run in runs if run.get("timed_during_build")]
                if disturbed:
                    results["warnings"].append(
                        f"{shape.name} {contender} at {', '.join(disturbed)}: timed while llama.cpp compiled in the "
                        "background (CPU contention); carry its binaries (RUN_ALL_LLAMACPP_OUT, then .llamacpp/pack) "
                        "to time every contender without it")
                results["errors"] += [f"{r['shape']} {r['contender']} {r['budget_fraction']:.0%}: {r['error']}"
                                      for r in runs if "error" in r]
                write_results(results, args.out)
        finally:
            if not args.keep:
                remove_model(model)


class TimeBudgetExceeded(Exception):
    """SIGTERM, from run_all.sh's timeout: what was measured so far is still written."""


_terminated: list[int] = []  # the signal, once received: no contender starts after it


def _raise_time_budget_exceeded(signum, frame) -> None:
    _terminated.append(signum)
    raise TimeBudgetExceeded(f"signal {signum}: the e2e matrix ran past its time limit")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.llamacpp_bin is not None:
        if "llamacpp" not in args.contenders:
            raise SystemExit("--llamacpp-bin given but the llamacpp contender is not among --contenders")
        os.environ[BIN_ENV] = str(llama_bench_path(args.llamacpp_bin))  # the runner's children inherit it
    signal.signal(signal.SIGTERM, _raise_time_budget_exceeded)
    args.workdir.mkdir(parents=True, exist_ok=True)
    results = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
               "machine": machine_figures(args.machine_json), "statements": [], "warnings": [], "errors": [],
               "e2e": {"models": [], "runs": []}}
    try:
        run(args, results)
    except Exception as exc:  # noqa: BLE001 - recorded, then a non-zero exit
        import traceback
        traceback.print_exc()
        results["errors"].append(f"{type(exc).__name__}: {exc}")
    json_path, md_path = write_results(results, args.out)
    print(md_path.read_text())
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
