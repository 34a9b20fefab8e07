"""One record per architecture: everything packtools knows about one MoE model_type.

Each module of packtools.arch.models exports one `ARCHITECTURE`; packtools.arch.registry collects
them. A record holds the Hugging Face side (ArchSpec: layers, expert widths, checkpoint names),
the tiny test config, the routing check, and the GGUF side (GGUFArch: llama.cpp's arch name,
config read and write, dense tensor names), so adding an architecture is one new module.
Nothing but the registry's lookup (packtools.arch.registry.get_architecture) is keyed by
model_type, so a record may also be made rather than written: one per model_type that shares a
generic experts interface, with per-architecture modules only for what differs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from transformers import PretrainedConfig

from packtools.arch.spec import ArchSpec
from packtools.arch.tiny import TinySize
from packtools.gguf.gguf_arch import GGUFArch


@dataclasses.dataclass(frozen=True)
class Architecture:
    spec: ArchSpec
    # the keys of a small, real config of the architecture beyond those every tiny config has
    # (packtools.arch.tiny); AutoModelForCausalLM.from_config builds it and it runs on CPU
    tiny: Callable[[TinySize], dict]
    gguf: GGUFArch | None = None  # None: no GGUF mapping
    # raises UnrunnableConfig where the config's router cannot route as the config says
    # (packtools.arch.routing); None: nothing to check
    check_routing: Callable[[PretrainedConfig, ArchSpec], None] | None = None
    # layers of a synthesized test model by default: enough for every kind of layer to appear
    synth_layers: int = 2

    def __post_init__(self) -> None:
        if self.gguf is not None and self.gguf.model_type != self.spec.model_type:
            raise ValueError(f"{self.spec.model_type}: the GGUF mapping is for {self.gguf.model_type!r}")
        if self.synth_layers < 1:
            raise ValueError(f"{self.spec.model_type}: synth_layers {self.synth_layers} must be >= 1")

    @property
    def model_type(self) -> str:
        return self.spec.model_type

    def with_spec(self, **changes) -> Architecture:
        """This record with its spec's fields changed (e.g. a checkpoint format declared)."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, **changes))

    @property
    def gguf_writable(self) -> bool:
        """packtools can write GGUFs of this architecture (synth), not only read them."""
        return self.gguf is not None and self.gguf.write_config is not None
