"""Synthetic GGUF checkpoints: a transformers MoE model written the way llama.cpp's converter would.

Names come from gguf-py's TensorNameMap, dense transforms from packtools.gguf.tensor_map, expert
tensors are one 3-D tensor per role per layer (gate/up split, gpt-oss de-interleaved, with
biases), metadata from packtools.gguf.config_write, the tokenizer from gguf-py's SpecialVocab.
Experts are quantized to `expert_type` and streamed expert by expert, so a model whose experts
do not fit in RAM can be written by passing `expert_values` (and meta-device expert params).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

from packformat.constants import QUANT_TYPES, ElementType, Role, block_shape
from packtools.arch import get_arch
from packtools.gguf.config_write import write_config_kv
from packtools.gguf.errors import ExpertQuantizationError
from packtools.gguf.expert_map import BIAS_ROLES, expert_tensor_name, hf_expert_roles, role_shapes, written_roles
from packtools.gguf.tensor_map import TensorMapper
from packtools.gguf.tokenizer import GPT2_PRE, write_vocab_kv
from packtools.quants import quantize
from packtools.synth.gguf_stream import TensorPlan, write_gguf

# (layer, expert, role) -> that role's values in GGUF orientation (GATE/UP [I, H], DOWN [H, I],
# biases [I] / [H]): floats, or uint8 bytes already encoded in the expert type (for huge models,
# e.g. packtools.quants.random_blocks). Tensors are role-major, so it is called once per triple.
ExpertValues = Callable[[int, int, Role], np.ndarray]

# Tensors llama.cpp's converter always keeps in F32 (besides 1-D ones, norms and biases)
_F32_KINDS = (
    gguf.MODEL_TENSOR.FFN_GATE_INP,
    gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
    gguf.MODEL_TENSOR.SSM_CONV1D_Q,
    gguf.MODEL_TENSOR.SSM_CONV1D_K,
    gguf.MODEL_TENSOR.SSM_CONV1D_V,
)
_F32_NAMES = re.compile(
    "^(?:" + "|".join(re.escape(gguf.TENSOR_NAMES[k]).replace(r"\{bid\}", r"\d+") for k in _F32_KINDS) + r")\.weight$"
)


def file_type(experts_type: ElementType) -> gguf.LlamaFileType:
    """general.file_type of a GGUF whose experts are of this type: its record's, else GUESSED."""
    record = QUANT_TYPES.get(experts_type)
    return record.file_type if record is not None and record.file_type is not None else gguf.LlamaFileType.GUESSED


def element_type(value: str | int) -> ElementType:
    return ElementType[value] if isinstance(value, str) else ElementType(value)


def synth_gguf(
    arch: str,
    out_path: Path | str,
    *,
    model: PreTrainedModel | None = None,
    config: PretrainedConfig | None = None,
    state_dict: Mapping[str, torch.Tensor] | None = None,
    expert_type: str | int = "F32",
    dense_type: str | int = "F32",
    split_max_tensors: int | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    tokenizer_pre: str = GPT2_PRE,
    expert_values: ExpertValues | None = None,
    name: str = "expertpack synthetic",
) -> list[Path]:
    """Write `model` (or `config` + `state_dict`) as a GGUF of `arch`; returns the file(s) written.

    Routed expert parameters may be on the meta device when `expert_values` supplies them.
    """
    if model is not None:
        config, state_dict = model.config, model.state_dict()
    if config is None or state_dict is None:
        raise ValueError("synth_gguf needs a model, or a config and a state_dict")
    if config.model_type != arch:
        raise ValueError(f"arch {arch!r} but the config's model_type is {config.model_type!r}")
    experts_type, dense = element_type(expert_type), element_type(dense_type)
    mapper = TensorMapper(config)
    # a dry run on a file-less writer refuses settings GGUF cannot carry before any tensor work
    write_config_kv(gguf.GGUFWriter(None, mapper.arch.gguf_name), config)
    plans = _tensor_plans(mapper, state_dict, experts_type, dense, expert_values)

    def add_metadata(writer: gguf.GGUFWriter) -> None:
        writer.add_name(name)
        write_config_kv(writer, config)
        writer.add_file_type(file_type(experts_type))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        write_vocab_kv(writer, config, tokenizer, pre=tokenizer_pre)

    return write_gguf(out_path, mapper.arch.gguf_name, add_metadata, plans, split_max_tensors=split_max_tensors)


def _tensor_plans(mapper, state_dict, experts_type, dense_type, expert_values) -> list[TensorPlan]:
    config = mapper.config
    plans: list[TensorPlan] = []
    layers_done: set[int] = set()
    for key, tensor in state_dict.items():
        routed = mapper.routed_expert(key)
        if routed is not None:
            layer = routed[0]
            if layer not in layers_done:
                layers_done.add(layer)
                values = expert_values or _values_from_params(config.model_type, state_dict, layer)
                plans.extend(_expert_plans(config, layer, experts_type, values))
            continue
        if config.tie_word_embeddings and key == "lm_head.weight":
            continue  # tied: llama.cpp reuses token_embd
        if tensor.is_meta:
            raise ValueError(f"dense tensor {key!r} is on the meta device; only routed experts may be")
        rule = mapper.dense_rule(key)
        for gguf_name, value in zip(rule.gguf_names, rule.to_gguf(tensor.detach())):
            shape = tuple(value.shape)
            kind = _dense_element_type(gguf_name, shape, dense_type)
            # converted to float32 and encoded only when written: one dense tensor in flight at a time
            plans.append(TensorPlan(gguf_name, shape, kind, lambda v=value, k=kind: [quantize(v.float().numpy(), k)]))
    return plans


def _dense_element_type(gguf_name: str, shape: tuple[int, ...], dense_type: ElementType) -> ElementType:
    """llama.cpp's converter policy: 1-D, norms, biases, routers and conv stay F32."""
    if len(shape) <= 1 or gguf_name.endswith("_norm.weight") or not gguf_name.endswith(".weight"):
        return ElementType.F32
    if _F32_NAMES.match(gguf_name):
        return ElementType.F32
    if shape[-1] % block_shape(dense_type)[0]:
        return ElementType.F16  # the converter's fallback when rows do not divide into blocks
    return dense_type


def _values_from_params(model_type: str, state_dict: Mapping[str, torch.Tensor], layer: int) -> ExpertValues:
    prefix = f"model.layers.{layer}.mlp.experts."
    params = {key[len(prefix):]: t for key, t in state_dict.items() if key.startswith(prefix)}
    if any(t.is_meta for t in params.values()):
        raise ValueError(f"layer {layer}: expert parameters are on the meta device; pass expert_values")

    def values(layer_index: int, expert: int, role: Role) -> np.ndarray:
        return hf_expert_roles(model_type, params, expert)[role].detach().float().numpy()

    return values


def _expert_plans(
    config: PretrainedConfig, layer: int, experts_type: ElementType, values: ExpertValues
) -> list[TensorPlan]:
    spec = get_arch(config.model_type)
    shapes = role_shapes(spec.moe_intermediate_size(config), config.hidden_size)
    count = spec.num_experts(config)
    plans = []
    for role in written_roles(config.model_type):
        kind = ElementType.F32 if role in BIAS_ROLES else experts_type
        name = expert_tensor_name(role, layer)
        row, block = shapes[role][-1], block_shape(kind)[0]
        if row % block:
            raise ExpertQuantizationError(
                f"{name}: rows of {row} elements are not a whole number of {kind.name} blocks of {block} elements"
            )
        plans.append(TensorPlan(name, (count, *shapes[role]), kind, _expert_chunks(values, layer, role, count, kind)))
    return plans


def _expert_chunks(values: ExpertValues, layer: int, role: Role, count: int, kind: ElementType):
    def chunks() -> Iterator[np.ndarray]:
        for expert in range(count):
            value = values(layer, expert, role)
            yield value if value.dtype == np.uint8 else quantize(np.ascontiguousarray(value, dtype=np.float32), kind)

    return chunks
