"""Typed errors of the dequantizers. Each is a ValueError: the caller handed in bad input."""

from __future__ import annotations


class DequantError(ValueError):
    """Base class: the bytes, type, shape or backend asked for cannot be dequantized."""


class UnsupportedTypeError(DequantError):
    """The element type is not one a pack may hold (or not a GGML type at all)."""

    def __init__(self, element_type: object, detail: str = ""):
        self.element_type = element_type
        name = getattr(element_type, "name", None) or repr(element_type)
        super().__init__(f"cannot dequantize element type {name}{': ' + detail if detail else ''}")


class ShapeError(DequantError):
    """The logical shape is empty, has a non-positive dim, or its last dim is not whole blocks."""

    def __init__(self, type_name: str, shape: tuple[int, ...], reason: str):
        self.type_name = type_name
        self.shape = shape
        super().__init__(f"{type_name} tensor of shape {shape}: {reason}")


class ByteLengthError(DequantError):
    """The raw byte count does not equal what the type and shape need."""

    def __init__(self, type_name: str, shape: tuple[int, ...], expected: int, actual: int, which: str = ""):
        self.type_name = type_name
        self.shape = shape
        self.expected = expected
        self.actual = actual
        where = f" ({which})" if which else ""
        super().__init__(
            f"{type_name} tensor of shape {shape} needs {expected} bytes, got {actual}{where}"
        )


class RawTensorError(DequantError):
    """The raw input is not a uint8 tensor of the expected rank, or the batch is inconsistent."""


class BackendUnavailableError(DequantError):
    """A backend was asked for explicitly but cannot run here (no CUDA tensor, no triton)."""


class OutputDtypeError(DequantError):
    """The requested output dtype is not a floating-point dtype."""
