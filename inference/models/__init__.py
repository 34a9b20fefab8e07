"""Model implementations transformers lacks, registered with its Auto classes on import.

packtools builds models on the meta device to name dense tensors, and inference builds them from a
bundle's config.json; both go through AutoConfig/AutoModelForCausalLM, so importing this package
is what makes these model types loadable. packtools.arch.registry imports it.
"""

from __future__ import annotations

from inference.models import kimi_k3

# model_type -> the config.json layout of the official checkpoint, for architectures whose
# repository wraps the text model (synthetic checkpoints are written the same way)
OFFICIAL_CONFIG_LAYOUTS = {kimi_k3.MODEL_TYPE: kimi_k3.official_config_dict}

__all__ = ["OFFICIAL_CONFIG_LAYOUTS", "kimi_k3"]
