"""Dense (non-routed) tensors of a GGUF, named and shaped as the transformers model's state_dict.

The transformers model is built on the meta device from the mapped config; each of its
state_dict keys goes through packtools.gguf.tensor_map to the GGUF tensor(s) it comes from.
Loading one tensor reads only its own bytes, dequantizes with gguf-py (F16/BF16/F32 are kept
as they are) and undoes llama.cpp's transforms.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping

import gguf
import numpy as np
import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from packtools.gguf.errors import TensorMappingError, UnsupportedTensorTypeError
from packtools.gguf.experts import read_exact
from packtools.gguf.files import TensorLocation
from packtools.gguf.tensor_map import TensorMapper
from packtools.gguf.tensor_rules import DenseRule
from packtools.quants import UnsupportedQuantType, dequantize
from packtools.sources.base import DenseTensor

ElementType = gguf.GGMLQuantizationType
# kept as stored: floats, and integer tables (deepseek4's hash-routing tid2eid is I32)
_KEPT_DTYPES = {ElementType.F32: torch.float32, ElementType.F16: torch.float16, ElementType.BF16: torch.bfloat16,
                ElementType.I32: torch.int32}


def read_tensor(location: TensorLocation) -> torch.Tensor:
    """A GGUF tensor as a torch tensor of its logical shape: F32/F16/BF16/I32 as is, else float32."""
    kind = location.element_type
    # pread, not a copy out of gguf-py's memory map: pages read through a map that stays open
    # stay resident, so RSS would grow with the dense bytes (tests/packtools/test_build.py)
    template = location.tensor.data  # dtype and shape only; no page is touched
    fd = os.open(location.shard.path, os.O_RDONLY)
    try:
        data = read_exact(fd, location.shard.path, location.offset, location.nbytes)
    finally:
        os.close(fd)
    raw = np.frombuffer(bytearray(data), dtype=template.dtype).reshape(template.shape)
    if kind in (ElementType.F32, ElementType.F16, ElementType.I32):
        return torch.from_numpy(raw).reshape(location.shape)
    if kind == ElementType.BF16:
        return torch.from_numpy(raw.view(np.int16)).view(torch.bfloat16).reshape(location.shape)
    try:
        values = dequantize(raw, kind)
    except UnsupportedQuantType:
        raise UnsupportedTensorTypeError(
            location.shard.path, location.name, kind.name, "gguf-py cannot dequantize it", offset=location.offset
        ) from None
    return torch.from_numpy(values).reshape(location.shape)


@functools.cache
def _dequantizable(kind: ElementType) -> bool:
    if kind in _KEPT_DTYPES:
        return True
    try:
        dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[kind][1]), dtype=np.uint8), kind)
    except UnsupportedQuantType:
        return False
    return True


def meta_model_state(config: PretrainedConfig) -> dict[str, torch.Tensor]:
    """The model's state_dict on the meta device, tied duplicates (lm_head = embed_tokens) dropped."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    state = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        state[name] = tensor
    return state


def plan_dense(
    mapper: TensorMapper, state: Mapping[str, torch.Tensor], tensors: Mapping[str, TensorLocation]
) -> tuple[list[DenseTensor], set[str]]:
    """One loadable DenseTensor per non-expert state_dict key; also the GGUF names they use."""
    planned, used = [], set()
    for name, meta in state.items():
        if mapper.routed_expert(name) is not None:
            continue
        rule = mapper.dense_rule(name)
        if rule.fallback is not None and not all(n in tensors for n in rule.gguf_names):
            rule = rule.fallback
        sources = []
        for gguf_name in rule.gguf_names:
            location = tensors.get(gguf_name)
            if location is None:
                raise TensorMappingError(f"{name}: the GGUF has no tensor {gguf_name!r}")
            if not _dequantizable(location.element_type):
                raise UnsupportedTensorTypeError(location.shard.path, gguf_name, location.element_type.name,
                                                 "gguf-py cannot dequantize it", offset=location.offset)
            sources.append(location)
            used.add(gguf_name)
        kinds = {location.element_type for location in sources}
        dtype = _KEPT_DTYPES.get(kinds.pop(), torch.float32) if len(kinds) == 1 else torch.float32
        shape = tuple(meta.shape)
        planned.append(DenseTensor(name, dtype, shape, functools.partial(_load, rule, tuple(sources), dtype, shape)))
    return planned, used


def _load(
    rule: DenseRule, sources: tuple[TensorLocation, ...], dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    value = rule.from_gguf(tuple(read_tensor(location) for location in sources)).to(dtype)
    if _squeezed(value.shape) == _squeezed(shape):
        value = value.reshape(shape)  # llama.cpp may drop or add unit dims (A_log [1, H] vs [1, 1, H, 1])
    else:
        names = ", ".join(location.name for location in sources)
        raise TensorMappingError(
            f"{rule.hf_name}: GGUF {names} gives shape {tuple(value.shape)}, the model expects {shape}"
        )
    return value.contiguous()


def _squeezed(shape) -> tuple[int, ...]:
    return tuple(int(d) for d in shape if d != 1)
