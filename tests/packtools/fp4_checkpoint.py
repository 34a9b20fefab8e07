"""FP4 (E2M1) + UE8M0 test material: a numpy reference dequantizer and block-scaled checkpoints.

`write_block_scaled_checkpoint` turns a save_pretrained checkpoint (per-expert float weights)
into the two checkpoints an FP4 test needs: one whose expert projections are packed FP4 data
plus a scale tensor, named as the official DeepSeek-V4 (`.weight` + `.scale`) or
compressed-tensors (`.weight_packed` + `.weight_scale`) checkpoints name them, and one holding
the same weights dequantized to float32 by the numpy reference (what transformers would load).
"""

from __future__ import annotations

import dataclasses
import re
import shutil
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                dtype=np.float32)
GROUP = 32  # FP4 elements per UE8M0 scale


def reference_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """uint8 [rows, cols/2] (element 2j in the low nibble) and uint8 [rows, cols/32] -> f32 [rows, cols].

    Written from the format's definition, independently of inference.dequant: value * 2**(b - 127),
    with b = 255 NaN.
    """
    rows, half = codes.shape
    values = np.stack([E2M1[codes & 0x0F], E2M1[codes >> 4]], axis=-1).reshape(rows, 2 * half)
    with np.errstate(over="ignore"):
        scale = np.ldexp(np.float32(1.0), scales.astype(np.int32) - 127).astype(np.float32)
    scale = np.where(scales == 0xFF, np.float32(np.nan), scale)
    with np.errstate(over="ignore", invalid="ignore"):
        out = values.reshape(rows, -1, GROUP) * scale[:, :, None]
    return out.reshape(rows, 2 * half).astype(np.float32)


def random_fp4(shape: tuple[int, int], rng: np.random.Generator, exponents=(119, 124)) -> tuple[np.ndarray, np.ndarray]:
    """Random codes uint8 [out, in/2] and scales uint8 [out, in/32] with exponents in [lo, hi]."""
    out_features, in_features = shape
    codes = rng.integers(0, 256, (out_features, in_features // 2), dtype=np.uint8)
    scales = rng.integers(exponents[0], exponents[1] + 1, (out_features, in_features // GROUP), dtype=np.uint8)
    return codes, scales


@dataclasses.dataclass(frozen=True)
class ScaledStyle:
    """How a checkpoint stores one block-scaled projection."""

    data_suffix: str
    scale_suffix: str
    data_dtype: torch.dtype  # int8, uint8 (shape [out, in/2]) or float4_e2m1fn_x2 (logical [out, in])
    scale_dtype: torch.dtype  # float8_e8m0fnu or uint8


DEEPSEEK_V4 = ScaledStyle("weight", "scale", torch.int8, torch.float8_e8m0fnu)
COMPRESSED_TENSORS = ScaledStyle("weight_packed", "weight_scale", torch.uint8, torch.uint8)
TORCH_FP4 = ScaledStyle("weight", "scale", torch.float4_e2m1fn_x2, torch.float8_e8m0fnu)


@dataclasses.dataclass(frozen=True)
class BlockScaledCheckpoint:
    scaled_dir: Path  # FP4 data + scales
    reference_dir: Path  # the same weights dequantized to float32
    codes: dict[str, np.ndarray]  # per-expert weight name (".weight" form) -> codes
    scales: dict[str, np.ndarray]


_EXPERT_WEIGHT = re.compile(r"\.experts\.\d+\.[A-Za-z0-9_]+\.weight$")


def write_block_scaled_checkpoint(source: Path, out: Path, style: ScaledStyle, seed: int = 0,
                                  skip: frozenset[str] = frozenset()) -> BlockScaledCheckpoint:
    """Both checkpoints of `source` (a single-file save_pretrained directory) under `out`.

    Tensors named in `skip` keep their float form in the scaled checkpoint.
    """
    rng = np.random.default_rng(seed)
    tensors = load_file(source / "model.safetensors")
    scaled, reference, codes_of, scales_of = {}, {}, {}, {}
    for name in sorted(tensors):
        value = tensors[name]
        if not _EXPERT_WEIGHT.search(name) or name in skip:
            scaled[name] = reference[name] = value
            continue
        codes, scales = random_fp4(tuple(value.shape), rng)
        codes_of[name], scales_of[name] = codes, scales
        reference[name] = torch.from_numpy(reference_dequantize(codes, scales))
        stem = name.removesuffix(".weight")
        data = torch.from_numpy(codes)
        if style.data_dtype == torch.float4_e2m1fn_x2:
            data = data.view(torch.float4_e2m1fn_x2)
        elif style.data_dtype == torch.int8:
            data = data.view(torch.int8)
        scaled[f"{stem}.{style.data_suffix}"] = data
        scaled[f"{stem}.{style.scale_suffix}"] = torch.from_numpy(scales).view(style.scale_dtype)
    dirs = {}
    for kind, state in (("scaled", scaled), ("reference", reference)):
        directory = out / kind
        shutil.copytree(source, directory, ignore=shutil.ignore_patterns("model.safetensors"))
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
        dirs[kind] = directory
    return BlockScaledCheckpoint(dirs["scaled"], dirs["reference"], codes_of, scales_of)
