"""What the synthesizers attach to each element type: its quantizer and its random fill.

One SynthCodec per self-contained type of packformat.quant_types.QUANT_TYPES, checked against the
registry on import; codec.quantize and random_fill.random_blocks dispatch through it, and the
types they accept (QUANTIZABLE_TYPES, RANDOM_BLOCK_TYPES, the synth CLI's list) are its keys.
"""

from __future__ import annotations

import dataclasses
import functools
import types
from collections.abc import Callable, Iterable, Mapping

import numpy as np

from packformat.quant_types import QUANT_TYPES, ElementType, require_entries
from packtools.quants import kquants
from packtools.quants.fills import BlockScales, E8M0Exponent, FloatExponent, RandomFill, tie_k4_mins, tie_q2k_mins

BlockQuantizer = Callable[[np.ndarray], np.ndarray]  # float [N, block_elements] -> uint8 [N, block_bytes]


@dataclasses.dataclass(frozen=True)
class SynthCodec:
    element_type: ElementType
    random_fill: RandomFill  # makes random block bytes dequantize like trained weights
    # This package's port of llama.cpp's reference quantizer (finite input only); None where
    # gguf.quants.quantize has one.
    quantize_blocks: BlockQuantizer | None = None


def _table(entries: Iterable[SynthCodec]) -> Mapping[ElementType, SynthCodec]:
    table = {entry.element_type: entry for entry in entries}
    expected = [t for t, q in QUANT_TYPES.items() if q.self_contained]
    require_entries("packtools.quants.registry.SYNTH_CODECS", table, expected)
    return types.MappingProxyType(table)


def _k_quant(quantize_chunk: Callable[[np.ndarray], np.ndarray], element_type: ElementType) -> BlockQuantizer:
    return functools.partial(kquants.quantize_k_blocks, quantize_chunk=quantize_chunk,
                             block_bytes=QUANT_TYPES[element_type].block_bytes)


_T = ElementType
# Each d range [d_low, 2 * d_low) is d_low = 0.02 / (1.5 * rms of the random level grid times
# sub-scale): the mean d is then 1.5 * d_low and the dequantized std lands near 0.02.
# Float types keep sign and mantissa and get the exponent 2**-7 or 2**-6 (one random bit), so
# |x| lies in [0.0078, 0.031) and the std is about 0.019.
SYNTH_CODECS: Mapping[ElementType, SynthCodec] = _table([
    SynthCodec(_T.F32, FloatExponent(np.uint32, 0x80FFFFFF, 0x3C000000)),  # exponent 0b0111100x, bias 127
    SynthCodec(_T.F16, FloatExponent(np.uint16, 0x87FF, 0x2000)),  # exponent 0b0100x, bias 15
    SynthCodec(_T.BF16, FloatExponent(np.uint16, 0x80FF, 0x3C00)),  # exponent 0b0111100x, bias 127
    # int8 levels, rms 73.9
    SynthCodec(_T.Q8_0, BlockScales(0, 1.8e-4)),
    # (q - 8), rms 4.64
    SynthCodec(_T.Q4_0, BlockScales(0, 2.9e-3, signed=True)),
    # q * d + m with q in 0..15: m = -7.5 d centres the block
    SynthCodec(_T.Q4_1, BlockScales(0, 2.9e-3, centre_offset=2, centre_ratio=-7.5)),
    # (q - 16), rms 9.25
    SynthCodec(_T.Q5_0, BlockScales(0, 1.45e-3, signed=True)),
    SynthCodec(_T.Q5_1, BlockScales(0, 1.45e-3, centre_offset=2, centre_ratio=-15.5)),
    # d * sc * q - dmin * sc, sc in 8..15 (rms 11.7), q - 1.5 rms 1.12
    SynthCodec(_T.Q2_K, BlockScales(80, 1.0e-3, 82, 1.5, tie_q2k_mins), _k_quant(kquants.quantize_q2_k, _T.Q2_K)),
    # d * (sc - 32) * (q - 4): rms 18.5 * 2.35
    SynthCodec(_T.Q3_K, BlockScales(108, 3.0e-4, signed=True), _k_quant(kquants.quantize_q3_k, _T.Q3_K)),
    # d * sc * (q - 7.5), sc in 32..63 (rms 45.7), q - 7.5 rms 4.61
    SynthCodec(_T.Q4_K, BlockScales(0, 6.5e-5, 2, 7.5, tie_k4_mins), _k_quant(kquants.quantize_q4_k, _T.Q4_K)),
    SynthCodec(_T.Q5_K, BlockScales(0, 3.3e-5, 2, 15.5, tie_k4_mins), _k_quant(kquants.quantize_q5_k, _T.Q5_K)),
    # d * sc * (q - 32), int8 sc rms 73.9, rms 18.5
    SynthCodec(_T.Q6_K, BlockScales(208, 1.0e-5, signed=True), _k_quant(kquants.quantize_q6_k, _T.Q6_K)),
    # E8M0 half-scale 2**(e - 128) of 2**-9 or 2**-8; E2M1 (doubled) rms 5.85
    SynthCodec(_T.MXFP4, E8M0Exponent(119, 121)),
])
