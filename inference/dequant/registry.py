"""What inference attaches to each element type: its torch dequantizer, its Triton kernel if any,
and whether the fused MoE kernels read it in place.

One Dequantizer per type of packformat.quant_types.QUANT_TYPES that dequantizes on its own (every
type but weights that need their scale role; those go through scaled.py), checked against the
registry on import. The Triton kernel is named, not imported: triton is imported only on the CUDA
path (triton_kernels.py resolves the names there). inference.kernels.ops derives the fused
kernels' tables from the `fused` entries here, and refuses one its kernels cannot run.
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
class FusedKernel:
    """How the fused MoE kernels (inference.kernels.moe_triton, quant_tile) read a type in place."""

    code: int  # the kernels' QT constexpr: the branch that decodes this type
    tile_rank: int  # rank of the GEMV's product tile
    parts: int  # pieces the grouped GEMM dequantizes one step in (SPLIT)
    gemv_shape: tuple[int, int] | None = None  # GEMV (rows per program, warps); None: ops' default
    gemm_shape: tuple[int, int] | None = None  # grouped GEMM (rows per program, warps); None: ops' default


@dataclasses.dataclass(frozen=True)
class Dequantizer:
    element_type: ElementType
    torch: BlockDequantizer  # bit-exact with gguf.quants.dequantize in float32
    triton: TritonKernel | None = None  # None: the torch backend runs on CUDA too
    float_dtype: torch.dtype | None = None  # plain float types: a cast, without a float32 detour
    fused: FusedKernel | None = None  # None: the fused kernels cannot read it (the unfused path does)


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
# Fused GEMV shapes (rows per program, warps) measured on an H200 with bench/gemv_sweep.py
# (2026-12-01, one decode token's experts): Q4_K 4 rows x 1 warp 24.5 us per layer against 38.2
# at 32 x 4 (Qwen3-30B-A3B-like), MXFP4 8 x 1 125.8 us against 139.8 (DeepSeek-V4-Flash-like);
# again with the conversion-free arithmetic (2026-12-03): Q4_K 4 x 1 22.3 us against 36.6,
# MXFP4 4 x 1 79.3 and 8 x 1 79.8 against 88.5.
# The other K-quants take Q4_K's shape and the other 32-element types MXFP4's (same loops; not
# measured).
_K_QUANT_GEMV, _BLOCK32_GEMV = (4, 1), (8, 1)
# The prefill's grouped GEMM (rows per program, warps) where measured: Q4_K 128 x 4 (parts, 16 pairs a
# block) 635.3 us a layer against 763.4 at ops' default 64 x 4 (a 64-token prefill of the
# Qwen3-30B-A3B-like shape, an H100, 2026-12-07; the whole prefill 1.14x). Only Q4_K: at 128 rows
# the other K-quants' loops spill more (docs/benchmarks.md, 2026-12-05), and none was timed.
_Q4_K_GEMM = (128, 4)


def _fused_float(code: int) -> FusedKernel:
    return FusedKernel(code, tile_rank=2, parts=1)


def _fused_block32(code: int) -> FusedKernel:
    return FusedKernel(code, tile_rank=3, parts=2, gemv_shape=_BLOCK32_GEMV)


def _fused_kquant(code: int, tile_rank: int, parts: int, gemm_shape: tuple[int, int] | None = None) -> FusedKernel:
    return FusedKernel(code, tile_rank, parts, gemv_shape=_K_QUANT_GEMV, gemm_shape=gemm_shape)


# Triton (blocks per program, warps) measured best on an H200 for 8 experts x [2048, 4096], bf16
# out (bench/dequant_bench.py); all are within ~10% of each other's neighbours, any is exact.
DEQUANTIZERS: Mapping[ElementType, Dequantizer] = _table([
    Dequantizer(_T.F32, torch_float.dequantize_f32, float_dtype=torch.float32, fused=_fused_float(0)),
    Dequantizer(_T.F16, torch_float.dequantize_f16, float_dtype=torch.float16, fused=_fused_float(1)),
    Dequantizer(_T.BF16, torch_float.dequantize_bf16, float_dtype=torch.bfloat16, fused=_fused_float(2)),
    Dequantizer(_T.Q8_0, torch_legacy.dequantize_q8_0, _legacy("q8_0_kernel", 64, 8), fused=_fused_block32(3)),
    Dequantizer(_T.Q4_0, torch_legacy.dequantize_q4_0, _legacy("q4_0_kernel", 128, 8), fused=_fused_block32(4)),
    Dequantizer(_T.Q4_1, torch_legacy.dequantize_q4_1, _legacy("q4_1_kernel", 128, 8), fused=_fused_block32(5)),
    Dequantizer(_T.Q5_0, torch_legacy.dequantize_q5_0, _legacy("q5_0_kernel", 128, 4), fused=_fused_block32(6)),
    Dequantizer(_T.Q5_1, torch_legacy.dequantize_q5_1, _legacy("q5_1_kernel", 128, 4), fused=_fused_block32(7)),
    Dequantizer(_T.MXFP4, torch_legacy.dequantize_mxfp4, _legacy("mxfp4_kernel", 128, 8), fused=_fused_block32(8)),
    Dequantizer(_T.Q2_K, torch_kquants.dequantize_q2_k, _kquant("q2_k_kernel", 16, 8), fused=_fused_kquant(9, 4, 4)),
    Dequantizer(_T.Q3_K, torch_kquants.dequantize_q3_k, _kquant("q3_k_kernel", 16, 4),
                fused=_fused_kquant(10, 4, 4)),
    Dequantizer(_T.Q4_K, torch_kquants.dequantize_q4_k, _kquant("q4_k_kernel", 16, 4),
                fused=_fused_kquant(11, 3, 2, gemm_shape=_Q4_K_GEMM)),
    Dequantizer(_T.Q5_K, torch_kquants.dequantize_q5_k, _kquant("q5_k_kernel", 16, 4),
                fused=_fused_kquant(12, 3, 2)),
    Dequantizer(_T.Q6_K, torch_kquants.dequantize_q6_k, _kquant("q6_k_kernel", 8, 4), fused=_fused_kquant(13, 4, 2)),
    Dequantizer(_T.UE8M0, torch_scaled.dequantize_ue8m0),  # block scales on their own, as float values
])

TORCH_DEQUANTIZERS: Mapping[ElementType, BlockDequantizer] = types.MappingProxyType(
    {t: d.torch for t, d in DEQUANTIZERS.items()}
)
