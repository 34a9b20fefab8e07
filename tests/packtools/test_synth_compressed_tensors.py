"""packtools.synth.compressed_tensors: Kimi-K3's official MXFP4 expert layout, against gguf-py and
against the format's definition (element 2i in the low nibble, value = E2M1 code * 2**(scale - 127))."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from packtools.synth.compressed_tensors import (
    CompressedTensorsError,
    ggml_blocks,
    pack_mxfp4,
    to_compressed_tensors_mxfp4,
)

MXFP4 = gguf.GGMLQuantizationType.MXFP4
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], dtype=np.float32)


def _decode_by_definition(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The compressed-tensors reading, written from the format's description, not from our packer."""
    codes = np.empty((packed.shape[0], packed.shape[1] * 2), dtype=np.uint8)
    codes[:, 0::2] = packed & 0x0F  # element 2i: low nibble
    codes[:, 1::2] = packed >> 4
    exponent = np.repeat(scale.astype(np.float64) - 127, 32, axis=1)  # one scale per 32 elements
    return (E2M1[codes] * np.exp2(exponent)).astype(np.float32)


@pytest.mark.parametrize("shape,spread", [((1, 32), 1.0), ((4, 64), 0.1), ((32, 96), 10.0), ((7, 256), 1e-3)])
def test_packing_is_lossless_and_means_what_gguf_means(shape, spread):
    rng = np.random.default_rng(shape[1])
    weight = (rng.standard_normal(shape) * spread).astype(np.float32)
    packed, scale = pack_mxfp4(weight, "w")
    assert packed.shape == (shape[0], shape[1] // 2) and packed.dtype == np.uint8
    assert scale.shape == (shape[0], shape[1] // 32) and scale.dtype == np.uint8
    reference = gguf.quants.quantize(weight, MXFP4)  # GGML block_mxfp4 bytes
    assert np.array_equal(ggml_blocks(packed, scale), reference)  # what llama.cpp's converter writes
    np.testing.assert_array_equal(_decode_by_definition(packed, scale), gguf.quants.dequantize(reference, MXFP4))


def test_nibble_order_is_pinned_by_a_hand_made_row():
    # codes 0..15 then 15..0, at scale 2**0: element 2i must be the LOW nibble of byte i
    codes = np.concatenate([np.arange(16), np.arange(16)[::-1]]).astype(np.uint8)
    weight = E2M1[codes][None, :]
    packed, scale = pack_mxfp4(weight, "w")
    assert scale.tolist() == [[127]]
    assert packed[0, 0] == (codes[0] | codes[1] << 4) == 0x10
    assert packed[0, 8] == (codes[16] | codes[17] << 4) == 0xEF


@pytest.mark.parametrize("shape", [(4, 48), (64,), (2, 3, 32)])
def test_unpackable_shapes_name_the_tensor(shape):
    with pytest.raises(CompressedTensorsError, match=r"layers\.1\.block_sparse_moe\.experts\.0\.w1\.weight"):
        pack_mxfp4(np.zeros(shape, dtype=np.float32), "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight")


def _checkpoint(tmp_path, prefix="language_model."):
    rng = np.random.default_rng(3)
    tensors = {f"{prefix}model.embed_tokens.weight": torch.from_numpy(rng.standard_normal((8, 64)).astype(np.float32))}
    for expert in range(2):
        for part, shape in (("w1", (32, 64)), ("w3", (32, 64)), ("w2", (64, 32))):
            name = f"{prefix}model.layers.1.block_sparse_moe.experts.{expert}.{part}.weight"
            tensors[name] = torch.from_numpy(rng.standard_normal(shape).astype(np.float32)).to(torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k3", "text_config": {"hidden_size": 64}}))
    return tensors


def test_checkpoint_rewrite_packs_experts_only(tmp_path):
    original = _checkpoint(tmp_path)
    assert to_compressed_tensors_mxfp4(tmp_path) == 6
    with safe_open(tmp_path / "model.safetensors", framework="pt") as handle:
        got = {name: handle.get_tensor(name) for name in handle.keys()}
    embed = "language_model.model.embed_tokens.weight"
    assert torch.equal(got[embed], original[embed])
    w2 = "language_model.model.layers.1.block_sparse_moe.experts.1.w2"
    assert f"{w2}.weight" not in got and got[f"{w2}.weight_packed"].dtype == torch.uint8
    packed, scale = pack_mxfp4(original[f"{w2}.weight"].float().numpy())
    assert np.array_equal(got[f"{w2}.weight_packed"].numpy(), packed)
    assert np.array_equal(got[f"{w2}.weight_scale"].numpy(), scale)
    assert len(got) == 1 + 2 * 6
    config = json.loads((tmp_path / "config.json").read_text())
    for level in (config, config["text_config"]):  # llama.cpp merges text_config up; either level is read
        assert level["quantization_config"]["quant_method"] == "compressed-tensors"
        assert level["quantization_config"]["format"] == "mxfp4-pack-quantized"
    targets = config["quantization_config"]["config_groups"]["group_0"]["targets"]
    assert targets[0].startswith(r"re:^language_model\.model")


def test_checkpoint_without_experts_is_refused(tmp_path):
    save_file({"model.norm.weight": torch.ones(4)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CompressedTensorsError, match="no routed expert weights"):
        to_compressed_tensors_mxfp4(tmp_path)
