"""load_model: what ends up where, what is refused, and with which message."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_fixtures import make_case

from inference.experts import IMPLEMENTATION_NAME, LocalPackSource, experts_modules, routed_parameter_names
from inference.model import (
    DenseWeightsError,
    UninitializedBufferError,
    build_meta_model,
    initialize_non_persistent_buffers,
    load_model,
)
from packformat.bundle import open_bundle
from packtools.arch.registry import tiny_config


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v2", "deepseek_v3", "deepseek_v4", "kimi_linear", "gpt_oss"])
def test_routed_experts_stay_meta_and_everything_else_equals_the_reference(arch, tmp_path):
    reference, bundle_dir = make_case(arch, tmp_path / "b")
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        model = loaded.model
        routed = routed_parameter_names(model)
        assert routed and all(".experts." in name for name in routed)
        expected = reference.state_dict()
        for name, tensor in model.state_dict().items():
            if name in routed:
                assert tensor.is_meta, name
            else:
                assert tensor.device.type == "cpu" and torch.equal(tensor, expected[name]), name
        reference_buffers = dict(reference.named_buffers())
        for name, buffer in model.named_buffers():  # non-persistent ones too (rotary frequencies)
            assert torch.equal(buffer, reference_buffers[name]), name
        assert model.config._experts_implementation == IMPLEMENTATION_NAME
        layers = sorted(experts_modules(model))
        assert layers == loaded.bundle.experts["moe_layers"]
        assert all(module.expertpack_binding.layer == layer for layer, (_, module) in experts_modules(model).items())
        assert not any(p.requires_grad for p in model.parameters())


def _rewrite_dense(bundle_dir, edit) -> None:
    """Apply `edit` to the dense tensors and keep the manifest's recorded size in step."""
    path = bundle_dir / "dense.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["dense"]["size"] = path.stat().st_size
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))


def _drop(name):
    return lambda t: t.pop(name)


def _put(name, value):
    return lambda t: t.__setitem__(name, value)


DENSE_DEFECTS = [
    ("missing", _drop("model.layers.1.post_attention_layernorm.weight"),
     r"missing \(1\): model\.layers\.1\.post_attention_layernorm\.weight"),
    ("unexpected", _put("model.layers.9.mlp.gate.weight", torch.zeros(8, 64)),
     r"unexpected \(1\): model\.layers\.9\.mlp\.gate\.weight"),
    ("routed expert in dense", _put("model.layers.0.mlp.experts.down_proj", torch.zeros(8, 64, 32)),
     r"routed expert weights that belong in experts\.pack \(1\): model\.layers\.0\.mlp\.experts\.down_proj"),
    ("shape", _put("model.norm.weight", torch.ones(65)),
     r"shape or dtype mismatch \(1\): model\.norm\.weight: file \(65,\), model \(64,\)"),
    ("integer for float", _put("model.norm.weight", torch.ones(64, dtype=torch.int32)),
     r"model\.norm\.weight: file torch\.int32, model torch\.float32"),
]


@pytest.mark.parametrize(("defect", "edit", "message"), DENSE_DEFECTS, ids=[d[0] for d in DENSE_DEFECTS])
def test_dense_file_must_hold_exactly_the_non_routed_weights(defect, edit, message, tmp_path):
    _, bundle_dir = make_case("qwen3_moe", tmp_path / "b")
    _rewrite_dense(bundle_dir, edit)
    with pytest.raises(DenseWeightsError, match=message) as caught:
        load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource)
    assert str(bundle_dir / "dense.safetensors") in str(caught.value)


@pytest.mark.parametrize("keep_lm_head", [True, False], ids=["lm_head in dense", "lm_head tied only"])
def test_tied_embeddings_may_be_absent_and_are_retied(keep_lm_head, tmp_path):
    reference, bundle_dir = make_case("qwen3_moe", tmp_path / "b", tie_word_embeddings=True)
    assert reference.lm_head.weight is reference.model.embed_tokens.weight
    if not keep_lm_head:
        _rewrite_dense(bundle_dir, _drop("lm_head.weight"))
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight
        ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
        with torch.no_grad():
            assert torch.equal(loaded.model(ids).logits, reference(ids).logits)


def test_tokenizer_is_loaded_when_the_bundle_has_one(tmp_path):
    _, with_tokenizer = make_case("mixtral", tmp_path / "a", tokenizer=True)
    _, without = make_case("mixtral", tmp_path / "b")
    with load_model(with_tokenizer, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert loaded.tokenizer("w5 w17")["input_ids"][-2:] == [5, 17]
        assert loaded.tokenizer.eos_token_id == loaded.config.eos_token_id
    with load_model(without, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert loaded.tokenizer is None


def test_expert_source_may_be_an_instance_or_a_factory(tmp_path):
    _, bundle_dir = make_case("olmoe", tmp_path / "b")
    with open_bundle(bundle_dir) as bundle:
        source = LocalPackSource(bundle, "cpu")
        with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=source) as loaded:
            assert loaded.expert_source is source
            assert experts_modules(loaded.model)[0][1].expertpack_binding.source is source
    with pytest.raises(TypeError, match="expert_source must be an ExpertSource or a factory"):
        load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=42)


@pytest.mark.parametrize("argument, value, message", [
    ("dense_kernels", "no", "dense_kernels must be True or False, got 'no'"),
    ("dense_kernels", 0, "dense_kernels must be True or False, got 0"),
    ("lookahead", -1, "lookahead must be a non-negative number of experts per token, got -1"),
    ("lookahead_min_precision", 1.5, r"lookahead_min_precision must be a fraction in \[0, 1\], got 1.5"),
])
def test_bad_loader_arguments_are_refused_naming_them(tmp_path, argument, value, message):
    _, bundle_dir = make_case("olmoe", tmp_path / "b")
    with pytest.raises(ValueError, match=message):
        load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource, **{argument: value})


def test_a_non_persistent_buffer_the_model_does_not_fill_is_reported():
    model = build_meta_model(tiny_config("qwen3_moe"), torch.float32)
    model.model.register_buffer("scratch", torch.empty(3, device="meta"), persistent=False)
    with pytest.raises(UninitializedBufferError, match="'model.scratch'"):
        initialize_non_persistent_buffers(model, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loads_onto_cuda_and_matches_the_cpu_reference(tmp_path):
    reference, bundle_dir = make_case("gpt_oss", tmp_path / "b")
    with load_model(bundle_dir, device="cuda", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        assert loaded.model.model.embed_tokens.weight.device.type == "cuda"
        ids = torch.tensor([[4, 8, 15, 16, 23, 42]])
        with torch.no_grad():
            got = loaded.model(ids.cuda()).logits.cpu()
            expected = reference(ids).logits
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=1e-4)
