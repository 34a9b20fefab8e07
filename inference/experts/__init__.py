"""Routed experts computed from raw expert objects: the "expertpack" transformers experts implementation."""

from inference.experts.binding import (
    bind_experts,
    experts_modules,
    register_experts_implementation,
    routed_parameter_names,
    select_expertpack,
)
from inference.experts.errors import (
    ExpertLayoutError,
    ExpertsError,
    ExpertSourceError,
    RoutingError,
    UnboundExpertsError,
)
from inference.experts.forward import IMPLEMENTATION_NAME, ExpertsBinding, expertpack_experts_forward
from inference.experts.plan import LayerPlan, build_layer_plan
from inference.experts.source import ExpertSource, LocalPackSource, uniform_layout

__all__ = [
    "IMPLEMENTATION_NAME", "ExpertSource", "LocalPackSource", "uniform_layout", "ExpertsBinding", "LayerPlan",
    "build_layer_plan", "bind_experts", "experts_modules", "register_experts_implementation",
    "routed_parameter_names", "select_expertpack", "expertpack_experts_forward", "ExpertsError",
    "ExpertLayoutError", "ExpertSourceError", "RoutingError", "UnboundExpertsError",
]
