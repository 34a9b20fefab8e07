"""Checkpoint names -> transformers 5 runtime (state_dict) names for the dense weights.

transformers 5 renames and merges checkpoint tensors while loading (transformers.conversion_mapping):
deepseek_v4 renames nearly every tensor (`attn.wq_a` -> `self_attn.q_a_proj`, `ffn` -> `mlp`,
`head` -> `lm_head`), mixtral and kimi_linear rename `block_sparse_moe` -> `mlp`, and kimi_linear
concatenates `q_conv1d`/`k_conv1d`/`v_conv1d` into one `conv1d`. Rather than re-deriving those
rules we run transformers' own: the transforms of a meta-device model of the config, applied
with the same fallback rule as transformers.core_model_loading.convert_and_load_state_dict_in_model.
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key

from packtools.arch.errors import UnexpectedTensor
from packtools.arch.spec import ArchSpec


@dataclasses.dataclass(frozen=True)
class DensePlan:
    """How one runtime dense tensor is made from checkpoint tensors."""

    runtime_name: str
    sources: tuple[str, ...]  # checkpoint names, in the order the converter consumes them
    converter: WeightConverter | None  # None: a plain rename of sources[0]


def build_meta_model(config: PretrainedConfig) -> torch.nn.Module:
    """The model of `config` with every parameter on the meta device (no memory)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


class RuntimeNames:
    """The dense runtime tensors of one config and how checkpoint names reach them."""

    def __init__(self, config: PretrainedConfig, spec: ArchSpec, meta_model: torch.nn.Module | None = None):
        model = meta_model if meta_model is not None else build_meta_model(config)
        self._meta_state = model.state_dict()
        self.base_model_prefix = model.base_model_prefix
        transforms = get_model_conversion_mapping(model)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._ignore = [re.compile(p) for p in (model._keys_to_ignore_on_load_unexpected or ())]
        # tied targets (lm_head tied to embed_tokens) are not stored in checkpoints
        self.tied_targets = set(getattr(model, "all_tied_weights_keys", {}) or {})
        self.routed = {k for k in self._meta_state if spec.is_routed_runtime_key(k)}
        self.dense = {k: tuple(v.shape) for k, v in self._meta_state.items() if k not in self.routed}

    def is_ignored(self, checkpoint_name: str) -> bool:
        """Tensors transformers drops on load (e.g. deepseek MTP layers)."""
        return any(p.search(checkpoint_name) for p in self._ignore)

    def runtime_name(self, checkpoint_name: str) -> tuple[str, str | None]:
        """(runtime name, matched converter source pattern or None), transformers' rule."""
        renamed, pattern = rename_source_key(
            checkpoint_name, self._renamings, self._converters, self.base_model_prefix, self._meta_state
        )
        if renamed not in self._meta_state and checkpoint_name in self._meta_state:
            # a rename that overshot (e.g. deepseek_v4 `\.norm\.` hitting model.norm): keep the name
            renamed, pattern = rename_source_key(checkpoint_name, [], [], self.base_model_prefix, self._meta_state)
        return renamed, pattern

    def plan(self, checkpoint_names: list[str]) -> list[DensePlan]:
        """Group dense checkpoint tensors into runtime tensors, in runtime state_dict order."""
        sources: dict[str, list[str]] = {}
        converters: dict[str, WeightConverter | None] = {}
        for name in sorted(checkpoint_names, key=dot_natural_key):
            runtime, pattern = self.runtime_name(name)
            if runtime not in self.dense:
                raise UnexpectedTensor(
                    f"checkpoint tensor {name!r} maps to {runtime!r}, which is not a dense weight of the model"
                )
            sources.setdefault(runtime, []).append(name)
            if pattern is None:
                converters[runtime] = None
            else:
                converters[runtime] = next(c for c in self._converters if pattern in c.source_patterns)
        for runtime, names in sources.items():
            if converters[runtime] is None and len(names) > 1:
                raise UnexpectedTensor(f"runtime tensor {runtime!r} comes from several checkpoint tensors {names}")
        order = {name: i for i, name in enumerate(self.dense)}
        return [
            DensePlan(runtime, tuple(sources[runtime]), converters[runtime])
            for runtime in sorted(sources, key=order.__getitem__)
        ]

    def missing(self, plans: list[DensePlan]) -> list[str]:
        """Dense runtime tensors no checkpoint tensor provides (tied ones excepted)."""
        provided = {p.runtime_name for p in plans}
        return [k for k in self.dense if k not in provided and k not in self.tied_targets]

    def load(self, plan: DensePlan, get_tensor: Callable[[str], torch.Tensor]) -> torch.Tensor:
        """Materialize one runtime tensor, running the converter when there is one."""
        if plan.converter is None:
            tensor = get_tensor(plan.sources[0])
        else:
            converter = copy.deepcopy(plan.converter)  # it accumulates state; one per call
            for name in plan.sources:
                _, pattern = converter.rename_source_key(self._renamed_only(name))
                converter.add_tensor(plan.runtime_name, name, pattern, lambda name=name: get_tensor(name))
            tensor = converter.convert(plan.runtime_name)[plan.runtime_name]
        expected = self.dense[plan.runtime_name]
        if tuple(tensor.shape) != expected:
            raise UnexpectedTensor(
                f"{plan.runtime_name!r} from {list(plan.sources)} has shape {tuple(tensor.shape)}, "
                f"the model expects {expected}"
            )
        return tensor

    def _renamed_only(self, checkpoint_name: str) -> str:
        renamed = checkpoint_name
        for renaming in self._renamings:
            renamed, _ = renaming.rename_source_key(renamed)
        return renamed
