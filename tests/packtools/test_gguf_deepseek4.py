"""deepseek4 GGUFs written by llama.cpp's converter: metadata -> config, tensor names.

The oracle is the committed golden GGUF (tests/golden/llamacpp/deepseek_v4-MXFP4.gguf): llama.cpp's
convert_hf_to_gguf.py made it from packtools' official-layout checkpoint, whose config is known.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
from transformers import AutoConfig

from packtools.arch import config_from_dict
from packtools.gguf.archs import arch_for_gguf
from packtools.gguf.config_parts import TensorFacts
from packtools.gguf.config_read import hf_config_kwargs
from packtools.gguf.deepseek4 import GGUF_ARCH_NAME, gguf_tensor_name
from packtools.gguf.dense import meta_model_state
from packtools.gguf.errors import TensorMappingError, UnknownArchitectureError
from packtools.gguf.experts import find_expert_tensors
from packtools.gguf.files import index_tensors, open_shards
from packtools.gguf.metadata import Metadata
from packtools.synth.deepseek_v4_official import official_config

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llamacpp" / "deepseek_v4-MXFP4.gguf"
LLM = gguf.Keys.LLM


@pytest.fixture(scope="module")
def golden():
    shards = open_shards(GOLDEN)
    meta = Metadata(GOLDEN, shards[0].reader.fields, GGUF_ARCH_NAME)
    return meta, index_tensors(shards)


def _config(meta, tensors):
    arch = arch_for_gguf(GOLDEN, GGUF_ARCH_NAME, expert_count=meta.require(LLM.EXPERT_COUNT),
                         gating_func=meta.get(LLM.EXPERT_GATING_FUNC))
    facts = TensorFacts(vocab_size=tensors["token_embd.weight"].shape[0], tied_embeddings=False,
                        attention_bias=False, shared_expert_rows=None, names=frozenset(tensors))
    return AutoConfig.for_model(arch.model_type, **hf_config_kwargs(meta, arch, facts))


CONFIG_FIELDS = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                 "qk_rope_head_dim", "q_lora_rank", "o_groups", "o_lora_rank", "n_routed_experts",
                 "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
                 "norm_topk_prob", "swiglu_limit", "scoring_func", "sliding_window", "index_n_heads",
                 "index_head_dim", "layer_types", "mlp_layer_types", "compress_rates", "hc_mult",
                 "hc_sinkhorn_iters", "hc_eps", "vocab_size", "rms_norm_eps"]


def _rope(config) -> dict:
    # the official config spells YaRN's type twice (legacy "type" and "rope_type"); the meaning is rope_type
    return {kind: {k: v for k, v in params.items() if k != "type"} for kind, params in config.rope_parameters.items()}


def test_metadata_gives_the_config_of_the_official_checkpoint_it_came_from(golden):
    meta, tensors = golden
    got = _config(meta, tensors)
    expected = config_from_dict({**official_config(), "index_topk": 64})  # the golden case's checkpoint
    for field in CONFIG_FIELDS:
        assert getattr(got, field) == getattr(expected, field), field
    assert _rope(got) == _rope(expected) and _rope(got)["compress"]["rope_type"] == "yarn"
    assert got.index_topk == 64 and got.num_nextn_predict_layers == 0


def test_every_dense_weight_has_its_tensor_and_every_tensor_a_place(golden):
    meta, tensors = golden
    config = _config(meta, tensors)
    experts = {t.location.name for roles in find_expert_tensors(tensors).values() for t in roles.values()}
    used = set()
    for name, meta_tensor in meta_model_state(config).items():
        if ".mlp.experts." in name:
            continue
        gguf_name = gguf_tensor_name(name)
        assert gguf_name in tensors, f"{name} -> {gguf_name}"
        assert tuple(tensors[gguf_name].shape) == tuple(meta_tensor.shape), name
        used.add(gguf_name)
    assert set(tensors) - experts == used
    assert {tensors[n].element_type for n in experts} == {gguf.GGMLQuantizationType.MXFP4}


@pytest.mark.parametrize("hf_name", ["model.layers.0.self_attn.unknown_proj.weight", "model.embed.weight",
                                     "model.layers.0.mlp.gate.bias_vl"])
def test_unknown_tensors_are_refused_naming_them(hf_name):
    with pytest.raises(TensorMappingError, match=rf"'{hf_name}'.*packtools/gguf/deepseek4\.py"):
        gguf_tensor_name(hf_name)


@pytest.mark.parametrize("key, value, message", [
    ("{arch}.expert_gating_func", 2, "not sqrtsoftplus"),
    ("{arch}.attention.compress_ratios", [0, 8, 128, 0], r"compress ratios \[8\]"),
    ("{arch}.attention.compress_ratios", [0, 4], "2 entries for 3 blocks"),
    ("{arch}.swiglu_clamp_exp", [10.0, 7.0, 10.0], "swiglu clamps"),
])
def test_metadata_llamacpp_would_refuse_is_refused(golden, key, value, message):
    meta, tensors = golden

    class Edited(Metadata):
        def get(self, template, default=None):
            return value if template == key else super().get(template, default)

    edited = Edited(GOLDEN, meta._fields, GGUF_ARCH_NAME)
    with pytest.raises(UnknownArchitectureError, match=message):
        _config(edited, tensors)
