"""Helpers shared by the torch dequantizers: scale fields and bit-plane unpacking.

Every dequantizer maps `blocks: uint8 [n_blocks, type_size]` to `float32 [n_blocks, block_size]`
and mirrors gguf-py 0.19.0's numpy `dequantize_blocks` op for op, so that float32 results are
bit-identical: same products, same order, no fused multiply-add (torch runs each op as its own
kernel, so nothing gets contracted).
"""

from __future__ import annotations

import torch


def viewable_as(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`data` (uint8) reinterpreted as `dtype` along its last dim; copied first when it is not
    contiguous or its storage offset is not a multiple of the new element size (torch refuses
    such views, and a misaligned pointer would be one on the GPU)."""
    if not data.is_contiguous() or data.storage_offset() % dtype.itemsize:
        data = data.clone(memory_format=torch.contiguous_format)  # fresh storage, offset 0
    return data.view(dtype)


def fp16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The little-endian fp16 at byte `offset` of each block, widened exactly to float32."""
    pair = viewable_as(blocks[:, offset : offset + 2], torch.float16)  # f16 [n, 1]
    return pair.to(torch.float32)  # f32 [n, 1]


def shift_amounts(start: int, stop: int, step: int, device: torch.device) -> torch.Tensor:
    """uint8 shift counts start, start+step, ... < stop, made on the device (no host copy)."""
    return torch.arange(start, stop, step, dtype=torch.uint8, device=device)


def nibble_planes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, groups, width] -> uint8 [n, groups, 2, width]: low nibbles, then high nibbles.

    This is gguf-py's `x.reshape((n, -1, 1, width)) >> [0, 4] & 0x0F`.
    """
    shifts = shift_amounts(0, 8, 4, packed.device).reshape(1, 1, 2, 1)
    return (packed.unsqueeze(2) >> shifts) & 0x0F


def crumb_planes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, groups, width] -> uint8 [n, groups, 4, width]: 2-bit fields at shifts 0,2,4,6."""
    shifts = shift_amounts(0, 8, 2, packed.device).reshape(1, 1, 4, 1)
    return (packed.unsqueeze(2) >> shifts) & 0x03


def bit_planes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, groups, width] -> uint8 [n, groups, 8, width]: bit k of every byte in plane k."""
    shifts = shift_amounts(0, 8, 1, packed.device).reshape(1, 1, 8, 1)
    return (packed.unsqueeze(2) >> shifts) & 0x01


def little_endian_bits32(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> uint8 [n, 32]: bit i of the word at index i.

    gguf-py views the 4 bytes as uint32 and shifts by 0..31; bit i lives in byte i // 8 at
    position i % 8, which is this byte-wise expansion.
    """
    shifts = shift_amounts(0, 8, 1, packed.device).reshape(1, 1, 8)
    return ((packed.unsqueeze(2) >> shifts) & 0x01).reshape(packed.shape[0], 32)
