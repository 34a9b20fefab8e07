"""inference.model.fast_norms on real transformers models (the fused path's RMSNorm kernel; on a
machine without CUDA it runs under triton's interpreter, tests/conftest.py)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM

import inference.models  # noqa: F401  (registers kimi_k3 with transformers' auto classes)
from inference.model.fast_norms import fuse_rms_norms
from packtools.arch import tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# model type -> the norm classes that take the fused forward (the rest keep theirs: Qwen3-Next's
# norms scale by 1 + weight, so none of its agrees with the kernel)
FUSED = {
    "qwen3_next": set(),
    "qwen3_5_moe_text": set(),
    "kimi_linear": {"KimiLinearRMSNorm"},
    "kimi_k3": {"KimiLinearRMSNorm"},
    "granitemoehybrid": {"GraniteMoeHybridRMSNorm"},
    "nemotron_h": {"NemotronHRMSNorm"},
}


def _takes_gate(module: torch.nn.Module) -> bool:
    return "gate" in inspect.signature(type(module).forward).parameters


@pytest.mark.parametrize("model_type", sorted(FUSED))
def test_gated_norms_keep_their_forward_and_the_model_generates(model_type):
    """Linear-attention and Mamba layers call their gated RMSNorm as norm(x, gate); the fused
    forward takes x alone. Checking such a norm by calling it without a gate raised (Qwen3-Next's
    gate is required, Kimi's is dereferenced), and swapping one whose gate is optional broke
    the layer's call (`_fused_forward() takes 2 positional arguments but 3 were given`)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16).eval().to(DEVICE)
    gated = [m for m in model.modules() if "RMSNorm" in type(m).__name__ and _takes_gate(m)]
    assert gated, f"{model_type}: the tiny model has no gated norm to check"

    changed = fuse_rms_norms(model, torch.bfloat16)

    swapped = [m for m in model.modules() if "forward" in m.__dict__]
    assert changed == len(swapped)
    assert {type(m).__name__ for m in swapped} == FUSED[model_type]
    assert not any("forward" in m.__dict__ for m in gated)
    tokens = torch.randint(3, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model.generate(tokens.to(DEVICE), max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 11)
