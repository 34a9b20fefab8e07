"""Which VRAM pins each session holds: one set of keys per (session, model, layer).

A session holds at most one pin per key (an Acquire never names an expert twice), so the
pins on a key equal the number of sessions holding it. The reverse index (key → sessions)
lets an aborted load drop its key from every holder without scanning all sessions.
"""

from __future__ import annotations

from storaged.policy.keys import ExpertKey
from storaged.policy.plan import SessionId

LayerRef = tuple[int, int]  # (model, layer)


class SessionPins:
    """Bookkeeping only: the caller pins/unpins the cache to match."""

    def __init__(self) -> None:
        self._held: dict[SessionId, dict[LayerRef, tuple[ExpertKey, ...]]] = {}
        self._holders: dict[ExpertKey, set[SessionId]] = {}

    @property
    def session_count(self) -> int:
        """Sessions holding at least one pin."""
        return len(self._held)

    def pin_total(self) -> int:
        return sum(len(holders) for holders in self._holders.values())

    def held(self, session: SessionId, model: int, layer: int) -> tuple[ExpertKey, ...]:
        return self._held.get(session, {}).get((model, layer), ())

    def held_by(self, session: SessionId) -> dict[LayerRef, tuple[ExpertKey, ...]]:
        return dict(self._held.get(session, {}))

    def other_layers(self, session: SessionId, model: int, layer: int) -> list[LayerRef]:
        """The (model, layer)s of `model` other than `layer` on which the session holds pins."""
        return [ref for ref in self._held.get(session, ()) if ref[0] == model and ref[1] != layer]

    def holders(self, key: ExpertKey) -> frozenset[SessionId]:
        return frozenset(self._holders.get(key, ()))

    def replace(self, session: SessionId, model: int, layer: int,
                keys: tuple[ExpertKey, ...]) -> tuple[ExpertKey, ...]:
        """Record `keys` as the session's pins on (model, layer); returns the previous ones."""
        previous = self._take(session, (model, layer))
        if keys:
            self._held.setdefault(session, {})[(model, layer)] = keys
            for key in keys:
                self._holders.setdefault(key, set()).add(session)
        return previous

    def take(self, session: SessionId, *, model: int | None = None,
             layer: int | None = None) -> list[ExpertKey]:
        """Forget the session's pins on matching layers (all if both None); returns them."""
        layers = self._held.get(session, {})
        matching = [ref for ref in layers
                    if (model is None or ref[0] == model) and (layer is None or ref[1] == layer)]
        released: list[ExpertKey] = []
        for ref in matching:
            released.extend(self._take(session, ref))
        return released

    def forget_key(self, key: ExpertKey) -> frozenset[SessionId]:
        """Drop `key` from every session holding it (its load failed); returns those sessions."""
        holders = frozenset(self._holders.pop(key, ()))
        ref = (key.model, key.layer)
        for session in holders:
            layers = self._held[session]
            remaining = tuple(k for k in layers[ref] if k != key)
            if remaining:
                layers[ref] = remaining
            else:
                del layers[ref]
                if not layers:
                    del self._held[session]
        return holders

    def _take(self, session: SessionId, ref: LayerRef) -> tuple[ExpertKey, ...]:
        layers = self._held.get(session)
        if layers is None or ref not in layers:
            return ()
        keys = layers.pop(ref)
        if not layers:
            del self._held[session]
        for key in keys:
            holders = self._holders[key]
            holders.discard(session)
            if not holders:
                del self._holders[key]
        return keys
