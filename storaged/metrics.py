"""StoragedMetrics: the values of storaged's figures (storaged.stats_snapshot's field table), their
snapshot, and the Prometheus endpoint that renders it.

Every name starts with `expertpack_storaged_` and carries its unit (`_bytes`, `_seconds`,
`_total` for counters; the field table checks it). The registry is owned by the instance, never
prometheus_client's global one, so several daemons (or tests) in one process do not collide; it
holds one collector that renders `snapshot()` on each scrape, so /metrics and the Stats RPC read
the same values.

Recording is thread-safe (one lock), so read worker threads may call observe_read while the
event loop records hits.
"""

from __future__ import annotations

import bisect
import math
import threading
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

import prometheus_client
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from storaged import stats_snapshot
from storaged.stats_snapshot import (ACQUIRE_SECONDS_BUCKETS, PREFIX, READ_SECONDS_BUCKETS, TIERS, Histogram,
                                     Kind, StatField, StatsSnapshot)

__all__ = ["ACQUIRE_SECONDS_BUCKETS", "PREFIX", "READ_SECONDS_BUCKETS", "TIERS", "MetricsServer",
           "StoragedMetrics", "UnknownFigureError", "UnknownLabelError", "WrongKindError"]


class UnknownFigureError(KeyError):
    """A figure name the field table does not have."""


class UnknownLabelError(ValueError):
    """A label value outside a field's label_values (e.g. a tier other than those in TIERS), or a
    label given to an unlabelled figure, or none to a labelled one."""


class WrongKindError(TypeError):
    """A recording that does not fit the figure's kind (observe on a counter, add to a gauge...)."""


@dataclass
class MetricsServer:
    """A running /metrics HTTP endpoint; close() stops it."""

    server: WSGIServer
    thread: threading.Thread

    @property
    def address(self) -> tuple[str, int]:
        host, port = self.server.server_address[:2]
        return host, port

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()


class _Histogram:
    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # per bucket, the last one above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def figures(self) -> Histogram:
        cumulative, buckets = 0, []
        for bound, count in zip((*self.bounds, math.inf), self.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        return Histogram(cumulative, self.sum, tuple(buckets))


class StoragedMetrics:
    def __init__(self, fields: tuple[StatField, ...] | None = None) -> None:
        self.fields = stats_snapshot.table() if fields is None else fields
        self._by_name = {f.name: f for f in self.fields}
        self._lock = threading.Lock()
        self._values: dict[str, float | dict[str, float] | _Histogram] = {}
        for f in self.fields:
            if f.kind is Kind.HISTOGRAM:
                self._values[f.name] = _Histogram(f.buckets)
            elif f.label is not None:  # every fixed label value exists from the start, at zero
                self._values[f.name] = {value: 0 for value in f.label_values}
            else:
                self._values[f.name] = 0
        self._tier_names = TIERS
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_Collector(self))

    # ---- recording (generic) ------------------------------------------------------------------

    def _field(self, name: str, kinds: tuple[Kind, ...], label: str | None) -> StatField:
        f = self._by_name.get(name)
        if f is None:
            raise UnknownFigureError(f"unknown figure {name!r}; the field table (storaged.stats_snapshot) "
                                     "has no such name")
        if f.kind not in kinds:
            raise WrongKindError(f"figure {name!r} is a {f.kind.value}; this records a "
                                 f"{' or '.join(k.value for k in kinds)}")
        if (label is None) != (f.label is None):
            raise UnknownLabelError(f"figure {name!r} takes {f'a {f.label!r} label' if f.label else 'no label'}")
        if label is not None and f.label_values and label not in f.label_values:
            raise UnknownLabelError(f"unknown {f.label} {label!r} for {name!r}; expected one of {f.label_values}")
        return f

    def _write(self, name: str, label: str | None, update) -> None:
        with self._lock:
            if label is None:
                self._values[name] = update(self._values[name])
            else:
                series = self._values[name]
                series[label] = update(series.get(label, 0))

    def add(self, name: str, amount: float = 1, label: str | None = None) -> None:
        """Count `amount` (>= 0) more on counter `name` (its series `label` if labelled)."""
        self._field(name, (Kind.COUNTER,), label)
        if amount < 0:
            raise ValueError(f"counter {name!r} only goes up; asked to add {amount}")
        self._write(name, label, lambda old: old + amount)

    def set(self, name: str, value: float, label: str | None = None) -> None:
        """Set gauge `name`; or counter `name` to a total kept elsewhere (the policy's own counts),
        which must not go down."""
        f = self._field(name, (Kind.GAUGE, Kind.COUNTER), label)

        def update(old: float) -> float:
            if f.kind is Kind.COUNTER and value < old:
                raise ValueError(f"counter {name!r} only goes up; asked to set {value} below {old}")
            return value
        self._write(name, label, update)

    def observe(self, name: str, value: float) -> None:
        self._field(name, (Kind.HISTOGRAM,), None)
        with self._lock:
            self._values[name].observe(value)

    def set_tier_names(self, names: tuple[str, ...]) -> None:
        """The cache tiers serving (the Stats reply lists these); every one must be in TIERS."""
        unknown = [name for name in names if name not in TIERS]
        if unknown:
            raise UnknownLabelError(f"unknown tier(s) {unknown}; expected some of {TIERS}")
        self._tier_names = tuple(names)

    # ---- recording (what the daemon's components call) ---------------------------------------

    def observe_read(self, nbytes: int, seconds: float) -> None:
        self.add("read_bytes_total", nbytes)
        self.observe("read_seconds", seconds)

    def record_h2d(self, nbytes: int) -> None:
        self.add("h2d_bytes_total", nbytes)

    def observe_acquire(self, seconds: float) -> None:
        self.observe("acquire_seconds", seconds)

    def observe_acquire_phases(self, **seconds: float) -> None:
        """Seconds of one Acquire's phases (stats_snapshot.ACQUIRE_PHASES) added to their counters."""
        for phase, value in seconds.items():
            self.add("acquire_phase_seconds_total", value, label=phase)

    def record_io_error(self) -> None:
        self.add("io_errors_total")

    def record_checksum_failure(self) -> None:
        self.add("checksum_failures_total")

    def record_hit_verified(self, *, mismatch: bool) -> None:
        self.add("hits_verified_total")
        if mismatch:
            self.add("hit_mismatches_total")

    def record_demotion(self, nbytes: int) -> None:
        self.add("demotions_total")
        self.add("d2h_bytes_total", nbytes)

    def record_dataplane_request(self, kind: str) -> None:
        self.add("dataplane_requests_total", label=kind)

    # ---- export -------------------------------------------------------------------------------

    def snapshot(self) -> StatsSnapshot:
        with self._lock:
            values = {name: value.figures() if isinstance(value, _Histogram)
                      else dict(value) if isinstance(value, dict) else value
                      for name, value in self._values.items()}
            return StatsSnapshot(values, self._tier_names, self.fields)

    def exposition(self) -> bytes:
        """The text exposition format, as /metrics serves it."""
        return prometheus_client.generate_latest(self.registry)

    def start_http_server(self, port: int, addr: str = "127.0.0.1") -> MetricsServer:
        """Serve /metrics on addr:port (port 0 picks a free one) from a daemon thread."""
        server, thread = prometheus_client.start_http_server(port, addr=addr, registry=self.registry)
        return MetricsServer(server, thread)


class _Collector:
    """The snapshot as Prometheus metric families (the first of its two renderings; the Stats
    reply, storaged.server.stats, is the other)."""

    def __init__(self, metrics: StoragedMetrics):
        self.metrics = metrics

    def collect(self):
        snapshot = self.metrics.snapshot()
        for f in snapshot.fields:
            name, value = PREFIX + f.name, snapshot.values[f.name]
            if f.kind is Kind.HISTOGRAM:
                family = HistogramMetricFamily(name, f.help)
                family.add_metric([], [(floatToGoString(bound), count) for bound, count in value.buckets],
                                  value.sum)
            else:
                make = CounterMetricFamily if f.kind is Kind.COUNTER else GaugeMetricFamily
                if f.label is None:
                    family = make(name, f.help, value=value)
                else:
                    family = make(name, f.help, labels=[f.label])
                    for label, number in sorted(value.items()):
                        family.add_metric([label], number)
            yield family
