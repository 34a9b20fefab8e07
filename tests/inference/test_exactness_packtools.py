"""Exactness on bundles made by `packtools build`, the way users make them.

- Hugging Face route: packtools.synth.hf writes a checkpoint with save_pretrained, the bundle is
  built from it, and the reference is `from_pretrained` of that same checkpoint.
- GGUF route: a random model is written as a GGUF with quantized experts, the bundle is built
  from the GGUF, and the reference is packtools.gguf.reference.load_reference_model — the model
  with every expert dequantized by gguf-py, fully resident in plain transformers.
"""

from __future__ import annotations

import pytest
import torch
from test_model_fixtures import compare
from transformers import AutoModelForCausalLM

from inference.experts import LocalPackSource
from inference.model import load_model
from packtools.arch import ARCHITECTURES
from packtools.build import build_bundle
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf
from packtools.synth.hf import synth_hf
from packtools.tokenizer_synth import build_tokenizer

F32_RELATIVE_TOLERANCE = 1e-4
WIDE = {"hidden_size": 256, "moe_intermediate_size": 256}  # K-quant rows are 256-element blocks
pytestmark = pytest.mark.usefixtures("one_thread")

HF_CASES = [(arch, "float32") for arch in sorted(ARCHITECTURES)]
HF_CASES += [("qwen3_moe", "bfloat16"), ("gpt_oss", "bfloat16")]


@pytest.mark.parametrize(("arch", "checkpoint_dtype"), HF_CASES, ids=[f"{a}-{d}" for a, d in HF_CASES])
def test_hf_checkpoint_bundle_matches_from_pretrained(arch, checkpoint_dtype, tmp_path):
    synth_hf(arch, tmp_path / "hf", dtype=checkpoint_dtype, seed=3)
    build_bundle(tmp_path / "hf", tmp_path / "bundle", progress=False)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with load_model(tmp_path / "bundle", device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert loaded.tokenizer is not None
        relative = compare(reference, loaded.model, f"packtools hf {arch} {checkpoint_dtype}")
    assert relative < F32_RELATIVE_TOLERANCE


# the expert type each architecture packtools writes GGUFs of is checked in here; not listed: Q8_0
GGUF_EXPERT_TYPE = {
    "qwen3_moe": ("Q8_0", {}),
    "qwen2_moe": ("Q4_0", {}),
    "olmoe": ("Q5_K", WIDE),
    "mixtral": ("Q4_K", WIDE),
    "deepseek_v3": ("Q6_K", WIDE),
    "deepseek_v2": ("Q4_K", WIDE),
    "kimi_linear": ("Q8_0", {}),
    "gpt_oss": ("MXFP4", {}),  # GGUF layout: split out_in gate/up/down, F32 biases
    "dots1": ("Q5_0", {}),
    "glm4_moe": ("Q3_K", WIDE),
    "ernie4_5_moe": ("Q2_K", WIDE),
    "hunyuan_v1_moe": ("Q4_1", {}),
    "minimax_m2": ("Q5_1", {}),
    "qwen3_next": ("Q8_0", {}),
}
GGUF_CASES = [(arch, *GGUF_EXPERT_TYPE.get(arch, ("Q8_0", {})))
              for arch, record in sorted(ARCHITECTURES.items()) if record.gguf_writable]


@pytest.mark.parametrize(("arch", "expert_type", "sizes"), GGUF_CASES, ids=[f"{a}-{t}" for a, t, _ in GGUF_CASES])
def test_gguf_bundle_matches_transformers_with_gguf_py_dequantized_experts(arch, expert_type, sizes, tmp_path):
    model = tiny_random_model(arch, seed=11, **sizes)
    (gguf_path,) = synth_gguf(arch, tmp_path / "model.gguf", model=model, expert_type=expert_type,
                              tokenizer=build_tokenizer(model.config.vocab_size))
    build_bundle(gguf_path, tmp_path / "bundle", progress=False)
    source = GGUFSource(gguf_path)
    try:
        reference = load_reference_model(source)
    finally:
        source.close()
    with load_model(tmp_path / "bundle", device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert expert_type in loaded.bundle.experts["element_types"]
        relative = compare(reference, loaded.model, f"packtools gguf {arch} {expert_type}")
    assert relative < F32_RELATIVE_TOLERANCE
