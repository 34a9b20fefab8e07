"""Token ids to text, as it streams: whole characters only, nothing that may become a stop string."""

from __future__ import annotations

REPLACEMENT_CHARACTER = "\ufffd"  # what a decoder yields for an incomplete UTF-8 sequence


class IncrementalDecoder:
    """Decodes a growing token sequence into text deltas without splitting multi-byte characters.

    A byte-level token may end in the middle of a UTF-8 character, and some tokenizers decode a
    token differently depending on its left neighbour (leading-space rules), so each step decodes
    a short window of already-shown tokens plus the new ones and emits only what the window adds,
    holding it back while it ends in an incomplete character.
    """

    def __init__(self, tokenizer, *, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._tokens: list[int] = []
        self._prefix_start = 0  # window start: tokens before it are final
        self._shown_end = 0  # tokens [_prefix_start, _shown_end) are already in the emitted text

    def _decode(self, tokens: list[int]) -> str:
        return self._tokenizer.decode(tokens, skip_special_tokens=self._skip_special)

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self._tokens.append(token)
        shown = self._decode(self._tokens[self._prefix_start:self._shown_end])
        window = self._decode(self._tokens[self._prefix_start:])
        if len(window) <= len(shown) or window.endswith(REPLACEMENT_CHARACTER):
            return ""
        self._prefix_start, self._shown_end = self._shown_end, len(self._tokens)
        return window[len(shown):]

    def flush(self) -> str:
        """Text of tokens still held back (an incomplete character decodes as U+FFFD)."""
        shown = self._decode(self._tokens[self._prefix_start:self._shown_end])
        window = self._decode(self._tokens[self._prefix_start:])
        self._prefix_start = self._shown_end = len(self._tokens)
        return window[len(shown):] if window.startswith(shown) else ""


class StopMatcher:
    """Finds stop strings in the growing completion text and says how much of it is safe to show.

    Text that could still turn into a stop string (a suffix that is a prefix of one) is held back
    until the next token settles it, so a streamed completion never shows part of a stop string.
    """

    def __init__(self, stops: tuple[str, ...]):
        self._stops = stops
        self._longest = max((len(s) for s in stops), default=0)
        self.text = ""  # the completion so far
        self._searched = 0  # no stop string starts before this offset
        self._floor = 0  # text before this offset was added unsearched (min_tokens): never part of a match
        self._shown = 0  # text[:_shown] has been released

    def add(self, delta: str, *, search: bool = True) -> tuple[str, bool]:
        """Append decoded text; returns (text now safe to show, whether a stop string matched).

        On a match the completion is truncated before the earliest stop string. `search=False`
        (the request's min_tokens are not reached yet) releases the text unsearched: a stop string
        only counts when it starts after the last such text.
        """
        self.text += delta
        if not search:
            self._searched = self._floor = len(self.text)
            return self._release(len(self.text)), False
        start = max(self._floor, self._searched - self._longest + 1)
        found = [i for i in (self.text.find(s, start) for s in self._stops) if i >= 0]
        if found:
            self.text = self.text[:min(found)]
            return self._release(len(self.text)), True
        self._searched = len(self.text)
        return self._release(len(self.text) - self._pending_prefix_length()), False

    def finish(self) -> str:
        """Release the held-back text when generation ends without a match."""
        return self._release(len(self.text))

    def _pending_prefix_length(self) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        for length in range(min(self._longest - 1, len(self.text) - self._floor), 0, -1):
            tail = self.text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._shown)
        released, self._shown = self.text[self._shown:end], end
        return released
