"""DeepSeek-V4 in DeepSeek's published layout: the synthesizer and DeepseekV4OfficialSource.

The oracle for names and dtypes is the published inventory of deepseek-ai/DeepSeek-V4-Flash
(tabled below); for values, the FP8 / FP4 formats (packtools.sources.dsv4_formats) and
transformers' own official -> runtime conversion table.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from packformat.constants import ElementType, Role
from packtools.arch.errors import InconsistentExperts, MissingExpert
from packtools.sources.deepseek_v4_official import DeepseekV4OfficialSource, is_official_layout
from packtools.sources.dsv4_formats import DeepseekV4FormatError, dequantize_fp8_blocks
from packtools.synth.deepseek_v4_official import official_config, synth_official

TRUNK = "model-00001-of-00002.safetensors"
# (name in layer 1 (a CSA layer) or at the root, safetensors dtype), from the published checkpoint
PUBLISHED = [
    ("embed.weight", "BF16"), ("head.weight", "BF16"), ("norm.weight", "BF16"), ("hc_head_fn", "F32"),
    ("hc_head_base", "F32"), ("hc_head_scale", "F32"),
    ("layers.1.attn.attn_sink", "F32"), ("layers.1.attn.kv_norm.weight", "BF16"),
    ("layers.1.attn.q_norm.weight", "BF16"), ("layers.1.attn.wq_a.weight", "F8_E4M3"),
    ("layers.1.attn.wq_a.scale", "F8_E8M0"), ("layers.1.attn.wq_b.weight", "F8_E4M3"),
    ("layers.1.attn.wkv.weight", "F8_E4M3"), ("layers.1.attn.wo_a.weight", "F8_E4M3"),
    ("layers.1.attn.wo_b.scale", "F8_E8M0"), ("layers.1.attn_norm.weight", "BF16"),
    ("layers.1.ffn_norm.weight", "BF16"), ("layers.1.ffn.gate.weight", "BF16"), ("layers.1.ffn.gate.bias", "F32"),
    ("layers.0.ffn.gate.tid2eid", "I64"), ("layers.1.ffn.experts.3.w1.weight", "I8"),
    ("layers.1.ffn.experts.3.w1.scale", "F8_E8M0"), ("layers.1.ffn.experts.3.w2.weight", "I8"),
    ("layers.1.ffn.shared_experts.w3.weight", "F8_E4M3"), ("layers.1.ffn.shared_experts.w3.scale", "F8_E8M0"),
    ("layers.1.hc_attn_fn", "F32"), ("layers.1.hc_ffn_scale", "F32"), ("layers.1.attn.compressor.ape", "F32"),
    ("layers.1.attn.compressor.wkv.weight", "BF16"), ("layers.1.attn.compressor.norm.weight", "BF16"),
    ("layers.1.attn.indexer.wq_b.weight", "F8_E4M3"), ("layers.1.attn.indexer.weights_proj.weight", "BF16"),
    ("layers.1.attn.indexer.compressor.ape", "F32"), ("layers.1.attn.indexer.compressor.wgate.weight", "BF16"),
    ("layers.2.attn.compressor.ape", "F32"),
]
ABSENT = ["layers.0.ffn.gate.bias", "layers.0.attn.compressor.ape", "layers.2.attn.indexer.wq_b.weight",
          "layers.1.ffn.gate.tid2eid", "model.embed_tokens.weight", "layers.1.attn.norm.weight"]


@pytest.fixture(scope="module")
def official(tmp_path_factory) -> Path:
    return synth_official(tmp_path_factory.mktemp("dsv4") / "official", seed=3).out_dir


def _dtypes(directory: Path) -> dict[str, str]:
    out = {}
    for file in directory.glob("*.safetensors"):
        with safe_open(file, "pt") as handle:
            out.update({name: handle.get_slice(name).get_dtype() for name in handle.keys()})
    return out


def test_synth_writes_the_published_names_dtypes_and_config_keys(official):
    dtypes = _dtypes(official)
    for name, dtype in PUBLISHED:
        assert dtypes.get(name) == dtype, name
    assert not set(ABSENT) & set(dtypes)
    assert any(name.startswith("mtp.0.") for name in dtypes)
    config = json.loads((official / "config.json").read_text())
    assert config["compress_ratios"] == [0, 4, 128, 0] and config["num_hash_layers"] == 1
    assert config["quantization_config"]["scale_fmt"] == "ue8m0" and "layer_types" not in config
    assert is_official_layout(official)


def test_source_copies_expert_bytes_verbatim_and_dequantizes_fp8_exactly(official):
    raw = load_file(official / TRUNK)
    with DeepseekV4OfficialSource(official) as source:
        assert source.expert_layout().roles == (Role.GATE, Role.UP, Role.DOWN, Role.GATE_SCALE, Role.UP_SCALE,
                                                Role.DOWN_SCALE)
        assert all(name.startswith("mtp.") for name in source.ignored_tensors) and source.ignored_tensors
        roles = {s.role: s for s in source.expert_roles(2, 3)}
        assert roles[Role.DOWN].element_type == ElementType.F4_E2M1X2 and roles[Role.DOWN].shape == (64, 32)
        assert roles[Role.DOWN].read() == raw["layers.2.ffn.experts.3.w2.weight"].view(torch.uint8).numpy().tobytes()
        assert roles[Role.GATE_SCALE].read() == raw["layers.2.ffn.experts.3.w1.scale"].view(torch.uint8).numpy().tobytes()
        dense = {t.name: t for t in source.dense_tensors()}
        q_b = dense["model.layers.1.self_attn.q_b_proj.weight"]
        expected = dequantize_fp8_blocks("q_b", raw["layers.1.attn.wq_b.weight"], raw["layers.1.attn.wq_b.scale"],
                                         torch.float64)
        assert q_b.dtype == torch.bfloat16 and torch.equal(q_b.load().double(), expected)
        assert dense["model.layers.0.mlp.gate.tid2eid"].load().dtype == torch.int64


def _broken_copy(official: Path, tmp_path: Path, edit) -> Path:
    broken = tmp_path / "broken"
    shutil.copytree(official, broken)
    tensors = load_file(broken / TRUNK)
    edit(tensors)
    save_file(tensors, str(broken / TRUNK), metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != TRUNK} | dict.fromkeys(tensors, TRUNK)
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    return broken


def _drop(name):
    return lambda tensors: tensors.pop(name)


def _replace(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


BAD_INPUTS = [
    ("FP8 tensor without scale", _drop("layers.1.attn.wkv.scale"), DeepseekV4FormatError,
     r"'layers\.1\.attn\.wkv\.weight' has no block scale tensor 'layers\.1\.attn\.wkv\.scale'"),
    ("wrong FP8 scale shape", _replace("layers.1.attn.wq_b.scale", torch.zeros(1, 1, dtype=torch.float8_e8m0fnu)),
     DeepseekV4FormatError, r"'layers\.1\.attn\.wq_b\.weight'.*scale shape \(1, 1\).*expected \(4, 1\)"),
    ("scale of a bfloat16 weight", _replace("layers.1.ffn.gate.scale", torch.zeros(1, 1, dtype=torch.float8_e8m0fnu)),
     DeepseekV4FormatError, r"'layers\.1\.ffn\.gate\.scale' scales nothing.*BF16"),
    ("missing expert scale", _drop("layers.1.ffn.experts.2.w3.scale"), MissingExpert,
     r"layers\.1\.ffn\.experts\.2\.w3\.scale"),
    ("wrong expert scale shape", _replace("layers.2.ffn.experts.0.w2.scale", torch.zeros(64, 2, dtype=torch.uint8)),
     InconsistentExperts, r"layers\.2\.ffn\.experts\.0\.w2\.scale"),
]


@pytest.mark.parametrize("what, edit, error, message", BAD_INPUTS, ids=[case[0] for case in BAD_INPUTS])
def test_bad_official_checkpoints_fail_naming_the_tensor(official, tmp_path, what, edit, error, message):
    with pytest.raises(error, match=message):
        DeepseekV4OfficialSource(_broken_copy(official, tmp_path, edit))


@pytest.mark.parametrize("argv, error", [
    (["synth", "deepseek_v4", "--layout", "official", "--layers", "2"], None),
    (["synth", "qwen3_moe", "--layout", "official"], "exists for deepseek_v4"),
    (["synth", "deepseek_v4", "--layout", "official", "--expert-type", "bfloat16"], "fixes the dtypes"),
])
def test_cli_writes_the_official_layout_or_says_why_not(tmp_path, capsys, argv, error):
    from packtools.cli import main

    assert main([*argv, "-o", str(tmp_path / "out")]) == (0 if error is None else 2)
    if error is None:
        assert json.loads((tmp_path / "out" / "config.json").read_text())["compress_ratios"] == [0, 4, 0]
    else:
        assert error in capsys.readouterr().err


def test_official_config_is_read_by_transformers_as_the_model_it_describes():
    from packtools.arch import config_from_dict

    config = config_from_dict(official_config(num_layers=3))
    assert config.layer_types == ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"]
    assert config.mlp_layer_types == ["hash_moe", "moe", "moe"] and config.qk_rope_head_dim == 16
    assert config.rope_parameters["compress"]["rope_type"] == "yarn"


def test_bundle_config_drops_the_checkpoints_quantization_config_and_the_manifest_keeps_it(official, tmp_path):
    from packtools.build import build_bundle

    build_bundle(official, tmp_path / "bundle", progress=False)
    config = json.loads((tmp_path / "bundle" / "config.json").read_text())
    manifest = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    source_config = json.loads((official / "config.json").read_text())
    assert "quantization_config" not in config  # the bundle's dense is plain floats, its experts in the pack
    assert manifest["source"]["quantization_config"] == source_config["quantization_config"]
