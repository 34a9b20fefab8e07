"""Prometheus metrics of one engine and its HTTP front end, in their own CollectorRegistry.

tokens/s over any window = rate(generated_tokens_total) / rate(decode_seconds_total); the
tokens_per_second gauge is the last finished request's own rate.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "expertpack_inference_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# TTFT on CPU test models is milliseconds; with experts read from NVMe it can be many seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class EngineMetrics:
    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.requests = Counter(f"{PREFIX}requests", "Requests answered, by endpoint and HTTP status",
                                ["endpoint", "status"], registry=r)
        self.time_to_first_token = Histogram(f"{PREFIX}time_to_first_token_seconds",
                                             "Seconds from a request's submission (queue wait included) to "
                                             "its first generated token", buckets=TTFT_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}prompt_tokens", "Prompt tokens processed", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}generated_tokens", "Tokens generated", registry=r)
        self.decode_seconds = Counter(f"{PREFIX}decode_seconds", "Seconds the worker spent generating "
                                      "(prefill and decode steps)", registry=r)
        self.tokens_per_second = Gauge(f"{PREFIX}tokens_per_second", "Generated tokens per second of the "
                                       "last finished request", registry=r)
        self.expert_wait_seconds = Counter(f"{PREFIX}expert_wait_seconds", "Seconds spent waiting for the "
                                           "expert source's acquire (when the source reports it)", registry=r)
        self.expert_source_unavailable = Counter(f"{PREFIX}expert_source_unavailable", "Requests failed "
                                                 "because the expert source was unavailable", registry=r)
        self.queue_depth = Gauge(f"{PREFIX}queue_depth", "Requests waiting for the worker", registry=r)
        self.running = Gauge(f"{PREFIX}requests_running", "Requests being generated", registry=r)

    def record_request(self, endpoint: str, status: int) -> None:
        self.requests.labels(endpoint=endpoint, status=str(status)).inc()

    def record_finished(self, prompt_tokens: int, completion_tokens: int, time_to_first_token: float | None,
                        generation_seconds: float) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.generated_tokens.inc(completion_tokens)
        self.decode_seconds.inc(generation_seconds)
        if time_to_first_token is not None:
            self.time_to_first_token.observe(time_to_first_token)
        if generation_seconds > 0:
            self.tokens_per_second.set(completion_tokens / generation_seconds)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
