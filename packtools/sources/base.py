"""What a checkpoint source gives the bundle builder.

A source is a GGUF file set or a Hugging Face directory. The builder only sees this
interface, so both kinds of checkpoint go through one writer and one set of checks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Protocol

import torch

from packformat.constants import Role


@dataclasses.dataclass(frozen=True)
class RoleSlice:
    """One role of one expert as it lies in the source, read lazily."""

    role: Role
    element_type: int  # packformat.constants.ElementType id (GGML ids and the pack's own)
    shape: tuple[int, ...]  # logical element shape, last dim contiguous (e.g. [I, H])
    nbytes: int
    read: Callable[[], memoryview | bytes]  # exactly nbytes of source bytes, verbatim


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """How the roles of an object are to be interpreted (recorded in manifest.json)."""

    roles: tuple[Role, ...]  # the roles of every object, in object order
    # "out_in": matrices are [out_features, in_features] (nn.Linear, GGUF);
    # "in_out": transposed, [in_features, out_features] (gpt_oss in transformers).
    orientation: str = "out_in"
    # "concat": GATE_UP rows/cols are gate then up; "interleaved": gate = [..., ::2], up = [..., 1::2].
    gate_up: str = "concat"


@dataclasses.dataclass(frozen=True)
class DenseTensor:
    """One non-routed weight, under the name the transformers model's state_dict uses."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    load: Callable[[], torch.Tensor]  # materializes only this tensor


class CheckpointSource(Protocol):
    kind: str  # "gguf" | "hf"

    def hf_config(self) -> dict:
        """The transformers config.json contents (mapped from GGUF metadata for GGUF)."""

    def moe_layers(self) -> list[int]:
        """Model layer indices that have routed experts, ascending."""

    def num_experts(self) -> int: ...

    def expert_layout(self) -> ExpertLayout: ...

    def expert_roles(self, layer: int, expert: int) -> list[RoleSlice]:
        """The roles of (layer, expert), in expert_layout().roles order."""

    def dense_tensors(self) -> Iterator[DenseTensor]:
        """Every non-routed weight, each loadable on its own (bounded memory)."""

    def write_tokenizer(self, out_dir: Path) -> dict:
        """Write tokenizer files into out_dir; return {"files": [...], "origin": str, "note": str}."""

    def identity(self) -> dict:
        """Source identity for the manifest: files with sizes and content hashes."""

    def close(self) -> None: ...
