"""SerializedTokenizer: one tokenizer shared by the HTTP handlers (encoding) and the worker (decoding).

A fast tokenizer's Rust object refuses concurrent use whenever one call changes its state (padding
or truncation settings: "Already borrowed"), so every call that reaches it goes through one lock.
The calls are short; the lock is never held across a forward pass.
"""

from __future__ import annotations

import threading


class SerializedTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            return self.tokenizer(*args, **kwargs)

    def decode(self, *args, **kwargs):
        with self._lock:
            return self.tokenizer.decode(*args, **kwargs)

    def get_vocab(self):
        with self._lock:
            return self.tokenizer.get_vocab()

    def apply_chat_template(self, *args, **kwargs):
        with self._lock:
            return self.tokenizer.apply_chat_template(*args, **kwargs)

    def __getattr__(self, name: str):
        # plain attributes (eos_token_id, chat_template...) of the wrapped tokenizer
        return getattr(self.tokenizer, name)
