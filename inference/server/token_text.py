"""A token id's text and its exact bytes, as OpenAI's logprobs report them.

A byte-level BPE token (GPT-2 style: Qwen, DeepSeek, Llama 3...) may hold part of a multi-byte
character: its text decodes to U+FFFD, so `bytes` are taken from the token's byte-level spelling,
which concatenates to the exact UTF-8 of the completion. Other tokenizers give the UTF-8 of the
token's decoded text.
"""

from __future__ import annotations

import functools


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters back to bytes."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars)}


def _is_byte_level(tokenizer) -> bool:
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """Cached id -> (text, bytes) for one tokenizer; special tokens keep their text (e.g. '<|eos|>')."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._byte_level = _is_byte_level(tokenizer)
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def text_and_bytes(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            text = self._tokenizer.decode([token_id], skip_special_tokens=False)
            raw = list(text.encode("utf-8"))
            if self._byte_level:
                piece = self._tokenizer.convert_ids_to_tokens(token_id)
                alphabet = _byte_level_alphabet()
                if isinstance(piece, str) and piece and all(c in alphabet for c in piece):
                    raw = [alphabet[c] for c in piece]
            cached = self._cache[token_id] = (text, raw)
        return cached

    def text(self, token_id: int) -> str:
        return self.text_and_bytes(token_id)[0]
