"""Kimi-K3 GGUFs as llama.cpp's converter writes them, read back into the kimi_k3 model's terms.

The GGUF is the committed golden tests/golden/llamacpp/kimi_k3-F32.gguf: llama.cpp's own
convert_hf_to_gguf.py output of the tiny random official-layout checkpoint that
scripts/llamacpp_golden.py makes (seeded). Here that checkpoint is made again and every config
value, dense tensor and expert byte packtools reads from the GGUF is compared with it: the
converter's transforms (kv_b split, conv reshape, -exp(A_log), g_proj by layer kind, fused residual
scores) must come back undone.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from packformat.constants import Role
from packtools.gguf.errors import ExpertLayoutError, TensorMappingError, UnknownArchitectureError
from packtools.gguf.kimi_k3_tensors import a_log_from_gguf, a_log_to_gguf
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_models import tiny_random_model
from gguf_handmade import rewrite_gguf

REPO = Path(__file__).resolve().parents[2]
GOLDEN_F32 = REPO / "tests" / "golden" / "llamacpp" / "kimi_k3-F32.gguf"
KV = gguf.GGUFValueType


def _golden_script():
    spec = importlib.util.spec_from_file_location("llamacpp_golden", REPO / "scripts" / "llamacpp_golden.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint_model():
    """The float32 model the golden GGUF was converted from (same seed and sizes as the script)."""
    script = _golden_script()
    case = next(c for c in script.KIMI_K3_CASES if c.quant == "F32")
    return tiny_random_model(case.arch, seed=5, overrides=case.overrides or None, **case.sizes)


@pytest.fixture(scope="module")
def source():
    with GGUFSource(GOLDEN_F32) as opened:
        yield opened


CONFIG_KEYS = [
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "rms_norm_eps",
    "hidden_act", "activation_situ_beta", "activation_situ_linear_beta", "q_lora_rank", "kv_lora_rank",
    "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "mla_use_nope", "mla_use_output_gate", "num_experts",
    "num_experts_per_token", "num_shared_experts", "first_k_dense_replace", "routed_expert_hidden_size",
    "latent_moe_use_norm", "routed_scaling_factor", "moe_renormalize", "moe_router_activation_func",
    "attn_res_block_size", "layer_types", "mlp_layer_types", "moe_intermediate_size", "tie_word_embeddings",
]


@pytest.mark.parametrize("key", CONFIG_KEYS)
def test_config_from_metadata_is_the_checkpoints(source, checkpoint_model, key):
    assert source.hf_config()[key] == getattr(checkpoint_model.config, key), key


def test_layer_kinds_come_from_the_per_layer_kv_list(source, checkpoint_model):
    linear = source.hf_config()["linear_attn_config"]
    expected = checkpoint_model.config.linear_attn_config
    for key in ("full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size", "gate_lower_bound"):
        assert linear[key] == expected[key], key
    assert set(linear["full_attn_layers"]) and set(linear["kda_layers"]), "the golden model must have both kinds"


def test_dense_tensors_come_back_as_the_checkpoints(source, checkpoint_model):
    state = checkpoint_model.state_dict()
    loaded = {tensor.name: tensor.load() for tensor in source.dense_tensors()}
    assert set(loaded) == {name for name in state if ".mlp.experts." not in name}
    for name, value in loaded.items():
        original = state[name]
        assert value.shape == original.shape and value.dtype == torch.float32, name
        if name.endswith("_res_proj.weight"):
            assert torch.equal(value, torch.ones_like(value)), name  # the score lives in the norm
        elif name.endswith("_res_norm.weight"):
            proj = state[name.replace("_res_norm", "_res_proj")]
            assert torch.equal(value, original * proj.flatten()), f"{name}: not llama.cpp's fused score"
        elif name.endswith("A_log"):
            assert torch.equal(torch.exp(value), torch.exp(original)), f"{name}: exp(A_log) is not llama.cpp's A"
            assert (value - original).abs().max() <= A_LOG_MAX_ERROR, name
        else:
            assert torch.equal(value, original), name


def test_routed_experts_are_the_checkpoints_bytes(source, checkpoint_model):
    state = checkpoint_model.state_dict()
    inter = checkpoint_model.config.moe_intermediate_size
    assert source.moe_layers() == [1, 2, 3]
    for layer in source.moe_layers():
        gate_up = state[f"model.layers.{layer}.mlp.experts.gate_up_proj"]  # [E, 2I, D]
        down = state[f"model.layers.{layer}.mlp.experts.down_proj"]  # [E, D, I]
        for expert in range(source.num_experts()):
            roles = {r.role: r for r in source.expert_roles(layer, expert)}
            expected = {Role.GATE: gate_up[expert, :inter], Role.UP: gate_up[expert, inter:], Role.DOWN: down[expert]}
            for role, value in expected.items():
                assert roles[role].shape == tuple(value.shape), (layer, expert, role)  # latent width, not hidden
                assert roles[role].read() == value.contiguous().numpy().tobytes(), (layer, expert, role)


# |recovered - A_log| is bounded by the float32 resolution of A itself: A_log ~ 0 can move by
# up to half an ulp of 1.0 without changing exp(A_log)
A_LOG_MAX_ERROR = 2.0**-23
A_LOG_SAMPLES = {  # name: (A_log values, least fraction recovered bit-exactly)
    "typical": (torch.linspace(-4.0, 4.0, 20001), 0.8),
    "random": (torch.randn(50000, generator=torch.Generator().manual_seed(1)) * 3, 0.8),
    "tiny decay": (torch.linspace(-30.0, -10.0, 5001), 0.99),
    "near zero": (torch.linspace(-0.1, 0.1, 20001), 0.03),
}


@pytest.mark.parametrize("sample", A_LOG_SAMPLES)
def test_a_log_inverse_reproduces_llamacpps_a_exactly(sample):
    """The cost of -exp(A_log): A_log is not always recoverable, but a value whose exp is A is."""
    a_log, least_exact = A_LOG_SAMPLES[sample]
    (stored,) = a_log_to_gguf(a_log)
    recovered = a_log_from_gguf((stored,))
    assert torch.equal(-torch.exp(recovered), stored)  # what the model computes == what llama.cpp holds
    assert (recovered - a_log).abs().max() <= A_LOG_MAX_ERROR
    exact = float((recovered == a_log).float().mean())
    print(f"A_log {sample}: {exact:.1%} recovered bit-exactly, max |error| {(recovered - a_log).abs().max():.1e}")
    assert exact >= least_exact


BAD_INPUTS = [
    # (kv changes, dropped tensors, added tensors, error, message)
    ({}, set(), {"blk.1.mystery.weight": np.zeros(4, np.float32)}, TensorMappingError, r"blk\.1\.mystery\.weight"),
    ({"kimi-k3.attention.head_count_kv": ([0, 0, 1], KV.ARRAY)}, set(), {}, ExpertLayoutError,
     r"kimi-k3\.attention\.head_count_kv lists 3 layers, block_count is 4"),
    ({"kimi-k3.attention.head_count_kv": ([0, 0, 0, 2], KV.ARRAY)}, set(), {}, ExpertLayoutError,
     r"head_count_kv\[3\] is 2"),
    # layer 0 declared MLA, layer 3 KDA: the tensors say otherwise
    ({"kimi-k3.attention.head_count_kv": ([1, 0, 0, 1], KV.ARRAY)}, set(), {}, ExpertLayoutError,
     r"head_count_kv\[0\] makes layer 0 MLA, but the file has no blk\.0\.attn_kv_a_mqa\.weight; it has blk\.0\.ssm_a"),
    ({"kimi-k3.attention.head_count_kv": ([0, 0, 0, 0], KV.ARRAY)}, set(), {}, ExpertLayoutError,
     r"makes layer 3 KDA, but the file has no blk\.3\.ssm_a; it has blk\.3\.attn_kv_a_mqa\.weight"),
    ({"kimi-k3.expert_gating_func": (1, KV.UINT32)}, set(), {}, UnknownArchitectureError, "not sigmoid"),
    ({}, {"blk.2.ssm_a"}, {}, ExpertLayoutError, r"makes layer 2 KDA, but the file has no blk\.2\.ssm_a$"),
    ({}, {"blk.2.ssm_dt.bias"}, {}, TensorMappingError, r"dt_bias: the GGUF has no tensor 'blk\.2\.ssm_dt\.bias'"),
    ({}, {"output_res_score.weight"}, {}, TensorMappingError, r"output_res_score\.weight"),
]


@pytest.mark.parametrize("kv,drop,add,error,message", BAD_INPUTS)
def test_bad_kimi_k3_files_name_what_is_wrong(tmp_path, kv, drop, add, error, message):
    broken = rewrite_gguf(GOLDEN_F32, tmp_path / "broken.gguf", kv, drop, add)
    with pytest.raises(error, match=message):
        GGUFSource(broken).close()


def test_unbroken_rewrite_opens(tmp_path):
    """The bad-input table's copier alone breaks nothing."""
    with GGUFSource(rewrite_gguf(GOLDEN_F32, tmp_path / "copy.gguf", {}, set(), {})) as copy:
        assert copy.moe_layers() == [1, 2, 3]
