"""Next-token choice for one request, pure torch: logit processors in vLLM's order, then greedy or
seeded sampling, and the raw log-probabilities when asked for.

transformers' processors are used where their semantics are vLLM's and OpenAI's: repetition
penalty (multiplicative, over prompt and generated tokens), top-k (ties at the k-th value kept) and
min-p. OpenAI's presence and frequency penalties (additive, generated tokens only) and logit_bias
have no transformers counterpart and are a line each here.

A step is two halves: `pick` draws the token on the device and queues its copy to the host
without waiting, so a decoder may launch its next step on the drawn token (still on the device)
before anyone reads it; `accept` reads it and moves the request's state on; `discard` forgets a
pick whose logits turned out void (the generator rewound: the redrawn token is the same draw).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
)

from inference.engine.params import SamplingParams, TokenLogprob

if TYPE_CHECKING:
    from inference.engine.constraints import TokenConstraint


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


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """One token drawn from probabilities [V] as torch.multinomial(probs, 1) draws it (the same
    exponential draws from the generator, the same argmax: the same token), without its two host
    syncs, which check the distribution. [1] int64, and [1] bool: whether probs was a
    distribution (finite, non-negative, a positive sum), for the caller to check once it reads
    the token (DrawError)."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)  # [V] ~ Exp(1)
    token = torch.argmax(probs / q).view(1)  # argmax p / q: a draw from p (the Gumbel-max trick)
    valid = ((probs.max() < math.inf) & (probs.min() >= 0) & (probs.sum() > 0)).view(1)
    return token, valid


class DrawError(RuntimeError):
    """Sampling met probabilities that are no distribution (the model's logits held inf or NaN)."""


def pick_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[1] int64 on logits' device: the next token from the last position's logits [V], with
    temperature and top_p only, and draw()'s validity flag (None when greedy); no host sync."""
    if params.greedy:
        return torch.argmax(logits).view(1), None
    return draw(nucleus_probabilities(logits, params.temperature, params.top_p), generator)


def _checked(valid: torch.Tensor | None) -> None:
    if valid is not None and not bool(valid[0]):
        raise DrawError("probability tensor contains either `inf`, `nan` or element < 0, or sums to 0")


def next_token(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The next token id from the last position's logits [V], with temperature and top_p only."""
    token, valid = pick_token(logits, params, generator)
    _checked(valid)
    return int(token)


@dataclasses.dataclass
class PickedToken:
    """A token drawn on the device, not read yet (TokenSampler.pick)."""

    token: torch.Tensor  # [1] int64 on the device: a decode step may take it as its input
    host: torch.Tensor  # [1] int64 on the CPU, filled asynchronously on CUDA (pinned)
    logprobs: tuple[torch.Tensor, ...] | None  # CPU: chosen [1] float32, then top values [k], top ids [k]
    valid: torch.Tensor | None  # [1] bool on the CPU: the draw's distribution was one (None: greedy)
    ready: torch.cuda.Event | None  # recorded after the copies to the host: accept() waits for it alone
    generator_state: torch.Tensor | None  # the generator before the draw: restored by discard()


def _to_host(tensor: torch.Tensor) -> torch.Tensor:
    # from CUDA, non_blocking lands in pinned memory: the copy waits only for the work queued before it
    return tensor.to("cpu", non_blocking=True) if tensor.is_cuda else tensor


class TokenSampler:
    """Picks one request's tokens, step after step; holds what its penalties need to remember.

    `constraint` (a request's grammar) masks what it forbids before any other step.
    `stop_ids` are the ids that would end the request (EOS unless ignore_eos, and stop_token_ids):
    they are masked while fewer than min_tokens tokens exist. Only the steps a request switches on
    cost anything: with every option at its default a step is an argmax or one nucleus draw.
    """

    def __init__(self, params: SamplingParams, prompt_ids: list[int], *, device: torch.device,
                 stop_ids: Iterable[int] = (), constraint: TokenConstraint | None = None):
        self.params = params
        self.constraint = constraint  # the grammar's mask comes first; logprobs stay the model's own
        self.device = device
        self.generator = request_generator(params, device)
        self.generated = 0
        self._stop_ids = sorted(set(stop_ids)) if params.min_tokens else []
        self._prompt_ids = prompt_ids
        self._vocab: int | None = None  # from the first logits: lm_head may be wider than the tokenizer
        self._bias: torch.Tensor | None = None  # [V] float32
        self._counts: torch.Tensor | None = None  # [V] float32, generated tokens only
        self._history: torch.Tensor | None = None  # [1, P + max_tokens] int64, prompt then generated
        self._repetition = (RepetitionPenaltyLogitsProcessor(float(params.repetition_penalty))
                            if params.repetition_penalty != 1.0 else None)
        self._min_p = MinPLogitsWarper(float(params.min_p)) if params.min_p > 0 else None
        self._top_k = TopKLogitsWarper(int(params.top_k)) if params.top_k > 0 else None

    def _prepare(self, vocab: int) -> None:
        p = self.params
        self._vocab = vocab
        if self._stop_ids:
            self._stop_index = torch.tensor(self._stop_ids, dtype=torch.long).to(self.device)  # [S]
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.long)
            values = torch.tensor([v for _, v in p.logit_bias], dtype=torch.float32)
            self._bias = torch.zeros(vocab, dtype=torch.float32).index_put_((ids,), values).to(self.device)  # [V]
        if p.presence_penalty or p.frequency_penalty:
            self._counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)  # [V]
        if self._repetition is not None:
            prompt = len(self._prompt_ids)
            self._history = torch.empty((1, prompt + p.max_tokens), dtype=torch.long, device=self.device)
            self._history[0, :prompt] = torch.tensor(self._prompt_ids, dtype=torch.long)

    def _processed(self, logits: torch.Tensor) -> torch.Tensor:
        """[V] float32 logits after bias, min_tokens masking and penalties (what greedy takes the argmax of)."""
        p = self.params
        logits = logits.float()  # [V]
        if self._bias is not None:
            logits = logits + self._bias
        if self.generated < p.min_tokens and self._stop_ids:
            logits = logits.index_fill(0, self._stop_index, float("-inf"))
        if self._history is not None:
            seen = self._history[:, :len(self._prompt_ids) + self.generated]  # [1, P + generated]
            logits = self._repetition(seen, logits.unsqueeze(0))[0]
        if self._counts is not None:
            logits = logits - p.frequency_penalty * self._counts - p.presence_penalty * (self._counts > 0).float()
        return logits

    def _sample(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """draw() from processed logits [V]: temperature, min_p, top_k, then the top_p nucleus."""
        p = self.params
        scaled = (logits / p.temperature).unsqueeze(0)  # [1, V]
        if self._min_p is not None:
            scaled = self._min_p(None, scaled)
        if self._top_k is not None:
            scaled = self._top_k(None, scaled)
        probs = nucleus_probabilities(scaled[0], 1.0, p.top_p)  # [V]
        return draw(probs, self.generator)

    def step(self, logits: torch.Tensor) -> tuple[int, TokenLogprob | None]:
        """The next token from the last position's logits [V], and its log-probabilities if asked for."""
        return self.accept(self.pick(logits))

    def pick(self, logits: torch.Tensor) -> PickedToken:
        """Draw the next token from logits [V] on their device and queue its copy to the host; no
        host sync (a grammar's mask is the exception: it is built on the host). Read it with
        accept(), or drop it with discard(), before the next pick."""
        p = self.params
        if self._vocab is None:
            self._prepare(int(logits.shape[-1]))
        state = self.generator.get_state() if self.generator is not None else None
        raw = logits
        if self.constraint is not None:
            logits = self.constraint.mask(logits)
        plain = (self._bias is None and self._counts is None and self._history is None and self._min_p is None
                 and self._top_k is None and not (self.generated < p.min_tokens and self._stop_ids))
        if plain:  # the common request: exactly the two-step path, no extra kernels
            token, valid = pick_token(logits, p, self.generator)
        else:
            processed = self._processed(logits)
            token, valid = (torch.argmax(processed).view(1), None) if p.greedy else self._sample(processed)
        logprobs = self._logprobs(raw, token) if p.logprobs is not None else None
        host = _to_host(token)
        host_logprobs = tuple(_to_host(t) for t in logprobs) if logprobs is not None else None
        host_valid = _to_host(valid) if valid is not None else None
        ready = None
        if token.is_cuda:
            ready = torch.cuda.Event()
            ready.record()
        return PickedToken(token, host, host_logprobs, host_valid, ready, state)

    def accept(self, picked: PickedToken) -> tuple[int, TokenLogprob | None]:
        """The picked token (waiting for its copy only), its log-probabilities if asked for; the
        request's state (penalties, grammar) moves past it."""
        if picked.ready is not None:
            picked.ready.synchronize()
        _checked(picked.valid)
        token = int(picked.host[0])
        entry = None
        if picked.logprobs is not None:
            chosen, *top = picked.logprobs
            pairs = tuple(zip(top[1].tolist(), top[0].tolist())) if top else ()
            entry = TokenLogprob(token, float(chosen[0]), pairs)
        self._remember(token)
        if self.constraint is not None:
            self.constraint.advance(token)
        return token, entry

    def discard(self, picked: PickedToken) -> None:
        """Forget a pick made from logits that were void: the generator goes back to before its
        draw, so the next pick draws what this one would have from the right logits."""
        if picked.generator_state is not None:
            self.generator.set_state(picked.generator_state)

    def _logprobs(self, logits: torch.Tensor, token: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # vLLM's default (raw_logprobs): the model's distribution, before any processing or temperature
        logprobs = torch.log_softmax(logits.float(), dim=-1)  # [V]
        chosen = logprobs.gather(0, token)  # [1]
        if not self.params.logprobs:
            return (chosen,)
        values, ids = torch.topk(logprobs, self.params.logprobs)  # [k], [k] best first
        return chosen, values, ids

    def _remember(self, token: int) -> None:
        if self._counts is not None and token < self._vocab:
            self._counts[token] += 1
        if self._history is not None:
            self._history[0, len(self._prompt_ids) + self.generated] = token
        self.generated += 1


def warm_up(device: torch.device, vocab: int) -> None:
    """A greedy and a sampled pick once, read: on CUDA their kernels load (modules load lazily) and
    the host copies' page-locked blocks are allocated before the first request, whose first
    token would otherwise wait tens of milliseconds for them."""
    logits = torch.zeros(vocab, device=device)  # [V]
    for params in (SamplingParams(max_tokens=1, temperature=0.0), SamplingParams(max_tokens=1, seed=0, logprobs=1)):
        sampler = TokenSampler(params, [], device=device)
        sampler.accept(sampler.pick(logits))
