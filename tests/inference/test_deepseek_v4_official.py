"""DeepSeek-V4 end to end: DeepSeek's published layout and llama.cpp's deepseek4 GGUF of it.

The committed golden GGUF (tests/golden/llamacpp/deepseek_v4-MXFP4.gguf) is llama.cpp's converter
run on exactly the checkpoint synthesized here (scripts/llamacpp_golden.py, case deepseek_v4-MXFP4):
so the bundle built from the official checkpoint and the one built from the GGUF must compute the
same function (the MXFP4 repack is lossless and both dense paths are exact), and both must give
llama.cpp's 32 greedy tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from inference.experts import LocalPackSource
from inference.model import load_model
import packtools.build as _build
from packtools.build import build_bundle
from packtools.synth.deepseek_v4_official import synth_official

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llamacpp"
CASE = "deepseek_v4-MXFP4"
SIZES = {"hidden_size": 64, "moe_intermediate_size": 32, "num_experts": 4}  # the script's NARROW
OVERRIDES = {"index_topk": 64}  # the script's case overrides
pytestmark = pytest.mark.usefixtures("one_thread")


def _official(tmp_path: Path) -> Path:
    out = synth_official(tmp_path / "official", seed=5, **SIZES).out_dir
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, **OVERRIDES}, indent=2) + "\n")
    return out


@torch.no_grad()
def _logits_and_greedy(bundle: Path, prompt: list[int], tokens: list[int]) -> tuple[np.ndarray, list[int]]:
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        logits = loaded.model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:].numpy()
        out = loaded.model.generate(torch.tensor([prompt]), max_new_tokens=len(tokens), min_new_tokens=len(tokens),
                                    do_sample=False, pad_token_id=0)
    return logits, out[0, len(prompt):].tolist()


def test_official_checkpoint_and_its_gguf_give_the_same_outputs_and_llamacpps_tokens(tmp_path):
    source = _build.open_source(_official(tmp_path / "probe"))
    source.close()
    assert type(source).__name__ == "DeepseekV4OfficialSource", "packtools build must route DeepSeek's layout"
    record = json.loads((GOLDEN / f"{CASE}.json").read_text())
    prompt, tokens = record["prompt"], record["tokens"]
    build_bundle(_official(tmp_path), tmp_path / "from_hf", progress=False)
    build_bundle(GOLDEN / record["gguf"], tmp_path / "from_gguf", progress=False)
    hf_logits, hf_greedy = _logits_and_greedy(tmp_path / "from_hf", prompt, tokens)
    gguf_logits, gguf_greedy = _logits_and_greedy(tmp_path / "from_gguf", prompt, tokens)
    assert np.array_equal(hf_logits, gguf_logits), "the official and GGUF bundles compute different functions"
    assert hf_greedy == gguf_greedy == tokens, "greedy tokens differ from llama.cpp's"
    expected = np.load(GOLDEN / record["logits"])
    assert np.abs(hf_logits - expected).max() / np.abs(expected).max() < 1e-2
