"""The timed loop every contender runs: one prefill forward of the prompt, then decoding one token at
a time with the model's KV cache, stopped early at a deadline (after at least two tokens).

Decoding is greedy, or sampled (temperature 1, a seeded generator on the device): greedy decoding
of a random-weight model soon repeats one token, so its router picks the same experts every step
and decode never touches the disk; sampled tokens vary, and so does routing, as with real text."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable

import torch


def _cache_keyword(model: torch.nn.Module) -> str:
    # transformers renamed past_key_values to cache (5.2x); the GPU image still runs 5.17
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(output):
    cache = getattr(output, "cache", None)
    return cache if cache is not None else getattr(output, "past_key_values", None)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_ids(vocab_size: int, length: int, seed: int = 0) -> torch.Tensor:
    """[1, length] random token ids above the special ids (0..2)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=generator)


@torch.inference_mode()
def warm_up(model: torch.nn.Module, device: torch.device, vocab_size: int, decoder=None,
            prompt_len: int = 2, sample_seed: int | None = None) -> None:
    """Untimed: a 2-token prefill and two cached decode steps, so the kernels of both phases are
    compiled (triton) and chosen before the clock starts. A prefill alone left the first budget's
    decode paying for the decode-shape kernels (third GPU run: 100% slower than 50%). With a
    StaticDecoder, its decode step is captured as a CUDA graph here, and a prefill of
    `prompt_len` tokens captures that length's prefill graph (when every expert is resident), and
    the tokens are picked as the timed loop picks them (sample_seed), one token ahead: the
    sampler's kernels and page-locked copies are ready before the clock starts."""
    if decoder is not None:
        from inference.engine.decode_ahead import DecodeAhead

        ids = prompt_ids(vocab_size, 2, seed=99)[0].tolist()
        ahead = DecodeAhead(decoder, token_sampler(device, sample_seed, ids))
        ahead.first(ids, more=True)
        for index in range(2):
            ahead.next(more=index == 0)
        if prompt_len > 2:
            ids = prompt_ids(vocab_size, prompt_len, seed=98)[0].tolist()
            DecodeAhead(decoder, token_sampler(device, sample_seed, ids)).first(ids, more=False)
        synchronize(device)
        return
    keyword = _cache_keyword(model)
    output = model(input_ids=prompt_ids(vocab_size, 2, seed=99).to(device), use_cache=True)
    for _ in range(2):
        next_id = output.logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
        output = model(input_ids=next_id, use_cache=True, **{keyword: _cache_of(output)})
    synchronize(device)


@torch.inference_mode()
def timed_generation(model: torch.nn.Module, device: torch.device, *, vocab_size: int, prompt_len: int,
                     tokens: int, deadline: float, on_decode_start: Callable[[], None] | None = None,
                     sample_seed: int | None = None, min_seconds: float = 0.0, decoder=None,
                     decode_ahead: bool = True) -> dict:
    """prefill_seconds, decode_seconds, decoded (tokens), and the token ids (for cross-checks).

    sample_seed: None decodes greedily, else samples with that seed. The deadline is moved to
    `min_seconds` after the prefill starts when it is earlier: a slow cold start must not leave a
    contender no time to decode. decoder: a StaticDecoder (inference.engine.decode_graph) runs the
    prefill and the steps instead of the model's own KV cache loop, one token ahead unless
    decode_ahead is False (then each step is waited for before its token is picked)."""
    if decoder is not None:
        return _static_generation(decoder, device, vocab_size=vocab_size, prompt_len=prompt_len, tokens=tokens,
                                  deadline=deadline, on_decode_start=on_decode_start, sample_seed=sample_seed,
                                  min_seconds=min_seconds, ahead=decode_ahead)
    keyword = _cache_keyword(model)
    generator = None if sample_seed is None else torch.Generator(device=device).manual_seed(sample_seed)

    def pick(logits: torch.Tensor) -> torch.Tensor:  # [1, vocab] -> [1, 1]
        if generator is None:
            return logits.argmax(-1, keepdim=True)
        return torch.multinomial(torch.softmax(logits.float(), dim=-1), 1, generator=generator)

    ids = prompt_ids(vocab_size, prompt_len).to(device)  # [1, prompt_len]
    synchronize(device)
    started = time.perf_counter()
    deadline = max(deadline, started + min_seconds)
    output = model(input_ids=ids, use_cache=True)
    next_id = pick(output.logits[:, -1])  # [1, 1]
    synchronize(device)
    prefill_seconds = time.perf_counter() - started
    cache = _cache_of(output)
    generated = [int(next_id)]
    if on_decode_start is not None:
        on_decode_start()
    started = time.perf_counter()
    for _ in range(tokens):
        output = model(input_ids=next_id, use_cache=True, **{keyword: cache})
        cache = _cache_of(output)
        next_id = pick(output.logits[:, -1])
        generated.append(int(next_id))  # int() waits for the device
        if time.perf_counter() > deadline and len(generated) > 2:
            break
    decode_seconds = time.perf_counter() - started
    return {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds,
            "decoded": len(generated) - 1, "token_ids": generated}


def token_sampler(device: torch.device, sample_seed: int | None, prompt: list[int] | None = None):
    """The next token as the decoding loops here pick it, with inference's own sampler: argmax, or
    a draw at temperature 1 from a generator seeded with sample_seed on the device."""
    from inference.engine.params import SamplingParams
    from inference.engine.sampling import TokenSampler

    params = SamplingParams(max_tokens=1, temperature=0.0 if sample_seed is None else 1.0, seed=sample_seed)
    return TokenSampler(params, prompt or [], device=device)


def token_picker(device: torch.device, sample_seed: int | None) -> Callable[[torch.Tensor], int]:
    """token_sampler's choice as a function of logits [vocab] (for loops that feed the model themselves)."""
    sampler = token_sampler(device, sample_seed)
    return lambda logits: sampler.step(logits)[0]


def _static_generation(decoder, device: torch.device, *, vocab_size: int, prompt_len: int, tokens: int,
                       deadline: float, on_decode_start, sample_seed: int | None, min_seconds: float,
                       ahead: bool) -> dict:
    """As inference decodes alone on a static decoder: one token ahead (inference.engine.decode_ahead),
    or, without `ahead`, waiting for each step (no step is launched before its token is read)."""
    from inference.engine.decode_ahead import DecodeAhead

    ids = prompt_ids(vocab_size, prompt_len)[0].tolist()
    synchronize(device)
    started = time.perf_counter()
    deadline = max(deadline, started + min_seconds)
    decoding = DecodeAhead(decoder, token_sampler(device, sample_seed, ids))
    generated = [decoding.first(ids, more=ahead and tokens > 0)[0]]
    prefill_seconds = time.perf_counter() - started
    if on_decode_start is not None:
        on_decode_start()
    redone_before = decoder.redone_steps
    started = time.perf_counter()
    for index in range(tokens):
        generated.append(decoding.next(more=ahead and index + 1 < tokens)[0])
        if time.perf_counter() > deadline and len(generated) > 2:
            break
    decode_seconds = time.perf_counter() - started  # every token counted was read; a step launched past the last is not
    decoding.close()
    return {"prefill_seconds": prefill_seconds, "decode_seconds": decode_seconds, "decoded": len(generated) - 1,
            "token_ids": generated, "static_steps_redone": decoder.redone_steps - redone_before}
