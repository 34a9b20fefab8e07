"""storaged's figures: one field table, and the frozen snapshot of their values it describes.

`FIELDS` is the one list of what storaged counts. Each `StatField` names a Prometheus family
(without the `expertpack_storaged_` prefix), its kind, unit and help text, and the Stats reply
field it fills, if any. From it:

- `storaged.metrics.StoragedMetrics` keeps the values and renders a `StatsSnapshot` as the
  /metrics families;
- `storaged.server.stats` renders the same snapshot as the Stats reply: the reply fields the
  table names, and every series in the reply's `figures` map;
- `storaged.client` parses the reply back into a `StatsSnapshot` (from the map), so the client
  reads every figure, named ones as attributes (`stats.pins`, `stats.tiers["vram"].hits`).

A figure added to FIELDS therefore appears in /metrics, in the Stats reply's map and in the
client's snapshot, and the ops lint (tests/ops) knows its name; a reply field of its own is the
one further step (a proto field of the same name). Plain Python: no prometheus_client, no grpc.

Series keys (the reply's map, `StatsSnapshot.series()`): `name` for an unlabelled counter or
gauge, `name{label=value}` for a labelled one, `name_count` and `name_sum` for a histogram.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

PREFIX = "expertpack_storaged_"
TIERS = ("vram", "host")
ACQUIRE_PHASES = ("plan", "unmap", "issue", "join")  # the engine's steps of one Acquire, in order
# Object reads: a 4 KiB hit in a fast NVMe queue (~100 us) up to a 100 MiB object on a slow disk.
READ_SECONDS_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0)
# Acquire: an all-hit round trip (tens of us) up to a layer of misses from disk.
ACQUIRE_SECONDS_BUCKETS = (2e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2,
                           0.1, 0.25, 0.5, 1.0)


class Kind(enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class StatFieldError(ValueError):
    """A field table entry that breaks the naming rules, or a table that names a figure twice."""


@dataclass(frozen=True)
class StatField:
    """One figure. `reply`: the StatsResponse field it fills (a TierStats field when `label` is
    "tier"); for a histogram, the field of its count, and `reply_mean_us` the field of its mean in
    microseconds. `label_values`: the only values `label` takes (each series exists from the
    start, at zero); empty: any value, each series from its first record."""

    name: str
    kind: Kind
    unit: str  # "bytes", "seconds", or what is counted ("experts", "sessions", ...)
    help: str
    reply: str | None = None
    reply_mean_us: str | None = None
    label: str | None = None
    label_values: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        base = self.name.removesuffix("_total")
        if not self.name.isidentifier() or self.name != self.name.lower():
            raise StatFieldError(f"figure name {self.name!r}: lower-case letters, digits and _ only")
        if (self.kind is Kind.COUNTER) != self.name.endswith("_total"):
            raise StatFieldError(f"figure {self.name!r}: counters, and only counters, end in _total")
        if self.unit in ("bytes", "seconds") and not base.endswith("_" + self.unit):
            raise StatFieldError(f"figure {self.name!r}: a figure in {self.unit} carries _{self.unit} in its name")
        if (self.kind is Kind.HISTOGRAM) != bool(self.buckets):
            raise StatFieldError(f"figure {self.name!r}: histograms, and only histograms, have buckets")
        if list(self.buckets) != sorted(set(self.buckets)):
            raise StatFieldError(f"figure {self.name!r}: buckets must increase")
        if self.reply_mean_us is not None and self.kind is not Kind.HISTOGRAM:
            raise StatFieldError(f"figure {self.name!r}: only a histogram has a mean")
        if self.label_values and self.label is None:
            raise StatFieldError(f"figure {self.name!r}: label_values without a label")
        if self.label is not None and self.kind is Kind.HISTOGRAM:
            raise StatFieldError(f"figure {self.name!r}: labelled histograms are not supported")

    @property
    def integral(self) -> bool:
        """Whole numbers (counts, bytes), as opposed to seconds."""
        return self.unit != "seconds"


def _tier(name: str, kind: Kind, unit: str, help: str, reply: str) -> StatField:
    return StatField(name, kind, unit, help, reply=reply, label="tier", label_values=TIERS)


C, G, H = Kind.COUNTER, Kind.GAUGE, Kind.HISTOGRAM
FIELDS: tuple[StatField, ...] = (
    _tier("hits_total", C, "experts", "Acquired experts found resident, by tier", "hits"),
    _tier("misses_total", C, "experts", "Acquired experts not resident, by tier", "misses"),
    _tier("evictions_total", C, "experts", "Experts evicted, by tier", "evictions"),
    _tier("coalesced_total", C, "experts",
          "Misses that joined a load already in flight instead of reading again, by tier", "coalesced"),
    _tier("resident_experts", G, "experts", "Experts resident, by tier", "resident_experts"),
    _tier("resident_bytes", G, "bytes", "Bytes of resident experts, by tier", "resident_bytes"),
    _tier("capacity_slots", G, "slots", "Slots a tier holds in all, by tier", "capacity_slots"),
    StatField("read_bytes_total", C, "bytes", "Bytes read from packs (padded objects)", reply="bytes_read"),
    StatField("h2d_bytes_total", C, "bytes", "Bytes copied host to device", reply="h2d_bytes"),
    StatField("read_seconds", H, "seconds", "Latency of one object read from a pack", reply="reads",
              reply_mean_us="read_latency_mean_us", buckets=READ_SECONDS_BUCKETS),
    StatField("acquire_seconds", H, "seconds", "Latency of one Acquire, request to reply", reply="acquires",
              reply_mean_us="acquire_latency_mean_us", buckets=ACQUIRE_SECONDS_BUCKETS),
    StatField("acquire_phase_seconds_total", C, "seconds",
              "Seconds Acquires spent, by phase: plan (the cache policy), unmap (clearing victims' slot-map "
              "entries, starting their demotions), issue (until its own copies were issued), join (until "
              "loads of other requests it joined were complete)", label="phase", label_values=ACQUIRE_PHASES),
    StatField("io_errors_total", C, "reads", "Pack reads the OS failed", reply="io_errors"),
    StatField("checksum_failures_total", C, "objects", "Objects whose crc32 mismatched",
              reply="checksum_failures"),
    StatField("hits_verified_total", C, "experts", "Acquire hits re-checked against their crc32 (verify_hits)",
              reply="hits_verified"),
    StatField("hit_mismatches_total", C, "experts",
              "Verified hits whose bytes mismatched (reloaded from the pack, not served)", reply="hit_mismatches"),
    StatField("prefetch_issued_total", C, "experts", "Prefetch loads started", reply="prefetch_issued"),
    StatField("prefetch_used_total", C, "experts", "Prefetched experts later acquired", reply="prefetch_used"),
    StatField("prefetch_wasted_total", C, "experts", "Prefetched experts evicted without being acquired",
              reply="prefetch_wasted"),
    StatField("preload_loads_total", C, "experts",
              "Experts the preload read into the tiers at start (preload = true), failed loads included"),
    StatField("preloading", G, "preloads", "1 while the preload at start is filling the tiers, else 0"),
    StatField("sessions", G, "sessions", "Attached client sessions", reply="sessions"),
    StatField("sessions_idle_closed_total", C, "sessions",
              "Sessions closed after session_idle_seconds without an Acquire stream or data plane connection"),
    StatField("sessions_refused_total", C, "sessions",
              "Attach calls refused because the peer held max_sessions_per_peer sessions"),
    StatField("pins", G, "pins", "VRAM pins held by sessions; a slot pinned by two sessions counts twice",
              reply="pins"),
    StatField("capacity_exhausted_total", C, "requests", "Acquire requests refused with RESOURCE_EXHAUSTED",
              reply="capacity_exhausted"),
    StatField("loads_in_flight", G, "loads", "Loads (pack reads or host copies) in flight",
              reply="loads_in_flight"),
    StatField("demotions_total", C, "experts", "VRAM victims copied down to the host tier", reply="demotions"),
    StatField("d2h_bytes_total", C, "bytes", "Bytes copied device to host (demotions)", reply="d2h_bytes"),
    StatField("fence_waits_total", C, "reuses", "Slot reuses that waited for a session to finish a device step",
              reply="fence_waits"),
    StatField("fence_wait_seconds_total", C, "seconds", "Seconds slot reuses waited for sessions' device steps"),
    StatField("fence_revocations_total", C, "sessions",
              "Sessions whose step fence was revoked for staying mid-step too long", reply="fence_revocations"),
    StatField("dataplane_requests_total", C, "requests", "Data plane requests, by kind", label="kind"),
)
del C, G, H


def table() -> tuple[StatField, ...]:
    """The field table in force: FIELDS, read when called (so a test may extend it in one place)."""
    fields = FIELDS
    names = [f.name for f in fields]
    if len(names) != len(set(names)):
        twice = sorted({name for name in names if names.count(name) > 1})
        raise StatFieldError(f"the field table names a figure twice: {twice}")
    return fields


@dataclass(frozen=True)
class Histogram:
    """A histogram's figures. `buckets`: (upper bound, cumulative count), ending with +inf; empty
    in a snapshot read back from a Stats reply, which carries count and sum only."""

    count: int
    sum: float
    buckets: tuple[tuple[float, int], ...] = ()

    @property
    def mean(self) -> float:
        return self.sum / self.count if self.count else 0.0


Value = float | Mapping[str, float] | Histogram  # unlabelled; by label value; histogram


@dataclass(frozen=True)
class TierStats:
    """One tier's figures, the TierStats fields of the reply as attributes (`hits`, `misses`, ...)."""

    tier: str
    figures: Mapping[str, int]  # reply field -> value

    def __getattr__(self, name: str) -> int:
        try:
            return self.__dict__["figures"][name]
        except KeyError:
            raise AttributeError(f"tier {self.__dict__.get('tier')!r} has no figure {name!r}") from None


@dataclass(frozen=True)
class StatsSnapshot:
    """Every figure at one moment: `values` by field name; `tier_names` the cache tiers serving
    (in reply order: "vram", then "host" when that tier is on). Reply fields read as attributes."""

    values: Mapping[str, Value]
    tier_names: tuple[str, ...] = TIERS
    fields: tuple[StatField, ...] = field(default_factory=table)

    def __getitem__(self, name: str) -> Value:
        try:
            return self.values[name]
        except KeyError:
            raise KeyError(f"no figure {name!r} in this snapshot") from None

    def __getattr__(self, name: str) -> int | float:
        if name.startswith("_") or name in ("values", "fields", "tier_names"):
            raise AttributeError(name)
        try:
            return self.reply_fields()[name]
        except KeyError:
            raise AttributeError(f"the Stats snapshot has no figure {name!r}") from None

    @property
    def tiers(self) -> dict[str, TierStats]:
        return {tier: TierStats(tier, self.tier_fields(tier)) for tier in self.tier_names}

    def reply_fields(self) -> dict[str, int | float]:
        """The unlabelled figures by the Stats reply field they fill."""
        out: dict[str, int | float] = {}
        for f in self.fields:
            if f.label is not None or f.name not in self.values:
                continue
            value = self.values[f.name]
            if isinstance(value, Histogram):
                if f.reply is not None:
                    out[f.reply] = value.count
                if f.reply_mean_us is not None:
                    out[f.reply_mean_us] = value.mean * 1e6
            elif f.reply is not None:
                out[f.reply] = _number(f, value)
        return out

    def tier_fields(self, tier: str) -> dict[str, int]:
        """One tier's figures by the TierStats reply field they fill."""
        return {f.reply: _number(f, self.values[f.name].get(tier, 0)) for f in self.fields
                if f.label == "tier" and f.reply is not None and f.name in self.values}

    def series(self) -> dict[str, float]:
        """Every series as a plain number, keyed as in the module docstring."""
        out: dict[str, float] = {}
        for f in self.fields:
            if f.name not in self.values:
                continue
            value = self.values[f.name]
            if isinstance(value, Histogram):
                out[f.name + "_count"], out[f.name + "_sum"] = float(value.count), float(value.sum)
            elif isinstance(value, Mapping):
                out.update({f"{f.name}{{{f.label}={v}}}": float(x) for v, x in sorted(value.items())})
            else:
                out[f.name] = float(value)
        return out

    @classmethod
    def from_series(cls, series: Mapping[str, float], tier_names: tuple[str, ...],
                    fields: tuple[StatField, ...] | None = None) -> StatsSnapshot:
        """The snapshot `series()` came from (histogram buckets aside); figures the series lack
        are left out, series no field names are ignored."""
        fields = table() if fields is None else fields
        values: dict[str, Value] = {}
        for f in fields:
            if f.kind is Kind.HISTOGRAM:
                if f.name + "_count" in series:
                    values[f.name] = Histogram(int(series[f.name + "_count"]), series.get(f.name + "_sum", 0.0))
            elif f.label is not None:
                start = f"{f.name}{{{f.label}="
                labelled = {key[len(start):-1]: _number(f, value) for key, value in series.items()
                            if key.startswith(start) and key.endswith("}")}
                if labelled or f.label_values:
                    values[f.name] = labelled
            elif f.name in series:
                values[f.name] = _number(f, series[f.name])
        return cls(values, tuple(tier_names), fields)


def _number(f: StatField, value: float) -> int | float:
    return int(value) if f.integral else float(value)
