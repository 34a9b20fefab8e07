"""What a request asks of the engine (SamplingParams), checked when built, and what it gets back."""

from __future__ import annotations

import dataclasses
import math
import numbers

from inference.engine.errors import InvalidRequestError

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 is greedy (argmax; top_p and seed are then irrelevant). Otherwise logits are
    divided by temperature and sampled from the smallest set of most likely tokens whose mass
    reaches top_p, with a torch.Generator seeded from `seed` (None: a fresh random seed), so a
    request repeated with the same seed yields the same tokens.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self):
        if not _is_int(self.max_tokens):
            raise InvalidRequestError(f"max_tokens must be an integer, got {self.max_tokens!r}", param="max_tokens")
        if self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be at least 1, got {self.max_tokens}", param="max_tokens")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            raise InvalidRequestError(f"temperature must be a number in [0, {MAX_TEMPERATURE:g}], "
                                      f"got {self.temperature!r}", param="temperature")
        if not _is_number(self.top_p) or math.isnan(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be a number in (0, 1], got {self.top_p!r}", param="top_p")
        if self.seed is not None and not _is_int(self.seed):
            raise InvalidRequestError(f"seed must be an integer, got {self.seed!r}", param="seed")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            raise InvalidRequestError(f"stop must be non-empty strings, got {self.stop!r}", param="stop")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def generator_seed(self) -> int | None:
        """The seed as torch.Generator.manual_seed takes it (any integer maps into [0, 2**64))."""
        return None if self.seed is None else int(self.seed) % SEED_MODULUS


@dataclasses.dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def as_dict(self) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.total_tokens}


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New text, safe to show: complete characters, none of it possibly the start of a stop string."""

    text: str


@dataclasses.dataclass(frozen=True)
class Finished:
    """The request's end: finish_reason is "stop" (EOS or a stop string) or "length" (max_tokens)."""

    finish_reason: str
    text: str  # the whole completion, truncated before the stop string if one matched
    usage: Usage
    token_ids: tuple[int, ...]  # every sampled token, EOS included when it ended the request
    time_to_first_token: float  # seconds from submission to the first sampled token
    generation_seconds: float  # seconds spent generating (prefill and decode, queue wait excluded)


GenerationEvent = TextDelta | Finished
