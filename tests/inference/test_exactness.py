"""The project's bar: a bundle run through load_model equals the same weights fully resident in
plain transformers — 32 greedy tokens identical, logits within a small relative error.

Bundles here come from the test factory (test_model_fixtures: PackWriter fed from a live model's
expert parameters), in float and quantized element types and in every layout the experts
implementation supports. Bundles built by `packtools build` are in test_exactness_packtools.py.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from arch_fake import register_fake_architecture
from test_model_fixtures import GGUF_GPT_OSS_ROLES, PackLayout, compare, default_layout, make_case
from transformers import AutoModelForCausalLM

from inference.experts import LocalPackSource
from inference.model import load_model
from packformat import ElementType, Role
from packtools.arch import ARCHITECTURES


def exactness_archs() -> list[str]:
    """Every registered architecture."""
    return sorted(ARCHITECTURES)


ARCHS = exactness_archs()
F32_RELATIVE_TOLERANCE = 1e-4
pytestmark = pytest.mark.usefixtures("one_thread")


def run_case(arch: str, tmp_path, layout: PackLayout | None = None, label: str = "", **model_kwargs) -> float:
    reference, bundle_dir = make_case(arch, tmp_path / "bundle", layout, **model_kwargs)
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        return compare(reference, loaded.model, label or arch)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("expert_type", [ElementType.F32, ElementType.BF16], ids=["F32", "BF16"])
def test_float_experts_match_resident_transformers(arch, expert_type, tmp_path):
    base = default_layout(arch)
    layout = PackLayout(base.roles, base.orientation, base.gate_up, tuple((r, expert_type) for r in base.roles))
    assert run_case(arch, tmp_path, layout, f"{arch} {expert_type.name} experts") < F32_RELATIVE_TOLERANCE


def test_a_registered_architecture_is_checked_like_the_others(monkeypatch, tmp_path):
    """One record registered (arch_fake) is all loading a bundle of it and this check need."""
    fake_arch = register_fake_architecture(monkeypatch)
    assert fake_arch in exactness_archs()
    test_float_experts_match_resident_transformers(fake_arch, ElementType.F32, tmp_path)


QUANTIZED_CASES = {
    # arch, layout, model size: K-quants need rows of 256 elements
    "qwen3_moe Q8_0": (
        "qwen3_moe", PackLayout(types=tuple((r, ElementType.Q8_0) for r in (Role.GATE, Role.UP, Role.DOWN)))),
    "mixtral Q4_K gate/up, Q6_K down": (
        "mixtral",
        PackLayout(types=((Role.GATE, ElementType.Q4_K), (Role.UP, ElementType.Q4_K), (Role.DOWN, ElementType.Q6_K))),
        {"hidden": 256, "moe_intermediate": 256}),
    "deepseek_v3 mixed Q8_0 gate, Q4_0 up, Q5_K down": (
        "deepseek_v3",
        PackLayout(types=((Role.GATE, ElementType.Q8_0), (Role.UP, ElementType.Q4_0), (Role.DOWN, ElementType.Q5_K))),
        {"hidden": 256, "moe_intermediate": 256}),
    "gpt_oss MXFP4, transformers layout": (
        "gpt_oss",
        PackLayout(default_layout("gpt_oss").roles, "in_out", "interleaved",
                   ((Role.GATE_UP, ElementType.MXFP4), (Role.DOWN, ElementType.MXFP4)))),
    "gpt_oss MXFP4, GGUF layout (split out_in, F32 biases)": (
        "gpt_oss",
        PackLayout(GGUF_GPT_OSS_ROLES, "out_in", "concat",
                   tuple((r, ElementType.MXFP4) for r in (Role.GATE, Role.UP, Role.DOWN)))),
    "deepseek_v4 Q8_0 fused gate_up": (
        "deepseek_v4",
        PackLayout((Role.GATE_UP, Role.DOWN), "out_in", "concat",
                   ((Role.GATE_UP, ElementType.Q8_0), (Role.DOWN, ElementType.Q8_0)))),
}


@pytest.mark.parametrize("case", list(QUANTIZED_CASES))
def test_quantized_experts_match_transformers_with_gguf_py_weights(case, tmp_path):
    arch, layout, *size = QUANTIZED_CASES[case]
    assert run_case(arch, tmp_path, layout, case, **(size[0] if size else {})) < F32_RELATIVE_TOLERANCE


def _skip_unless_transformers_runs(reference: torch.nn.Module, arch: str) -> None:
    """transformers 5.17's deepseek_v4 feeds its float32 norm output into bf16 projections and
    fails in bf16 by itself; there is then no reference to compare with."""
    try:
        with torch.no_grad():
            reference(torch.tensor([[3, 4, 5]], device=reference.device))
    except RuntimeError as exc:
        if "same dtype" not in str(exc):
            raise
        pytest.skip(f"plain transformers {transformers.__version__} cannot run {arch} in bfloat16: {exc}")


CUDA = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                      reason="needs CUDA")])
BF16_CASES = {  # name: (arch, layout, model size)
    "qwen3_moe F32 experts": ("qwen3_moe", None, {}),
    "deepseek_v4 F32 experts": ("deepseek_v4", None, {}),
    "gpt_oss F32 experts": ("gpt_oss", None, {}),
    "mixtral Q4_K/Q6_K experts": QUANTIZED_CASES["mixtral Q4_K gate/up, Q6_K down"],
    "gpt_oss MXFP4 GGUF layout": (*QUANTIZED_CASES["gpt_oss MXFP4, GGUF layout (split out_in, F32 biases)"], {}),
}


@pytest.mark.parametrize("device", ["cpu", CUDA])
@pytest.mark.parametrize("case", list(BF16_CASES))
def test_bfloat16_model_matches_from_pretrained_eager(case, device, tmp_path):
    """In bf16 the reference is from_pretrained(dtype=bfloat16) (keep-in-fp32 plan included) with the
    eager experts forward, whose arithmetic the expertpack forward reproduces op for op."""
    arch, layout, sizes = BF16_CASES[case]
    reference32, bundle_dir = make_case(arch, tmp_path / "bundle", layout, **sizes)
    reference32.save_pretrained(tmp_path / "hf")
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.bfloat16,
                                                     experts_implementation="eager").eval().to(device)
    _skip_unless_transformers_runs(reference, arch)
    with load_model(bundle_dir, device=device, dtype=torch.bfloat16, expert_source=LocalPackSource) as loaded:
        for key, tensor in loaded.model.state_dict().items():
            assert tensor.dtype == reference.state_dict()[key].dtype, key
        relative = compare(reference, loaded.model, f"{case} bf16 on {device}")
    # 0.0 on CPU (the same ops in the same order); on CUDA at most one bfloat16 ulp of the largest
    # logit (2^-7 of it): the fused kernels accumulate in float32 in another order than cuBLAS
    assert relative <= 2**-7
