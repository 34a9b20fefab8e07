"""Quantizers for synthetic models: every pack element type, in gguf-py's byte layout.

- quantize(values, element_type): floats [..., n] -> uint8 [..., n / block * type_size];
  gguf-py where it can, this package's ports of llama.cpp's K-quant reference otherwise.
- dequantize(raw, element_type): gguf-py's dequantizer (the reference), float32 out.
- random_blocks(element_type, shape, rng): random valid bytes for multi-GB benchmark models.
"""

from packtools.quants.codec import (
    QUANTIZABLE_TYPES,
    UnsupportedQuantType,
    dequantize,
    quantize,
)
from packtools.quants.random_fill import RANDOM_BLOCK_TYPES, random_blocks

__all__ = [
    "QUANTIZABLE_TYPES",
    "RANDOM_BLOCK_TYPES",
    "UnsupportedQuantType",
    "dequantize",
    "quantize",
    "random_blocks",
]
