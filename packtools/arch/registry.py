"""The MoE architectures packtools supports, keyed by transformers `model_type`.

Every module of packtools.arch.models (but the "_" ones) exports one Architecture record; this
registry collects them. A model_type without one is served through transformers' experts
interface when packtools.arch.generic can make its record (made once, on first lookup); a written
module always wins over the generic record. Tables elsewhere (the GGUF arch names, config readers and writers, tensor
respellings, routing checks, tests' architecture lists) read the records rather than keep their own.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil

from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig

import inference.models  # noqa: F401  (registers model types transformers lacks, e.g. kimi_k3)
import packtools.arch.models as architecture_modules
from packtools.arch.errors import UnknownArchitectureError, UnsupportedArchitecture
from packtools.arch.record import Architecture
from packtools.arch.spec import ArchSpec
from packtools.arch.tiny import TinySize, tiny_config_kwargs


def _collect() -> dict[str, Architecture]:
    records: dict[str, Architecture] = {}
    for module_info in sorted(pkgutil.iter_modules(architecture_modules.__path__), key=lambda m: m.name):
        if module_info.name.startswith("_"):
            continue
        module = importlib.import_module(f"{architecture_modules.__name__}.{module_info.name}")
        record = getattr(module, "ARCHITECTURE", None)
        if not isinstance(record, Architecture):
            raise TypeError(f"{module.__name__} must export ARCHITECTURE, an Architecture record")
        if record.model_type != module_info.name:
            raise ValueError(f"{module.__name__} exports the record of {record.model_type!r}; an architecture "
                             "module is named after its model_type")
        records[record.model_type] = record
    return records


# model_type -> record; tests may register one more (monkeypatch.setitem), every lookup reads this
ARCHITECTURES: dict[str, Architecture] = _collect()


# model_type -> its generic record, or the UnsupportedArchitecture that refused it
_GENERIC: dict[str, Architecture | UnknownArchitectureError] = {}


def get_architecture(model_type: str) -> Architecture:
    """The written record of `model_type`, else the generic one (packtools.arch.generic); raises
    UnknownArchitectureError for a type transformers lacks, UnsupportedArchitecture (a subclass,
    with the reason) for one the generic path refuses."""
    record = ARCHITECTURES.get(model_type)
    if record is not None:
        return record
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise UnknownArchitectureError(None, model_type, known=ARCHITECTURES)
    if model_type not in _GENERIC:
        from packtools.arch.generic import generic_architecture

        try:
            _GENERIC[model_type] = generic_architecture(model_type)
        except UnsupportedArchitecture as exc:
            _GENERIC[model_type] = UnsupportedArchitecture(model_type, exc.reason, known=ARCHITECTURES)
    found = _GENERIC[model_type]
    if isinstance(found, Exception):
        raise found
    return found


def coverage() -> dict[str, Architecture | UnknownArchitectureError]:
    """Every model_type packtools has a module for or transformers marks as using its experts
    interface -> its record, or the error that refuses it (generic records are made here)."""
    from packtools.arch.generic import experts_interface_model_types

    found: dict[str, Architecture | UnknownArchitectureError] = {}
    for model_type in sorted(set(ARCHITECTURES) | set(experts_interface_model_types())):
        try:
            found[model_type] = get_architecture(model_type)
        except UnknownArchitectureError as exc:
            found[model_type] = exc
    return found


def supported_model_types() -> list[str]:
    """The model_types packtools builds and serves: a module of their own or a generic record."""
    return [t for t, record in coverage().items() if isinstance(record, Architecture)]


def get_arch(model_type: str) -> ArchSpec:
    """The Hugging Face side of the architecture (its record's spec)."""
    return get_architecture(model_type).spec


def config_from_dict(config: dict) -> PretrainedConfig:
    """A transformers config object from config.json contents (aliases and defaults resolved)."""
    model_type = config.get("model_type")
    get_arch(model_type)
    # a deep copy: configs may edit the nested dicts they are given (transformers 5.17's
    # DeepseekV4Config adds rope_theta and partial_rotary_factor to rope_parameters), which would
    # change the caller's config.json contents, e.g. the bundle's copy of it
    kwargs = copy.deepcopy({k: v for k, v in config.items() if k != "model_type"})
    # transformers writes inf and nan as {"__float__": "Infinity"} (nemotron_h's time_step_limit) and
    # decodes them when it reads config.json; so must we
    decode = getattr(PretrainedConfig, "_decode_special_floats", None)
    if decode is not None:
        kwargs = decode(kwargs)
    return AutoConfig.for_model(model_type, **kwargs)


def tiny_config(
    arch: str,
    *,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_experts: int = 8,
    top_k: int = 2,
    moe_intermediate_size: int = 32,
    vocab_size: int = 512,
) -> PretrainedConfig:
    """A small, real config of `arch` (deterministic: it depends on the arguments only).

    Routed experts sit in every layer the architecture allows (deepseek_v2/v3 keep their first layer
    dense when num_layers >= 2; deepseek_v4's first layer is hash-routed). Builds with
    AutoModelForCausalLM.from_config and runs on CPU in float32; hidden_size=4096,
    num_experts=256, moe_intermediate_size=2048 give full-width layers.
    """
    record = get_architecture(arch)
    size = TinySize(hidden_size, num_layers, num_experts, top_k, moe_intermediate_size, vocab_size)
    return AutoConfig.for_model(arch, **tiny_config_kwargs(record.tiny, size))
