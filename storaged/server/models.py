"""The models a daemon serves: their bundles, opened and validated once at start-up."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from packformat import PackError, PackReader
from packformat.bundle import Bundle, BundleError, open_bundle
from packformat.index import ObjectEntry, RoleEntry
from storaged.policy.keys import ModelLayout


class ModelOpenError(Exception):
    """A configured bundle cannot be served; names the model and the bundle problem."""

    def __init__(self, model: str, path: Path, problem: str):
        super().__init__(f"model {model!r}: {problem}")  # bundle errors name the file themselves
        self.model = model
        self.path = path


@dataclass(frozen=True)
class LayerObjects:
    """The role layout shared by a layer's objects, and the experts that differ from it."""

    layer: int
    common: ObjectEntry  # expert 0's entry: its size and roles are the layer's common layout
    overrides: tuple[ObjectEntry, ...]  # experts whose size or roles differ from `common`


@dataclass
class ServedModel:
    name: str
    model_id: int  # the policy's integer model key (position in the configuration)
    bundle: Bundle
    layers: tuple[LayerObjects, ...]  # one per MoE layer, ascending

    @property
    def pack(self) -> PackReader:
        return self.bundle.pack

    @property
    def model_type(self) -> str:
        return str(self.bundle.config.get("model_type", ""))

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(self.pack.layers)

    @property
    def expert_count(self) -> int:
        return self.pack.header.expert_count

    @property
    def max_object_bytes(self) -> int:
        return self.pack.max_object_size

    def policy_layout(self, max_ids_per_acquire: int) -> ModelLayout:
        return ModelLayout(frozenset(self.moe_layers), self.expert_count, max_ids_per_acquire)

    def close(self) -> None:
        self.bundle.close()


def _role_key(roles: tuple[RoleEntry, ...]) -> tuple:
    return tuple((r.role, r.element_type, r.offset, r.nbytes, r.shape) for r in roles)


def _layer_objects(pack: PackReader, layer: int) -> LayerObjects:
    entries = [pack.entry(layer, expert) for expert in range(pack.header.expert_count)]
    common = entries[0]
    signature = (common.size, _role_key(common.roles))
    overrides = tuple(e for e in entries[1:] if (e.size, _role_key(e.roles)) != signature)
    return LayerObjects(layer, common, overrides)


def open_models(models: Mapping[str, Path]) -> dict[str, ServedModel]:
    """Open and validate every bundle; on any failure close what was opened and raise."""
    served: dict[str, ServedModel] = {}
    try:
        for model_id, (name, path) in enumerate(models.items()):
            try:
                bundle = open_bundle(path)
            except (BundleError, PackError) as exc:
                raise ModelOpenError(name, path, str(exc)) from None
            layers = tuple(_layer_objects(bundle.pack, layer) for layer in bundle.pack.layers)
            served[name] = ServedModel(name, model_id, bundle, layers)
    except BaseException:
        for model in served.values():
            model.close()
        raise
    return served
