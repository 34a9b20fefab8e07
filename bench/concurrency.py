"""Continuous batching against a running `inference serve --storaged`: aggregate tokens/s and SSD
bytes per generated token at 1, 2, 4, 8 and 16 concurrent streams.

For each concurrency c: c clients (threads) each stream completions of `--max-tokens` tokens
(ignore_eos, so every completion has exactly that many) one after another, all of them for
`--rounds` rounds; the level's wall time runs from the first request to the last stream's end.
Greedy by default; with `--sample-seed S`, temperature 1 and a seed per stream and round (from
S), so that routing varies token to token as with real text (greedy decoding of random weights
repeats one token, and with it one set of experts). Before the first level, `--warmup` single
completions and then one untimed burst of the largest level's streams (a few tokens each) run,
so that no level pays for first-use work (kernel compilation, CUDA graph capture). Measured, per
level:
  - aggregate tokens/s: completion tokens (the server's own usage counts) / wall seconds;
  - SSD bytes per generated token: storaged's bytes read from its packs (its Stats RPC, through
    `--storaged SOCKET`) over the level / completion tokens; with `--storaged-pid`, also the
    block-layer read_bytes of the daemon's /proc/<pid>/io (O_DIRECT reads included, page-cache
    hits not);
  - time to first token and inter-token gap percentiles, over every stream of the level.
Each level starts from the same prompts (a different prompt per stream, `--prompt-tokens` long),
so prefill work per stream is equal across levels. bench/concurrency_run.py runs this against a
daemon and a server it starts itself, per model shape, in one command.

    python bench/concurrency.py --url http://127.0.0.1:8000 --storaged /run/expertpack/storaged.sock \\
        --storaged-pid $(pidof storaged) --max-tokens 64 --json concurrency.json
    python bench/concurrency.py --url http://127.0.0.1:8123 --storaged /tmp/sd.sock --streams 1,2 \\
        --max-tokens 8 --rounds 1                                  # a CPU smoke with a tiny model
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run from a checkout

from bench.common import BenchError, percentile  # noqa: E402
from bench.e2e.measure import process_read_bytes  # noqa: E402

DEFAULT_STREAMS = (1, 2, 4, 8, 16)
WARMUP_BURST_TOKENS = 4
WORDS = ("river", "mill", "stone", "field", "market", "harbor", "lantern", "orchard", "bridge", "valley")


def prompt_of(stream: int, tokens: int) -> str:
    """A distinct prompt per stream of roughly `tokens` tokens (a word is about one token or two)."""
    words = [WORDS[(stream * 7 + i * 3) % len(WORDS)] for i in range(max(1, tokens - 2))]
    return f"Story {stream}: " + " ".join(words)


class Server:
    """POST /v1/completions with stream=True over http.client; one connection per call."""

    def __init__(self, url: str, model: str | None, api_key: str | None, timeout: float):
        parts = urllib.parse.urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise BenchError(f"--url {url!r}: expected http://HOST:PORT")
        self.host, self.port = parts.hostname, parts.port or 80
        self.api_key = api_key
        self.timeout = timeout
        self.model = model or self._model()

    def _request(self, method: str, path: str, body: dict | None = None) -> http.client.HTTPResponse:
        connection = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        connection.request(method, path, body=None if body is None else json.dumps(body), headers=headers)
        response = connection.getresponse()
        if response.status != 200:
            raise BenchError(f"{method} {path}: HTTP {response.status}: {response.read()[:500]!r}")
        return response

    def _model(self) -> str:
        models = json.loads(self._request("GET", "/v1/models").read())["data"]
        return models[0]["id"]

    def stream(self, prompt: str, max_tokens: int, seed: int | None = None) -> dict:
        """One completion streamed, greedy or (with a seed) sampled at temperature 1: completion tokens
        (the server's usage), TTFT and token gaps."""
        started = time.monotonic()
        sampling = {"temperature": 0} if seed is None else {"temperature": 1.0, "seed": seed}
        response = self._request("POST", "/v1/completions", {
            "model": self.model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, **sampling,
            "ignore_eos": True, "stream_options": {"include_usage": True}})
        arrivals, usage = [], None
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            if "error" in chunk:
                raise BenchError(f"the stream failed: {chunk['error']}")
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                arrivals.append(time.monotonic())
        if usage is None:
            raise BenchError("the stream ended without a usage chunk")
        return {"completion_tokens": usage["completion_tokens"], "ttft": arrivals[0] - started if arrivals else None,
                "gaps": [b - a for a, b in zip(arrivals, arrivals[1:])]}


class StoragedCounters:
    """storaged's pack bytes read (Stats RPC) and, with a pid, its block-layer read_bytes."""

    def __init__(self, socket: str | None, pid: int | None):
        self.socket, self.pid = socket, pid

    def read(self) -> dict:
        figures: dict = {"pack_bytes": None, "acquires": None, "block_bytes": None}
        if self.socket:
            from storaged.client import StorageClient

            with StorageClient(self.socket) as client:
                stats = client.stats()
            figures.update(pack_bytes=stats.bytes_read, acquires=stats.acquires)
        if self.pid is not None:
            figures["block_bytes"] = process_read_bytes(self.pid)
        return figures


def _delta(after: dict, before: dict, key: str):
    return None if after[key] is None or before[key] is None else after[key] - before[key]


def _seed(sample_seed: int | None, stream: int, round_: int) -> int | None:
    return None if sample_seed is None else sample_seed + 1000 * stream + round_


def run_level(server: Server, counters: StoragedCounters, streams: int, *, max_tokens: int, prompt_tokens: int,
              rounds: int, sample_seed: int | None = None) -> dict:
    prompts = [prompt_of(i, prompt_tokens) for i in range(streams)]
    start = threading.Event()

    def client(i: int) -> list[dict]:
        start.wait()
        return [server.stream(prompts[i], max_tokens, _seed(sample_seed, i, r)) for r in range(rounds)]

    before = counters.read()
    with concurrent.futures.ThreadPoolExecutor(streams) as pool:
        futures = [pool.submit(client, i) for i in range(streams)]
        began = time.monotonic()
        start.set()
        results = [r for f in futures for r in f.result()]
    wall = time.monotonic() - began
    after = counters.read()
    tokens = sum(r["completion_tokens"] for r in results)
    ttfts = sorted(r["ttft"] for r in results if r["ttft"] is not None)
    gaps = sorted(g for r in results for g in r["gaps"])
    pack, block = _delta(after, before, "pack_bytes"), _delta(after, before, "block_bytes")
    return {
        "streams": streams, "requests": len(results), "completion_tokens": tokens, "wall_seconds": wall,
        "aggregate_tokens_per_second": tokens / wall if wall > 0 else None,
        "ssd_bytes_per_token": None if pack is None or not tokens else pack / tokens,
        "block_read_bytes_per_token": None if block is None or not tokens else block / tokens,
        "pack_bytes_read": pack, "block_read_bytes": block, "acquires": _delta(after, before, "acquires"),
        "ttft_p50_seconds": percentile(ttfts, 50) if ttfts else None,
        "ttft_max_seconds": ttfts[-1] if ttfts else None,
        "inter_token_p50_seconds": percentile(gaps, 50) if gaps else None,
        "inter_token_p99_seconds": percentile(gaps, 99) if gaps else None,
    }


def warm_up(server: Server, *, singles: int, burst: int, max_tokens: int, prompt_tokens: int,
            sample_seed: int | None = None) -> None:
    """`singles` completions alone, then `burst` streams at once (untimed; see the module doc)."""
    for _ in range(singles):
        server.stream(prompt_of(0, prompt_tokens), max_tokens, _seed(sample_seed, 0, 0))
    if burst > 1:
        with concurrent.futures.ThreadPoolExecutor(burst) as pool:
            for future in [pool.submit(server.stream, prompt_of(i, prompt_tokens), WARMUP_BURST_TOKENS,
                                       _seed(sample_seed, i, 0)) for i in range(burst)]:
                future.result()


def measure(server: Server, counters: StoragedCounters, streams: tuple[int, ...], *, max_tokens: int,
            prompt_tokens: int, rounds: int, warmup: int, sample_seed: int | None = None,
            may_start: Callable[[int, list[dict]], bool] = lambda streams, done: True,
            on_level: Callable[[dict], None] = lambda level: None) -> list[dict]:
    """The warm-up, then one run_level per stream count, in order, while `may_start(streams,
    levels so far)` allows; each level gets speedup_vs_first and goes to `on_level` when done."""
    warm_up(server, singles=warmup, burst=max(streams) if warmup else 0, max_tokens=max_tokens,
            prompt_tokens=prompt_tokens, sample_seed=sample_seed)
    levels: list[dict] = []
    for count in streams:
        if not may_start(count, levels):
            break
        level = run_level(server, counters, count, max_tokens=max_tokens, prompt_tokens=prompt_tokens,
                          rounds=rounds, sample_seed=sample_seed)
        base = (levels or [level])[0]["aggregate_tokens_per_second"]
        level["speedup_vs_first"] = level["aggregate_tokens_per_second"] / base if base else None
        levels.append(level)
        per_token = level["ssd_bytes_per_token"]
        print(f"{count:3d} streams: {level['aggregate_tokens_per_second']:9.2f} tok/s aggregate, "
              f"SSD {'-' if per_token is None else f'{per_token:,.0f}'} bytes/token, "
              f"TTFT p50 {level['ttft_p50_seconds']:.3f} s", flush=True)
        on_level(level)
    return levels


def parse_stream_counts(text: str) -> tuple[int, ...]:
    """`--streams`' argparse type: comma-separated counts, each 1 or more."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated stream counts, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"stream counts must be 1 or more, got {text!r}")
    return values


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", required=True, help="the inference server, http://HOST:PORT")
    parser.add_argument("--model", default=None, help="model id (default: the server's only model)")
    parser.add_argument("--api-key", default=None, help="Bearer key, when the server asks for one")
    parser.add_argument("--storaged", default=None, metavar="SOCKET",
                        help="storaged's socket: its Stats give the pack bytes read per level")
    parser.add_argument("--storaged-pid", type=int, default=None, metavar="PID",
                        help="storaged's pid: its /proc/PID/io read_bytes per level too")
    parser.add_argument("--streams", type=parse_stream_counts, default=DEFAULT_STREAMS, help="default 1,2,4,8,16")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per completion (default 64)")
    parser.add_argument("--prompt-tokens", type=int, default=32, help="about this many prompt tokens (default 32)")
    parser.add_argument("--rounds", type=int, default=2, help="completions per stream per level (default 2)")
    parser.add_argument("--warmup", type=int, default=1,
                        help="single completions before measuring, then one burst of the largest level's streams "
                             "(default 1; 0: no warm-up)")
    parser.add_argument("--sample-seed", type=int, default=None, metavar="S",
                        help="sample at temperature 1, seeded per stream and round from S (default: greedy)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per HTTP request (default 600)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here too")
    args = parser.parse_args(argv)
    check_level_args(parser, args)
    return args


def check_level_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse (parser.error, naming the flag) level settings that cannot run."""
    for name in ("max_tokens", "prompt_tokens", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be 1 or more")
    if args.warmup < 0:
        parser.error("--warmup must be 0 or more")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        server = Server(args.url, args.model, args.api_key, args.timeout)
        counters = StoragedCounters(args.storaged, args.storaged_pid)
        levels = measure(server, counters, args.streams, max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
                         rounds=args.rounds, warmup=args.warmup, sample_seed=args.sample_seed)
    except (BenchError, OSError) as exc:
        print(f"bench/concurrency.py: {exc}", file=sys.stderr)
        return 1
    report = {"url": args.url, "model": server.model, "max_tokens": args.max_tokens,
              "prompt_tokens": args.prompt_tokens, "rounds": args.rounds, "sample_seed": args.sample_seed,
              "levels": levels}
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
