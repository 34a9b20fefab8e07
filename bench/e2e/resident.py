"""The fully resident contender: every routed expert dequantized once into transformers' own expert
parameters on the device, computed by transformers' own experts forward (grouped_mm where the
installed transformers has it, else its eager loop).

The experts are dequantized on the device, a chunk of experts at a time, by the same bit-exact
kernels the expertpack forward uses (inference.dequant matches gguf-py bit for bit), so the
weights equal those packtools.gguf.reference.load_reference_model builds on the CPU, without
holding the whole dequantized model in host RAM (that would not fit the contenders' RAM limit,
nor finish in the benchmark's time at full size).
"""

from __future__ import annotations

import torch

from inference.experts import LocalPackSource
from inference.experts.binding import experts_modules
from inference.experts.forward import BINDING_ATTRIBUTE
from inference.model import LoadedModel, load_model

CHUNK_EXPERTS = 16  # experts dequantized at once: bounds the float32 intermediates on the device
PREFERRED_IMPLEMENTATIONS = ("grouped_mm", "eager")


class ResidentLayoutError(ValueError):
    """The bundle's expert layout is one the resident loader does not assemble (names the layer)."""


def _layer_weights(binding, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up_proj [E, 2I, H], down_proj [E, H, I]) of one out_in, bias-free, concat layer."""
    plan = binding.plan
    if plan.orientation != "out_in" or any(p is not None and p.bias is not None
                                           for p in (plan.fused_up, plan.gate, plan.up, plan.down)):
        raise ResidentLayoutError(f"layer {binding.layer}: the resident loader assembles out_in experts "
                                  f"without biases, not orientation {plan.orientation!r} with biases")
    gate_up_chunks, down_chunks = [], []
    for first in range(0, num_experts, CHUNK_EXPERTS):
        ids = list(range(first, min(first + CHUNK_EXPERTS, num_experts)))
        weights = plan.materialize(binding.source.acquire(binding.layer, ids))  # name -> [n, out, in]
        if plan.fused_up is not None:
            if plan.fused_output_layout != "concat":
                raise ResidentLayoutError(f"layer {binding.layer}: fused gate_up layout "
                                          f"{plan.fused_output_layout!r} is not concat")
            gate_up = weights[plan.fused_up.weight.name]  # [n, 2I, H], gate rows first
        else:
            gate_up = torch.cat([weights[plan.gate.weight.name], weights[plan.up.weight.name]], dim=1)
        gate_up_chunks.append(gate_up)
        down_chunks.append(weights[plan.down.weight.name])  # [n, H, I]
    return torch.cat(gate_up_chunks), torch.cat(down_chunks)


def load_resident(bundle_dir, *, device: torch.device, dtype: torch.dtype) -> tuple[LoadedModel, str]:
    """The bundle's model with every expert resident on `device`; returns it and the experts
    implementation transformers computes them with."""
    loaded = load_model(bundle_dir, device=device, dtype=dtype, expert_source=LocalPackSource, experts_compute="exact")
    num_experts = int(loaded.bundle.experts["num_experts"])
    for _, (_, module) in experts_modules(loaded.model).items():
        binding = getattr(module, BINDING_ATTRIBUTE)
        gate_up, down = _layer_weights(binding, num_experts)
        assert gate_up.shape == module.gate_up_proj.shape and down.shape == module.down_proj.shape, (
            tuple(gate_up.shape), tuple(module.gate_up_proj.shape))
        module.gate_up_proj = torch.nn.Parameter(gate_up.to(dtype), requires_grad=False)
        module.down_proj = torch.nn.Parameter(down.to(dtype), requires_grad=False)
        delattr(module, BINDING_ATTRIBUTE)
    errors = []
    for implementation in PREFERRED_IMPLEMENTATIONS:
        try:
            loaded.model.set_experts_implementation(implementation)
            return loaded, implementation
        except (ValueError, ImportError, RuntimeError) as exc:
            errors.append(f"{implementation}: {exc}")
    raise RuntimeError(f"no built-in experts implementation could be selected: {errors}")
