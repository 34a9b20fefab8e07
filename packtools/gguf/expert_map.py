"""Routed experts: transformers 5 experts parameters <-> GGUF expert tensors, per role.

GGUF keeps one 3-D tensor per role per layer, expert-major, numpy shape (E, rows, cols):
`blk.N.ffn_gate_exps.weight` [E, I, H], `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]
(some files fuse `ffn_gate_up_exps` [E, 2I, H], gate rows first), and for gpt-oss biases
`ffn_*_exps.bias` [E, I] / [E, H]. transformers 5 keeps `gate_up_proj` [E, 2I, H] (gate rows
first) and `down_proj` [E, H, I]; an architecture whose layout (its ArchSpec) is in_out transposes
both, and an interleaved one alternates gate/up (gpt_oss: `gate_up_proj` [E, H, 2I], gate =
[..., ::2]), which llama.cpp's converter undoes. Expert biases travel with their weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import gguf
import torch

from packformat.constants import Role
from packtools.arch import get_arch

MODEL_TENSOR = gguf.MODEL_TENSOR

# role -> (gguf-py tensor kind, suffix)
EXPERT_TENSORS: dict[Role, tuple[gguf.MODEL_TENSOR, str]] = {
    Role.GATE: (MODEL_TENSOR.FFN_GATE_EXP, ".weight"),
    Role.UP: (MODEL_TENSOR.FFN_UP_EXP, ".weight"),
    Role.DOWN: (MODEL_TENSOR.FFN_DOWN_EXP, ".weight"),
    Role.GATE_UP: (MODEL_TENSOR.FFN_GATE_UP_EXP, ".weight"),
    Role.GATE_BIAS: (MODEL_TENSOR.FFN_GATE_EXP, ".bias"),
    Role.UP_BIAS: (MODEL_TENSOR.FFN_UP_EXP, ".bias"),
    Role.DOWN_BIAS: (MODEL_TENSOR.FFN_DOWN_EXP, ".bias"),
    Role.GATE_UP_BIAS: (MODEL_TENSOR.FFN_GATE_UP_EXP, ".bias"),
}
BIAS_ROLES = frozenset({Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS, Role.GATE_UP_BIAS})
# the order roles take inside an object: weights (gate, up | fused), down, then their biases
ROLE_ORDER = (
    Role.GATE, Role.UP, Role.GATE_UP, Role.DOWN, Role.GATE_BIAS, Role.UP_BIAS, Role.GATE_UP_BIAS, Role.DOWN_BIAS
)

_SWIGLU_ROLES = (Role.GATE, Role.UP, Role.DOWN)
_SWIGLU_BIAS_ROLES = (Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS)


def expert_tensor_name(role: Role, layer: int) -> str:
    kind, suffix = EXPERT_TENSORS[role]
    return gguf.TENSOR_NAMES[kind].format(bid=layer) + suffix


def role_shapes(inter: int, hidden: int) -> dict[Role, tuple[int, ...]]:
    """Per-expert logical shape (numpy order, last dim contiguous) of every role, expert width `inter`."""
    return {
        Role.GATE: (inter, hidden), Role.UP: (inter, hidden), Role.GATE_UP: (2 * inter, hidden),
        Role.DOWN: (hidden, inter), Role.GATE_BIAS: (inter,), Role.UP_BIAS: (inter,),
        Role.GATE_UP_BIAS: (2 * inter,), Role.DOWN_BIAS: (hidden,),
    }


def written_roles(model_type: str) -> tuple[Role, ...]:
    """The roles llama.cpp's converter writes for this architecture (gate and up separate, then
    their biases where the architecture's experts have biases)."""
    has_biases = not BIAS_ROLES.isdisjoint(get_arch(model_type).layout.roles)
    return _SWIGLU_ROLES + (_SWIGLU_BIAS_ROLES if has_biases else ())


def _split_gate_up(fused: torch.Tensor, gate_up: str, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    if gate_up == "interleaved":  # gate, up, gate, up, ... along `dim`
        index = [slice(None)] * fused.dim()
        gate, up = list(index), list(index)
        gate[dim], up[dim] = slice(0, None, 2), slice(1, None, 2)
        return fused[tuple(gate)], fused[tuple(up)]
    return fused.chunk(2, dim=dim)  # concat: gate first


def _fuse_gate_up(gate: torch.Tensor, up: torch.Tensor, gate_up: str, dim: int) -> torch.Tensor:
    if gate_up == "interleaved":
        return torch.stack([gate, up], dim=dim + 1).flatten(dim, dim + 1)
    return torch.cat([gate, up], dim=dim)


def hf_expert_roles(model_type: str, params: Mapping[str, torch.Tensor], expert: int) -> dict[Role, torch.Tensor]:
    """One expert's roles in GGUF orientation (GATE/UP [I, H], DOWN [H, I]) from the transformers
    experts parameters of its layer (`gate_up_proj`, `down_proj`, and their biases if any)."""
    layout = get_arch(model_type).layout
    gate_up, down = params["gate_up_proj"][expert], params["down_proj"][expert]
    if layout.orientation == "in_out":
        gate_up, down = gate_up.transpose(0, 1), down.transpose(0, 1)  # [H, 2I] -> [2I, H], [I, H] -> [H, I]
    gate, up = _split_gate_up(gate_up, layout.gate_up, dim=0)
    roles = {Role.GATE: gate, Role.UP: up, Role.DOWN: down}
    if "gate_up_proj_bias" in params:
        roles[Role.GATE_BIAS], roles[Role.UP_BIAS] = _split_gate_up(params["gate_up_proj_bias"][expert],
                                                                    layout.gate_up, dim=0)
        roles[Role.DOWN_BIAS] = params["down_proj_bias"][expert]
    return roles


def hf_expert_params(model_type: str, roles: Mapping[Role, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers experts parameters of a layer from role tensors stacked over experts
    ([E, I, H] etc.); the inverse of hf_expert_roles. A fused GATE_UP role is accepted too."""
    layout = get_arch(model_type).layout
    if Role.GATE_UP in roles:
        gate, up = roles[Role.GATE_UP].chunk(2, dim=1)  # [E, 2I, H], gate rows first
    else:
        gate, up = roles[Role.GATE], roles[Role.UP]
    gate_up, down = _fuse_gate_up(gate, up, layout.gate_up, dim=1), roles[Role.DOWN]
    if layout.orientation == "in_out":
        gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
    params = {"gate_up_proj": gate_up, "down_proj": down}
    if Role.GATE_UP_BIAS in roles:
        gate_bias, up_bias = roles[Role.GATE_UP_BIAS].chunk(2, dim=1)
    elif Role.GATE_BIAS in roles:
        gate_bias, up_bias = roles[Role.GATE_BIAS], roles[Role.UP_BIAS]
    else:
        return params
    params["gate_up_proj_bias"] = _fuse_gate_up(gate_bias, up_bias, layout.gate_up, dim=1)
    params["down_proj_bias"] = roles[Role.DOWN_BIAS]
    return params
