"""Typed errors of the cache policy. Each names the model, layer, expert or key that is wrong.

The gRPC layer maps them to status codes: `InvalidExpertRequest` → INVALID_ARGUMENT,
`SlotsExhausted` → RESOURCE_EXHAUSTED, `PolicyStateError` → FAILED_PRECONDITION /
INTERNAL (it means the caller broke the reserve → complete/abort protocol). What a client
then catches are storaged.client's InvalidRequest and CapacityExhausted; the policy's classes
are named apart from those so that code and tests seeing both never meet two classes of one name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from storaged.policy.keys import ExpertKey


class PolicyError(Exception):
    """Base of every error raised by the cache policy."""


class InvalidExpertRequest(PolicyError):
    """The client asked for something that does not exist or is malformed."""


class UnknownModel(InvalidExpertRequest):
    def __init__(self, model: int, served: list[int]):
        super().__init__(f"model {model} is not served (served models: {sorted(served)})")
        self.model = model


class InvalidLayer(InvalidExpertRequest):
    def __init__(self, model: int, layer: int, layer_count: int):
        super().__init__(
            f"model {model}: layer {layer} has no routed experts "
            f"(the pack holds {layer_count} MoE layers)"
        )
        self.model = model
        self.layer = layer


class InvalidExpert(InvalidExpertRequest):
    def __init__(self, model: int, layer: int, expert: int, expert_count: int):
        super().__init__(
            f"model {model} layer {layer}: expert {expert} out of range [0, {expert_count})"
        )
        self.model = model
        self.layer = layer
        self.expert = expert


class DuplicateExpert(InvalidExpertRequest):
    def __init__(self, model: int, layer: int, expert: int):
        super().__init__(f"model {model} layer {layer}: expert {expert} requested twice")
        self.model = model
        self.layer = layer
        self.expert = expert


class TooManyExperts(InvalidExpertRequest):
    def __init__(self, model: int, layer: int, count: int, limit: int):
        super().__init__(
            f"model {model} layer {layer}: {count} experts requested, at most {limit} per call"
        )
        self.model = model
        self.layer = layer
        self.count = count
        self.limit = limit


class SlotsExhausted(PolicyError):
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
