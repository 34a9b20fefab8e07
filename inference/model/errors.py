"""Typed errors of model loading; each names the file or tensor at fault."""

from __future__ import annotations

from pathlib import Path

_SHOWN = 20  # names listed per category before "... and N more"


def _listing(label: str, names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    more = f" ... and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return f"{label} ({len(names)}): {shown}{more}"


class ModelLoadError(Exception):
    """A bundle could not be turned into a runnable model."""


class DenseWeightsError(ModelLoadError):
    """dense.safetensors does not hold exactly the model's non-routed weights."""

    def __init__(self, path: str | Path, *, missing: list[str] = (), unexpected: list[str] = (),
                 routed: list[str] = (), mismatched: list[str] = ()):
        self.path = Path(path)
        self.missing, self.unexpected = list(missing), list(unexpected)
        self.routed, self.mismatched = list(routed), list(mismatched)
        parts = [_listing(label, names) for label, names in (
            ("missing", self.missing), ("unexpected", self.unexpected),
            ("routed expert weights that belong in experts.pack", self.routed),
            ("shape or dtype mismatch", self.mismatched)) if names]
        super().__init__(f"{self.path}: " + "; ".join(parts))


class UninitializedBufferError(ModelLoadError):
    """A non-persistent buffer was left unset by the model's own _init_weights."""

    def __init__(self, name: str):
        self.name = name
        super().__init__(f"non-persistent buffer {name!r} was not filled by the model's _init_weights; "
                         "the loader cannot compute it")


class TokenizerLoadError(ModelLoadError):
    """The bundle lists tokenizer files that transformers cannot load."""
