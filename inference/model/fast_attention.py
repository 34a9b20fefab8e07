"""transformers' SDPA attention with the one-query kernel for decode steps.

Models whose attention goes through transformers' AttentionInterface as "sdpa" are switched to
DECODE_OR_SDPA: a call with one query token over a cache (what inference.kernels.dense_ops'
attention_fits accepts, with no dropout, soft cap, position bias or attention sinks) runs
inference.kernels.decode_attention; every other call runs transformers' own
sdpa_attention_forward, and masks are built by transformers' sdpa_mask, as before. The split
softmax sums in another order than torch's kernels: outputs agree to bfloat16 rounding, not
bit for bit. Only for the fused (GPU) path: the exact path keeps eager's kernels.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from inference.kernels import dense_ops
from inference.kernels.ops import triton_module

DECODE_OR_SDPA = "expertpack_decode_sdpa"
# keyword arguments that change what attention computes and that the kernel does not implement
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks", "output_attentions")


def decode_or_sdpa_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                             is_causal: bool | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    if (dropout == 0.0 and not any(kwargs.get(name) is not None and kwargs.get(name) is not False
                                   for name in _UNSUPPORTED)
            and not (torch.is_grad_enabled() and query.requires_grad)
            and dense_ops.attention_fits(query, key, value, attention_mask)):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return dense_ops.attention(query, key, value, attention_mask, scale), None
    return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)


def use_decode_attention(model: torch.nn.Module) -> int:
    """Switch every config of the model that attends through "sdpa" to DECODE_OR_SDPA; returns
    how many configs changed (0: triton is missing or nothing used SDPA)."""
    if triton_module() is None:
        return 0
    AttentionInterface.register(DECODE_OR_SDPA, decode_or_sdpa_attention)
    AttentionMaskInterface.register(DECODE_OR_SDPA, sdpa_mask)
    configs, seen = [], set()
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            configs.append(config)
    changed = 0
    for config in configs:
        if getattr(config, "_attn_implementation", None) == "sdpa":
            config._attn_implementation_internal = DECODE_OR_SDPA
            changed += 1
    return changed
