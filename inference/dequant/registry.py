"""What inference attaches to each element type: its torch dequantizer, its Triton kernel if any.

One Dequantizer per type of packformat.quant_types.QUANT_TYPES that dequantizes on its own (every
type but weights that need their scale role; those go through scaled.py), checked against the
registry on import. The Triton kernel is named, not imported: triton is imported only on the CUDA
path (triton_kernels.py resolves the names there).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Iterable, Mapping

import torch

from inference.dequant import torch_float, torch_kquants, torch_legacy, torch_scaled
from packformat.quant_types import QUANT_TYPES, ElementType, require_entries

BlockDequantizer = Callable[[torch.Tensor], torch.Tensor]  # uint8 [n, block_bytes] -> f32 [n, block_elements]


@dataclasses.dataclass(frozen=True)
class TritonKernel:
    """A Triton dequant kernel: `name` in module inference.dequant.<module>, and its launch shape."""

    module: str
    name: str
    blocks_per_program: int  # elements per program = this x block elements
    num_warps: int


@dataclasses.dataclass(frozen=True)
class Dequantizer:
    element_type: ElementType
    torch: BlockDequantizer  # bit-exact with gguf.quants.dequantize in float32
    triton: TritonKernel | None = None  # None: the torch backend runs on CUDA too
    float_dtype: torch.dtype | None = None  # plain float types: a cast, without a float32 detour


def _table(entries: Iterable[Dequantizer]) -> Mapping[ElementType, Dequantizer]:
    table = {entry.element_type: entry for entry in entries}
    expected = [t for t, q in QUANT_TYPES.items() if q.scale_rule is None]
    require_entries("inference.dequant.registry.DEQUANTIZERS", table, expected)
    return types.MappingProxyType(table)


def _legacy(name: str, blocks_per_program: int, num_warps: int) -> TritonKernel:
    return TritonKernel("triton_legacy", name, blocks_per_program, num_warps)


def _kquant(name: str, blocks_per_program: int, num_warps: int) -> TritonKernel:
    return TritonKernel("triton_kquants", name, blocks_per_program, num_warps)


_T = ElementType
# Triton (blocks per program, warps) measured best on an H200 for 8 experts x [2048, 4096], bf16
# out (bench/dequant_bench.py); all are within ~10% of each other's neighbours, any is exact.
DEQUANTIZERS: Mapping[ElementType, Dequantizer] = _table([
    Dequantizer(_T.F32, torch_float.dequantize_f32, float_dtype=torch.float32),
    Dequantizer(_T.F16, torch_float.dequantize_f16, float_dtype=torch.float16),
    Dequantizer(_T.BF16, torch_float.dequantize_bf16, float_dtype=torch.bfloat16),
    Dequantizer(_T.Q8_0, torch_legacy.dequantize_q8_0, _legacy("q8_0_kernel", 64, 8)),
    Dequantizer(_T.Q4_0, torch_legacy.dequantize_q4_0, _legacy("q4_0_kernel", 128, 8)),
    Dequantizer(_T.Q4_1, torch_legacy.dequantize_q4_1, _legacy("q4_1_kernel", 128, 8)),
    Dequantizer(_T.Q5_0, torch_legacy.dequantize_q5_0, _legacy("q5_0_kernel", 128, 4)),
    Dequantizer(_T.Q5_1, torch_legacy.dequantize_q5_1, _legacy("q5_1_kernel", 128, 4)),
    Dequantizer(_T.MXFP4, torch_legacy.dequantize_mxfp4, _legacy("mxfp4_kernel", 128, 8)),
    Dequantizer(_T.Q2_K, torch_kquants.dequantize_q2_k, _kquant("q2_k_kernel", 16, 8)),
    Dequantizer(_T.Q3_K, torch_kquants.dequantize_q3_k, _kquant("q3_k_kernel", 16, 4)),
    Dequantizer(_T.Q4_K, torch_kquants.dequantize_q4_k, _kquant("q4_k_kernel", 16, 4)),
    Dequantizer(_T.Q5_K, torch_kquants.dequantize_q5_k, _kquant("q5_k_kernel", 16, 4)),
    Dequantizer(_T.Q6_K, torch_kquants.dequantize_q6_k, _kquant("q6_k_kernel", 8, 4)),
    Dequantizer(_T.UE8M0, torch_scaled.dequantize_ue8m0),  # block scales on their own, as float values
])

TORCH_DEQUANTIZERS: Mapping[ElementType, BlockDequantizer] = types.MappingProxyType(
    {t: d.torch for t, d in DEQUANTIZERS.items()}
)
