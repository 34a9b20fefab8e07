"""Torch dequantizers of the pack's own types: F4_E2M1X2 weights scaled by UE8M0 block scales.

Format (docs/pack-format.md, "Element types of the pack's own"): a F4_E2M1X2 row of `cols`
elements is cols/2 bytes, element 2j in the low nibble of byte j and 2j+1 in the high nibble —
the order of llama.cpp's `repack_mxfp4_blocks` ("element 2i in the low nibble, 2i+1 in the high
one", vendor/llama.cpp/conversion/base.py) and of transformers' `_unpack_fp4`
(integrations/finegrained_fp8.py: `stack([lut[low], lut[high]])`). A nibble is sign (bit 3) and
E2M1 magnitude (0, 0.5, 1, 1.5, 2, 3, 4, 6); code 8 is -0.0, as in transformers' table (GGML's
integer MXFP4 table has +0 there, the only difference in value). A UE8M0 byte b is 2**(b - 127) (b = 0 gives the
float32 subnormal 2**-127), and 255 is NaN, as torch.float8_e8m0fnu casts it. Element k of a row
is value(k) * scale(k // group).

Every product is exact in float32 (a 2-significant-bit value times a power of two) except where
it overflows to inf, so any correct evaluation, numpy's included, gives the same bits.
"""

from __future__ import annotations

import torch

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
UE8M0_BIAS = 127
UE8M0_NAN = 0xFF
_F32_2_POW_MINUS_127 = 0x00400000  # bits of 2**-127, a float32 subnormal (mantissa bit 22)
_F32_QUIET_NAN = 0x7FC00000


def e2m1_table(device: torch.device) -> torch.Tensor:
    """float32 [16]: the value of each 4-bit E2M1 code."""
    return torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n] (two codes a byte) -> float32 [..., 2n]: low nibble first, then high."""
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1)  # uint8 [..., n, 2]
    values = e2m1_table(packed.device)[codes.long()]  # f32 [..., n, 2]
    return values.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def ue8m0_to_float32(scales: torch.Tensor) -> torch.Tensor:
    """uint8 [...] biased exponents -> float32 [...] 2**(b - 127), built bit by bit (exact)."""
    exponent = scales.to(torch.int32)
    bits = exponent << 23  # float32 with that biased exponent and a zero mantissa, for b in 1..254
    bits = torch.where(exponent == 0, torch.full_like(bits, _F32_2_POW_MINUS_127), bits)
    bits = torch.where(exponent == UE8M0_NAN, torch.full_like(bits, _F32_QUIET_NAN), bits)
    return bits.view(torch.float32)


def dequantize_ue8m0(blocks: torch.Tensor) -> torch.Tensor:
    """UE8M0 as a standalone tensor: uint8 [n, 1] -> float32 [n, 1] scale values."""
    return ue8m0_to_float32(blocks)


def dequantize_f4_e2m1x2_ue8m0(weights: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [rows, cols/2] codes and uint8 [rows, cols/group] scales -> float32 [rows, cols].

    rows may be any flattening of the leading dims (experts x output rows).
    """
    rows, half_cols = weights.shape
    cols = 2 * half_cols
    values = unpack_e2m1(weights).view(rows, cols // group, group)  # f32 [rows, groups, group]
    scale = ue8m0_to_float32(scales).view(rows, cols // group, 1)  # f32 [rows, groups, 1]
    return (values * scale).view(rows, cols)
