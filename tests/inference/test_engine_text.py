"""Sampling, request parameters, incremental decoding and stop strings, each on its own."""

from __future__ import annotations

import pytest
import torch
from test_engine_fixtures import qwen_bundle  # noqa: F401  (fixture)
from transformers import AutoTokenizer

from inference.engine import InvalidRequestError, SamplingParams
from inference.engine.sampling import next_token, nucleus_probabilities, request_generator
from inference.engine.text import IncrementalDecoder, StopMatcher

# --- SamplingParams -------------------------------------------------------------------------

INVALID_PARAMS = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 2.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.01}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": "1"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": float("nan")}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"stop": ("",)}, "stop"),
    ({"stop": ["x"]}, "stop"),  # a tuple is the contract: frozen, hashable
]


@pytest.mark.parametrize("change, param", INVALID_PARAMS)
def test_invalid_sampling_params_name_their_field(change, param):
    with pytest.raises(InvalidRequestError) as caught:
        SamplingParams(**{"max_tokens": 4, **change})
    assert caught.value.param == param


@pytest.mark.parametrize("values", [{"temperature": 0}, {"temperature": 2.0}, {"top_p": 1.0}, {"top_p": 1e-9},
                                    {"seed": -1}, {"seed": 2**70}, {"stop": ("a", "bc")}])
def test_boundary_sampling_params_are_accepted(values):
    params = SamplingParams(max_tokens=1, **values)
    if params.seed is not None:
        assert 0 <= params.generator_seed < 2**64


# --- sampling -------------------------------------------------------------------------------

LOGITS = torch.log(torch.tensor([0.05, 0.5, 0.15, 0.3]))  # ranked: 1, 3, 2, 0


@pytest.mark.parametrize("top_p, nucleus", [
    (1.0, {0, 1, 2, 3}),
    (0.96, {0, 1, 2, 3}),  # the top three hold 0.95: token 0 is needed
    (0.94, {1, 2, 3}),
    (0.81, {1, 2, 3}),
    (0.7, {1, 3}),
    (0.5, {1}),  # the top token alone reaches 0.5
    (0.3, {1}),
    (1e-9, {1}),
])
def test_nucleus_is_the_smallest_top_set_reaching_top_p(top_p, nucleus):
    probs = nucleus_probabilities(LOGITS, 1.0, top_p)
    assert set(torch.nonzero(probs).flatten().tolist()) == nucleus
    assert probs.sum().item() == pytest.approx(1.0)
    kept = torch.tensor(sorted(nucleus))
    expected = torch.softmax(LOGITS, -1)[kept]
    assert torch.allclose(probs[kept], expected / expected.sum())


def test_temperature_sharpens_and_flattens():
    cold = nucleus_probabilities(LOGITS, 0.25, 1.0)
    hot = nucleus_probabilities(LOGITS, 2.0, 1.0)
    base = torch.softmax(LOGITS, -1)
    assert cold[1] > base[1] > hot[1]
    assert torch.allclose(hot, torch.softmax(LOGITS / 2.0, -1))


def test_samples_follow_the_nucleus_distribution():
    params = SamplingParams(max_tokens=1, temperature=1.0, top_p=0.7, seed=11)
    generator = request_generator(params, torch.device("cpu"))
    draws = [next_token(LOGITS, params, generator) for _ in range(4000)]
    assert set(draws) == {1, 3}
    assert draws.count(1) / len(draws) == pytest.approx(0.5 / 0.8, abs=0.03)


def test_same_seed_same_draws_greedy_needs_no_generator():
    params = SamplingParams(max_tokens=1, temperature=1.3, top_p=0.9, seed=5)
    runs = []
    for _ in range(2):
        generator = request_generator(params, torch.device("cpu"))
        runs.append([next_token(LOGITS, params, generator) for _ in range(50)])
    assert runs[0] == runs[1]
    assert request_generator(SamplingParams(max_tokens=1, temperature=0), torch.device("cpu")) is None
    assert next_token(LOGITS, SamplingParams(max_tokens=1, temperature=0), None) == 1


# --- incremental decoding -------------------------------------------------------------------

@pytest.fixture(scope="module")
def tokenizer(qwen_bundle):
    return AutoTokenizer.from_pretrained(qwen_bundle)


@pytest.mark.parametrize("text", ["plain words and spaces", "café ☃ 日本語 🙂 done", "🙂🙂", "a\nb\tc  d"])
def test_streamed_text_never_splits_a_character_and_adds_up(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > len(text.encode()) // 4  # byte-level pieces: multi-byte characters span tokens
    decoder = IncrementalDecoder(tokenizer)
    deltas = [decoder.push(t) for t in ids] + [decoder.flush()]
    assert "".join(deltas) == text
    assert not any("\ufffd" in d for d in deltas)


def test_special_tokens_are_skipped_and_incomplete_bytes_flush_as_replacement(tokenizer):
    snowman = tokenizer("☃", add_special_tokens=False).input_ids
    assert len(snowman) > 1
    decoder = IncrementalDecoder(tokenizer)
    shown = decoder.push(tokenizer.convert_tokens_to_ids("<|im_start|>")) + decoder.push(snowman[0])
    assert shown == ""
    assert decoder.flush() == "\ufffd"


# --- stop strings ---------------------------------------------------------------------------

STOP_CASES = [
    # stops, deltas, expected shown pieces, final text, matched
    (("END",), ["abc", "dE", "N", "Dxyz"], ["abc", "d", "", ""], "abcd", True),
    (("END",), ["abc", "dE", "Nx"], ["abc", "d", "ENx"], "abcdENx", False),
    (("\n\n", "."), ["one", " two", ".", "three"], ["one", " two", ""], "one two", True),
    (("ab",), ["xa", "a", "b"], ["x", "a", ""], "xa", True),
    (("aab",), ["a", "a", "a", "b"], ["", "", "a", ""], "a", True),
    (("x", "yz"), ["..y", "z"], ["..", ""], "..", True),
    ((), ["a", "b"], ["a", "b"], "ab", False),
    (("stop",), ["no stop", "here"], ["no "], "no ", True),
]


@pytest.mark.parametrize("stops, deltas, shown, final, matched", STOP_CASES)
def test_stop_strings_truncate_and_nothing_of_them_is_shown(stops, deltas, shown, final, matched):
    matcher = StopMatcher(stops)
    pieces, hit = [], False
    for delta in deltas:
        piece, hit = matcher.add(delta)
        pieces.append(piece)
        if hit:
            break
    if not hit:
        pieces.append(matcher.finish())
    assert hit == matched
    assert pieces[:len(shown)] == shown
    assert "".join(pieces) == final == matcher.text
