"""GGUFs as llama.cpp's converter writes them (tests/golden/llamacpp), changed where a file says
what transformers' model cannot compute: dots1 needs the sigmoid gating its router computes,
Hunyuan a shared MLP as wide as its experts; GLM's multi-token-prediction blocks, which
transformers does not load, are left out of the model and named in the identity."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from gguf_handmade import rewrite_gguf
from packtools.gguf.errors import InvalidMetadataError
from packtools.gguf.source import GGUFSource

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "llamacpp"
U32 = gguf.GGUFValueType.UINT32


@pytest.mark.parametrize("case,arch", [("dots1", "dots1"), ("glm4_moe", "glm4moe"), ("minimax_m2", "minimax-m2")])
@pytest.mark.parametrize("gating", [None, int(gguf.ExpertGatingFuncType.SOFTMAX)], ids=["absent", "softmax"])
def test_gating_other_than_sigmoid_is_refused(tmp_path, case, arch, gating):
    """Their routers gate with sigmoid (llama.cpp's glm4moe reads an absent key as sigmoid too)."""
    key = f"{arch}.expert_gating_func"
    path = rewrite_gguf(GOLDEN / f"{case}-F32.gguf", tmp_path / "m.gguf", {key: (gating, U32)}, set(), {})
    if gating is None and case == "glm4_moe":
        GGUFSource(path).close()
        return
    with pytest.raises(InvalidMetadataError, match=key):
        GGUFSource(path)


def test_glm4moe_mtp_blocks_are_left_out_and_named(tmp_path):
    golden = GOLDEN / "glm4_moe-F32.gguf"
    reader = gguf.GGUFReader(golden)
    assert reader.get_field("glm4moe.nextn_predict_layers").contents() == 1
    assert reader.get_field("glm4moe.block_count").contents() == 3  # 2 decoder layers + 1 MTP block
    # what a real GLM-4.5 GGUF holds in its MTP block (a whole decoder layer plus nextn.*)
    mtp = {name.replace("blk.1.", "blk.2."): np.array(t.data) for t in reader.tensors
           if (name := t.name).startswith("blk.1.")}
    mtp["blk.2.nextn.eh_proj.weight"] = np.zeros((64, 128), dtype=np.float32)
    mtp["blk.2.nextn.enorm.weight"] = np.ones(64, dtype=np.float32)
    path = rewrite_gguf(golden, tmp_path / "with-mtp.gguf", {}, set(), mtp)
    with GGUFSource(golden) as plain, GGUFSource(path) as source:
        assert source.hf_config() == plain.hf_config()
        assert source.hf_config()["num_hidden_layers"] == 2
        assert source.hf_config()["num_nextn_predict_layers"] == 1
        assert source.moe_layers() == plain.moe_layers() == [1]
        assert [t.name for t in source.dense_tensors()] == [t.name for t in plain.dense_tensors()]
        assert source.identity()["mtp_tensors_left_out"] == sorted(mtp)
        assert "mtp_tensors_left_out" not in plain.identity()


def test_hunyuan_shared_mlp_of_another_width_is_refused(tmp_path):
    """transformers' HunYuanMoEV1 sizes experts and the shared MLP alike (intermediate_size)."""
    key = "hunyuan-moe.expert_shared_feed_forward_length"
    path = rewrite_gguf(GOLDEN / "hunyuan_v1_moe-F32.gguf", tmp_path / "m.gguf", {key: (64, U32)}, set(), {})
    with pytest.raises(InvalidMetadataError, match=key):
        GGUFSource(path)
