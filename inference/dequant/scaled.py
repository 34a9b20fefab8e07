"""dequantize_scaled / dequantize_scaled_many: weights whose values need a companion scale tensor.

A F4_E2M1X2 role holds 4-bit codes only; its block scales are a second role (UE8M0), so both byte
tensors come in together with both logical shapes: weight [..., cols], scales [..., cols / group].
The torch backend runs on any device (a handful of elementwise ops); there is no triton kernel
for these types, so backend="triton" is refused rather than silently served by torch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from inference.dequant import torch_scaled
from inference.dequant.api import Backend, byte_rows, check_out_dtype, check_raw, check_type_and_shape
from inference.dequant.errors import (
    BackendUnavailableError,
    ByteLengthError,
    RawTensorError,
    ShapeError,
    UnsupportedTypeError,
)
from packformat.constants import SCALED_WEIGHT_TYPES, ElementType
from packformat.scales import scale_group_size

# (weight type, scale type) -> uint8 codes [rows, cols / 2], uint8 scales [rows, groups], group
# -> float32 [rows, cols]
_TORCH_SCALED = {
    (ElementType.F4_E2M1X2, ElementType.UE8M0): torch_scaled.dequantize_f4_e2m1x2_ue8m0,
}


def check_scaled_types_and_shapes(
    weight_type: int, weight_shape: Sequence[int], scale_type: int, scale_shape: Sequence[int]
) -> tuple[ElementType, tuple[int, ...], int, ElementType, tuple[int, ...], int, int]:
    """Validate a (weight, scale) pair; return both (type, dims, nbytes) and the group size."""
    wtype, wdims, wbytes = check_type_and_shape(weight_type, weight_shape)
    stype, sdims, sbytes = check_type_and_shape(scale_type, scale_shape)
    rule = SCALED_WEIGHT_TYPES.get(wtype)
    if rule is None:
        raise UnsupportedTypeError(wtype, "it takes no block scales; use inference.dequant.dequantize")
    if stype != rule.scale_type:
        raise UnsupportedTypeError(stype, f"{wtype.name} weights take {rule.scale_type.name} scales")
    group = scale_group_size(wdims, sdims)
    if group not in rule.group_sizes:
        raise ShapeError(wtype.name, wdims, f"scales of shape {sdims} do not divide it into groups of "
                         f"{sorted(rule.group_sizes)} along the last dimension")
    assert (wtype, stype) in _TORCH_SCALED, (wtype, stype)
    return wtype, wdims, wbytes, stype, sdims, sbytes, group


def _check_backend(wtype: ElementType, backend: Backend) -> None:
    if backend not in ("auto", "torch", "triton"):
        raise BackendUnavailableError(f"unknown backend {backend!r}; use 'auto', 'torch' or 'triton'")
    if backend == "triton":
        raise BackendUnavailableError(f"triton backend unavailable for {wtype.name}: no triton kernel")


def _dequantize_rows(weights: torch.Tensor, scales: torch.Tensor, wtype: ElementType, stype: ElementType,
                     wdims: tuple[int, ...], group: int, out_dtype: torch.dtype) -> torch.Tensor:
    """uint8 [N, wbytes] and uint8 [N, sbytes] -> out_dtype [N, *wdims]."""
    count, cols = weights.shape[0], wdims[-1]
    rows = count * math.prod(wdims[:-1])
    codes = weights.reshape(rows, cols // 2)  # uint8 [rows, cols / 2]; copies if strided
    block_scales = scales.reshape(rows, cols // group)  # uint8 [rows, groups]
    values = _TORCH_SCALED[(wtype, stype)](codes, block_scales, group)  # f32 [rows, cols]
    return values.to(out_dtype).reshape(count, *wdims)


def dequantize_scaled(
    weight_raw: torch.Tensor,
    scale_raw: torch.Tensor,
    weight_type: int,
    weight_shape: Sequence[int],
    scale_type: int,
    scale_shape: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """One weight: uint8 weight_raw [wbytes] + uint8 scale_raw [sbytes] -> out_dtype [*weight_shape].

    float32 results are exact (see torch_scaled); other dtypes are that result rounded once.
    """
    wtype, wdims, wbytes, stype, sdims, sbytes, _ = check_scaled_types_and_shapes(
        weight_type, weight_shape, scale_type, scale_shape)
    rows = []
    for raw, qtype, dims, nbytes, what in ((weight_raw, wtype, wdims, wbytes, "weight_raw"),
                                           (scale_raw, stype, sdims, sbytes, "scale_raw")):
        raw = check_raw(raw, what)
        if raw.dim() != 1:
            raise RawTensorError(f"{what} must be 1-D bytes, got shape {tuple(raw.shape)}")
        if raw.numel() != nbytes:
            raise ByteLengthError(qtype.name, dims, nbytes, raw.numel(), what)
        rows.append(raw.reshape(1, nbytes))
    return dequantize_scaled_many(rows[0], rows[1], weight_type, weight_shape, scale_type, scale_shape,
                                  out_dtype, backend)[0]


def dequantize_scaled_many(
    weights: torch.Tensor | Sequence[torch.Tensor],
    scales: torch.Tensor | Sequence[torch.Tensor],
    weight_type: int,
    weight_shape: Sequence[int],
    scale_type: int,
    scale_shape: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """N experts' weights at once: weights uint8 [N, wbytes] (or N 1-D tensors), scales likewise
    [N, sbytes], same device -> out_dtype [N, *weight_shape]."""
    wtype, wdims, wbytes, stype, sdims, sbytes, group = check_scaled_types_and_shapes(
        weight_type, weight_shape, scale_type, scale_shape)
    check_out_dtype(out_dtype)
    _check_backend(wtype, backend)
    weight_rows = byte_rows(weights, wtype, wdims, wbytes, "weights")
    scale_rows = byte_rows(scales, stype, sdims, sbytes, "scales")
    if weight_rows.shape[0] != scale_rows.shape[0]:
        raise RawTensorError(f"{weight_rows.shape[0]} weight rows but {scale_rows.shape[0]} scale rows")
    if weight_rows.device != scale_rows.device:
        raise RawTensorError(f"weights are on {weight_rows.device}, scales on {scale_rows.device}")
    if weight_rows.shape[0] == 0:
        return torch.empty((0, *wdims), dtype=out_dtype, device=weight_rows.device)
    return _dequantize_rows(weight_rows, scale_rows, wtype, stype, wdims, group, out_dtype)
