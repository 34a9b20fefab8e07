"""The synthetic byte-level BPE tokenizer: exact size, special ids, round trip, chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from packtools.arch.tiny import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID
from packtools.tokenizer_synth import IM_END, IM_START, MIN_VOCAB, build_tokenizer, write_tokenizer


@pytest.mark.parametrize("vocab_size", [MIN_VOCAB, 512, 3000])
def test_size_and_special_ids(vocab_size):
    tokenizer = build_tokenizer(vocab_size)
    assert len(tokenizer) == vocab_size
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (
        PAD_TOKEN_ID, BOS_TOKEN_ID, EOS_TOKEN_ID)
    assert tokenizer.convert_tokens_to_ids([IM_START, IM_END]) == [3, 4]
    assert max(tokenizer.get_vocab().values()) == vocab_size - 1


@pytest.mark.parametrize("text", ["Hello world, the cache is full.", "naïve café — 東京 🙂", "", "a\n\tb  c"])
def test_round_trips_any_text(text):
    tokenizer = build_tokenizer(512)
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == BOS_TOKEN_ID
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_merges_are_learned_and_deterministic():
    first, second = build_tokenizer(512), build_tokenizer(512)
    assert first.backend_tokenizer.to_str() == second.backend_tokenizer.to_str()
    # common English compresses well below one token per byte
    text = "The weather this morning was cold and clear."
    assert len(first(text)["input_ids"]) < len(text) / 2


def test_chat_template_and_save_load(tmp_path):
    files = write_tokenizer(tmp_path, 512)
    assert "tokenizer.json" in files
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "hi"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    assert 3 in ids and 4 in ids


def test_too_small_vocab_is_rejected():
    with pytest.raises(ValueError, match="260"):
        build_tokenizer(MIN_VOCAB - 1)
