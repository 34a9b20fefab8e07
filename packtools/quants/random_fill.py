"""Random but valid quantized blocks, fast enough for multi-GB synthetic benchmark models.

Quantizing random floats costs seconds per GB; here the bytes are random words from the
generator and the type's fill (packtools.quants.fills, chosen in packtools.quants.registry)
rewrites only the fields that set the magnitude. Every result dequantizes to finite values with
a standard deviation near 0.02, like trained weights.
"""

from __future__ import annotations

import math

import numpy as np

from packformat.quant_types import ElementType, block_shape
from packtools.quants.codec import UnsupportedQuantType, element_type_of
from packtools.quants.registry import SYNTH_CODECS

RANDOM_BLOCK_TYPES: frozenset[ElementType] = frozenset(SYNTH_CODECS)


def _random_bytes(byte_count: int, rng: np.random.Generator) -> np.ndarray:
    # Full-range uint64 draws are the generator's fastest path (~1.3 GB/s, no masking).
    words = rng.integers(0, 2**64 - 1, size=-(-byte_count // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:byte_count]


def random_blocks(
    element_type: object, shape: tuple[int, ...], rng: np.random.Generator
) -> np.ndarray:
    """Random valid bytes of a tensor of logical `shape` -> uint8 [*shape[:-1], row bytes].

    The last dim must be a whole number of blocks. Raises UnsupportedQuantType for a type
    outside RANDOM_BLOCK_TYPES.
    """
    element_type = element_type_of(element_type, "random_blocks")
    if element_type not in RANDOM_BLOCK_TYPES:
        raise UnsupportedQuantType(element_type, "random_blocks")
    shape = tuple(int(dim) for dim in shape)
    if not shape or any(dim < 0 for dim in shape):
        raise ValueError(f"random_blocks needs a non-empty shape of sizes >= 0, got {shape}")
    block_elements, type_size = block_shape(element_type)
    if shape[-1] % block_elements:
        raise ValueError(
            f"last dimension {shape[-1]} is not a multiple of the {element_type.name} block "
            f"of {block_elements} elements"
        )
    block_count = math.prod(shape) // block_elements
    raw = _random_bytes(block_count * type_size, rng)  # [N * type_size]
    SYNTH_CODECS[element_type].random_fill(raw.reshape(block_count, type_size), rng)
    return raw.reshape(*shape[:-1], shape[-1] // block_elements * type_size)
