"""How one transformers tensor is stored in GGUF (DenseRule), and the transforms rules share.

tensor_map builds the rules of the archs gguf-py knows; the modules of the archs it lacks
(deepseek4, kimi_k3_tensors) build theirs from these same parts.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from transformers import PretrainedConfig

Tensors = tuple[torch.Tensor, ...]


@dataclasses.dataclass(frozen=True)
class DenseRule:
    """How one transformers tensor is stored in GGUF: as `gguf_names`, via `to_gguf`/`from_gguf`."""

    hf_name: str
    gguf_names: tuple[str, ...]
    to_gguf: Callable[[torch.Tensor], Tensors]
    from_gguf: Callable[[Tensors], torch.Tensor]
    # what older files hold instead (reading only): e.g. attn_kv_b from before llama.cpp split it
    fallback: DenseRule | None = None


def kv_b_split_join(config: PretrainedConfig) -> tuple[Callable[[torch.Tensor], Tensors],
                                                      Callable[[Tensors], torch.Tensor]]:
    """MLA's kv_b_proj <-> llama.cpp's (attn_k_b, attn_v_b): the converter splits it per head and
    transposes k_b for weight absorption."""
    n_head = config.num_attention_heads
    nope, v_dim = config.qk_nope_head_dim, config.v_head_dim

    def split(kv_b: torch.Tensor) -> Tensors:  # [n_head*(nope+v), kv_lora]
        per_head = kv_b.reshape(n_head, nope + v_dim, kv_b.shape[-1])
        k_b, v_b = torch.split(per_head, [nope, v_dim], dim=1)
        return k_b.transpose(1, 2).contiguous(), v_b.contiguous()  # [n_head, kv_lora, nope], [n_head, v, kv_lora]

    def join(tensors: Tensors) -> torch.Tensor:
        k_b, v_b = tensors
        per_head = torch.cat([k_b.transpose(1, 2), v_b.to(k_b.dtype)], dim=1)  # [n_head, nope+v, kv_lora]
        return per_head.reshape(n_head * (nope + v_dim), per_head.shape[-1])

    return split, join


def identity_out(tensor: torch.Tensor) -> Tensors:
    return (tensor,)


def identity_in(tensors: Tensors) -> torch.Tensor:
    return tensors[0]
