"""DecodeAhead: step n + 1 launched on step n's token before it is read, against a real daemon.

On the CPU a launched step runs uncaptured and has completed when launch() returns, but every
decision is the one the CUDA path makes: the fence holds two steps, a step that met an absent
expert voids the step launched after it and the token picked from its logits, and the tokens,
random draws included, are those of waiting for every step.
"""

from __future__ import annotations

import pytest
import torch
from test_storaged_source_fixtures import StoragedDaemon, cases_dir, qwen_case  # noqa: F401 (fixtures)

from inference.engine.decode_ahead import DecodeAhead
from inference.engine.generate import ModelRunner
from inference.engine.metrics import EngineMetrics
from inference.engine.params import SamplingParams
from inference.engine.sampling import TokenSampler
from inference.experts.storaged_source import StoragedExpertSource
from inference.model import load_model

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DAEMON_DEVICE = "cuda:0" if DEVICE == "cuda" else "cpu"
PROMPT = [3, 17, 42, 99, 7, 250, 11]
TOKENS = 8
SAMPLINGS = [dict(temperature=0.0), dict(temperature=1.0, seed=7, logprobs=2)]
pytestmark = pytest.mark.usefixtures("one_thread")


def _sampler(device, **params) -> TokenSampler:
    return TokenSampler(SamplingParams(max_tokens=TOKENS, **params), PROMPT, device=torch.device(device))


def _waiting(decoder, device, params) -> list:
    """Each step waited for before its token is picked: what DecodeAhead must reproduce."""
    sampler = _sampler(device, **params)
    picked = [sampler.step(decoder.start(PROMPT))]
    while len(picked) < TOKENS:
        picked.append(sampler.step(decoder.step(picked[-1][0])))
    return picked


def _ahead(decoder, device, params, fence) -> list:
    ahead = DecodeAhead(decoder, _sampler(device, **params))
    picked = [ahead.first(PROMPT, more=True)]
    open_steps = [fence.open_steps]
    while len(picked) < TOKENS:
        picked.append(ahead.next(more=len(picked) + 1 < TOKENS))
        open_steps.append(fence.open_steps)
    ahead.close()
    assert not fence.open
    return picked, open_steps


@pytest.mark.slow  # fused decodes under triton's interpreter on the CPU: minutes
@pytest.mark.parametrize("vram_slots", [None, 8], ids=["every expert fits", "one layer's experts fit"])
def test_decoding_ahead_gives_the_tokens_and_draws_of_waiting_for_each_step(qwen_case, vram_slots):
    with StoragedDaemon({"m": qwen_case.bundle}, vram_cache_bytes="64MiB", device=DAEMON_DEVICE) as probe:
        slot_bytes = probe.info().slot_bytes
    daemon = StoragedDaemon({"m": qwen_case.bundle}, device=DAEMON_DEVICE,
                            vram_cache_bytes="64MiB" if vram_slots is None else vram_slots * slot_bytes)
    try:
        with load_model(qwen_case.bundle, device=DEVICE, dtype=torch.bfloat16, experts_compute="fused",
                        expert_source=lambda b, d: StoragedExpertSource(str(daemon.socket), "m", b, d)) as loaded:
            runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None,
                                 expert_source=loaded.expert_source, static_cache_len=64)
            decoder, fence = runner.decoder, loaded.expert_source.device_lookup()[4]
            metrics = EngineMetrics("m")
            metrics.watch_static_decoder(decoder)
            runs = {}
            for params in SAMPLINGS:
                waited = runs[params["temperature"]] = _waiting(decoder, DEVICE, params)
                redone, abandoned = decoder.redone_steps, decoder.abandoned_steps
                picked, open_steps = _ahead(decoder, DEVICE, params, fence)
                assert picked == waited, params
                if vram_slots is None:  # every step found its experts: one launched ahead of each token
                    assert open_steps == [1] * (TOKENS - 1) + [0]
                    assert decoder.redone_steps == redone and decoder.abandoned_steps == abandoned
                else:  # misses: the step launched after a step that missed was undone with it
                    assert decoder.redone_steps > redone and decoder.abandoned_steps > abandoned
            assert decoder.lookup_steps + decoder.redone_steps + decoder.skipped_steps == decoder.steps
            scraped = {outcome: metrics.registry.get_sample_value("expertpack_inference_static_decoder_steps_total",
                                                                  {"model": "m", "outcome": outcome})
                       for outcome in ("slot_map", "redone", "backoff", "launched_ahead_undone")}
            assert scraped == {"slot_map": decoder.lookup_steps, "redone": decoder.redone_steps,
                               "backoff": decoder.skipped_steps, "launched_ahead_undone": decoder.abandoned_steps}
            if vram_slots is None:
                # a request ended by a stop token before max_tokens: its step launched ahead is undone
                greedy = [token for token, _ in runs[0.0]]
                stop = greedy[2]
                finished = runner.run(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                             stop_token_ids=(stop,)), emit=lambda _: None)
                assert finished.finish_reason == "stop" and finished.token_ids[-1] == stop
                assert not fence.open and decoder.abandoned_steps == abandoned + 1
                again = runner.run(PROMPT, SamplingParams(max_tokens=TOKENS, temperature=0.0), emit=lambda _: None)
                assert list(again.token_ids) == greedy
    finally:
        daemon.stop()
