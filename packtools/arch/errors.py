"""Typed errors of the architecture registry and of Hugging Face checkpoint reading."""

from __future__ import annotations

from collections.abc import Iterable

# One class for an architecture packtools has no model for, whether a config.json or a GGUF names
# it; it lives in packtools.errors since packtools.gguf raises it too and packtools.arch imports
# packtools.gguf (the records' GGUF mappings).
from packtools.errors import UnknownArchitectureError  # noqa: F401  (raised by the registry)


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint directory that cannot be read as its config says."""


class MissingCheckpointFile(HFCheckpointError, FileNotFoundError):
    def __init__(self, path: object, why: str = ""):
        self.path = path
        super().__init__(f"missing checkpoint file {path}" + (f" ({why})" if why else ""))


class MissingExpert(HFCheckpointError):
    """A routed expert (or one of its roles) the config promises but the checkpoint lacks."""

    def __init__(self, layer: int, expert: int | None, what: str):
        self.layer, self.expert = layer, expert
        where = f"layer {layer}" + ("" if expert is None else f" expert {expert}")
        super().__init__(f"{where}: missing {what}")


class InconsistentExperts(HFCheckpointError):
    """Expert tensors whose shape, dtype or count disagree with the config or with each other."""

    def __init__(self, layer: int, expert: int | None, message: str):
        self.layer, self.expert = layer, expert
        where = f"layer {layer}" + ("" if expert is None else f" expert {expert}")
        super().__init__(f"{where}: {message}")


class UnexpectedTensor(HFCheckpointError):
    """A checkpoint tensor that the model of the config has no place for."""


class UnsupportedDtype(HFCheckpointError):
    """A routed expert tensor stored in a dtype a pack cannot hold verbatim."""


class UnrunnableConfig(ValueError):
    """A config whose transformers model would build but not run as the config says (e.g. routing
    settings its router cannot honour); refused before a bundle is written."""

    def __init__(self, model_type: object, setting: str, value: object, reason: str):
        self.model_type, self.setting, self.value = model_type, setting, value
        super().__init__(f"{model_type}: {setting}={value!r} cannot run: {reason}")


class UnsupportedArchitecture(UnknownArchitectureError):
    """A model_type transformers knows but packtools cannot pack and serve exactly: no module of its
    own (packtools.arch.models), and the generic experts-interface path refuses it for `reason`."""

    def __init__(self, model_type: str, reason: str, *, known: Iterable[str] = ()):
        self.model_type, self.reason = model_type, reason
        ValueError.__init__(self, f"model_type {model_type!r} is not supported: {reason}" + (
            f" (architectures with a module of their own: {', '.join(sorted(known))})" if known else ""))
        self.path, self.architecture = None, model_type
