"""Random fills: rewrite the magnitude fields of random block bytes so they dequantize like weights.

random_fill.random_blocks draws random words; the fill of a type (packtools.quants.registry)
then rewrites, in place, only the fields that set the magnitude: fp16 super-block scales drawn
from a narrow range, minimums tied to scales so every (sub-)block is centred on zero, E8M0
exponents for MXFP4, and the exponent bits of F32/F16/BF16. Every result dequantizes to finite
values with a standard deviation near 0.02, like trained weights.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

# A fill: uint8 blocks [N, block_bytes] of random bytes, rewritten in place.
RandomFill = Callable[[np.ndarray, np.random.Generator], None]


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


@dataclasses.dataclass(frozen=True)
class BlockScales:
    """Where a block type keeps its fp16 scale and how to centre it."""

    d_offset: int  # byte offset of the fp16 scale d inside the block
    d_low: float  # d is drawn from [d_low, 2 * d_low)
    centre_offset: int | None = None  # fp16 min / offset field (Q4_1, Q5_1, K-quant dmin)
    centre_ratio: float = 0.0  # that field = ratio * d: the midpoint of the level grid
    tie_sub_scales: Callable[[np.ndarray], None] | None = None
    signed: bool = False  # d of random sign (types whose level grid is lopsided)

    def __call__(self, blocks: np.ndarray, rng: np.random.Generator) -> None:
        d = _draw_scale(rng, blocks.shape[0], self.d_low, self.signed)  # [N] fp16
        _write_fp16(blocks, self.d_offset, d)
        if self.centre_offset is not None:
            _write_fp16(blocks, self.centre_offset, d.astype(np.float32) * np.float32(self.centre_ratio))
        if self.tie_sub_scales is not None:
            self.tie_sub_scales(blocks)


@dataclasses.dataclass(frozen=True)
class FloatExponent:
    """Float types: keep sign and mantissa, force the exponent bits (draws nothing)."""

    word_type: type  # the float's width as an unsigned numpy type
    keep_mask: int
    set_bits: int

    def __call__(self, blocks: np.ndarray, rng: np.random.Generator) -> None:
        words = blocks.reshape(-1).view(self.word_type)  # the buffer is a multiple of the word size
        np.bitwise_and(words, self.word_type(self.keep_mask), out=words)
        np.bitwise_or(words, self.word_type(self.set_bits), out=words)


@dataclasses.dataclass(frozen=True)
class E8M0Exponent:
    """A block whose first byte is a shared E8M0 exponent (MXFP4), drawn from [low, high)."""

    low: int
    high: int

    def __call__(self, blocks: np.ndarray, rng: np.random.Generator) -> None:
        blocks[:, 0] = rng.integers(self.low, self.high, size=blocks.shape[0], dtype=np.uint8)


def tie_q2k_mins(blocks: np.ndarray) -> None:
    """Q2_K scales[16] at byte 0: scale nibble in 8..15, min nibble equal to it."""
    scales = (blocks[:, 0:16] & 0x7) | 0x8  # [N, 16] 8..15: no near-empty sub-blocks
    blocks[:, 0:16] = scales | (scales << 4)


def tie_k4_mins(blocks: np.ndarray) -> None:
    """Q4_K/Q5_K 12-byte scales at byte 4: 6-bit scales in 32..63, each min equal to its scale.

    Bytes 4-7 hold scales 0-3 (bits 0-5) and the top bits of scales 4-7 (bits 6-7); setting
    bits 5 and 7 puts every scale in 32..63. Bytes 8-11 are the same for the mins, and bytes
    12-15 hold the low nibbles of scale and min 4-7.
    """
    blocks[:, 4:8] |= 0xA0
    blocks[:, 8:12] = blocks[:, 4:8]
    low_nibbles = blocks[:, 12:16] & 0xF
    blocks[:, 12:16] = low_nibbles | (low_nibbles << 4)
