"""What a request asks of the engine (SamplingParams), checked when built, and what it gets back."""

from __future__ import annotations

import dataclasses
import math
import numbers

from inference.engine.errors import InvalidRequestError
from servicekit.echo import shown

MAX_TEMPERATURE = 2.0  # OpenAI's range is [0, 2]
MAX_PENALTY = 2.0  # OpenAI's presence/frequency penalties are in [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's logit_bias values are in [-100, 100]
MAX_LOGPROBS = 20  # OpenAI's top_logprobs is at most 20 (vLLM's default max_logprobs too)
SEED_MODULUS = 2**64  # torch.Generator.manual_seed takes an unsigned 64-bit seed


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value)


def _refuse(param: str, message: str):
    raise InvalidRequestError(f"{param} {message}", param=param)


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop; vLLM's semantics, in vLLM's order.

    Each step: logit_bias is added and, before min_tokens tokens, the stop token ids are masked;
    then the penalties: repetition_penalty (multiplicative, over prompt and generated tokens),
    frequency_penalty (minus penalty x count) and presence_penalty (minus penalty once), both over
    generated tokens only, as OpenAI defines them. temperature 0 then takes the argmax. Otherwise
    logits are divided by temperature, tokens under min_p x the top token's probability are
    dropped, then all but the top_k, then all outside the top_p nucleus, and one token is drawn
    with a torch.Generator seeded from `seed` (None: a fresh random seed).

    With a `grammar`, every token it does not allow next is masked before any of that (the output
    matches it), and the choice ends once the grammar is complete.

    Defaults switch every step off. `logprobs` None returns none; k >= 0 returns each sampled
    token's log-probability and the k most likely ones, from the model's raw distribution.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off (-1 is accepted for off, as vLLM does, and stored as 0)
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), sorted by id
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: str | None = None  # llguidance's grammar text (inference.engine.constraints) the output must match

    def __post_init__(self):
        if not _is_int(self.max_tokens):
            _refuse("max_tokens", f"must be an integer, got {shown(self.max_tokens)}")
        if self.max_tokens < 1:
            _refuse("max_tokens", f"must be at least 1, got {self.max_tokens}")
        if not _is_number(self.temperature) or not 0.0 <= self.temperature <= MAX_TEMPERATURE:
            _refuse("temperature", f"must be a number in [0, {MAX_TEMPERATURE:g}], got {shown(self.temperature)}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            _refuse("top_p", f"must be a number in (0, 1], got {shown(self.top_p)}")
        if not _is_int(self.top_k) or self.top_k < -1:
            _refuse("top_k", f"must be an integer, -1 or 0 for off, got {shown(self.top_k)}")
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            _refuse("min_p", f"must be a number in [0, 1], got {shown(self.min_p)}")
        if not _is_number(self.repetition_penalty) or not 0.0 < self.repetition_penalty < math.inf:
            _refuse("repetition_penalty", f"must be a number above 0 (1 is off), got {shown(self.repetition_penalty)}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                _refuse(name, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {shown(value)}")
        self._check_logit_bias()
        if self.seed is not None and not _is_int(self.seed):
            _refuse("seed", f"must be an integer, got {shown(self.seed)}")
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) and s for s in self.stop):
            _refuse("stop", f"must be non-empty strings, got {shown(self.stop)}")
        if not isinstance(self.stop_token_ids, tuple) or not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            _refuse("stop_token_ids", f"must be token ids, got {shown(self.stop_token_ids)}")
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                _refuse(name, f"must be a boolean, got {shown(getattr(self, name))}")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            _refuse("min_tokens",
                    f"must be an integer in [0, max_tokens={self.max_tokens}], got {shown(self.min_tokens)}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            _refuse("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {shown(self.logprobs)}")
        if self.grammar is not None and (not isinstance(self.grammar, str) or not self.grammar):
            _refuse("response_format", f"grammar must be llguidance's grammar text, got {shown(self.grammar)}")
        if self.grammar is not None and self.min_tokens:
            # the grammar may allow nothing but an end token while min_tokens masks them all
            _refuse("min_tokens", "cannot be combined with structured output (response_format, tool_choice)")

    def _check_logit_bias(self) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or not all(isinstance(p, tuple) and len(p) == 2 for p in bias):
            _refuse("logit_bias", f"must be (token id, bias) pairs, got {shown(bias)}")
        for token, value in bias:
            if not _is_int(token) or token < 0:
                _refuse("logit_bias", f"keys must be token ids, got {shown(token)}")
            if not _is_number(value) or not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
                _refuse("logit_bias", f"values must be numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                                      f"got {shown(value)} for token {token}")
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(v)) for t, v in bias)))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def generator_seed(self) -> int | None:
        """The seed as torch.Generator.manual_seed takes it (any integer maps into [0, 2**64))."""
        return None if self.seed is None else int(self.seed) % SEED_MODULUS

    def for_choice(self, index: int) -> SamplingParams:
        """The parameters of choice `index` of n: seed + index, as vLLM seeds its n samples."""
        if index == 0 or self.seed is None:
            return self
        return dataclasses.replace(self, seed=self.seed + index)

    def token_ids(self) -> tuple[int, ...]:
        """Every token id the parameters name (checked against the vocabulary by the runner)."""
        return tuple(t for t, _ in self.logit_bias) + self.stop_token_ids


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
class TokenLogprob:
    """One sampled token's log-probability and the `top` most likely (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclasses.dataclass(frozen=True)
class TextDelta:
    """New text, safe to show: complete characters, none of it possibly the start of a stop string.

    `logprobs` covers the tokens sampled since the previous delta of the same choice (empty unless
    asked for); `completion_tokens` counts the choice's tokens so far.
    """

    text: str
    index: int = 0  # the choice (n > 1, or several prompts) it belongs to
    logprobs: tuple[TokenLogprob, ...] = ()
    completion_tokens: int = 0


@dataclasses.dataclass(frozen=True)
class Finished:
    """A choice's end: finish_reason is "stop" (EOS, a stop token id or a stop string), "length"
    (max_tokens) or "cancelled"."""

    finish_reason: str
    text: str  # the whole completion, truncated before the stop string if one matched
    usage: Usage
    token_ids: tuple[int, ...]  # every sampled token, EOS included when it ended the request
    time_to_first_token: float | None  # seconds from submission to the first sampled token
    generation_seconds: float  # seconds spent generating (prefill and decode, queue wait excluded)
    index: int = 0
    logprobs: tuple[TokenLogprob, ...] | None = None  # one per sampled token when asked for
    inter_token_seconds: tuple[float, ...] = ()  # gaps between consecutive sampled tokens


GenerationEvent = TextDelta | Finished
