"""DeepSeek-V4's FP8 block and FP4 group formats: exact dequantization, the bf16-exactness claim."""

from __future__ import annotations

import pytest
import torch

from packtools.sources.dsv4_formats import (
    BF16_EXACT_SCALE_BYTES,
    E8M0_BIAS,
    DeepseekV4FormatError,
    dequantize_fp4_groups,
    dequantize_fp8_blocks,
    e8m0_to_float,
    fp8_dequantized_dtype,
    fp8_scale_shape,
    quantize_fp4_groups,
    quantize_fp8_blocks,
)

ALL_FP8_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
FINITE_FP8 = ALL_FP8_CODES[torch.isfinite(ALL_FP8_CODES.float())]  # every finite e4m3 value, NaNs out


@pytest.mark.parametrize("shape", [(1, 1), (128, 128), (129, 127), (300, 40), (64, 257)])
def test_fp8_dequant_matches_a_float64_reference_on_ragged_block_grids(shape):
    generator = torch.Generator().manual_seed(sum(shape))
    weight = torch.randn(shape, generator=generator, dtype=torch.float64) * 0.05
    fp8, scale = quantize_fp8_blocks(weight.float())
    assert tuple(scale.shape) == fp8_scale_shape(shape)
    got = dequantize_fp8_blocks("w", fp8, scale, torch.float32)
    rows, cols = torch.meshgrid(torch.arange(shape[0]), torch.arange(shape[1]), indexing="ij")
    block_scale = e8m0_to_float(scale).double()[rows // 128, cols // 128]  # [out, in]
    expected = fp8.double() * block_scale
    assert torch.equal(got.double(), expected)
    assert (got - weight).abs().max() <= weight.abs().max() / 8  # 3 mantissa bits: quantization, not garbage


@pytest.mark.parametrize("scale_byte, dtype", [
    (E8M0_BIAS, torch.bfloat16), (E8M0_BIAS - 20, torch.bfloat16),
    (BF16_EXACT_SCALE_BYTES.start, torch.bfloat16), (BF16_EXACT_SCALE_BYTES.stop - 1, torch.bfloat16),
    (BF16_EXACT_SCALE_BYTES.start - 1, torch.float32), (0, torch.float32),
])
def test_bf16_is_chosen_exactly_when_it_holds_every_fp8_value_times_the_scale(scale_byte, dtype):
    scale = torch.tensor([[scale_byte]], dtype=torch.uint8)
    assert fp8_dequantized_dtype("w", scale) == dtype
    for part in (FINITE_FP8[:128], FINITE_FP8[-128:]):
        weight = part.reshape(1, 128)
        exact = weight.double() * 2.0 ** (scale_byte - E8M0_BIAS)
        got = dequantize_fp8_blocks("w", weight, scale, dtype)
        assert torch.equal(got.double(), exact), f"scale byte {scale_byte}: {dtype} is not exact"
    if dtype == torch.float32:  # and bf16 really would have rounded: the fallback is needed
        tiny = dequantize_fp8_blocks("w", FINITE_FP8[:128].reshape(1, 128), scale, torch.bfloat16).double()
        assert not torch.equal(tiny, FINITE_FP8[:128].reshape(1, 128).double() * 2.0 ** (scale_byte - E8M0_BIAS))


@pytest.mark.parametrize("scale_byte, message", [(0xFF, "NaN"), (E8M0_BIAS + 120, "overflow")])
def test_scales_no_float_type_holds_are_refused_naming_the_tensor(scale_byte, message):
    with pytest.raises(DeepseekV4FormatError, match=rf"'layers\.0\.attn\.wq_a\.scale'.*{message}"):
        fp8_dequantized_dtype("layers.0.attn.wq_a.scale", torch.tensor([[scale_byte]], dtype=torch.uint8))


@pytest.mark.parametrize("weight_shape, scale_shape", [((256, 64), (1, 1)), ((256, 64), (2, 2)), ((64,), (1,))])
def test_a_scale_grid_that_does_not_cover_the_weight_is_refused(weight_shape, scale_shape):
    weight = torch.zeros(weight_shape, dtype=torch.float8_e4m3fn)
    with pytest.raises(DeepseekV4FormatError, match=r"'layers\.1\.attn\.wkv\.weight'"):
        dequantize_fp8_blocks("layers.1.attn.wkv.weight", weight, torch.zeros(scale_shape, dtype=torch.uint8),
                              torch.float32)


def test_fp4_packing_puts_even_elements_in_the_low_nibble_and_round_trips_exactly():
    codes = torch.arange(64) % 16  # every E2M1 code, twice per row of 32
    values = torch.tensor([0.0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])[codes]
    weight = (values * 0.25).reshape(2, 32)  # [out, in]; group max 6 * 0.25 -> scale 2**-2
    packed, scale = quantize_fp4_groups(weight)
    assert tuple(packed.shape) == (2, 16) and tuple(scale.shape) == (2, 1)
    assert int(packed.view(torch.uint8)[0, 0]) == (0x1 << 4) | 0x0  # elements 0 (low) and 1 (high)
    assert torch.equal(dequantize_fp4_groups(packed, scale), weight)
