"""Triton backend: launch the kernel of a type over N rows (experts) in one grid.

Imported by api only for CUDA tensors (or by tests under TRITON_INTERPRET); importing it
imports triton.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import NamedTuple

import torch
import triton

from inference.dequant.registry import DEQUANTIZERS, TritonKernel
from packformat.constants import ElementType, block_shape

MAX_GRID_ROWS = 65535  # CUDA's limit on grid dimension 1, which indexes rows


class KernelSpec(NamedTuple):
    kernel: triton.JITFunction
    blocks_per_program: int  # elements per program = this x block elements
    num_warps: int


def _kernel_spec(kernel: TritonKernel) -> KernelSpec:
    module = importlib.import_module(f"inference.dequant.{kernel.module}")
    return KernelSpec(getattr(module, kernel.name), kernel.blocks_per_program, kernel.num_warps)


# the types whose registry entry names a kernel (inference.dequant.registry)
KERNELS: dict[ElementType, KernelSpec] = {
    qtype: _kernel_spec(entry.triton) for qtype, entry in DEQUANTIZERS.items() if entry.triton is not None
}
TRITON_TYPES = frozenset(KERNELS)


def _on_device_of(rows: torch.Tensor) -> contextlib.AbstractContextManager:
    """Launches go to the current CUDA device: switch to the rows' one if it is another.
    (Interpreter runs pass CPU tensors: nothing to switch.)"""
    if rows.is_cuda and rows.device.index != torch.cuda.current_device():
        return torch.cuda.device(rows.device)
    return contextlib.nullcontext()


def dequantize_rows(
    rows: torch.Tensor, qtype: ElementType, numel: int, out_dtype: torch.dtype
) -> torch.Tensor:
    """uint8 [N, nbytes] (unit stride along bytes, any row stride) -> out_dtype [N, numel]."""
    spec = KERNELS[qtype]
    block_elems, type_size = block_shape(qtype)
    blocks_per_row = numel // block_elems
    assert rows.dim() == 2 and rows.shape[1] == blocks_per_row * type_size and rows.stride(1) == 1
    out = torch.empty((rows.shape[0], numel), dtype=out_dtype, device=rows.device)  # [N, numel]
    programs_per_row = triton.cdiv(blocks_per_row, spec.blocks_per_program)
    row_count = rows.shape[0]
    with _on_device_of(rows):
        for first in range(0, row_count, MAX_GRID_ROWS):
            count = min(MAX_GRID_ROWS, row_count - first)
            chunk_rows = rows if count == row_count else rows[first : first + count]
            chunk_out = out if count == row_count else out[first : first + count]
            spec.kernel[(programs_per_row, count)](
                chunk_rows, chunk_out, blocks_per_row, rows.stride(0), out.stride(0),
                BLOCKS=spec.blocks_per_program, num_warps=spec.num_warps,
                enable_fp_fusion=False,  # gguf-py rounds each product: no FMA contraction
            )
    return out
