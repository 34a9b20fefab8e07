"""quantize / dequantize over every element type a pack may hold.

gguf-py is the reference: it quantizes the legacy types, F16/BF16 and MXFP4, and it
dequantizes everything; the K-quants it cannot quantize come from `kquants`. Byte layouts are
gguf-py's: [..., n] floats become [..., n / block * type_size] uint8.
"""

from __future__ import annotations

import functools

import gguf
import numpy as np

from packtools.quants.registry import SYNTH_CODECS

ElementType = gguf.GGMLQuantizationType


class UnsupportedQuantType(ValueError):
    """The element type is not one this module can produce (or gguf-py can read)."""

    def __init__(self, element_type: object, operation: str):
        self.element_type = element_type
        name = element_type.name if isinstance(element_type, ElementType) else repr(element_type)
        super().__init__(f"{operation} does not support element type {name}")


# Types quantize() produces: the pack's self-contained GGML types (constants.SELF_CONTAINED_TYPES).
QUANTIZABLE_TYPES: frozenset[ElementType] = frozenset(SYNTH_CODECS)


def element_type_of(element_type: object, operation: str) -> ElementType:
    """Normalise an int or enum to ElementType; UnsupportedQuantType for an unknown id."""
    try:
        return ElementType(element_type)
    except ValueError:
        raise UnsupportedQuantType(element_type, operation) from None


def _check_row_length(length: int, element_type: ElementType, what: str) -> None:
    block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
    unit = block_elements if what == "elements" else type_size
    if length % unit:
        raise ValueError(
            f"last dimension of {length} {what} is not a multiple of the {element_type.name} "
            f"block of {unit} {what}"
        )


def quantize(values: np.ndarray, element_type: object) -> np.ndarray:
    """Float array [..., n] -> uint8 [..., n / block * type_size] in gguf-py's byte layout.

    F32/F16/BF16 come back as their raw little-endian bytes. Raises UnsupportedQuantType for a
    type outside QUANTIZABLE_TYPES, ValueError when n is not a whole number of blocks or when
    a K-quant input holds NaN/inf.
    """
    element_type = element_type_of(element_type, "quantize")
    if element_type not in QUANTIZABLE_TYPES:
        raise UnsupportedQuantType(element_type, "quantize")
    values = np.asarray(values)
    if values.ndim == 0:
        raise ValueError("quantize needs an array with at least one dimension")
    if not np.issubdtype(values.dtype, np.floating):
        raise TypeError(f"quantize needs floating-point values, got dtype {values.dtype}")
    _check_row_length(values.shape[-1], element_type, "elements")

    quantize_blocks = SYNTH_CODECS[element_type].quantize_blocks
    if quantize_blocks is not None:
        # The scale searches assume finite input; NaN/inf would silently yield garbage blocks.
        finite = np.isfinite(values)
        if not finite.all():
            index = tuple(int(i) for i in np.unravel_index(int(np.argmin(finite)), values.shape))
            raise ValueError(
                f"cannot quantize non-finite value {values[index]} at index {index} "
                f"to {element_type.name}"
            )
        block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
        blocks = values.reshape(-1, block_elements)  # [N, 256]
        raw = quantize_blocks(blocks)  # [N, type_size]
        return raw.reshape(*values.shape[:-1], values.shape[-1] // block_elements * type_size)
    quantized = np.ascontiguousarray(gguf.quants.quantize(values, element_type))
    if np.shares_memory(quantized, values):
        quantized = quantized.copy()  # F32 input comes back as itself: never alias the caller
    # F32/F16 come back as typed floats; their bytes are the layout (uint8 view widens the row).
    return quantized.view(np.uint8)


def dequantize(raw: np.ndarray, element_type: object) -> np.ndarray:
    """uint8 [..., bytes] -> float32 [..., bytes / type_size * block]: gguf-py's dequantizer.

    For F32 the result may be a view of `raw`. Raises UnsupportedQuantType for a type gguf-py
    cannot read, ValueError for a ragged row.
    """
    element_type = element_type_of(element_type, "dequantize")
    raw = np.ascontiguousarray(raw)
    if raw.dtype != np.uint8:
        raise TypeError(f"dequantize needs uint8 bytes, got dtype {raw.dtype}")
    if raw.ndim == 0:
        raise ValueError("dequantize needs an array with at least one dimension")
    if not _gguf_can_dequantize(element_type):
        raise UnsupportedQuantType(element_type, "dequantize")
    _check_row_length(raw.shape[-1], element_type, "bytes")
    return gguf.quants.dequantize(raw, element_type).astype(np.float32, copy=False)


@functools.cache
def _gguf_can_dequantize(element_type: ElementType) -> bool:
    """gguf-py has no public list of what it reads: ask it to decode one zero block."""
    if element_type not in gguf.GGML_QUANT_SIZES:
        return False
    type_size = gguf.GGML_QUANT_SIZES[element_type][1]
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), dtype=np.uint8), element_type)
    except NotImplementedError:
        return False
    return True
