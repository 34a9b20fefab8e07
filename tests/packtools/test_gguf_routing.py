"""Routing as a GGUF file states it: which model a deepseek2 file is (its gating function), and
group-limited routing as llama.cpp reads it. The files are llama.cpp converter outputs
(tests/golden/llamacpp) with single keys or tensors changed."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch
from gguf_handmade import rewrite_gguf

from inference.experts import LocalPackSource
from inference.model import load_model
from packtools.build import build_bundle
from packtools.gguf.errors import InvalidMetadataError, UnknownArchitectureError
from packtools.gguf.source import GGUFSource

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llamacpp"
DEEPSEEK_V3 = GOLDEN / "deepseek_v3-F32.gguf"  # 4 experts, groups 2 (1 kept), sigmoid, exp_probs_b in blk.1
KIMI_LINEAR = GOLDEN / "kimi_linear-F32.gguf"  # 4 experts, group used count 1 and no group count
KV = gguf.GGUFValueType
GATING, NORM = "deepseek2.expert_gating_func", "deepseek2.expert_weights_norm"
GROUPS, KEPT = "deepseek2.expert_group_count", "deepseek2.expert_group_used_count"
SOFTMAX = (int(gguf.ExpertGatingFuncType.SOFTMAX), KV.UINT32)
DELETE = (None, None)  # rewrite_gguf drops the key
SELECTION_BIAS = {"blk.1.exp_probs_b.bias"}
V2 = {GATING: SOFTMAX, NORM: DELETE}  # what DeepSeek-V2's converter writes: softmax, no renormalisation

DEEPSEEK2_FILES = [
    # (key changes, dropped tensors, config expected)
    pytest.param({}, set(), {"model_type": "deepseek_v3", "n_group": 2, "topk_group": 1}, id="sigmoid-is-v3"),
    pytest.param(V2, SELECTION_BIAS, {"model_type": "deepseek_v2", "topk_method": "group_limited_greedy",
                                      "n_group": 2, "topk_group": 1, "norm_topk_prob": False}, id="softmax-is-v2"),
    pytest.param({**V2, GATING: DELETE}, SELECTION_BIAS, {"model_type": "deepseek_v2"},
                 id="no-gating-key-is-v2-as-in-llamacpp"),
    pytest.param({**V2, GROUPS: DELETE, KEPT: DELETE}, SELECTION_BIAS,
                 {"model_type": "deepseek_v2", "topk_method": "greedy", "n_group": 1, "topk_group": 1},
                 id="v2-lite-no-groups-is-greedy"),
    pytest.param({**V2, KEPT: (2, KV.UINT32)}, SELECTION_BIAS, {"n_group": 2, "topk_group": 2},
                 id="every-group-kept"),
]


@pytest.mark.parametrize("kv,drop,expected", DEEPSEEK2_FILES)
def test_deepseek2_files_map_by_gating_function(tmp_path, kv, drop, expected):
    path = rewrite_gguf(DEEPSEEK_V3, tmp_path / "m.gguf", kv, drop, {})
    with GGUFSource(path) as source:
        config = source.hf_config()
    assert {key: config[key] for key in expected} == expected


REFUSED = [
    # (key changes, dropped tensors, error, message)
    pytest.param({GATING: SOFTMAX}, set(), UnknownArchitectureError,
                 r"expert_gating_func 1 \(softmax\) with expert-selection biases \(exp_probs_b\)",
                 id="softmax-with-selection-bias"),
    pytest.param({GATING: DELETE}, set(), UnknownArchitectureError,
                 r"expert_gating_func absent \(llama.cpp reads softmax\) with expert-selection biases",
                 id="v3-converted-without-scoring-func"),
    pytest.param({GATING: (3, KV.UINT32)}, set(), UnknownArchitectureError, r"expert_gating_func 3 is none of",
                 id="unknown-gating"),
    pytest.param({GATING: SOFTMAX, NORM: (True, KV.BOOL)}, SELECTION_BIAS, InvalidMetadataError,
                 r"deepseek2\.expert_weights_norm=True: transformers' DeepseekV2 router never renormalises",
                 id="v2-renormalised"),
    pytest.param({GROUPS: (3, KV.UINT32)}, set(), InvalidMetadataError,
                 r"deepseek2\.expert_group_count=3: the 4 experts do not split", id="uneven-groups"),
    pytest.param({KEPT: (3, KV.UINT32)}, set(), InvalidMetadataError,
                 r"deepseek2\.expert_group_used_count=3: .* between 1 and deepseek2\.expert_group_count=2",
                 id="more-groups-kept-than-exist"),
    pytest.param({KEPT: DELETE}, set(), InvalidMetadataError, r"expert_group_used_count=None", id="groups-none-kept"),
]


@pytest.mark.parametrize("kv,drop,error,message", REFUSED)
def test_unmappable_deepseek2_routing_is_refused_by_name(tmp_path, kv, drop, error, message):
    path = rewrite_gguf(DEEPSEEK_V3, tmp_path / "m.gguf", kv, drop, {})
    with pytest.raises(error, match=message):
        GGUFSource(path).close()


KIMI_GROUPS = [
    # llama.cpp's converter looks for n_group, which Moonshot's config spells num_expert_group: it
    # writes topk_group alone, and llama.cpp then limits nothing (groups count only when > 1)
    pytest.param({"kimi-linear.expert_group_used_count": (2, KV.UINT32)}, (1, 1), id="used-count-alone"),
    pytest.param({"kimi-linear.expert_group_count": (2, KV.UINT32)}, (2, 1), id="two-groups-one-kept"),
]


@pytest.mark.parametrize("kv,groups", KIMI_GROUPS)
def test_kimi_linear_groups_as_llamacpp_reads_them(tmp_path, kv, groups):
    path = rewrite_gguf(KIMI_LINEAR, tmp_path / "m.gguf", kv, set(), {})
    with GGUFSource(path) as source:
        config = source.hf_config()
    assert (config["num_expert_group"], config["topk_group"]) == groups


@pytest.mark.slow  # builds and generates 32 tokens (~14 s); test_kimi_linear_groups_as_llamacpp_reads_them covers the read
def test_kimi_linear_converter_file_with_two_groups_kept_generates_llamacpps_tokens(tmp_path):
    """The held-out failure: a converter file with expert_group_used_count 2 and no group count built
    to num_expert_group 1, topk_group 2 and crashed in generate ("selected index k out of range").
    llama.cpp limits nothing there (run once on this very file: logits bit-identical to the golden's,
    whose used count is 1), so the bundle must give llama.cpp's 32 greedy tokens of the golden."""
    record = json.loads(KIMI_LINEAR.with_suffix(".json").read_text())
    path = rewrite_gguf(KIMI_LINEAR, tmp_path / "m.gguf", {"kimi-linear.expert_group_used_count": (2, KV.UINT32)},
                        set(), {})
    build_bundle(path, tmp_path / "bundle", progress=False)
    with load_model(tmp_path / "bundle", device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert (loaded.config.num_expert_group, loaded.config.topk_group) == (1, 1)
        prompt = torch.tensor([record["prompt"]])
        out = loaded.model.generate(prompt, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
    assert out[0, prompt.shape[1]:].tolist() == record["tokens"]
