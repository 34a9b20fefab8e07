"""Moonshot's TikToken tokenizer (Kimi-K2, Kimi-Linear, Kimi-K3) as a transformers fast tokenizer.

Kimi checkpoints ship `tiktoken.model` (lines of `<base64 token bytes> <rank>`), a
`tokenizer_config.json` naming `TikTokenTokenizer`, and `tokenization_kimi.py`, remote code that
needs `trust_remote_code=True` and the tiktoken package. This module rebuilds the same tokenizer
as a `tokenizer.json` that `AutoTokenizer` loads without remote code:

- byte-level BPE whose vocabulary is the rank table (id = rank) and whose merges are every split
  of a token into two tokens, ordered by the merged token's rank: tiktoken merges whichever
  adjacent pair concatenates to the lowest-ranked token, which is this merge list's order;
  `ignore_merges` because tiktoken looks a whole pre-token up in the table before merging. (Only
  ties can differ: one token reachable by two different splits at two overlapping places of one
  word at once, where tiktoken merges the leftmost and BPE the split listed first);
- the pre-tokenizer regex of `tokenization_kimi.py` (KIMI_PAT_STR) as a Split; the `tokenizers`
  library's regex engine (Oniguruma) accepts its `&&` class intersections as written;
- the special tokens at ids len(ranks) ... len(ranks) + 255: named by the config's
  `added_tokens_decoder`, the others `<|reserved_token_{id}|>`, as TikTokenTokenizer does. Like its
  `encode` (tiktoken `allowed_special="all"`), every one of them is matched whole in text; none
  is added around the text (no BOS).

Oniguruma's Unicode tables are older than the `regex` module's (and than the Rust regex crate
tiktoken uses): the split is identical on every code point assigned in Unicode 14, and may
differ only on characters assigned since (tests/packtools/test_tokenizers_kimi.py checks both).
"""

from __future__ import annotations

import base64
import binascii
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast
from transformers.convert_slow_tokenizer import bytes_to_unicode

TIKTOKEN_FILE = "tiktoken.model"
CONFIG_FILE = "tokenizer_config.json"
FAST_TOKENIZER_FILE = "tokenizer.json"
TIKTOKEN_TOKENIZER_CLASS = "TikTokenTokenizer"
NUM_RESERVED_SPECIAL_TOKENS = 256  # TikTokenTokenizer.num_reserved_special_tokens
GGUF_PRE = "kimi-k2"  # llama.cpp's tokenizer.ggml.pre for this vocabulary

# TikTokenTokenizer.pat_str of Moonshot's tokenization_kimi.py (Kimi-K2-Instruct, Kimi-Linear,
# Kimi-K3), alternatives joined with "|" exactly as there. llama.cpp's unicode.cpp
# (unicode_regex_split_custom_kimi_k2) quotes the same string.
KIMI_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])

# config keys carried into the converted tokenizer_config.json as they are
_CARRIED_CONFIG_KEYS = ("model_max_length", "chat_template", "clean_up_tokenization_spaces")
_SPECIAL_TOKEN_ROLES = ("bos_token", "eos_token", "unk_token", "pad_token")
_BYTE_SPELLING = bytes_to_unicode()  # byte -> the printable character byte-level BPE writes it as


class TiktokenFormatError(ValueError):
    """tiktoken.model is not a table of `<base64 bytes> <rank>` lines with ranks 0..n-1."""


class TiktokenConfigError(ValueError):
    """tokenizer_config.json's special tokens do not fit the rank table."""


def spell_bytes(token: bytes) -> str:
    """A token's bytes as byte-level BPE writes them (GPT-2's printable byte alphabet)."""
    return "".join(_BYTE_SPELLING[b] for b in token)


def read_tiktoken_ranks(path: Path | str) -> dict[bytes, int]:
    """The rank table of a tiktoken file; ranks must be exactly 0..n-1 (special tokens follow them)."""
    path = Path(path)
    ranks: dict[bytes, int] = {}
    for line_number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            raise TiktokenFormatError(f"{path}:{line_number}: expected '<base64 token> <rank>', got {line[:80]!r}")
        try:
            token = base64.b64decode(fields[0], validate=True)
        except binascii.Error as exc:
            raise TiktokenFormatError(f"{path}:{line_number}: token {fields[0][:40]!r} is not base64: {exc}") from None
        if token in ranks:
            raise TiktokenFormatError(f"{path}:{line_number}: token {token!r} repeats (first at rank {ranks[token]})")
        ranks[token] = int(fields[1])
    if not ranks:
        raise TiktokenFormatError(f"{path}: no tokens")
    seen = sorted(ranks.values())
    for expected, rank in enumerate(seen):
        if rank != expected:
            raise TiktokenFormatError(f"{path}: ranks must be 0..{len(seen) - 1} without gaps or repeats; "
                                      f"rank {expected} is {'repeated' if rank < expected else 'missing'}")
    return ranks


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """Byte-level BPE merges equivalent to tiktoken's merging by rank (see the module docstring)."""
    merges: list[tuple[bytes, bytes]] = []
    for token in sorted(ranks, key=ranks.__getitem__):
        pairs = [(token[:cut], token[cut:]) for cut in range(1, len(token))
                 if token[:cut] in ranks and token[cut:] in ranks]
        merges.extend(sorted(pairs, key=lambda pair: (ranks[pair[0]], ranks[pair[1]])))
    return [(spell_bytes(left), spell_bytes(right)) for left, right in merges]


def kimi_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    """Kimi's regex split, then bytes -> byte-level characters (no second, GPT-2, split)."""
    return pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PAT_STR), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])


def apply_kimi_k2_pre_tokenizer(tokenizer: PreTrainedTokenizerFast) -> PreTrainedTokenizerFast:
    """Make a byte-level BPE rebuilt from a GGUF with tokenizer.ggml.pre = "kimi-k2" split text as
    Kimi does, and look whole pre-tokens up first as tiktoken does. Returns the same object."""
    backend = tokenizer.backend_tokenizer
    if not isinstance(backend.model, models.BPE):
        raise TypeError(f"pre={GGUF_PRE!r} needs a byte-level BPE tokenizer, got {type(backend.model).__name__}")
    backend.pre_tokenizer = kimi_pre_tokenizer()
    backend.model.ignore_merges = True
    return tokenizer


def _token_text(value) -> str | None:
    # tokenizer_config.json writes a token as a string or as a serialized AddedToken
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    raise TiktokenConfigError(f"cannot read a token from {value!r}")


def special_tokens(config: dict, num_base_tokens: int) -> list[AddedToken]:
    """Special tokens for ids num_base_tokens, num_base_tokens + 1, ... in id order."""
    declared: dict[int, dict] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        if not str(key).isdigit():
            raise TiktokenConfigError(f"added_tokens_decoder key {key!r} is not a token id")
        token_id = int(key)
        if token_id < num_base_tokens:
            raise TiktokenConfigError(f"added token {entry.get('content')!r} has id {token_id}, inside the "
                                      f"{num_base_tokens} tiktoken ranks")
        declared[token_id] = entry
    end = max([num_base_tokens + NUM_RESERVED_SPECIAL_TOKENS, *(i + 1 for i in declared)])
    tokens = []
    for token_id in range(num_base_tokens, end):
        entry = declared.get(token_id, {})
        tokens.append(AddedToken(
            entry.get("content", f"<|reserved_token_{token_id}|>"),
            special=entry.get("special", True),
            normalized=False,  # tiktoken matches special tokens in the raw text
            lstrip=entry.get("lstrip", False),
            rstrip=entry.get("rstrip", False),
            single_word=entry.get("single_word", False),
        ))
    return tokens


def fast_tokenizer_from_tiktoken(tiktoken_path: Path | str, config: dict) -> PreTrainedTokenizerFast:
    """The transformers fast tokenizer equivalent to TikTokenTokenizer(tiktoken_path, **config)."""
    ranks = read_tiktoken_ranks(tiktoken_path)
    vocab = {spell_bytes(token): rank for token, rank in ranks.items()}
    bpe = models.BPE(vocab=vocab, merges=merges_from_ranks(ranks), fuse_unk=False, byte_fallback=False)
    bpe.ignore_merges = True
    backend = Tokenizer(bpe)
    backend.pre_tokenizer = kimi_pre_tokenizer()
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)  # offsets only; adds no token

    specials = special_tokens(config, len(ranks))
    for token_id, token in enumerate(specials, start=len(ranks)):
        if token.content in vocab:  # tokenizers would give the special token the base token's id
            raise TiktokenConfigError(f"special token {token.content!r} (id {token_id}) is spelled like base "
                                      f"token {vocab[token.content]}")
        backend.add_tokens([token])
        assert backend.token_to_id(token.content) == token_id, (token.content, token_id)

    by_content = {token.content for token in specials}
    roles = {role: _token_text(config.get(role)) for role in _SPECIAL_TOKEN_ROLES}
    roles = {"bos_token": "[BOS]", "eos_token": "[EOS]", **{k: v for k, v in roles.items() if v is not None}}
    for role, content in roles.items():
        if content not in by_content:
            raise TiktokenConfigError(f"{role} {content!r} is none of the special tokens "
                                      f"(ids {len(ranks)}..{len(ranks) + len(specials) - 1})")
    extra = config.get("additional_special_tokens") or config.get("extra_special_tokens") or []
    extra = [_token_text(t) for t in (extra.values() if isinstance(extra, dict) else extra)]
    missing = [t for t in extra if t not in by_content]
    if missing:
        raise TiktokenConfigError(f"additional special tokens {missing} are none of the special tokens")
    carried = {key: config[key] for key in _CARRIED_CONFIG_KEYS if key in config}
    return PreTrainedTokenizerFast(tokenizer_object=backend, additional_special_tokens=extra, **roles, **carried)


def is_tiktoken_checkpoint(directory: Path | str) -> bool:
    """A Moonshot TikToken tokenizer without a fast tokenizer.json beside it."""
    directory = Path(directory)
    if (directory / FAST_TOKENIZER_FILE).is_file() or not (directory / TIKTOKEN_FILE).is_file():
        return False
    try:
        config = json.loads((directory / CONFIG_FILE).read_text())
    except (OSError, ValueError):  # absent or unreadable: not a tokenizer this module knows
        return False
    return isinstance(config, dict) and config.get("tokenizer_class") == TIKTOKEN_TOKENIZER_CLASS


def convert_tiktoken_checkpoint(source_dir: Path | str, out_dir: Path | str) -> list[str]:
    """Write tokenizer.json and a remote-code-free tokenizer_config.json for source_dir's TikToken
    tokenizer into out_dir (overwriting a copied tokenizer_config.json); returns the names written."""
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    config = json.loads((source_dir / CONFIG_FILE).read_text())
    tokenizer = fast_tokenizer_from_tiktoken(source_dir / TIKTOKEN_FILE, config)
    written = tokenizer.save_pretrained(str(out_dir))
    return sorted({Path(p).name for p in written if Path(p).is_file()})
