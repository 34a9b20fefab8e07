"""Kimi-K3 text model for transformers, registered as model_type "kimi_k3" on import.

Registers KimiK3Config with AutoConfig, KimiK3Model with AutoModel, KimiK3ForCausalLM with
AutoModelForCausalLM, and the official checkpoint's naming rules with transformers' conversion
mapping (checkpoint_kimi_k3). Registration is idempotent, so importing twice is harmless.
"""

from __future__ import annotations

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM
from transformers.conversion_mapping import get_checkpoint_conversion_mapping, register_checkpoint_conversion_mapping

from inference.models.kimi_k3.checkpoint_kimi_k3 import (
    CHECKPOINT_PREFIX,
    checkpoint_conversion_mapping,
    official_config_dict,
)
from inference.models.kimi_k3.configuration_kimi_k3 import KimiK3Config
from inference.models.kimi_k3.modeling_kimi_k3 import KimiK3ForCausalLM, KimiK3Model, KimiK3PreTrainedModel

MODEL_TYPE = KimiK3Config.model_type


def register() -> None:
    """Make "kimi_k3" known to the Auto classes and to transformers' checkpoint conversion."""
    AutoConfig.register(MODEL_TYPE, KimiK3Config, exist_ok=True)
    AutoModel.register(KimiK3Config, KimiK3Model, exist_ok=True)
    AutoModelForCausalLM.register(KimiK3Config, KimiK3ForCausalLM, exist_ok=True)
    if get_checkpoint_conversion_mapping(MODEL_TYPE) is None:
        register_checkpoint_conversion_mapping(MODEL_TYPE, checkpoint_conversion_mapping())


register()

__all__ = [
    "CHECKPOINT_PREFIX",
    "KimiK3Config",
    "KimiK3ForCausalLM",
    "KimiK3Model",
    "KimiK3PreTrainedModel",
    "official_config_dict",
    "register",
]
