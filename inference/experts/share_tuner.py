"""How large a share of the host-tier experts the CPU takes: tuned on the decode steps' own times.

The best share depends on the host's cores, on how fast the link reads the rest, on how much the
two slow each other down (both read the same memory: 16 CPU threads beside the link's reads cut
it to a tenth on the H200 host, docs/benchmarks.md) and on the model's experts; a fixed default is
right for one machine and model at best. So the share moves one level at a time while decoding
and stays where a step is fastest:

    measure the median step time at the current level (a window of steps); probe the next level
    up for a window; keep it while each move is faster by more than `margin`, else probe down
    the same way; when neither way is faster, settle, and probe again after `settle` windows.

Medians, not means: a step redone on the acquire path (an absent expert) takes ten times as long
and says nothing about the share. Plain Python (no torch), so the policy is tested alone.
"""

from __future__ import annotations

import dataclasses
import statistics

MEASURE, PROBE_UP, PROBE_DOWN, SETTLED = "measure", "probe up", "probe down", "settled"


@dataclasses.dataclass
class ShareTuner:
    level: int  # the share now: level / levels of each layer's host-tier experts
    levels: int = 16
    window: int = 16  # steps a measurement takes
    margin: float = 0.01  # a move must make the median step this much faster
    settle: int = 32  # windows at a settled level before probing again
    state: str = MEASURE
    moves: int = 0  # levels moved in this round of probes (0: the base is where the round began)
    base: float | None = None  # median seconds a step at the kept level
    base_level: int | None = None
    _times: list[float] = dataclasses.field(default_factory=list)
    _settled_windows: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.levels <= 64:
            raise ValueError(f"share tuner levels {self.levels}: expected 1..64")
        if not 0 <= self.level <= self.levels:
            raise ValueError(f"share tuner level {self.level}: expected 0..{self.levels}")
        if self.window < 1 or self.settle < 1 or not 0 <= self.margin < 1:
            raise ValueError(f"share tuner window {self.window}, settle {self.settle}, margin {self.margin}")

    @classmethod
    def starting_at(cls, share: float, **kwargs) -> ShareTuner:
        levels = kwargs.get("levels", 16)
        return cls(level=min(levels, max(0, round(share * levels))), **kwargs)

    @property
    def share(self) -> float:
        return self.level / self.levels

    def observe(self, seconds: float) -> int | None:
        """One decode step's seconds at the current level; the new level when it changes."""
        self._times.append(seconds)
        if len(self._times) < self.window:
            return None
        median = statistics.median(self._times)
        self._times.clear()
        if self.state == SETTLED:
            self._settled_windows += 1
            if self._settled_windows < self.settle:
                return None
            self.state = MEASURE  # conditions may have changed (context length, another request)
        if self.state == MEASURE:
            self.base, self.base_level, self.moves = median, self.level, 0
            if self._probe(PROBE_UP) or self._probe(PROBE_DOWN):
                return self.level
            return self._settle()
        if median < self.base * (1 - self.margin):  # faster: keep the probed level, go on the same way
            self.base, self.base_level, self.moves = median, self.level, self.moves + 1
            return self.level if self._probe(self.state) else self._settle()
        self.level = self.base_level  # not faster: back to the kept level
        if self.state == PROBE_UP and self.moves == 0 and self._probe(PROBE_DOWN):
            return self.level
        self._settle()
        return self.level

    def _probe(self, direction: str) -> bool:
        level = self.level + (1 if direction == PROBE_UP else -1)
        if not 0 <= level <= self.levels:
            return False
        self.state, self.level = direction, level
        return True

    def _settle(self) -> None:
        self.state, self._settled_windows = SETTLED, 0
        return None
