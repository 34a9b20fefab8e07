"""Typed access to a GGUF file's key-value metadata, with keys spelled by gguf-py's `Keys`."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import gguf
import numpy as np

from packtools.gguf.errors import MissingMetadataError

_MISSING = object()


def shortest_float(value: float) -> float:
    """The float a float32 metadata value was written from, in its shortest spelling (1e-06, not
    9.99999997e-07), so a config that went through GGUF compares equal to the original."""
    return float(str(np.float32(value)))


class Metadata:
    """The metadata of one GGUF file; `arch` fills the `{arch}` of gguf-py's key templates."""

    def __init__(self, path: object, fields: Mapping[str, gguf.ReaderField], arch: str | None = None):
        self.path = str(path)
        self._fields = fields
        self.arch = arch

    def key(self, template: str) -> str:
        return template.format(arch=self.arch) if "{arch}" in template else template

    def __contains__(self, template: str) -> bool:
        return self.key(template) in self._fields

    def get(self, template: str, default: Any = None) -> Any:
        field = self._fields.get(self.key(template))
        if field is None:
            return default
        types = field.types
        if types and types[0] == gguf.GGUFValueType.ARRAY:
            return field.contents()  # list
        value = field.contents()
        if types and types[0] in (gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.FLOAT64):
            return shortest_float(value)
        return value

    def require(self, template: str) -> Any:
        value = self.get(template, _MISSING)
        if value is _MISSING:
            raise MissingMetadataError(self.path, self.key(template))
        return value

    def keys(self) -> list[str]:
        return list(self._fields)
