"""packtools.gguf.byte_level_tokenizer: the byte-level BPE rebuilt from GGUF metadata alone.

Where the installed transformers has the GGUF tokenizer construction this module follows (5.24),
its own `from_pretrained(gguf_file=...)` is the golden: the rebuilt tokenizer.json must be the
same bytes. transformers 5.17 has no such construction (a per-architecture table instead), so
those comparisons need the newer one; the other tests run under both.
"""

from __future__ import annotations

import gguf
import pytest
from transformers import PreTrainedTokenizerFast

from packtools.gguf.byte_level_tokenizer import PRE_TOKENIZER_SPLITS, byte_level_tokenizer
from packtools.gguf.metadata import Metadata
from packtools.gguf.tokenizer import rebuild_tokenizer
from packtools.synth.gguf_models import tiny_random_model
from packtools.synth.gguf_writer import synth_gguf
from packtools.tokenizer_synth import build_tokenizer

try:
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
except ImportError:
    GGUF_PRE_TOKENIZER_SPLITS = None
needs_transformers_byte_level_gguf = pytest.mark.skipif(
    GGUF_PRE_TOKENIZER_SPLITS is None,
    reason="transformers < 5.18 (e.g. 5.17) builds GGUF tokenizers from a per-architecture table, not the "
           "tokenizer.ggml.* construction byte_level_tokenizer follows",
)
TEXTS = ("The weather this morning was cold.", "print(x + y) <|im_start|>user\nhi<|im_end|>",
         "  spaces\tand 4096 ünïcödé 12345")


def write_gguf(tmp_path, arch: str, pre: str):
    model = tiny_random_model(arch, seed=1)
    (path,) = synth_gguf(arch, tmp_path / "m.gguf", model=model, tokenizer=build_tokenizer(model.config.vocab_size),
                         tokenizer_pre=pre)
    return path, Metadata(path, gguf.GGUFReader(path).fields)


@needs_transformers_byte_level_gguf
def test_split_regexes_are_the_ones_transformers_knows():
    assert PRE_TOKENIZER_SPLITS == GGUF_PRE_TOKENIZER_SPLITS


@needs_transformers_byte_level_gguf
@pytest.mark.parametrize("pre", ["gpt-2", "qwen2", "llama-bpe", "kimi-k2"])
def test_rebuilt_tokenizer_equals_transformers_own_conversion(tmp_path, pre):
    path, meta = write_gguf(tmp_path, "qwen3_moe", pre)
    byte_level_tokenizer(meta).save_pretrained(tmp_path / "ours")
    PreTrainedTokenizerFast.from_pretrained(tmp_path, gguf_file=path.name).save_pretrained(tmp_path / "theirs")
    assert (tmp_path / "ours/tokenizer.json").read_bytes() == (tmp_path / "theirs/tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v3", "gpt_oss"])  # all unknown to transformers 5.17's table
def test_rebuilt_tokenizer_keeps_bos_and_special_tokens(tmp_path, arch):
    _, meta = write_gguf(tmp_path, arch, "gpt-2")  # the split the synthetic tokenizer was trained with
    original = build_tokenizer(len(meta.get(gguf.Keys.Tokenizer.LIST)))
    rebuilt = byte_level_tokenizer(meta)
    for text in TEXTS:
        assert rebuilt(text).input_ids == original(text).input_ids
    assert (rebuilt.bos_token, rebuilt.eos_token, rebuilt.pad_token) == (
        original.bos_token, original.eos_token, original.pad_token)


def test_a_vocabulary_without_merges_is_reported_not_guessed(tmp_path):
    path, meta = write_gguf(tmp_path, "olmoe", "gpt-2")
    fields = {k: v for k, v in meta._fields.items() if k != gguf.Keys.Tokenizer.MERGES}
    info = rebuild_tokenizer(path, Metadata(path, fields), tmp_path / "tok")
    assert info["origin"] == "none" and gguf.Keys.Tokenizer.MERGES in info["note"] and info["files"] == []
