"""Architecture records made, not written: one per model_type whose experts take transformers'
experts interface (`@use_experts_implementation`).

`generic_architecture(model_type)` builds the model of the type's tiny config (packtools.arch.
tiny_generic) on the meta device, finds its experts modules (packtools.arch.generic_spec) and reads
the layout from their flags and parameters: SwiGLU-style `gate_up_proj` [E, 2I, H] (gate rows first)
with `down_proj` [E, H, I]; `up_proj` [E, I, H] alone when the experts have no gate (nemotron_h);
transposed `gate_up_proj` [E, H, 2I] as one in_out role (aria_text). Those bytes
are packed verbatim and the inference client computes with them through the same module (its own
activation and gate), so nothing about the activation has to be known here. Checkpoint names come
from transformers' conversion mapping of that model: the per-expert tensors its converters merge
(`experts.*.gate_proj.weight` ...), the blocks and roots its renamings map onto the runtime ones
(`block_sparse_moe` -> `mlp`, `backbone.` -> `model.`) and whole fused tensors it renames
(granitemoe's `input_linear`). A checkpoint tensor transformers splits into several on load is
refused: packtools' dense reader (packtools.arch.hf_names) cannot split.

Before a record is made, the experts module's own forward is run against transformers' generic
batched experts forward (float64, random weights and routing): a model whose experts compute
anything else (extra scales, zero experts, other gating) is refused, since the expertpack forward
implements the interface, not the model's code. The probe runs the tiny config: a config flag that
changes the experts' arithmetic only at other settings goes unseen, though the activation and gate
are the module's own at run time either way. Every refusal is an `UnsupportedArchitecture`
naming the model type and the reason; the registry prefers a written module
(packtools.arch.models) whenever one exists.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from pathlib import Path

import torch
from transformers import CONFIG_MAPPING, AutoConfig, PretrainedConfig
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming
from transformers.integrations.moe import batched_mm_experts_forward
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from packformat.constants import Role
from packtools.arch.errors import UnsupportedArchitecture
from packtools.arch.generic_spec import ExpertsNotFound, GenericSpec, ModelExperts, model_experts, sparse_layers
from packtools.arch.group_routing import check_groups
from packtools.arch.parts import SWIGLU_FUSED, SWIGLU_LAYOUT
from packtools.arch.record import Architecture
from packtools.arch.spec import ArchSpec, FusedPart
from packtools.arch.tiny import TinySize, tiny_config_kwargs
from packtools.arch.tiny_generic import TOP_K_KEYS, TinyConfigError, shrink_kwargs
from packtools.sources.base import ExpertLayout

# is_transposed: gate_up_proj [E, H, 2I] (gate columns first), down_proj [E, I, H]; a gate/up split
# would cut every row, so the fused weight is one role, computed as x @ W
TRANSPOSED_LAYOUT = ExpertLayout(roles=(Role.GATE_UP, Role.DOWN), orientation="in_out", gate_up="concat")
TRANSPOSED_FUSED = {"gate_up_proj": FusedPart((Role.GATE_UP,)), "down_proj": FusedPart((Role.DOWN,))}
UP_DOWN_LAYOUT = ExpertLayout(roles=(Role.UP, Role.DOWN), orientation="out_in", gate_up="concat")
UP_DOWN_FUSED = {"up_proj": FusedPart((Role.UP,)), "down_proj": FusedPart((Role.DOWN,))}
_PART_IN_PATTERN = re.compile(r"experts\\?\.\*\\?\.(\w+)\\?\.weight$")
_PROBE_SIZE = TinySize(hidden_size=64, num_layers=2, num_experts=8, top_k=2, moe_intermediate_size=32,
                       vocab_size=512)


def tiny_model_config(model_type: str, size: TinySize) -> PretrainedConfig:
    return AutoConfig.for_model(model_type, **tiny_config_kwargs(functools.partial(shrink_kwargs, model_type), size))


def _refuse(model_type: str, reason: str) -> UnsupportedArchitecture:
    return UnsupportedArchitecture(model_type, " ".join(reason.split()))  # one line, whatever transformers said


def _meta_model(model_type: str, config: PretrainedConfig) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config)
    except Exception as exc:  # transformers' own error, whatever it is, is the reason
        raise _refuse(model_type, f"its tiny model does not build: {type(exc).__name__}: {exc}") from exc


def _layout(model_type: str, module: torch.nn.Module) -> tuple[ExpertLayout, dict[str, FusedPart]]:
    flags = {flag: bool(getattr(module, flag, False)) for flag in ("has_gate", "has_bias", "is_transposed")}
    flags["is_concatenated"] = bool(getattr(module, "is_concatenated", True))
    params = {name for name, _ in module.named_parameters(recurse=False)}
    if flags["has_bias"] or not flags["is_concatenated"] or flags["is_transposed"] and not flags["has_gate"]:
        raise _refuse(model_type, f"experts flags {flags}: only bias-free experts with gate before up (or no "
                                  "gate, untransposed) are read generically (gpt_oss has its own module)")
    if flags["is_transposed"]:
        layout, fused = TRANSPOSED_LAYOUT, TRANSPOSED_FUSED
    else:
        layout, fused = (SWIGLU_LAYOUT, SWIGLU_FUSED) if flags["has_gate"] else (UP_DOWN_LAYOUT, UP_DOWN_FUSED)
    if params != set(fused):
        raise _refuse(model_type, f"experts parameters {sorted(params)}, expected exactly {sorted(fused)}")
    return layout, fused


def _probe_forward(model_type: str, module: torch.nn.Module, found: ModelExperts) -> None:
    """Refuse experts whose own forward is not the interface's arithmetic (float64, random weights)."""
    original = getattr(type(module).forward, "__wrapped__", None)
    if original is None:
        raise _refuse(model_type, f"{type(module).__name__}.forward does not dispatch through the experts interface")
    generator = torch.Generator().manual_seed(0)
    probe = module.to_empty(device="cpu").to(torch.float64)
    with torch.no_grad():
        for _, param in probe.named_parameters():
            param.copy_(torch.randn(param.shape, generator=generator, dtype=torch.float64) * 0.2)
    tokens, top_k = 6, 2
    hidden = torch.randn(tokens, found.hidden, generator=generator, dtype=torch.float64)
    index = torch.stack([torch.randperm(found.num_experts, generator=generator)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=generator, dtype=torch.float64)
    try:
        with torch.no_grad():
            own = original(probe, hidden, index, weights)
            interface = batched_mm_experts_forward(probe, hidden, index, weights)
    except Exception as exc:
        raise _refuse(model_type, f"its experts forward cannot be probed: {type(exc).__name__}: {exc}") from exc
    if not isinstance(own, torch.Tensor) or own.shape != interface.shape or not torch.allclose(
            own, interface, rtol=1e-9, atol=1e-9):
        raise _refuse(model_type, f"{type(module).__name__}'s forward computes something other than the experts "
                                  "interface's gate_up -> gate -> down, weighted sum")


@dataclasses.dataclass(frozen=True)
class CheckpointNames:
    """How routed expert tensors are named in checkpoints, read from transformers' conversion mapping."""

    blocks: tuple[str, ...]  # between "layers.N." and ".experts": the runtime block first, then renamed ones
    prefixes: tuple[str, ...]  # before "layers.N.": "model.", renamed roots ("backbone."), ""
    per_expert: dict[str, Role]  # per-expert part merged on load -> role
    aliases: dict[str, str]  # whole fused tensor renamed on load: name after "layers.N." -> runtime part


def _renamed(renamings: list[WeightRenaming], name: str) -> str:
    for renaming in renamings:
        name, _ = renaming.rename_source_key(name)
    return name


def _checkpoint_names(model: torch.nn.Module, container: str, fused: dict[str, FusedPart]) -> CheckpointNames:
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    block = f"{container}." if container else ""  # gemma4_text: model.layers.N.experts
    per_expert: dict[str, Role] = {}
    for converter in (t for t in transforms if isinstance(t, WeightConverter)):
        targets = converter.target_patterns
        target = (targets[0] if len(targets) == 1 else "").replace("\\", "")
        part = next((p for p in fused if target.endswith(f"experts.{p}")), None)
        names = [m.group(1) for m in map(_PART_IN_PATTERN.search, converter.source_patterns) if m]
        if part is not None and len(names) == len(converter.source_patterns) == fused[part].splits:
            per_expert.update(zip(names, fused[part].roles))
    aliases: dict[str, str] = {}
    for renaming in renamings:
        target = renaming.target_patterns[0].replace("\\", "") if len(renaming.target_patterns) == 1 else ""
        part = next((p for p in fused if target == f"{block}experts.{p}"), None)
        source = renaming.source_patterns[0] if len(renaming.source_patterns) == 1 else ""
        if part is not None and re.fullmatch(r"(?:\w+\\\.)+\w+", source):
            aliases[source.replace("\\", "")] = part
    # candidate words: every identifier the renamings match; kept where they rename onto ours
    words = sorted({w for t in renamings for p in t.source_patterns for w in re.findall(r"[A-Za-z_]\w*", p)})
    runtime = f"model.layers.0.{block}experts.0.x.weight"
    blocks = [container] + [w for w in words if w != container
                            and _renamed(renamings, f"model.layers.0.{w}.experts.0.x.weight") == runtime]
    # roots of one or two words ("backbone.", a multimodal checkpoint's "model.language_model.")
    candidates = dict.fromkeys(r for w in words if w != "model" for r in (f"{w}.", f"model.{w}.", f"{w}.model."))
    roots = [r for r in candidates if _renamed(renamings, f"{r}layers.0.{block}experts.0.x.weight") == runtime]
    return CheckpointNames(tuple(blocks), ("model.", *roots, ""), per_expert, aliases)


def _refuse_splits(model_type: str, model: torch.nn.Module) -> None:
    # packtools' dense reader (packtools.arch.hf_names) makes each runtime tensor from one checkpoint
    # tensor or merges several into one; it cannot split one into several
    for converter in get_model_conversion_mapping(model):
        if isinstance(converter, WeightConverter) and len(converter.target_patterns) > 1:
            raise _refuse(model_type, f"transformers splits checkpoint tensor {converter.source_patterns} into "
                                      f"{converter.target_patterns} on load; packtools' dense reader cannot split")


def _top_k_key(model_type: str, config: PretrainedConfig) -> str:
    for key in TOP_K_KEYS:
        if isinstance(getattr(config, key, None), int):
            return key
    raise _refuse(model_type, f"its config names top-k by none of {TOP_K_KEYS}")


def _check_groups(config: PretrainedConfig, spec: ArchSpec) -> None:
    # group-limited routers of the interface's model types score a group by its two best experts
    # (DeepSeek-V3's rule); a config without groups routes over all experts
    config = config.get_text_config()
    if isinstance(getattr(config, "n_group", None), int) and isinstance(getattr(config, "topk_group", None), int):
        check_groups(config, spec, group_key="n_group", min_group_size=2)


def generic_architecture(model_type: str) -> Architecture:
    """The record of `model_type` made from its transformers model; UnsupportedArchitecture if none can be."""
    if model_type not in CONFIG_MAPPING:
        raise _refuse(model_type, "transformers has no config class for it")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise _refuse(model_type, "transformers has no causal-LM model for it (AutoModelForCausalLM)")
    try:
        config = tiny_model_config(model_type, _PROBE_SIZE)
    except TinyConfigError as exc:
        raise _refuse(model_type, str(exc).partition(": ")[2]) from exc
    except Exception as exc:
        raise _refuse(model_type, f"its shrunk config is invalid: {type(exc).__name__}: {exc}") from exc
    model = _meta_model(model_type, config)
    sub_configs = sorted(getattr(model.config, "sub_configs", None) or ())
    if sub_configs:  # a composite config whose causal LM is not its text model alone (gemma4)
        raise _refuse(model_type, f"its causal-LM model {type(model).__name__} is multimodal ({', '.join(sub_configs)}); "
                                  "packtools packs text models")
    try:
        found = model_experts(model)
    except ExpertsNotFound as exc:
        raise _refuse(model_type, str(exc)) from exc
    config = model.config  # a composite config's text config: the model's own
    layout, fused = _layout(model_type, found.module)
    names = _checkpoint_names(model, found.container, fused)
    _refuse_splits(model_type, model)
    _probe_forward(model_type, found.module, found)
    spec = GenericSpec(
        model_type=model_type,
        layout=layout,
        num_experts_attr=next((k for k in ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
                               if isinstance(getattr(config, k, None), int)), "num_experts"),
        moe_intermediate_attr="moe_intermediate_size" if hasattr(config, "moe_intermediate_size")
        else "intermediate_size",
        moe_layer_rule=sparse_layers,
        containers=names.blocks,
        per_expert_parts=names.per_expert,
        fused_parts=fused,
        fused_aliases=names.aliases,
        checkpoint_prefixes=names.prefixes,
        top_k_attr=_top_k_key(model_type, config),
        notes=f"generic: {type(found.module).__name__} through transformers' experts interface",
    )
    return Architecture(spec=spec, tiny=functools.partial(shrink_kwargs, model_type), check_routing=_check_groups)


def experts_interface_model_types() -> list[str]:
    """Every model_type transformers has a causal-LM model for whose modeling module marks an experts
    class with @use_experts_implementation (read from the installed transformers' source files)."""
    import transformers
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    models = Path(transformers.__file__).parent / "models"
    marked = {path.parent.name for path in models.glob("*/modeling_*.py")
              if "@use_experts_implementation" in path.read_text(encoding="utf-8")}
    return sorted(t for t in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES if model_type_to_module_name(t) in marked)
