"""A loaded model and its tokenizer: request checks, the model forward, and one request's generation loop.

Sampling is ours (inference.engine.sampling, vLLM's semantics), not transformers' generate, so
seed, penalties and stop conditions mean what an OpenAI client expects. The loop is synchronous
and runs on whichever thread calls it (the engine's worker, or the CLI's main thread).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable

import torch

from inference.engine.errors import InvalidRequestError
from inference.engine.params import Finished, SamplingParams, TextDelta
from inference.engine.sequence import FINISH_CANCELLED, FINISH_LENGTH, FINISH_STOP, Sequence

__all__ = ["FINISH_CANCELLED", "FINISH_LENGTH", "FINISH_STOP", "ModelRunner", "context_length_of",
           "eos_token_ids"]


def eos_token_ids(tokenizer, generation_config) -> frozenset[int]:
    """Every id that ends a completion: the tokenizer's EOS and the generation config's (int or list)."""
    ids: set[int] = set()
    for value in (getattr(tokenizer, "eos_token_id", None), getattr(generation_config, "eos_token_id", None)):
        if value is None:
            continue
        ids.update([value] if isinstance(value, int) else value)
    return frozenset(int(i) for i in ids)


def context_length_of(config) -> int | None:
    for name in ("max_position_embeddings", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers renamed past_key_values to cache (5.2x); the GPU image still runs 5.17
    parameters = inspect.signature(model.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


class ModelRunner:
    """A loaded model and its tokenizer; a request generates through a Sequence (alone: `run`)."""

    def __init__(self, model: torch.nn.Module, tokenizer, *, eos_ids: Iterable[int], context_length: int | None,
                 expert_source=None, static_cache_len: int = 0, cpu_experts=None):
        """static_cache_len > 0: decode through a StaticDecoder of that many tokens (a CUDA graph
        per step reading experts through storaged's slot map) when the model and `expert_source`
        allow it (inference.engine.decode_graph.why_not); requests that do not fit it, and models
        that cannot, decode eagerly. cpu_experts (inference.experts.cpu_experts.CpuExpertsConfig):
        CPU threads share the host-tier experts of its steps; refused (ValueError) without one."""
        self.model = model
        self.tokenizer = tokenizer
        self.eos_ids = frozenset(eos_ids)
        self.context_length = context_length
        embeddings = model.get_input_embeddings()
        self.device = embeddings.weight.device
        self.vocab_size = int(embeddings.weight.shape[0])
        self._cache_keyword = _cache_keyword(model)
        self._keeps_last_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        self.decoder = None
        if static_cache_len:
            from inference.engine.decode_graph import StaticDecoder

            length = min(static_cache_len, context_length or static_cache_len)
            self.decoder = StaticDecoder.create(model, expert_source, max_len=length,
                                                cache_keyword=self._cache_keyword, cpu_experts=cpu_experts)
        elif cpu_experts is not None:
            raise ValueError("cpu_experts_threads: CPU experts run inside the static decoder's steps "
                             "(static_cache_len is 0)")

    def check_request(self, prompt_ids: list[int], params: SamplingParams, *, prompt_param: str = "prompt") -> None:
        """Refuse a prompt the model cannot take, or a max_tokens that does not fit the context."""
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty (it encodes to no tokens)", param=prompt_param)
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, "
                                      f"{self.vocab_size})", param=prompt_param)
        named = (("logit_bias", [t for t, _ in params.logit_bias]), ("stop_token_ids", params.stop_token_ids))
        for param, ids in named:
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"{param}: token ids {bad[:5]} are outside the vocabulary [0, "
                                          f"{self.vocab_size})", param=param)
        if self.context_length is None:
            return
        if len(prompt_ids) >= self.context_length:
            raise InvalidRequestError(f"the prompt has {len(prompt_ids)} tokens; this model's context is "
                                      f"{self.context_length}", param=prompt_param, code="context_length_exceeded")
        if len(prompt_ids) + params.max_tokens > self.context_length:
            raise InvalidRequestError(f"max_tokens {params.max_tokens} + {len(prompt_ids)} prompt tokens exceed "
                                      f"this model's context of {self.context_length} tokens", param="max_tokens",
                                      code="context_length_exceeded")

    def room_after(self, prompt_ids: list[int]) -> int:
        """The most tokens a completion of this prompt may have (the default max_tokens)."""
        if self.context_length is None:
            raise InvalidRequestError("max_tokens is required: this model's config gives no context length",
                                      param="max_tokens")
        return max(1, self.context_length - len(prompt_ids))

    def forward(self, input_ids: torch.Tensor, cache) -> tuple[torch.Tensor, object]:
        """Logits of the last position [V] and the (updated) cache."""
        kwargs = {"use_cache": True}
        if cache is not None:
            kwargs[self._cache_keyword] = cache
        if self._keeps_last_logits:
            kwargs["logits_to_keep"] = 1  # a long prompt needs no [P, V] logits
        output = self.model(input_ids=input_ids, **kwargs)
        return output.logits[0, -1], _cache_of(output)

    def stop_ids(self, params: SamplingParams) -> frozenset[int]:
        """The token ids that end this request: EOS (unless ignore_eos) and its stop_token_ids."""
        return (frozenset() if params.ignore_eos else self.eos_ids) | frozenset(params.stop_token_ids)

    def sequence(self, prompt_ids: list[int], params: SamplingParams, *, emit: Callable[[TextDelta], None],
                 submitted_at: float | None = None, index: int = 0, static: bool = True,
                 prefill_chunk: int | None = None) -> Sequence:
        """A Sequence of this request; on the static decoder when `static`, there is one, and it fits.
        The static decoder has one cache: the caller lets at most one sequence at a time have it."""
        decoder = self.decoder if static and self.decoder is not None and self.decoder.fits(
            len(prompt_ids), params.max_tokens) else None
        return Sequence(self, prompt_ids, params, emit=emit, index=index, submitted_at=submitted_at,
                        static=decoder, prefill_chunk=prefill_chunk)

    def run(self, prompt_ids: list[int], params: SamplingParams, *, emit: Callable[[TextDelta], None],
            cancelled: Callable[[], bool] = lambda: False, submitted_at: float | None = None,
            index: int = 0) -> Finished:
        """Generate for one request alone, calling `emit` with each piece of safe text; returns its end.

        `cancelled` is polled once per step; `index` is the choice the events belong to.
        Exceptions from the model (an expert source failing included) propagate unchanged.
        """
        sequence = self.sequence(prompt_ids, params, emit=emit, submitted_at=submitted_at, index=index)
        with torch.inference_mode():
            while not sequence.done:
                if cancelled():
                    sequence.cancel()
                    break
                sequence.forward()
                sequence.advance()
        return sequence.finish()
