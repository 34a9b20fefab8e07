"""Find a model's experts modules, bind each to its layer and expert source, select "expertpack".

transformers does not tell an experts module which layer it belongs to; the layer index is read
from the module's name (`model.layers.7.mlp.experts` -> 7) and recorded on the module.
"""

from __future__ import annotations

import re

import torch
from transformers.integrations.moe import ExpertsInterface

from inference.experts.errors import ExpertLayoutError, ExpertsError
from inference.experts.forward import BINDING_ATTRIBUTE, IMPLEMENTATION_NAME, ExpertsBinding, expertpack_experts_forward
from inference.experts.plan import build_layer_plan
from inference.experts.source import ExpertSource
from inference.kernels.ops import fused_unavailable_reason

_LAYER_IN_NAME = re.compile(r"(?:^|\.)layers\.(\d+)(?:\.|$)")


def register_experts_implementation(*, graph_break: bool = False) -> None:
    """Make "expertpack" a valid experts_implementation (idempotent). graph_break: registered
    behind torch.compiler.disable, so that a compiled decoder layer leaves the experts call to
    our own kernels (inference.engine.compiled_layers); once so, it stays so."""
    if graph_break:
        ExpertsInterface.register(IMPLEMENTATION_NAME, torch.compiler.disable(expertpack_experts_forward))
    elif getattr(ExpertsInterface, "_global_mapping", {}).get(IMPLEMENTATION_NAME) is None:
        ExpertsInterface.register(IMPLEMENTATION_NAME, expertpack_experts_forward)


def is_experts_module(module: torch.nn.Module) -> bool:
    """Whether transformers' @use_experts_implementation decorated this module's class."""
    return all(hasattr(module, flag) for flag in ("has_gate", "has_bias", "is_transposed")) and hasattr(
        module, "down_proj")


def experts_modules(model: torch.nn.Module) -> dict[int, tuple[str, torch.nn.Module]]:
    """layer index -> (module name, experts module), for every routed-experts module of the model."""
    found: dict[int, tuple[str, torch.nn.Module]] = {}
    for name, module in model.named_modules():
        if not is_experts_module(module):
            continue
        match = _LAYER_IN_NAME.search(name)
        if match is None:
            raise ExpertLayoutError(-1, f"experts module {name!r} has no 'layers.<n>' in its name; "
                                    "cannot tell which pack layer feeds it")
        layer = int(match.group(1))
        if layer in found:
            raise ExpertLayoutError(layer, f"two experts modules, {found[layer][0]!r} and {name!r}")
        found[layer] = (name, module)
    return dict(sorted(found.items()))


def routed_parameter_names(model: torch.nn.Module) -> set[str]:
    """state_dict names of the routed expert weights: the experts modules' own parameters."""
    names = set()
    for _, (module_name, module) in experts_modules(model).items():
        names.update(f"{module_name}.{param}" for param, _ in module.named_parameters(recurse=False))
    return names


COMPUTE_MODES = ("auto", "exact", "fused")


def resolve_compute(compute: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the fused kernels compute the experts: "fused" (refused where they cannot run),
    "exact" (never), "auto" (on CUDA with triton; a CPU run under triton's interpreter, which
    tests use, takes the fused path only when asked for)."""
    if compute not in COMPUTE_MODES:
        raise ExpertsError(f"experts compute mode {compute!r} is not one of {COMPUTE_MODES}")
    if compute == "exact":
        return False
    reason = fused_unavailable_reason(device, dtype)
    if compute == "fused" and reason is not None:
        raise ExpertsError(f"experts compute mode 'fused' cannot run here: {reason}")
    return reason is None and (compute == "fused" or device.type == "cuda")


def bind_experts(model: torch.nn.Module, source: ExpertSource, *, moe_layers: list[int], num_experts: int,
                 orientation: str, gate_up_layout: str, fused_kernels: bool = False) -> dict[int, ExpertsBinding]:
    """Attach layer, source and a checked LayerPlan to every experts module; returns them by layer.

    fused_kernels: compute on the fused path (inference.experts.fused); a layer whose weights the
    GEMV cannot read in place uses its dequantize-and-multiply fallback there."""
    modules = experts_modules(model)
    if list(modules) != list(moe_layers):
        raise ExpertLayoutError(-1, f"the model has routed experts in layers {list(modules)}, the bundle in "
                                f"{list(moe_layers)}")
    bindings = {}
    for layer, (_, module) in modules.items():
        plan = build_layer_plan(layer, list(source.layout(layer)), orientation, gate_up_layout, module)
        if plan.target.num_experts != num_experts:
            raise ExpertLayoutError(layer, f"the model has {plan.target.num_experts} experts, the bundle "
                                    f"{num_experts}")
        binding = ExpertsBinding(layer, source, plan, use_fused_kernels=fused_kernels)
        if fused_kernels:
            from inference.experts.fused import fused_plan

            binding.fused, _ = fused_plan(plan)
        setattr(module, BINDING_ATTRIBUTE, binding)
        bindings[layer] = binding
    if fused_kernels and callable(getattr(source, "finish_resident_step", None)):
        model.register_forward_hook(_finish_resident_step_hook(source))
    return bindings


def _finish_resident_step_hook(source):
    """A model forward hook ending the source's resident step (inference.experts.forward) once the
    forward's device work completed: a synchronization the caller is about to make anyway (it
    reads the logits). Not while a CUDA graph is being captured (nothing may synchronize then; a
    captured step reads the slot map under the decoder's own fence)."""
    def hook(module, args, output):
        if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            source.finish_resident_step()
    return hook


def select_expertpack(model) -> None:
    """Register and select the expertpack implementation on a transformers PreTrainedModel."""
    register_experts_implementation()
    model.set_experts_implementation(IMPLEMENTATION_NAME)
    if model.config._experts_implementation != IMPLEMENTATION_NAME:
        raise ExpertsError(f"transformers kept experts_implementation={model.config._experts_implementation!r} "
                           f"after selecting {IMPLEMENTATION_NAME!r}")


def attach_lookahead(model: torch.nn.Module, bindings: dict[int, ExpertsBinding], source: ExpertSource,
                     *, per_token: int, policy=None) -> int:
    """Give each MoE layer but the last a predictor of the next MoE layer's experts, hinted to
    `source` (which must have `prefetch(layer, experts)`) while `policy` (an
    inference.experts.hint_policy.HintPolicy shared by the layers; None: every hint is sent)
    finds them precise enough; the next layer's binding reports its experts to the predictor
    (`hinted_by`). Returns how many layers got one; a layer whose next block has no
    recognisable router gets none."""
    from inference.experts.lookahead import NextLayerPredictor, router_of

    if not callable(getattr(source, "prefetch", None)):
        raise ExpertsError("lookahead: the expert source takes no prefetch hints (the local pack has no cache to "
                           "fill; use --storaged, or --lookahead 0)")
    modules = experts_modules(model)
    layers = list(bindings)
    attached = 0
    for layer, next_layer in zip(layers, layers[1:]):
        name, experts = modules[next_layer]
        block = model.get_submodule(name.rpartition(".")[0])
        target = bindings[next_layer].plan.target
        router = router_of(block, experts, target.num_experts, target.hidden)
        if router is None:
            continue
        predictor = NextLayerPredictor(source, next_layer, router[0], per_token, router[1], policy)
        bindings[layer].predict = predictor
        bindings[next_layer].hinted_by = predictor
        attached += 1
    return attached
