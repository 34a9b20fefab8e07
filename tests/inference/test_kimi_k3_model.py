"""inference.models.kimi_k3: config, forward/generate, the official checkpoint layout.

The K3-specific formulas are pinned in test_kimi_k3_formulas.py against llama.cpp's graph
(src/models/kimi-k3.cpp) written out independently.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.cache_utils import DynamicCache

from inference.models import OFFICIAL_CONFIG_LAYOUTS
from inference.models.kimi_k3 import KimiK3Config, KimiK3ForCausalLM, official_config_dict
from inference.models.kimi_k3.transformers_compat import cache_of, linear_attention_states
from packtools.arch import config_from_dict, get_arch, tiny_config

TEXT_KEYS = {"vocab_size": 128, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2,
             "intermediate_size": 48, "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_token": 2,
             "q_lora_rank": None, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
             "routed_expert_hidden_size": 16, "attn_res_block_size": 2, "pad_token_id": 0, "bos_token_id": 1,
             "eos_token_id": 2, "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 3,
                                                       "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                                       "full_attn_layers": [3], "kda_layers": [1, 2]}}


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = tiny_config("kimi_k3", num_layers=4)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_wrapper_config_is_lifted_and_equals_the_flat_one():
    wrapper = {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"], "vocab_size": 7,
               "text_config": {**TEXT_KEYS, "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"]},
               "vision_config": {"hidden_size": 1}}
    lifted, flat = config_from_dict(wrapper), config_from_dict({"model_type": "kimi_k3", **TEXT_KEYS})
    assert isinstance(lifted, KimiK3Config) and lifted.vocab_size == 128  # text_config wins, as in llama.cpp
    for key in ("layer_types", "mlp_layer_types", "linear_attn_config", "num_experts", "expert_hidden_size"):
        assert getattr(lifted, key) == getattr(flat, key), key
    assert lifted.layer_types == ["linear_attention", "linear_attention", "full_attention"]  # 1-based numbers
    assert lifted.mlp_layer_types == ["dense", "sparse", "sparse"]  # first_k_dense_replace defaults to 1
    spec = get_arch("kimi_k3")
    assert (spec.moe_layers(lifted), spec.num_experts(lifted), spec.top_k(lifted)) == ([1, 2], 4, 2)


@pytest.mark.parametrize("alias, attribute, value", [
    ("num_local_experts", "num_experts", 6), ("num_experts_per_tok", "num_experts_per_token", 3),
    ("n_shared_experts", "num_shared_experts", 2), ("n_group", "num_expert_group", 2),
    ("norm_topk_prob", "moe_renormalize", False),
])
def test_transformers_aliases_reach_the_official_attributes(alias, attribute, value):
    config = KimiK3Config(**{**TEXT_KEYS, alias: value})
    assert getattr(config, attribute) == value and getattr(config, alias) == value


@pytest.mark.parametrize("overrides, message", [
    ({"mla_use_nope": False}, "mla_use_nope"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func"),
    ({"attn_res_block_size": 0}, "attn_res_block_size"),
    ({"linear_attn_config": {**TEXT_KEYS["linear_attn_config"], "use_full_rank_gate": False}}, "use_full_rank_gate"),
    ({"linear_attn_config": {**TEXT_KEYS["linear_attn_config"], "full_attn_layers": [0]}}, "1-based"),
    ({"layer_types": ["full_attention"] * 3}, "disagree"),
    ({"mlp_layer_types": ["sparse"] * 3}, "first_k_dense_replace"),
])
def test_config_refuses_what_it_does_not_implement(overrides, message):
    with pytest.raises(ValueError, match=message):
        KimiK3Config(**{**TEXT_KEYS, **overrides})


# bfloat16 (~12 s) with -m slow: float32 runs the same forward and caches
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.slow)],
                         ids=["float32", "bfloat16"])
def test_forward_and_generate(dtype):
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(tiny_config("kimi_k3", num_layers=4), dtype=dtype).eval()
    assert isinstance(model, KimiK3ForCausalLM)
    ids = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits = model(ids).logits
        cached = model.generate(ids[:1], max_new_tokens=6, do_sample=False)
        uncached = model.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=False)
    assert logits.shape == (2, 9, 512) and logits.dtype == dtype and torch.isfinite(logits).all()
    # the KDA recurrent/conv states and the MLA latent cache give what recomputing everything gives
    assert torch.equal(cached, uncached)


def test_incremental_decoding_matches_a_full_forward(tiny):
    ids = torch.randint(3, 512, (1, 70), generator=torch.Generator().manual_seed(3))  # > one 64-token KDA chunk
    with torch.no_grad():
        full = tiny(ids[:, :69]).logits[0, -5:]  # predictions after tokens 64..68
        prefix = tiny(ids[:, :65], use_cache=True)
        steps, cache = [prefix.logits[0, -1]], cache_of(prefix)  # `cache` in 5.24, `past_key_values` in 5.17
        for t in range(65, 69):
            out = tiny(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits[0, -1])
            cache = cache_of(out)
    torch.testing.assert_close(torch.stack(steps), full, rtol=1e-4, atol=1e-5)


def test_save_pretrained_writes_the_official_names_and_loads_back_exactly(tiny, tmp_path):
    tiny.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(official_config_dict(tiny.config)))
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        names = set(f.keys())
    assert all(name.startswith("language_model.") for name in names)
    assert "language_model.model.layers.1.block_sparse_moe.experts.7.w1.weight" in names
    assert "language_model.model.layers.1.block_sparse_moe.routed_expert_down_proj.weight" in names
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # a dense layer keeps "mlp"
    assert "language_model.model.output_attn_res_proj.weight" in names
    assert not any(".mlp.experts" in name or "gate_up_proj" in name for name in names)
    # the official repository also holds the vision tower: ignored by the text model
    extra = {**load_file(tmp_path / "model.safetensors"), "vision_tower.patch.weight": torch.ones(2),
             "mm_projector.proj.weight": torch.ones(2)}
    save_file(extra, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    for name, tensor in tiny.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_official_config_layout_round_trips(tiny, tmp_path):
    layout = OFFICIAL_CONFIG_LAYOUTS["kimi_k3"](tiny.config)
    assert layout["architectures"] == ["KimiK3ForConditionalGeneration"] and layout["model_type"] == "kimi_k3"
    text = layout["text_config"]
    assert text["model_type"] == "kimi_linear" and text["hidden_act"] == "situ"
    # the keys llama.cpp's converter (conversion/kimi_k3.py) reads
    for key in ("num_experts", "num_experts_per_token", "num_shared_experts", "first_k_dense_replace",
                "routed_expert_hidden_size", "attn_res_block_size", "activation_situ_beta",
                "activation_situ_linear_beta", "mla_use_nope", "moe_router_activation_func", "moe_renormalize",
                "routed_scaling_factor", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
        assert key in text, key
    assert {"full_attn_layers", "kda_layers", "head_dim", "short_conv_kernel_size"} <= set(text["linear_attn_config"])
    (tmp_path / "config.json").write_text(json.dumps(layout))
    again = AutoConfig.from_pretrained(tmp_path)
    unrelated = {"architectures": None, "_name_or_path": None}
    assert again.to_dict() | unrelated == tiny.config.to_dict() | unrelated


def test_without_attention_residuals_the_model_is_a_plain_residual_stack():
    config = tiny_config("kimi_k3", num_layers=3)
    config.attn_res_block_size = None
    torch.manual_seed(4)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    assert not any("_res_" in name for name in model.state_dict())
    ids = torch.randint(3, 512, (1, 8), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        hidden = model.model.embed_tokens(ids)
        for layer in model.model.layers:  # x + attn(norm(x)), then + mlp(norm(.))
            hidden, banked = layer(hidden, [])
            assert banked == []
        torch.testing.assert_close(model(ids).logits, model.lm_head(model.model.norm(hidden)))
        cached = model.generate(ids, max_new_tokens=4, do_sample=False)
        assert torch.equal(cached, model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=False))


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # 5.24 says so
def test_the_cache_is_accepted_and_returned_under_either_transformers_name(tiny):
    # `cache` (transformers 5.24) and `past_key_values` (5.17, what its generate passes) are one argument
    ids = torch.randint(3, 512, (1, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        results = []
        for name in ("cache", "past_key_values"):
            prefix = cache_of(tiny(ids[:, :10], use_cache=True))
            assert linear_attention_states(prefix, 0)[1] is not None  # layer 0 is KDA: its state was kept
            out = tiny(ids[:, 10:11], use_cache=True, **{name: prefix})
            assert cache_of(out).get_seq_length() == 11
            results.append(out.logits)
    assert torch.equal(*results)
    fresh = DynamicCache(config=tiny.config)
    assert linear_attention_states(fresh, 0) == (None, None) and linear_attention_states(None, 0) == (None, None)
