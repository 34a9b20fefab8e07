"""The generic path: records made from transformers' experts interface, the tiny-config maker,
and the typed refusals (packtools.arch.generic, generic_spec, tiny_generic)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import CONFIG_MAPPING, AutoModelForCausalLM

from packformat.constants import Role
from packtools.arch import ARCHITECTURES, config_from_dict, get_architecture, tiny_config
from packtools.arch.errors import UnknownArchitectureError, UnsupportedArchitecture
from packtools.arch.generic import experts_interface_model_types
from packtools.arch.generic_spec import GenericSpec
from packtools.arch.spec import ExpertKey
from packtools.arch.tiny import TinySize
from packtools.arch.tiny_generic import TinyConfigError, shrink_kwargs


def _needs(model_type: str) -> None:
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {model_type}")


def test_a_written_module_wins_over_the_generic_record(monkeypatch):
    _needs("glm4_moe")
    generic = get_architecture("glm4_moe")
    if "glm4_moe" not in ARCHITECTURES:
        assert isinstance(generic.spec, GenericSpec)
    written = dataclasses.replace(ARCHITECTURES["qwen3_moe"], gguf=None).with_spec(model_type="glm4_moe")
    monkeypatch.setitem(ARCHITECTURES, "glm4_moe", written)
    assert get_architecture("glm4_moe") is written  # even after the generic one was made
    assert get_architecture("qwen3_moe") is ARCHITECTURES["qwen3_moe"]


@pytest.mark.parametrize(("model_type", "reason"), [
    ("llama", "no module of the model uses transformers' experts interface"),
    ("gemma4", "is multimodal"),
    ("lara_mini", "packtools' dense reader cannot split"),
    ("inkling2_text", "computes something other than the experts interface"),
])
def test_a_type_the_generic_path_cannot_serve_is_refused_naming_it_and_why(model_type, reason):
    _needs(model_type)
    with pytest.raises(UnsupportedArchitecture) as info:
        get_architecture(model_type)
    assert info.value.model_type == model_type and reason in info.value.reason
    assert repr(model_type) in str(info.value) and isinstance(info.value, UnknownArchitectureError)
    with pytest.raises(UnsupportedArchitecture):  # the refusal is remembered, not recomputed differently
        get_architecture(model_type)


def test_the_layout_and_names_come_from_the_model_and_its_conversion_mapping():
    _needs("nemotron_h")
    minimax = get_architecture("minimax").spec
    assert minimax.containers == ("mlp", "block_sparse_moe")  # renamed on load (mixtral's rule)
    assert minimax.per_expert_parts == {"w1": Role.GATE, "w3": Role.UP, "w2": Role.DOWN}
    assert minimax.parse_expert_key("model.layers.2.block_sparse_moe.experts.5.w3.weight") == ExpertKey(2, 5, "w3")
    granite = get_architecture("granitemoe").spec  # whole fused tensors renamed on load
    assert granite.parse_expert_key("model.layers.1.block_sparse_moe.input_linear.weight") == ExpertKey(
        1, None, "gate_up_proj")
    assert granite.parse_expert_key("model.layers.1.block_sparse_moe.router.layer.weight") is None
    nemotron = get_architecture("nemotron_h").spec  # experts without a gate, checkpoint root "backbone."
    assert nemotron.layout.roles == (Role.UP, Role.DOWN) and "backbone." in nemotron.checkpoint_prefixes
    assert nemotron.parse_expert_key("backbone.layers.1.mixer.experts.3.up_proj.weight") == ExpertKey(1, 3, "up_proj")
    config = tiny_config("nemotron_h")
    assert nemotron.role_shapes(config) == {Role.UP: (32, 64), Role.DOWN: (64, 32)}


def test_sizes_and_sparse_layers_are_read_off_the_model_of_the_config():
    _needs("glm4_moe_lite")
    spec = get_architecture("glm4_moe_lite").spec
    config = tiny_config("glm4_moe_lite", num_layers=3, num_experts=16, moe_intermediate_size=48)
    assert spec.moe_layers(config) == [1, 2]  # first_k_dense_replace=1 keeps layer 0 dense
    assert spec.num_experts(config) == 16 and spec.moe_intermediate_size(config) == 48 and spec.top_k(config) == 2


def test_experts_directly_under_the_layer_parse():
    _needs("gemma4_text")
    spec = get_architecture("gemma4_text").spec
    assert spec.containers[0] == ""
    assert spec.parse_expert_key("model.layers.3.experts.gate_up_proj") == ExpertKey(3, None, "gate_up_proj")
    assert spec.parse_expert_key("model.layers.3.mlp.down_proj.weight") is None
    assert spec.fused_key(3, "down_proj") == "model.layers.3.experts.down_proj"
    assert spec.is_routed_runtime_key("model.layers.0.experts.down_proj")


def test_a_config_whose_model_does_not_build_is_refused_by_a_typed_error():
    _needs("glm4_moe_lite")
    from packtools.arch.errors import UnrunnableConfig

    spec = get_architecture("glm4_moe_lite").spec
    config = tiny_config("glm4_moe_lite")
    config.__dict__["n_routed_experts"] = None  # past the config class's own validation
    with pytest.raises(UnrunnableConfig, match="glm4_moe_lite.*transformers cannot build its model"):
        spec.moe_layers(config)


def test_encoded_infinities_in_config_json_are_decoded():
    _needs("nemotron_h")
    config = config_from_dict({"model_type": "nemotron_h", "time_step_limit": [0.0, {"__float__": "Infinity"}]})
    assert list(config.time_step_limit) == [0.0, float("inf")]


SIZE = TinySize(hidden_size=64, num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32, vocab_size=512)


@pytest.mark.parametrize(("model_type", "expected"), [
    ("afmoe", {"head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    ("deepseek_v32", {"n_routed_experts": 8, "kv_lora_rank": 16, "first_k_dense_replace": 1, "n_group": 4}),
    ("jamba", {"attn_layer_period": 2, "attn_layer_offset": 0}),
    ("zaya", {"num_experts_per_tok": 1}),
])
def test_the_tiny_maker_shrinks_the_keys_the_config_class_has(model_type, expected):
    _needs(model_type)
    kwargs = shrink_kwargs(model_type, SIZE)
    for key, value in expected.items():
        assert key in kwargs and (value is None or kwargs[key] == value), (key, kwargs.get(key))
    assert "kv_lora_rank" not in shrink_kwargs("mixtral", SIZE)  # no key the class lacks is added


def test_the_tiny_maker_keeps_every_kind_of_layer():
    _needs("qwen3_next")
    kwargs = shrink_kwargs("qwen3_next", SIZE)
    defaults = CONFIG_MAPPING["qwen3_next"]().layer_types
    assert set(kwargs["layer_types"]) == set(defaults) and kwargs["num_hidden_layers"] == len(kwargs["layer_types"])


def test_the_tiny_maker_shrinks_a_composite_config_through_its_text_config():
    _needs("qwen3_5_moe")
    kwargs = shrink_kwargs("qwen3_5_moe", SIZE)
    assert set(kwargs) == {"text_config"} and kwargs["text_config"]["hidden_size"] == 64
    assert kwargs["text_config"]["num_experts"] == 8
    config = tiny_config("qwen3_5_moe")
    spec = get_architecture("qwen3_5_moe").spec  # the causal LM of the composite config is its text model
    assert spec.num_experts(config) == 8 and spec.top_k(config) == 2 and spec.moe_layers(config)
    # the official checkpoints' names: the text model under model.language_model.
    assert spec.parse_expert_key("model.language_model.layers.0.mlp.experts.gate_up_proj") == ExpertKey(
        0, None, "gate_up_proj")


def test_the_tiny_maker_refuses_a_composite_config_without_a_text_config(monkeypatch):
    _needs("qwen3_5_moe")
    config_class = CONFIG_MAPPING["qwen3_5_moe"]
    monkeypatch.setattr(config_class, "sub_configs", {"vision_config": config_class.sub_configs["vision_config"]})
    with pytest.raises(TinyConfigError, match="qwen3_5_moe.*without a text_config"):
        shrink_kwargs("qwen3_5_moe", SIZE)


@pytest.mark.slow
@pytest.mark.parametrize("model_type", sorted(set(experts_interface_model_types()) - set(ARCHITECTURES)))
def test_every_generic_tiny_model_is_small_and_has_routed_experts(model_type):
    try:
        record = get_architecture(model_type)
    except UnsupportedArchitecture:
        pytest.skip("refused")
    config = tiny_config(model_type)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 50_000_000
    assert record.spec.moe_layers(config) and record.spec.num_experts(config) == 8
