"""Architecture registry: what packtools knows about each supported MoE model_type."""

from packtools.arch.record import Architecture
from packtools.arch.registry import (
    ARCHITECTURES,
    UnknownArchitectureError,
    config_from_dict,
    get_arch,
    get_architecture,
    tiny_config,
)
from packtools.arch.spec import ArchSpec, ExpertKey, FusedPart

__all__ = [
    "ARCHITECTURES",
    "ArchSpec",
    "Architecture",
    "ExpertKey",
    "FusedPart",
    "UnknownArchitectureError",
    "config_from_dict",
    "get_arch",
    "get_architecture",
    "tiny_config",
]
