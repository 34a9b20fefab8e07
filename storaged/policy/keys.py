"""Identity of a cached object and the per-model shape the planner validates requests against."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class ExpertKey(NamedTuple):
    """One (model, layer, expert) object of a pack: the unit of caching.

    A NamedTuple rather than a dataclass: it is hashed on every lookup of the hot path and
    tuple hashing is done in C.
    """

    model: int
    layer: int  # the model's layer index (as in the pack's layer table), not a MoE ordinal
    expert: int

    def __str__(self) -> str:
        return f"(model {self.model}, layer {self.layer}, expert {self.expert})"


@dataclass(frozen=True)
class ModelLayout:
    """What the planner needs to know about one served model to validate requests.

    `moe_layers` are the model layer indices that have routed experts (dense layers such as
    DeepSeek's first_k_dense ones are absent); every MoE layer has `experts_per_layer` experts.
    `max_experts_per_acquire` bounds one Acquire (default: every expert of a layer).
    """

    moe_layers: frozenset[int]
    experts_per_layer: int
    max_experts_per_acquire: int | None = None

    def __post_init__(self) -> None:
        if self.experts_per_layer <= 0:
            raise ValueError(f"experts_per_layer must be positive, got {self.experts_per_layer}")
        if any(layer < 0 for layer in self.moe_layers):
            raise ValueError(f"negative layer index in {sorted(self.moe_layers)}")
        if self.max_experts_per_acquire is not None and self.max_experts_per_acquire <= 0:
            raise ValueError(
                f"max_experts_per_acquire must be positive, got {self.max_experts_per_acquire}"
            )

    @classmethod
    def contiguous(cls, layer_count: int, experts_per_layer: int,
                   max_experts_per_acquire: int | None = None) -> ModelLayout:
        """Layout whose layers 0..layer_count-1 are all MoE layers."""
        return cls(frozenset(range(layer_count)), experts_per_layer, max_experts_per_acquire)

    @property
    def acquire_limit(self) -> int:
        limit = self.max_experts_per_acquire
        return self.experts_per_layer if limit is None else min(limit, self.experts_per_layer)
