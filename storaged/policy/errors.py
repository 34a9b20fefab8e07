"""Typed errors of the cache policy. Each names the model, layer, expert or key that is wrong.

The gRPC layer maps them to status codes: `InvalidRequest` → INVALID_ARGUMENT,
`CapacityExhausted` → RESOURCE_EXHAUSTED, `PolicyStateError` → FAILED_PRECONDITION /
INTERNAL (it means the caller broke the reserve → complete/abort protocol).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from storaged.policy.keys import ExpertKey


class PolicyError(Exception):
    """Base of every error raised by the cache policy."""


class InvalidRequest(PolicyError):
    """The client asked for something that does not exist or is malformed."""


class UnknownModel(InvalidRequest):
    def __init__(self, model: int, served: list[int]):
        super().__init__(f"model {model} is not served (served models: {sorted(served)})")
        self.model = model


class InvalidLayer(InvalidRequest):
    def __init__(self, model: int, layer: int, layer_count: int):
        super().__init__(
            f"model {model}: layer {layer} has no routed experts "
            f"(the pack holds {layer_count} MoE layers)"
        )
        self.model = model
        self.layer = layer


class InvalidExpert(InvalidRequest):
    def __init__(self, model: int, layer: int, expert: int, expert_count: int):
        super().__init__(
            f"model {model} layer {layer}: expert {expert} out of range [0, {expert_count})"
        )
        self.model = model
        self.layer = layer
        self.expert = expert


class DuplicateExpert(InvalidRequest):
    def __init__(self, model: int, layer: int, expert: int):
        super().__init__(f"model {model} layer {layer}: expert {expert} requested twice")
        self.model = model
        self.layer = layer
        self.expert = expert


class TooManyExperts(InvalidRequest):
    def __init__(self, model: int, layer: int, count: int, limit: int):
        super().__init__(
            f"model {model} layer {layer}: {count} experts requested, at most {limit} per call"
        )
        self.model = model
        self.layer = layer
        self.count = count
        self.limit = limit


class CapacityExhausted(PolicyError):
    """Not enough free or evictable slots: everything else is pinned or still loading."""

    def __init__(self, tier: str, needed: int, available: int, detail: str = ""):
        suffix = f" ({detail})" if detail else ""
        super().__init__(
            f"{tier} tier: {needed} slot(s) needed but only {available} free or evictable; "
            f"the rest are pinned or loading{suffix}"
        )
        self.tier = tier
        self.needed = needed
        self.available = available


class PolicyStateError(PolicyError):
    """The caller broke the entry protocol (complete of a READY key, unpin below zero...)."""

    def __init__(self, tier: str, key: ExpertKey, message: str):
        super().__init__(f"{tier} tier: {key}: {message}")
        self.tier = tier
        self.key = key
