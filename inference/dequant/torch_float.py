"""Torch "dequantizers" of the plain float types: F32, F16, BF16 (one element per block).

gguf-py reads F32 as a view, F16 with an exact widening, and BF16 as `int16 << 16` viewed as
float32; torch's bfloat16 -> float32 conversion is that same 16-bit shift.
"""

from __future__ import annotations

import torch

from inference.dequant.torch_common import viewable_as


def dequantize_f32(blocks: torch.Tensor) -> torch.Tensor:
    """F32, 4 B per element; a copy, so the result never aliases the caller's raw bytes."""
    view = viewable_as(blocks, torch.float32)  # f32 [n, 1], may alias blocks
    return view.clone() if view.data_ptr() == blocks.data_ptr() else view


def dequantize_f16(blocks: torch.Tensor) -> torch.Tensor:
    """F16, 2 B per element, widened exactly (subnormals included)."""
    return viewable_as(blocks, torch.float16).to(torch.float32)  # f32 [n, 1]


def dequantize_bf16(blocks: torch.Tensor) -> torch.Tensor:
    """BF16, 2 B per element: the top half of a float32."""
    return viewable_as(blocks, torch.bfloat16).to(torch.float32)  # f32 [n, 1]


def cast_rows(rows: torch.Tensor, dtype: torch.dtype, out_dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, nbytes] of floats of `dtype` -> out_dtype [N, elements], always a new tensor.

    One cast equals widening to float32 first (exact) and rounding that once, which is what
    the dequantizers above followed by .to(out_dtype) give.
    """
    values = viewable_as(rows, dtype)  # [N, elements], may alias rows
    return values.to(out_dtype, copy=True)
