"""synth_hf: real, loadable, deterministic random-weight checkpoints, materialized or streamed."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from packtools.arch import ARCHITECTURES, UnknownArchitectureError, get_arch, tiny_config
from packtools.synth.hf import expert_bytes, synth_hf

ARCHS = sorted(ARCHITECTURES)
STREAMED = {"stream_threshold_bytes": 0, "max_shard_bytes": 50_000}


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.glob("*.safetensors"))}


def load_and_generate(path: Path) -> list[int]:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert len(tokenizer) == model.config.vocab_size
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is a cache?"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=12, do_sample=False, min_new_tokens=12)
    return out[0, prompt["input_ids"].shape[1]:].tolist()


@pytest.mark.parametrize("streamed", [False, True], ids=["materialized", "streamed"])
@pytest.mark.parametrize("arch", ARCHS)
def test_synth_writes_a_loadable_checkpoint_that_generates(arch, streamed, tmp_path):
    result = synth_hf(arch, tmp_path, seed=5, dtype="float32", **(STREAMED if streamed else {}))
    assert result.mode == ("streamed" if streamed else "materialized")
    names = set(result.files)
    assert {"config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"} <= names
    if streamed:
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2
        stored = set()
        for shard in tmp_path.glob("*.safetensors"):
            with safe_open(shard, "pt") as f:
                stored |= set(f.keys())
        assert index["weight_map"].keys() == stored
    else:
        assert "model.safetensors" in names
    tokens = load_and_generate(tmp_path)
    assert len(tokens) == 12 and len(set(tokens)) >= 3, tokens  # random weights, but not a stuck loop


@pytest.mark.parametrize("kwargs", [{}, STREAMED], ids=["materialized", "streamed"])
def test_synth_is_deterministic_in_the_seed(kwargs, tmp_path):
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        synth_hf("deepseek_v4", tmp_path / name, seed=seed, dtype="bfloat16", **kwargs)
    assert digest(tmp_path / "a") == digest(tmp_path / "b")
    assert digest(tmp_path / "a") != digest(tmp_path / "c")
    assert (tmp_path / "a" / "tokenizer.json").read_bytes() == (tmp_path / "c" / "tokenizer.json").read_bytes()


def test_routing_state_is_randomized(tmp_path):
    synth_hf("deepseek_v4", tmp_path / "v4", seed=0, dtype="float32")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "v4")
    tid2eid = model.model.layers[0].mlp.gate.tid2eid  # [vocab, k] experts per token of the hash layer
    assert tid2eid.min() >= 0 and tid2eid.max() < 8 and len(tid2eid.unique()) == 8
    assert (tid2eid[:, 0] != tid2eid[:, 1]).all()
    synth_hf("gpt_oss", tmp_path / "oss", seed=0, dtype="float32")
    experts = AutoModelForCausalLM.from_pretrained(tmp_path / "oss").model.layers[0].mlp.experts
    assert experts.gate_up_proj_bias.abs().sum() > 0 and experts.down_proj_bias.abs().sum() > 0


def test_expert_bytes_and_the_threshold_pick_the_mode(tmp_path):
    config = tiny_config("qwen3_moe")
    spec = get_arch("qwen3_moe")
    assert expert_bytes(spec, config, torch.bfloat16) == 2 * 8 * 3 * 32 * 64 * 2
    at = synth_hf("qwen3_moe", tmp_path / "at", stream_threshold_bytes=2 * 8 * 3 * 32 * 64 * 2)
    above = synth_hf("qwen3_moe", tmp_path / "above", stream_threshold_bytes=2 * 8 * 3 * 32 * 64 * 2 - 1)
    assert (at.mode, above.mode) == ("materialized", "streamed")


@pytest.mark.parametrize("kwargs, error", [
    ({"dtype": "int8"}, ValueError),
    ({"top_k": 20}, ValueError),
    ({"vocab_size": 100}, ValueError),  # smaller than the byte-level tokenizer's 261 entries
])
def test_synth_rejects_bad_options(kwargs, error, tmp_path):
    with pytest.raises(error):
        synth_hf("mixtral", tmp_path, **kwargs)


def test_synth_refuses_a_non_empty_directory(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("{}")  # e.g. left by an earlier run
    with pytest.raises(FileExistsError, match=str(tmp_path)):
        synth_hf("olmoe", tmp_path)


def test_synth_unknown_arch(tmp_path):
    with pytest.raises(UnknownArchitectureError, match="llama"):
        synth_hf("llama", tmp_path)
