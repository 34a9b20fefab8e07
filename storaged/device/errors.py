"""Typed errors of storaged's device layer (arenas, host tier, client mapping)."""

from __future__ import annotations


class ArenaError(Exception):
    """Base of every arena error."""


class ArenaDescriptorError(ArenaError, ValueError):
    """A descriptor's fields are inconsistent (kind, sizes, handles)."""


class SlotRangeError(ArenaError, IndexError):
    """A slot index or byte count is outside the arena or tier."""

    def __init__(self, what: str, slot: int, slot_count: int, nbytes: int | None = None,
                 slot_bytes: int | None = None):
        detail = f"slot {slot} of {slot_count}"
        if nbytes is not None:
            detail += f", {nbytes} bytes of a {slot_bytes}-byte slot"
        super().__init__(f"{what}: {detail} is out of range")
        self.slot = slot
        self.nbytes = nbytes


class ArenaClosedError(ArenaError):
    """The arena (or its client mapping) was used after close()."""


class ArenaMapError(ArenaError):
    """The client could not map the arena named by a descriptor."""


class CudaUnavailableError(ArenaError):
    """A CUDA arena was requested on a machine or build without CUDA."""


class EventIndexError(ArenaError, IndexError):
    """A copy event index outside the descriptor's event pool."""


class CopySizeError(ArenaError, ValueError):
    """A copy's host buffer is smaller than the bytes to copy."""
