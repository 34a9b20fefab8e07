"""TokenSampler on hand-made logits: each processor's arithmetic, vLLM's order, seeds, raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from inference.engine import InvalidRequestError, SamplingParams
from inference.engine.sampling import DrawError, TokenSampler, draw, next_token, request_generator

CPU = torch.device("cpu")
LOGITS = torch.tensor([2.0, 1.0, -1.0, 0.5, -3.0, 0.0])  # ranked: 0, 1, 3, 5, 2, 4


def sampler(prompt=(5,), stop_ids=(), **params) -> TokenSampler:
    return TokenSampler(SamplingParams(max_tokens=50, **params), list(prompt), device=CPU, stop_ids=stop_ids)


def processed(s: TokenSampler, logits=LOGITS) -> torch.Tensor:
    if s._vocab is None:
        s._prepare(logits.shape[-1])
    return s._processed(logits)


def test_plain_requests_take_the_plain_path():
    greedy = sampler(temperature=0)
    assert [greedy.step(LOGITS)[0] for _ in range(3)] == [0, 0, 0]
    a, b = sampler(temperature=1.0, top_p=0.9, seed=4), SamplingParams(max_tokens=50, temperature=1.0, top_p=0.9,
                                                                       seed=4)
    generator = request_generator(b, CPU)
    assert [a.step(LOGITS)[0] for _ in range(40)] == [next_token(LOGITS, b, generator) for _ in range(40)]


def test_logit_bias_is_added_before_greedy():
    s = sampler(temperature=0, logit_bias=((4, 6.0), (0, -1.0)))
    assert torch.allclose(processed(s), LOGITS + torch.tensor([-1.0, 0, 0, 0, 6.0, 0]))
    assert s.step(LOGITS)[0] == 4


def test_frequency_and_presence_penalties_count_generated_tokens_only():
    s = sampler(prompt=(1, 1, 1), temperature=0, frequency_penalty=0.5, presence_penalty=0.25)
    assert torch.equal(processed(s), LOGITS)  # the prompt's tokens are not penalised
    for token in (3, 3, 0):
        s._remember(token)
    counts = torch.tensor([1.0, 0, 0, 2.0, 0, 0])
    assert torch.allclose(processed(s), LOGITS - 0.5 * counts - 0.25 * (counts > 0).float())


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_prompt_and_output():
    s = sampler(prompt=(2, 5), temperature=0, repetition_penalty=2.0)
    processed(s)
    s._remember(0)
    expected = LOGITS.clone()
    expected[0] /= 2  # generated, positive
    expected[2] *= 2  # prompt, negative
    assert torch.allclose(processed(s), expected)  # 5 (logit 0) stays 0 either way


def test_min_tokens_masks_the_stop_ids_until_reached():
    s = sampler(temperature=0, min_tokens=2, stop_ids=(0, 1))
    assert s.step(LOGITS)[0] == 3  # 0 and 1 masked
    assert s.step(LOGITS)[0] == 3
    assert s.step(LOGITS)[0] == 0  # two tokens exist: EOS may come


@pytest.mark.parametrize("params, allowed", [
    ({"top_k": 1}, {0}),
    ({"top_k": 2}, {0, 1}),
    ({"top_k": 3, "top_p": 0.7}, {0, 1}),  # top_p on top_k's renormalised mass: 0.66 + 0.24 reaches it
    ({"min_p": 0.3}, {0, 1}),  # p(1)/p(0) = e^-1 = 0.37 >= 0.3; p(3)/p(0) = 0.22 < 0.3
    ({"min_p": 1.0}, {0}),
    ({"top_k": -1}, {0, 1, 2, 3, 4, 5}),
])
def test_truncation_keeps_exactly_these_tokens(params, allowed):
    s = sampler(temperature=1.0, seed=3, **params)
    draws = {s.step(LOGITS)[0] for _ in range(600)}
    assert draws == allowed


def test_temperature_applies_before_min_p():
    # at temperature 0.5 token 1's probability relative to token 0 is e^-2 = 0.135: min_p 0.2 drops it
    s = sampler(temperature=0.5, min_p=0.2, seed=1)
    assert {s.step(LOGITS)[0] for _ in range(300)} == {0}


def test_logprobs_are_the_raw_distribution_whatever_the_processing():
    s = sampler(temperature=0.3, logit_bias=((4, 50.0),), logprobs=2, seed=0)
    token, entry = s.step(LOGITS)
    raw = torch.log_softmax(LOGITS, -1)
    assert token == 4 and entry.token_id == 4
    assert entry.logprob == pytest.approx(float(raw[4]))
    assert [t for t, _ in entry.top] == [0, 1] and entry.top[0][1] == pytest.approx(float(raw[0]))
    assert sampler(temperature=0, logprobs=0).step(LOGITS)[1].top == ()
    assert sampler(temperature=0).step(LOGITS)[1] is None


def test_choice_seeds_are_the_request_seed_plus_the_index():
    params = SamplingParams(max_tokens=4, seed=10, temperature=1.0)
    assert [params.for_choice(i).seed for i in range(3)] == [10, 11, 12]
    assert SamplingParams(max_tokens=4).for_choice(2).seed is None


@pytest.mark.parametrize("change, param", [
    ({"top_k": -2}, "top_k"), ({"top_k": 1.5}, "top_k"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": math.nan}, "min_p"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"logit_bias": ((1, 101.0),)}, "logit_bias"), ({"logit_bias": ((-1, 1.0),)}, "logit_bias"),
    ({"stop_token_ids": (1.5,)}, "stop_token_ids"), ({"ignore_eos": 1}, "ignore_eos"),
    ({"min_tokens": 9}, "min_tokens"), ({"logprobs": 21}, "logprobs"), ({"skip_special_tokens": "no"},
                                                                        "skip_special_tokens"),
])
def test_invalid_new_params_name_their_field(change, param):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(max_tokens=8, **change)
    assert caught.value.param == param


@pytest.mark.parametrize("params", [
    dict(temperature=0),
    dict(temperature=1.0, seed=11),
    dict(temperature=0.7, top_k=3, min_p=0.05, seed=5, repetition_penalty=1.3, logprobs=2),
    dict(temperature=1.0, seed=3, frequency_penalty=0.5, presence_penalty=0.5, logit_bias=((2, 1.0),)),
], ids=["greedy", "sampled", "processed with logprobs", "penalties"])
def test_a_discarded_pick_leaves_the_draws_as_if_it_was_never_made(params):
    """What decoding ahead relies on: a pick from logits that turned out void, discarded, changes
    nothing; the tokens and logprobs are those of plain steps."""
    plain, ahead = sampler(**params), sampler(**params)
    void = torch.flip(LOGITS, [0])  # other logits, as a step that met an absent expert gives
    expected, got = [], []
    for index in range(30):
        expected.append(plain.step(LOGITS))
        if index % 3 == 0:
            ahead.discard(ahead.pick(void))
        got.append(ahead.accept(ahead.pick(LOGITS)))
    assert got == expected
    assert len({token for token, _ in got}) > 1 or params.get("temperature") == 0  # the draws did vary


def test_a_pick_is_read_only_by_accept():
    s = sampler(temperature=1.0, seed=2, frequency_penalty=1.0)
    picked = s.pick(LOGITS)
    assert picked.token.shape == (1,) and picked.token.dtype == torch.long
    assert s.generated == 0 and s._counts.sum() == 0  # the request's state moves only when it is read
    token, _ = s.accept(picked)
    assert s.generated == 1 and s._counts[token] == 1


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_draw_is_torch_multinomial_without_its_syncs(device):
    """draw() must keep giving torch.multinomial's tokens for the same generator (seeded requests
    reproduce across versions) and leave the generator where multinomial leaves it."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    for seed in range(100):
        probs = torch.softmax(torch.randn(3000, generator=torch.Generator().manual_seed(seed)) * 4, -1).to(device)
        ours, torchs = torch.Generator(device).manual_seed(seed), torch.Generator(device).manual_seed(seed)
        token, valid = draw(probs, ours)
        assert int(token) == int(torch.multinomial(probs, 1, generator=torchs)) and bool(valid)
        assert torch.equal(ours.get_state(), torchs.get_state())


@pytest.mark.parametrize("logits", [[1.0, float("nan"), 0.0], [float("inf"), 0.0, 1.0]], ids=["nan", "inf"])
def test_a_draw_from_no_distribution_fails_when_read(logits):
    s = sampler(temperature=1.0, seed=1)
    picked = s.pick(torch.tensor(logits))
    with pytest.raises(DrawError, match="inf"):
        s.accept(picked)
