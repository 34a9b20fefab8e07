"""bench/e2e/generation.py's token picker: the one way the timed loops and the profiler pick tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # bench/ is a directory of scripts

from bench.e2e.generation import token_picker  # noqa: E402

CPU = torch.device("cpu")


def test_greedy_picks_the_argmax():
    logits = torch.tensor([0.5, 3.0, -1.0, 2.9])
    assert token_picker(CPU, None)(logits) == 1


def test_sampling_draws_at_temperature_one_from_the_seeded_stream():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(0)) * 2
    picks = token_picker(CPU, 1234)
    got = [picks(logits) for _ in range(20)]
    generator = torch.Generator().manual_seed(1234)
    expected = [int(torch.multinomial(torch.softmax(logits.float(), -1), 1, generator=generator)) for _ in range(20)]
    assert got == expected
    assert len(set(got)) > 1  # a draw, not the argmax
    again = token_picker(CPU, 1234)
    assert [again(logits) for _ in range(20)] == got  # the same seed, the same draws
