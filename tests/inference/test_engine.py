"""The generation loop on real tiny models: greedy exactness, seeds, stop strings, EOS, usage."""

from __future__ import annotations

import pytest
import torch
from test_engine_fixtures import engine, loaded, qwen_bundle, tiny_bundle  # noqa: F401  (fixtures)

from inference.engine import (
    Finished,
    InvalidRequestError,
    ModelRunner,
    SamplingParams,
    TextDelta,
    encode_completion_prompt,
)
from inference.experts import LocalPackSource
from inference.model import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPT = "The weather this morning was"


def run(runner: ModelRunner, prompt_ids, **params) -> tuple[list[str], Finished]:
    deltas: list[str] = []
    finished = runner.run(prompt_ids, SamplingParams(**params), emit=lambda d: deltas.append(d.text))
    return deltas, finished


def plain_greedy(model, prompt_ids: list[int], steps: int, adjust=None) -> list[int]:
    """argmax over the whole sequence's logits each step: no cache, no sampling code of ours.
    `adjust(logits [V], generated ids)` changes the logits first (a reference for a penalty)."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1].float()
            if adjust is not None:
                logits = adjust(logits, ids[0, len(prompt_ids):].tolist())
            ids = torch.cat([ids, logits.argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt_ids):].tolist()


def test_greedy_equals_a_plain_transformers_greedy_loop(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    _, finished = run(engine.runner, prompt_ids, max_tokens=24, temperature=0)
    assert list(finished.token_ids) == plain_greedy(loaded.model, prompt_ids, 24)
    assert finished.finish_reason == "length"


@pytest.mark.parametrize("arch", ["deepseek_v3", "gpt_oss", "kimi_linear"])
def test_greedy_equals_transformers_generate_across_architectures(arch, tmp_path_factory):
    bundle = tiny_bundle(tmp_path_factory, arch)
    with load_model(bundle, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as model:
        runner = ModelRunner(model.model, model.tokenizer, eos_ids=(), context_length=None)
        prompt_ids = encode_completion_prompt(model.tokenizer, PROMPT)
        _, finished = run(runner, prompt_ids, max_tokens=16, temperature=0)
        reference = model.model.generate(torch.tensor([prompt_ids]), max_new_tokens=16, do_sample=False,
                                         eos_token_id=None, pad_token_id=0)
        assert list(finished.token_ids) == reference[0, len(prompt_ids):].tolist()


def test_streamed_deltas_add_up_to_the_text_and_usage_counts_tokens(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    deltas, finished = run(engine.runner, prompt_ids, max_tokens=30, temperature=0)
    assert "".join(deltas) == finished.text
    assert finished.text == loaded.tokenizer.decode(list(finished.token_ids), skip_special_tokens=True)
    assert finished.usage.prompt_tokens == len(prompt_ids)
    assert finished.usage.completion_tokens == len(finished.token_ids) == 30
    assert finished.usage.total_tokens == len(prompt_ids) + 30
    assert finished.time_to_first_token is not None and 0 < finished.time_to_first_token <= finished.generation_seconds


def test_same_seed_same_tokens_different_seed_different_tokens(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    sample = dict(max_tokens=24, temperature=1.0, top_p=0.95)
    first = run(engine.runner, prompt_ids, seed=1234, **sample)[1].token_ids
    other = run(engine.runner, prompt_ids, seed=99, **sample)[1].token_ids
    again = run(engine.runner, prompt_ids, seed=1234, **sample)[1].token_ids
    assert first == again
    assert first != other
    unseeded = {run(engine.runner, prompt_ids, **sample)[1].token_ids for _ in range(2)}
    assert len(unseeded) == 2  # no seed: a fresh random stream each time


def test_tiny_top_p_and_near_zero_temperature_are_greedy(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    greedy = run(engine.runner, prompt_ids, max_tokens=16, temperature=0)[1].token_ids
    assert run(engine.runner, prompt_ids, max_tokens=16, temperature=1.0, top_p=1e-6, seed=3)[1].token_ids == greedy
    assert run(engine.runner, prompt_ids, max_tokens=16, temperature=1e-4, seed=3)[1].token_ids == greedy


def test_stop_string_truncates_the_text_and_ends_generation(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    _, full = run(engine.runner, prompt_ids, max_tokens=40, temperature=0)
    stop = full.text[12:15]
    cut = full.text.index(stop)
    deltas, stopped = run(engine.runner, prompt_ids, max_tokens=40, temperature=0, stop=("never there", stop))
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:cut] == "".join(deltas)
    assert stop not in "".join(deltas)
    assert stopped.usage.completion_tokens < 40
    assert stopped.token_ids == full.token_ids[:len(stopped.token_ids)]


def test_eos_ends_with_stop_and_its_text_is_not_shown(loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    free = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(), context_length=None)
    _, full = run(free, prompt_ids, max_tokens=12, temperature=0)
    eos = full.token_ids[4]
    assert eos not in full.token_ids[:4]
    ended = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(eos,), context_length=None)
    _, finished = run(ended, prompt_ids, max_tokens=12, temperature=0)
    assert finished.finish_reason == "stop"
    assert finished.token_ids == full.token_ids[:5]  # the EOS token is counted...
    assert finished.usage.completion_tokens == 5
    assert finished.text == loaded.tokenizer.decode(list(full.token_ids[:4]))  # ...but not shown


@pytest.mark.parametrize("prompt_ids, max_tokens, param, message", [
    ([], 4, "prompt", "empty"),
    ([5, 512], 4, "prompt", "outside the vocabulary"),
    ([5] * 100, 4, "prompt", "context is 100"),
    ([5] * 90, 11, "max_tokens", "exceed this model's context of 100"),
])
def test_requests_that_do_not_fit_are_refused(loaded, prompt_ids, max_tokens, param, message):
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(2,), context_length=100)
    with pytest.raises(InvalidRequestError, match=message) as caught:
        runner.check_request(prompt_ids, SamplingParams(max_tokens=max_tokens))
    assert caught.value.param == param
    runner.check_request([5] * 90, SamplingParams(max_tokens=10))  # exactly fills the context
    assert runner.room_after([5] * 90) == 10


def test_text_delta_events_carry_only_text(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    events = list(engine.generate(prompt_ids, SamplingParams(max_tokens=8, temperature=0)))
    assert all(isinstance(e, TextDelta) and e.text for e in events[:-1])
    assert isinstance(events[-1], Finished)


# --- the sampling fields on the real model --------------------------------------------------

def test_repetition_penalty_greedy_equals_transformers_generate(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    _, finished = run(engine.runner, prompt_ids, max_tokens=24, temperature=0, repetition_penalty=1.8)
    reference = loaded.model.generate(torch.tensor([prompt_ids]), max_new_tokens=24, do_sample=False,
                                      repetition_penalty=1.8, eos_token_id=None, pad_token_id=0)
    assert list(finished.token_ids) == reference[0, len(prompt_ids):].tolist()
    assert list(finished.token_ids) != list(run(engine.runner, prompt_ids, max_tokens=24, temperature=0)[1].token_ids)


def test_presence_and_frequency_penalties_follow_openais_formula(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)

    def openai_penalties(logits, generated):  # OpenAI's definition, over generated tokens only
        counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=logits.shape[0]).float()
        return logits - 1.5 * counts - 0.7 * (counts > 0).float()

    _, finished = run(engine.runner, prompt_ids, max_tokens=20, temperature=0, frequency_penalty=1.5,
                      presence_penalty=0.7)
    assert list(finished.token_ids) == plain_greedy(loaded.model, prompt_ids, 20, openai_penalties)
    assert len(set(finished.token_ids)) > len(set(plain_greedy(loaded.model, prompt_ids, 20)))


def test_top_k_1_and_min_p_1_are_greedy_whatever_the_seed(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    greedy = run(engine.runner, prompt_ids, max_tokens=16, temperature=0)[1].token_ids
    for seed in (1, 2, 3):
        for cut in ({"top_k": 1}, {"min_p": 1.0}):
            _, finished = run(engine.runner, prompt_ids, max_tokens=16, temperature=1.0, seed=seed, **cut)
            assert finished.token_ids == greedy
    sampled = {run(engine.runner, prompt_ids, max_tokens=16, temperature=1.0, top_k=0, seed=s)[1].token_ids
               for s in (1, 2, 3)}
    assert len(sampled) == 3


def test_stop_token_ids_ignore_eos_min_tokens_and_special_tokens(loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    eos = loaded.tokenizer.eos_token_id
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(eos,), context_length=None)
    forced = ((eos, 100.0),)  # EOS wins every step
    _, ended = run(runner, prompt_ids, max_tokens=6, temperature=0, logit_bias=forced)
    assert (ended.finish_reason, ended.token_ids, ended.text) == ("stop", (eos,), "")
    _, ignored = run(runner, prompt_ids, max_tokens=6, temperature=0, logit_bias=forced, ignore_eos=True)
    assert (ignored.finish_reason, ignored.token_ids, ignored.text) == ("length", (eos,) * 6, "")
    _, shown = run(runner, prompt_ids, max_tokens=2, temperature=0, logit_bias=forced, ignore_eos=True,
                   skip_special_tokens=False)
    assert shown.text == "<|eos|><|eos|>"
    _, late = run(runner, prompt_ids, max_tokens=6, temperature=0, logit_bias=forced, min_tokens=3)
    assert late.finish_reason == "stop" and len(late.token_ids) == 4 and late.token_ids[-1] == eos
    free = run(runner, prompt_ids, max_tokens=8, temperature=0)[1].token_ids
    _, stopped = run(runner, prompt_ids, max_tokens=8, temperature=0, stop_token_ids=(free[3],))
    first = free.index(free[3])
    assert stopped.finish_reason == "stop" and stopped.token_ids == free[:first + 1]
    assert stopped.text == loaded.tokenizer.decode(list(free[:first]))


def test_min_tokens_defers_stop_strings(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    _, full = run(engine.runner, prompt_ids, max_tokens=30, temperature=0)
    stop = full.text[2:4]
    early = run(engine.runner, prompt_ids, max_tokens=30, temperature=0, stop=(stop,))[1]
    assert early.text == full.text[:full.text.index(stop)]
    late = run(engine.runner, prompt_ids, max_tokens=30, temperature=0, stop=(stop,), min_tokens=10)[1]
    assert len(late.token_ids) >= 10 and len(late.text) > len(early.text)


def test_logprobs_are_the_models_log_softmax(engine, loaded):
    prompt_ids = encode_completion_prompt(loaded.tokenizer, PROMPT)
    deltas, finished = [], None
    finished = engine.runner.run(prompt_ids, SamplingParams(max_tokens=6, temperature=0, logprobs=3),
                                 emit=deltas.append)
    assert [e.token_id for e in finished.logprobs] == list(finished.token_ids)
    assert [e for d in deltas for e in d.logprobs] == list(finished.logprobs[:sum(len(d.logprobs) for d in deltas)])
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor([prompt_ids]), use_cache=False).logits[0, -1].float()
    reference = torch.log_softmax(logits, -1)
    first = finished.logprobs[0]
    assert first.top[0][0] == first.token_id  # greedy: the sampled token is the most likely one
    assert first.logprob == pytest.approx(float(reference[first.token_id]), abs=1e-5)
    assert [t for t, _ in first.top] == torch.topk(reference, 3).indices.tolist()


@pytest.mark.parametrize("params, param", [
    ({"logit_bias": ((512, 1.0),)}, "logit_bias"),
    ({"stop_token_ids": (9999,)}, "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused(loaded, params, param):
    runner = ModelRunner(loaded.model, loaded.tokenizer, eos_ids=(2,), context_length=None)
    with pytest.raises(InvalidRequestError) as caught:
        runner.check_request([5, 6], SamplingParams(max_tokens=4, **params))
    assert caught.value.param == param
