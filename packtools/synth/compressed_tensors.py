"""Routed experts as the official Kimi-K3 checkpoint stores them: compressed-tensors MXFP4.

quantization_config {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized"};
each per-expert projection `...experts.{E}.w{1,2,3}.weight` [out, in] becomes

- `...w1.weight_packed` uint8 [out, in/2]: FP4 E2M1 codes, element 2i in the low nibble and
  2i+1 in the high one (llama.cpp conversion/base.py repack_mxfp4_blocks, "Source" layout);
- `...w1.weight_scale` uint8 [out, in/32]: one E8M0 biased exponent per 32-element group.

Values come from gguf-py's MXFP4 quantizer (GGML block_mxfp4: a scale byte, then 16 bytes with
element j in the low nibble and j+16 in the high one), re-laid out here. The two layouts hold the
same codes and exponents (ggml doubles its code table and halves the scale), so llama.cpp's
converter turns these tensors back into exactly the GGML blocks they came from.

`to_compressed_tensors_mxfp4(checkpoint_dir)` rewrites a float checkpoint in place (one shard in
memory at a time); the other tensors keep their bytes. `synth_kimi_k3_mxfp4` is `packtools synth
kimi_k3` followed by that rewrite: the official checkpoint's layout, names and expert format.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import gguf
import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

MXFP4 = gguf.GGMLQuantizationType.MXFP4
GROUP = 32  # elements per E8M0 scale
_BLOCK_BYTES = 17  # GGML block_mxfp4: 1 scale byte + 16 code bytes
FORMAT = "mxfp4-pack-quantized"
# a routed expert projection of the official checkpoint (w1 gate, w3 up, w2 down)
EXPERT_WEIGHT = re.compile(r"^(?P<module>(?:language_model\.)?model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123])"
                           r"\.weight$")


class CompressedTensorsError(ValueError):
    """A tensor cannot be stored as compressed-tensors MXFP4 (names the tensor)."""


def pack_mxfp4(weight: np.ndarray, name: str = "<tensor>") -> tuple[np.ndarray, np.ndarray]:
    """float [out, in] -> (weight_packed uint8 [out, in/2], weight_scale uint8 [out, in/32])."""
    if weight.ndim != 2 or weight.shape[1] % GROUP:
        raise CompressedTensorsError(f"{name}: shape {weight.shape} is not [out, in] with in a multiple of {GROUP}")
    rows, cols = weight.shape
    blocks = gguf.quants.quantize(np.ascontiguousarray(weight, dtype=np.float32), MXFP4)
    blocks = blocks.reshape(rows, cols // GROUP, _BLOCK_BYTES)  # [out, groups, 17]
    scale = blocks[..., 0]  # [out, groups]
    codes = blocks[..., 1:]  # [out, groups, 16]
    in_group = np.concatenate([codes & 0x0F, codes >> 4], axis=-1)  # [out, groups, 32]: element order
    packed = in_group[..., 0::2] | (in_group[..., 1::2] << 4)  # [out, groups, 16]
    return packed.reshape(rows, cols // 2).astype(np.uint8), np.ascontiguousarray(scale, dtype=np.uint8)


def ggml_blocks(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The GGML MXFP4 blocks [out, in/32*17] of a (weight_packed, weight_scale) pair: the layout
    llama.cpp's converter writes to its GGUF (the inverse of pack_mxfp4's re-layout)."""
    rows, groups = scale.shape
    in_group = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(rows, groups, GROUP)  # element order
    codes = in_group[..., :16] | (in_group[..., 16:] << 4)  # [out, groups, 16]
    return np.concatenate([scale[..., None], codes], axis=-1).reshape(rows, groups * _BLOCK_BYTES).astype(np.uint8)


def quantization_config(text_prefix: str) -> dict:
    """The quantization_config of a checkpoint whose routed experts only are MXFP4."""
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": FORMAT,
                "targets": [rf"re:^{re.escape(text_prefix)}model\.layers\.\d+\.block_sparse_moe\.experts\.\d+\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": GROUP,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
    }


def to_compressed_tensors_mxfp4(checkpoint_dir: Path | str) -> int:
    """Rewrite every routed expert weight of an official-layout checkpoint as compressed-tensors
    MXFP4 (files and config.json in place); returns how many weights were packed."""
    checkpoint_dir = Path(checkpoint_dir)
    config_path = checkpoint_dir / "config.json"
    config = json.loads(config_path.read_text())
    packed_count, prefixes = 0, set()
    for path in sorted(checkpoint_dir.glob("*.safetensors")):
        tensors, changed = {}, False
        with safe_open(path, framework="pt") as handle:
            metadata = handle.metadata()
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                match = EXPERT_WEIGHT.match(name)
                if match is None:
                    tensors[name] = tensor
                    continue
                packed, scale = pack_mxfp4(tensor.float().numpy(), name)
                tensors[f"{match['module']}.weight_packed"] = torch.from_numpy(packed)
                tensors[f"{match['module']}.weight_scale"] = torch.from_numpy(scale)
                prefixes.add("language_model." if name.startswith("language_model.") else "")
                packed_count += 1
                changed = True
        if changed:
            save_file(tensors, path, metadata=metadata)
    if packed_count == 0:
        raise CompressedTensorsError(f"{checkpoint_dir}: no routed expert weights (...block_sparse_moe.experts.E.w1.weight)")
    _rewrite_index(checkpoint_dir)
    quant = quantization_config(prefixes.pop() if len(prefixes) == 1 else "")
    if "text_config" in config:  # the multimodal wrapper: llama.cpp reads the merged view, either level works
        config["text_config"]["quantization_config"] = quant
    config["quantization_config"] = quant
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return packed_count


def _rewrite_index(checkpoint_dir: Path) -> None:
    """Keep model.safetensors.index.json's weight_map naming the tensors each shard now holds."""
    index_path = checkpoint_dir / "model.safetensors.index.json"
    if not index_path.exists():
        return
    index = json.loads(index_path.read_text())
    weight_map = {}
    for shard in sorted(set(index["weight_map"].values())):
        with safe_open(checkpoint_dir / shard, framework="pt") as handle:
            weight_map.update({name: shard for name in handle.keys()})
    index["weight_map"] = dict(sorted(weight_map.items()))
    index_path.write_text(json.dumps(index, indent=2) + "\n")


def synth_kimi_k3_mxfp4(out_dir: Path | str, *, seed: int = 0, dtype: str = "bfloat16", **sizes) -> Path:
    """A random Kimi-K3 checkpoint as Moonshot publishes it: official names and config.json wrapper
    (packtools.synth.hf), `dtype` dense weights, routed experts as compressed-tensors MXFP4
    (quantized from their `dtype` values). `sizes` as synth_hf's; widths must be multiples of 32."""
    from packtools.synth.hf import synth_hf  # noqa: PLC0415  (imports transformers and the models)

    result = synth_hf("kimi_k3", Path(out_dir), seed=seed, dtype=dtype, **sizes)
    to_compressed_tensors_mxfp4(result.out_dir)
    return result.out_dir
