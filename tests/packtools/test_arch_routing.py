"""Routing settings the transformers router cannot run as the config says are refused by name,
at build, before anything is written; the ones it can run pass."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from packtools.arch.errors import UnrunnableConfig
from packtools.arch.routing import check_routing
from packtools.build import build_bundle
from packtools.synth.gguf_models import tiny_config_with
from packtools.synth.hf import synth_hf

# tiny configs have 8 experts and top-2 (deepseek_v3/v2: n_group 4, topk_group 2)
REFUSED = [
    # (arch, overrides, key named, the transformers model fails at its first forward)
    pytest.param("kimi_linear", {"num_expert_group": 1, "topk_group": 2}, "topk_group", True,
                 id="kimi-keeps-more-groups-than-exist"),  # what kimi_linear GGUFs used to become
    pytest.param("deepseek_v3", {"n_group": 4, "topk_group": 5}, "topk_group", True, id="v3-topk-group-above-groups"),
    pytest.param("deepseek_v3", {"n_group": 3, "topk_group": 1}, "n_group", True, id="v3-uneven-groups"),
    pytest.param("deepseek_v3", {"n_group": 8, "topk_group": 4}, "n_group", True, id="v3-one-expert-groups"),
    pytest.param("deepseek_v3", {"n_group": 4, "topk_group": 0}, "topk_group", False, id="v3-no-group-kept"),
    pytest.param("deepseek_v3", {"n_group": 4, "topk_group": 1, "num_experts_per_tok": 3}, "topk_group", False,
                 id="v3-kept-groups-hold-fewer-than-top-k"),
    pytest.param("kimi_k3", {"num_expert_group": 2, "topk_group": 3}, "topk_group", True, id="k3-topk-group"),
    pytest.param("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method", True, id="v2-unknown-topk-method"),
    pytest.param("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob", False, id="v2-renormalise-ignored"),
    pytest.param("deepseek_v2", {"n_group": None, "topk_group": None}, "n_group", True, id="v2-grouped-without-groups"),
    pytest.param("deepseek_v2", {"n_group": 4, "topk_group": 5}, "topk_group", True, id="v2-topk-group-above-groups"),
]


@pytest.mark.parametrize("arch,overrides,key,forward_fails", REFUSED)
def test_unrunnable_routing_is_refused_by_name(arch, overrides, key, forward_fails):
    config = tiny_config_with(arch, overrides=overrides)
    with pytest.raises(UnrunnableConfig, match=rf"^{arch}: {key}=") as refused:
        check_routing(config)
    assert refused.value.setting == key
    if forward_fails:  # the refusal stands in for a crash, not a matter of taste
        model = AutoModelForCausalLM.from_config(config).eval()
        with pytest.raises((RuntimeError, IndexError, UnboundLocalError, TypeError)), torch.no_grad():
            model(torch.tensor([[3, 4, 5, 6]]))


ACCEPTED = [
    pytest.param("deepseek_v3", {}, id="v3-tiny"),
    pytest.param("deepseek_v3", {"n_group": 4, "topk_group": 4}, id="v3-every-group-kept"),
    pytest.param("kimi_linear", {}, id="kimi-tiny"),
    pytest.param("kimi_linear", {"num_expert_group": 4, "topk_group": 2}, id="kimi-groups"),
    pytest.param("deepseek_v2", {}, id="v2-tiny-group-limited"),
    pytest.param("deepseek_v2", {"topk_method": "greedy", "n_group": None, "topk_group": None}, id="v2-lite-greedy"),
    pytest.param("deepseek_v2", {"n_group": 8, "topk_group": 2}, id="v2-one-expert-groups-by-max"),
    pytest.param("qwen3_moe", {}, id="no-groups"),
]


@pytest.mark.parametrize("arch,overrides", ACCEPTED)
def test_runnable_routing_passes_and_runs(arch, overrides):
    config = tiny_config_with(arch, overrides=overrides)
    check_routing(config)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[3, 4, 5, 6]])).logits).all()


def test_build_refuses_before_writing(tmp_path):
    source = tmp_path / "kimi"
    synth_hf("kimi_linear", source, seed=3, num_layers=4)
    config = json.loads((source / "config.json").read_text())
    (source / "config.json").write_text(json.dumps({**config, "num_expert_group": 1, "topk_group": 2}))
    with pytest.raises(UnrunnableConfig, match="topk_group=2"):
        build_bundle(source, tmp_path / "bundle", progress=False)
    assert not (tmp_path / "bundle").exists()
