"""What the experts' kernels compile to on sm_90, without a GPU: the SASS of their main loop per type.

The prefill's grouped GEMM is bound by the CUDA cores that dequantize its tensor cores' operand, and
the GEMV spends ~10 instructions a weight (docs/benchmarks.md, twelfth run): the count of
instructions in the loop over a row's blocks, per weight a thread handles, is a cheap first check of
a kernel change before the device measures it. For the GEMV it is only that: its speed follows its
launch shape more than this count (at 4 x 1 the longer loop was the faster on the H200). The kernel is compiled with triton's own
compiler and disassembler (the ones its wheel carries), with the launch's integer arguments marked
16-divisible as a real launch specializes them.

    python bench/kernel_sass.py --types Q4_K MXFP4 --shapes 8x1 4x1
    python bench/kernel_sass.py --types Q4_K --baseline-rev d99c19b   # the same for another revision
    python bench/kernel_sass.py --kernel gemm --shapes 64x4 128x8    # the grouped GEMM (BLOCK_N x warps)
    python bench/kernel_sass.py --kernel gemm --swap off             # ... its weights the dot's second operand

Read with care: the loop is the longest backward branch of the SASS, and "per weight" divides its
length by the weights one iteration covers per thread, assuming the compiler did not unroll it
(when it does, the figure is a multiple of the real one; compare a type's figure across revisions at
the same shape, not across shapes).
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

# the kernels' arguments that a real launch gives 16-divisible values (pointers, strides, byte offsets)
DIVISIBLE = ("x_ptr", "x_stride", "expert_ptr", "map_ptr", "miss_ptr", "order_ptr", "blocks_ptr", "arena_ptr",
             "slot_bytes", "host_first", "host_delta", "off1", "off2", "row_bytes", "out_ptr", "out_stride", "N")


def parse_shape(text: str) -> tuple[int, int]:
    """'8x1' -> (rows per program, warps)."""
    try:
        rows, warps = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a launch shape is ROWSxWARPS (e.g. 8x1), got {text!r}") from None
    if rows < 1 or rows & (rows - 1) or warps not in (1, 2, 4, 8):
        raise argparse.ArgumentTypeError(f"rows must be a power of two and warps 1, 2, 4 or 8, got {text!r}")
    return rows, warps


def loop_of(sass: str) -> list[str]:
    """The instructions of the longest loop (a label and the backward branch to it)."""
    lines = sass.splitlines()
    labels = {line[:-1]: i for i, line in enumerate(lines) if line.startswith("LBB") and line.endswith(":")}
    best: tuple[int, int] | None = None
    for i, line in enumerate(lines):
        if "BRA LBB" not in line:
            continue
        start = labels.get(line.split("BRA ")[1].strip().rstrip(";"))
        if start is not None and start < i and (best is None or i - start > best[1] - best[0]):
            best = (start, i)
    if best is None:
        return []
    return [line for line in lines[best[0] + 1:best[1] + 1] if "\t" in line]


def opcode(line: str) -> str:
    words = line.split("\t", 1)[1].split()
    if words[0].startswith("@"):  # a predicate
        words = words[1:]
    return words[0].rstrip(";").split(".")[0]


def measure(type_names: list[str], shapes: list[tuple[int, int]], kernel_name: str = "gemv",
            whole: bool = False, swap: bool | None = None) -> list[dict]:
    """One row per (type, shape): the loop's length, per weight, and its commonest opcodes. For the
    GEMM a shape is (BLOCK_N, warps) at the shipped BLOCK_M, in parts (ops.GEMM_SPLIT) unless whole,
    its operands as ops.GEMM_SWAP has them unless `swap` says."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from inference.kernels import moe_triton, ops
    from inference.kernels.ops import _TYPE_CODES
    from packformat.constants import ElementType, block_shape

    kernel = moe_triton.moe_gemv_kernel if kernel_name == "gemv" else moe_triton.moe_gemm_kernel
    argument_types = getattr(moe_triton, f"{kernel_name.upper()}_ARGUMENT_TYPES", None)
    if argument_types is None:  # a tree before they moved beside the kernel (a --baseline-rev run)
        sys.path.insert(0, str(REPO / "tests" / "inference"))
        import kernels_compile_check
        argument_types = getattr(kernels_compile_check, kernel_name.upper())
    signature = {name: argument_types.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in DIVISIBLE
             if name in kernel.arg_names}
    rows_out = []
    for name in type_names:
        element_type = ElementType.__members__.get(name)
        if element_type is None:
            raise SystemExit(f"{name}: not an element type (packformat.constants.ElementType)")
        if element_type not in _TYPE_CODES:
            raise SystemExit(f"{name}: not a type the fused kernels read")
        code, blocks_per_step, rank = _TYPE_CODES[element_type]
        step_weights = blocks_per_step * block_shape(element_type)[0]
        for rows, warps in shapes:
            if kernel_name == "gemv":
                constants = dict(QT=code, NB=blocks_per_step, RANK=rank, BLOCK_N=rows, WR=1, INTERP=False, TOP_K=8,
                                 X_PER_PAIR=False, COUNT_MISSES=False)
            else:  # the prefill's up projection (tokens gathered), as ops.moe_gemm launches it
                constants = dict(QT=code, NB=blocks_per_step, BLOCK_M=ops.GEMM_BLOCK_M, BLOCK_N=rows, TOP_K=8,
                                 GATHER_TOKENS=True, WR=1, INTERP=False, SPLIT=not whole, PARTS=ops.GEMM_PARTS[code])
                if "SWAP" in kernel.arg_names:  # (a tree before it had no SWAP)
                    constants["SWAP"] = ops.GEMM_SWAP if swap is None else swap
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs),
                                      target=GPUTarget("cuda", 90, 32),
                                      options={"num_warps": warps, "enable_fp_fusion": False})
            loop = loop_of(compiled.asm["sass"])
            per_thread = rows * step_weights / (32 * warps)  # weights one iteration covers per thread
            rows_out.append({"kernel": kernel_name, "type": name, "rows": rows, "warps": warps,
                             "loop_instructions": len(loop),
                             "global_loads": sum(opcode(line) == "LDG" for line in loop),  # vectorized: few
                             "per_weight": round(len(loop) / per_thread, 2) if loop else None,
                             "opcodes": dict(collections.Counter(opcode(line) for line in loop).most_common(12))})
    return rows_out


def at_revision(rev: str, argv: list[str]) -> list[dict]:
    """This script's rows for the tree of git revision `rev` (exported to a temporary directory)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], capture_output=True)
        if archive.returncode != 0:
            raise SystemExit(f"--baseline-rev {rev!r}: git archive failed: {archive.stderr.decode().strip()}")
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        # this script, run against the revision's modules (older trees have none, or an older one)
        script = Path(tmp) / "bench" / "kernel_sass.py"
        script.parent.mkdir(exist_ok=True)
        script.write_text(Path(__file__).read_text())
        run = subprocess.run([sys.executable, str(script), *argv, "--json-stdout"], capture_output=True, text=True,
                             cwd=tmp)
        if run.returncode != 0:
            raise SystemExit(f"--baseline-rev {rev!r}: its kernels did not compile: {run.stderr.strip()[-1500:]}")
    return json.loads(run.stdout)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kernel", choices=("gemv", "gemm"), default="gemv",
                        help="the decode's GEMV (default) or the prefill's grouped GEMM")
    parser.add_argument("--types", nargs="+", default=["Q4_K", "MXFP4"])
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                        help="launch shapes ROWSxWARPS, rows being BLOCK_N (default 8x1 4x1 for the GEMV, "
                             "64x4 128x4 for the GEMM)")
    parser.add_argument("--whole", action="store_true", help="the GEMM dequantizes each step whole, not in parts")
    parser.add_argument("--swap", choices=("on", "off"), default=None,
                        help="the GEMM's weights as the dot's first operand or not (default: ops.GEMM_SWAP; a "
                             "--baseline-rev compiles its own default)")
    parser.add_argument("--baseline-rev", default=None, help="also compile the kernels of this git revision")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--json-stdout", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.whole and args.kernel != "gemm":
        parser.error("--whole: only the GEMM (--kernel gemm) dequantizes in parts")
    if args.swap and args.kernel != "gemm":
        parser.error("--swap: only the GEMM (--kernel gemm) has its operands swapped")
    if args.shapes is None:
        args.shapes = [(8, 1), (4, 1)] if args.kernel == "gemv" else [(64, 4), (128, 4)]
    rows = measure(args.types, args.shapes, args.kernel, args.whole, None if args.swap is None else args.swap == "on")
    if args.json_stdout:
        print(json.dumps(rows))
        return 0
    forwarded = ["--kernel", args.kernel, "--types", *args.types, "--shapes", *[f"{r}x{w}" for r, w in args.shapes],
                 *(["--whole"] if args.whole else [])]
    baseline = {(r["type"], r["rows"], r["warps"]): r for r in at_revision(args.baseline_rev, forwarded)} \
        if args.baseline_rev else {}
    for row in rows:
        line = (f"{args.kernel} {row['type']:6s} {row['rows']}x{row['warps']}: loop {row['loop_instructions']} instructions, "
                f"{row['per_weight']} per weight")
        old = baseline.get((row["type"], row["rows"], row["warps"]))
        if old is not None:
            line += f" (at {args.baseline_rev}: {old['loop_instructions']}, {old['per_weight']} per weight)"
        print(line)
        print("    " + ", ".join(f"{k} {v}" for k, v in row["opcodes"].items()))
    if args.json:
        args.json.write_text(json.dumps({"kernel": args.kernel, "whole": args.whole, "rows": rows,
                                         "baseline_rev": args.baseline_rev,
                                         "baseline": list(baseline.values())}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
