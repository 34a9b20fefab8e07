"""The synth GGUF holds what llama.cpp's convert_hf_to_gguf.py would write.

Each expectation is computed here from the transformers weights with the converter's own
formula (re-typed from llama.cpp, not imported from packtools), and compared with the file as
gguf-py's GGUFReader sees it. A bug shared by our writer and our reader cannot pass these.
"""

from __future__ import annotations

import dataclasses

import gguf
import numpy as np
import pytest
import torch
from transformers import PretrainedConfig

from packtools.arch import ARCHITECTURES
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf


def _llama_permute(weights: np.ndarray, n_head: int) -> np.ndarray:
    # llama.cpp convert_hf_to_gguf.py LlamaModel.permute
    half = weights.shape[0] // n_head // 2
    return weights.reshape(n_head, 2, half, *weights.shape[1:]).swapaxes(1, 2).reshape(weights.shape)


@dataclasses.dataclass
class Written:
    """A synth GGUF as gguf-py reads it, next to the transformers weights it came from."""

    config: PretrainedConfig
    state: dict[str, np.ndarray]
    reader: gguf.GGUFReader

    def hf(self, name: str) -> np.ndarray:
        return self.state[name]

    def field(self, key: str):
        return self.reader.get_field(key).contents()

    def check(self, gguf_name: str, expected: np.ndarray) -> None:
        tensor = next(t for t in self.reader.tensors if t.name == gguf_name)
        assert tensor.tensor_type == gguf.GGMLQuantizationType.F32, gguf_name
        np.testing.assert_array_equal(np.asarray(tensor.data), expected, err_msg=gguf_name)

    def has(self, gguf_name: str) -> bool:
        return any(t.name == gguf_name for t in self.reader.tensors)


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    cache = {}

    def get(arch: str) -> Written:
        if arch not in cache:
            model = tiny_random_model(arch, seed=3)
            (path,) = synth_gguf(arch, tmp_path_factory.mktemp(arch) / "m.gguf", model=model)
            state = {k: v.numpy() for k, v in model.state_dict().items()}
            cache[arch] = Written(model.config, state, gguf.GGUFReader(path))
        return cache[arch]

    return get


# every architecture packtools writes GGUFs of whose transformers experts are gate_up_proj [E, 2I, H]
# (gate rows first) and down_proj [E, H, I] (gpt_oss's in_out interleaved experts: its own test)
SWIGLU_ARCHS = sorted(arch for arch, record in ARCHITECTURES.items()
                      if record.gguf_writable and record.spec.layout.orientation == "out_in")


@pytest.mark.parametrize("arch", SWIGLU_ARCHS)
def test_swiglu_experts_split_gate_and_up(written, arch):
    w = written(arch)
    layers = sorted({int(k.split(".")[2]) for k in w.state if k.endswith("mlp.experts.gate_up_proj")})
    assert layers
    for layer in layers:
        hf, blk = f"model.layers.{layer}.mlp.", f"blk.{layer}."
        gate_up = w.hf(hf + "experts.gate_up_proj")  # [E, 2I, H], gate rows first
        inter = gate_up.shape[1] // 2
        w.check(blk + "ffn_gate_exps.weight", gate_up[:, :inter])
        w.check(blk + "ffn_up_exps.weight", gate_up[:, inter:])
        w.check(blk + "ffn_down_exps.weight", w.hf(hf + "experts.down_proj"))
        router = hf + ("gate.wg.weight" if hf + "gate.wg.weight" in w.state else "gate.weight")  # hunyuan: gate.wg
        w.check(blk + "ffn_gate_inp.weight", w.hf(router))


def test_gpt_oss_experts_deinterleaved_with_biases(written):
    w = written("gpt_oss")
    for layer in range(w.config.num_hidden_layers):
        hf, blk = f"model.layers.{layer}.", f"blk.{layer}."
        gate_up = w.hf(hf + "mlp.experts.gate_up_proj").swapaxes(-1, -2)  # [E, H, 2I] -> [E, 2I, H]
        bias = w.hf(hf + "mlp.experts.gate_up_proj_bias")  # [E, 2I]
        # the converter: transpose(-1, -2), then gate = [:, ::2, :], up = [:, 1::2, :]
        w.check(blk + "ffn_gate_exps.weight", gate_up[:, ::2])
        w.check(blk + "ffn_up_exps.weight", gate_up[:, 1::2])
        w.check(blk + "ffn_gate_exps.bias", bias[..., ::2])
        w.check(blk + "ffn_up_exps.bias", bias[..., 1::2])
        w.check(blk + "ffn_down_exps.weight", w.hf(hf + "mlp.experts.down_proj").swapaxes(-1, -2))
        w.check(blk + "ffn_down_exps.bias", w.hf(hf + "mlp.experts.down_proj_bias"))
        w.check(blk + "attn_sinks.weight", w.hf(hf + "self_attn.sinks"))
        w.check(blk + "post_attention_norm.weight", w.hf(hf + "post_attention_layernorm.weight"))
        w.check(blk + "ffn_gate_inp.bias", w.hf(hf + "mlp.router.bias"))
    assert w.field("gpt-oss.attention.sliding_window") == w.config.sliding_window
    assert w.field("gpt-oss.expert_feed_forward_length") == w.config.intermediate_size
    assert w.field("gpt-oss.rope.scaling.type") == "yarn"


def test_mixtral_is_llama_with_rope_permuted_q_and_k(written):
    w = written("mixtral")
    assert w.field("general.architecture") == "llama"
    assert w.field("llama.expert_count") == w.config.num_local_experts
    for layer in range(w.config.num_hidden_layers):
        q, k = (w.hf(f"model.layers.{layer}.self_attn.{p}_proj.weight") for p in "qk")
        w.check(f"blk.{layer}.attn_q.weight", _llama_permute(q, w.config.num_attention_heads))
        w.check(f"blk.{layer}.attn_k.weight", _llama_permute(k, w.config.num_key_value_heads))
        assert not np.array_equal(_llama_permute(q, w.config.num_attention_heads), q)  # not a no-op here


def test_deepseek2_splits_kv_b_for_the_mla_cache(written):
    w = written("deepseek_v3")
    config = w.config
    n_head, nope, v_dim = config.num_attention_heads, config.qk_nope_head_dim, config.v_head_dim
    rank = config.kv_lora_rank
    for layer in range(config.num_hidden_layers):
        kv_b = w.hf(f"model.layers.{layer}.self_attn.kv_b_proj.weight").reshape(n_head, nope + v_dim, rank)
        w.check(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].swapaxes(1, 2))  # [n_head, rank, nope]
        w.check(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:])  # [n_head, v, rank]
        assert not w.has(f"blk.{layer}.attn_kv_b.weight")
    w.check("blk.1.exp_probs_b.bias", w.hf("model.layers.1.mlp.gate.e_score_correction_bias"))
    assert not w.has("blk.0.ffn_gate_exps.weight") and w.has("blk.0.ffn_gate.weight")  # first_k_dense_replace
    expected = {
        "deepseek2.attention.head_count_kv": 1,
        "deepseek2.attention.key_length": rank + config.qk_rope_head_dim,
        "deepseek2.attention.value_length": rank,
        "deepseek2.attention.key_length_mla": nope + config.qk_rope_head_dim,
        "deepseek2.attention.value_length_mla": v_dim,
        "deepseek2.leading_dense_block_count": config.first_k_dense_replace,
        "deepseek2.expert_gating_func": int(gguf.ExpertGatingFuncType.SIGMOID),
        "deepseek2.expert_shared_count": config.n_shared_experts,
        "deepseek2.expert_group_count": config.n_group,
        "deepseek2.expert_group_used_count": config.topk_group,
        "deepseek2.rope.dimension_count": config.qk_rope_head_dim,
    }
    assert {key: w.field(key) for key in expected} == expected


def test_kimi_linear_kda_tensors(written):
    w = written("kimi_linear")
    for layer, kind in enumerate(w.config.layer_types):
        hf, blk = f"model.layers.{layer}.self_attn.", f"blk.{layer}."
        if kind != "linear_attention":
            assert w.has(blk + "attn_k_b.weight")
            continue
        conv = w.hf(hf + "conv1d.weight")  # [3D, 1, K]: q, k, v channels
        d_inner, kernel = conv.shape[0] // 3, conv.shape[-1]
        for index, part in enumerate("qkv"):
            channels = conv[index * d_inner:(index + 1) * d_inner]  # [D, 1, K]
            w.check(blk + f"ssm_conv1d_{part}.weight", channels.reshape(1, d_inner, 1, kernel))  # ggml ne [K, 1, D, 1]
        # the converter's torch expression, bit for bit (numpy's exp rounds differently)
        w.check(blk + "ssm_a", (-torch.exp(torch.from_numpy(w.hf(hf + "forget_gate.A_log")))).numpy())
        w.check(blk + "ssm_dt.bias", w.hf(hf + "forget_gate.dt_bias"))
    assert w.field("kimi-linear.attention.head_count_kv") == [int(k == "full_attention") for k in w.config.layer_types]
    assert w.field("kimi-linear.kda.head_dim") == w.config.linear_head_dim


def test_qwen2moe_shared_expert_and_its_gate(written):
    w = written("qwen2_moe")
    w.check("blk.0.ffn_gate_inp_shexp.weight", w.hf("model.layers.0.mlp.shared_expert_gate.weight"))
    w.check("blk.0.ffn_up_shexp.weight", w.hf("model.layers.0.mlp.shared_expert.up_proj.weight"))
    assert w.field("qwen2moe.expert_shared_feed_forward_length") == w.config.shared_expert_intermediate_size


def test_dense_type_policy_follows_the_converter(tmp_path):
    model = tiny_random_model("deepseek_v3", seed=5)
    (path,) = synth_gguf("deepseek_v3", tmp_path / "m.gguf", model=model, dense_type="Q8_0", expert_type="Q4_0")
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types["token_embd.weight"] == "Q8_0" and types["blk.0.attn_q_a.weight"] == "Q8_0"
    assert types["blk.1.ffn_gate_inp.weight"] == "F32"  # routers stay F32
    assert types["blk.0.attn_norm.weight"] == "F32" and types["blk.1.exp_probs_b.bias"] == "F32"
    assert types["blk.0.attn_k_b.weight"] == "F16"  # rows of qk_nope=8 do not fill a Q8_0 block: F16 fallback
    assert types["blk.1.ffn_gate_exps.weight"] == "Q4_0"
