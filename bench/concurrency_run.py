"""bench/concurrency.py's figures in one unattended command: for each model shape, synthesize the
model (bench.e2e.prepare), start storaged with an arena of `--budget` of its experts
(bench.e2e.contenders.start_storaged; O_DIRECT, no host tier unless `--host-tier`, so what the
arena misses is read from the SSD), start `inference serve --storaged` in front of it, measure
aggregate tokens/s and SSD bytes per generated token at each `--streams` level
(bench.concurrency.measure: storaged's Stats RPC and the daemon's /proc/<pid>/io), stop both and
delete the model before the next shape.

The JSON (`--json`; a markdown table beside it, OUT.md) is rewritten after every level, with per
shape the levels, and the ratios against one stream that docs/benchmarks.md quotes: aggregate
tokens/s at N streams ÷ at 1 stream, and bytes per token at N streams ÷ at 1 stream.
`--time-budget` covers the whole run, preparation included, split evenly between the shapes not
yet run: a shape whose preparation (at `--prepare-gbps`) and start no longer fit is not started,
past its share no level starts, and a level still running is ended by stopping the server; the
figures measured so far are written, and the exit status is 1 if any shape or level did not run.

On the H200 test machine, from the repository root, with the wheels its image lacks carried in
.whl/ (gguf, grpcio-health-checking, grpcio-reflection; as bench/run_all.sh installs them) —
Qwen3-like 12 layers, then DeepSeek-V4-Flash-like 4 layers; 8 and 20 GB on disk at most, one at a
time; about 5 to 6 minutes, at most about --time-budget + 15 s:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 && \\
        python3 bench/concurrency_run.py --device cuda --json $OUT/concurrency.json --time-budget 400

On a CPU, at the smoke test's sizes (tests/bench/test_concurrency_run.py):

    python bench/concurrency_run.py --device cpu --tiny --shapes qwen3 --streams 1,2 --max-tokens 4 \\
        --torch-threads 1 --json /tmp/concurrency.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import signal
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import BenchError  # noqa: E402
from bench.concurrency import (DEFAULT_STREAMS, Server, StoragedCounters, check_level_args, measure,  # noqa: E402
                               parse_stream_counts)
from bench.e2e.shapes import CPU_SCALE_SHAPES, FULL_SHAPES, TINY_SHAPES  # noqa: E402
from bench.serve_process import ServeProcess  # noqa: E402

# Qwen3-like: 12 of 48 layers (4.1 GB of experts); DeepSeek-like: 1 dense + 3 MoE layers (10.3 GB):
# GGUF and pack together stay under 20 GiB, and 25% of 3 MoE layers is 189 experts, most of a layer
DEFAULT_LAYERS = {"qwen3": 12, "deepseek": 4}
SAMPLE_SEED = 1234
START_SECONDS = 60  # storaged and the server started, the warm-up and a first level, beyond preparing
MAX_NUM_SEQS = 256  # inference serve's most
# what preparing (packtools' GGUF reader and writer), storaged and the server import beyond torch
NEEDED_MODULES = ("gguf", "grpc", "grpc_health", "grpc_reflection", "aiohttp", "transformers")


def shape_keys(text: str) -> tuple[str, ...]:
    keys = tuple(k.strip() for k in text.split(",") if k.strip())
    unknown = [k for k in keys if k not in FULL_SHAPES]
    if not keys or unknown:
        raise argparse.ArgumentTypeError(f"unknown shape {', '.join(map(repr, unknown)) or repr(text)}; "
                                         f"known: {', '.join(FULL_SHAPES)}")
    return keys


def budget_fraction(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a fraction of the experts, got {text!r}") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"the budget is a fraction in (0, 1], got {text!r}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", type=shape_keys, default=tuple(FULL_SHAPES),
                        help=f"comma-separated, of {', '.join(FULL_SHAPES)} (default: all, in that order)")
    sizes = parser.add_mutually_exclusive_group()
    sizes.add_argument("--tiny", action="store_true", help="the shapes' CPU smoke-test sizes")
    sizes.add_argument("--cpu-scale", action="store_true",
                       help="the shapes' routing (experts, top-k) at widths of 256, so batching and the cache "
                            "behave as at full size on a CPU (default 4 MoE layers)")
    parser.add_argument("--layers", type=int, default=None,
                        help=f"layers of every shape (default {DEFAULT_LAYERS}; --tiny: 2 MoE layers; "
                             "--cpu-scale: 4)")
    parser.add_argument("--budget", type=budget_fraction, default=0.25,
                        help="storaged's arena, as a fraction of the experts' pack slots (default 0.25)")
    parser.add_argument("--layer-floor", action="store_true",
                        help="raise the arena to one layer's experts where the budget is below that, as the e2e "
                             "matrix does (default: the budget as given; a layer needing more experts than the "
                             "arena holds is computed in groups)")
    parser.add_argument("--host-tier", action="store_true",
                        help="give storaged a host-RAM tier of the budget's bytes (CUDA only; default off: "
                             "misses are read from the SSD)")
    parser.add_argument("--streams", type=parse_stream_counts, default=DEFAULT_STREAMS, help="default 1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens per completion (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=16, help="about this many prompt tokens (default 16)")
    parser.add_argument("--rounds", type=int, default=1, help="completions per stream per level (default 1)")
    parser.add_argument("--warmup", type=int, default=1, help="bench/concurrency.py's --warmup (default 1)")
    parser.add_argument("--decode", choices=("sample", "greedy"), default="sample",
                        help=f"sample (default): temperature 1, seeded from {SAMPLE_SEED} per stream and round, so "
                             "routing varies token to token as with real text; greedy")
    parser.add_argument("--routing", choices=("balanced", "random"), default="balanced",
                        help="the synthetic routers (bench/e2e/main.py's --routing; default balanced)")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="the server's (default bfloat16 on cuda, float32 on cpu)")
    parser.add_argument("--torch-threads", type=int, default=None, help="the server's torch threads on the CPU")
    parser.add_argument("--serve-arg", action="append", default=[], metavar="FLAG",
                        help="one more `inference serve` argument (repeatable; e.g. --serve-arg=--lookahead=0)")
    parser.add_argument("--workdir", type=Path, default=Path("/var/tmp/expertpack-concurrency"),
                        help="models and logs, on the disk under test (it must take O_DIRECT)")
    parser.add_argument("--keep", action="store_true", help="keep the prepared models")
    parser.add_argument("--json", type=Path, default=None, help="write the report here (and OUT.md beside it)")
    parser.add_argument("--time-budget", type=float, default=400.0, metavar="SECONDS",
                        help="the whole run, preparation included (default 400)")
    parser.add_argument("--prepare-gbps", type=float, default=0.3,
                        help="GB/s that preparing a model (GGUF, then pack) is assumed to write, to tell whether "
                             "a shape still fits the time left (default 0.3)")
    args = parser.parse_args(argv)
    check_level_args(parser, args)
    if max(args.streams) > MAX_NUM_SEQS:
        parser.error(f"--streams: at most {MAX_NUM_SEQS} (inference serve's --max-num-seqs limit)")
    if args.time_budget <= 0:
        parser.error("--time-budget must be more than 0 seconds")
    if args.prepare_gbps <= 0:
        parser.error("--prepare-gbps must be more than 0")
    shapes = shapes_of(args)
    if args.layers is not None:
        short = [k for k in args.shapes if args.layers <= shapes[k].dense_layers]
        if short:
            parser.error(f"--layers {args.layers}: shape {short[0]} has {shapes[short[0]].dense_layers} dense "
                         "layer(s) first and needs at least one MoE layer more")
    if args.host_tier and args.device == "cpu":
        parser.error("--host-tier: storaged's host tier is a CUDA device's (on the CPU the arena is host RAM)")
    if args.torch_threads is not None and args.device != "cpu":
        parser.error("--torch-threads: the server's CPU threads; only with --device cpu")
    return args


def shapes_of(args: argparse.Namespace) -> dict:
    return TINY_SHAPES if args.tiny else CPU_SCALE_SHAPES if args.cpu_scale else FULL_SHAPES


def layers_of(args: argparse.Namespace, key: str) -> int:
    if args.layers is not None:
        return args.layers
    if args.tiny or args.cpu_scale:
        return (2 if args.tiny else 4) + shapes_of(args)[key].dense_layers
    return DEFAULT_LAYERS[key]


def seconds_needed(args: argparse.Namespace, key: str) -> float:
    """About how long a shape needs at least: writing its GGUF and pack, then START_SECONDS."""
    shape = shapes_of(args)[key]
    written = 2 * shape.experts * shape.expert_bytes * shape.moe_layers(layers_of(args, key))
    return written / (args.prepare_gbps * 1e9) + START_SECONDS


def uniform_routing_share(streams: int, experts: int, top_k: int) -> float:
    """Distinct experts a layer-step needs for `streams` decode tokens routed uniformly (each token k
    distinct of E), per token, against one token's k: E·(1 − (1 − k/E)^n) / (n·k). The most batching
    can save of the bytes per token when routing has no overlap beyond chance, with no cache."""
    return experts * (1 - (1 - top_k / experts) ** streams) / (streams * top_k)


def ratios(levels: list[dict], experts: int | None = None, top_k: int | None = None) -> dict:
    """Each level against one stream: aggregate tokens/s, and bytes per token (Stats and block layer);
    with the shape's experts and top_k, the uniform-routing bound on bytes per token beside them."""
    one = next((level for level in levels if level["streams"] == 1), None)
    if one is None:
        return {}

    def against(key: str) -> dict:
        base = one[key]
        return {str(level["streams"]): (level[key] / base if base and level[key] is not None else None)
                for level in levels}

    out = {"tokens_per_second_vs_1": against("aggregate_tokens_per_second"),
           "ssd_bytes_per_token_vs_1": against("ssd_bytes_per_token"),
           "block_read_bytes_per_token_vs_1": against("block_read_bytes_per_token")}
    eight = out["tokens_per_second_vs_1"].get("8")
    if experts and top_k:
        out["uniform_routing_bytes_per_token_vs_1"] = {
            str(level["streams"]): uniform_routing_share(level["streams"], experts, top_k) for level in levels}
    out["tokens_per_second_8_over_1"] = eight
    out["eight_streams_at_least_4x"] = None if eight is None else eight >= 4.0
    per_token = [level["ssd_bytes_per_token"] for level in levels]
    out["ssd_bytes_per_token_falling"] = (None if None in per_token or len(per_token) < 2 else
                                         all(b <= a for a, b in zip(per_token, per_token[1:])))
    return out


def markdown(report: dict) -> str:
    def mb(value):
        return "–" if value is None else f"{value / 1e6:,.2f}"

    def times(value):
        return "–" if value is None else f"{value:.2f}×"

    def gbps(nbytes, seconds):
        return "–" if nbytes is None or not seconds else f"{nbytes / seconds / 1e9:.2f}"

    rows = ["| shape | streams | aggregate tok/s | × 1 stream | SSD MB/token (Stats) | block MB/token "
            "(/proc) | bytes/token × 1 stream | uniform routing's bound | pack GB/s | TTFT p50 s | "
            "inter-token p50 ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for shape in report["shapes"]:
        r = shape.get("ratios", {})
        for level in shape["levels"]:
            n = str(level["streams"])
            rows.append(f"| {shape['shape']} | {n} | {level['aggregate_tokens_per_second']:,.2f} | "
                        f"{times(r.get('tokens_per_second_vs_1', {}).get(n))} | {mb(level['ssd_bytes_per_token'])} | "
                        f"{mb(level['block_read_bytes_per_token'])} | "
                        f"{times(r.get('ssd_bytes_per_token_vs_1', {}).get(n))} | "
                        f"{times(r.get('uniform_routing_bytes_per_token_vs_1', {}).get(n))} | "
                        f"{gbps(level['pack_bytes_read'], level['wall_seconds'])} | "
                        f"{level['ttft_p50_seconds']:.3f} | {1000 * (level['inter_token_p50_seconds'] or 0):.1f} |")
    notes = [f"- {shape['shape']}: {'; '.join(shape['notes'])}" for shape in report["shapes"]]
    return "\n".join(rows + [""] + notes + [f"- error: {e}" for e in report["errors"]]) + "\n"


class Terminated(BaseException):
    """SIGTERM: the run stops, no shape after it starts (a BaseException, as KeyboardInterrupt is, so
    that the per-shape error handling lets it through); what was measured is still written."""


class Run:
    """The report, written after every level; the server that a time limit or SIGTERM stops."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.report = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
                       "shapes": [], "errors": []}
        self.serve: ServeProcess | None = None
        self.cut: str | None = None  # why the server was stopped under a running level

    def write(self) -> None:
        for shape in self.report["shapes"]:
            geometry = shape.get("model", {}).get("shape", {})
            shape["ratios"] = ratios(shape["levels"], geometry.get("experts"), geometry.get("top_k"))
        if self.args.json is not None:
            self.args.json.parent.mkdir(parents=True, exist_ok=True)
            self.args.json.write_text(json.dumps(self.report, indent=2) + "\n")
            self.args.json.with_suffix(".md").write_text(markdown(self.report))

    def stop_server(self, why: str) -> None:
        self.cut = why
        if self.serve is not None:
            self.serve.terminate()

    def shape(self, key: str, deadline: float) -> None:
        import torch

        from bench.e2e.contenders import STORAGED_VARIANTS, start_storaged
        from bench.e2e.prepare import prepare_model, remove_model

        args = self.args
        shape = shapes_of(args)[key]
        entry = {"key": key, "shape": shape.name, "levels": [], "not_run": [], "notes": []}
        self.report["shapes"].append(entry)
        model = prepare_model(shape, layers_of(args, key), args.workdir, with_bf16_checkpoint=False,
                              device=args.device, balanced_routing=args.routing == "balanced")
        entry["model"] = model.as_dict()
        self.write()
        try:
            daemon, host_bytes, notes = start_storaged(model, args.budget, torch.device(args.device), args.workdir,
                                                       io_parallelism=STORAGED_VARIANTS["storaged"].io_parallelism,
                                                       host_tier=args.host_tier, layer_floor=args.layer_floor)
            try:
                objects = model.moe_layers * shape.experts
                entry.update(budget_fraction=args.budget, arena_slots=daemon.slot_count, expert_objects=objects,
                             arena_fraction=daemon.slot_count / objects, host_tier_bytes=host_bytes)
                entry["notes"] += [f"{model.layers} layers ({model.moe_layers} MoE), "
                                   f"{model.expert_bytes_total / 1e6:,.1f} MB of experts",
                                   f"arena {daemon.slot_count} of {objects} experts "
                                   f"({daemon.slot_count / objects:.1%}; budget {args.budget:.0%})", *notes]
                self._measure(entry, daemon, model, deadline)
            finally:
                daemon.stop(check=False)
                entry["storaged_exit_status"] = daemon.process.returncode
        finally:
            if not args.keep:
                remove_model(model)
            self.write()

    def _measure(self, entry: dict, daemon, model, deadline: float) -> None:
        from bench.e2e.contenders import STORAGED_MODEL

        args = self.args
        socket = str(daemon.socket_dir / "s.sock")
        dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
        extra = [*(["--torch-threads", str(args.torch_threads)] if args.torch_threads else []), *args.serve_arg]
        self.cut = None
        self.serve = ServeProcess(model.bundle_dir, socket, storaged_model=STORAGED_MODEL, device=args.device,
                                  dtype=dtype, max_num_seqs=max(args.streams),
                                  log_path=args.workdir / f"serve-{entry['key']}.log", extra_args=extra)
        timer = threading.Timer(max(0.0, deadline - time.monotonic()), self.stop_server,
                                args=(f"the time budget ran out ({args.time_budget:.0f} s for the run)",))
        timer.daemon = True
        timer.start()
        try:
            entry["serve_start_seconds"] = self.serve.start_seconds
            server = Server(self.serve.url, None, None, timeout=max(60.0, deadline - time.monotonic() + 30))
            counters = StoragedCounters(socket, daemon.process.pid)

            def may_start(streams: int, done: list[dict]) -> bool:
                # a level with batching at work takes about as long as the one before it
                left = deadline - time.monotonic()
                if done and left < done[-1]["wall_seconds"]:
                    entry["not_run"].append(f"{streams} streams: {left:.0f} s of the time budget left, the "
                                            f"{done[-1]['streams']}-stream level took {done[-1]['wall_seconds']:.0f} s")
                    return False
                return True

            def on_level(level: dict) -> None:
                entry["levels"].append(level)
                self.write()

            try:
                measure(server, counters, args.streams, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                        rounds=args.rounds, warmup=args.warmup,
                        sample_seed=SAMPLE_SEED if args.decode == "sample" else None,
                        may_start=may_start, on_level=on_level)
            except (BenchError, OSError) as exc:
                if self.cut is None:
                    raise
                entry["not_run"].append(f"cut short: {self.cut} ({type(exc).__name__}: {exc})")
            done = {level["streams"] for level in entry["levels"]}
            entry["not_run"] += [f"{n} streams: not measured" for n in args.streams if n not in done]
        finally:
            timer.cancel()
            entry["serve_exit_status"] = self.serve.stop()
            self.serve = None


def run(args: argparse.Namespace, state: Run) -> None:
    deadline = time.monotonic() + args.time_budget
    for n, key in enumerate(args.shapes):
        left, needed = deadline - time.monotonic(), seconds_needed(args, key)
        if left < needed:
            state.report["errors"].append(f"{key}: not run, {left:.0f} s of the time budget left and it needs "
                                          f"about {needed:.0f} s (preparing at {args.prepare_gbps} GB/s, starting, "
                                          "one level)")
            continue
        try:
            state.shape(key, time.monotonic() + left / (len(args.shapes) - n))
        except Exception as exc:  # noqa: BLE001 - recorded with what was measured; the next shape still runs
            state.report["errors"].append(f"{key}: {type(exc).__name__}: {exc}")
            print(f"bench/concurrency_run.py: {key}: {exc}", file=sys.stderr, flush=True)
        entry = state.report["shapes"][-1] if state.report["shapes"] else None
        if entry is not None and entry["key"] == key and entry["not_run"]:
            state.report["errors"] += [f"{key}: {why}" for why in entry["not_run"]]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    missing = [name for name in NEEDED_MODULES if importlib.util.find_spec(name) is None]
    if missing:  # before minutes of preparation, not after
        print(f"bench/concurrency_run.py: missing Python modules {', '.join(missing)} (install the carried "
              "wheels first: see the module doc)", file=sys.stderr)
        return 2
    args.workdir.mkdir(parents=True, exist_ok=True)
    state = Run(args)

    def terminated(signum, frame):
        state.stop_server(f"signal {signum}")
        raise Terminated(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminated)
    try:
        run(args, state)
    except (Terminated, KeyboardInterrupt) as exc:
        state.report["errors"].append(f"stopped: {type(exc).__name__} {exc}")
    finally:
        state.write()
    print(markdown(state.report), end="")
    return 1 if state.report["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
