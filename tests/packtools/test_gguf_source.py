"""GGUFSource on files written by hand with gguf-py's GGUFWriter (not by our synth).

The hand-written qwen3moe file is the golden input: its expert slices must be exactly the bytes
we quantized, its dense tensors the arrays we wrote, and its logits those of a transformers
model loaded directly from those arrays. Also: fused gate_up experts, dense types, and the
DeepSeek-2 layout from before llama.cpp's MLA cache.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from packformat.constants import Role
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf

from gguf_handmade import (
    EXPERTS, HIDDEN, INTER, KV_HEADS, HEAD_DIM, HEADS, LAYERS, VOCAB, Q, Tensors,
    handmade_kv, handmade_tensors, rewrite_gguf, write_handmade,
)


@pytest.fixture
def handmade(tmp_path) -> tuple[Path, Tensors]:
    tensors = handmade_tensors()
    return write_handmade(tmp_path / "hand.gguf", handmade_kv(), tensors), tensors


def test_handmade_qwen3moe_config(handmade):
    path, _ = handmade
    with GGUFSource(path) as source:
        config = source.hf_config()
    expected = {
        "model_type": "qwen3_moe", "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "intermediate_size": 96, "moe_intermediate_size": INTER,
        "num_local_experts": EXPERTS, "num_experts_per_tok": 2, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 512, "norm_topk_prob": True, "tie_word_embeddings": False, "mlp_only_layers": [],
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
    }
    assert {key: config[key] for key in expected} == expected


def test_handmade_expert_slices_are_the_bytes_written(handmade):
    path, tensors = handmade
    roles = {"GATE": "ffn_gate_exps", "UP": "ffn_up_exps", "DOWN": "ffn_down_exps"}
    with GGUFSource(path) as source:
        assert source.moe_layers() == [0, 1] and source.num_experts() == EXPERTS
        for layer in range(LAYERS):
            for expert in range(EXPERTS):
                for role_slice in source.expert_roles(layer, expert):
                    written = tensors[f"blk.{layer}.{roles[role_slice.role.name]}.weight"][0]  # [E, rows, row bytes]
                    assert role_slice.element_type == Q.Q8_0
                    assert bytes(role_slice.read()) == written[expert].tobytes()
                    assert role_slice.nbytes == written[expert].nbytes


def test_handmade_dense_and_logits(handmade):
    path, tensors = handmade
    # transformers name -> GGUF name, typed out here rather than taken from the code under test
    names = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm", "self_attn.q_proj.weight": "attn_q", "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v", "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm", "self_attn.k_norm.weight": "attn_k_norm",
        "post_attention_layernorm.weight": "ffn_norm", "mlp.gate.weight": "ffn_gate_inp",
    }
    for b in range(LAYERS):
        names.update({f"model.layers.{b}.{hf}": f"blk.{b}.{g}.weight" for hf, g in per_layer.items()})
    with GGUFSource(path) as source:
        loaded = {t.name: t.load() for t in source.dense_tensors()}
        assert set(loaded) == set(names)
        for hf_name, gguf_name in names.items():
            assert torch.equal(loaded[hf_name], torch.from_numpy(tensors[gguf_name][0]))
        reference = load_reference_model(source)
        direct = AutoModelForCausalLM.from_config(AutoConfig.for_model(**source.hf_config())).eval()
    state = {hf: torch.from_numpy(tensors[g][0]) for hf, g in names.items()}
    for b in range(LAYERS):
        gate, up, down = (torch.from_numpy(gguf.quants.dequantize(tensors[f"blk.{b}.ffn_{r}_exps.weight"][0], Q.Q8_0))
                          for r in ("gate", "up", "down"))
        state[f"model.layers.{b}.mlp.experts.gate_up_proj"] = torch.cat([gate, up], dim=1)
        state[f"model.layers.{b}.mlp.experts.down_proj"] = down
    direct.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(reference(ids).logits, direct(ids).logits, rtol=0, atol=1e-5)


def test_handmade_without_tokenizer_says_why(handmade, tmp_path):
    path, _ = handmade
    with GGUFSource(path) as source:
        info = source.write_tokenizer(tmp_path / "tok")
    assert info["origin"] == "none" and info["files"] == [] and "tokenizer.ggml.model" in info["note"]


def test_deepseek2_file_from_before_the_mla_cache(tmp_path):
    """Older DeepSeek-2 GGUFs: attn_kv_b unsplit, per-head key/value lengths, head_count_kv = n_head."""
    model = tiny_random_model("deepseek_v3", seed=6)
    config, state = model.config, model.state_dict()
    (new,) = synth_gguf("deepseek_v3", tmp_path / "new.gguf", model=model)
    u32 = gguf.GGUFValueType.UINT32
    old = rewrite_gguf(
        new, tmp_path / "old.gguf",
        kv_changes={
            "deepseek2.attention.head_count_kv": (config.num_attention_heads, u32),
            "deepseek2.attention.key_length": (config.qk_nope_head_dim + config.qk_rope_head_dim, u32),
            "deepseek2.attention.value_length": (config.v_head_dim, u32),
            "deepseek2.attention.key_length_mla": (None, u32),
            "deepseek2.attention.value_length_mla": (None, u32),
        },
        drop={f"blk.{b}.attn_{kv}_b.weight" for b in range(2) for kv in "kv"},
        add={f"blk.{b}.attn_kv_b.weight": state[f"model.layers.{b}.self_attn.kv_b_proj.weight"].numpy()
             for b in range(2)},
    )
    with GGUFSource(old) as source, GGUFSource(new) as reference_source:
        assert source.hf_config() == reference_source.hf_config()
        ids = torch.arange(3, 30)[None]
        with torch.no_grad():
            torch.testing.assert_close(load_reference_model(source)(ids).logits, model(ids).logits, rtol=0, atol=1e-5)


def test_fused_gate_up_experts_read_as_one_role(tmp_path, handmade):
    """Files with ffn_gate_up_exps [E, 2I, H] (gate rows first): one GATE_UP role, same model."""
    separate, tensors = handmade
    fused = dict(tensors)
    for b in range(LAYERS):
        gate, kind = fused.pop(f"blk.{b}.ffn_gate_exps.weight")
        up, _ = fused.pop(f"blk.{b}.ffn_up_exps.weight")
        fused[f"blk.{b}.ffn_gate_up_exps.weight"] = (np.concatenate([gate, up], axis=1), kind)  # [E, 2I, row bytes]
    path = write_handmade(tmp_path / "fused.gguf", handmade_kv(), fused)
    with GGUFSource(path) as source, GGUFSource(separate) as reference_source:
        assert source.expert_layout().roles == (Role.GATE_UP, Role.DOWN)
        assert source.expert_layout().gate_up == "concat"
        gate_up = source.expert_roles(1, 2)[0]
        assert gate_up.shape == (2 * INTER, HIDDEN)
        assert bytes(gate_up.read()) == fused["blk.1.ffn_gate_up_exps.weight"][0][2].tobytes()
        ids = torch.arange(5, 25)[None]
        with torch.no_grad():
            torch.testing.assert_close(load_reference_model(source)(ids).logits,
                                       load_reference_model(reference_source)(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("dense_type,dtype",
                         [("F16", torch.float16), ("BF16", torch.bfloat16), ("Q8_0", torch.float32)])
def test_dense_types_are_kept_or_dequantized(tmp_path, dense_type, dtype):
    model = tiny_random_model("qwen3_moe", seed=8)
    (path,) = synth_gguf("qwen3_moe", tmp_path / "m.gguf", model=model, dense_type=dense_type)
    stored = {t.name: t for t in gguf.GGUFReader(path).tensors}
    with GGUFSource(path) as source:
        loaded = {t.name: t for t in source.dense_tensors()}
    q_proj = loaded["model.layers.1.self_attn.q_proj.weight"]
    assert q_proj.dtype == dtype and q_proj.load().dtype == dtype
    raw = stored["blk.1.attn_q.weight"]
    if dense_type == "Q8_0":
        expected = torch.from_numpy(gguf.quants.dequantize(np.array(raw.data), Q.Q8_0))
    else:
        expected = model.state_dict()["model.layers.1.self_attn.q_proj.weight"].to(dtype)
    assert torch.equal(q_proj.load(), expected)
    norm = loaded["model.layers.1.input_layernorm.weight"]  # norms stay F32 whatever the dense type
    assert norm.dtype == torch.float32
    assert torch.equal(norm.load(), model.state_dict()["model.layers.1.input_layernorm.weight"])

