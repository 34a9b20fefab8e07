"""HFSource on block-scaled (FP4 + UE8M0) expert checkpoints: roles, layout and every refusal."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp4_checkpoint import COMPRESSED_TENSORS, DEEPSEEK_V4, write_block_scaled_checkpoint
from safetensors.torch import load_file, save_file

from packformat.constants import ElementType, Role
from packtools.arch import ARCHITECTURES
from packtools.arch.errors import InconsistentExperts, MissingExpert, UnsupportedDtype
from packtools.arch.spec import BlockScaledParts, ExpertKey
from packtools.sources.hf import HFSource
from packtools.synth.hf import synth_hf

EXPERT = "model.layers.1.mlp.experts.3"


@pytest.fixture(scope="module")
def float_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "src"
    synth_hf("qwen3_moe", path, dtype="float32", seed=1)
    return path


@pytest.fixture
def deepseek_style(monkeypatch):
    record = ARCHITECTURES["qwen3_moe"].with_spec(block_scaled=BlockScaledParts("weight", "scale"))
    monkeypatch.setitem(ARCHITECTURES, "qwen3_moe", record)
    return record.spec


def test_roles_layout_and_bytes(float_checkpoint, tmp_path, deepseek_style):
    checkpoint = write_block_scaled_checkpoint(float_checkpoint, tmp_path, DEEPSEEK_V4, seed=2)
    with HFSource(checkpoint.scaled_dir) as source:
        assert source.expert_layout().roles == (Role.GATE, Role.UP, Role.DOWN, Role.GATE_SCALE, Role.UP_SCALE,
                                                Role.DOWN_SCALE)
        slices = {s.role: s for s in source.expert_roles(1, 3)}
        gate, gate_scale = slices[Role.GATE], slices[Role.GATE_SCALE]
        assert (gate.element_type, gate.shape, gate.nbytes) == (ElementType.F4_E2M1X2, (32, 64), 1024)
        assert (gate_scale.element_type, gate_scale.shape) == (ElementType.UE8M0, (32, 2))
        name = f"{EXPERT}.gate_proj.weight"
        assert bytes(gate.read()) == checkpoint.codes[name].tobytes()
        assert bytes(gate_scale.read()) == checkpoint.scales[name].tobytes()
        assert slices[Role.DOWN].shape == (64, 32) and slices[Role.DOWN_SCALE].shape == (64, 1)


def test_float_weights_without_scales_stay_plain_under_a_block_scaled_spec(float_checkpoint, deepseek_style):
    with HFSource(float_checkpoint) as source:  # e.g. a dequantized re-save of a DeepSeek-V4 checkpoint
        assert source.expert_layout() == deepseek_style.layout
        assert {s.element_type for s in source.expert_roles(0, 0)} == {ElementType.F32}


def _mutated(checkpoint_dir, mutate):
    tensors = load_file(checkpoint_dir / "model.safetensors")
    mutate(tensors)
    save_file(tensors, checkpoint_dir / "model.safetensors", metadata={"format": "pt"})


def _all_layer_plain(float_tensors, layer):
    def mutate(t):
        for name in [n for n in t if f"layers.{layer}.mlp.experts." in n]:
            del t[name]
        t.update({n: v for n, v in float_tensors.items() if f"layers.{layer}.mlp.experts." in n})
    return mutate


BROKEN = [
    ("missing scales", lambda t, f: t.pop(f"{EXPERT}.up_proj.scale"), MissingExpert,
     f"layer 1 expert 3: missing UP block scales ({EXPERT}.up_proj.scale)"),
    ("scales of a float weight", lambda t, f: t.update({f"{EXPERT}.up_proj.weight": f[f"{EXPERT}.up_proj.weight"]}),
     InconsistentExperts, "scales UP, whose data is"),
    ("scale group of 16", lambda t, f: t.update({f"{EXPERT}.down_proj.scale": torch.zeros(64, 2, dtype=torch.uint8)}),
     InconsistentExperts, "do not scale DOWN (64, 32) in groups of [32]"),
    ("scales in bf16", lambda t, f: t.update({f"{EXPERT}.down_proj.scale": torch.zeros(64, 1, dtype=torch.bfloat16)}),
     UnsupportedDtype, "UE8M0 scales must be one of"),
    ("data of the wrong width",
     lambda t, f: t.update({f"{EXPERT}.gate_proj.weight": torch.zeros(32, 16, dtype=torch.int8)}),
     InconsistentExperts, "GATE from"),
    ("one layer plain, one scaled", lambda t, f: _all_layer_plain(f, 1)(t), InconsistentExperts,
     "differ from the first MoE layer's"),
    ("one expert plain", lambda t, f: (t.pop(f"{EXPERT}.gate_proj.scale"),
                                       t.update({f"{EXPERT}.gate_proj.weight": f[f"{EXPERT}.gate_proj.weight"]})),
     InconsistentExperts, "differ from expert 0's"),
]


@pytest.mark.parametrize(("name", "mutate", "error", "message"), BROKEN, ids=[b[0] for b in BROKEN])
def test_broken_block_scaled_checkpoints_are_refused(float_checkpoint, tmp_path, deepseek_style, name, mutate,
                                                     error, message):
    checkpoint = write_block_scaled_checkpoint(float_checkpoint, tmp_path, DEEPSEEK_V4, seed=2)
    float_tensors = load_file(float_checkpoint / "model.safetensors")
    _mutated(checkpoint.scaled_dir, lambda t: mutate(t, float_tensors))
    with pytest.raises(error) as caught:
        HFSource(checkpoint.scaled_dir)
    assert message in str(caught.value)


def test_packed_suffix_with_float_data_is_refused(float_checkpoint, tmp_path, monkeypatch):
    record = ARCHITECTURES["qwen3_moe"].with_spec(block_scaled=BlockScaledParts("weight_packed", "weight_scale"))
    monkeypatch.setitem(ARCHITECTURES, "qwen3_moe", record)
    checkpoint = write_block_scaled_checkpoint(float_checkpoint, tmp_path, COMPRESSED_TENSORS, seed=2)
    name = f"{EXPERT}.down_proj.weight_packed"
    _mutated(checkpoint.scaled_dir, lambda t: t.update({name: torch.zeros(64, 16, dtype=torch.float16)}))
    with pytest.raises(UnsupportedDtype, match=f"{name}.*is F16; packed FP4 data must be one of"):
        HFSource(checkpoint.scaled_dir)


PARSE_CASES = [
    (("model.", ""), "layers.2.ffn.experts.7.w1.scale", ExpertKey(2, 7, "w1", "scale")),
    (("model.", ""), "model.layers.2.ffn.experts.7.w3.weight", ExpertKey(2, 7, "w3", "weight")),
    (("model.", ""), "language_model.model.layers.2.ffn.experts.7.w3.weight", None),
    (("language_model.model.", "model.", ""), "language_model.model.layers.2.ffn.experts.7.w2.weight_packed",
     ExpertKey(2, 7, "w2", "weight_packed")),
    (("language_model.model.", "model.", ""), "language_model.model.layers.2.ffn.experts.7.w2.weight_scale",
     ExpertKey(2, 7, "w2", "weight_scale")),
    (("language_model.model.", "model.", ""), "layers.2.ffn.experts.7.w2.weight_shape", None),
]


@pytest.mark.parametrize(("prefixes", "name", "expected"), PARSE_CASES)
def test_block_scaled_names_parse(prefixes, name, expected):
    scaled = BlockScaledParts("weight_packed", "weight_scale") if "weight_" in name else BlockScaledParts()
    spec = dataclasses.replace(ARCHITECTURES["deepseek_v4"].spec, block_scaled=scaled, checkpoint_prefixes=prefixes)
    assert spec.parse_expert_key(name) == expected
    if expected is not None:
        role = spec.per_expert_parts[expected.part]
        assert spec.parse_expert_key(spec.per_expert_key(2, 7, role, expected.suffix)) == expected
