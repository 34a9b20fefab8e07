"""Routed experts computed from raw expert objects: the "expertpack" transformers experts implementation."""

from inference.experts.binding import (
    COMPUTE_MODES,
    attach_lookahead,
    bind_experts,
    resolve_compute,
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
from inference.experts.forward import IMPLEMENTATION_NAME, DeviceLookup, ExpertsBinding, expertpack_experts_forward
from inference.experts.plan import LayerPlan, build_layer_plan
from inference.experts.source import ExpertSource, LocalPackSource, SlotRows, acquire_rows, uniform_layout

__all__ = [
    "IMPLEMENTATION_NAME", "COMPUTE_MODES", "ExpertSource", "LocalPackSource", "SlotRows", "acquire_rows",
    "uniform_layout", "ExpertsBinding", "DeviceLookup", "LayerPlan", "resolve_compute", "attach_lookahead",
    "build_layer_plan", "bind_experts", "experts_modules", "register_experts_implementation",
    "routed_parameter_names", "select_expertpack", "expertpack_experts_forward", "ExpertsError",
    "ExpertLayoutError", "ExpertSourceError", "RoutingError", "UnboundExpertsError",
]
