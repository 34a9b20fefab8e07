"""F4_E2M1X2 weights with UE8M0 block scales: torch dequantization against three references.

1. the numpy reference written from the format's definition (tests/packtools/fp4_checkpoint.py),
   bit for bit over every code byte and every scale byte;
2. gguf-py's MXFP4 dequantizer on the same values repacked into GGML MXFP4 blocks the way
   llama.cpp's `repack_mxfp4_blocks` (conversion/base.py) does it: a golden check of the nibble
   order and of the scale exponent (GGML doubles the E2M1 table and halves the scale);
3. transformers' own FP4 dequantization (Fp8Dequantize._dequantize_one, the loader's path for
   DeepSeek-V4 FP4 experts).
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from fp4_checkpoint import GROUP, reference_dequantize

from inference.dequant import (
    BackendUnavailableError,
    ByteLengthError,
    RawTensorError,
    ShapeError,
    UnsupportedTypeError,
    dequantize,
    dequantize_many,
    dequantize_scaled,
    dequantize_scaled_many,
)
from packformat.constants import ElementType

F4, UE8M0 = ElementType.F4_E2M1X2, ElementType.UE8M0
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _exhaustive() -> tuple[np.ndarray, np.ndarray]:
    """Codes: every byte value in every position of a group; scales: every byte value, NaN included."""
    # [256 rows, 256 bytes] = 512 elements a row; row r is every byte value, rotated by r
    codes = ((np.arange(256)[None, :] + np.arange(256)[:, None]) % 256).astype(np.uint8)
    scales = (np.arange(256 * 16, dtype=np.int64).reshape(256, 16) * 7 % 256).astype(np.uint8)
    assert set(scales.ravel()) == set(range(256))
    return codes, scales


def _bits_equal(got: torch.Tensor, expected: np.ndarray) -> bool:
    """Bitwise equality, except that any NaN matches any NaN."""
    got_np = got.cpu().numpy()
    both_nan = np.isnan(got_np) & np.isnan(expected)
    return bool(np.all((got_np.view(np.uint32) == expected.view(np.uint32)) | both_nan))


@pytest.mark.parametrize("device", DEVICES)
def test_every_code_and_scale_matches_the_numpy_reference_bit_for_bit(device):
    codes, scales = _exhaustive()
    expected = reference_dequantize(codes, scales)  # f32 [256, 512]
    got = dequantize_scaled(torch.from_numpy(codes.ravel()).to(device), torch.from_numpy(scales.ravel()).to(device),
                            F4, (256, 512), UE8M0, (256, 16))
    assert got.dtype == torch.float32 and got.shape == (256, 512) and got.device.type == device
    assert _bits_equal(got, expected)
    assert np.isnan(expected).sum() == 32 * np.count_nonzero(scales == 0xFF)  # 0xFF really is NaN
    for dtype in (torch.bfloat16, torch.float16):  # one rounding of the float32 result
        rounded = dequantize_scaled(torch.from_numpy(codes.ravel()).to(device),
                                    torch.from_numpy(scales.ravel()).to(device), F4, (256, 512), UE8M0, (256, 16),
                                    out_dtype=dtype)
        assert torch.equal(rounded.float().nan_to_num(7.0), torch.from_numpy(expected).to(device).to(dtype)
                           .float().nan_to_num(7.0))


def _repack_as_ggml_mxfp4(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """llama.cpp's repack_mxfp4_blocks in numpy: per 32-element group, the scale byte, then 16
    bytes where byte j holds element j (low nibble) and element j + 16 (high nibble)."""
    rows, half = codes.shape
    groups = 2 * half // GROUP
    src = codes.reshape(rows, groups, GROUP // 2)
    elements = np.stack([src & 0x0F, src >> 4], axis=-1).reshape(rows, groups, GROUP)  # 2j low, 2j+1 high
    qs = elements[:, :, :16] | (elements[:, :, 16:] << 4)
    return np.concatenate([scales[:, :, None], qs.astype(np.uint8)], axis=-1).reshape(rows, groups * 17)


def test_gguf_py_mxfp4_of_the_repacked_blocks_agrees_except_scale_255_and_negative_zero():
    codes, scales = _exhaustive()
    ours = dequantize_scaled(torch.from_numpy(codes.ravel()), torch.from_numpy(scales.ravel()), F4, (256, 512),
                             UE8M0, (256, 16))
    blocks = _repack_as_ggml_mxfp4(codes, scales)
    with np.errstate(over="ignore"):
        ggml = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).reshape(256, 512)
    finite_scale = np.repeat(scales != 0xFF, GROUP, axis=1)  # GGML reads 0xFF as 2**127, OCP as NaN
    assert finite_scale.sum() > 250 * 512
    # code 8 is -0 in E2M1 (OCP, transformers, torch.float4_e2m1fn_x2); GGML's integer table has +0
    # there. Adding +0.0 maps -0 to +0 and leaves every other float32 bit pattern as it is.
    ours_np = ours.numpy()[finite_scale] + np.float32(0.0)
    assert np.array_equal(ours_np.view(np.uint32), ggml[finite_scale].view(np.uint32))
    negative_zero = np.signbit(ours.numpy()) & (ours.numpy() == 0)
    nibbles = np.stack([codes & 0x0F, codes >> 4], axis=-1).reshape(256, 512)  # element 2j low, 2j+1 high
    assert np.array_equal(negative_zero[finite_scale], (nibbles == 8)[finite_scale])
    # the same check through our own GGML MXFP4 dequantizer, which is bit-exact with gguf-py
    ggml_torch = dequantize(torch.from_numpy(blocks.ravel()), ElementType.MXFP4, (256, 512))
    assert torch.equal(ours[torch.from_numpy(finite_scale)] + 0.0, ggml_torch[torch.from_numpy(finite_scale)])


def test_transformers_fp4_dequantization_agrees():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    rng = np.random.default_rng(3)
    codes = rng.integers(0, 256, (64, 128), dtype=np.uint8)
    scales = rng.integers(100, 150, (64, 8), dtype=np.uint8)
    theirs = Fp8Dequantize(None)._dequantize_one(torch.from_numpy(codes).view(torch.int8),
                                                 torch.from_numpy(scales).view(torch.float8_e8m0fnu),
                                                 output_dtype=torch.float32)
    ours = dequantize_scaled(torch.from_numpy(codes.ravel()), torch.from_numpy(scales.ravel()), F4, (64, 256),
                             UE8M0, (64, 8))
    assert torch.equal(ours, theirs)


@pytest.mark.parametrize("device", DEVICES)
def test_many_experts_from_strided_arena_rows(device):
    rng = np.random.default_rng(1)
    experts = [(rng.integers(0, 256, (16, 32), dtype=np.uint8), rng.integers(110, 130, (16, 2), dtype=np.uint8))
               for _ in range(3)]
    arena = torch.zeros(3, 1024, dtype=torch.uint8, device=device)  # slots larger than the role bytes
    for i, (codes, scales) in enumerate(experts):
        arena[i, :512] = torch.from_numpy(codes.ravel())
        arena[i, 768:800] = torch.from_numpy(scales.ravel())
    got = dequantize_scaled_many(arena[:, :512], arena[:, 768:800], F4, (16, 64), UE8M0, (16, 2))
    listed = dequantize_scaled_many(list(arena[:, :512]), list(arena[:, 768:800]), F4, (16, 64), UE8M0, (16, 2),
                                    out_dtype=torch.bfloat16)
    for i, (codes, scales) in enumerate(experts):
        expected = torch.from_numpy(reference_dequantize(codes, scales)).to(device)
        assert torch.equal(got[i], expected)
        assert torch.equal(listed[i], expected.to(torch.bfloat16))
    empty = dequantize_scaled_many(arena[:0, :512], arena[:0, 768:800], F4, (16, 64), UE8M0, (16, 2))
    assert empty.shape == (0, 16, 64)


def test_ue8m0_alone_dequantizes_to_its_scale_values():
    raw = torch.tensor([0, 1, 126, 127, 128, 254, 255], dtype=torch.uint8)
    got = dequantize(raw, UE8M0, (7,))
    assert torch.equal(got[:-1], raw[:-1].view(torch.float8_e8m0fnu).float())  # torch's own cast
    assert got[-1].isnan()
    assert dequantize_many(raw.reshape(1, 7), UE8M0, (7,)).shape == (1, 7)


def _z(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


ERRORS = [
    ("F4 alone", lambda: dequantize(_z(32), F4, (2, 32)), UnsupportedTypeError, "UE8M0 block scales"),
    ("unscaled weight type", lambda: dequantize_scaled(_z(68), _z(2), ElementType.Q8_0, (2, 32), UE8M0, (2, 1)),
     UnsupportedTypeError, "takes no block scales"),
    ("wrong scale type", lambda: dequantize_scaled(_z(32), _z(4), F4, (2, 32), ElementType.F16, (2, 1)),
     UnsupportedTypeError, "F4_E2M1X2 weights take UE8M0 scales"),
    ("group of 16", lambda: dequantize_scaled(_z(32), _z(4), F4, (2, 32), UE8M0, (2, 2)), ShapeError, "groups of [32]"),
    ("rows differ", lambda: dequantize_scaled(_z(32), _z(3), F4, (2, 32), UE8M0, (3, 1)), ShapeError, "(3, 1)"),
    ("odd row", lambda: dequantize_scaled(_z(32), _z(2), F4, (2, 31), UE8M0, (2, 1)), ShapeError, "2-element block"),
    ("short weight", lambda: dequantize_scaled(_z(31), _z(2), F4, (2, 32), UE8M0, (2, 1)), ByteLengthError,
     "needs 32 bytes, got 31 (weight_raw)"),
    ("short scales", lambda: dequantize_scaled(_z(32), _z(1), F4, (2, 32), UE8M0, (2, 1)), ByteLengthError,
     "needs 2 bytes, got 1 (scale_raw)"),
    ("batch sizes differ", lambda: dequantize_scaled_many(torch.zeros(2, 32, dtype=torch.uint8),
                                                          torch.zeros(3, 2, dtype=torch.uint8), F4, (2, 32), UE8M0,
                                                          (2, 1)), RawTensorError, "2 weight rows but 3 scale rows"),
    ("not uint8", lambda: dequantize_scaled(_z(32).to(torch.int8), _z(2), F4, (2, 32), UE8M0, (2, 1)),
     RawTensorError, "uint8"),
    ("triton", lambda: dequantize_scaled(_z(32), _z(2), F4, (2, 32), UE8M0, (2, 1), backend="triton"),
     BackendUnavailableError, "no triton kernel"),
]


@pytest.mark.parametrize(("name", "call", "error", "message"), ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input_is_refused_by_name(name, call, error, message):
    with pytest.raises(error) as caught:
        call()
    assert message in str(caught.value)
