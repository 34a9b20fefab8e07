"""Client sessions: created by Attach, bound to one model, named by a random token.

A session lives as long as its client's Acquire stream or data plane connection: when the client
ends it (or its process dies, which ends it too) the session is closed. A stream the server ends
with an error status leaves the session open, so the client can open a new stream for it.
Detach closes a session explicitly.

A session with neither (attached and never streamed, its client killed between Attach and the
stream, or its stream ended by a server error and never reopened) is closed once it has been
idle for `idle_seconds`: a client cannot leak sessions by attaching and going away. Each peer
(a uid, from the peer credentials of its connection) holds at most `max_per_owner` sessions.
"""

from __future__ import annotations

import secrets
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from servicekit.echo import shown
from storaged.server.models import ServedModel

_REMEMBERED_IDLE_CLOSES = 4096  # recently idle-closed ids, so a late client is told why (bounded)


class SessionNotFound(LookupError):
    """An RPC named a session id that was never issued or is already closed."""

    def __init__(self, session_id: str, why: str = "never attached, detached, or its client went away"):
        super().__init__(f"session {shown(session_id)} is unknown ({why})")
        self.session_id = session_id


class StreamAlreadyOpen(RuntimeError):
    """A second Acquire stream was opened for a session whose stream is still open."""

    def __init__(self, session_id: str):
        super().__init__(f"session {session_id!r} already has an open Acquire stream; "
                         "a session's requests are ordered on one stream")
        self.session_id = session_id


class TooManySessions(RuntimeError):
    """Attach refused: the peer already holds max_sessions_per_peer sessions."""

    def __init__(self, owner: int, count: int, limit: int):
        super().__init__(f"peer uid {owner} already holds {count} sessions, the most max_sessions_per_peer "
                         f"({limit}) allows; end unused sessions (Detach, or close their Acquire stream or "
                         "data plane connection) or raise max_sessions_per_peer")
        self.owner = owner
        self.count = count
        self.limit = limit


@dataclass(eq=False)
class ServerSession:
    """The daemon's record of one attached session (storaged.client.Session is the client's handle)."""

    id: str
    model: ServedModel
    owner: int | None = None  # uid of the peer that attached it (None: peers are not identified)
    streaming: bool = False  # an Acquire stream or a data plane connection is bound to this session
    closed: bool = False  # detached, idle too long, or its client went away: the id is no longer valid
    idle_since: float = 0.0  # clock time it was last unbound or named by an RPC (while not streaming)

    def __hash__(self) -> int:
        return hash(self.id)


class SessionRegistry:
    """All live sessions. Used from the event loop thread only.

    `max_per_owner` None: no bound. `clock`: monotonic seconds (injectable for tests).
    """

    def __init__(self, *, idle_seconds: float = 60.0, max_per_owner: int | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if idle_seconds <= 0:
            raise ValueError(f"idle_seconds must be positive, got {idle_seconds}")
        self.idle_seconds = idle_seconds
        self.max_per_owner = max_per_owner
        self._clock = clock
        self._sessions: dict[str, ServerSession] = {}
        self._idle: OrderedDict[str, ServerSession] = OrderedDict()  # not streaming, oldest idle_since first
        self._per_owner: Counter[int] = Counter()
        self._idle_closed: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def count_of(self, owner: int) -> int:
        return self._per_owner[owner]

    def open(self, model: ServedModel, owner: int | None = None) -> ServerSession:
        """A new session, idle until a stream binds it; TooManySessions when `owner` is at its bound."""
        if owner is not None and self.max_per_owner is not None and self._per_owner[owner] >= self.max_per_owner:
            raise TooManySessions(owner, self._per_owner[owner], self.max_per_owner)
        session = ServerSession(secrets.token_urlsafe(24), model, owner, idle_since=self._clock())
        self._sessions[session.id] = session
        self._idle[session.id] = session
        if owner is not None:
            self._per_owner[owner] += 1
        return session

    def get(self, session_id: str) -> ServerSession:
        """The live session; naming an idle session counts as using it (its idle time restarts)."""
        session = self._sessions.get(session_id)
        if session is None:
            if session_id in self._idle_closed:
                raise SessionNotFound(session_id, f"closed after {self.idle_seconds:g} s without an Acquire stream "
                                      "or data plane connection (session_idle_seconds); attach again")
            raise SessionNotFound(session_id)
        if not session.streaming:
            session.idle_since = self._clock()
            self._idle.move_to_end(session_id)
        return session

    def bind_stream(self, session_id: str) -> ServerSession:
        session = self.get(session_id)
        if session.streaming:
            raise StreamAlreadyOpen(session_id)
        session.streaming = True
        del self._idle[session_id]
        return session

    def unbind_stream(self, session: ServerSession) -> None:
        if not session.streaming:
            return
        session.streaming = False
        if not session.closed:
            session.idle_since = self._clock()
            self._idle[session.id] = session

    def close(self, session_id: str) -> ServerSession | None:
        session = self._sessions.pop(session_id, None)
        if session is not None:
            session.closed = True
            self._idle.pop(session_id, None)
            if session.owner is not None:
                self._per_owner[session.owner] -= 1
                if not self._per_owner[session.owner]:
                    del self._per_owner[session.owner]
        return session

    def close_idle(self) -> list[ServerSession]:
        """Close every session idle for idle_seconds or longer; returns them (their pins are the
        caller's to release)."""
        deadline = self._clock() - self.idle_seconds
        closed = []
        while self._idle:
            session_id, session = next(iter(self._idle.items()))
            if session.idle_since > deadline:
                break  # ordered by idle_since: the rest are younger
            self.close(session_id)
            self._idle_closed[session_id] = None
            if len(self._idle_closed) > _REMEMBERED_IDLE_CLOSES:
                self._idle_closed.popitem(last=False)
            closed.append(session)
        return closed

    def all(self) -> list[ServerSession]:
        return list(self._sessions.values())
