"""Dequantize expert bytes (GGML block formats) on their device, bit-exact with gguf-py.

dequantize(raw, element_type, shape) -> tensor; dequantize_many(raws, ...) -> [N, *shape].
The torch backend runs everywhere; triton kernels are used on CUDA when triton is present.
"""

from inference.dequant.api import (
    TORCH_DEQUANTIZERS,
    check_type_and_shape,
    dequantize,
    dequantize_many,
    triton_backend,
)
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
    "check_type_and_shape",
    "dequantize",
    "dequantize_many",
    "triton_backend",
]
