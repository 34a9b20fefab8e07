"""Typed errors about GGUF files. Each names the file, tensor, type, key or byte offset at fault."""

from __future__ import annotations

# One class for an architecture packtools has no model for, whether a GGUF or a config.json names it.
from packtools.errors import UnknownArchitectureError  # noqa: F401  (raised by the GGUF readers)


class GGUFError(Exception):
    """Base of every error about reading or writing a GGUF checkpoint."""


class GGUFFormatError(GGUFError):
    """The bytes are not a well-formed GGUF file."""

    def __init__(self, path: object, message: str, *, offset: int | None = None):
        where = f" at byte {offset}" if offset is not None else ""
        super().__init__(f"{path}: {message}{where}")
        self.path = str(path)
        self.offset = offset


class GGUFMagicError(GGUFFormatError):
    """The file does not start with b'GGUF'."""

    def __init__(self, path: object, magic: bytes):
        super().__init__(path, f"not a GGUF file: magic {magic!r}, expected b'GGUF'", offset=0)
        self.magic = magic


class GGUFTruncatedError(GGUFFormatError):
    """The file ends before the header, metadata or a tensor's data does."""

    def __init__(self, path: object, what: str, *, offset: int, needed: int, file_size: int):
        super().__init__(
            path, f"truncated: {what} needs bytes up to {needed} but the file has {file_size}", offset=offset
        )
        self.needed = needed
        self.file_size = file_size


class MissingShardError(GGUFError):
    """A shard of a split GGUF set is not on disk (or is not the shard its name says)."""

    def __init__(self, path: object, message: str = "missing shard of a split GGUF set"):
        super().__init__(f"{path}: {message}")
        self.path = str(path)


class UnsupportedTensorTypeError(GGUFError):
    """A tensor's GGML type cannot be read here (unknown id, or not allowed for its use)."""

    def __init__(self, path: object, tensor: str, type_name: str, reason: str, *, offset: int | None = None):
        where = f" (data at byte {offset})" if offset is not None else ""
        super().__init__(f"{path}: tensor {tensor!r} has type {type_name}{where}: {reason}")
        self.tensor = tensor
        self.type_name = type_name
        self.offset = offset


class ExpertLayoutError(GGUFError):
    """Routed expert tensors disagree with each other or with the metadata (counts, shapes, roles)."""


class MissingMetadataError(GGUFError):
    """A metadata key the architecture needs is absent."""

    def __init__(self, path: object, key: str):
        super().__init__(f"{path}: metadata key {key!r} is required but absent")
        self.key = key


class InvalidMetadataError(GGUFError):
    """A metadata value the architecture's model cannot run with (alone or with other keys)."""

    def __init__(self, path: object, key: str, value: object, reason: str):
        super().__init__(f"{path}: metadata {key}={value!r}: {reason}")
        self.key = key
        self.value = value


class TensorMappingError(GGUFError):
    """A tensor has no counterpart on the other side (GGUF name <-> transformers state_dict key)."""


class UnrepresentableConfigError(GGUFError):
    """A transformers config has a setting a GGUF of this architecture cannot express."""

    def __init__(self, model_type: str, setting: str, value: object, reason: str):
        super().__init__(f"{model_type}: {setting}={value!r} cannot be written to GGUF: {reason}")
        self.setting = setting
        self.value = value


class ExpertQuantizationError(GGUFError):
    """Expert rows cannot be encoded in the requested block type."""
