"""When lookahead hints pay: a precision governor for prefetch hints.

A hint that names an expert the next layer does not use costs a disk read (when the expert was
not resident) and buys nothing. How often that happens depends on the predictor (its router on
the previous layer's input may be poor for a model) and on the step's width: one token's hint is
`per_token` experts for top_k used; the union of many decode tokens' hints covers most experts
while the step needs fewer; a prefill chunk's hint is nearly all used. So the policy scores every
prediction against the experts the next layer then used, precision = |predicted ∩ used| /
|predicted|, keeps an exponentially weighted precision per width bucket, and lets a bucket's
hints through only while its precision is at least `min_precision`.

Predictions are scored whether they were sent or withheld (shadow scoring): a bucket whose
predictor improves gets its hints back. A bucket starts optimistic (hints sent) until it has
`warmup` observations. `min_precision` 0 sends every hint (and still scores them).

Plain Python, no torch: the caller hands in the experts as lists of ints it already has on the
host (the routing transfer brings them; scoring adds no device sync).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Sequence

# weight of the newest observation in the running precision: ~10 steps of memory, so a change in
# the traffic (a new prompt, a batch filling up) turns the decision within a few dozen layers
DEFAULT_ALPHA = 0.1
# a precision p wastes (1 - p) / p of the bytes the used hints bring: at 0.87 at most ~15% (the
# most prefetch may add to a step's reads)
DEFAULT_MIN_PRECISION = 0.87
DEFAULT_WARMUP = 8  # observations of a bucket before its precision decides
BATCHED_MAX_TOKENS = 32  # widest step still counted as batched decode; wider ones are prefill chunks

SINGLE, BATCHED, CHUNK = "single", "batched", "chunk"
BUCKETS = (SINGLE, BATCHED, CHUNK)


def width_bucket(tokens: int) -> str:
    """The bucket of a step over `tokens` tokens: one token, a few (batched decode), or more."""
    if tokens < 1:
        raise ValueError(f"a step has at least one token, got {tokens}")
    if tokens == 1:
        return SINGLE
    return BATCHED if tokens <= BATCHED_MAX_TOKENS else CHUNK


@dataclasses.dataclass(frozen=True)
class BucketStats:
    observations: int  # predictions scored
    precision: float | None  # the running precision; None before the first observation
    sending: bool  # whether this bucket's hints go out now


@dataclasses.dataclass(frozen=True)
class HintStats:
    """A snapshot of the policy's counters."""

    hints_sent: int  # prefetch hints sent (one per layer call)
    hinted_experts: int  # experts named in the sent hints
    withheld: int  # predictions not sent (their bucket's precision was below min_precision)
    buckets: dict[str, BucketStats]


class HintPolicy:
    """Decides per prediction whether to send it; scores it once its layer's experts are known."""

    def __init__(self, min_precision: float = DEFAULT_MIN_PRECISION, *, alpha: float = DEFAULT_ALPHA,
                 warmup: int = DEFAULT_WARMUP):
        if isinstance(min_precision, bool) or not isinstance(min_precision, (int, float)) \
                or not 0.0 <= min_precision <= 1.0:
            raise ValueError(f"min_precision must be in [0, 1], got {min_precision!r}")
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha!r}")
        if warmup < 0:
            raise ValueError(f"warmup must be 0 or more, got {warmup!r}")
        self.min_precision = float(min_precision)
        self.alpha = alpha
        self.warmup = warmup
        self._lock = threading.Lock()  # the server reads stats() from another thread
        self._precision: dict[str, float] = {}
        self._observations = dict.fromkeys(BUCKETS, 0)
        self._pending: dict[int, tuple[int, frozenset[int]]] = {}  # layer -> (tokens, predicted experts)
        self._sent = self._hinted = self._withheld = 0

    def should_send(self, tokens: int) -> bool:
        """Whether a hint of a step over `tokens` tokens goes out now."""
        bucket = width_bucket(tokens)
        with self._lock:
            return self._sending(bucket)

    def _sending(self, bucket: str) -> bool:
        if self.min_precision == 0.0 or self._observations[bucket] < self.warmup:
            return True
        return self._precision[bucket] >= self.min_precision

    def predicted(self, layer: int, tokens: int, experts: Sequence[int]) -> bool:
        """Remember the prediction for `layer` (replacing an unscored one) and count it as sent or
        withheld; True when it is to be sent. An empty prediction is neither."""
        bucket = width_bucket(tokens)
        with self._lock:
            if not experts:
                self._pending.pop(layer, None)
                return False
            self._pending[layer] = (tokens, frozenset(experts))
            if not self._sending(bucket):
                self._withheld += 1
                return False
            self._sent += 1
            self._hinted += len(experts)
            return True

    def observe(self, layer: int, tokens: int, used: Iterable[int]) -> None:
        """`layer` ran over `tokens` tokens with the distinct experts `used`: score its pending
        prediction (if one was made for a step of that width) into its bucket's precision."""
        bucket = width_bucket(tokens)
        with self._lock:
            pending = self._pending.pop(layer, None)
            if pending is None or pending[0] != tokens:  # no prediction, or one from another step
                return
            predicted = pending[1]
            precision = len(predicted.intersection(used)) / len(predicted)
            previous = self._precision.get(bucket)
            self._precision[bucket] = precision if previous is None else \
                previous + self.alpha * (precision - previous)
            self._observations[bucket] += 1

    def stats(self) -> HintStats:
        with self._lock:
            buckets = {bucket: BucketStats(self._observations[bucket], self._precision.get(bucket),
                                           self._sending(bucket)) for bucket in BUCKETS}
            return HintStats(self._sent, self._hinted, self._withheld, buckets)
