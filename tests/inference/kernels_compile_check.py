"""Compile every fused kernel variant for sm_90 with triton's real compiler (no GPU needed);
run as a script without TRITON_INTERPRET (test_kernels_compile.py does). Prints one line per
variant, 'ok' or the error, and exits 1 if any failed."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inference.kernels import moe_triton as mt
from inference.kernels.ops import _TYPE_CODES, GEMM_PARTS

POINTERS = {"x_ptr": "*bf16", "arena_ptr": "*u8", "out_ptr": "*bf16", "x_stride": "i32", "slot_bytes": "i32",
            "off1": "i32", "off2": "i32", "n_split": "i32", "row_bytes": "i32", "nblk": "i32", "out_stride": "i32",
            "N": "i32", "host_first": "i32", "host_delta": "i64"}  # a host tier: its distance is 64-bit
GEMM = {**POINTERS, "order_ptr": "*i64", "blocks_ptr": "*i32"}
GEMV = {**POINTERS, "expert_ptr": "*i64", "map_ptr": "*i32", "miss_ptr": "*i32"}


def _compile(fn, signature: dict[str, str], constants: dict) -> None:
    ordered = [name for name in fn.arg_names]
    full = {name: signature.get(name, "constexpr") for name in ordered}
    triton.compile(ASTSource(fn=fn, signature=full, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "enable_fp_fusion": False})


def variants():
    for code, blocks, rank in sorted(_TYPE_CODES.values()):
        for split in (True, False):
            yield (f"moe_gemm_kernel type {code} {'parts' if split else 'whole'}", mt.moe_gemm_kernel, GEMM,
                   dict(QT=code, NB=blocks, BLOCK_M=16, BLOCK_N=64, TOP_K=8, GATHER_TOKENS=True, WR=1, INTERP=False,
                        SPLIT=split, PARTS=GEMM_PARTS[code]))
        yield (f"moe_gemv_kernel type {code}", mt.moe_gemv_kernel, GEMV,
               dict(QT=code, NB=blocks, RANK=rank, BLOCK_N=4, WR=1, INTERP=False, TOP_K=8, X_PER_PAIR=False,
                    COUNT_MISSES=True))


def main() -> int:
    failed = 0
    for name, fn, signature, constants in variants():
        try:
            _compile(fn, signature, constants)
            print(f"{name}: ok")
        except Exception as exc:  # noqa: BLE001 - every compiler error is a finding, reported by name
            failed += 1
            print(f"{name}: {type(exc).__name__}: {str(exc)[-400:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
