"""The coverage check of one model type through a Hugging Face checkpoint, shared by the tests
(test_hf_coverage.py) and the table docs/inference.md shows (scripts/moe_coverage.py).

A random-weight checkpoint of the type's tiny config is written with save_pretrained
(packtools.synth.hf), `packtools build` packs it, and greedy tokens of the bundle served through
the expertpack experts forward must equal plain transformers' `from_pretrained` of the same
checkpoint. The reference must also depend on its experts (zeroing them moves its logits), or
the comparison would prove nothing.
"""

from __future__ import annotations

import dataclasses
import warnings
from pathlib import Path

import torch
from test_model_fixtures import compare, prompt
from transformers import AutoModelForCausalLM

from inference.experts import LocalPackSource
from inference.experts.binding import experts_modules
from inference.model import load_model
from packtools.build import build_bundle
from packtools.synth.hf import synth_hf

warnings.filterwarnings("ignore", message=".*fla.*|.*causal_conv1d.*|.*fast path.*|.*mamba.*")
# zeroing every expert must move the reference's logits by at least this much of their largest
EXPERTS_MATTER = 1e-3
BF16_CUDA_RELATIVE = 2**-7  # one bfloat16 ulp of the largest logit (the fused kernels' order)


class ReferenceFails(RuntimeError):
    """Plain transformers itself cannot generate with the type's tiny model: nothing to compare."""


@dataclasses.dataclass(frozen=True)
class Checked:
    relative: float  # max relative logits error against the reference
    experts_effect: float  # how far zeroing the experts moves the reference's logits (relative)


def _experts_effect(reference: torch.nn.Module) -> float:
    tokens = prompt(reference.config.vocab_size).to(reference.device)
    with torch.no_grad():
        before = reference(tokens).logits.float()
        for _, module in experts_modules(reference).values():
            for param in module.parameters(recurse=False):
                param.zero_()
        after = reference(tokens).logits.float()
    return ((after - before).abs().max() / before.abs().max()).item()


def _reference(hf_dir: Path, device: str, dtype: torch.dtype) -> torch.nn.Module:
    kwargs = {"experts_implementation": "eager"} if dtype != torch.float32 else {}
    reference = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, **kwargs).eval().to(device)
    try:
        with torch.no_grad():
            reference.generate(prompt(reference.config.vocab_size).to(device), max_new_tokens=2, do_sample=False,
                               pad_token_id=0)
    except Exception as exc:
        raise ReferenceFails(f"plain transformers cannot generate: {type(exc).__name__}: {exc}") from exc
    return reference


def write_checkpoint(model_type: str, work: Path) -> Path:
    synth_hf(model_type, work / "hf", dtype="float32", seed=3)
    return work / "hf"


def build(model_type: str, work: Path) -> Path:
    """`packtools build` of a random float32 checkpoint of the type; returns the bundle."""
    hf_dir = write_checkpoint(model_type, work)
    build_bundle(hf_dir, work / "bundle", progress=False)
    return work / "bundle"


def greedy_identical(model_type: str, work: Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32
                     ) -> Checked:
    """Build, then compare with plain transformers; AssertionError (tokens differ, experts do not
    matter, or bfloat16 logits beyond one ulp), ReferenceFails, or the error that stopped it."""
    bundle = build(model_type, work)
    reference = _reference(work / "hf", device, dtype)
    label = f"{model_type} {str(dtype).removeprefix('torch.')} on {device}"
    with load_model(bundle, device=device, dtype=dtype, expert_source=LocalPackSource) as loaded:
        relative = compare(reference, loaded.model, label)
    if dtype == torch.float32:
        assert relative < 1e-4, f"{label}: logits differ by {relative:.3e} of the largest"
    else:
        assert relative <= BF16_CUDA_RELATIVE, f"{label}: logits differ by {relative:.3e} of the largest"
    effect = _experts_effect(reference)
    assert effect > EXPERTS_MATTER, f"{label}: zeroing the experts moves the logits by only {effect:.1e}"
    return Checked(relative, effect)
