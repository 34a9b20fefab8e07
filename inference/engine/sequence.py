"""One choice being generated, advanced one model forward at a time.

A Sequence owns what a choice needs between steps: its prompt, its own KV/recurrent cache (the
model's usual cache object, whatever the architecture), its sampler, its incremental decoder and
stop matcher. A step is two calls: `forward()` (the model on the next input: a chunk of the
prompt, or the last sampled token) and `advance()` (sample from the logits, emit text, check the
stop conditions). `forward()` of several sequences may run at the same time on different threads
(inference.engine.batch); `advance()` runs on the scheduling thread.

On the static decoder (a request running alone), `forward()` also picks the token, on the
device, and launches the next step on it before reading it (inference.engine.decode_ahead):
`advance()` then takes that token, and the host's work of a step overlaps the next step's.

The prompt goes through the model in chunks of at most `prefill_chunk` tokens, each chunk one
step, so that a long prompt joining a running batch holds the others' decode steps for one
chunk's time at most; the last chunk's logits give the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from inference.engine.constraints import TokenConstraint
from inference.engine.params import Finished, SamplingParams, TextDelta, TokenLogprob, Usage
from inference.engine.sampling import TokenSampler
from inference.engine.text import IncrementalDecoder, StopMatcher

FINISH_STOP, FINISH_LENGTH, FINISH_CANCELLED = "stop", "length", "cancelled"


class Sequence:
    """`runner` is the inference.engine.generate.ModelRunner whose model and tokenizer it uses;
    `static` a StaticDecoder this sequence has to itself (one CUDA graph per decode step), or None."""

    def __init__(self, runner, prompt_ids: list[int], params: SamplingParams, *, emit: Callable[[TextDelta], None],
                 index: int = 0, submitted_at: float | None = None, static=None, prefill_chunk: int | None = None):
        self.runner = runner
        self.prompt_ids = list(prompt_ids)
        self.params = params
        self.emit = emit
        self.index = index
        self.started = time.monotonic()
        self.submitted_at = self.started if submitted_at is None else submitted_at
        self.static = static
        self._chunk_setting = prefill_chunk
        # the tokens the model is fed before decoding: the prompt (and, after leave_static, the
        # tokens generated so far, to rebuild the cache outside the static decoder)
        self._context = self.prompt_ids
        # a static decoder prefills in one call; elsewhere chunks of prefill_chunk tokens
        self.prefill_chunk = len(self.prompt_ids) if static is not None or not prefill_chunk else prefill_chunk
        self.stop_ids = runner.stop_ids(params)
        self.constraint = (TokenConstraint(runner.tokenizer, params.grammar, self.stop_ids)
                           if params.grammar is not None else None)
        self.sampler = TokenSampler(params, self.prompt_ids, device=runner.device, stop_ids=self.stop_ids,
                                    constraint=self.constraint)
        self._decoder = IncrementalDecoder(runner.tokenizer, skip_special_tokens=params.skip_special_tokens)
        self._stops = StopMatcher(params.stop)
        self.tokens: list[int] = []
        self._token_times: list[float] = []
        self._logprobs: list = []
        self._reported = 0  # logprobs entries already sent with a delta
        self._fed = 0  # prompt tokens already through the model
        self._cache = None
        self._logits: torch.Tensor | None = None  # [V] of the last forward that ended the prompt or decoded
        self._ahead = None  # DecodeAhead on the static decoder
        self._picked: tuple[int, TokenLogprob | None] | None = None  # its token of the last forward
        self.finish_reason: str | None = None  # set once the sequence is done
        self._matched_stop = False

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def prefilling(self) -> bool:
        return self._fed < len(self._context)

    def next_input_len(self) -> int:
        """Tokens the next forward takes."""
        return min(self.prefill_chunk, len(self._context) - self._fed) if self.prefilling else 1

    def leave_static(self) -> bool:
        """Stop using the static decoder (others now run beside this sequence): the next forwards
        feed the prompt and the tokens generated so far, in chunks, into a cache of its own, then
        decoding goes on from the last token. True when it was on the static decoder.

        Why recompute rather than keep it apart: a sequence stepping alone beside a batch makes
        its own expert acquisitions every step; in the batch it shares theirs, and its refeed
        shares the expert reads of the prefills it joins with."""
        if self.static is None or self.done:
            return False
        self._close_ahead()
        self.static = None
        self._context = self.prompt_ids + self.tokens
        self._fed = 0
        self._cache = None
        self._logits = None
        self.prefill_chunk = self._chunk_setting or len(self._context)
        return True

    def forward(self) -> None:
        """The model on the next input; thread-safe against other sequences' forwards."""
        assert not self.done, "forward() of a finished sequence"
        if self.static is not None:
            if self._ahead is None:
                from inference.engine.decode_ahead import DecodeAhead

                self._ahead = DecodeAhead(self.static, self.sampler)
            more = len(self.tokens) + 1 < self.params.max_tokens  # a token will follow unless a stop says no
            self._picked = (self._ahead.next(more=more) if self.tokens
                            else self._ahead.first(self.prompt_ids, more=more))
            self._fed = len(self.prompt_ids)
            return
        if self.prefilling:
            chunk = self._context[self._fed:self._fed + self.next_input_len()]
            self._fed += len(chunk)
        else:
            chunk = [self.tokens[-1]]
        input_ids = torch.tensor([chunk], dtype=torch.long, device=self.runner.device)  # [1, chunk]
        self._logits, self._cache = self.runner.forward(input_ids, self._cache)

    def advance(self) -> None:
        """After forward(): sample the next token (unless the prompt is still being fed), emit the
        text it makes safe, and end the sequence when a stop condition or max_tokens says so."""
        if self.prefilling:
            return
        params = self.params
        if self._picked is not None:
            (token, entry), self._picked = self._picked, None
        else:
            token, entry = self.sampler.step(self._logits)
        self._logits = None
        self.tokens.append(token)
        self._token_times.append(time.monotonic())
        if entry is not None:
            self._logprobs.append(entry)
        if token in self.stop_ids:
            self.finish_reason = FINISH_STOP
            return
        safe, self._matched_stop = self._stops.add(self._decoder.push(token),
                                                   search=len(self.tokens) > params.min_tokens)
        if safe:
            self._emit(safe)
        if self._matched_stop or (self.constraint is not None and self.constraint.finished):
            self.finish_reason = FINISH_STOP
        elif len(self.tokens) >= params.max_tokens:
            self.finish_reason = FINISH_LENGTH

    def cancel(self) -> None:
        if not self.done:
            self.finish_reason = FINISH_CANCELLED

    def fail(self) -> None:
        """The sequence will take no further steps (its request failed); its cache is let go."""
        self._cache = None
        try:
            self._close_ahead()
        except Exception:  # noqa: BLE001 - the request already failed with the error that matters
            self._ahead = None
        if not self.done:
            self.finish_reason = FINISH_CANCELLED

    def finish(self) -> Finished:
        """The choice's end, after releasing what the decoder and the stop matcher still hold."""
        assert self.done, "finish() of a running sequence"
        self._cache = None
        self._close_ahead()
        if not self._matched_stop:
            safe, self._matched_stop = self._stops.add(self._decoder.flush(),
                                                       search=len(self.tokens) > self.params.min_tokens)
            tail = safe if self._matched_stop else safe + self._stops.finish()
            if self._matched_stop:
                self.finish_reason = FINISH_STOP
            if tail and self.finish_reason != FINISH_CANCELLED:
                self._emit(tail)
        ended = time.monotonic()
        times = self._token_times
        ttft = None if not times else times[0] - self.submitted_at
        gaps = tuple(b - a for a, b in zip(times, times[1:]))
        return Finished(self.finish_reason, self._stops.text, Usage(len(self.prompt_ids), len(self.tokens)),
                        tuple(self.tokens), ttft, ended - self.started, self.index,
                        tuple(self._logprobs) if self.params.logprobs is not None else None, gaps)

    def _close_ahead(self) -> None:
        """Undo a step launched for a token this sequence will not take; the decoder is free again."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.close()

    def _emit(self, text: str) -> None:
        self.emit(TextDelta(text, self.index, tuple(self._logprobs[self._reported:]), len(self.tokens)))
        self._reported = len(self._logprobs)
