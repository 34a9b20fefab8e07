"""Block-scaled FP4 experts end to end: checkpoint -> `packtools build` -> inference.

A save_pretrained checkpoint's expert projections are replaced by packed FP4 data plus UE8M0
scales, named as DeepSeek-V4 and compressed-tensors checkpoints name them (tests/packtools/
fp4_checkpoint.py); the architecture is told so through ArchSpec.block_scaled. The bundle must
hold the source bytes verbatim, and the model on it must compute exactly what transformers
computes with the same weights dequantized to float32: identical greedy tokens, equal logits.
"""

from __future__ import annotations


import pytest
import torch
from fp4_checkpoint import COMPRESSED_TENSORS, DEEPSEEK_V4, TORCH_FP4, write_block_scaled_checkpoint
from test_model_fixtures import NEW_TOKENS, greedy, prompt
from transformers import AutoModelForCausalLM

from inference.experts import LocalPackSource
from inference.experts.storaged_source import StoragedExpertSource
from inference.model import load_model
from packformat.bundle import open_bundle
from packformat.constants import SCALE_ROLE_OF, ElementType, Role
from packtools.arch import ARCHITECTURES
from packtools.arch.spec import BlockScaledParts
from packtools.build import build_bundle
from packtools.inspect import format_summary, summarize
from packtools.synth.hf import synth_hf

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [
    ("qwen3_moe", DEEPSEEK_V4, ("model.", "")),
    ("mixtral", COMPRESSED_TENSORS, ("model.", "")),
    ("qwen3_moe", TORCH_FP4, ("model.", "")),
]


def _declare_block_scaled(monkeypatch, arch: str, style, prefixes) -> None:
    record = ARCHITECTURES[arch].with_spec(checkpoint_prefixes=prefixes,
                                          block_scaled=BlockScaledParts(style.data_suffix, style.scale_suffix))
    monkeypatch.setitem(ARCHITECTURES, arch, record)


def _check_bundle_bytes(bundle_dir, checkpoint, spec) -> None:
    """Every weight role is its source codes, every scale role its source scales, byte for byte."""
    name_of = {}  # (layer, expert, role) -> the projection's ".weight" name in the float checkpoint
    for name in checkpoint.codes:
        key = spec.parse_expert_key(name)
        name_of[key.layer, key.expert, spec.per_expert_parts[key.part]] = name
    assert len(name_of) == len(checkpoint.codes)
    with open_bundle(bundle_dir) as bundle:
        pack = bundle.pack
        assert pack.header.version_minor == 1  # 1.1 features in use
        assert bundle.experts["roles"] == ["gate", "up", "down", "gate_scale", "up_scale", "down_scale"]
        assert bundle.experts["element_types"] == ["F4_E2M1X2", "UE8M0"]
        text = format_summary(summarize(bundle))
        assert "gate F4_E2M1X2 32x64" in text and "gate_scale UE8M0 32x2" in text, text
        assert "types         F4_E2M1X2, UE8M0" in text and "pack format   1.1" in text, text
        for obj in pack:
            payload = pack.read_object(obj.layer, obj.expert)
            for weight_role in (Role.GATE, Role.UP, Role.DOWN):
                name = name_of[obj.layer, obj.expert, weight_role]
                for role, expected in ((weight_role, checkpoint.codes[name]),
                                       (SCALE_ROLE_OF[weight_role], checkpoint.scales[name])):
                    entry = obj.role(role)
                    assert payload[entry.offset: entry.offset + entry.nbytes] == expected.tobytes(), (name, role)
                assert obj.role(weight_role).element_type == ElementType.F4_E2M1X2


def _build(tmp_path, monkeypatch, arch, style, prefixes):
    _declare_block_scaled(monkeypatch, arch, style, prefixes)
    synth_hf(arch, tmp_path / "src", dtype="float32", seed=5)
    checkpoint = write_block_scaled_checkpoint(tmp_path / "src", tmp_path, style, seed=9)
    build_bundle(checkpoint.scaled_dir, tmp_path / "bundle", progress=False)
    return checkpoint


@pytest.mark.parametrize(("arch", "style", "prefixes"), CASES,
                         ids=[f"{a}-{s.data_suffix}-{s.data_dtype}".replace("torch.", "") for a, s, _ in CASES])
def test_block_scaled_checkpoint_builds_verbatim_and_computes_exactly(arch, style, prefixes, tmp_path, monkeypatch):
    checkpoint = _build(tmp_path, monkeypatch, arch, style, prefixes)
    _check_bundle_bytes(tmp_path / "bundle", checkpoint, ARCHITECTURES[arch].spec)

    reference = AutoModelForCausalLM.from_pretrained(checkpoint.reference_dir, dtype=torch.float32,
                                                     experts_implementation="eager").eval()
    with load_model(tmp_path / "bundle", device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        input_ids = prompt(reference.config.vocab_size)
        expected_tokens = greedy(reference, input_ids)
        assert expected_tokens.shape[1] == input_ids.shape[1] + NEW_TOKENS
        assert torch.equal(greedy(loaded.model, input_ids), expected_tokens)
        with torch.no_grad():
            expected = reference(expected_tokens).logits
            got = loaded.model(expected_tokens).logits
    assert torch.equal(got, expected), f"max |diff| {(got - expected).abs().max().item():.3e}"


def test_storaged_serves_block_scaled_roles_as_opaque_bytes(tmp_path, monkeypatch):
    """storaged never reads element types: the 1.1 roles reach inference intact through it."""
    from test_storaged_source_fixtures import StoragedDaemon

    _build(tmp_path, monkeypatch, "qwen3_moe", DEEPSEEK_V4, ("model.", ""))
    bundle = tmp_path / "bundle"
    input_ids = prompt(512)
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as local:
        with torch.no_grad():
            expected_tokens = greedy(local.model, input_ids)
            expected = local.model(expected_tokens).logits
    daemon = StoragedDaemon({"fp4": bundle})
    try:
        def source(opened, device):
            return StoragedExpertSource(str(daemon.socket), "fp4", opened, device)

        with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=source) as served:
            try:
                assert torch.equal(greedy(served.model, input_ids), expected_tokens)
                with torch.no_grad():
                    assert torch.equal(served.model(expected_tokens).logits, expected)
            finally:
                served.expert_source.close()
    finally:
        daemon.stop()
