"""dequantize / dequantize_many: validate, pick a backend, run it.

The torch backend runs on any device; the triton backend is used on CUDA tensors when triton
imports and the type has a kernel. triton is imported only on that path, never on a CPU run.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Sequence
from types import ModuleType
from typing import Literal

import torch

from inference.dequant import torch_float
from inference.dequant.errors import (
    BackendUnavailableError,
    ByteLengthError,
    OutputDtypeError,
    RawTensorError,
    ShapeError,
    UnsupportedTypeError,
)
from inference.dequant.registry import DEQUANTIZERS
from packformat.constants import SCALED_WEIGHT_TYPES, SUPPORTED_TYPES, ElementType, block_shape

Backend = Literal["auto", "torch", "triton"]
_triton_module: ModuleType | None = None
_triton_import_error: BaseException | None = None


def triton_backend() -> ModuleType | None:
    """The triton kernels module, imported on first use; None where triton cannot import."""
    global _triton_module, _triton_import_error
    if _triton_module is None and _triton_import_error is None:
        try:
            _triton_module = importlib.import_module("inference.dequant.triton_kernels")
        except ImportError as exc:  # no triton in this environment
            _triton_import_error = exc
    return _triton_module


def check_type_and_shape(element_type: int, shape: Sequence[int]) -> tuple[ElementType, tuple[int, ...], int]:
    """Validate; return (type, shape as a tuple of ints, bytes one tensor of it takes)."""
    return _type_and_shape(element_type, tuple(int(dim) for dim in shape))


@functools.lru_cache(maxsize=4096)  # a model has few (type, shape) pairs; calls are per layer
def _type_and_shape(element_type: int, dims: tuple[int, ...]) -> tuple[ElementType, tuple[int, ...], int]:
    try:
        qtype = ElementType(element_type)
    except ValueError:
        raise UnsupportedTypeError(element_type, "not an element type id of the pack format") from None
    if qtype not in SUPPORTED_TYPES:
        raise UnsupportedTypeError(qtype, "not a type an expert pack may hold")
    if not dims:
        raise ShapeError(qtype.name, dims, "a tensor needs at least one dimension")
    if any(dim <= 0 for dim in dims):
        raise ShapeError(qtype.name, dims, "every dimension must be positive")
    block_elems, type_size = block_shape(qtype)
    if dims[-1] % block_elems:
        raise ShapeError(
            qtype.name, dims,
            f"last dimension {dims[-1]} is not a multiple of the {block_elems}-element block",
        )
    nbytes = math.prod(dims[:-1]) * (dims[-1] // block_elems) * type_size
    return qtype, dims, nbytes


def _check_self_contained(qtype: ElementType) -> None:
    if qtype in SCALED_WEIGHT_TYPES:
        scale = SCALED_WEIGHT_TYPES[qtype].scale_type.name
        raise UnsupportedTypeError(qtype, f"its values need their {scale} block scales; "
                                   "use inference.dequant.dequantize_scaled")


def check_out_dtype(out_dtype: torch.dtype) -> None:
    if not out_dtype.is_floating_point:
        raise OutputDtypeError(f"out_dtype must be a floating dtype, got {out_dtype}")


def check_raw(raw: object, what: str) -> torch.Tensor:
    if not isinstance(raw, torch.Tensor):
        raise RawTensorError(f"{what} must be a torch.Tensor, got {type(raw).__name__}")
    if raw.dtype != torch.uint8:
        raise RawTensorError(f"{what} must be uint8, got {raw.dtype}")
    return raw


def _use_triton(qtype: ElementType, device: torch.device, backend: Backend) -> ModuleType | None:
    """The triton module when this call should run it, None for the torch path."""
    if backend == "torch":
        return None
    if backend not in ("auto", "triton"):
        raise BackendUnavailableError(f"unknown backend {backend!r}; use 'auto', 'torch' or 'triton'")
    module = triton_backend() if device.type == "cuda" else None
    has_kernel = module is not None and qtype in module.TRITON_TYPES
    if backend == "triton" and not has_kernel:
        reason = (
            f"tensor is on {device}, not CUDA" if device.type != "cuda"
            else f"triton did not import ({_triton_import_error})" if module is None
            else f"no triton kernel for {qtype.name}"
        )
        raise BackendUnavailableError(f"triton backend unavailable for {qtype.name}: {reason}")
    return module if has_kernel else None


def _dequantize_rows(
    rows: torch.Tensor, qtype: ElementType, dims: tuple[int, ...], out_dtype: torch.dtype, backend: Backend
) -> torch.Tensor:
    """uint8 [N, nbytes] (last dim unit stride) -> out_dtype [N, *dims]."""
    count = rows.shape[0]
    module = _use_triton(qtype, rows.device, backend)
    if module is not None:
        flat = module.dequantize_rows(rows, qtype, math.prod(dims), out_dtype)  # [N, numel]
        return flat.reshape(count, *dims)
    entry = DEQUANTIZERS[qtype]
    if entry.float_dtype is not None:  # a plain cast, without a float32 detour
        return torch_float.cast_rows(rows, entry.float_dtype, out_dtype).reshape(count, *dims)
    _, type_size = block_shape(qtype)
    blocks = rows.reshape(-1, type_size)  # uint8 [N * blocks, type_size]; copies if strided
    values = entry.torch(blocks)  # f32 [N * blocks, block_elems]
    return values.to(out_dtype).reshape(count, *dims)


def dequantize(
    raw: torch.Tensor,
    element_type: int,
    shape: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Dequantize one tensor: uint8 raw [nbytes] in GGML block layout -> out_dtype [*shape].

    In float32 the result is bit-identical to gguf.quants.dequantize; other out dtypes are that
    float32 result rounded once (to nearest even). Runs on raw's device and never aliases raw.
    """
    qtype, dims, nbytes = check_type_and_shape(element_type, shape)
    check_out_dtype(out_dtype)
    _check_self_contained(qtype)
    raw = check_raw(raw, "raw")
    if raw.dim() != 1:
        raise RawTensorError(f"raw must be 1-D bytes, got shape {tuple(raw.shape)}")
    if raw.numel() != nbytes:
        raise ByteLengthError(qtype.name, dims, nbytes, raw.numel())
    if raw.stride(0) != 1:  # every backend reads bytes at unit stride
        raw = raw.contiguous()
    return _dequantize_rows(raw.reshape(1, nbytes), qtype, dims, out_dtype, backend)[0]


def dequantize_many(
    raws: torch.Tensor | Sequence[torch.Tensor],
    element_type: int,
    shape: Sequence[int],
    out_dtype: torch.dtype = torch.float32,
    backend: Backend = "auto",
) -> torch.Tensor:
    """Dequantize N same-type, same-shape tensors (one role of several experts) in one launch.

    raws is a uint8 [N, nbytes] tensor (rows may be strided, e.g. slots of an arena, as long
    as each row is contiguous) or a list of N uint8 [nbytes] tensors on one device, which
    are stacked first. Returns out_dtype [N, *shape].
    """
    qtype, dims, nbytes = check_type_and_shape(element_type, shape)
    check_out_dtype(out_dtype)
    _check_self_contained(qtype)
    rows = byte_rows(raws, qtype, dims, nbytes, "raws")
    if rows.shape[0] == 0:
        return torch.empty((0, *dims), dtype=out_dtype, device=rows.device)
    return _dequantize_rows(rows, qtype, dims, out_dtype, backend)


def byte_rows(raws: torch.Tensor | Sequence[torch.Tensor], qtype: ElementType, dims: tuple[int, ...],
              nbytes: int, what: str) -> torch.Tensor:
    """Validate a batch of raw tensors and return it as uint8 [N, nbytes], each row unit stride."""
    if isinstance(raws, torch.Tensor):
        rows = check_raw(raws, what)
        if rows.dim() != 2:
            raise RawTensorError(f"{what} must be [N, nbytes], got shape {tuple(rows.shape)}")
        if rows.shape[1] != nbytes:
            raise ByteLengthError(qtype.name, dims, nbytes, rows.shape[1], f"every row of {what}")
        if rows.shape[0] and rows.stride(1) != 1:
            rows = rows.contiguous()
        return rows
    if len(raws) == 0:
        raise RawTensorError(f"{what} is an empty list: nothing says which device to use")
    for index, raw in enumerate(raws):
        check_raw(raw, f"{what}[{index}]")
        if raw.dim() != 1:
            raise RawTensorError(f"{what}[{index}] must be 1-D bytes, got shape {tuple(raw.shape)}")
        if raw.numel() != nbytes:
            raise ByteLengthError(qtype.name, dims, nbytes, raw.numel(), f"{what}[{index}]")
        if raw.device != raws[0].device:
            raise RawTensorError(f"{what}[{index}] is on {raw.device}, {what}[0] on {raws[0].device}")
    return torch.stack(list(raws))  # uint8 [N, nbytes]
