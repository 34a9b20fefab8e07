"""DeepSeek-V4's lightning indexer next to llama.cpp's: its recorded choices, replayed in our model,
and our own per-query scores, to check that llama.cpp's choice is a top-k of them up to ties.

The golden case deepseek_v4-MXFP4-topk8 records llama.cpp's "lid_top_k-<layer>" nodes
(scripts/llamacpp_golden.py): int32 [layers, positions, index_topk], row p = the compressed entries
the query at position p attends. Both sides score entry s for query t as
sum_h w_th relu(q_th . k_s) and pick the index_topk largest; they differ only in which of several
equal (or, after llama.cpp's BF16/Q8_0 activation rounding, nearly equal) scores they keep.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from transformers.models.deepseek_v4 import modeling_deepseek_v4


def recorded_choices(record: dict, golden_dir: Path) -> dict[int, torch.Tensor]:
    """layer -> llama.cpp's choices, int64 [positions, index_topk]."""
    recorded = record["indexer_top_k"]
    choices = np.load(golden_dir / recorded["choices"])  # [layers, positions, k] int32
    return {layer: torch.from_numpy(choices[i].astype(np.int64)) for i, layer in enumerate(recorded["layers"])}


@contextlib.contextmanager
def indexer_choices_as_in_llamacpp(record: dict, golden_dir: Path) -> Iterator[None]:
    """Every DeepseekV4Indexer returns llama.cpp's recorded choice for its layer and query positions
    instead of torch.topk's. Our indexer still runs first: its compressor state lives in the cache."""
    choices = recorded_choices(record, golden_dir)
    ours = modeling_deepseek_v4.DeepseekV4Indexer.forward

    def forward(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        ours(self, hidden_states, q_residual, position_ids, cache, layer_idx)
        picked = choices[layer_idx].to(position_ids.device)[position_ids]  # [B, S, k]
        # llama.cpp's early queries pick -inf-scored entries they cannot see (it masks them after the
        # top-k); transformers' convention for those is the -1 sentinel
        visible = (position_ids + 1) // self.compress_rate  # [B, S] entries a query can see
        return torch.where(picked >= visible.unsqueeze(-1), -1, picked)

    modeling_deepseek_v4.DeepseekV4Indexer.forward = forward
    try:
        yield
    finally:
        modeling_deepseek_v4.DeepseekV4Indexer.forward = ours


@torch.no_grad()
def our_indexer_scores(model: torch.nn.Module, ids: torch.Tensor) -> dict[int, np.ndarray]:
    """layer -> our index scores of one forward over `ids` [1, S]: float32 [S, entries], -inf where
    the entry is not visible to the query (the scorer's output before transformers masks it)."""
    indexer_cls, scorer_cls = modeling_deepseek_v4.DeepseekV4Indexer, modeling_deepseek_v4.DeepseekV4IndexerScorer
    indexer_forward, scorer_forward = indexer_cls.forward, scorer_cls.forward
    current_layer: list[int] = []
    scores: dict[int, np.ndarray] = {}

    def indexer(self, hidden_states, q_residual, position_ids, cache, layer_idx):
        current_layer[:] = [layer_idx]
        return indexer_forward(self, hidden_states, q_residual, position_ids, cache, layer_idx)

    def scorer(self, q, compressed_kv, hidden_states):
        out = scorer_forward(self, q, compressed_kv, hidden_states)  # [B, S, T]
        scores[current_layer[0]] = out[0].float().numpy().copy()
        return out

    indexer_cls.forward, scorer_cls.forward = indexer, scorer
    try:
        model(ids)
    finally:
        indexer_cls.forward, scorer_cls.forward = indexer_forward, scorer_forward
    for row in scores.values():
        positions = np.arange(row.shape[0])[:, None]
        ratio = model.config.compress_rates["compressed_sparse_attention"]
        row[np.arange(row.shape[1])[None, :] >= (positions + 1) // ratio] = -np.inf
    return scores


def tie_gap(scores: np.ndarray, chosen: np.ndarray) -> float:
    """How far `chosen` (entry ids) is from being a top-len(chosen) of `scores` [entries] (-inf =
    invisible), relative to the row's largest |score|: 0 when it is one (ties broken either way)."""
    visible = np.isfinite(scores)
    unchosen = visible.copy()
    unchosen[chosen] = False
    if not unchosen.any():
        return 0.0
    gap = scores[unchosen].max() - scores[chosen].min()
    return float(max(gap, 0.0) / np.abs(scores[visible]).max())
