"""`packtools synth`: arguments and dispatch to the HF and GGUF synthesizers."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_synth_arguments(p: argparse.ArgumentParser) -> None:
    from packformat.quant_types import QUANT_TYPES  # gguf-py, not transformers: ~0.1 s

    gguf_types = " ".join(t.name for t, record in QUANT_TYPES.items() if record.self_contained)
    # No `choices=`: listing the architectures imports transformers, which would cost every
    # packtools command (validate, inspect) seconds of start-up; run_synth checks the name instead.
    p.add_argument("arch", metavar="ARCH",
                   help="transformers model_type of a supported MoE architecture (an unknown name lists them)")
    p.add_argument("-o", "--output", required=True,
                   help="output directory (hf) or .gguf file path (gguf; split sets get -0000N-of-0000M)")
    p.add_argument("--format", choices=("hf", "gguf"), default="hf")
    p.add_argument("--layout", choices=("transformers", "official"), default="transformers",
                   help="hf: what save_pretrained writes, or the vendor's published layout (deepseek_v4: FP8 "
                        "dense + scales, FP4 experts + scales, DeepSeek's names and config keys; kimi_k3: "
                        "compressed-tensors MXFP4 experts, bf16 dense, Moonshot's multimodal wrapper)")
    p.add_argument("--expert-type", default=None,
                   help=f"expert element type: {gguf_types} (gguf; default F32) "
                        "or float32/bfloat16/float16 (hf; default bfloat16)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hidden-size", type=int, default=None,
                   help="default 64, or 256 when the expert type's block is 256 elements (K-quants)")
    p.add_argument("--layers", type=int, default=None,
                   help="number of layers (default 2; gguf kimi_linear 4, so both attention kinds appear)")
    p.add_argument("--experts", type=int, default=8, help="routed experts per layer")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--moe-intermediate-size", type=int, default=None,
                   help="default 32, or 256 when the expert type's block is 256 elements (K-quants)")
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--balanced-routing", action="store_true",
                   help="gguf: routers that spread tokens over the experts like a trained model's (for benchmarks; "
                        "a plain random model routes nearly every token to the same few experts)")
    p.add_argument("--split-max-tensors", type=int, default=None,
                   help="gguf: write a split set with at most this many tensors per shard")


def _block_elements(expert_type: str | None) -> int:
    from packformat.quant_types import ElementType, block_shape

    if expert_type is None or expert_type.upper() not in ElementType.__members__:
        return 1  # hf dtypes (float32, bfloat16, ...) are not blocked
    return block_shape(ElementType[expert_type.upper()])[0]


def _sizes(args) -> dict:
    # Rows must be whole blocks: a K-quant needs 256-element rows in both directions.
    block = _block_elements(args.expert_type)
    hidden = args.hidden_size or max(64, block)
    inter = args.moe_intermediate_size or max(32, block)
    sizes = dict(hidden_size=hidden, num_experts=args.experts, top_k=args.top_k,
                 moe_intermediate_size=inter, vocab_size=args.vocab_size)
    if args.layers is not None:
        sizes["num_layers"] = args.layers
    return sizes


def _synth_official(args, out: Path) -> Path:
    if args.arch not in ("deepseek_v4", "kimi_k3") or args.format != "hf":
        raise ValueError(f"--layout official exists for deepseek_v4 and kimi_k3 --format hf, not {args.arch} "
                         f"--format {args.format}")
    if args.expert_type is not None:
        raise ValueError("--layout official fixes the dtypes (FP4 experts with scales); drop --expert-type")
    if args.arch == "kimi_k3":
        from packtools.synth.compressed_tensors import synth_kimi_k3_mxfp4

        return synth_kimi_k3_mxfp4(out, seed=args.seed, **_sizes(args))
    from packtools.synth.deepseek_v4_official import synth_official

    # default 3 layers: one sliding-window, one CSA and one HCA layer
    return synth_official(out, seed=args.seed, **_sizes(args)).out_dir


def run_synth(args) -> Path:
    from packtools.arch import get_arch

    get_arch(args.arch)  # UnknownArchitectureError names the known ones
    out = Path(args.output)
    if out.exists():
        raise FileExistsError(f"{out}: already exists; synth never overwrites")
    if args.balanced_routing and args.format != "gguf":
        raise ValueError("--balanced-routing exists for --format gguf (the benchmark models)")
    if args.layout == "official":
        return _synth_official(args, out)
    if args.format == "hf":
        from packtools.synth.hf import synth_hf

        result = synth_hf(args.arch, out, seed=args.seed, dtype=args.expert_type or "bfloat16", **_sizes(args))
        return result.out_dir
    from packtools.synth.gguf_cli import synth_gguf_model

    files = synth_gguf_model(args.arch, out, seed=args.seed, expert_type=args.expert_type or "F32",
                             balanced_routing=args.balanced_routing,
                             split_max_tensors=args.split_max_tensors, **_sizes(args))
    return files[0]
