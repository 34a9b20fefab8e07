"""A byte-level BPE tokenizer (tokenizer.ggml.model = "gpt2") rebuilt from GGUF metadata alone.

Why not transformers' `from_pretrained(gguf_file=...)`: its result depends on the transformers
version. Some versions (5.17, for one) pick a converter from a per-architecture table
(`general.architecture` olmoe, deepseek2, kimi-linear, gpt-oss, ... are "not supported yet"), drop
`add_bos_token` in the qwen2 converter, have no pre-tokenizer split regexes, and fail on split
GGUFs; later ones (5.24) build the tokenizer from tokenizer.ggml.* alone. This module is that
construction (transformers/integrations/gguf/gguf_tokenizer_mapping.py: get_gguf_tokenizer,
byte_level_tokenizer, add_gguf_special_tokens, set_split_regex) on transformers' GPT2Tokenizer,
whose code is the same across those versions, so the tokenizer is the same whichever is installed.
"""

from __future__ import annotations

import gguf
from tokenizers import AddedToken, Regex, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.gpt2.tokenization_gpt2 import GPT2Tokenizer

from packtools.gguf.metadata import Metadata

BYTE_LEVEL_MODEL = "gpt2"  # tokenizer.ggml.model of byte-level BPE vocabularies

# llama.cpp's pre-tokenizer regexes (src/llama-vocab.cpp), by tokenizer.ggml.pre; the same set
# transformers 5.24 knows (GGUF_PRE_TOKENIZER_SPLITS). Any other `pre` splits the GPT-2 way.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3_SPLIT),
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}

# tokenizer.ggml.* id keys -> the tokenizer's special token attribute
_SPECIAL_TOKEN_IDS = {
    "bos_token": gguf.Keys.Tokenizer.BOS_ID,
    "eos_token": gguf.Keys.Tokenizer.EOS_ID,
    "unk_token": gguf.Keys.Tokenizer.UNK_ID,
    "pad_token": gguf.Keys.Tokenizer.PAD_ID,
}
# the flags and template a tokenizer_config takes from the file, where the file has them
_CONFIG_KEYS = {
    "chat_template": gguf.Keys.Tokenizer.CHAT_TEMPLATE,
    "add_bos_token": gguf.Keys.Tokenizer.ADD_BOS,
    "add_eos_token": gguf.Keys.Tokenizer.ADD_EOS,
}


class ByteLevelVocabError(ValueError):
    """The GGUF's byte-level vocabulary cannot be rebuilt (a key it needs is missing)."""


def byte_level_tokenizer(meta: Metadata) -> PreTrainedTokenizerFast:
    """The tokenizer a GGUF with tokenizer.ggml.model = "gpt2" describes."""
    tokens = meta.get(gguf.Keys.Tokenizer.LIST)
    merges = meta.get(gguf.Keys.Tokenizer.MERGES)
    for key, value in ((gguf.Keys.Tokenizer.LIST, tokens), (gguf.Keys.Tokenizer.MERGES, merges)):
        if value is None:
            raise ByteLevelVocabError(f"{meta.path}: byte-level vocabulary without {key}")
    token_types = meta.get(gguf.Keys.Tokenizer.TOKEN_TYPE) or []

    spelling = bytes_to_unicode()  # byte -> the printable character byte-level BPE writes it as
    alphabet = set(spelling.values())
    # a token spelled outside the byte alphabet (plain UTF-8, e.g. "<think>") is respelled byte by byte
    vocab = {token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
             for index, token in enumerate(tokens)}
    tokenizer = GPT2Tokenizer(vocab=vocab, merges=[tuple(merge.split(" ")) for merge in merges])

    # control tokens stay whole and special; one spelled outside the byte alphabet is a llama.cpp
    # mislabel, and adding it would grow the vocabulary past the model's
    control = [AddedToken(token, normalized=False, special=True)
               for token, kind in zip(tokens, token_types)
               if kind == gguf.TokenType.CONTROL and set(token) <= alphabet]
    if control:
        tokenizer.add_special_tokens({"additional_special_tokens": control}, replace_extra_special_tokens=False)
    # user-defined tokens (e.g. "<think>") are matched whole by llama.cpp, but are not special
    known = tokenizer.get_vocab()
    user_defined = [AddedToken(token, normalized=False, special=False)
                    for token, kind in zip(tokens, token_types)
                    if kind == gguf.TokenType.USER_DEFINED and token in known]
    if user_defined:
        tokenizer.add_tokens(user_defined)

    split = PRE_TOKENIZER_SPLITS.get(meta.get(gguf.Keys.Tokenizer.PRE))
    if split is not None:  # split text the way this vocabulary's merges were learned
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])

    config = {name: meta.get(key) for name, key in _CONFIG_KEYS.items() if key in meta}
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = meta.get(key)
        config[name] = tokens[token_id] if token_id is not None else None
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, **config)
