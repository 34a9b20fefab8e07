"""Decayed access frequency with O(1) updates, kept in the log domain.

An entry's score at logical time `now` is  sum_i 2^(-(now - t_i) / H)  over its access times
t_i: every access counts 1 when it happens and half as much every H accesses later, so the
score mixes frequency (many accesses) and recency (recent accesses weigh more).

Decaying every entry on every tick would be O(entries). Instead each entry stores
    log_score = log2( sum_i 2^(t_i / H) )
which never changes unless the entry itself is accessed, and ranks entries exactly like their
decayed scores do at any common `now` (the decay factor 2^(-now/H) is shared). The raw sum
would overflow a float after ~1000 half-lives; its log grows like (now - origin)/H, and the
owner rebases (subtracts a common shift from every log_score, which keeps their order) every
REBASE_AFTER_HALF_LIVES half-lives so that float precision never degrades with uptime.
"""

from __future__ import annotations

import math

NEVER_ACCESSED = -math.inf  # log_score of an entry with no accesses (decayed score 0)
# 2^16 keeps log scores below ~2^17, where a float still resolves ~1e-11; a rebase is O(entries)
# once per 65536 * half_life accesses.
REBASE_AFTER_HALF_LIVES = 2**16


def log2_add(log_a: float, log_b: float) -> float:
    """log2(2^a + 2^b) without overflow."""
    if log_a == NEVER_ACCESSED:
        return log_b
    if log_b == NEVER_ACCESSED:
        return log_a
    high, low = (log_a, log_b) if log_a >= log_b else (log_b, log_a)
    # 2.0 ** (very negative) underflows to 0.0 without raising, which is the right limit.
    return high + math.log2(1.0 + 2.0 ** (low - high))


class DecayClock:
    """Logical clock of one tier: one tick per access, frequency halves every `half_life` ticks.

    Log scores are measured from `origin` (a past tick), not from tick 0.
    """

    __slots__ = ("half_life", "now", "origin")

    def __init__(self, half_life: int):
        if half_life <= 0:
            raise ValueError(f"half_life must be a positive number of accesses, got {half_life}")
        self.half_life = half_life
        self.now = 0
        self.origin = 0

    def record_access(self, log_score: float) -> tuple[float, int]:
        """Advance the clock by one access; returns (the entry's new log_score, access tick)."""
        self.now += 1
        level = (self.now - self.origin) / self.half_life
        if log_score == NEVER_ACCESSED:
            return level, self.now
        # log2_add inlined: this runs once per expert on the hit path.
        if log_score >= level:
            return log_score + math.log2(1.0 + 2.0 ** (level - log_score)), self.now
        return level + math.log2(1.0 + 2.0 ** (log_score - level)), self.now

    def decayed(self, log_score: float) -> float:
        """The entry's score at the current tick, in accesses (1.0 = one access just now)."""
        if log_score == NEVER_ACCESSED:
            return 0.0
        return 2.0 ** (log_score - (self.now - self.origin) / self.half_life)

    def log_level(self, decayed_score: float) -> float:
        """The log_score whose decayed score is exactly `decayed_score` at the current tick."""
        if decayed_score <= 0.0:
            return NEVER_ACCESSED
        return (self.now - self.origin) / self.half_life + math.log2(decayed_score)

    @property
    def needs_rebase(self) -> bool:
        return self.now - self.origin >= REBASE_AFTER_HALF_LIVES * self.half_life

    def rebase(self) -> float:
        """Move the origin to now; returns the shift every log_score must be reduced by."""
        shift = (self.now - self.origin) / self.half_life
        self.origin = self.now
        return shift
