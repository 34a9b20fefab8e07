"""Random but valid quantized blocks, fast enough for multi-GB synthetic benchmark models.

Quantizing random floats costs seconds per GB; here the bytes are random words from the
generator and only the fields that set the magnitude are rewritten in place: fp16 super-block
scales drawn from a narrow range, minimums tied to scales so every (sub-)block is centred
on zero, E8M0 exponents for MXFP4, and the exponent bits of F32/F16/BF16. Every result
dequantizes to finite values with a standard deviation near 0.02, like trained weights.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import gguf
import numpy as np

from packtools.quants.codec import ElementType, UnsupportedQuantType, element_type_of

# Each d range [d_low, 2 * d_low) is d_low = 0.02 / (1.5 * rms of the random level grid times
# sub-scale): the mean d is then 1.5 * d_low and the dequantized std lands near 0.02.


def _draw_scale(
    rng: np.random.Generator, block_count: int, d_low: float, signed: bool
) -> np.ndarray:
    d = rng.uniform(d_low, 2 * d_low, block_count).astype(np.float16)  # [N]
    if signed:
        # ggml's symmetric quantizers store d of either sign; a random sign also cancels the
        # -0.5 level bias of grids like -8..7 that would otherwise tilt every block one way
        d.view(np.uint16)[:] |= rng.integers(0, 2, block_count, dtype=np.uint16) << 15
    return d


def _write_fp16(blocks: np.ndarray, offset: int, values: np.ndarray) -> None:
    blocks[:, offset : offset + 2] = values.astype(np.float16).view(np.uint8).reshape(-1, 2)


def _tie_q2k_mins(blocks: np.ndarray) -> None:
    """Q2_K scales[16] at byte 0: scale nibble in 8..15, min nibble equal to it."""
    scales = (blocks[:, 0:16] & 0x7) | 0x8  # [N, 16] 8..15: no near-empty sub-blocks
    blocks[:, 0:16] = scales | (scales << 4)


def _tie_k4_mins(blocks: np.ndarray) -> None:
    """Q4_K/Q5_K 12-byte scales at byte 4: 6-bit scales in 32..63, each min equal to its scale.

    Bytes 4-7 hold scales 0-3 (bits 0-5) and the top bits of scales 4-7 (bits 6-7); setting
    bits 5 and 7 puts every scale in 32..63. Bytes 8-11 are the same for the mins, and bytes
    12-15 hold the low nibbles of scale and min 4-7.
    """
    blocks[:, 4:8] |= 0xA0
    blocks[:, 8:12] = blocks[:, 4:8]
    low_nibbles = blocks[:, 12:16] & 0xF
    blocks[:, 12:16] = low_nibbles | (low_nibbles << 4)


@dataclasses.dataclass(frozen=True)
class _BlockScales:
    """Where a block type keeps its fp16 scale and how to centre it."""

    d_offset: int  # byte offset of the fp16 scale d inside the block
    d_low: float  # d is drawn from [d_low, 2 * d_low)
    centre_offset: int | None = None  # fp16 min / offset field (Q4_1, Q5_1, K-quant dmin)
    centre_ratio: float = 0.0  # that field = ratio * d: the midpoint of the level grid
    tie_sub_scales: Callable[[np.ndarray], None] | None = None
    signed: bool = False  # d of random sign (types whose level grid is lopsided)


_BLOCK_SCALES: dict[ElementType, _BlockScales] = {
    # int8 levels, rms 73.9
    ElementType.Q8_0: _BlockScales(0, 1.8e-4),
    # (q - 8), rms 4.64
    ElementType.Q4_0: _BlockScales(0, 2.9e-3, signed=True),
    # q * d + m with q in 0..15: m = -7.5 d centres the block
    ElementType.Q4_1: _BlockScales(0, 2.9e-3, centre_offset=2, centre_ratio=-7.5),
    # (q - 16), rms 9.25
    ElementType.Q5_0: _BlockScales(0, 1.45e-3, signed=True),
    ElementType.Q5_1: _BlockScales(0, 1.45e-3, centre_offset=2, centre_ratio=-15.5),
    # d * sc * q - dmin * sc, sc in 8..15 (rms 11.7), q - 1.5 rms 1.12
    ElementType.Q2_K: _BlockScales(80, 1.0e-3, 82, 1.5, _tie_q2k_mins),
    # d * (sc - 32) * (q - 4): rms 18.5 * 2.35
    ElementType.Q3_K: _BlockScales(108, 3.0e-4, signed=True),
    # d * sc * (q - 7.5), sc in 32..63 (rms 45.7), q - 7.5 rms 4.61
    ElementType.Q4_K: _BlockScales(0, 6.5e-5, 2, 7.5, _tie_k4_mins),
    ElementType.Q5_K: _BlockScales(0, 3.3e-5, 2, 15.5, _tie_k4_mins),
    # d * sc * (q - 32), int8 sc rms 73.9, rms 18.5
    ElementType.Q6_K: _BlockScales(208, 1.0e-5, signed=True),
}

# Float types: keep sign and mantissa, force the exponent to 2**-7 or 2**-6 (one random bit),
# so |x| lies in [0.0078, 0.031) and the std is about 0.019. (word dtype, keep mask, set bits)
_FLOAT_EXPONENTS: dict[ElementType, tuple[type, int, int]] = {
    ElementType.F32: (np.uint32, 0x80FFFFFF, 0x3C000000),  # exponent 0b0111100x, bias 127
    ElementType.F16: (np.uint16, 0x87FF, 0x2000),  # exponent 0b0100x, bias 15
    ElementType.BF16: (np.uint16, 0x80FF, 0x3C00),  # exponent 0b0111100x, bias 127
}

# MXFP4 E8M0 exponents: half-scale 2**(e - 128) of 2**-9 or 2**-8; E2M1 (doubled) rms 5.85.
_MXFP4_EXPONENTS = (119, 121)  # [low, high)

RANDOM_BLOCK_TYPES: frozenset[ElementType] = frozenset(
    {*_BLOCK_SCALES, *_FLOAT_EXPONENTS, ElementType.MXFP4}
)


def _random_bytes(byte_count: int, rng: np.random.Generator) -> np.ndarray:
    # Full-range uint64 draws are the generator's fastest path (~1.3 GB/s, no masking).
    words = rng.integers(0, 2**64 - 1, size=-(-byte_count // 8), dtype=np.uint64, endpoint=True)
    return words.view(np.uint8)[:byte_count]


def _patch_float_exponents(raw: np.ndarray, element_type: ElementType) -> None:
    word_type, keep_mask, set_bits = _FLOAT_EXPONENTS[element_type]
    words = raw.view(word_type)  # whole buffer is a multiple of the word size
    np.bitwise_and(words, word_type(keep_mask), out=words)
    np.bitwise_or(words, word_type(set_bits), out=words)


def _patch_block_scales(
    blocks: np.ndarray, element_type: ElementType, rng: np.random.Generator
) -> None:
    layout = _BLOCK_SCALES[element_type]
    d = _draw_scale(rng, blocks.shape[0], layout.d_low, layout.signed)  # [N] fp16
    _write_fp16(blocks, layout.d_offset, d)
    if layout.centre_offset is not None:
        _write_fp16(
            blocks, layout.centre_offset, d.astype(np.float32) * np.float32(layout.centre_ratio)
        )
    if layout.tie_sub_scales is not None:
        layout.tie_sub_scales(blocks)


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
    block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
    if shape[-1] % block_elements:
        raise ValueError(
            f"last dimension {shape[-1]} is not a multiple of the {element_type.name} block "
            f"of {block_elements} elements"
        )
    block_count = math.prod(shape) // block_elements
    raw = _random_bytes(block_count * type_size, rng)  # [N * type_size]
    if element_type in _FLOAT_EXPONENTS:
        _patch_float_exponents(raw, element_type)
    elif element_type == ElementType.MXFP4:
        blocks = raw.reshape(block_count, type_size)
        blocks[:, 0] = rng.integers(*_MXFP4_EXPONENTS, size=block_count, dtype=np.uint8)
    else:
        _patch_block_scales(raw.reshape(block_count, type_size), element_type, rng)
    return raw.reshape(*shape[:-1], shape[-1] // block_elements * type_size)
