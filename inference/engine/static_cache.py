"""Resetting a StaticCache in a launch or two rather than three a layer.

transformers' `Cache.reset` zeroes each layer's keys, values and length one tensor at a time:
36 launches for 12 layers before every prefill, while the GPU waits (about 1 ms of host time in
bench/layer_profile.py's host profile of a 64-token graph prefill, whose device time is 11.8 ms on
an H100; the profiler inflates small calls, so the saving is to be timed). The same tensors
zeroed by one `torch._foreach_zero_` (one launch per dtype) leave the same state. A layer whose
class resets otherwise (sliding windows, linear attention, indexers) keeps its own `reset`.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


def _plain_static(layer) -> bool:
    """Whether the layer's reset is the mixin's (zero keys and values, zero a length tensor)."""
    return type(layer).reset is CacheLayerMixin.reset and isinstance(getattr(layer, "cumulative_length", None),
                                                                     torch.Tensor)


def reset_cache(cache: Cache) -> None:
    """cache.reset(), the plain static layers' tensors zeroed together."""
    if type(cache).reset is not Cache.reset:  # a cache that resets more than its layers
        cache.reset()
        return
    tensors = []
    for layer in cache.layers:
        if not _plain_static(layer):
            layer.reset()
            continue
        if layer.is_initialized:
            tensors += [layer.keys, layer.values]
        tensors.append(layer.cumulative_length)
    if tensors:
        torch._foreach_zero_(tensors)


def set_lengths(cache: Cache, count: int) -> None:
    """Every layer's length tensor to `count` (after a prefill), in two launches rather than one a layer."""
    lengths = [layer.cumulative_length for layer in cache.layers]
    torch._foreach_zero_(lengths)
    torch._foreach_add_(lengths, count)
