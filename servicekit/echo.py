"""Client-supplied values quoted in error messages, cut short.

An error that echoes what the client sent must stay small whatever was sent: a gRPC status
message travels in a trailer that peers refuse beyond 16 KiB (a 100 KB model name echoed into
NOT_FOUND reached the client as RESOURCE_EXHAUSTED), and a 10 MB prompt echoed into a 400 would
be sent back whole and flood the log.
"""

from __future__ import annotations

import reprlib

ECHO_CHARS = 64  # characters of a string kept in a message


class _Short(reprlib.Repr):
    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = ECHO_CHARS + 2  # the quotes
        self.maxlist = self.maxtuple = self.maxset = self.maxdict = 6
        self.maxlevel = 3
        self.maxlong = 40

    def repr_str(self, value: str, level: int) -> str:
        if len(value) <= ECHO_CHARS:
            return repr(value)
        return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


_SHORT = _Short()


def shown(value: object) -> str:
    """repr(value) for a message, at most about ECHO_CHARS characters of any string in it, a few
    items of any list or object; a cut string says how long it was."""
    return _SHORT.repr(value)
