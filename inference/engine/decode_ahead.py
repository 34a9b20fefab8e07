"""Decoding one token ahead: step n + 1 is launched on step n's token while that token is still on
the device, so the host reads the token, emits its text and checks the stop conditions while the
device already runs the next step.

    ahead = DecodeAhead(decoder, sampler)        # a StaticDecoder and the request's TokenSampler
    token, logprob = ahead.first(prompt_ids, more=True)
    token, logprob = ahead.next(more=True)       # more=False: no step is launched after this token
    ahead.close()                                # undoes a step launched for a token never needed

Without it a decode step is two host syncs apart from the next (the step's miss count, then the
sampled token), and the device idles while the host turns one into the other: 0.39-1.0 ms a step
on the H200; one token ahead, about 0.1, and decode 1.19-1.33x faster (docs/benchmarks.md).

The order of a step, all queued on one stream:

    step n's logits ─▶ pick token n (device) ─▶ launch step n + 1 on it ─▶ settle step n ─▶ read token n

A step that met an absent expert (settle() False) voids the token picked from its logits and the
step launched on that token: the decoder undoes both, the pick is discarded (the generator
rewound), and the step runs again on the acquire path before its token is picked again, so the
tokens, the random draws included, are those of decoding without looking ahead. Where the
decoder cannot launch (backing off after misses, the fence revoked, the cache full) a step runs
and is waited for as before.
"""

from __future__ import annotations

from inference.engine.decode_graph import StaticDecoder
from inference.engine.decode_launch import LaunchedStep
from inference.engine.params import TokenLogprob
from inference.engine.sampling import PickedToken, TokenSampler


class DecodeAhead:
    def __init__(self, decoder: StaticDecoder, sampler: TokenSampler):
        self.decoder = decoder
        self.sampler = sampler
        self._ahead: LaunchedStep | None = None  # launched on the last token returned, not settled
        self._last: int | None = None  # the last token returned

    def first(self, prompt_ids: list[int], *, more: bool) -> tuple[int, TokenLogprob | None]:
        """The prefill's token; `more`: another token will be asked for (launch its step now)."""
        self.close()
        return self._from(self.decoder.start(prompt_ids), more)

    def next(self, *, more: bool) -> tuple[int, TokenLogprob | None]:
        """The token after the last one returned."""
        assert self._last is not None, "next() before first()"
        step, self._ahead = self._ahead, None
        if step is None:
            return self._from(self.decoder.step(self._last), more)
        picked = self.sampler.pick(step.logits)  # before the next launch: it overwrites the logits
        following = self.decoder.launch(picked.token) if more else None
        if self.decoder.settle(step):
            self._ahead = following
            return self._accept(picked)
        self.sampler.discard(picked)  # picked from void logits; `following` was undone by settle()
        return self._from(self.decoder.redo(self._last), more)

    def close(self) -> None:
        """Undo a step launched ahead for a token that will not be asked for."""
        if self._ahead is not None:
            self._ahead = None
            self.decoder.abandon()

    def _from(self, logits, more: bool) -> tuple[int, TokenLogprob | None]:
        picked = self.sampler.pick(logits)
        if more:
            self._ahead = self.decoder.launch(picked.token)
        return self._accept(picked)

    def _accept(self, picked: PickedToken) -> tuple[int, TokenLogprob | None]:
        token, entry = self.sampler.accept(picked)
        self._last = token
        return token, entry
