"""Architecture registry: tiny configs build and run, and ArchSpec facts match the real models."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from packformat.constants import Role
from packtools.arch import ARCHITECTURES, ExpertKey, UnknownArchitectureError, config_from_dict, get_arch, tiny_config

ARCHS = sorted(ARCHITECTURES)
EXPERTS_MODULE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts$")


def experts_modules(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    return {int(m[1]): mod for name, mod in model.named_modules() if (m := EXPERTS_MODULE.match(name))}


@pytest.fixture(scope="module", params=ARCHS)
def tiny_model(request):
    torch.manual_seed(0)
    config = tiny_config(request.param)
    return request.param, config, AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def test_tiny_config_builds_forwards_and_generates(tiny_model):
    arch, config, model = tiny_model
    ids = torch.randint(3, config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits
        generated = model.generate(ids[:1], max_new_tokens=4, do_sample=False)
    assert logits.shape == (2, 12, config.vocab_size)
    assert torch.isfinite(logits).all()
    assert generated.shape == (1, 16)


def test_spec_matches_the_built_model(tiny_model):
    arch, config, model = tiny_model
    spec = get_arch(arch)
    modules = experts_modules(model)
    assert spec.moe_layers(config) == sorted(modules)
    assert spec.num_experts(config) == 8 and spec.top_k(config) == 2 and spec.moe_intermediate_size(config) == 32
    shapes = spec.role_shapes(config)
    for module in modules.values():
        gate_up, down = module.gate_up_proj, module.down_proj
        assert gate_up.shape[0] == down.shape[0] == 8
        if spec.layout.orientation == "in_out":  # gpt_oss: [E, H, 2I] and [E, I, H] plus biases
            assert tuple(gate_up.shape[1:]) == shapes[Role.GATE_UP]
            assert tuple(down.shape[1:]) == shapes[Role.DOWN]
            assert tuple(module.gate_up_proj_bias.shape[1:]) == shapes[Role.GATE_UP_BIAS]
            assert tuple(module.down_proj_bias.shape[1:]) == shapes[Role.DOWN_BIAS]
        else:  # [E, 2I, H] gate rows first, [E, H, I]
            assert (gate_up.shape[1] // 2, gate_up.shape[2]) == shapes[Role.GATE] == shapes[Role.UP]
            assert tuple(down.shape[1:]) == shapes[Role.DOWN]
    routed = {k for k in model.state_dict() if spec.is_routed_runtime_key(k)}
    expected = {f"model.layers.{layer}.mlp.experts.{part}" for layer in modules for part in spec.fused_parts}
    assert routed == expected


@pytest.mark.parametrize("arch", ARCHS)
def test_full_width_shapes_build_on_meta(arch):
    config = tiny_config(arch, hidden_size=4096, num_layers=2, num_experts=256, top_k=8,
                         moe_intermediate_size=2048, vocab_size=1024)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    spec = get_arch(arch)
    modules = experts_modules(model)
    assert sorted(modules) == spec.moe_layers(config) and modules
    for module in modules.values():
        assert module.gate_up_proj.shape[0] == 256
        assert 2 * 2048 in module.gate_up_proj.shape and 4096 in module.gate_up_proj.shape


def test_architecture_quirks():
    kimi = tiny_config("kimi_linear", num_layers=1)
    assert kimi.pad_token_id < kimi.vocab_size and kimi.layer_types == ["full_attention"]
    assert "full_attention" in tiny_config("kimi_linear", num_layers=3).layer_types
    v3 = tiny_config("deepseek_v3", num_layers=3, num_experts=16, top_k=4)
    assert v3.first_k_dense_replace == 1 and get_arch("deepseek_v3").moe_layers(v3) == [1, 2]
    assert v3.n_routed_experts % v3.n_group == 0
    assert v3.topk_group * (v3.n_routed_experts // v3.n_group) >= v3.num_experts_per_tok
    assert get_arch("deepseek_v3").moe_layers(tiny_config("deepseek_v3", num_layers=1)) == [0]
    v4 = tiny_config("deepseek_v4", num_layers=3)
    assert v4.mlp_layer_types == ["hash_moe", "moe", "moe"]
    qwen2 = tiny_config("qwen2_moe")
    assert qwen2.shared_expert_intermediate_size > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_config_round_trips_through_json_dict(arch):
    config = tiny_config(arch, num_layers=3)
    contents = json.loads(config.to_json_string())
    again = config_from_dict(contents)
    # the caller's dict (e.g. the bundle's config.json) is left as it was: transformers 5.17's
    # DeepseekV4Config adds keys to the rope_parameters dict it is given
    assert contents == json.loads(config.to_json_string())
    spec = get_arch(arch)
    assert spec.moe_layers(again) == spec.moe_layers(config)
    assert spec.num_experts(again) == spec.num_experts(config)
    assert spec.top_k(again) == spec.top_k(config)


def test_kimi_and_deepseek_v4_config_aliases():
    kimi = config_from_dict({"model_type": "kimi_linear", "num_experts": 16, "num_experts_per_token": 3,
                             "moe_intermediate_size": 48, "num_hidden_layers": 2})
    spec = get_arch("kimi_linear")
    assert (spec.num_experts(kimi), spec.top_k(kimi), spec.moe_intermediate_size(kimi)) == (16, 3, 48)
    assert spec.moe_layers(kimi) == [1]  # first_k_dense_replace defaults to 1
    v4 = config_from_dict({"model_type": "deepseek_v4", "n_routed_experts": 32, "num_experts_per_tok": 4,
                           "moe_intermediate_size": 64, "num_hidden_layers": 4, "num_hash_layers": 2})
    assert v4.mlp_layer_types == ["hash_moe", "hash_moe", "moe", "moe"]
    assert get_arch("deepseek_v4").num_experts(v4) == 32 and v4.num_local_experts == 32


@pytest.mark.parametrize("bad", ["llama", "", None, "qwen3"])
def test_unknown_architecture_is_typed_and_lists_known(bad):
    with pytest.raises(UnknownArchitectureError) as info:
        get_arch(bad)
    assert repr(bad) in str(info.value) and "qwen3_moe" in str(info.value) and "gpt_oss" in str(info.value)
    with pytest.raises(UnknownArchitectureError):
        tiny_config(bad)
    with pytest.raises(UnknownArchitectureError):
        config_from_dict({"model_type": bad})


@pytest.mark.parametrize(
    "kwargs",
    [{"top_k": 9}, {"top_k": 0}, {"num_layers": 0}, {"hidden_size": 60}, {"moe_intermediate_size": 31},
     {"vocab_size": 2}],
)
def test_tiny_config_rejects_impossible_sizes(kwargs):
    with pytest.raises(ValueError):
        tiny_config("qwen3_moe", **kwargs)


@pytest.mark.parametrize(
    "arch, key, expected",
    [
        ("qwen3_moe", "model.layers.3.mlp.experts.7.gate_proj.weight", ExpertKey(3, 7, "gate_proj")),
        ("qwen3_moe", "model.layers.3.mlp.experts.gate_up_proj", ExpertKey(3, None, "gate_up_proj")),
        ("qwen3_moe", "model.layers.3.mlp.gate.weight", None),
        ("qwen2_moe", "model.layers.0.mlp.shared_expert.gate_proj.weight", None),
        ("deepseek_v3", "model.layers.1.mlp.shared_experts.up_proj.weight", None),
        ("deepseek_v3", "layers.1.mlp.experts.12.down_proj.weight", ExpertKey(1, 12, "down_proj")),
        ("mixtral", "model.layers.2.block_sparse_moe.experts.5.w3.weight", ExpertKey(2, 5, "w3")),
        ("mixtral", "model.layers.2.block_sparse_moe.gate.weight", None),
        ("kimi_linear", "model.layers.2.block_sparse_moe.experts.0.w2.weight", ExpertKey(2, 0, "w2")),
        ("deepseek_v4", "model.layers.4.ffn.experts.9.w1.weight", ExpertKey(4, 9, "w1")),
        ("deepseek_v4", "model.layers.4.ffn.shared_experts.w1.weight", None),
        ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj_bias", ExpertKey(1, None, "gate_up_proj_bias")),
        ("gpt_oss", "model.layers.1.mlp.experts.gate_up_proj", ExpertKey(1, None, "gate_up_proj")),
        ("gpt_oss", "model.layers.1.mlp.experts.3.gate_proj.weight", None),
        ("gpt_oss", "model.layers.1.mlp.router.weight", None),
    ],
)
def test_parse_expert_key(arch, key, expected):
    assert get_arch(arch).parse_expert_key(key) == expected


def test_per_expert_key_is_what_the_parser_reads_back():
    for spec in (record.spec for record in ARCHITECTURES.values()):
        for role in spec.per_expert_parts.values():
            key = spec.per_expert_key(5, 3, role)
            parsed = spec.parse_expert_key(key)
            assert parsed is not None and (parsed.layer, parsed.expert) == (5, 3)
            assert spec.per_expert_parts[parsed.part] == role
