"""synth_gguf_model(balanced_routing=True): a random model that routes like a load-balanced one,
so benchmarks on synthetic models reach the cache-miss regime a trained model would."""

from __future__ import annotations

import collections

import pytest
import torch

from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_cli import synth_gguf_model

SIZES = dict(hidden_size=256, num_experts=64, top_k=4, moe_intermediate_size=32, num_layers=6)


def distinct_experts_per_layer(path, prompt_len: int = 32) -> list[int]:
    """How many different experts each MoE layer picks for one random prompt (the GGUF's model)."""
    with GGUFSource(path) as source:
        model = load_reference_model(source)
    picks = collections.defaultdict(set)
    for name, module in model.named_modules():
        if hasattr(module, "down_proj") and hasattr(module, "has_gate"):
            module.register_forward_pre_hook(
                lambda _, args, name=name: picks[name].update(args[1].flatten().tolist()))
    ids = torch.randint(3, model.config.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)
    return [len(picks[name]) for name in sorted(picks)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v3"])
def test_balanced_routing_spreads_tokens_over_the_experts(tmp_path, arch):
    plain = distinct_experts_per_layer(synth_gguf_model(arch, tmp_path / "plain.gguf", **SIZES)[0])
    balanced = distinct_experts_per_layer(
        synth_gguf_model(arch, tmp_path / "balanced.gguf", balanced_routing=True, **SIZES)[0])
    uniform = 64 * (1 - (1 - 4 / 64) ** 32)  # ~55 experts for 32 tokens routed at random
    # the deepest layers are where a random model collapses; there balanced routing is near uniform
    assert min(balanced[-2:]) > 0.8 * uniform, (plain, balanced)
    assert sum(balanced) > 1.3 * sum(plain), (plain, balanced)


def test_balanced_routing_also_applies_to_streamed_models(tmp_path):
    """Above the streaming threshold the dense state is built apart from the model: same rule."""
    small = synth_gguf_model("qwen3_moe", tmp_path / "a.gguf", balanced_routing=True, **SIZES)[0]
    streamed = synth_gguf_model("qwen3_moe", tmp_path / "b.gguf", balanced_routing=True,
                                stream_threshold_bytes=0, **SIZES)[0]
    assert distinct_experts_per_layer(streamed)[-1] > 40 and distinct_experts_per_layer(small)[-1] > 40


def test_cli_refuses_balanced_routing_for_hf_checkpoints(tmp_path, capsys):
    from packtools.cli import main

    assert main(["synth", "qwen3_moe", "--format", "hf", "--balanced-routing", "-o", str(tmp_path / "x")]) == 2
    assert "--balanced-routing exists for --format gguf" in capsys.readouterr().err
    assert main(["synth", "qwen3_moe", "--format", "gguf", "--balanced-routing", "-o", str(tmp_path / "x.gguf")]) == 0
