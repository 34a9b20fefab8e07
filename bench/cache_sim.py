"""What storaged's cache policy does with batched routing, simulated: SSD reads per generated token.

Drives the real policy (`AcquirePlanner` over `SlotCache` tiers; pure Python, no I/O) the way
`inference serve` does for S concurrent streams: one prefill step of S prompts, then decode steps of
S tokens; per step, one Acquire per MoE layer of the union of the batch's experts (in groups of at
most the arena's slots when the union is larger), each dropping the session's pins on the other
layers. Routing is uniform: every token picks `top_k` distinct experts at random, as the balanced
routers of `bench/concurrency_run.py`'s synthesized models do.

For each stream count it prints the objects read from the pack per generated token, the decode
hit rate, and bytes per token against one stream. When the disk is the bottleneck (a small arena,
no host tier), aggregate tokens/s scale as the inverse of bytes per token, so `1 ÷ bytes × 1
stream` is the ceiling of concurrency's speed-up at that budget. Each row is run twice in the same
run: with storaged's replacement rule (`layer share`: a layer at its share of the slots replaces
within itself, else the layer holding most gives way; storaged/policy/layer_share.py) and with the
rule it replaced (`lowest score`: the globally lowest decayed score), as the baseline.

    python bench/cache_sim.py                                     # Qwen3-like, 25% arena
    python bench/cache_sim.py --experts 256 --top-k 6 --layers 3  # DeepSeek-V4-Flash-like
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import BenchError  # noqa: E402
from storaged.policy import AcquirePlanner, ModelLayout, SlotCache, Source  # noqa: E402
from storaged.policy.entries import CacheEntry  # noqa: E402
from storaged.policy.layer_share import LayerShareEviction  # noqa: E402

RULES = ("layer share", "lowest score")


class LowestScoreEviction(LayerShareEviction):
    """The replacement rule before layer shares: the globally lowest (score, last access)."""

    def peek_victim(self, model: int, layer: int, now: int) -> CacheEntry | None:
        tops = [heap.peek_min() for heap in (self._coldest, *self._heaps.values())]
        tops = [top for top in tops if top is not None]
        return min(tops, key=lambda e: (e.log_score, e.last_tick)) if tops else None


@dataclass
class Level:
    rule: str
    streams: int
    generated_tokens: int
    pack_reads: int
    decode_hits: int
    decode_lookups: int
    pack_reads_per_token: float
    decode_hit_rate: float
    bytes_per_token_vs_1: float = 1.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=12, help="MoE layers")
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25, help="VRAM arena, share of the experts")
    parser.add_argument("--host-share", type=float, default=0.0, help="host tier, share of the experts (0: off)")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    parser.add_argument("--prompt-tokens", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=16, help="generated tokens per stream")
    parser.add_argument("--rounds", type=int, default=3, help="runs per level, each after a fresh cache")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if min(args.layers, args.experts, args.top_k, args.prompt_tokens, args.max_tokens, args.rounds) < 1:
        raise BenchError("--layers, --experts, --top-k, --prompt-tokens, --max-tokens and --rounds must be positive")
    if args.top_k > args.experts:
        raise BenchError(f"--top-k {args.top_k} exceeds --experts {args.experts}")
    if not 0 < args.budget <= 1 or not 0 <= args.host_share <= 1:
        raise BenchError(f"--budget must be in (0, 1] and --host-share in [0, 1], got {args.budget}, {args.host_share}")
    if min(args.streams) < 1:
        raise BenchError(f"--streams must be positive, got {args.streams}")
    return args


def _tier(rule: str, slots: int, tier: str) -> SlotCache:
    cache = SlotCache(slots, tier=tier)
    if rule == "lowest score":
        cache._evictable = LowestScoreEviction(slots, idle_after=1)  # the baseline rule, swapped in on an empty tier
    return cache


def simulate(args: argparse.Namespace, rule: str, streams: int, rng: random.Random) -> Level:
    """One level: a fresh cache, one prefill step of `streams` prompts, then decode steps."""
    total = args.layers * args.experts
    slots = max(args.top_k, round(args.budget * total))
    host_slots = round(args.host_share * total)
    vram = _tier(rule, slots, "vram")
    host = _tier(rule, host_slots, "host") if host_slots else None
    planner = AcquirePlanner(vram, host, {0: ModelLayout.contiguous(args.layers, args.experts)})
    session = "sim"
    counts = {"reads": 0, "hits": 0, "lookups": 0}

    def step(tokens: int, decode: bool) -> None:
        for layer in range(args.layers):
            union = sorted({e for _ in range(tokens) for e in rng.sample(range(args.experts), args.top_k)})
            for start in range(0, len(union), slots):  # a layer larger than the arena, in groups
                plan = planner.acquire(session, 0, layer, union[start:start + slots], release_other_layers=True)
                for demotion in plan.demotions:
                    planner.demoted(demotion.key)
                for expert_step in plan.steps:
                    counts["reads"] += expert_step.source is Source.PACK
                    if decode:
                        counts["lookups"] += 1
                        counts["hits"] += expert_step.source is Source.READY
                    if expert_step.source.needs_io:
                        planner.complete(expert_step.key)

    step(streams * args.prompt_tokens, decode=False)  # the prefill also yields each stream's first token
    for _ in range(args.max_tokens - 1):
        step(streams, decode=True)
    planner.close_session(session)
    generated = streams * args.max_tokens
    return Level(rule, streams, generated, counts["reads"], counts["hits"], counts["lookups"],
                 counts["reads"] / generated, counts["hits"] / max(1, counts["lookups"]))


def run(args: argparse.Namespace) -> list[Level]:
    levels: list[Level] = []
    for rule in RULES:
        rng = random.Random(args.seed)  # both rules see the same routing
        for streams in args.streams:
            rounds = [simulate(args, rule, streams, rng) for _ in range(args.rounds)]
            level = Level(rule, streams, sum(r.generated_tokens for r in rounds), sum(r.pack_reads for r in rounds),
                          sum(r.decode_hits for r in rounds), sum(r.decode_lookups for r in rounds), 0.0, 0.0)
            level.pack_reads_per_token = level.pack_reads / level.generated_tokens
            level.decode_hit_rate = level.decode_hits / max(1, level.decode_lookups)
            levels.append(level)
        first = next(level for level in levels if level.rule == rule)
        for level in levels:
            if level.rule == rule:
                level.bytes_per_token_vs_1 = level.pack_reads_per_token / first.pack_reads_per_token
    return levels


def table(args: argparse.Namespace, levels: list[Level]) -> str:
    lines = [f"{args.layers} MoE layers x {args.experts} experts, top-{args.top_k}; arena {args.budget:.0%}, "
             f"host tier {args.host_share:.0%}; prompts {args.prompt_tokens} tokens, {args.max_tokens} generated "
             f"per stream; {args.rounds} rounds per level",
             "",
             "| rule | streams | pack reads / token | decode hit rate | bytes/token × 1 stream | "
             "disk-bound ceiling × 1 stream | reads ÷ lowest score |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    baseline = {level.streams: level for level in levels if level.rule == "lowest score"}
    for level in levels:
        versus = level.pack_reads_per_token / baseline[level.streams].pack_reads_per_token
        lines.append(f"| {level.rule} | {level.streams} | {level.pack_reads_per_token:.1f} | "
                     f"{level.decode_hit_rate:.3f} | {level.bytes_per_token_vs_1:.2f}× | "
                     f"{1 / level.bytes_per_token_vs_1:.2f}× | {versus:.2f}× |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except BenchError as exc:
        print(f"cache_sim.py: {exc}", file=sys.stderr)
        return 2
    levels = run(args)
    print(table(args, levels))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) if isinstance(v, Path) else v
                                                  for k, v in vars(args).items()},
                                         "levels": [asdict(level) for level in levels]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
