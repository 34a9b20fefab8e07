"""Client sessions: created by Attach, bound to one model, named by a random token.

A session lives as long as its client's Acquire stream: when the client ends the stream (or its
process dies, which ends it too) the session is closed. A stream the server ends with an error
status leaves the session open, so the client can open a new stream for it. Detach closes a
session explicitly.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from servicekit.echo import shown
from storaged.server.models import ServedModel


class SessionNotFound(LookupError):
    """An RPC named a session id that was never issued or is already closed."""

    def __init__(self, session_id: str):
        super().__init__(f"session {shown(session_id)} is unknown "
                         "(never attached, detached, or its client went away)")
        self.session_id = session_id


class SessionBusy(RuntimeError):
    """A second Acquire stream was opened for a session whose stream is still open."""

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} already has an open Acquire stream; "
                         "a session's requests are ordered on one stream")
        self.session_id = session_id


@dataclass(eq=False)
class Session:
    id: str
    model: ServedModel
    streaming: bool = False  # an Acquire stream is bound to this session
    closed: bool = False  # detached, or its client went away: the id is no longer valid

    def __hash__(self) -> int:
        return hash(self.id)


class SessionRegistry:
    """All live sessions. Used from the event loop thread only."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._sessions)

    def open(self, model: ServedModel) -> Session:
        session = Session(secrets.token_urlsafe(24), model)
        self._sessions[session.id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(session_id)
        return session

    def bind_stream(self, session_id: str) -> Session:
        session = self.get(session_id)
        if session.streaming:
            raise SessionBusy(session_id)
        session.streaming = True
        return session

    def unbind_stream(self, session: Session) -> None:
        session.streaming = False

    def close(self, session_id: str) -> Session | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.closed = True
        return session

    def all(self) -> list[Session]:
        return list(self._sessions.values())
