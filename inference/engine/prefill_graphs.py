"""The prefill of a StaticDecoder through the slot map, a CUDA graph per padded length.

The prefill runs as a decode step does (inference.engine.decode_graph): the prompt padded to a
power of two (at least PREFILL_MIN_BUCKET tokens, at most PREFILL_MAX_BUCKET and the cache), one
CUDA graph per such length, captured on first use; the padding's keys lie past the prompt, where
the mask hides them until decode steps overwrite them, and the logits are taken at the last
prompt token. A prefill that met an absent expert runs again eagerly on the acquire path.
Without it, a prefill would be bound by the host: a few hundred eager launches per layer's worth
of Python.

These are StaticDecoder's methods, kept apart: PrefillGraphs is a mixin of it and uses its cache,
fence, lookups and graph capture.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from inference.engine.static_cache import set_lengths
from inference.experts.host_reads import host_tier_pairs

log = logging.getLogger(__name__)
PREFILL_MIN_BUCKET = 16  # shortest padded prefill (tokens): fewer graphs for short prompts
PREFILL_MAX_BUCKET = 1024  # longer prompts prefill eagerly


def prefill_bucket(count: int, max_len: int) -> int | None:
    """The padded length a prompt of `count` tokens prefills at through a graph, or None (eager)."""
    bucket = max(PREFILL_MIN_BUCKET, 1 << (count - 1).bit_length())
    return bucket if bucket <= min(max_len, PREFILL_MAX_BUCKET) else None


@dataclasses.dataclass
class PaddedPrefill:
    """The static inputs of one padded prefill length, and its graph once captured."""

    ids: torch.Tensor  # [1, B] the prompt, then padding
    positions: torch.Tensor  # [1, B]
    mask: torch.Tensor  # [1, 1, B, L] causal over the cache
    last: torch.Tensor  # [1] index of the last prompt token: the logits kept
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None


class PrefillGraphs:
    """StaticDecoder's prefills through the slot map (its `_prefills`, one PaddedPrefill a bucket)."""

    def _lookup_prefill(self, prompt_ids: list[int]) -> torch.Tensor | None:
        """The prefill padded to its bucket through the slot map (its graph, captured on first
        use); None when the prompt has no bucket or an expert was absent (cache left dirty)."""
        count = len(prompt_ids)
        bucket = prefill_bucket(count, self.max_len)
        if bucket is None or not self._every_expert_resident(bucket):
            return None
        prefill = self._prefills.get(bucket)
        if prefill is None:
            prefill = self._prefills[bucket] = self._new_prefill(bucket)
        padded = torch.zeros((1, bucket), dtype=torch.long)  # [1, B] padding: token 0
        padded[0, :count] = torch.tensor(prompt_ids, dtype=torch.long)
        prefill.ids.copy_(padded)
        prefill.last.fill_(count - 1)
        if prefill.graph is not None:
            logits = self._fenced(prefill.graph.replay, lambda: prefill.logits)
        else:
            logits = self._fenced(None, lambda: self._prefill_call(prefill))
        if logits is None:
            self.redone_prefills += 1
            return None
        set_lengths(self.cache, count)  # the padding's keys stay past the length, masked, then overwritten
        self.lookup_prefills += 1
        return logits

    def _every_expert_resident(self, tokens: int) -> bool:
        """Whether the slot map holds every expert of the model now (with the host tier's, when a
        prefill of `tokens` reads them in place): a prompt routes to most of a layer's experts, so
        short of that the optimistic prefill would mostly be thrown away."""
        lookup = self.source.device_lookup()
        if lookup is None:
            return False
        slot_map, host = lookup[0], lookup[5]
        top_k = getattr(self.model.config, "num_experts_per_tok", None)
        pairs = min((host_tier_pairs(b) for b in self.bindings.values()), default=0)
        if host is not None and top_k is not None and tokens * top_k <= pairs:
            slot_map = host.merge(slot_map)
        return bool((slot_map >= 0).all())

    def _new_prefill(self, bucket: int) -> PaddedPrefill:
        positions = torch.arange(bucket, device=self.device).view(1, bucket)
        prefill = PaddedPrefill(torch.zeros((1, bucket), dtype=torch.long, device=self.device), positions,
                                self._kv_index <= positions.view(1, 1, bucket, 1),
                                torch.zeros(1, dtype=torch.long, device=self.device))
        if self.capture:
            prefill.graph, prefill.logits = self._capture_graph(lambda: self._prefill_call(prefill))
            log.info("prefill of %d tokens captured as a CUDA graph", bucket)
        return prefill

    def _prefill_call(self, prefill: PaddedPrefill) -> torch.Tensor:
        self.misses.zero_()
        self._merge_maps()
        out = self.model(input_ids=prefill.ids, position_ids=prefill.positions, attention_mask=prefill.mask,
                         use_cache=True, logits_to_keep=prefill.last, **{self.cache_keyword: self.cache})
        return out.logits[0, -1]  # [V]
