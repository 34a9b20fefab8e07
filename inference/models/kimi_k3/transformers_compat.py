"""The transformers API differences Kimi-K3 meets between 5.17 and 5.25, detected once at import.

pyproject allows transformers >= 5.17: the lent GPU machine's image has 5.17.0, and CI installs the
newest (5.25.0 on 2026-12-03). Between 5.17 and 5.24 transformers renamed the cache everywhere a model
touches it:
- model forwards, `create_causal_mask` / `create_recurrent_attention_mask` and the model output
  dataclasses call it `cache` in 5.24, `past_key_values` in 5.17 (whose `generate` passes and reads
  `past_key_values`);
- 5.24's Cache has `get_conv_state` / `get_recurrent_state` (None before the first update); 5.17 has
  only `has_previous_state(layer_idx, state_idx)` and the layer's `conv_states` / `recurrent_states`.
- 5.25's linear-attention cache layers count their tokens themselves, in update_conv_state; a
  single-token decode that updates the conv state in place must add its token with
  `increase_count(layer_idx, state_idx)` (what 5.25's kimi_linear does), or get_seq_length stays
  at the prefix's length. Before 5.25 there is no such count (and no such method).
(5.24's KimiLinearTopkRouter also creates its weight in float32, 5.17's in the default dtype; that one
needs no detection: KimiK3TopkRouter in moe_kimi_k3 always makes it float32.)
Each difference is detected from the installed API itself (a signature, a dataclass field, an
attribute), not from the version string, so a release in between works with whichever form it has.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable

import torch
from transformers.cache_utils import Cache
from transformers.masking_utils import create_causal_mask
from transformers.modeling_outputs import MoeModelOutputWithPast
from transformers.utils.deprecation import deprecate_kwarg

LEGACY_CACHE_NAME = "past_key_values"
# what the installed transformers' mask functions call the cache argument
MASK_CACHE_NAME = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else LEGACY_CACHE_NAME
# what its model outputs call the cache field (5.17's generate reads `outputs.past_key_values`)
OUTPUT_CACHE_NAME = ("cache" if "cache" in {f.name for f in dataclasses.fields(MoeModelOutputWithPast)}
                     else LEGACY_CACHE_NAME)
CACHE_HAS_STATE_GETTERS = hasattr(Cache, "get_conv_state") and hasattr(Cache, "get_recurrent_state")
CACHE_COUNTS_LINEAR_TOKENS = hasattr(Cache, "increase_count")


def mask_cache_kwargs(cache: Cache | None) -> dict[str, Cache | None]:
    """The cache as the keyword argument of create_causal_mask / create_recurrent_attention_mask."""
    return {MASK_CACHE_NAME: cache}


def output_cache_kwargs(cache: Cache | None) -> dict[str, Cache | None]:
    """The cache as the keyword argument of a model output dataclass."""
    return {OUTPUT_CACHE_NAME: cache}


def cache_of(output) -> Cache | None:
    """The cache a model output carries, under whichever name this transformers gives it."""
    return getattr(output, OUTPUT_CACHE_NAME, None)


def accepts_legacy_cache_name(forward: Callable) -> Callable:
    """Let a forward whose parameter is `cache` also take `past_key_values`.

    5.24: transformers' own deprecation (as its models do), which warns that the old name goes away.
    5.17: `past_key_values` is that version's current name and its generate passes it, so rename it
    silently.
    """
    if OUTPUT_CACHE_NAME == "cache":
        return deprecate_kwarg(LEGACY_CACHE_NAME, "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def forward_taking_past_key_values(*args, **kwargs):
        if LEGACY_CACHE_NAME in kwargs:
            legacy = kwargs.pop(LEGACY_CACHE_NAME)
            if kwargs.get("cache") is not None and legacy is not None:
                raise ValueError("pass the cache as either `cache` or `past_key_values`, not both")
            if legacy is not None:
                kwargs["cache"] = legacy
        return forward(*args, **kwargs)

    return forward_taking_past_key_values


def linear_attention_states(cache: Cache | None, layer_idx: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(conv state, recurrent state) a linear-attention layer continues from; (None, None) before its
    first update (or after a reset), so that a prefill starts from zero states."""
    if cache is None:
        return None, None
    if CACHE_HAS_STATE_GETTERS:
        return cache.get_conv_state(layer_idx, state_idx=0), cache.get_recurrent_state(layer_idx, state_idx=0)
    if not cache.has_previous_state(layer_idx, state_idx=0):
        return None, None
    layer = cache.layers[layer_idx]
    return layer.conv_states[0], layer.recurrent_states[0]


def count_in_place_conv_token(cache: Cache, layer_idx: int) -> None:
    """Record one token a single-token decode added to layer `layer_idx`'s conv state in place
    (transformers >= 5.25 counts a linear-attention layer's tokens; earlier ones need nothing)."""
    if CACHE_COUNTS_LINEAR_TOKENS:
        cache.increase_count(layer_idx, 0)
