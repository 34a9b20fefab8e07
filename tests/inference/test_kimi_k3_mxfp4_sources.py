"""Kimi-K3's MXFP4 experts two ways: the official compressed-tensors checkpoint, and the GGUF
llama.cpp's converter makes of it (tests/golden/llamacpp/kimi_k3-MXFP4.gguf). The converter's
repack only moves bits, so the two bundles hold the same expert values in different encodings
(F4_E2M1X2 + UE8M0 roles, GGML MXFP4 blocks) and must compute exactly the same thing.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.experts import LocalPackSource
from inference.model import load_model
from packformat.constants import SCALE_ROLE_OF, ElementType, Role
from packtools.build import build_bundle, open_source
from packtools.gguf.kimi_k3_tensors import a_log_from_gguf, a_log_to_gguf
from packtools.synth.compressed_tensors import ggml_blocks, synth_kimi_k3_mxfp4

REPO = Path(__file__).resolve().parents[2]
GOLDEN_MXFP4 = REPO / "tests" / "golden" / "llamacpp" / "kimi_k3-MXFP4.gguf"
PROMPT = [1, 17, 305, 88, 421, 42, 260, 133, 77, 499, 12, 301]
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def official_checkpoint(tmp_path_factory) -> Path:
    """The compressed-tensors checkpoint the golden GGUF was converted from, made again."""
    spec = importlib.util.spec_from_file_location("llamacpp_golden", REPO / "scripts" / "llamacpp_golden.py")
    script = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = script  # its dataclasses look their module up while being defined
    spec.loader.exec_module(script)
    case = next(c for c in script.KIMI_K3_CASES if c.expert_format == "compressed-tensors-mxfp4")
    out = tmp_path_factory.mktemp("kimi_k3_official") / "checkpoint"
    script.write_checkpoint(case, out)
    return out


def test_expert_bytes_are_one_encoding_apart(official_checkpoint):
    hf, gguf = open_source(official_checkpoint), open_source(GOLDEN_MXFP4)
    try:
        assert hf.moe_layers() == gguf.moe_layers() and hf.num_experts() == gguf.num_experts()
        for layer in hf.moe_layers():
            for expert in range(hf.num_experts()):
                official = {r.role: r for r in hf.expert_roles(layer, expert)}
                converted = {r.role: r for r in gguf.expert_roles(layer, expert)}
                for role in (Role.GATE, Role.UP, Role.DOWN):
                    weight, scale = official[role], official[SCALE_ROLE_OF[role]]
                    assert (weight.element_type, scale.element_type) == (ElementType.F4_E2M1X2, ElementType.UE8M0)
                    assert converted[role].element_type == ElementType.MXFP4
                    packed = np.frombuffer(weight.read(), np.uint8).reshape(weight.shape[0], -1)
                    scales = np.frombuffer(scale.read(), np.uint8).reshape(scale.shape)
                    assert ggml_blocks(packed, scales).tobytes() == converted[role].read(), (layer, expert, role)
    finally:
        hf.close()
        gguf.close()


def _as_the_converter_leaves_it(model: torch.nn.Module) -> None:
    """The two dense changes a kimi-k3 GGUF carries (packtools.gguf.kimi_k3_tensors): residual scores
    fused into the norm (projection ones) and A_log through -exp. Same function, other rounding."""
    params = dict(model.named_parameters())
    for name, param in params.items():
        if name.endswith("_res_norm.weight"):
            proj = params[name.replace("_res_norm", "_res_proj")]
            param.copy_(param * proj.flatten())
            proj.fill_(1.0)
        elif name.endswith("A_log"):
            param.copy_(a_log_from_gguf(a_log_to_gguf(param)))


@torch.no_grad()
def _run(bundle: Path, adjust=None) -> tuple[torch.Tensor, list[int]]:
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        if adjust is not None:
            adjust(loaded.model)
        ids = torch.tensor([PROMPT])
        logits = loaded.model(ids).logits[0]  # [prompt, vocab]
        out = loaded.model.generate(ids, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    return logits, out[0, len(PROMPT):].tolist()


def test_official_and_gguf_bundles_compute_the_same(official_checkpoint, tmp_path):
    build_bundle(official_checkpoint, tmp_path / "hf", progress=False)
    build_bundle(GOLDEN_MXFP4, tmp_path / "gguf", progress=False)
    gguf_logits, gguf_tokens = _run(tmp_path / "gguf")
    hf_logits, hf_tokens = _run(tmp_path / "hf")
    assert hf_tokens == gguf_tokens
    relative = float((hf_logits - gguf_logits).abs().max() / gguf_logits.abs().max())
    print(f"kimi_k3 MXFP4, official vs GGUF bundle: max relative logits difference {relative:.2e}")
    assert relative < 1e-5  # float32 rounding of the two dense changes below
    # with those two changes made to the official bundle's model, nothing at all differs
    converted_logits, converted_tokens = _run(tmp_path / "hf", _as_the_converter_leaves_it)
    assert converted_tokens == gguf_tokens
    assert torch.equal(converted_logits, gguf_logits), f"max |diff| {(converted_logits - gguf_logits).abs().max():.3e}"


def test_synthesized_official_checkpoint_builds_verbatim(tmp_path):
    checkpoint = synth_kimi_k3_mxfp4(tmp_path / "checkpoint", seed=2, num_layers=2)
    with open_source(checkpoint) as source:
        roles = source.expert_roles(source.moe_layers()[0], 0)
    types = {role.role: role.element_type for role in roles}
    assert types[Role.GATE] == ElementType.F4_E2M1X2 and types[Role.GATE_SCALE] == ElementType.UE8M0
    build_bundle(checkpoint, tmp_path / "bundle", progress=False)
    _, tokens = _run(tmp_path / "bundle")
    assert len(tokens) == 16
