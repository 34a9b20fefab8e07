"""The fully resident transformers model a GGUFSource describes: the exactness reference.

Dense tensors as the source maps them, routed experts dequantized from their role bytes with
gguf-py and assembled back into transformers' fused expert parameters. What runs here is what
an expert pack built from the same source must reproduce.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from packformat.constants import tensor_nbytes
from packtools.gguf.expert_map import hf_expert_params
from packtools.gguf.source import GGUFSource
from packtools.quants import dequantize
from packtools.sources.base import RoleSlice


def dequantize_role(role: RoleSlice) -> torch.Tensor:
    """One role's bytes as float32 of its logical shape."""
    row_bytes = tensor_nbytes(role.element_type, (role.shape[-1],))
    raw = np.frombuffer(role.read(), dtype=np.uint8).reshape(*role.shape[:-1], row_bytes)
    return torch.from_numpy(dequantize(raw, role.element_type).copy())


def load_reference_model(source: GGUFSource, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    config = source.hf_config()
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**config), dtype=dtype)
    state = {tensor.name: tensor.load().to(dtype) for tensor in source.dense_tensors()}
    for layer in source.moe_layers():
        per_expert = [source.expert_roles(layer, expert) for expert in range(source.num_experts())]
        stacked = {
            slices[0].role: torch.stack([dequantize_role(s) for s in slices])  # [E, *role shape]
            for slices in zip(*per_expert)
        }
        for name, value in hf_expert_params(config["model_type"], stacked).items():
            state[f"model.layers.{layer}.mlp.experts.{name}"] = value.to(dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    if unexpected or set(missing) - tied:
        raise RuntimeError(f"reference model: missing {sorted(set(missing) - tied)}, unexpected {sorted(unexpected)}")
    return model.eval()
