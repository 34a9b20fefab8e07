"""How closely the fast path (storaged's slot map, CUDA graphs, compiled layers) follows the
resident reference, position by position.

    python bench/agreement.py --shape qwen3 --layers 12 --prompts 16 --tokens 64 --out /tmp/agreement.json

For each of `--prompts` random prompts, the resident model (every expert dequantized into
transformers' own experts, bfloat16) decodes `--tokens` greedy tokens. Then:
- teacher forcing: the fast path (StaticDecoder) is fed the same prompt and the reference's tokens,
  and at every position its top-1 token is compared with the reference's, and its logits with the
  reference's logits of the same position (the largest absolute difference, also relative to the
  largest absolute logit);
- free running: the fast path's own greedy tokens, compared with the reference's.
Prints the top-1 agreement (the issue's bar: at least 99% of 1,000 positions), the logits bound
and how many prompts gave identical greedy tokens; --out keeps JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from bench.e2e.generation import prompt_ids  # noqa: E402
from bench.e2e.prepare import prepare_model  # noqa: E402
from bench.e2e.shapes import FULL_SHAPES, TINY_SHAPES  # noqa: E402


@torch.inference_mode()
def reference_runs(model, prompts: list[list[int]], tokens: int, device) -> list[dict]:
    """Per prompt: the resident model's greedy tokens, and its logits [tokens, V] at each decode
    position (the logits after the prompt, then after each generated token but the last)."""
    runs = []
    for prompt in prompts:
        out = model(input_ids=torch.tensor([prompt], device=device), use_cache=True)
        cache, logits, generated, kept = out.past_key_values, out.logits[0, -1], [], []
        for _ in range(tokens):
            kept.append(logits.float().cpu())
            token = int(logits.argmax())
            generated.append(token)
            out = model(input_ids=torch.tensor([[token]], device=device), past_key_values=cache, use_cache=True)
            cache, logits = out.past_key_values, out.logits[0, -1]
        runs.append({"tokens": generated, "logits": torch.stack(kept)})
    return runs


@torch.inference_mode()
def fast_path_runs(decoder, prompts: list[list[int]], references: list[dict]) -> tuple[list[dict], list[list[int]]]:
    """Teacher-forced logits of the decoder on the references' tokens, and its own greedy tokens."""
    forced, free = [], []
    for prompt, reference in zip(prompts, references, strict=True):
        logits, kept = decoder.start(prompt), []
        for token in reference["tokens"]:
            kept.append(logits.float().cpu())
            logits = decoder.step(token)
        forced.append({"logits": torch.stack(kept)})
        logits, own = decoder.start(prompt), []
        for _ in reference["tokens"]:
            own.append(int(logits.argmax()))
            logits = decoder.step(own[-1])
        free.append(own)
    return forced, free


def compare(references: list[dict], forced: list[dict], free: list[list[int]]) -> dict:
    positions = agree = 0
    worst_abs = worst_rel = 0.0
    for reference, fast in zip(references, forced, strict=True):
        ref, got = reference["logits"], fast["logits"]  # [tokens, V]
        positions += ref.shape[0]
        agree += int((ref.argmax(-1) == got.argmax(-1)).sum())
        diff = (ref - got).abs().amax(-1)  # [tokens]
        scale = ref.abs().amax(-1).clamp(min=1e-30)
        worst_abs = max(worst_abs, float(diff.max()))
        worst_rel = max(worst_rel, float((diff / scale).max()))
    identical = sum(r["tokens"] == own for r, own in zip(references, free, strict=True))
    return {"positions": positions, "top1_agreement": agree / positions, "max_abs_logit_diff": worst_abs,
            "max_rel_logit_diff": worst_rel, "greedy_identical_prompts": identical, "prompts": len(free)}


def run(args) -> dict:
    from bench.e2e.resident import load_resident
    from bench.layer_profile import _build, _prewarm

    shape = (TINY_SHAPES if args.tiny else FULL_SHAPES)[args.shape]
    device, dtype = torch.device(args.device), torch.bfloat16
    workdir = Path(args.workdir)
    model = prepare_model(shape, args.layers, workdir, with_bf16_checkpoint=False, balanced_routing=True)
    loaded, _ = load_resident(model.bundle_dir, device=device, dtype=dtype)
    vocab = loaded.model.config.vocab_size
    prompts = [prompt_ids(vocab, args.prompt_len, seed=1000 + i)[0].tolist() for i in range(args.prompts)]
    try:
        references = reference_runs(loaded.model, prompts, args.tokens, device)
    finally:
        loaded.close()
        torch.cuda.empty_cache() if device.type == "cuda" else None
    results = {"shape": shape.name, "layers": args.layers, "prompt_len": args.prompt_len, "tokens": args.tokens,
               "modes": {}}
    for mode in args.modes:
        built, decoder, source, closers, _ = _build(mode, model, device, dtype, workdir,
                                                    args.prompt_len + args.tokens + 16)
        try:
            _prewarm(source, model.bundle_dir)
            forced, free = fast_path_runs(decoder, prompts, references)
            results["modes"][mode] = compare(references, forced, free) | {
                "steps_redone": decoder.redone_steps, "prefills_through_slot_map": decoder.lookup_prefills}
        finally:
            for close in closers:
                close()
        print(mode, results["modes"][mode], flush=True)
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(FULL_SHAPES), default="qwen3")
    parser.add_argument("--tiny", action="store_true", help="the CPU smoke-test size of the shape")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--modes", nargs="+", choices=["storaged-graph", "storaged-graph-compiled"],
                        default=["storaged-graph-compiled"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--workdir", default=tempfile.gettempdir() + "/expertpack-profile")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    results = run(args)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
