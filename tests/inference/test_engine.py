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


def plain_greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    """argmax over the whole sequence's logits each step: no cache, no sampling code of ours."""
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        for _ in range(steps):
            logits = model(input_ids=ids, use_cache=False).logits[0, -1]
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
