"""The demo's client: one chat request through the official openai client, then the figures.

    python scripts/demo_client.py --base-url http://127.0.0.1:PORT --model NAME --storaged-socket SOCK

Prints the answer, storaged's cache figures (its Stats RPC: hits and misses per tier, bytes read,
resident experts) and the inference server's metrics (time to first token, tokens). Exit status
0, or 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
import urllib.request

import openai

from storaged.client import StorageClient, StorageError

INFERENCE_PREFIX = "expertpack_inference_"
STORAGED_SERIES = ("expertpack_storaged_hits_total", "expertpack_storaged_misses_total",
                   "expertpack_storaged_read_bytes_total", "expertpack_storaged_resident_experts")


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {'name{labels}': value} (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def mib(nbytes: int) -> str:
    return f"{nbytes / (1 << 20):.2f} MiB"


def print_storaged_stats(socket_path: str) -> None:
    with StorageClient(socket_path, timeout=10) as client:
        stats = client.stats()
        info = client.info()
    print(f"storaged cache ({info.device}, {info.slot_count} slots of {info.slot_bytes} bytes; "
          f"direct I/O {'on' if 'DIRECT_IO' in info.capabilities else 'off'}):")
    for tier, figures in stats.tiers.items():
        print(f"  {tier:5} tier: hits={figures.hits} misses={figures.misses} evictions={figures.evictions} "
              f"resident_experts={figures.resident_experts} resident={mib(figures.resident_bytes)}")
    print(f"  bytes_read={stats.bytes_read} ({mib(stats.bytes_read)}) reads={stats.reads} "
          f"h2d_bytes={stats.h2d_bytes} acquires={stats.acquires} "
          f"mean_acquire_latency={stats.acquire_latency_mean_us:.0f}us checksum_failures={stats.checksum_failures}")


def scrape(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_metrics(response.read().decode())


def print_storaged_prometheus(url: str) -> None:
    """The same figures as Prometheus sees them on storaged's endpoint."""
    print(f"storaged Prometheus endpoint {url}:")
    for name, value in scrape(url).items():
        if name.startswith(STORAGED_SERIES):
            print(f"  {name} {value:g}")


def print_inference_metrics(base_url: str) -> None:
    metrics = scrape(f"{base_url}/metrics")

    def metric(name: str) -> float:
        """The series' value summed over its labels (model, ...)."""
        full = INFERENCE_PREFIX + name
        return sum(v for k, v in metrics.items() if k == full or k.startswith(full + "{"))

    requests = metric("time_to_first_token_seconds_count")
    decode = metric("decode_seconds_total")
    rate = metric("generated_tokens_total") / decode if decode else float("nan")  # while generating
    ttft = metric("time_to_first_token_seconds_sum") / requests if requests else float("nan")
    print("inference metrics:")
    print(f"  ttft={ttft:.3f}s (mean of {requests:.0f} request(s)) prompt_tokens={metric('prompt_tokens_total'):.0f} "
          f"generated_tokens={metric('generated_tokens_total'):.0f} "
          f"tokens_per_second={rate:.1f} "
          f"expert_wait={metric('expert_wait_seconds_total'):.3f}s")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="the inference server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="the model id the server serves")
    parser.add_argument("--storaged-socket", required=True, help="storaged's Unix socket (for its Stats)")
    parser.add_argument("--storaged-metrics-url", default=None, help="storaged's Prometheus endpoint (optional)")
    parser.add_argument("--prompt", default="Tell me about mixtures of experts.")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args(argv)
    client = openai.OpenAI(base_url=f"{args.base_url}/v1", api_key="not-needed", timeout=300, max_retries=0)
    try:
        reply = client.chat.completions.create(model=args.model, max_tokens=args.max_tokens, temperature=0,
                                               messages=[{"role": "user", "content": args.prompt}])
    except openai.OpenAIError as exc:
        print(f"demo_client: the chat request failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(f"prompt: {args.prompt}")
    # a synthetic model's tokens are random text: repr keeps control characters visible
    print(f"answer: {reply.choices[0].message.content!r}")
    print(f"usage: prompt_tokens={reply.usage.prompt_tokens} completion_tokens={reply.usage.completion_tokens} "
          f"finish_reason={reply.choices[0].finish_reason}")
    try:
        print_storaged_stats(args.storaged_socket)
        if args.storaged_metrics_url:
            print_storaged_prometheus(args.storaged_metrics_url)
        print_inference_metrics(args.base_url)
    except (StorageError, OSError) as exc:
        print(f"demo_client: cannot read the figures: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
