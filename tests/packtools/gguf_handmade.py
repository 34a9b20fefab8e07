"""A small qwen3moe GGUF written by hand with gguf-py's GGUFWriter, for GGUFSource tests.

Independent of packtools' own writer: keys through GGUFWriter.add_*, tensors through
add_tensor, experts quantized by gguf.quants. Tests mutate the key and tensor tables to make
broken files. Also a GGUF copier that changes metadata and tensors on the way.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
LAYERS, EXPERTS, HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 2, 4, 64, 32, 4, 2, 16, 300
KVs = dict[str, Callable[[gguf.GGUFWriter], None]]
Tensors = dict[str, tuple[np.ndarray, Q]]


def handmade_kv(arch: str = "qwen3moe") -> KVs:
    return {
        "block_count": lambda w: w.add_block_count(LAYERS),
        "context_length": lambda w: w.add_context_length(512),
        "embedding_length": lambda w: w.add_embedding_length(HIDDEN),
        "feed_forward_length": lambda w: w.add_feed_forward_length(96),
        "head_count": lambda w: w.add_head_count(HEADS),
        "head_count_kv": lambda w: w.add_head_count_kv(KV_HEADS),
        "key_length": lambda w: w.add_key_length(HEAD_DIM),
        "value_length": lambda w: w.add_value_length(HEAD_DIM),
        "rms_eps": lambda w: w.add_layer_norm_rms_eps(1e-6),
        "rope_freq_base": lambda w: w.add_rope_freq_base(1000000.0),
        "expert_count": lambda w: w.add_expert_count(EXPERTS),
        "expert_used_count": lambda w: w.add_expert_used_count(2),
        "expert_feed_forward_length": lambda w: w.add_expert_feed_forward_length(INTER),
    }


def handmade_tensors(expert_type: Q = Q.Q8_0, seed: int = 0) -> Tensors:
    rng = np.random.default_rng(seed)

    def values(*shape: int, base: float = 0.0) -> np.ndarray:
        return (base + 0.1 * rng.standard_normal(shape)).astype(np.float32)

    def experts(*shape: int) -> tuple[np.ndarray, Q]:
        return gguf.quants.quantize(values(EXPERTS, *shape), expert_type), expert_type  # [E, rows, row bytes]

    tensors: Tensors = {"token_embd.weight": (values(VOCAB, HIDDEN), Q.F32)}
    for b in range(LAYERS):
        tensors.update({
            f"blk.{b}.attn_norm.weight": (values(HIDDEN, base=1.0), Q.F32),
            f"blk.{b}.attn_q.weight": (values(HEADS * HEAD_DIM, HIDDEN), Q.F32),
            f"blk.{b}.attn_k.weight": (values(KV_HEADS * HEAD_DIM, HIDDEN), Q.F32),
            f"blk.{b}.attn_v.weight": (values(KV_HEADS * HEAD_DIM, HIDDEN), Q.F32),
            f"blk.{b}.attn_output.weight": (values(HIDDEN, HEADS * HEAD_DIM), Q.F32),
            f"blk.{b}.attn_q_norm.weight": (values(HEAD_DIM, base=1.0), Q.F32),
            f"blk.{b}.attn_k_norm.weight": (values(HEAD_DIM, base=1.0), Q.F32),
            f"blk.{b}.ffn_norm.weight": (values(HIDDEN, base=1.0), Q.F32),
            f"blk.{b}.ffn_gate_inp.weight": (values(EXPERTS, HIDDEN), Q.F32),
            f"blk.{b}.ffn_gate_exps.weight": experts(INTER, HIDDEN),
            f"blk.{b}.ffn_up_exps.weight": experts(INTER, HIDDEN),
            f"blk.{b}.ffn_down_exps.weight": experts(HIDDEN, INTER),
        })
    tensors["output_norm.weight"] = (values(HIDDEN, base=1.0), Q.F32)
    tensors["output.weight"] = (values(VOCAB, HIDDEN), Q.F32)
    return tensors


def write_handmade(path: Path, kv: KVs, tensors: Tensors, arch: str = "qwen3moe") -> Path:
    writer = gguf.GGUFWriter(path, arch)
    for add in kv.values():
        add(writer)
    for name, (array, kind) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=None if kind == Q.F32 else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def rewrite_gguf(src: Path, dst: Path, kv_changes: dict, drop: set[str], add: dict[str, np.ndarray]) -> Path:
    """Copy a GGUF through gguf-py, changing metadata (None deletes) and tensors."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, reader.get_field("general.architecture").contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in kv_changes:
            continue
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), field.types[0], sub_type=sub_type)
    for name, (value, vtype) in kv_changes.items():
        if value is not None:
            writer.add_key_value(name, value, vtype)
    for tensor in reader.tensors:
        if tensor.name not in drop:
            writer.add_tensor(tensor.name, np.array(tensor.data), raw_dtype=tensor.tensor_type)
    for name, array in add.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst

