"""Launchers of the fused experts kernels, and which weights they can read in place.

    weight = gemv_weight(roles, rows=2 * I, cols=H)      # None: not readable in place
    y = moe_gemv(x, slots, arena, slot_bytes, weight, tokens=pair_tokens)   # [P, 2I]
    out = moe_combine(y, top_k_weights, order)           # [T, H]

Everything here is asynchronous device work with fixed shapes and no host synchronization, so a
decode step built from it can be captured in a CUDA graph. triton is imported on first use
(`triton_module()`), never on a machine that only computes on the CPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import os
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch

from inference.dequant.errors import UnsupportedTypeError
from inference.dequant.registry import DEQUANTIZERS, Dequantizer
from packformat import RoleEntry
from packformat.constants import ElementType, block_shape
from packformat.quant_types import QUANT_TYPES

# The QT branches moe_triton._dot and quant_tile.weight_tile/weight_part implement; the
# registry's fused entries name them (inference.dequant.registry.FusedKernel.code).
KERNEL_CODES = range(14)
TILE_RANKS = (2, 3, 4)  # the GEMV's product tiles (moe_triton.moe_gemv_kernel's RANK)
# Columns one kernel step covers: plain floats (a "block" is one element), and block types.
FLOAT_STEP_COLUMNS, BLOCK_STEP_COLUMNS = 64, 256


def _fused_tables(dequantizers: Mapping[ElementType, Dequantizer]) -> dict[ElementType, tuple[int, int, int]]:
    """element type -> (kernel type code, blocks per step, rank of its product tile), for every
    type whose registry entry says the fused kernels read it; an entry the kernels cannot run is
    refused here, on import, naming the type."""
    table: dict[ElementType, tuple[int, int, int]] = {}
    codes: dict[int, ElementType] = {}
    for etype, entry in dequantizers.items():
        fused = entry.fused
        if fused is None:
            continue
        record = QUANT_TYPES[etype]
        step = FLOAT_STEP_COLUMNS if entry.float_dtype is not None else BLOCK_STEP_COLUMNS
        if not record.self_contained:
            problem = "it is not a weight type that dequantizes alone"
        elif fused.code not in KERNEL_CODES:
            problem = f"the kernels have no branch for type code {fused.code}"
        elif fused.code in codes:
            problem = f"type code {fused.code} is {codes[fused.code].name}'s"
        elif fused.tile_rank not in TILE_RANKS:
            problem = f"the GEMV has no product tile of rank {fused.tile_rank}"
        elif step % record.block_elements:
            problem = f"its {record.block_elements}-element blocks do not fill a {step}-column step"
        else:
            codes[fused.code] = etype
            table[etype] = (fused.code, step // record.block_elements, fused.tile_rank)
            continue
        raise UnsupportedTypeError(etype, f"inference.dequant.registry marks it for the fused kernels, but {problem}")
    return table


_TYPE_CODES = _fused_tables(DEQUANTIZERS)
GEMV_TYPES = frozenset(_TYPE_CODES)
# kernel type code -> the parts the grouped GEMM dequantizes a step in (moe_gemm_kernel's PARTS)
GEMM_PARTS = {code: DEQUANTIZERS[t].fused.parts for t, (code, _, _) in _TYPE_CODES.items()}
ROUNDING = {torch.bfloat16: 1, torch.float16: 2, torch.float32: 0}  # dtype -> quant_dot.ROUND_* code
GEMV_BLOCK_N = 32  # output rows per program
GEMV_WARPS = 4
# element type -> (rows per program, warps), where measured (the registry's gemv_shape); a dict
# bench/gemv_sweep.py overwrites with what it measures
GEMV_TUNING: dict[ElementType, tuple[int, int]] = {
    t: DEQUANTIZERS[t].fused.gemv_shape for t in _TYPE_CODES if DEQUANTIZERS[t].fused.gemv_shape is not None
}
COMBINE_BLOCK_H = 256
# The grouped GEMM (prefill): pairs per block (the tensor-core dot's M; an expert's pairs are cut
# into blocks of this many), then (output rows per program, warps). A step covers the GEMV's
# blocks per step: 256 columns for the block types, 64 for plain floats.
GEMM_BLOCK_M = 16
GEMM_TUNING: tuple[int, int] = (64, 4)  # where the registry gives a type no gemm_shape
# element type -> (rows per program, warps) of the grouped GEMM, where measured (the registry's
# gemm_shape); a dict bench/gemv_sweep.py overwrites with what it measures
GEMM_TYPE_TUNING: dict[ElementType, tuple[int, int]] = {
    t: DEQUANTIZERS[t].fused.gemm_shape for t in _TYPE_CODES if DEQUANTIZERS[t].fused.gemm_shape is not None
}
GEMM_SPLIT = True  # dequantize a step in parts (quant_tile.weight_part) rather than whole
# the dequantized weights as the tensor-core dot's first operand (acc [rows, pairs]) rather than
# its second: on sm_90 the dot is then a wgmma with the weights in registers, and the tile skips
# the register moves the second operand's fragments took (bench/kernel_sass.py --kernel gemm: Q4_K
# at 128 x 8 5.9 instructions a weight against 8.3 unswapped at 128 x 4). Off until a GPU times it
# (docs/benchmarks.md, "What the next GPU call runs first"); bench/gemv_sweep.py sweeps both.
GEMM_SWAP = False

_triton: ModuleType | None = None
_triton_error: BaseException | None = None


def triton_module() -> ModuleType | None:
    """inference.kernels.moe_triton, imported on first use; None where triton cannot import."""
    global _triton, _triton_error
    if _triton is None and _triton_error is None:
        try:
            _triton = importlib.import_module("inference.kernels.moe_triton")
        except ImportError as exc:
            _triton_error = exc
    return _triton


def fused_unavailable_reason(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why the fused kernels cannot run on `device` in `dtype`, or None when they can."""
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if device.type != "cuda" and not interpreted:
        return f"the fused kernels need CUDA (the model runs on {device})"
    if dtype not in ROUNDING:
        return f"the fused kernels compute in bfloat16, float16 or float32, not {dtype}"
    if triton_module() is None:
        return f"triton does not import: {_triton_error}"
    return None


@dataclasses.dataclass(frozen=True)
class GemvWeight:
    """Where one projection's weight lies inside every object of a layer: `rows` output rows of
    `row_bytes` each, rows [0, split) from byte `first_offset`, rows [split, rows) from
    `second_offset` (one role: split == rows)."""

    element_type: ElementType
    rows: int  # N, output features
    cols: int  # K, input features
    row_bytes: int
    first_offset: int
    second_offset: int
    split: int

    def __post_init__(self) -> None:
        if self.element_type not in _TYPE_CODES:
            raise UnsupportedTypeError(self.element_type, "the fused kernels cannot read it in place "
                                       "(inference.dequant.registry gives it no fused entry)")

    @property
    def code(self) -> int:
        return _TYPE_CODES[self.element_type][0]

    @property
    def blocks_per_step(self) -> int:
        return _TYPE_CODES[self.element_type][1]

    @property
    def tile_rank(self) -> int:
        return _TYPE_CODES[self.element_type][2]

    @property
    def blocks_per_row(self) -> int:
        elements, _ = block_shape(self.element_type)
        return self.cols // elements


def gemv_weight(roles: Sequence[RoleEntry], *, rows: int, cols: int) -> GemvWeight | None:
    """The in-place description of a weight made of `roles` (1 role, or gate then up), each an
    out_in [rows_i, cols] matrix of one GEMV-readable type; None when the kernel cannot read it."""
    if not 1 <= len(roles) <= 2 or len({r.element_type for r in roles}) != 1:
        return None
    element_type = ElementType(roles[0].element_type)
    if element_type not in GEMV_TYPES:
        return None
    if any(len(r.shape) != 2 or r.shape[1] != cols for r in roles) or sum(r.shape[0] for r in roles) != rows:
        return None
    row_bytes = roles[0].nbytes // roles[0].shape[0]
    if any(r.nbytes != r.shape[0] * row_bytes for r in roles):
        return None
    second = roles[-1]
    return GemvWeight(element_type, rows, cols, row_bytes, roles[0].offset, second.offset,
                      roles[0].shape[0] if len(roles) == 2 else rows)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def moe_gemv(x: torch.Tensor, experts: torch.Tensor, slot_map: torch.Tensor, arena: torch.Tensor, slot_bytes: int,
             weight: GemvWeight, *, top_k: int, x_per_pair: bool = False, misses: torch.Tensor | None = None,
             out_dtype: torch.dtype | None = None, tuning: tuple[int, int] | None = None,
             host: HostSlots | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """[P, rows]: row p is W(pair p's expert) · x[p // top_k] (x[p] when x_per_pair), into `out`
    when given ([P, rows], unit stride along rows: e.g. a column slice of a wider output; the
    rows of pairs whose slot is -2 are left as they are).

    experts: int64 [P], top_k_index flattened (pair p = token p // top_k); slot_map: int32 [E],
    the slot of each expert (-1: not resident, its row is garbage, and it is counted in
    `misses`, int32 [1], when given; with `host`, a slot >= host.first is a host tier slot, read
    in place); x: [rows of x, cols] in the model dtype (unit stride along cols); arena: uint8
    [slot_count * slot_bytes (+ anything after)].
    """
    module = triton_module()
    assert module is not None, "moe_gemv without triton: check fused_unavailable_reason first"
    out_dtype = out_dtype or (out.dtype if out is not None else x.dtype)
    pairs = experts.shape[0]
    assert x.stride(-1) == 1 and x.shape[-1] == weight.cols, (tuple(x.shape), weight)
    if out is None:
        out = torch.empty((pairs, weight.rows), dtype=out_dtype, device=x.device)  # [P, N]
    assert out.shape == (pairs, weight.rows) and out.stride(-1) == 1 and out.dtype == out_dtype, \
        (tuple(out.shape), out.stride(), out.dtype, weight)
    if pairs == 0:
        return out
    if tuning is not None:
        block_n, warps = tuning
    elif _interpreted():  # the interpreter runs programs one by one: fewer, larger ones
        block_n, warps = GEMV_BLOCK_N, GEMV_WARPS
    else:
        block_n, warps = GEMV_TUNING.get(weight.element_type, (GEMV_BLOCK_N, GEMV_WARPS))
    grid = (pairs, -(-weight.rows // block_n))
    host = host or NO_HOST
    module.moe_gemv_kernel[grid](
        x, x.stride(0), experts, slot_map, misses if misses is not None else slot_map, arena, slot_bytes,
        host.first, host.delta, weight.first_offset, weight.second_offset, weight.split, weight.row_bytes, weight.blocks_per_row,
        out, out.stride(0), weight.rows,
        QT=weight.code, NB=weight.blocks_per_step, RANK=weight.tile_rank, BLOCK_N=block_n,
        WR=ROUNDING[out_dtype], INTERP=_interpreted(), TOP_K=top_k, X_PER_PAIR=x_per_pair,
        COUNT_MISSES=misses is not None, num_warps=warps,
        enable_fp_fusion=False,  # dequantized weights round like gguf-py's: no FMA contraction
    )
    return out


@dataclasses.dataclass(frozen=True)
class HostSlots:
    """How the GEMV finds objects the host tier holds, read in place over the link: slot ids >=
    `first` (the arena's slot count) name host slot (id - first), whose bytes are at device
    address (arena's address + delta + host slot * slot bytes); delta may be negative."""

    first: int
    delta: int

    def __post_init__(self) -> None:
        if not 0 < self.first < 2**31:
            raise ValueError(f"host slot ids start at {self.first}, outside (0, 2^31)")


NO_HOST = HostSlots(2**31 - 1, 0)  # no slot id reaches it: every slot is an arena slot


@dataclasses.dataclass(frozen=True)
class GemmBlocks:
    """The grouped GEMM's work list: int32 [B, 3] rows of (arena row, first sorted position,
    pairs), each block at most `block_m` pairs of one expert."""

    table: torch.Tensor
    block_m: int

    def to(self, device: torch.device) -> GemmBlocks:
        return GemmBlocks(self.table.to(device, non_blocking=True), self.block_m)


def gemm_blocks(rows: Sequence[int], counts: Sequence[int], block_m: int | None = None) -> GemmBlocks:
    """The blocks of experts whose objects are at arena `rows` with `counts` pairs each, their
    pairs sorted by expert in this order; an expert with more than block_m pairs (default
    GEMM_BLOCK_M) takes several blocks."""
    block_m = block_m or GEMM_BLOCK_M
    table = []
    first = 0
    for row, count in zip(rows, counts, strict=True):
        for start in range(0, count, block_m):
            table.append((row, first + start, min(block_m, count - start)))
        first += count
    return GemmBlocks(torch.tensor(table, dtype=torch.int32).reshape(-1, 3), block_m)


def gemm_shape(element_type: ElementType) -> tuple[int, int]:
    """The grouped GEMM's (rows per program, warps) for weights of `element_type`."""
    return GEMM_TYPE_TUNING.get(element_type, GEMM_TUNING)


def moe_gemm(x: torch.Tensor, order: torch.Tensor, blocks: GemmBlocks, arena: torch.Tensor, slot_bytes: int,
             weight: GemvWeight, *, pairs: int, top_k: int, gather_tokens: bool,
             tuning: tuple[int, int] | None = None, split: bool | None = None, swap: bool | None = None,
             host: HostSlots | None = None) -> torch.Tensor:
    """[pairs, rows] in expert-sorted order: row s is W(s's expert) · x[order[s] // top_k] when
    gather_tokens (x: hidden states [T, cols]), else W · x[s] (x: [pairs, cols], sorted order).

    order: int64 [pairs], pair indices sorted by expert; blocks: `gemm_blocks` of the same sort,
    on x's device; each block's weight tiles are dequantized once for all of its pairs. With
    `host`, a block's slot >= host.first is a host tier slot, read in place (once per block).
    """
    module = triton_module()
    assert module is not None, "moe_gemm without triton: check fused_unavailable_reason first"
    assert x.stride(-1) == 1 and x.shape[-1] == weight.cols, (tuple(x.shape), weight)
    out = torch.empty((pairs, weight.rows), dtype=x.dtype, device=x.device)  # [S, N]
    if pairs == 0:
        return out
    block_n, warps = tuning or gemm_shape(weight.element_type)
    grid = (blocks.table.shape[0], -(-weight.rows // block_n))
    host = host or NO_HOST
    module.moe_gemm_kernel[grid](
        x, x.stride(0), order, blocks.table, arena, slot_bytes, host.first, host.delta, weight.first_offset, weight.second_offset, weight.split,
        weight.row_bytes, weight.blocks_per_row, out, out.stride(0), weight.rows,
        QT=weight.code, NB=weight.blocks_per_step, BLOCK_M=blocks.block_m, BLOCK_N=block_n,
        TOP_K=top_k, GATHER_TOKENS=gather_tokens, WR=ROUNDING[x.dtype], INTERP=_interpreted(),
        SPLIT=GEMM_SPLIT if split is None else split, PARTS=GEMM_PARTS[weight.code],
        SWAP=GEMM_SWAP if swap is None else swap, num_warps=warps,
        enable_fp_fusion=False,  # dequantized weights round like gguf-py's: no FMA contraction
    )
    return out


def moe_combine(y: torch.Tensor, top_k_weights: torch.Tensor, top_k_index: torch.Tensor) -> torch.Tensor:
    """[T, H]: per token, the sum over its k pairs (rows of y [T*k, H]) in ascending expert id
    (top_k_index [T, k]), each term y * weight (top_k_weights [T, k])."""
    module = triton_module()
    assert module is not None, "moe_combine without triton"
    tokens, top_k = top_k_weights.shape
    hidden = y.shape[1]
    out = torch.empty((tokens, hidden), dtype=y.dtype, device=y.device)  # [T, H]
    if tokens == 0:
        return out
    grid = (tokens, -(-hidden // COMBINE_BLOCK_H))
    module.moe_combine_kernel[grid](
        y, y.stride(0), top_k_weights.contiguous(), top_k_index.contiguous(), out, out.stride(0), hidden,
        K=top_k, KP=1 << (top_k - 1).bit_length(), BLOCK_H=COMBINE_BLOCK_H, WR=ROUNDING[y.dtype], num_warps=4)
    return out
