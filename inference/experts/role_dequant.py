"""Turn a batch of experts' raw role bytes into weights of the compute dtype, on their device.

F32/F16/BF16 roles are reinterpreted in place on the device (their bytes are the values, so no
kernel is needed). Quantized roles go through `inference.dequant.dequantize_many`, whose
float32 results are bit-identical to gguf-py's and whose other dtypes are that result rounded
once — the same weights transformers holds after loading gguf-py-dequantized tensors.
Block-scaled roles (F4_E2M1X2 + UE8M0) go through `dequantize_scaled_many` with their scales.
"""

from __future__ import annotations

import torch

from inference.dequant import dequantize_many, dequantize_scaled_many
from inference.dequant.registry import DEQUANTIZERS
from packformat.constants import ElementType, tensor_nbytes

# the plain float types: their bytes are their values
FLOAT_VIEWS: dict[ElementType, torch.dtype] = {t: d.float_dtype for t, d in DEQUANTIZERS.items() if d.float_dtype}


def dequantize_roles(raw: torch.Tensor, element_type: int, role_shape: tuple[int, ...],
                     out_dtype: torch.dtype) -> torch.Tensor:
    """uint8 [n, nbytes] (one contiguous row per expert) -> out_dtype [n, *role_shape] on raw's device."""
    assert raw.dim() == 2 and raw.shape[1] == tensor_nbytes(element_type, role_shape), (tuple(raw.shape), role_shape)
    float_dtype = FLOAT_VIEWS.get(ElementType(element_type))
    if float_dtype is not None:
        # rows are fresh (torch.cat) or arena slots sliced at a role offset: 256-byte aligned, so
        # reinterpreting them as any float type is a view
        return raw.view(float_dtype).reshape(raw.shape[0], *role_shape).to(out_dtype)
    return dequantize_many(raw, element_type, role_shape, out_dtype)


def dequantize_scaled_roles(raw: torch.Tensor, scales: torch.Tensor, element_type: int, role_shape: tuple[int, ...],
                            scale_type: int, scale_shape: tuple[int, ...], out_dtype: torch.dtype) -> torch.Tensor:
    """uint8 [n, nbytes] weights with uint8 [n, scale bytes] block scales -> out_dtype [n, *role_shape]."""
    assert raw.dim() == 2 and raw.shape[1] == tensor_nbytes(element_type, role_shape), (tuple(raw.shape), role_shape)
    assert scales.dim() == 2 and scales.shape[1] == tensor_nbytes(scale_type, scale_shape), (
        tuple(scales.shape), scale_shape)
    return dequantize_scaled_many(raw, scales, element_type, role_shape, scale_type, scale_shape, out_dtype)
