"""Bad GGUF inputs fail with typed errors that name the file, tensor, type, key or offset.

Each broken file is the valid hand-written qwen3moe GGUF (gguf_handmade) with one mutation:
of its metadata or tensor table before writing, or of its bytes after.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest

from packtools.gguf.errors import (
    ExpertLayoutError,
    GGUFMagicError,
    GGUFTruncatedError,
    MissingMetadataError,
    TensorMappingError,
    UnknownArchitectureError,
    UnsupportedTensorTypeError,
)
from packtools.gguf.source import GGUFSource

from gguf_handmade import EXPERTS, HIDDEN, INTER, KVs, Q, Tensors, handmade_kv, handmade_tensors, write_handmade


# Table rows: (mutate kv/tensors before writing, mutate the file after writing, error, text in message)
def _drop(kind: str, name: str):
    def mutate(kv: KVs, tensors: Tensors) -> None:
        (kv if kind == "kv" else tensors).pop(name)
    return mutate


def _set_tensor(name: str, array: np.ndarray, kind: Q):
    def mutate(kv: KVs, tensors: Tensors) -> None:
        tensors[name] = (array, kind)
    return mutate


def _set_kv(name: str, add: Callable[[gguf.GGUFWriter], None]):
    def mutate(kv: KVs, tensors: Tensors) -> None:
        kv[name] = add
    return mutate


def _truncate(size: int | None = None, minus: int = 0):
    def cut(path: Path) -> None:
        data = path.read_bytes()
        path.write_bytes(data[: size if size is not None else len(data) - minus])
    return cut


def _overwrite(offset: int, raw: bytes):
    def patch(path: Path) -> None:
        data = bytearray(path.read_bytes())
        data[offset:offset + len(raw)] = raw
        path.write_bytes(bytes(data))
    return patch


def _bad_type_id(path: Path) -> None:
    # tensor info: name, n_dims (u32), dims (u64 each), type (u32), offset (u64)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_gate_exps.weight"
    at = data.index(name) + len(name)
    n_dims = int.from_bytes(data[at:at + 4], "little")
    type_at = at + 4 + 8 * n_dims
    data[type_at:type_at + 4] = (250).to_bytes(4, "little")
    path.write_bytes(bytes(data))


_Q81 = np.zeros((EXPERTS, INTER, HIDDEN // 32 * gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), dtype=np.uint8)
_FEWER = gguf.quants.quantize(np.zeros((EXPERTS - 1, INTER, HIDDEN), np.float32), Q.Q8_0)
_NARROW = gguf.quants.quantize(np.zeros((EXPERTS, INTER // 2, HIDDEN), np.float32), Q.Q8_0)

BAD_INPUTS = [
    pytest.param(None, _overwrite(0, b"GGML"), GGUFMagicError, "magic", id="wrong-magic"),
    pytest.param(None, _truncate(minus=100), GGUFTruncatedError, "output.weight", id="truncated-tensor-data"),
    pytest.param(None, _truncate(size=200), GGUFTruncatedError, "metadata", id="truncated-metadata"),
    pytest.param(None, _truncate(size=2), GGUFTruncatedError, "magic", id="truncated-magic"),
    pytest.param(None, _bad_type_id, UnsupportedTensorTypeError, "id 250", id="unknown-type-id"),
    pytest.param(_set_tensor("blk.0.ffn_gate_exps.weight", _Q81, Q.Q8_1), None, UnsupportedTensorTypeError,
                 "Q8_1", id="expert-type-q8_1"),
    pytest.param(_set_tensor("blk.1.ffn_up_exps.weight", _FEWER, Q.Q8_0), None, ExpertLayoutError,
                 "blk.1.ffn_up_exps.weight: 3 experts", id="inconsistent-expert-count"),
    pytest.param(_set_kv("expert_count", lambda w: w.add_expert_count(EXPERTS + 1)), None, ExpertLayoutError,
                 "expert_count is 5", id="expert-count-metadata-disagrees"),
    pytest.param(_set_tensor("blk.0.ffn_up_exps.weight", _NARROW, Q.Q8_0), None, ExpertLayoutError,
                 "per-expert shape", id="inconsistent-expert-width"),
    pytest.param(_drop("tensor", "blk.1.ffn_up_exps.weight"), None, ExpertLayoutError, "layer 1", id="missing-role"),
    pytest.param(_drop("kv", "expert_feed_forward_length"), None, MissingMetadataError,
                 "qwen3moe.expert_feed_forward_length", id="missing-metadata"),
    pytest.param(_drop("tensor", "blk.1.attn_k_norm.weight"), None, TensorMappingError, "blk.1.attn_k_norm.weight",
                 id="missing-dense-tensor"),
    pytest.param(_set_tensor("blk.0.mystery.weight", np.zeros(4, np.float32), Q.F32), None, TensorMappingError,
                 "blk.0.mystery.weight", id="unmapped-tensor"),
    pytest.param(_drop("kv", "expert_count"), None, UnknownArchitectureError, "no routed experts", id="no-experts"),
]


@pytest.mark.parametrize("mutate,corrupt,error,text", BAD_INPUTS)
def test_bad_inputs_raise_typed_errors(tmp_path, mutate, corrupt, error, text):
    kv, tensors = handmade_kv(), handmade_tensors()
    if mutate is not None:
        mutate(kv, tensors)
    path = write_handmade(tmp_path / "bad.gguf", kv, tensors)
    if corrupt is not None:
        corrupt(path)
    with pytest.raises(error, match=None) as raised:
        GGUFSource(path)
    assert text in str(raised.value)


@pytest.mark.parametrize("arch,extra_kv,text", [
    ("falcon", {}, "'falcon'"),
    # 3 is llama.cpp's softmax_weight: neither DeepSeek-V2's softmax (1) nor V3's sigmoid (2)
    ("deepseek2", {"gating": lambda w: w.add_uint32(gguf.Keys.LLM.EXPERT_GATING_FUNC.format(arch="deepseek2"), 3)},
     r"expert_gating_func 3 is none of 1 \(softmax\), 2 \(sigmoid\)"),
])
def test_unknown_architectures(tmp_path, arch, extra_kv, text):
    kv = {**handmade_kv(), **extra_kv}
    path = write_handmade(tmp_path / "arch.gguf", kv, handmade_tensors(), arch=arch)
    with pytest.raises(UnknownArchitectureError, match=text):
        GGUFSource(path)


def test_unsupported_expert_quant_iq2_xxs(tmp_path):
    # gguf-py reads IQ2_XXS (66 bytes per 256 elements), but a pack cannot hold it: refused by name
    tensors = handmade_tensors()
    tensors["blk.0.ffn_gate_exps.weight"] = (np.zeros((EXPERTS, INTER, 66), dtype=np.uint8), Q.IQ2_XXS)
    path = write_handmade(tmp_path / "iq.gguf", handmade_kv(), tensors)
    with pytest.raises(UnsupportedTensorTypeError, match="IQ2_XXS") as raised:
        GGUFSource(path)
    assert raised.value.tensor == "blk.0.ffn_gate_exps.weight"


def test_the_unmutated_file_opens(tmp_path):
    """Control for the table above: every failure there comes from its mutation."""
    GGUFSource(write_handmade(tmp_path / "ok.gguf", handmade_kv(), handmade_tensors())).close()

