"""Prometheus metrics of one engine and its HTTP front end, in their own CollectorRegistry.

Every series carries a `model` label (the served model's name). Throughput over any window is
rate(generated_tokens_total); one choice's generation speed is rate(generated_tokens_total) /
rate(decode_seconds_total) (choices batched together each count their own seconds); the
inter-token latency histogram gives its distribution.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from inference.engine.params import Finished

PREFIX = "expertpack_inference_"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# TTFT on CPU test models is milliseconds; with experts read from NVMe it can be many seconds
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
# a whole request, or its wait in the queue: up to long generations on a disk-bound model
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
# one decode step: ~1 ms all-hit on a GPU to seconds when every expert is read from disk
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
               5.0, 10.0, 30.0)


class EngineMetrics:
    def __init__(self, model: str = "", registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model = model
        r, m = self.registry, ["model"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(f"{PREFIX}{name}", doc, m, registry=r).labels(model=model)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"{PREFIX}{name}", doc, m, buckets=buckets, registry=r).labels(model=model)

        self._requests = Counter(f"{PREFIX}requests", "HTTP requests answered, by endpoint and status (499: the "
                                 "client went away first)", ["model", "endpoint", "status"], registry=r)
        self._finish_reasons = Counter(f"{PREFIX}finish_reason", "Choices ended, by finish reason (stop, length, "
                                       "cancelled, timeout, error)", ["model", "finish_reason"], registry=r)
        self.time_to_first_token = histogram("time_to_first_token_seconds", "Seconds from a request's submission "
                                             "(queue wait included) to its first generated token", TTFT_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Seconds from a request's submission to its "
                                     "end, whatever the outcome", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Seconds a request waited before the worker "
                                    "started it", REQUEST_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds", "Seconds between consecutive "
                                             "generated tokens of a choice", ITL_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generated_tokens = counter("generated_tokens", "Tokens generated")
        self.decode_seconds = counter("decode_seconds", "Seconds choices spent generating (prefill and "
                                      "decode steps), summed over choices: batched choices overlap")
        self.expert_wait_seconds = counter("expert_wait_seconds", "Seconds spent waiting for the expert source's "
                                           "acquire (when the source reports it)")
        self.expert_source_unavailable = counter("expert_source_unavailable", "Requests failed because the "
                                                 "expert source was unavailable")
        self.expert_data_loss = counter("expert_data_loss", "Requests failed because an expert object failed its "
                                        "integrity check in the expert source (the log names the object)")
        self.expert_capacity_exhausted = counter("expert_capacity_exhausted", "Requests failed because the expert "
                                                 "cache had no room for one step's experts (others pinned it)")
        self.queue_full = counter("queue_full", "Requests refused with 429 because the queue was full")
        self.static_left = counter("static_decoder_left", "Sequences that left the static (CUDA graph) decoder "
                                   "to join a batch, their cache recomputed by a refeed of their tokens")
        self.queue_depth = Gauge(f"{PREFIX}queue_depth", "Requests waiting for the worker", m,
                                 registry=r).labels(model=model)
        self.running = Gauge(f"{PREFIX}requests_running", "Requests being generated", m,
                             registry=r).labels(model=model)

    def record_request(self, endpoint: str, status: int) -> None:
        self._requests.labels(model=self.model, endpoint=endpoint, status=str(status)).inc()

    def record_finish(self, reason: str, choices: int = 1) -> None:
        self._finish_reasons.labels(model=self.model, finish_reason=reason).inc(choices)

    def record_choice(self, finished: Finished, reason: str | None = None) -> None:
        """One choice generated (or stopped part way): its tokens, time, token gaps and finish reason
        (`reason` when the engine knows better than the choice, e.g. a timeout)."""
        self.prompt_tokens.inc(finished.usage.prompt_tokens)
        self.generated_tokens.inc(finished.usage.completion_tokens)
        self.decode_seconds.inc(finished.generation_seconds)
        for gap in finished.inter_token_seconds:
            self.inter_token_latency.observe(gap)
        self.record_finish(reason or finished.finish_reason)

    def watch_hints(self, policy) -> None:
        """Export the lookahead's HintPolicy (inference.experts.hint_policy) at every scrape: hints
        sent, hinted experts, predictions withheld, and each step width's precision and state."""
        self.registry.register(_HintCollector(policy, self.model))

    def watch_cpu_experts(self, decoder) -> None:
        """Export the CPU experts of a StaticDecoder (inference.experts.cpu_experts) at every
        scrape: the pool's jobs, refused jobs and busy seconds, and the share it takes now."""
        self.registry.register(_CpuExpertsCollector(decoder, self.model))

    def watch_static_decoder(self, decoder) -> None:
        """Export a StaticDecoder's step outcomes at every scrape (inference.engine.decode_graph)."""
        self.registry.register(_StaticDecoderCollector(decoder, self.model))

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


def _model_counters(model: str, rows):
    """A counter family labelled by `model` for each (name, doc, value) of rows, read when scraped."""
    from prometheus_client.core import CounterMetricFamily

    for name, doc, value in rows:
        family = CounterMetricFamily(f"{PREFIX}{name}", doc, labels=["model"])
        family.add_metric([model], value)
        yield family


class _CpuExpertsCollector:
    """Reads the decoder's CPU experts pool when scraped (nothing while it has none: before its
    first binding, after close). A pool started again (the decoder bound anew) counts from zero."""

    def __init__(self, decoder, model: str):
        self.decoder = decoder
        self.model = model

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        shared = self.decoder.cpu_experts
        if shared is None:
            return
        stats = shared.pool.stats()
        yield from _model_counters(self.model, (
                ("cpu_experts_jobs", "Layer jobs the CPU experts pool served (a share of a decode step's "
                                     "host-tier experts each)", stats.jobs),
                ("cpu_experts_failed_jobs", "Jobs the CPU experts pool refused as malformed (the step was redone "
                                            "on the acquire path)", stats.failed_jobs),
                ("cpu_experts_busy_seconds", "Seconds the CPU experts pool spent on jobs", stats.busy_seconds),
                ("cpu_experts_share_moves", "Times the share's tuner moved the CPU experts' share",
                 shared.share_moves)))
        share = GaugeMetricFamily(f"{PREFIX}cpu_experts_share", "Share of each layer's host-tier experts the CPU "
                                  "experts compute now", labels=["model"])
        share.add_metric([self.model], shared.share_now)
        yield share
        if shared.agent is None:
            return
        copied = shared.agent.stats()
        yield from _model_counters(self.model, (
                ("copy_agent_jobs", "Layer jobs the copy agent issued (the GPU's share of a decode step's host-tier "
                                    "experts, copied to VRAM)", copied.jobs),
                ("copy_agent_copies", "Host-tier experts the copy agent copied to VRAM", copied.copies),
                ("copy_agent_refused_jobs", "Copy jobs refused (malformed, or a CUDA call failed): the step was "
                                            "redone on the acquire path", copied.refused)))


class _StaticDecoderCollector:
    """Reads a StaticDecoder's step counters when scraped: how its decode steps ended. Many
    `redone` or `backoff` steps mean the tiers hold less than the requests route to."""

    OUTCOMES = (("slot_map", "lookup_steps"),  # every expert found through the slot map
                ("redone", "redone_steps"),  # an expert absent: undone, run again on the acquire path
                ("backoff", "skipped_steps"),  # on the acquire path straight away, after recent misses
                ("launched_ahead_undone", "abandoned_steps"))  # launched for a token never needed

    def __init__(self, decoder, model: str):
        self.decoder = decoder
        self.model = model

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(f"{PREFIX}static_decoder_steps", "Decode steps of the static (CUDA graph) "
                                     "decoder, by how they ended", labels=["model", "outcome"])
        for outcome, attribute in self.OUTCOMES:
            family.add_metric([self.model, outcome], getattr(self.decoder, attribute))
        yield family


class _HintCollector:
    """Reads a HintPolicy's counters when scraped (they are kept by the policy, not incremented here)."""

    def __init__(self, policy, model: str):
        self.policy = policy
        self.model = model

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        stats = self.policy.stats()
        yield from _model_counters(self.model, (
                ("lookahead_hints", "Lookahead prefetch hints sent to the expert source", stats.hints_sent),
                ("lookahead_hinted_experts", "Experts named in the lookahead hints sent", stats.hinted_experts),
                ("lookahead_withheld", "Lookahead predictions not sent: their step width's precision was below "
                                       "lookahead_min_precision", stats.withheld)))
        precision = GaugeMetricFamily(f"{PREFIX}lookahead_precision", "Running share of the predicted experts the "
                                      "next layer used, by step width (single, batched, chunk)",
                                      labels=["model", "width"])
        sending = GaugeMetricFamily(f"{PREFIX}lookahead_sending", "1 while a step width's lookahead hints are "
                                    "sent, 0 while withheld", labels=["model", "width"])
        for width, bucket in stats.buckets.items():
            if bucket.precision is not None:
                precision.add_metric([self.model, width], bucket.precision)
            sending.add_metric([self.model, width], 1.0 if bucket.sending else 0.0)
        yield precision
        yield sending
