"""Split GGUF sets (llama.cpp naming and split.* keys), streamed expert writing, source identity."""

from __future__ import annotations

import hashlib

import gguf
import numpy as np
import pytest
import torch

from packformat.constants import ElementType, Role
from packtools.gguf.errors import ExpertQuantizationError, MissingShardError
from packtools.gguf.reference import load_reference_model
from packtools.gguf.source import GGUFSource
from packtools.quants import random_blocks
from packtools.synth.gguf_cli import synth_gguf_model
from packtools.synth.gguf_models import random_expert_values, tiny_config_with, tiny_random_model
from packtools.synth.gguf_stream import GGUFWriteError, TensorPlan, write_gguf
from packtools.synth.gguf_writer import synth_gguf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The same deepseek_v3 model as one file and as a split set of <= 12 tensors per shard."""
    model = tiny_random_model("deepseek_v3", seed=11, num_layers=3)
    single_dir, split_dir = tmp_path_factory.mktemp("single"), tmp_path_factory.mktemp("split")
    (single,) = synth_gguf("deepseek_v3", single_dir / "ds.gguf", model=model, expert_type="Q8_0")
    shards = synth_gguf("deepseek_v3", split_dir / "ds.gguf", model=model, expert_type="Q8_0", split_max_tensors=12)
    return model, single, shards


def test_split_names_and_keys_follow_llama_cpp(pair):
    _, _, shards = pair
    count = len(shards)
    assert count >= 3
    assert [p.name for p in shards] == [f"ds-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
    total = 0
    for index, path in enumerate(shards):
        reader = gguf.GGUFReader(path)
        assert reader.get_field("split.no").contents() == index
        assert reader.get_field("split.count").contents() == count
        total += len(reader.tensors)
        assert len(reader.tensors) <= 12
    assert gguf.GGUFReader(shards[0]).get_field("split.tensors.count").contents() == total


def test_split_set_reads_like_the_single_file(pair):
    _, single, shards = pair
    with GGUFSource(single) as one, GGUFSource(shards[0]) as many:
        assert many.hf_config() == one.hf_config()
        assert many.moe_layers() == one.moe_layers() == [1, 2]
        for layer in one.moe_layers():
            for expert in range(one.num_experts()):
                a, b = one.expert_roles(layer, expert), many.expert_roles(layer, expert)
                assert [(s.role, s.nbytes, s.shape) for s in a] == [(s.role, s.nbytes, s.shape) for s in b]
                assert [bytes(s.read()) for s in a] == [bytes(s.read()) for s in b]
        for x, y in zip(one.dense_tensors(), many.dense_tensors(), strict=True):
            assert x.name == y.name and torch.equal(x.load(), y.load())
        ids = torch.arange(3, 20).reshape(1, -1)
        with torch.no_grad():
            torch.testing.assert_close(load_reference_model(many)(ids).logits, load_reference_model(one)(ids).logits,
                                       rtol=0, atol=0)


def test_identity_hashes_the_metadata_of_every_shard(pair):
    _, single, shards = pair
    with GGUFSource(shards[0]) as source:
        identity = source.identity()
    assert [f["name"] for f in identity["files"]] == [p.name for p in shards]
    for entry, path in zip(identity["files"], shards):
        data = path.read_bytes()
        assert entry["size"] == len(data)
        assert entry["header_sha256"] == hashlib.sha256(data[: gguf.GGUFReader(path).data_offset]).hexdigest()
    with GGUFSource(single) as source:
        assert source.identity()["files"][0]["header_sha256"] != identity["files"][0]["header_sha256"]


@pytest.mark.parametrize("damage,text", [
    ("delete-second", "-00002-of-"),
    ("open-second", "open the first shard"),
    ("rename-first", "cannot be found"),
])
def test_split_set_problems_name_the_shard(tmp_path, damage, text):
    model = tiny_random_model("qwen3_moe", seed=2)
    shards = synth_gguf("qwen3_moe", tmp_path / "q.gguf", model=model, split_max_tensors=8)
    opened = shards[0]
    if damage == "delete-second":
        shards[1].unlink()
    elif damage == "open-second":
        opened = shards[1]
    else:
        opened = shards[0].rename(tmp_path / "q-first.gguf")
    with pytest.raises(MissingShardError, match=text):
        GGUFSource(opened)


def test_streamed_experts_from_generators(tmp_path):
    """Expert params on the meta device; values come per (layer, expert, role), pre-encoded bytes."""
    model = tiny_random_model("qwen3_moe", seed=4, hidden_size=256, moe_intermediate_size=256, num_experts=4)
    state = {k: (v.to("meta") if ".mlp.experts." in k else v) for k, v in model.state_dict().items()}
    shapes = {Role.GATE: (256, 256), Role.UP: (256, 256), Role.DOWN: (256, 256)}
    calls = []

    def expert_values(layer: int, expert: int, role: Role) -> np.ndarray:
        calls.append((layer, expert, role))
        rng = np.random.default_rng([layer, expert, int(role)])
        return random_blocks(ElementType.Q4_K, shapes[role], rng)

    (path,) = synth_gguf("qwen3_moe", tmp_path / "s.gguf", config=model.config, state_dict=state,
                         expert_type="Q4_K", expert_values=expert_values)
    assert len(calls) == len(set(calls)) == 2 * 4 * 3  # each (layer, expert, role) generated exactly once
    with GGUFSource(path) as source:
        for layer in source.moe_layers():
            for expert in range(4):
                for role_slice in source.expert_roles(layer, expert):
                    expected = random_blocks(ElementType.Q4_K, shapes[role_slice.role],
                                             np.random.default_rng([layer, expert, int(role_slice.role)]))
                    assert bytes(role_slice.read()) == expected.tobytes()
        assert torch.isfinite(load_reference_model(source)(torch.arange(3, 9)[None]).logits).all()


def test_meta_experts_without_values_are_refused(tmp_path):
    model = tiny_random_model("olmoe", seed=1)
    state = {k: (v.to("meta") if ".mlp.experts." in k else v) for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match="expert_values"):
        synth_gguf("olmoe", tmp_path / "x.gguf", config=model.config, state_dict=state)


@pytest.mark.parametrize("chunks,text", [([np.zeros(3, np.float32)], "12 bytes, its info promises 16"),
                                         ([np.zeros(5, np.float32)], "at least 20 bytes")])
def test_write_gguf_checks_streamed_sizes_and_cleans_up(tmp_path, chunks, text):
    plan = TensorPlan("token_embd.weight", (4,), ElementType.F32, lambda: chunks)
    with pytest.raises(GGUFWriteError, match=text):
        write_gguf(tmp_path / "w.gguf", "qwen3moe", lambda writer: None, [plan])
    assert not (tmp_path / "w.gguf").exists()


def test_expert_rows_must_fill_whole_blocks(tmp_path):
    model = tiny_random_model("mixtral", seed=1)  # hidden 64: not a whole Q4_K block of 256
    expected = "blk.0.ffn_gate_exps.weight: rows of 64 elements .* Q4_K blocks of 256"
    with pytest.raises(ExpertQuantizationError, match=expected):
        synth_gguf("mixtral", tmp_path / "x.gguf", model=model, expert_type="Q4_K")
    assert not (tmp_path / "x.gguf").exists()


def test_synth_gguf_model_streams_large_models_with_the_same_dense_weights(tmp_path):
    kwargs = dict(seed=5, expert_type="MXFP4", num_experts=4)
    (full,) = synth_gguf_model("gpt_oss", tmp_path / "full.gguf", **kwargs)
    (streamed,) = synth_gguf_model("gpt_oss", tmp_path / "streamed.gguf", stream_threshold_bytes=0, **kwargs)
    values = random_expert_values(tiny_config_with("gpt_oss", num_experts=4), ElementType.MXFP4, seed=5)
    with GGUFSource(full) as a, GGUFSource(streamed) as b:
        assert a.hf_config() == b.hf_config()
        for x, y in zip(a.dense_tensors(), b.dense_tensors(), strict=True):
            assert x.name == y.name and torch.equal(x.load(), y.load())
        for layer in b.moe_layers():
            for expert in range(b.num_experts()):
                for role_slice in b.expert_roles(layer, expert):
                    assert bytes(role_slice.read()) == values(layer, expert, role_slice.role).tobytes()
        assert b.write_tokenizer(tmp_path / "tok")["origin"] == "gguf-metadata"
        with torch.no_grad():
            assert torch.isfinite(load_reference_model(b)(torch.arange(3, 20)[None]).logits).all()


def test_reading_after_close_fails_loudly(pair):
    _, single, _ = pair
    source = GGUFSource(single)
    role_slice = source.expert_roles(1, 0)[0]
    assert len(role_slice.read()) == role_slice.nbytes
    source.close()
    with pytest.raises(ValueError, match="closed"):
        role_slice.read()
