"""Dequantize expert bytes (GGML block formats) on their device, bit-exact with gguf-py.

dequantize(raw, element_type, shape) -> tensor; dequantize_many(raws, ...) -> [N, *shape].
Weights with a separate block-scale role (F4_E2M1X2 + UE8M0): dequantize_scaled(_many).
The torch backend runs everywhere; triton kernels are used on CUDA when triton is present.
"""

from inference.dequant.api import (
    check_type_and_shape,
    dequantize,
    dequantize_many,
    triton_backend,
)
from inference.dequant.registry import TORCH_DEQUANTIZERS
from inference.dequant.scaled import check_scaled_types_and_shapes, dequantize_scaled, dequantize_scaled_many
from inference.dequant.errors import (
    BackendUnavailableError,
    ByteLengthError,
    DequantError,
    OutputDtypeError,
    RawTensorError,
    ShapeError,
    UnsupportedTypeError,
)

__all__ = [
    "TORCH_DEQUANTIZERS",
    "BackendUnavailableError",
    "ByteLengthError",
    "DequantError",
    "OutputDtypeError",
    "RawTensorError",
    "ShapeError",
    "UnsupportedTypeError",
    "check_scaled_types_and_shapes",
    "check_type_and_shape",
    "dequantize",
    "dequantize_many",
    "dequantize_scaled",
    "dequantize_scaled_many",
    "triton_backend",
]
