"""Bad input to inference.dequant: typed errors (all ValueError) that name what was wrong."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from inference.dequant import (
    BackendUnavailableError,
    ByteLengthError,
    DequantError,
    OutputDtypeError,
    RawTensorError,
    ShapeError,
    UnsupportedTypeError,
    dequantize,
    dequantize_many,
)
from packformat.constants import ElementType

REPO = Path(__file__).resolve().parents[2]


def _zeros(nbytes: int) -> torch.Tensor:
    return torch.zeros(nbytes, dtype=torch.uint8)


@pytest.mark.parametrize(
    "error_type",
    [
        BackendUnavailableError, ByteLengthError, OutputDtypeError, RawTensorError, ShapeError,
        UnsupportedTypeError,
    ],
)
def test_every_error_is_a_value_error(error_type):
    assert issubclass(error_type, DequantError) and issubclass(error_type, ValueError)


BYTE_LENGTH_CASES = [  # (type, shape, bytes given, bytes needed)
    (ElementType.Q4_K, (2, 256), 287, 288),
    (ElementType.Q4_K, (2, 256), 289, 288),
    (ElementType.MXFP4, (4, 64), 0, 136),
    (ElementType.Q8_0, (32,), 68, 34),
    (ElementType.F16, (3, 5), 32, 30),
    (ElementType.F32, (7,), 27, 28),
]


@pytest.mark.parametrize(("qtype", "shape", "given", "needed"), BYTE_LENGTH_CASES)
def test_wrong_byte_length_names_type_shape_and_lengths(qtype, shape, given, needed):
    with pytest.raises(ByteLengthError) as caught:
        dequantize(_zeros(given), qtype, shape)
    message = str(caught.value)
    assert qtype.name in message and str(shape) in message
    assert str(given) in message and str(needed) in message
    assert (caught.value.expected, caught.value.actual) == (needed, given)


SHAPE_CASES = [  # (type, shape, words the message must hold)
    (ElementType.Q4_K, (2, 100), ["Q4_K", "(2, 100)", "256"]),
    (ElementType.Q2_K, (128,), ["Q2_K", "(128,)", "256"]),
    (ElementType.Q8_0, (4, 33), ["Q8_0", "(4, 33)", "32"]),
    (ElementType.MXFP4, (16,), ["MXFP4", "(16,)", "32"]),
    (ElementType.Q6_K, (), ["Q6_K", "()", "at least one dimension"]),
    (ElementType.F32, (0, 4), ["F32", "(0, 4)", "positive"]),
    (ElementType.BF16, (4, -2), ["BF16", "(4, -2)", "positive"]),
]


@pytest.mark.parametrize(("qtype", "shape", "words"), SHAPE_CASES)
def test_bad_shape_is_refused_before_bytes_are_read(qtype, shape, words):
    with pytest.raises(ShapeError) as caught:
        dequantize(_zeros(1), qtype, shape)
    for word in words:
        assert word in str(caught.value)


UNSUPPORTED_CASES = [
    (ElementType.IQ2_XXS, "IQ2_XXS"),
    (ElementType.Q8_1, "Q8_1"),
    (ElementType.Q8_K, "Q8_K"),
    (ElementType.TQ2_0, "TQ2_0"),
    (9999, "9999"),
    (-1, "-1"),
]


@pytest.mark.parametrize(("qtype", "name"), UNSUPPORTED_CASES)
def test_unsupported_type_is_named(qtype, name):
    with pytest.raises(UnsupportedTypeError) as caught:
        dequantize(_zeros(64), qtype, (32,))
    assert name in str(caught.value)


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (torch.zeros(34, dtype=torch.int8), ["uint8", "int8"]),
        (torch.zeros(2, 17, dtype=torch.uint8), ["1-D", "(2, 17)"]),
        (bytes(34), ["torch.Tensor", "bytes"]),
    ],
)
def test_raw_must_be_a_flat_uint8_tensor(raw, words):
    with pytest.raises(RawTensorError) as caught:
        dequantize(raw, ElementType.Q8_0, (32,))
    for word in words:
        assert word in str(caught.value)


def test_out_dtype_must_be_floating():
    with pytest.raises(OutputDtypeError, match="int32"):
        dequantize(_zeros(34), ElementType.Q8_0, (32,), out_dtype=torch.int32)


def test_batched_errors_name_the_offending_row():
    good, bad = _zeros(144), _zeros(143)
    with pytest.raises(ByteLengthError, match=r"raws\[2\]") as caught:
        dequantize_many([good, good, bad], ElementType.Q4_K, (256,))
    assert "143" in str(caught.value) and "144" in str(caught.value)
    with pytest.raises(ByteLengthError, match="every row"):
        dequantize_many(torch.zeros(3, 145, dtype=torch.uint8), ElementType.Q4_K, (256,))
    with pytest.raises(RawTensorError, match=r"raws\[1\].*1-D"):
        dequantize_many([good, torch.zeros(1, 144, dtype=torch.uint8)], ElementType.Q4_K, (256,))
    with pytest.raises(RawTensorError, match="empty"):
        dequantize_many([], ElementType.Q4_K, (256,))
    with pytest.raises(RawTensorError, match=r"\[N, nbytes\]"):
        dequantize_many(torch.zeros(144, dtype=torch.uint8), ElementType.Q4_K, (256,))


def test_backend_choice_is_checked():
    with pytest.raises(BackendUnavailableError, match="bogus"):
        dequantize(_zeros(34), ElementType.Q8_0, (32,), backend="bogus")
    if not torch.cuda.is_available():
        with pytest.raises(BackendUnavailableError, match="not CUDA"):
            dequantize(_zeros(34), ElementType.Q8_0, (32,), backend="triton")


def test_cpu_calls_never_import_triton():
    """A finder that fails any triton import proves the CPU path does not even try."""
    program = (
        "import sys\n"
        "class NoTriton:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise AssertionError('triton imported on a CPU run')\n"
        "sys.meta_path.insert(0, NoTriton())\n"
        "import torch\n"
        "from inference.dequant import dequantize, dequantize_many\n"
        "from packformat.constants import ElementType\n"
        "raw = torch.zeros(2, 144, dtype=torch.uint8)\n"
        "dequantize(raw[0], ElementType.Q4_K, (256,))\n"
        "dequantize_many(raw, ElementType.Q4_K, (256,), out_dtype=torch.bfloat16)\n"
        "print('ok')\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True, timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
             "CUDA_VISIBLE_DEVICES": ""},
    )
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr
