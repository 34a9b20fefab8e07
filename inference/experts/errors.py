"""Typed errors of the expertpack experts implementation."""

from __future__ import annotations


class ExpertsError(Exception):
    """Base class for everything the experts implementation refuses."""


class ExpertLayoutError(ExpertsError):
    """A layer's role entries do not fit the transformers experts module they must feed.

    Raised at load time, naming the layer and the role, so that a bundle built for another
    configuration is caught before the first forward.
    """

    def __init__(self, layer: int, message: str):
        self.layer = layer
        super().__init__(f"layer {layer}: {message}")


class ExpertSourceError(ExpertsError):
    """The expert source handed back something other than what was asked for."""

    def __init__(self, layer: int, message: str):
        self.layer = layer
        super().__init__(f"layer {layer}: {message}")


class RoutingError(ExpertsError):
    """The router selected an expert id outside [0, num_experts)."""

    def __init__(self, layer: int, expert: int, num_experts: int):
        self.layer = layer
        self.expert = expert
        super().__init__(f"layer {layer}: router selected expert {expert}, the layer has {num_experts} "
                         "(expert-parallel sentinels are not supported)")


class UnboundExpertsError(ExpertsError):
    """An experts module ran with the expertpack implementation but was never bound to a source."""

    def __init__(self, module_class: str):
        super().__init__(f"{module_class} runs with experts_implementation='expertpack' but has no expert "
                         "source bound; load the model with inference.model.load_model")
