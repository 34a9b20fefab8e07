"""The fused experts GEMV's launch shape per expert type: time each (rows per program, warps) on
one decode step's experts and keep the fastest (inference.kernels.ops.GEMV_TUNING); the same for
the prefill's grouped GEMM (pairs per block, rows per program, warps: ops.gemm_shape), against
the dequantize-then-grouped_mm path it replaced.

    python bench/gemv_sweep.py --types Q4_K MXFP4          # prints a table; --json keeps it
    python bench/gemv_sweep.py --no-gemv --gemm-tokens 64 512 2048   # the GEMM at longer prompts

Each case is one token's top-k experts of a model shape (gate+up [2I, H] and down [H, I] of the
type, in random valid bytes, in an arena of `--experts` slots), launched in a CUDA graph of 20
and timed by replay: microseconds per launch and the bytes of weights read per second.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from inference.kernels import ops  # noqa: E402
from packformat import RoleEntry  # noqa: E402
from packformat.constants import ElementType, Role, tensor_nbytes  # noqa: E402
from packtools.quants import random_blocks  # noqa: E402

CONFIGS = [(4, 1), (8, 1), (8, 2), (16, 2), (16, 4), (32, 4), (32, 8), (64, 8)]
SHAPES = {"Q4_K": (2048, 768, 8), "MXFP4": (4096, 2048, 6)}  # hidden, intermediate, top-k of the bench shapes


def _arena(element_type: ElementType, hidden: int, inter: int, experts: int, device: torch.device):
    roles = [(Role.GATE, (inter, hidden)), (Role.UP, (inter, hidden)), (Role.DOWN, (hidden, inter))]
    entries, offset = [], 0
    for role, shape in roles:
        nbytes = tensor_nbytes(element_type, shape)
        entries.append(RoleEntry(role, int(element_type), offset, nbytes, shape))
        offset = -(-(offset + nbytes) // 256) * 256
    slot_bytes = -(-offset // 4096) * 4096
    rng = np.random.default_rng(0)
    one = np.zeros(slot_bytes, dtype=np.uint8)
    for entry in entries:
        one[entry.offset:entry.offset + entry.nbytes] = random_blocks(element_type, entry.shape, rng).reshape(-1)
    arena = torch.from_numpy(one).to(device).repeat(experts)  # the same object in every slot: bytes are bytes
    return arena, slot_bytes, entries


def _layer(type_name: str, experts: int):
    """(type, hidden, intermediate, top-k, device, arena, slot bytes, (gate, up, down) roles,
    gate+up GemvWeight, down GemvWeight) of the bench shape of `type_name`, `experts` slots on CUDA."""
    element_type = ElementType[type_name]
    hidden, inter, top_k = SHAPES[type_name]
    device = torch.device("cuda")
    arena, slot_bytes, roles = _arena(element_type, hidden, inter, experts, device)
    gate, up, down = roles
    up_weight = ops.gemv_weight([gate, up], rows=2 * inter, cols=hidden)
    down_weight = ops.gemv_weight([down], rows=hidden, cols=inter)
    return element_type, hidden, inter, top_k, device, arena, slot_bytes, roles, up_weight, down_weight


def time_in_graph(fn, repeats: int = 20) -> float:
    """Microseconds per call, from a CUDA graph of `repeats` calls replayed 10 times."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(10):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (10 * repeats)


def sweep(type_name: str, *, experts: int = 64, install: bool = True) -> dict:
    element_type, hidden, inter, top_k, device, arena, slot_bytes, (gate, up, down), up_weight, down_weight = \
        _layer(type_name, experts)
    index = torch.randperm(experts)[:top_k].to(device)  # one token's experts
    slot_map = torch.arange(experts, dtype=torch.int32, device=device)
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(top_k, inter, device=device, dtype=torch.bfloat16)
    weight_bytes = top_k * (gate.nbytes + up.nbytes + down.nbytes)
    rows = []
    for block_n, warps in CONFIGS:
        cfg = (block_n, warps)
        up_us = time_in_graph(lambda: ops.moe_gemv(x, index, slot_map, arena, slot_bytes, up_weight, top_k=top_k, tuning=cfg))
        down_us = time_in_graph(lambda: ops.moe_gemv(h, index, slot_map, arena, slot_bytes, down_weight, top_k=top_k,
                                             x_per_pair=True, tuning=cfg))
        rows.append({"block_n": block_n, "warps": warps, "up_us": up_us, "down_us": down_us,
                     "gbps": weight_bytes / ((up_us + down_us) * 1e-6) / 1e9})
    best = min(rows, key=lambda r: r["up_us"] + r["down_us"])
    if install:
        ops.GEMV_TUNING[element_type] = (best["block_n"], best["warps"])
    return {"type": type_name, "hidden": hidden, "intermediate": inter, "top_k": top_k, "rows": rows, "best": best,
            "default": next(r for r in rows if (r["block_n"], r["warps"]) == (ops.GEMV_BLOCK_N, ops.GEMV_WARPS))}


# (pairs per block, rows per program, warps); blocks of 32 and 64 pairs are for long prompts, where an
# expert's pairs span several blocks of 16 and each block dequantizes the expert's weights again
GEMM_CONFIGS = [(16, 32, 4), (16, 64, 4), (16, 128, 4), (16, 64, 2), (16, 128, 8), (32, 64, 4), (32, 128, 8),
                (64, 64, 4), (64, 128, 8)]


def gemm_sweep(type_name: str, *, tokens: int = 64, experts: int = 128, install: bool = True,
               configs: list[tuple[int, int, int]] | None = None) -> dict:
    """The grouped GEMM of a `tokens`-token prefill (each token's top-k of `experts`, random):
    each (pairs per block, rows per program, warps) timed on the up and down projections, against
    the path it replaces (each distinct expert dequantized whole, then torch's grouped GEMMs)."""
    from inference.dequant import dequantize_many

    element_type, hidden, inter, top_k, device, arena, slot_bytes, (gate, up, down), up_weight, down_weight = \
        _layer(type_name, experts)
    generator = torch.Generator().manual_seed(0)
    index = torch.stack([torch.randperm(experts, generator=generator)[:top_k] for _ in range(tokens)])  # [T, k]
    sorted_experts, order = torch.sort(index.reshape(-1), stable=True)
    ids, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    ids, counts, order = ids.tolist(), counts.tolist(), order.to(device)
    pairs = tokens * top_k
    x = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16)
    h = torch.randn(pairs, inter, device=device, dtype=torch.bfloat16)
    weight_bytes = len(ids) * (gate.nbytes + up.nbytes + down.nbytes)
    rows = []
    # in parts only: every shape dequantizing a step whole was slower (docs/benchmarks.md, fifteenth run)
    variants = [(c, True, swap) for swap in (True, False) for c in (configs or GEMM_CONFIGS)]
    for (block_m, block_n, warps), split, swap in variants:
        blocks = ops.gemm_blocks(ids, counts, block_m).to(device)
        cfg = (block_n, warps)
        up_us = time_in_graph(lambda: ops.moe_gemm(x, order, blocks, arena, slot_bytes, up_weight, pairs=pairs, top_k=top_k,
                                           gather_tokens=True, tuning=cfg, split=split, swap=swap), repeats=5)
        down_us = time_in_graph(lambda: ops.moe_gemm(h, order, blocks, arena, slot_bytes, down_weight, pairs=pairs,
                                             top_k=top_k, gather_tokens=False, tuning=cfg, split=split, swap=swap),
                                repeats=5)
        rows.append({"block_m": block_m, "block_n": block_n, "warps": warps, "split": split, "swap": swap,
                     "up_us": up_us, "down_us": down_us, "gbps": weight_bytes / ((up_us + down_us) * 1e-6) / 1e9})
    best = min(rows, key=lambda r: r["up_us"] + r["down_us"])
    shipped = next((r for r in rows if (r["block_m"], r["block_n"], r["warps"], r["split"], r["swap"])
                    == (ops.GEMM_BLOCK_M, *ops.gemm_shape(element_type), ops.GEMM_SPLIT, ops.GEMM_SWAP)), None)

    table = arena.view(experts, slot_bytes)
    rows_t = torch.tensor(ids, device=device)
    offsets = torch.tensor(counts).cumsum(0).to(device, torch.int32)  # grouped_mm takes int32
    xs = x[order // top_k]

    def replaced() -> None:  # the old path: dequantize every touched expert, then grouped GEMMs
        objects = table.index_select(0, rows_t)
        w = {e.role: dequantize_many(objects[:, e.offset:e.offset + e.nbytes].contiguous(), element_type, e.shape,
                                     torch.bfloat16) for e in (gate, up, down)}
        gate_up = torch.cat([w[Role.GATE], w[Role.UP]], dim=1)  # [n, 2I, H]
        torch._grouped_mm(xs, gate_up.transpose(-2, -1), offs=offsets)
        torch._grouped_mm(h, w[Role.DOWN].transpose(-2, -1), offs=offsets)

    try:
        replaced_us = time_in_graph(replaced, repeats=3)
    except RuntimeError as exc:  # a torch without grouped_mm for this case: the GEMM's rows still count
        replaced_us, replaced_error = None, str(exc)[:200]
    else:
        replaced_error = None
    if install:
        ops.GEMM_BLOCK_M = best["block_m"]
        ops.GEMM_TYPE_TUNING[element_type] = (best["block_n"], best["warps"])
        ops.GEMM_SPLIT = best["split"]
        ops.GEMM_SWAP = best["swap"]
    return {"type": type_name, "kind": "gemm", "tokens": tokens, "experts_touched": len(ids), "top_k": top_k,
            "rows": rows, "best": best, "shipped": shipped, "replaced_us": replaced_us,
            "replaced_error": replaced_error}


def gemm_report(result: dict) -> str:
    lines = [f"{result['type']} grouped GEMM, {result['tokens']}-token prefill, {result['experts_touched']} experts "
             f"touched (top-{result['top_k']}):"]
    for r in result["rows"]:
        lines.append(f"  pairs/block {r['block_m']:3d} rows/program {r['block_n']:3d} warps {r['warps']} "
                     f"{'parts' if r['split'] else 'whole'}{' swapped' if r['swap'] else ''}: up "
                     f"{r['up_us']:7.1f} us  down {r['down_us']:7.1f} us  {r['gbps']:7.1f} GB/s of weights")
    b, shipped = result["best"], result.get("shipped")
    total = b["up_us"] + b["down_us"]
    if shipped is not None:
        lines.append(f"  shipped {shipped['block_m']}x{shipped['block_n']}x{shipped['warps']} "
                     f"{'parts' if shipped['split'] else 'whole'}{' swapped' if shipped['swap'] else ''}: {shipped['up_us'] + shipped['down_us']:.1f} us "
                     f"per layer ({(shipped['up_us'] + shipped['down_us']) / total:.2f}x the best)")
    if result["replaced_us"] is None:
        lines.append(f"  best {b['block_m']}x{b['block_n']}x{b['warps']}: {total:.1f} us per layer; dequantize + "
                     f"grouped_mm failed: {result['replaced_error']}")
    else:
        lines.append(f"  best {b['block_m']}x{b['block_n']}x{b['warps']} {'parts' if b['split'] else 'whole'}{' swapped' if b['swap'] else ''}: "
                 f"{total:.1f} us per layer vs dequantize + "
                     f"grouped_mm {result['replaced_us']:.1f} us ({result['replaced_us'] / total:.2f}x)")
    return "\n".join(lines)


def report(result: dict) -> str:
    lines = [f"{result['type']} GEMV, top-{result['top_k']} experts of [2x{result['intermediate']}, {result['hidden']}] "
             f"+ [{result['hidden']}, {result['intermediate']}]:"]
    for r in result["rows"]:
        lines.append(f"  rows/program {r['block_n']:3d} warps {r['warps']}: up {r['up_us']:6.1f} us  down "
                     f"{r['down_us']:6.1f} us  {r['gbps']:7.1f} GB/s")
    b, d = result["best"], result["default"]
    lines.append(f"  best {b['block_n']}x{b['warps']}: {b['up_us'] + b['down_us']:.1f} us per layer vs default "
                 f"{d['up_us'] + d['down_us']:.1f} us")
    return "\n".join(lines)


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a prefill length is a positive integer, got {text!r}")
    return value


def gemm_config(text: str) -> tuple[int, int, int]:
    """'16x128x4' -> (pairs per block, rows per program, warps), each a power of two."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 and int(p) & (int(p) - 1) == 0 for p in parts):
        raise argparse.ArgumentTypeError(f"a GEMM shape is PAIRSxROWSxWARPS in powers of two, got {text!r}")
    return tuple(int(p) for p in parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--types", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--gemm-tokens", nargs="+", type=positive_int, default=[64],
                        help="prefill lengths the grouped GEMM is swept at (default 64)")
    parser.add_argument("--no-gemv", action="store_true", help="sweep the grouped GEMM only")
    parser.add_argument("--gemm-shapes", nargs="+", type=gemm_config, default=None,
                        help="the grouped GEMM's shapes to time, PAIRSxROWSxWARPS (default: GEMM_CONFIGS)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    # each sweep printed and kept as it ends: a call cut short by its time limit keeps what it measured
    cases = [] if args.no_gemv else [lambda name=name: sweep(name) for name in args.types]
    # the shipped launch shape stays installed between prefill lengths: each sweep's best is reported
    cases += [lambda name=name, tokens=tokens: gemm_sweep(name, tokens=tokens, install=False, configs=args.gemm_shapes)
              for name in args.types for tokens in args.gemm_tokens]
    results = []
    for case in cases:
        results.append(case())
        print(gemm_report(results[-1]) if results[-1].get("kind") == "gemm" else report(results[-1]), flush=True)
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
