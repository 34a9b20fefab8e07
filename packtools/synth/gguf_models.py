"""Random MoE models for GGUF synthesis: small ones in full, large ones with streamed experts.

transformers initialises norms to ones and routing biases, sinks and A_log to constants; a
round trip that swapped two norms, or lost a bias, would still pass on such a model. Here every
tensor gets its own seeded random values (norm-like tensors near 1, the rest near 0, so the
model still runs in a numerically sane regime).

For models whose experts do not fit in memory, `random_dense_state` materializes only the dense
tensors (experts stay on the meta device) and `random_expert_values` produces each expert role's
bytes on demand, already encoded (packtools.quants.random_blocks), for synth_gguf's streaming.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from packformat.constants import ElementType, Role, tensor_nbytes
from packtools.arch import get_arch, get_architecture, tiny_config
from packtools.gguf.expert_map import BIAS_ROLES, role_shapes, written_roles
from packtools.quants import random_blocks
from packtools.synth.gguf_writer import ExpertValues
from packtools.synth.seeding import seeded_generator

_NEAR_ONE = ("norm.weight", "layernorm.weight")
_STD = 0.1  # dense and float expert values
_BIAS_STD = 0.02  # expert biases of streamed models


def default_layers(arch: str) -> int:
    """Layers of a synthesized model: enough for every kind of layer of `arch` to appear."""
    return get_architecture(arch).synth_layers


def tiny_config_with(
    arch: str, *, num_layers: int | None = None, overrides: dict | None = None, **sizes
) -> PretrainedConfig:
    """packtools.arch.tiny_config, then `overrides` of any config attribute."""
    config = tiny_config(arch, num_layers=num_layers or default_layers(arch), **sizes)
    if overrides:
        kwargs = {k: v for k, v in config.to_dict().items() if k != "model_type"}
        config = AutoConfig.for_model(arch, **{**kwargs, **overrides})
    return config


def _randomize(name: str, tensor: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    noise = torch.randn(tensor.shape, generator=seeded_generator(seed, index)) * _STD
    return (1.0 if name.endswith(_NEAR_ONE) else 0.0) + noise


def tiny_random_model(
    arch: str, *, seed: int = 0, num_layers: int | None = None, overrides: dict | None = None, **sizes
) -> PreTrainedModel:
    """A float32 model of `arch` with every tensor randomized (sizes as tiny_config's)."""
    config = tiny_config_with(arch, num_layers=num_layers, overrides=overrides, **sizes)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.state_dict().items()):
            if tensor.is_floating_point():
                tensor.copy_(_randomize(name, tensor, seed, index))
    return model.eval()


def random_dense_state(config: PretrainedConfig, seed: int) -> dict[str, torch.Tensor]:
    """The model's state_dict with dense tensors random (as tiny_random_model's) and routed
    expert parameters left on the meta device."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    spec = get_arch(config.model_type)
    state = {}
    for index, (name, tensor) in enumerate(model.state_dict().items()):
        routed = spec.is_routed_runtime_key(name)
        state[name] = tensor if routed or not tensor.is_floating_point() else _randomize(name, tensor, seed, index)
    return state


BALANCED_EMBEDDING_STD = 100.0


def balance_routing(state: dict[str, torch.Tensor], config: PretrainedConfig, seed: int) -> None:
    """Make a random model route like a trained, load-balanced one (in place on `state`).

    With every tensor at std 0.1 the residual stream of a random model collapses towards one
    direction within a few layers, so every token picks nearly the same experts (a Qwen3-like
    model touched 24 of 128 experts over 24 sampled tokens, a uniform router ~100), and sigmoid
    routers saturate (logit std 0.1*sqrt(hidden)), leaving the choice to the correction bias.
    Benchmarks then never miss the cache. Here the token embeddings are large (std 100: each
    layer's contribution stays small beside the token's own identity), router weights have std
    1/sqrt(hidden) (logits ~ N(0, 1) after the pre-MLP norm) and correction biases are zero.
    Measured on the CPU: a 12-layer Qwen3-like model (hidden 2048, 128 experts, top-8) then
    touches 106-115 experts per layer for a 32-token prompt, as uniform routing would (112).
    """
    num_experts = get_arch(config.model_type).num_experts(config)
    generator = seeded_generator(seed, 1 << 20)
    for name, tensor in state.items():
        if tensor.device.type == "meta" or not tensor.is_floating_point():
            continue
        if name.endswith("embed_tokens.weight"):
            value = torch.randn(tensor.shape, generator=generator) * BALANCED_EMBEDDING_STD
        elif name.endswith(("gate.weight", "router.weight")) and tensor.dim() == 2 and tensor.shape[0] == num_experts:
            value = torch.randn(tensor.shape, generator=generator) / tensor.shape[1] ** 0.5
        elif name.endswith("e_score_correction_bias"):
            value = torch.zeros(tensor.shape)
        else:
            continue
        state[name] = value.to(tensor.dtype)
    if getattr(config, "tie_word_embeddings", False):  # one tensor in the model: keep the pair equal
        for name in [n for n in state if n.endswith("embed_tokens.weight")]:
            state[name.replace("model.embed_tokens", "lm_head")] = state[name]


def random_expert_values(config: PretrainedConfig, expert_type: ElementType, seed: int) -> ExpertValues:
    """Each (layer, expert, role) as random valid bytes of `expert_type` (biases as float32)."""
    spec = get_arch(config.model_type)
    shapes = role_shapes(spec.moe_intermediate_size(config), config.hidden_size)

    def values(layer: int, expert: int, role: Role) -> np.ndarray:
        rng = np.random.default_rng([seed, layer, expert, int(role)])
        if role in BIAS_ROLES:
            return (rng.standard_normal(shapes[role]) * _BIAS_STD).astype(np.float32)
        return random_blocks(expert_type, shapes[role], rng)

    return values


def expert_bytes(config: PretrainedConfig, expert_type: ElementType) -> int:
    """Bytes of every routed expert tensor of `config` in a GGUF with experts of `expert_type`."""
    spec = get_arch(config.model_type)
    shapes = role_shapes(spec.moe_intermediate_size(config), config.hidden_size)
    per_expert = sum(
        tensor_nbytes(ElementType.F32 if role in BIAS_ROLES else expert_type, shapes[role])
        for role in written_roles(config.model_type)
    )
    return len(spec.moe_layers(config)) * spec.num_experts(config) * per_expert
