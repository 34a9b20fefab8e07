"""Next-token choice: greedy, or temperature + nucleus (top_p) sampling from a seeded generator."""

from __future__ import annotations

import torch

from inference.engine.params import SamplingParams


def request_generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """The request's own random stream (None when greedy): same seed, same draws, whatever ran before."""
    if params.greedy:
        return None
    generator = torch.Generator(device=device)
    if params.generator_seed is None:
        generator.seed()  # a fresh non-deterministic seed
    else:
        generator.manual_seed(params.generator_seed)
    return generator


def nucleus_probabilities(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """[V] probabilities of softmax(logits / temperature) restricted to the top_p nucleus, renormalized.

    The nucleus is the smallest set of most likely tokens whose mass reaches top_p: a token is kept
    when the mass of the tokens ranked above it is still below top_p, so the top token always is.
    Ties are ranked by token id (stable sort), which keeps the set deterministic.
    """
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # [V] float32
    if top_p >= 1.0:
        return probs
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)  # [V], [V]
    mass_above = torch.cumsum(sorted_probs, dim=-1) - sorted_probs  # [V] mass ranked strictly above
    kept = torch.where(mass_above < top_p, sorted_probs, torch.zeros_like(sorted_probs))
    nucleus = torch.zeros_like(probs).scatter_(-1, order, kept)  # back to token order, [V]
    return nucleus / nucleus.sum()


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id from the last position's logits [V]."""
    if params.greedy:
        return int(torch.argmax(logits))
    probs = nucleus_probabilities(logits, params.temperature, params.top_p)
    return int(torch.multinomial(probs, 1, generator=generator))
