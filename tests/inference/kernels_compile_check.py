"""Compile every fused kernel variant (and the decode step's dense kernels) for sm_90 with
triton's real compiler (no GPU needed); run as a script without TRITON_INTERPRET (test_kernels_compile.py does). Prints one line per
variant, 'ok' or the error, and exits 1 if any failed."""

from __future__ import annotations

import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from inference.kernels import decode_attention as da
from inference.kernels import dispatch_triton as dt
from inference.kernels import dense_gemv as dg
from inference.kernels import moe_triton as mt
from inference.kernels import router_topk as rt
from inference.kernels.ops import _TYPE_CODES, GEMM_PARTS

GEMM, GEMV = mt.GEMM_ARGUMENT_TYPES, mt.GEMV_ARGUMENT_TYPES


# the decode step's dense kernels (inference.kernels.dense_ops): every argument that is not a
# constexpr is a bf16 pointer unless named here
DENSE_GEMV = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "out_ptr": "*bf16", "N": "i32", "K": "i32",
              "w_stride": "i32"}
ATTENTION_SPLIT = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "mask_ptr": "*i1", "part_acc_ptr": "*fp32",
                   "part_ml_ptr": "*fp32", "L": "i32", "G": "i32", "DK": "i32", "DV": "i32", "scale": "fp32",
                   "splits": "i32", **{name: "i32" for name in ("q_sb", "q_sh", "k_sb", "k_sh", "k_sl", "v_sb", "v_sh",
                                                                 "v_sl", "m_sb", "m_sl")}}
ATTENTION_MERGE = {"part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32", "out_ptr": "*bf16", "DV": "i32", "splits": "i32",
                   "o_sb": "i32", "o_sh": "i32"}
SOFTMAX_TOPK = {"logits_ptr": "*bf16", "scores_ptr": "*bf16", "indices_ptr": "*i64", "E": "i32", "K": "i32",
                "logits_stride": "i32"}


def _compile(fn, signature: dict[str, str], constants: dict) -> None:
    ordered = [name for name in fn.arg_names]
    full = {name: signature.get(name, "constexpr") for name in ordered}
    triton.compile(ASTSource(fn=fn, signature=full, constexprs=constants), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "enable_fp_fusion": False})


def dense_variants():
    for bias in (True, False):
        yield (f"dense_gemv_kernel bias={bias}", dg.dense_gemv_kernel, DENSE_GEMV,
               dict(HAS_BIAS=bias, BLOCK_N=2, BLOCK_K=1024))
    for mask, dk, dv, block_n in ((True, 128, 128, 32), (False, 512, 512, 16), (True, 256, 128, 16)):
        yield (f"decode_attention_split_kernel mask={mask} {dk}/{dv}", da.decode_attention_split_kernel,
               ATTENTION_SPLIT, dict(HAS_MASK=mask, CHUNK=2 * block_n, BLOCK_G=16, BLOCK_N=block_n, BLOCK_DK=dk,
                                     BLOCK_DV=dv))
    yield ("decode_attention_merge_kernel", da.decode_attention_merge_kernel, ATTENTION_MERGE,
           dict(BLOCK_S=16, BLOCK_DV=128))
    for renormalize in (True, False):
        yield (f"softmax_topk_kernel renormalize={renormalize}", rt.softmax_topk_kernel, SOFTMAX_TOPK,
               dict(RENORMALIZE=renormalize, BLOCK_E=128, BLOCK_K=8))


def variants():
    for code, blocks, rank in sorted(_TYPE_CODES.values()):
        for split, swap in ((True, True), (True, False), (False, True), (False, False)):
            yield (f"moe_gemm_kernel type {code} {'parts' if split else 'whole'}{' swapped' if swap else ''}",
                   mt.moe_gemm_kernel, GEMM,
                   dict(QT=code, NB=blocks, BLOCK_M=16, BLOCK_N=64, TOP_K=8, GATHER_TOKENS=True, WR=1, INTERP=False,
                        SPLIT=split, PARTS=GEMM_PARTS[code], SWAP=swap))
        if code == 11:  # float16 and float32 models: the other roundings of the dot's operand
            for (wr, dtype), swap in [(r, s) for r in ((2, "*fp16"), (0, "*fp32")) for s in (True, False)]:
                yield (f"moe_gemm_kernel type {code} rounding {wr}{' swapped' if swap else ''}", mt.moe_gemm_kernel,
                       {**GEMM, "x_ptr": dtype, "out_ptr": dtype},
                       dict(QT=code, NB=blocks, BLOCK_M=16, BLOCK_N=64, TOP_K=8, GATHER_TOKENS=True, WR=wr,
                            INTERP=False, SPLIT=True, PARTS=GEMM_PARTS[code], SWAP=swap))
        yield (f"moe_gemv_kernel type {code}", mt.moe_gemv_kernel, GEMV,
               dict(QT=code, NB=blocks, RANK=rank, BLOCK_N=4, WR=1, INTERP=False, TOP_K=8, X_PER_PAIR=False,
                    COUNT_MISSES=True))


DISPATCH = {"expert_ptr": "*i64", "map_ptr": "*i32", "order_ptr": "*i64", "sorted_ptr": "*i64", "table_ptr": "*i32",
            "miss_ptr": "*i32", "S": "i32", "E": "i32", "B": "i32"}


def dispatch_variants():
    """The prefill's dispatch program from one pair to the most it takes (dispatch.DISPATCH_PROGRAM_PAIRS),
    for 128 and 384 experts (not a power of two: padding columns)."""
    for pairs, experts in ((1, 128), (2, 128), (64, 128), (512, 128), (1024, 512)):
        yield (f"moe_dispatch_kernel {pairs} pairs {experts} experts", dt.moe_dispatch_kernel, DISPATCH,
               dict(BLOCK_M=16, EP=experts, SP=pairs, CHUNK=64, COUNT_MISSES=True))


def main() -> int:
    failed = 0
    for name, fn, signature, constants in (*variants(), *dense_variants(), *dispatch_variants()):
        try:
            _compile(fn, signature, constants)
            print(f"{name}: ok")
        except Exception as exc:  # noqa: BLE001 - every compiler error is a finding, reported by name
            failed += 1
            print(f"{name}: {type(exc).__name__}: {str(exc)[-400:]}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
