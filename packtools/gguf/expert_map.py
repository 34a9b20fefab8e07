"""Routed experts: transformers 5 experts parameters <-> GGUF expert tensors, per role.

GGUF keeps one 3-D tensor per role per layer, expert-major, numpy shape (E, rows, cols):
`blk.N.ffn_gate_exps.weight` [E, I, H], `ffn_up_exps` [E, I, H], `ffn_down_exps` [E, H, I]
(some files fuse `ffn_gate_up_exps` [E, 2I, H], gate rows first), and for gpt-oss biases
`ffn_*_exps.bias` [E, I] / [E, H]. transformers 5 keeps `gate_up_proj` [E, 2I, H] (gate rows
first) and `down_proj` [E, H, I]; gpt_oss transposes both and interleaves gate/up columns
(`gate_up_proj` [E, H, 2I], gate = [..., ::2]), which llama.cpp's converter undoes.
"""

from __future__ import annotations

from collections.abc import Mapping

import gguf
import torch

from packformat.constants import Role

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
_GPT_OSS_ROLES = (Role.GATE, Role.UP, Role.DOWN, Role.GATE_BIAS, Role.UP_BIAS, Role.DOWN_BIAS)


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
    """The roles llama.cpp's converter writes for this architecture (gate and up separate)."""
    return _GPT_OSS_ROLES if model_type == "gpt_oss" else _SWIGLU_ROLES


def hf_expert_roles(model_type: str, params: Mapping[str, torch.Tensor], expert: int) -> dict[Role, torch.Tensor]:
    """One expert's roles in GGUF orientation (GATE/UP [I, H], DOWN [H, I]) from the transformers
    experts parameters of its layer (`gate_up_proj`, `down_proj`, gpt_oss biases)."""
    gate_up, down = params["gate_up_proj"][expert], params["down_proj"][expert]
    if model_type != "gpt_oss":
        inter = gate_up.shape[0] // 2  # gate_up [2I, H]
        return {Role.GATE: gate_up[:inter], Role.UP: gate_up[inter:], Role.DOWN: down}
    gate_up = gate_up.transpose(0, 1)  # [H, 2I] -> [2I, H], rows interleaved gate, up, gate, ...
    gate_up_bias = params["gate_up_proj_bias"][expert]  # [2I]
    return {
        Role.GATE: gate_up[0::2],
        Role.UP: gate_up[1::2],
        Role.DOWN: down.transpose(0, 1),  # [I, H] -> [H, I]
        Role.GATE_BIAS: gate_up_bias[0::2],
        Role.UP_BIAS: gate_up_bias[1::2],
        Role.DOWN_BIAS: params["down_proj_bias"][expert],
    }


def hf_expert_params(model_type: str, roles: Mapping[Role, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers experts parameters of a layer from role tensors stacked over experts
    ([E, I, H] etc.); the inverse of hf_expert_roles. A fused GATE_UP role is accepted too."""
    if Role.GATE_UP in roles:
        gate, up = roles[Role.GATE_UP].chunk(2, dim=1)  # [E, 2I, H], gate rows first
    else:
        gate, up = roles[Role.GATE], roles[Role.UP]
    down = roles[Role.DOWN]
    if model_type != "gpt_oss":
        return {"gate_up_proj": torch.cat([gate, up], dim=1), "down_proj": down}
    if Role.GATE_UP_BIAS in roles:
        gate_bias, up_bias = roles[Role.GATE_UP_BIAS].chunk(2, dim=1)
    else:
        gate_bias, up_bias = roles[Role.GATE_BIAS], roles[Role.UP_BIAS]
    interleaved = torch.stack([gate, up], dim=2).flatten(1, 2)  # [E, 2I, H], rows gate, up, gate, ...
    return {
        "gate_up_proj": interleaved.transpose(1, 2).contiguous(),  # [E, H, 2I]
        "gate_up_proj_bias": torch.stack([gate_bias, up_bias], dim=2).flatten(1, 2),  # [E, 2I]
        "down_proj": down.transpose(1, 2).contiguous(),  # [E, H, I] -> [E, I, H]
        "down_proj_bias": roles[Role.DOWN_BIAS],
    }
