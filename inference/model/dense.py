"""Build a transformers model on the meta device and give it every weight except the routed experts.

This mirrors what `from_pretrained` does, minus the experts: construct under the meta device,
put each checkpoint tensor in place in the dtype `from_pretrained` would choose (the requested
dtype, the module's own dtype where its __init__ fixed one, float32 where the model's
keep-in-fp32 plan says so), then let the model's own `_init_weights` fill the non-persistent
buffers (rotary inverse frequencies and the like) that no checkpoint holds.
"""

from __future__ import annotations

import re

import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, PretrainedConfig, initialization

from inference.model.errors import DenseWeightsError, UninitializedBufferError


def build_meta_model(config: PretrainedConfig, dtype: torch.dtype) -> torch.nn.Module:
    """The causal-LM model of `config` with every parameter and buffer on the meta device."""
    with torch.device("meta"), initialization.meta_device_safe_creation_ops(), initialization.no_init_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval().requires_grad_(False)  # inference only; routed params included


def _keep_in_fp32_pattern(model: torch.nn.Module, dtype: torch.dtype) -> re.Pattern | None:
    # the plan from_pretrained applies (all its values are float32): a regex search per key, "*" = ".*"
    plan = model._get_dtype_plan(dtype)
    assert set(plan.values()) <= {torch.float32}, plan
    return re.compile("|".join(f"(?:{glob.replace('*', '.*')})" for glob in plan)) if plan else None


def _target_dtype(key: str, meta_tensor: torch.Tensor, fp32_pattern: re.Pattern | None) -> torch.dtype:
    if fp32_pattern is not None and meta_tensor.is_floating_point() and fp32_pattern.search(key):
        return torch.float32
    return meta_tensor.dtype


# bytes; torch's CPU allocator starts every tensor it allocates on such a boundary (c10 gAlignment)
TENSOR_ALIGNMENT = 64


def _aligned(value: torch.Tensor) -> torch.Tensor:
    """`value`, copied if its data does not start on a TENSOR_ALIGNMENT boundary.

    safe_open on the CPU maps the file: a tensor starts wherever the file put it, on any 8-byte step.
    Some BLAS kernels sum in another order for unaligned rows (MKL's GEMV below AVX2 does, e.g. a
    [1, H] gate), so the same values would give other bits than transformers' own parameters, which
    its allocator aligns.
    """
    if value.data_ptr() % TENSOR_ALIGNMENT == 0:
        return value
    return value.clone(memory_format=torch.contiguous_format)


def _set_tensor(model: torch.nn.Module, key: str, value: torch.Tensor) -> None:
    module_name, _, attr = key.rpartition(".")
    module = model.get_submodule(module_name)
    if attr in module._parameters:
        module._parameters[attr] = torch.nn.Parameter(value, requires_grad=False)
    else:
        module._buffers[attr] = value


def load_dense(model: torch.nn.Module, path, device: torch.device, dtype: torch.dtype, routed: set[str]) -> int:
    """Load every non-routed state_dict entry from `path`; refuses missing, unexpected or misshapen keys.

    Tied weights (lm_head tied to the embeddings) may be absent; they are re-tied afterwards.
    Every loaded tensor starts on a TENSOR_ALIGNMENT boundary. Returns the number of tensors loaded.
    """
    expected = {k: v for k, v in model.state_dict(keep_vars=True).items() if k not in routed}
    tied = set(getattr(model, "all_tied_weights_keys", {}) or {})
    fp32_pattern = _keep_in_fp32_pattern(model, dtype)
    with safe_open(str(path), framework="pt", device=str(device)) as dense:
        keys = set(dense.keys())
        missing = sorted(set(expected) - keys - tied)
        unexpected = sorted(keys - set(expected))
        routed_in_file = sorted(keys & routed)
        if missing or unexpected:
            raise DenseWeightsError(path, missing=missing, unexpected=unexpected, routed=routed_in_file)
        mismatched = []
        for key in sorted(keys):
            meta = expected[key]
            shape = tuple(dense.get_slice(key).get_shape())
            if shape != tuple(meta.shape):
                mismatched.append(f"{key}: file {shape}, model {tuple(meta.shape)}")
                continue
            value = dense.get_tensor(key)
            if value.is_floating_point() != meta.is_floating_point():
                mismatched.append(f"{key}: file {value.dtype}, model {meta.dtype}")
                continue
            _set_tensor(model, key, _aligned(value.to(_target_dtype(key, meta, fp32_pattern))))
        if mismatched:
            raise DenseWeightsError(path, mismatched=mismatched)
    if tied:
        model.tie_weights()
    return len(keys)


def _non_persistent_buffers(model: torch.nn.Module):
    for module_name, module in model.named_modules():
        for attr in sorted(module._non_persistent_buffers_set):
            if module._buffers.get(attr) is not None:
                yield module_name, module, attr


def initialize_non_persistent_buffers(model, device: torch.device) -> list[str]:
    """Materialize the non-persistent buffers on `device` and have the model's _init_weights fill them.

    Every other tensor (loaded, or routed and meta) and every module that owns no such buffer is
    marked initialized first, so `initialize_weights` touches nothing else. Float buffers start
    as NaN so that one the model does not fill is caught here rather than in a forward.
    """
    owners, names = set(), []
    for module_name, module, attr in _non_persistent_buffers(model):
        buffer = module._buffers[attr]
        fresh = torch.empty_like(buffer, device=device)
        if fresh.is_floating_point():
            fresh.fill_(float("nan"))
        module._buffers[attr] = fresh
        owners.add(module)
        names.append(f"{module_name}.{attr}" if module_name else attr)
    fresh_ids = {id(module._buffers[attr]) for _, module, attr in _non_persistent_buffers(model)}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) not in fresh_ids:
            tensor._is_hf_initialized = True
    for module in model.modules():
        module._is_hf_initialized = module not in owners
    model.initialize_weights()
    for module_name, module, attr in _non_persistent_buffers(model):
        buffer = module._buffers[attr]
        if buffer.is_floating_point() and bool(torch.isnan(buffer).any()):
            raise UninitializedBufferError(f"{module_name}.{attr}")
    return names
