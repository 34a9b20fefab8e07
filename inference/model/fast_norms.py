"""Swap transformers' RMSNorm modules for one fused kernel each, where it computes the same thing.

A module qualifies when it looks like an RMSNorm (a 1-D `weight`, a `variance_epsilon`, and a
forward of the hidden states alone: the gated norms of linear-attention and Mamba layers are called
as norm(x, gate) and keep their forward) and, checked on random rows in the model's dtype, the
kernel's output is within one unit in the last place of the module's own (the sum of squares is
reduced in another order, and the reciprocal square root of triton and of torch may differ by an
ulp before rounding): norms with another formula (Gemma's 1 + weight, a float32 output cast) fail
the check and keep their forward.
Only for the fused (GPU) path: the exact path keeps eager's kernels.
"""

from __future__ import annotations

import inspect
import types

import torch

from inference.kernels.ops import ROUNDING, triton_module


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    from inference.kernels import rmsnorm

    shape = hidden_states.shape
    x = hidden_states.reshape(-1, shape[-1])
    if x.stride(-1) != 1:
        x = x.contiguous()
    out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    block = 1 << (shape[-1] - 1).bit_length()
    rmsnorm.rms_norm_kernel[(x.shape[0],)](
        x, x.stride(0), self.weight, out, out.stride(0), shape[-1], float(self.variance_epsilon),
        BLOCK=block, XR=ROUNDING[hidden_states.dtype], WR=ROUNDING[out_dtype], num_warps=4 if block <= 2048 else 8)
    return out.view(shape)


def _takes_hidden_states_only(module: torch.nn.Module) -> bool:
    """Whether the module's forward has exactly one parameter, the one `_fused_forward` fills."""
    parameters = list(inspect.signature(module.forward).parameters.values())
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                            inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _agrees(module: torch.nn.Module, dtype: torch.dtype) -> bool:
    hidden = module.weight.shape[0]
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(0)).to(module.weight.device, dtype) * 3
    with torch.no_grad():
        expected = module.forward(x)
        got = _fused_forward(module, x)
    if got.dtype != expected.dtype or got.shape != expected.shape:
        return False
    scale = expected.float().abs().clamp(min=1e-30)
    ulp = scale * (2.0 ** -7 if expected.dtype == torch.bfloat16 else 2.0 ** -10 if expected.dtype == torch.float16
                   else 2.0 ** -22)
    return bool(((got.float() - expected.float()).abs() <= ulp).all())


def fuse_rms_norms(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every qualifying RMSNorm module the fused forward; returns how many changed."""
    if triton_module() is None or dtype not in ROUNDING:
        return 0
    changed = 0
    checked: dict[type, bool] = {}
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if not (isinstance(weight, torch.Tensor) and weight.dim() == 1 and hasattr(module, "variance_epsilon")
                and "RMSNorm" in type(module).__name__ and weight.device.type != "meta"
                and _takes_hidden_states_only(module)):
            continue
        kind = (type(module), weight.dtype)
        if kind not in checked:
            checked[kind] = _agrees(module, dtype)
        if checked[kind]:
            module.forward = types.MethodType(_fused_forward, module)
            changed += 1
    return changed
