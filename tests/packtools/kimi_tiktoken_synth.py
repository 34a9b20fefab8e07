"""A synthetic Kimi-style TikToken tokenizer, and a plain reference implementation of tiktoken.

The rank table is trained here, tiktoken style (byte-pair counts over the regex's pre-tokens,
most frequent pair first), on CORPUS: English with contractions and numbers, Chinese, Japanese,
Korean, accented and combining-mark text, mixed scripts, whitespace runs and punctuation. The
reference encoder is tiktoken's algorithm written out: split with the regex (Python's `regex`
module, VERSION1 for the `&&` intersections), look a whole pre-token up, else merge the adjacent
pair whose concatenation has the lowest rank, leftmost first. Shared by
tests/packtools/test_tokenizers_kimi.py and tests/golden/kimi_tokenizer/regenerate.py.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections import Counter
from pathlib import Path

import regex


# TikTokenTokenizer.pat_str of Moonshot's tokenization_kimi.py, copied apart from the module under test
MOONSHOT_PAT_STR = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
NUM_MERGES = 600
# a pre-token made a token after training, so merges never reach it: tiktoken still finds it by
# looking the whole pre-token up (and so must we: BPE ignore_merges)
UNREACHABLE_TOKEN = " zyxwv".encode()
# Words made single tokens after training (a chain of merges, each the last), each of which one
# pre-tokenizer keeps whole and another splits, so that a wrong split shows in the ids:
# llama.cpp's kimi-k2 handler keeps "camelCase" whole (the regex splits at the case change) and
# splits "時々" and " cafe\u0301" (the regex counts 々 as Han and U+0301 as part of the word);
# GPT-2's split keeps " 你好" whole (the regex puts the space apart from Han).
SPLIT_WITNESSES = ("camelCase", "時々", " cafe\u0301", " 你好")

CORPUS = """\
The cache keeps a copy of what was read; it's fast, but it isn't free. We'll measure it again.
I'm sure they're right: you've seen it, he'd agree, and she'll check the numbers tomorrow.
DON'T PANIC. It'S A TEST! They'RE loud. HTTPServer, camelCaseName, snake_case_name, XMLHttpRequest.
Numbers: 0 7 42 365 1024 65536 3.14159 2026-11-29 12:30:05 +86 138 0013 8000, 1,000,000 and 99%.
深度学习模型在推理时需要读取大量的权重。专家混合模型只激活一部分专家，所以可以把其余的专家放在磁盘上。
今天天气很好，我们去公园散步吧。你好，世界！这是一个测试：数字123和English混在一起。
日本語のテキストです。カタカナとひらがなと漢字が混ざっています。時々、人々は東京へ行きます。
キャッシュに当たれば速い。ディスクから読むと遅い。「専門家」の重みは４０９６バイトに揃えます。
한국어 문장도 조금 있습니다. 캐시는 빠르지만 디스크는 느립니다.
Ελληνικά κείμενα, русский текст и naïve café déjà vu — résumé, façade, Ångström, straße.
Combining marks: e\u0301 a\u0308 n\u0303, Devanagari हिन्दी भाषा, Arabic مرحبا بالعالم.
Mixed: GPU显存 80GB, Kimi模型K3版本, H200上跑DeepSeek-V4, 東京Tokyo2026年, ｆｕｌｌｗｉｄｔｈ ＡＢＣ１２３.
Whitespace:  two  spaces,   three,\ttab,\t\ttwo tabs,    four; trailing   
lines\r\nwith CRLF\r\n\r\nand blank lines


and indentation:
    def f(x):
        return x  # comment
Punctuation... really?! (yes) [no] {maybe} <tag/> "quoted" 'single' “curly” «guillemets» — – ‐ …
Symbols: © ® ™ € £ ¥ → ← ★ ☆ ✓ ∑ ∫ √ ∞ ≠ ≤ ≥ emoji 😀🚀👍🏽 and flags 🇯🇵 end.
URLs https://example.com/a/b?c=d&e=f#g and paths /var/tmp/x.y_z and emails a.b@c.de!
"""


def pre_tokens(text: str) -> list[str]:
    return regex.findall(MOONSHOT_PAT_STR, text, flags=regex.V1)


def train_ranks(text: str = CORPUS, num_merges: int = NUM_MERGES) -> dict[bytes, int]:
    """Bytes 0..255 at ranks 0..255, then the most frequent pair (ties: smallest bytes) merged
    each round, then SPLIT_WITNESSES' merge chains, then UNREACHABLE_TOKEN last."""
    ranks = {bytes([b]): b for b in range(256)}
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in pre_tokens(text))
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for word, count in words.items():
            for pair in zip(word, word[1:]):
                pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda pair: (-pairs[pair], pair))
        if pairs[best] < 2:
            break
        ranks[best[0] + best[1]] = len(ranks)
        words = Counter({_merge(word, best): count for word, count in words.items()})
    for word in SPLIT_WITNESSES:
        parts = reference_bpe(ranks, word.encode())
        for part in parts[1:]:  # left to right: each new token is the merge of the previous one and a part
            merged = parts[0] + part
            assert merged not in ranks, merged
            ranks[merged] = len(ranks)
            parts[0] = merged
    assert len(reference_bpe(ranks, UNREACHABLE_TOKEN)) > 2 and UNREACHABLE_TOKEN not in ranks
    ranks[UNREACHABLE_TOKEN] = len(ranks)
    return ranks


def _merge(word: tuple[bytes, ...], pair: tuple[bytes, bytes]) -> tuple[bytes, ...]:
    out, i = [], 0
    while i < len(word):
        if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
            out.append(word[i] + word[i + 1])
            i += 2
        else:
            out.append(word[i])
            i += 1
    return tuple(out)


def tiktoken_file_bytes(ranks: dict[bytes, int]) -> bytes:
    ordered = sorted(ranks.items(), key=lambda item: item[1])
    return b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ordered)


def ranks_sha256(ranks: dict[bytes, int]) -> str:
    return hashlib.sha256(tiktoken_file_bytes(ranks)).hexdigest()


# Moonshot's layout: named ids after the ranks, gaps left for reserved tokens, [UNK]/[PAD] last
SPECIAL_OFFSETS = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
                   6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
                   15: "<|im_middle|>", 20: "<|end_of_msg|>", 21: "<|open|>", 22: "<|close|>", 254: "[UNK]",
                   255: "[PAD]"}
NOT_SPECIAL_OFFSETS = {30: "<think>", 31: "</think>"}  # added tokens the config marks special: false


def tokenizer_config(num_base_tokens: int) -> dict:
    """A tokenizer_config.json as Kimi checkpoints ship it (remote-code class and all)."""
    def entry(content: str, special: bool) -> dict:
        return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
                "single_word": False, "special": special}
    decoder = {str(num_base_tokens + off): entry(name, True) for off, name in SPECIAL_OFFSETS.items()}
    decoder.update({str(num_base_tokens + off): entry(name, False) for off, name in NOT_SPECIAL_OFFSETS.items()})
    return {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": ["<|im_end|>", "<|im_user|>", "<|im_assistant|>", "<|start_header_id|>",
                                      "<|end_header_id|>", "[EOT]", "<|im_system|>", "<|im_middle|>"],
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]", "unk_token": "[UNK]",
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1048576,
        "tokenizer_class": "TikTokenTokenizer",
    }


def write_tiktoken_tokenizer(directory: Path, ranks: dict[bytes, int]) -> None:
    """tiktoken.model + tokenizer_config.json (+ a stand-in tokenization_kimi.py that must never run)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "tiktoken.model").write_bytes(tiktoken_file_bytes(ranks))
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(len(ranks)), indent=2) + "\n")
    (directory / "tokenization_kimi.py").write_text("raise RuntimeError('remote code must not run')\n")


def special_ids(num_base_tokens: int) -> dict[str, int]:
    """Every special token id, reserved names included, as TikTokenTokenizer numbers them."""
    named = {num_base_tokens + off: name for off, name in {**SPECIAL_OFFSETS, **NOT_SPECIAL_OFFSETS}.items()}
    return {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(num_base_tokens, num_base_tokens + 256)}


def reference_bpe(ranks: dict[bytes, int], piece: bytes) -> list[bytes]:
    """tiktoken's byte_pair_merge: merge the lowest-ranked adjacent concatenation, leftmost first."""
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        candidates = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                      if parts[i] + parts[i + 1] in ranks]
        if not candidates:
            break
        _, i = min(candidates)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return parts


def reference_encode(ranks: dict[bytes, int], text: str) -> list[int]:
    """tiktoken Encoding(pat_str=MOONSHOT_PAT_STR).encode(text, allowed_special="all")."""
    specials = special_ids(len(ranks))
    special_re = regex.compile("|".join(regex.escape(s) for s in sorted(specials, key=len, reverse=True)))
    ids, start = [], 0
    for match in [*special_re.finditer(text), None]:
        end = match.start() if match else len(text)
        for piece in pre_tokens(text[start:end]):
            data = piece.encode()
            ids.extend([ranks[data]] if data in ranks else [ranks[p] for p in reference_bpe(ranks, data)])
        if match:
            ids.append(specials[match.group()])
            start = match.end()
    return ids


def reference_decode(ranks: dict[bytes, int], ids: list[int]) -> str:
    by_id = {rank: token for token, rank in ranks.items()}
    by_id.update({i: name.encode() for name, i in special_ids(len(ranks)).items()})
    return b"".join(by_id[i] for i in ids).decode("utf-8", errors="replace")


def encode_cases(num_base_tokens: int) -> list[str]:
    """Texts tokenized by every implementation (ours, the reference, llama.cpp's golden output)."""
    reserved = f"<|reserved_token_{num_base_tokens + 100}|>"
    return [
        *[line for line in CORPUS.split("\n") if line],
        CORPUS,
        "",
        " ",
        "你好, world",
        "a zyxwv b",  # UNREACHABLE_TOKEN as a whole pre-token
        "[BOS]Hello<|im_end|>\n<|im_user|>user<|im_middle|>你好[EOS]",
        "<think>reasoning</think>answer" + reserved,
        "helloWORLD camelCase iPhone McDonald's",
        "camelCase 時々 cafe\u0301 你好 cafe\u0301s",
        "時々人々〇〇年",
        "e\u0301te\u0301 cafe\u0301 ae\u0308",
        "\t\t\n\n  \r\n   x   ",
        "'s 's 'S 'll 'LL 're 've 'm 'd 'x",
        "12345678901 ٣٤٥ ⅫⅣ ①②",
    ]
