"""The decode step's dense kernels against the ones they replace, on a bench shape's real sizes:
the one-row GEMV (inference.kernels.dense_gemv) against cuBLAS (F.linear) for every nn.Linear of
the model, and the one-query attention (inference.kernels.decode_attention) against torch's SDPA
as transformers calls it in a compiled decode step (keys repeated per query head, a boolean mask
over the static cache) and with cuDNN's kernel.

    python bench/dense_kernels.py --shapes qwen3 deepseek --json out.json
    python bench/dense_kernels.py --shapes qwen3-30b-a3b deepseek-v3     # the published models' sizes

Each case is launched 20 times in a CUDA graph and timed by replay; weights rotate over copies
that together exceed the L2 cache, as a decode step's weights do. A GEMV case prints
microseconds per launch and the weight bytes read per second; `--sweep` also times every launch
shape (rows per program, columns per step, warps) and prints the fastest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.e2e.shapes import FULL_SHAPES  # noqa: E402
from bench.gemv_sweep import time_in_graph  # noqa: E402
from inference.kernels import dense_ops  # noqa: E402

ROTATE_BYTES = 256 << 20  # weights cycled through per case: five times the H200's 50 MiB L2
SWEEP = [(n, k, w) for n in (1, 2, 4, 8, 16) for k in (256, 512, 1024) for w in (2, 4, 8)
         if n * k >= 32 * w and n * k <= 16384]


# The published models' own sizes (their config.json), for the kernels at the sizes users run:
# (module, N, K) of each distinct nn.Linear, attention dims, a softmax router's (E, H, k) or None
PUBLISHED = {
    "qwen3-30b-a3b": ([("q_proj", 4096, 2048), ("k_proj", 512, 2048), ("o_proj", 2048, 4096),
                       ("lm_head", 151936, 2048)],
                      {"heads": 32, "kv_heads": 4, "key_dim": 128, "value_dim": 128, "router": (128, 2048, 8)}),
    "deepseek-v3": ([("q_a_proj", 1536, 7168), ("q_b_proj", 24576, 1536), ("kv_a_proj_with_mqa", 576, 7168),
                     ("kv_b_proj", 32768, 512), ("o_proj", 7168, 16384), ("shared gate_proj", 2048, 7168),
                     ("shared down_proj", 7168, 2048), ("lm_head", 129280, 7168)],
                    {"heads": 128, "kv_heads": 128, "key_dim": 192, "value_dim": 128, "router": None}),
}


def model_dims(shape_key: str) -> tuple[list[tuple[str, int, int]], dict]:
    """((module name, N, K) of every distinct nn.Linear, attention dims) of the shape's model."""
    if shape_key in PUBLISHED:
        return PUBLISHED[shape_key]
    from transformers import AutoModelForCausalLM

    from packtools.synth.gguf_models import tiny_config_with

    shape = FULL_SHAPES[shape_key]
    sizes = shape.synth_sizes(2)
    config = tiny_config_with(shape.arch, **sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    linears: dict[tuple[int, int], str] = {}
    for name, module in model.named_modules():
        if type(module) is torch.nn.Linear:
            linears.setdefault(tuple(module.weight.shape), name.split(".")[-1])
    attention = next(m for m in model.modules() if type(m).__name__.endswith("Attention"))
    router = next((m for m in model.modules() if type(m).__name__.endswith("TopKRouter")), None)
    q_dim = getattr(attention, "qk_head_dim", None) or getattr(attention, "head_dim")
    v_dim = getattr(config, "v_head_dim", None) or q_dim
    dims = {"heads": config.num_attention_heads, "kv_heads": getattr(config, "num_key_value_heads", None)
            or config.num_attention_heads, "key_dim": q_dim, "value_dim": v_dim,
            # a softmax top-k router's (experts, hidden, k) where the model has one
            "router": (router.weight.shape[0], router.weight.shape[1], router.top_k) if router is not None else None}
    return [(name, n, k) for (n, k), name in sorted(linears.items(), key=lambda kv: kv[1])], dims


def _copies(nbytes: int) -> int:
    return max(2, min(64, -(-ROTATE_BYTES // max(nbytes, 1))))


def gemv_case(name: str, n: int, k: int, sweep: bool) -> dict:
    device = torch.device("cuda")
    copies = _copies(n * k * 2)
    weights = [torch.randn(n, k, device=device, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
    turn = iter(range(1 << 30))

    def rotating(launch):
        return lambda: launch(weights[next(turn) % copies])

    exact = (x.double() @ weights[0].double().T).float()
    ours = dense_ops.gemv(x, weights[0])
    cublas = F.linear(x, weights[0])
    result = {"module": name, "n": n, "k": k, "mib": n * k * 2 / 2**20, "config": dense_ops.gemv_config(n, k, device),
              "max_error_ours": float((ours.float() - exact).abs().max()),
              "max_error_cublas": float((cublas.float() - exact).abs().max())}
    result["cublas_us"] = time_in_graph(rotating(lambda w: F.linear(x, w)), repeats=max(20, copies))
    result["ours_us"] = time_in_graph(rotating(lambda w: dense_ops.gemv(x, w)), repeats=max(20, copies))
    if sweep:
        timings = {}
        for config in SWEEP:
            dense_ops.GEMV_TUNING[(n, k)] = config
            try:
                timings[config] = time_in_graph(rotating(lambda w: dense_ops.gemv(x, w)), repeats=max(20, copies))
            except Exception as exc:  # a launch shape triton refuses (registers, shared memory)
                print(f"  {config}: {type(exc).__name__}", file=sys.stderr)
        del dense_ops.GEMV_TUNING[(n, k)]
        best = min(timings, key=timings.get)
        result["best_config"], result["best_us"] = list(best), timings[best]
    for key in ("cublas", "ours", "best"):
        if f"{key}_us" in result:
            result[f"{key}_tbps"] = n * k * 2 / result[f"{key}_us"] / 1e6
    return result


def attention_case(dims: dict, length: int, visible: int) -> dict:
    device = torch.device("cuda")
    heads, kv_heads, dk, dv = dims["heads"], dims["kv_heads"], dims["key_dim"], dims["value_dim"]
    group = heads // kv_heads
    query = torch.randn(1, 1, heads, dk, device=device, dtype=torch.bfloat16).transpose(1, 2)
    key = torch.randn(1, kv_heads, length, dk, device=device, dtype=torch.bfloat16)
    value = torch.randn(1, kv_heads, length, dv, device=device, dtype=torch.bfloat16)
    mask = torch.arange(length, device=device).view(1, 1, 1, length) < visible
    scale = dk ** -0.5

    def sdpa() -> torch.Tensor:  # transformers' sdpa_attention_forward under torch.compile
        k, v = key.repeat_interleave(group, 1), value.repeat_interleave(group, 1)
        return F.scaled_dot_product_attention(query, k, v, attn_mask=mask, scale=scale).transpose(1, 2)

    def sdpa_cudnn() -> torch.Tensor:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa()

    def ours() -> torch.Tensor:
        return dense_ops.attention(query, key, value, mask, scale)

    k64, v64 = key.double().repeat_interleave(group, 1), value.double().repeat_interleave(group, 1)
    scores = (query.double() @ k64.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    exact = (scores.softmax(-1) @ v64).transpose(1, 2)
    result = {"length": length, "visible": visible, "heads": heads, "kv_heads": kv_heads, "key_dim": dk,
              "value_dim": dv}
    for label, fn in (("sdpa", sdpa), ("sdpa_cudnn", sdpa_cudnn), ("ours", ours)):
        try:
            result[f"max_error_{label}"] = float((fn().double() - exact).abs().max())
            result[f"{label}_us"] = time_in_graph(fn)
        except Exception as exc:  # cuDNN refuses some head sizes and masks
            result[f"{label}_us"] = None
            result[f"{label}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    return result


def router_case(experts: int, hidden: int, top_k: int) -> dict:
    """A softmax top-k router (Qwen3's formula, renormalized) for one token: torch's kernels as
    transformers calls them against the GEMV and inference.kernels.router_topk."""
    device = torch.device("cuda")
    weight = torch.randn(experts, hidden, device=device, dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, hidden, device=device, dtype=torch.bfloat16)

    def torch_router():
        probs = F.linear(x, weight).softmax(-1, dtype=torch.float)
        values, ids = torch.topk(probs, top_k, dim=-1)
        return (values / values.sum(-1, keepdim=True)).to(x.dtype), ids

    def ours():
        return dense_ops.softmax_topk(dense_ops.gemv(x, weight), top_k, renormalize=True, dtype=x.dtype)

    same = torch.equal(torch_router()[1].sort().values, ours()[1].sort().values)
    return {"experts": experts, "hidden": hidden, "top_k": top_k, "same_experts": same,
            "torch_us": time_in_graph(torch_router), "ours_us": time_in_graph(ours)}


def report(results: dict) -> str:
    lines = []
    for shape, data in results.items():
        lines.append(f"{shape}: GEMV, one row (us per launch, TB/s of weights)")
        total = {"cublas_us": 0.0, "ours_us": 0.0}
        for case in data["gemv"]:
            best = f"  best {tuple(case['best_config'])} {case['best_us']:.2f} us" if "best_us" in case else ""
            lines.append(f"  {case['module']:>20} [{case['n']:>5} x {case['k']:>5}] {case['mib']:6.1f} MiB  "
                         f"cuBLAS {case['cublas_us']:7.2f} ({case['cublas_tbps']:.2f})  ours {case['ours_us']:7.2f} "
                         f"({case['ours_tbps']:.2f}) {tuple(case['config'])}  x{case['cublas_us'] / case['ours_us']:.2f}"
                         f"{best}")
            for key in total:
                total[key] += case[key]
        lines.append(f"  sum of distinct shapes: cuBLAS {total['cublas_us']:.1f} us, "
                     f"ours {total['ours_us']:.1f} us")
        lines.append(f"{shape}: attention, one query (us per layer)")
        for case in data["attention"]:
            cells = "  ".join(f"{label} {case[f'{label}_us']:.2f}" if case.get(f"{label}_us") is not None
                              else f"{label} n/a" for label in ("sdpa", "sdpa_cudnn", "ours"))
            lines.append(f"  {case['length']:>6} keys, {case['visible']:>5} visible: {cells}")
        if data.get("router"):
            case = data["router"]
            lines.append(f"{shape}: softmax top-{case['top_k']} router of {case['experts']} experts: torch "
                         f"{case['torch_us']:.2f} us, ours {case['ours_us']:.2f} us "
                         f"(same experts: {case['same_experts']})")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(FULL_SHAPES) + sorted(PUBLISHED),
                        default=sorted(FULL_SHAPES),
                        help="the bench shapes (bench/e2e/shapes.py) or published models' sizes")
    parser.add_argument("--lengths", nargs="+", type=int, default=[300, 4096],
                        help="static cache lengths of the attention cases")
    parser.add_argument("--visible", type=int, default=250, help="keys the mask shows (at most the length)")
    parser.add_argument("--sweep", action="store_true", help="also time every GEMV launch shape")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("the kernels are timed on CUDA; this machine has none")
    if args.visible < 1 or any(length < 1 for length in args.lengths):
        parser.error("--visible and --lengths take positive numbers of keys")
    results = {}
    for shape in args.shapes:
        linears, dims = model_dims(shape)
        results[shape] = {
            "gemv": [gemv_case(name, n, k, args.sweep) for name, n, k in linears],
            "attention": [attention_case(dims, length, min(args.visible, length)) for length in args.lengths],
            "router": router_case(*dims["router"]) if dims["router"] else None}
    print(report(results), flush=True)
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
