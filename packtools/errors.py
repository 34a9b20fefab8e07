"""Errors that more than one packtools subpackage raises."""

from __future__ import annotations

from collections.abc import Iterable


class UnknownArchitectureError(ValueError):
    """An architecture packtools has no model for. Without `path`: a Hugging Face model_type with no
    ArchSpec (`known`: the model_types there are). With `path`: a GGUF file whose
    general.architecture, or a setting of it (`reason`), maps to no transformers model."""

    def __init__(self, path: object | None, architecture: object, reason: str = "", *, known: Iterable[str] = ()):
        self.path = None if path is None else str(path)
        self.architecture = architecture
        if path is None:
            message = f"unknown architecture {architecture!r}; known architectures: {', '.join(sorted(known))}"
        else:
            message = f"{path}: unsupported GGUF architecture {architecture!r}" + (f" ({reason})" if reason else "")
        super().__init__(message)
