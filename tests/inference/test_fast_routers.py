"""inference.model.fast_routers on real transformers models: which routers take the fused
forward (those whose selection the kernels reproduce), and that a swapped router selects as its
own forward did (on a machine without CUDA under triton's interpreter, tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from inference.model.fast_routers import fuse_routers
from packtools.arch import tiny_config

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# model type -> the router class that takes the fused forward, or None: DeepSeek's and GLM's
# sigmoid scores with bias-corrected group selection, Kimi's and Nemotron's likewise, and
# Granite's float32 logits keep their forward
FUSED = {
    "qwen3_moe": "Qwen3MoeTopKRouter",
    "qwen2_moe": "Qwen2MoeTopKRouter",
    "mixtral": "MixtralTopKRouter",  # float32 scores, always renormalized
    "olmoe": "OlmoeTopKRouter",
    "gpt_oss": "GptOssTopKRouter",  # a logit bias; softmax over the top-k logits
    "qwen3_next": "Qwen3NextTopKRouter",
    "deepseek_v3": None,
    "glm4_moe": None,
    "kimi_linear": None,
    "granitemoehybrid": None,
}


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return [m for m in model.modules() if type(m).__name__.endswith("Router")]


@pytest.mark.parametrize("model_type", sorted(FUSED))
def test_which_routers_take_the_fused_forward(model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16).eval().to(DEVICE)
    changed = fuse_routers(model, torch.bfloat16)
    swapped = {type(m).__name__ for m in model.modules() if "forward" in m.__dict__}
    expected = FUSED[model_type]
    assert swapped == ({expected} if expected else set())
    assert changed == (len([m for m in model.modules() if type(m).__name__ == expected]) if expected else 0)


@pytest.mark.parametrize("model_type", [t for t, cls in sorted(FUSED.items()) if cls])
def test_a_swapped_router_selects_as_its_own_forward(model_type):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16).eval().to(DEVICE)
    router = _routers(model)[0]
    hidden = router.weight.shape[1]
    rows = torch.randn(16, hidden, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.bfloat16)
    with torch.no_grad():
        expected = [router(row.view(1, hidden)) for row in rows]  # as the MoE blocks call them
        many = router(rows)  # several rows: the module's own forward, unchanged
        assert fuse_routers(model, torch.bfloat16) > 0 and "forward" in router.__dict__
        got = [router(row.view(1, hidden)) for row in rows]
        assert all(torch.equal(a, b) for a, b in zip(many, router(rows)))
    for (logits, scores, ids), (fused_logits, fused_scores, fused_ids) in zip(expected, got):
        assert fused_scores.dtype == scores.dtype and fused_logits.dtype == logits.dtype
        order, fused_order = ids.reshape(-1).argsort(), fused_ids.reshape(-1).argsort()
        # the same experts (random logits of these seeds have no ties), scores to an ulp
        assert torch.equal(ids.reshape(-1)[order].to(torch.int64), fused_ids.reshape(-1)[fused_order])
        want, have = scores.reshape(-1)[order].float(), fused_scores.reshape(-1)[fused_order].float()
        assert ((have - want).abs() <= want.abs() * 2 ** -7).all()


def test_a_router_computing_otherwise_keeps_its_forward():
    """A router whose logits are scaled after the linear layer (so not what the fused GEMV
    computes) fails the check though its selection formula is the softmax top-k."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16).eval().to(DEVICE)
    router_class = type(_routers(model)[0])

    class ScaledRouter(router_class):
        def forward(self, hidden_states):
            logits, scores, ids = super().forward(hidden_states)
            return logits * 2, scores, ids

    for router in _routers(model):
        router.__class__ = ScaledRouter
    assert fuse_routers(model, torch.bfloat16) == 0
