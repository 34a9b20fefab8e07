"""Dense-tensor rules: how one transformers tensor is stored as GGUF tensor(s), and the transforms
llama.cpp's converter applies that several architectures share (MLA's kv_b split, LLaMA's rope
permutation). Architecture modules (packtools.arch.models) build their rules from these;
packtools.gguf.tensor_map applies them.
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


def identity_out(tensor: torch.Tensor) -> Tensors:
    return (tensor,)


def identity_in(tensors: Tensors) -> torch.Tensor:
    return tensors[0]


def plain_rule(hf_name: str, gguf_name: str) -> DenseRule:
    """A tensor stored under another name, unchanged."""
    return DenseRule(hf_name, (gguf_name,), identity_out, identity_in)


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


def permute_for_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's LlamaModel.permute: each head's rows from [x0..x(d/2), y0..] to interleaved pairs."""
    half = weight.shape[0] // n_head // 2  # rows per head / 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def unpermute_for_llama_rope(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, half, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
