"""HFSource against checkpoints written by transformers itself, by hand (fused 3-D), and broken ones.

The oracle is transformers: a model loaded with from_pretrained (its own name conversion) holds
the fused expert parameters whose slices every RoleSlice must equal byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from packformat.constants import ElementType, Role
from packtools.arch import ARCHITECTURES, UnknownArchitectureError, get_arch
from packtools.arch.errors import (
    HFCheckpointError,
    InconsistentExperts,
    MissingCheckpointFile,
    MissingExpert,
    UnexpectedTensor,
    UnsupportedDtype,
)
from packtools.sources.hf import HFSource
from packtools.synth.hf import synth_hf

ARCHS = sorted(ARCHITECTURES)


def raw(tensor: torch.Tensor) -> bytes:
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def golden_roles(spec, state: dict, layer: int, expert: int) -> dict[Role, bytes]:
    """Each role's bytes cut from the runtime fused parameters of a transformers model."""
    prefix = f"model.layers.{layer}.mlp.experts."
    gate_up, down = state[prefix + "gate_up_proj"][expert], state[prefix + "down_proj"][expert]
    if spec.layout.orientation == "in_out":
        return {Role.GATE_UP: raw(gate_up), Role.DOWN: raw(down),
                Role.GATE_UP_BIAS: raw(state[prefix + "gate_up_proj_bias"][expert]),
                Role.DOWN_BIAS: raw(state[prefix + "down_proj_bias"][expert])}
    inter = gate_up.shape[0] // 2  # gate rows first
    return {Role.GATE: raw(gate_up[:inter]), Role.UP: raw(gate_up[inter:]), Role.DOWN: raw(down)}


def check_against_model(source: HFSource, model: torch.nn.Module) -> None:
    spec = source.spec
    state = model.state_dict()
    moe_layers = sorted({int(k.split(".")[2]) for k in state if spec.is_routed_runtime_key(k)})
    assert source.moe_layers() == moe_layers
    assert source.num_experts() == 8
    assert source.expert_layout() == spec.layout
    shapes = spec.role_shapes(source.config)
    for layer in moe_layers:
        for expert in range(8):
            slices = source.expert_roles(layer, expert)
            assert [s.role for s in slices] == list(spec.layout.roles)
            golden = golden_roles(spec, state, layer, expert)
            for piece in slices:
                data = bytes(piece.read())
                assert len(data) == piece.nbytes and piece.shape == shapes[piece.role]
                assert piece.element_type == ElementType.BF16
                assert data == golden[piece.role], (layer, expert, piece.role)
    dense = list(source.dense_tensors())
    assert [d.name for d in dense] == [k for k in state if not spec.is_routed_runtime_key(k)]
    for tensor in dense:
        value = tensor.load()
        assert value.dtype == tensor.dtype and tuple(value.shape) == tensor.shape
        # the source keeps the checkpoint's dtype; transformers may upcast on load (fp32 routers)
        assert torch.equal(value.to(state[tensor.name].dtype), state[tensor.name]), tensor.name


@pytest.fixture(scope="module")
def synth_dirs(tmp_path_factory):
    made = {}

    def make(arch: str, **kwargs) -> Path:
        key = (arch, tuple(sorted(kwargs.items())))
        if key not in made:
            out = tmp_path_factory.mktemp(f"{arch}_src")
            synth_hf(arch, out, seed=11, dtype="bfloat16", **kwargs)
            made[key] = out
        return made[key]

    return make


def load_reference(path: Path) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model


@pytest.mark.parametrize("arch", ARCHS)
def test_save_pretrained_checkpoint_reads_byte_exact(arch, synth_dirs):
    path = synth_dirs(arch)
    with HFSource(path) as source:
        assert source.kind == "hf"
        assert {source.expert_form(layer) for layer in source.moe_layers()} == (
            {"fused"} if arch == "gpt_oss" else {"per_expert"}
        )
        check_against_model(source, load_reference(path))


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_3d_checkpoint_reads_byte_exact(arch, synth_dirs, tmp_path):
    model = load_reference(synth_dirs(arch))
    # runtime names and fused [E, ...] expert tensors: what transformers also accepts on load
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, tmp_path / "model.safetensors")
    shutil.copy(synth_dirs(arch) / "config.json", tmp_path / "config.json")
    with HFSource(tmp_path) as source:
        assert {source.expert_form(layer) for layer in source.moe_layers()} == {"fused"}
        check_against_model(source, model)


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss", "deepseek_v4"])
def test_sharded_streamed_checkpoint_reads_byte_exact(arch, synth_dirs):
    path = synth_dirs(arch, stream_threshold_bytes=0, max_shard_bytes=40_000)
    assert (path / "model.safetensors.index.json").is_file()
    with HFSource(path) as source:
        assert len([f for f in source.identity()["files"] if f["name"].endswith(".safetensors")]) > 2
        check_against_model(source, load_reference(path))


def test_original_deepseek_v4_names_without_model_prefix(synth_dirs, tmp_path):
    # DeepSeek's own release names: no "model." prefix, "embed.weight"; transformers maps them
    base = synth_dirs("deepseek_v4")
    tensors = {k.removeprefix("model."): v for k, v in load_file(base / "model.safetensors").items()}
    tensors["embed.weight"] = tensors.pop("embed_tokens.weight")
    assert "layers.0.ffn.experts.0.w1.weight" in tensors and "layers.0.attn.wq_a.weight" in tensors
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(base / "config.json", tmp_path / "config.json")
    with HFSource(tmp_path) as source:
        check_against_model(source, load_reference(base))


def test_dense_state_dict_loads_into_a_model_with_experts_on_meta(synth_dirs):
    path = synth_dirs("kimi_linear")  # renamed containers and a concatenated conv1d
    with HFSource(path) as source:
        dense = {t.name: t.load() for t in source.dense_tensors()}
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(source.config)
    result = model.load_state_dict(dense, strict=False, assign=True)
    assert not result.unexpected_keys
    assert set(result.missing_keys) == {k for k in model.state_dict() if source.spec.is_routed_runtime_key(k)}


def test_tokenizer_files_are_copied_and_reported(synth_dirs, tmp_path):
    with HFSource(synth_dirs("olmoe")) as source:
        report = source.write_tokenizer(tmp_path / "tok")
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= set(report["files"])
    for name in report["files"]:
        assert (tmp_path / "tok" / name).read_bytes() == (synth_dirs("olmoe") / name).read_bytes()


def test_identity_hashes_config_and_safetensors_headers(synth_dirs):
    path = synth_dirs("mixtral")
    with HFSource(path) as source:
        identity = source.identity()
    files = {f["name"]: f for f in identity["files"]}
    blob = (path / "model.safetensors").read_bytes()
    header_length = int.from_bytes(blob[:8], "little")
    assert files["model.safetensors"]["header_sha256"] == hashlib.sha256(blob[8 : 8 + header_length]).hexdigest()
    assert files["model.safetensors"]["size"] == len(blob)
    assert files["config.json"]["sha256"] == hashlib.sha256((path / "config.json").read_bytes()).hexdigest()


def test_ignored_mtp_layer_tensors_are_skipped(synth_dirs, tmp_path):
    # deepseek_v3 drops model.layers.61.* (the MTP layer of the real model) on load
    base = synth_dirs("deepseek_v3")
    tensors = load_file(base / "model.safetensors")
    tensors["model.layers.61.mlp.experts.0.gate_proj.weight"] = torch.zeros(32, 64, dtype=torch.bfloat16)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(base / "config.json", tmp_path / "config.json")
    with HFSource(tmp_path) as source:
        assert source.ignored_tensors == ["model.layers.61.mlp.experts.0.gate_proj.weight"]
        assert source.moe_layers() == [1]


# ---- broken checkpoints ----------------------------------------------------------------------

def _delete(name):
    return lambda tensors: tensors.pop(name)


def _set(name, value):
    return lambda tensors: tensors.__setitem__(name, value)


def _retype(name, dtype):
    return lambda tensors: tensors.__setitem__(name, tensors[name].to(dtype))


def _zeros(*shape):
    return torch.zeros(*shape, dtype=torch.bfloat16)


BROKEN = [
    # (id, arch, edit of the tensors, error type, words the message must contain)
    ("expert-missing", "qwen3_moe", _delete("model.layers.1.mlp.experts.5.up_proj.weight"),
     MissingExpert, ["layer 1 expert 5", "UP"]),
    ("expert-shape", "qwen3_moe", _set("model.layers.0.mlp.experts.3.gate_proj.weight", _zeros(34, 64)),
     InconsistentExperts, ["layer 0 expert 3", "GATE", "(34, 64)"]),
    ("extra-expert", "mixtral", _set("model.layers.1.block_sparse_moe.experts.8.w1.weight", _zeros(32, 64)),
     InconsistentExperts, ["layer 1 expert 8"]),
    ("expert-dtype-mixed", "olmoe", _retype("model.layers.0.mlp.experts.2.down_proj.weight", torch.float16),
     InconsistentExperts, ["layer 0 expert 2", "DOWN", "F16"]),
    ("expert-dtype-unsupported", "olmoe", _retype("model.layers.0.mlp.experts.0.down_proj.weight", torch.float64),
     UnsupportedDtype, ["model.layers.0.mlp.experts.0.down_proj.weight", "F64"]),
    ("fused-expert-count", "gpt_oss", _set("model.layers.1.mlp.experts.gate_up_proj", _zeros(7, 64, 64)),
     InconsistentExperts, ["layer 1", "8 experts"]),
    ("fused-part-missing", "gpt_oss", _delete("model.layers.0.mlp.experts.down_proj_bias"),
     MissingExpert, ["layer 0", "down_proj_bias"]),
    ("experts-in-dense-layer", "deepseek_v3", _set("model.layers.0.mlp.experts.0.gate_proj.weight", _zeros(32, 64)),
     UnexpectedTensor, ["model.layers.0.mlp.experts.0.gate_proj.weight", "layer 0"]),
    ("unknown-dense", "qwen2_moe", _set("model.layers.0.mystery.weight", torch.zeros(4, dtype=torch.bfloat16)),
     UnexpectedTensor, ["model.layers.0.mystery.weight"]),
    ("dense-missing", "deepseek_v4", _delete("model.norm.weight"), UnexpectedTensor, ["model.norm.weight"]),
]


@pytest.mark.parametrize("case", BROKEN, ids=[c[0] for c in BROKEN])
def test_broken_checkpoints_raise_typed_errors(case, synth_dirs, tmp_path):
    _, arch, edit, error, words = case
    base = synth_dirs(arch)
    tensors = load_file(base / "model.safetensors")
    edit(tensors)
    save_file(tensors, tmp_path / "model.safetensors")
    shutil.copy(base / "config.json", tmp_path / "config.json")
    with pytest.raises(error) as info:
        HFSource(tmp_path)
    assert isinstance(info.value, HFCheckpointError)
    for word in words:
        assert word in str(info.value)


def test_missing_files_are_named(synth_dirs, tmp_path):
    with pytest.raises(MissingCheckpointFile, match="config.json"):
        HFSource(tmp_path)
    shutil.copy(synth_dirs("qwen3_moe") / "config.json", tmp_path / "config.json")
    with pytest.raises(MissingCheckpointFile, match="model.safetensors"):
        HFSource(tmp_path)
    sharded = synth_dirs("qwen2_moe", stream_threshold_bytes=0, max_shard_bytes=40_000)
    shutil.copytree(sharded, tmp_path / "sharded")
    victim = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(MissingCheckpointFile, match=victim.name):
        HFSource(tmp_path / "sharded")


def test_index_that_misplaces_a_tensor_is_rejected(synth_dirs, tmp_path):
    shutil.copytree(synth_dirs("qwen2_moe", stream_threshold_bytes=0, max_shard_bytes=40_000), tmp_path / "c")
    index_path = tmp_path / "c" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shards = sorted(set(index["weight_map"].values()))
    index["weight_map"]["model.norm.weight"] = shards[-1]
    index_path.write_text(json.dumps(index))
    with pytest.raises(HFCheckpointError, match="model.norm.weight"):
        HFSource(tmp_path / "c")


def test_tensor_in_two_shards_is_rejected(synth_dirs, tmp_path):
    shutil.copytree(synth_dirs("qwen2_moe", stream_threshold_bytes=0, max_shard_bytes=40_000), tmp_path / "c")
    first, second = sorted((tmp_path / "c").glob("model-*.safetensors"))[:2]
    tensors = load_file(second)
    tensors["model.norm.weight"] = load_file(first)["model.norm.weight"]
    save_file(tensors, second)
    with pytest.raises(HFCheckpointError, match="model.norm.weight"):
        HFSource(tmp_path / "c")


def test_unknown_model_type_and_corrupt_header(synth_dirs, tmp_path):
    base = synth_dirs("qwen3_moe")
    config = json.loads((base / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(UnknownArchitectureError, match="llama"):
        HFSource(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(HFCheckpointError, match="model.safetensors"):
        HFSource(tmp_path)


def test_role_bytes_match_spec_for_every_arch_config():
    # guards the registry: every layout role has a shape, and shapes are consistent
    for spec in (record.spec for record in ARCHITECTURES.values()):
        assert set(spec.layout.roles) == {r for part in spec.fused_parts.values() for r in part.roles}
        assert set(get_arch(spec.model_type).per_expert_parts.values()) <= set(spec.layout.roles)
