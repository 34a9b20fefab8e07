"""DeepSeek-V4's own checkpoint number formats: block-scaled FP8 dense weights, FP4 experts.

The official DeepSeek-V4 checkpoint stores
- dense projections as float8_e4m3fn `X.weight` [out, in] plus `X.scale` [ceil(out/128),
  ceil(in/128)] of UE8M0 bytes (2**(b - 127)), one per 128x128 block (llama.cpp's converter,
  DeepseekV4Model.dequant_model, reads the scale the same way);
- routed experts as int8 `X.weight` [out, in/2] holding two E2M1 codes per byte (element 2j in
  the low nibble) plus `X.scale` [out, in/32] UE8M0, one per 32 elements of a row.

Dequantized FP8 is exact in bfloat16 whenever every block scale lies in [2**-124, 2**119]:
an e4m3 value has at most 4 significant bits between 2**-9 (smallest subnormal) and 1.75 * 2**8,
so the product's bits lie in [2**-133, 2**128), bfloat16's range including its subnormals. Wider
scales fall back to float32 (exact down to 2**-149; above 2**119 nothing smaller than float64
holds the product, and such a weight is refused).
"""

from __future__ import annotations

import torch

FP8_BLOCK = 128  # rows and columns per FP8 scale block (quantization_config.weight_block_size)
FP4_GROUP = 32  # elements of a row per FP4 scale
E8M0_BIAS = 127
E8M0_NAN = 0xFF
# biased exponent bytes whose FP8 products bfloat16 holds exactly (see the module docstring)
BF16_EXACT_SCALE_BYTES = range(E8M0_BIAS - 124, E8M0_BIAS + 119 + 1)
FLOAT32_MAX_SCALE_BYTE = E8M0_BIAS + 119
# E2M1 code -> value; codes 8..15 are the negatives of 0..7 (8 is -0.0)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
FP8_E4M3_MAX = 448.0
E2M1_MAX = 6.0


class DeepseekV4FormatError(ValueError):
    """A weight/scale pair that does not fit DeepSeek-V4's formats; names the tensor."""


def fp8_scale_shape(weight_shape: tuple[int, ...]) -> tuple[int, int]:
    """[ceil(out/128), ceil(in/128)]: the scale grid of an FP8 weight [out, in]."""
    rows, cols = weight_shape
    return (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK))


def fp4_scale_shape(packed_shape: tuple[int, ...]) -> tuple[int, int]:
    """[out, in/32] for a packed FP4 weight [out, in/2]."""
    rows, packed_cols = packed_shape
    return (rows, packed_cols * 2 // FP4_GROUP)


def e8m0_to_float(scale_bytes: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 powers of two (0xFF, NaN in the format, becomes NaN)."""
    raw = scale_bytes.view(torch.uint8).to(torch.int32)
    values = torch.ldexp(torch.ones_like(raw, dtype=torch.float32), raw - E8M0_BIAS)
    return torch.where(raw == E8M0_NAN, torch.full_like(values, float("nan")), values)


def fp8_dequantized_dtype(name: str, scale_bytes: torch.Tensor) -> torch.dtype:
    """bfloat16 when it holds every product exactly, else float32; refuses NaN/huge scales."""
    raw = scale_bytes.view(torch.uint8)
    if raw.numel() == 0:
        return torch.bfloat16
    low, high = int(raw.min()), int(raw.max())
    if high == E8M0_NAN:
        raise DeepseekV4FormatError(f"{name!r}: a block scale is 0xFF, NaN in UE8M0")
    if high > FLOAT32_MAX_SCALE_BYTE:
        raise DeepseekV4FormatError(f"{name!r}: block scale 2**{high - E8M0_BIAS} makes weights overflow float32")
    if low in BF16_EXACT_SCALE_BYTES and high in BF16_EXACT_SCALE_BYTES:
        return torch.bfloat16
    return torch.float32


def check_fp8_pair(name: str, weight_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    if len(weight_shape) != 2:
        raise DeepseekV4FormatError(f"{name!r}: FP8 weight of shape {tuple(weight_shape)} is not a matrix")
    expected = fp8_scale_shape(tuple(weight_shape))
    if tuple(scale_shape) != expected:
        raise DeepseekV4FormatError(
            f"{name!r}: scale shape {tuple(scale_shape)} does not cover weight {tuple(weight_shape)} in "
            f"{FP8_BLOCK}x{FP8_BLOCK} blocks; expected {expected}"
        )


def dequantize_fp8_blocks(name: str, weight: torch.Tensor, scale_bytes: torch.Tensor,
                          dtype: torch.dtype) -> torch.Tensor:
    """float8_e4m3fn [out, in] times its per-128x128-block UE8M0 scale, in `dtype` (exact, see above)."""
    check_fp8_pair(name, tuple(weight.shape), tuple(scale_bytes.shape))
    rows, cols = weight.shape
    scale = e8m0_to_float(scale_bytes)  # [ceil(out/128), ceil(in/128)]
    scale = scale.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]  # [out, in]
    return (weight.view(torch.float8_e4m3fn).to(torch.float32) * scale).to(dtype)


def dequantize_fp4_groups(packed: torch.Tensor, scale_bytes: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 [out, in/2] with UE8M0 [out, in/32] -> float32 [out, in] (a reference for tests)."""
    codes = packed.contiguous().view(torch.uint8)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    values = torch.stack((table[(codes & 0xF).long()], table[(codes >> 4).long()]), dim=-1)  # [out, in/2, 2]
    values = values.reshape(codes.shape[0], -1)  # [out, in], element 2j from the low nibble
    scale = e8m0_to_float(scale_bytes).repeat_interleave(FP4_GROUP, 1)  # [out, in]
    return values * scale


def _power_of_two_scale_bytes(amax: torch.Tensor, largest_code: float) -> torch.Tensor:
    """The smallest power of two s with amax / s <= largest_code, as UE8M0 bytes (clamped)."""
    tiny = torch.finfo(torch.float32).tiny
    exponent = torch.ceil(torch.log2(torch.clamp(amax, min=tiny) / largest_code))
    return torch.clamp(exponent + E8M0_BIAS, 0, E8M0_NAN - 1).to(torch.uint8)


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (float8_e4m3fn [out, in], UE8M0 bytes [ceil(out/128), ceil(in/128)]),
    power-of-two block scales as DeepSeek's ue8m0 checkpoints use."""
    rows, cols = weight.shape
    grid = fp8_scale_shape((rows, cols))
    padded = torch.zeros(grid[0] * FP8_BLOCK, grid[1] * FP8_BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.reshape(grid[0], FP8_BLOCK, grid[1], FP8_BLOCK)  # [R, 128, C, 128]
    scale_bytes = _power_of_two_scale_bytes(blocks.abs().amax(dim=(1, 3)), FP8_E4M3_MAX)  # [R, C]
    scale = e8m0_to_float(scale_bytes).repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return (weight.float() / scale).to(torch.float8_e4m3fn), scale_bytes


def quantize_fp4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [out, in] -> (int8 [out, in/2] packed E2M1, UE8M0 bytes [out, in/32]), nearest code."""
    rows, cols = weight.shape
    if cols % FP4_GROUP:
        raise DeepseekV4FormatError(f"FP4 rows need a multiple of {FP4_GROUP} elements, got {cols}")
    groups = weight.float().reshape(rows, cols // FP4_GROUP, FP4_GROUP)
    scale_bytes = _power_of_two_scale_bytes(groups.abs().amax(dim=2), E2M1_MAX)  # [out, in/32]
    scaled = groups / e8m0_to_float(scale_bytes).unsqueeze(-1)  # |x| <= 6
    table = torch.tensor(E2M1_VALUES[:8])
    magnitude_code = (scaled.abs().unsqueeze(-1) - table).abs().argmin(dim=-1)  # nearest of 0..6
    codes = (magnitude_code + 8 * (scaled < 0)).to(torch.uint8).reshape(rows, cols)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)  # element 2j low nibble, 2j+1 high
    return packed.view(torch.int8), scale_bytes
