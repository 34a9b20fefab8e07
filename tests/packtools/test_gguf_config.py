"""Config settings through GGUF metadata: the ones GGUF can carry come back equal (and the model
gives the same logits); the ones it cannot are refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from packtools.arch.errors import UnrunnableConfig
from packtools.gguf.errors import UnrepresentableConfigError
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf

NOT_HYPERPARAMETERS = {"dtype", "architectures", "transformers_version", "_name_or_path", "linear_attn_config"}
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                 "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 5e5, "factor": 2.0}
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}

ROUND_TRIPS = [
    pytest.param("deepseek_v3", {"rope_parameters": DEEPSEEK_YARN, "max_position_embeddings": 2560},
                 id="deepseek-yarn"),
    pytest.param("deepseek_v3", {"q_lora_rank": None, "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.5,
                                 "norm_topk_prob": False}, id="deepseek-no-q-lora-no-groups"),
    pytest.param("deepseek_v2", {"rope_parameters": DEEPSEEK_YARN, "max_position_embeddings": 2560},
                 id="deepseek-v2-yarn-group-limited"),
    pytest.param("deepseek_v2", {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
                                 "routed_scaling_factor": 16.0}, id="deepseek-v2-lite-greedy"),
    pytest.param("qwen3_moe", {"norm_topk_prob": False, "rope_parameters": LINEAR_ROPE}, id="qwen3-linear-rope"),
    pytest.param("qwen2_moe", {"norm_topk_prob": True, "qkv_bias": False}, id="qwen2-renorm-no-qkv-bias"),
    pytest.param("kimi_linear", {"mlp_layer_types": ["dense", "sparse", "sparse", "sparse"], "moe_renormalize": False,
                                 "num_expert_group": 2, "topk_group": 1}, id="kimi-leading-dense"),
    pytest.param("mixtral", {"tie_word_embeddings": True, "head_dim": 32, "sliding_window": 48},
                 id="mixtral-tied-head-dim"),
    pytest.param("olmoe", {"clip_qkv": 8.0, "norm_topk_prob": True, "rms_norm_eps": 1e-6}, id="olmoe-clip-qkv"),
    pytest.param("dots1", {"n_group": 4, "topk_group": 2, "norm_topk_prob": False, "routed_scaling_factor": 1.0},
                 id="dots1-group-limited"),
    pytest.param("glm4_moe", {"use_qk_norm": False, "attention_bias": False, "num_nextn_predict_layers": 0,
                              "rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                  "partial_rotary_factor": 0.25},
                              "n_group": 2, "topk_group": 1}, id="glm4-no-qk-norm-quarter-rotary"),
    pytest.param("ernie4_5_moe", {"moe_layer_start_index": 0, "moe_num_shared_experts": 2, "tie_word_embeddings": True},
                 id="ernie-all-moe-two-shared-tied"),
    pytest.param("ernie4_5_moe", {"moe_num_shared_experts": 0}, id="ernie-no-shared"),
    pytest.param("hunyuan_v1_moe", {"attention_bias": True, "tie_word_embeddings": True, "head_dim": 32},
                 id="hunyuan-bias-tied-wide-heads"),
    pytest.param("minimax_m2", {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6,
                                                    "partial_rotary_factor": 1.0}}, id="minimax-m2-full-rotary"),
    pytest.param("qwen3_next", {"layer_types": ["linear_attention", "full_attention"] * 2, "linear_num_value_heads": 2,
                                "shared_expert_intermediate_size": 48},
                 id="qwen3-next-alternating-one-value-head-per-key"),
]


@pytest.mark.parametrize("arch,overrides", ROUND_TRIPS)
def test_settings_round_trip(tmp_path, arch, overrides):
    model = tiny_random_model(arch, seed=9, overrides=overrides)
    for key, value in overrides.items():  # the override took: otherwise this test proves nothing
        assert model.config.to_dict()[key] == value or key == "rope_parameters"
    (path,) = synth_gguf(arch, tmp_path / "m.gguf", model=model)
    with GGUFSource(path) as source:
        original, mapped = model.config.to_dict(), source.hf_config()
        differing = {k for k in set(original) | set(mapped) if original.get(k) != mapped.get(k)} - NOT_HYPERPARAMETERS
        assert not differing, {k: (original.get(k), mapped.get(k)) for k in differing}
        reference = load_reference_model(source)
    ids = torch.arange(3, 40).reshape(1, -1)
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


REFUSED = [
    pytest.param("kimi_linear", {"mlp_layer_types": ["sparse", "dense", "sparse", "sparse"]}, "mlp_layer_types",
                 id="kimi-dense-after-sparse"),
    pytest.param("kimi_linear", {"linear_attn_config": {"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4}},
                 "linear_num_heads", id="kimi-kda-heads"),
    pytest.param("qwen3_moe", {"hidden_act": "gelu"}, "hidden_act", id="qwen3-gelu"),
    pytest.param("deepseek_v3", {"rope_parameters": {**DEEPSEEK_YARN, "mscale": 1.0}}, "mscale",
                 id="deepseek-two-mscales"),
    pytest.param("gpt_oss", {"swiglu_limit": 5.0}, "swiglu_limit", id="gpt-oss-clamp"),
    pytest.param("mixtral", {"rope_parameters": LLAMA3_ROPE}, "rope_type", id="mixtral-llama3-rope"),
    pytest.param("qwen2_moe", {"mlp_only_layers": [0]}, "mlp_only_layers", id="qwen2-dense-layer"),
    pytest.param("dots1", {"num_key_value_heads": 2}, "num_key_value_heads", id="dots1-gqa"),
    pytest.param("dots1", {"attention_bias": True}, "attention_bias", id="dots1-attention-bias"),
    pytest.param("dots1", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types",
                 id="dots1-sliding-window"),
    pytest.param("ernie4_5_moe", {"moe_layer_interval": 2}, "moe_layer_interval", id="ernie-interleaved"),
    pytest.param("ernie4_5_moe", {"moe_layer_end_index": 0, "moe_layer_start_index": 0}, "moe_layer_end_index",
                 id="ernie-dense-tail"),
    pytest.param("ernie4_5_moe", {"use_bias": True}, "use_bias", id="ernie-biases"),
    pytest.param("hunyuan_v1_moe", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}},
                 "rope_type", id="hunyuan-dynamic-rope"),
    pytest.param("minimax_m2", {"tie_word_embeddings": True}, "tie_word_embeddings", id="minimax-m2-tied"),
    pytest.param("qwen3_next", {"attention_bias": True}, "attention_bias", id="qwen3-next-attention-bias"),
    pytest.param("qwen3_next", {"norm_topk_prob": False}, "norm_topk_prob", id="qwen3-next-no-renorm"),
    pytest.param("qwen3_next", {"linear_value_head_dim": 32}, "linear_value_head_dim", id="qwen3-next-wide-values"),
    pytest.param("qwen3_next", {"mlp_only_layers": [1]}, "mlp_only_layers", id="qwen3-next-dense-layer"),
]


@pytest.mark.parametrize("arch,overrides,setting", REFUSED)
def test_unrepresentable_settings_are_refused(tmp_path, arch, overrides, setting):
    model = tiny_random_model(arch, seed=9, overrides=overrides)
    with pytest.raises(UnrepresentableConfigError, match=setting):
        synth_gguf(arch, tmp_path / "m.gguf", model=model)
    assert not list(tmp_path.iterdir())


def test_unrunnable_routing_is_not_written(tmp_path):
    """transformers' DeepseekV2 ignores norm_topk_prob; a file saying true would make llama.cpp
    renormalise where the model does not."""
    model = tiny_random_model("deepseek_v2", seed=9, overrides={"norm_topk_prob": True})
    with pytest.raises(UnrunnableConfig, match="norm_topk_prob"):
        synth_gguf("deepseek_v2", tmp_path / "m.gguf", model=model)
    assert not list(tmp_path.iterdir())
