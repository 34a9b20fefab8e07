"""torch.compile for the dense part of a captured decode step.

Each decoder layer's forward is compiled by inductor (norms, rotary, the cache write, residuals
and the router fused into fewer kernels); the routed experts stay our own kernels, behind a graph
break at the experts call. The compiled forwards are used only while a step is being captured as
a CUDA graph (StaticDecoder), so each layer compiles once, for the decode shape, and eager code
runs everywhere else. Inductor's fused elementwise kernels round once where eager rounds after
every op: logits agree with the eager model to bfloat16 noise, not bit for bit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module] | None:
    """The decoder layers (`model.model.layers`), or None where the model keeps them elsewhere."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) and len(layers) else None


def why_not_compiled(model: torch.nn.Module) -> str | None:
    if decoder_layers(model) is None:
        return f"{type(model).__name__} keeps no decoder layers at model.layers"
    return None


_COMPILED = "_expertpack_compiled_forward"


@contextlib.contextmanager
def compiled_layers(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every decoder layer runs its compiled forward (compiled on first use)."""
    import torch._dynamo

    from inference.experts.binding import register_experts_implementation

    layers = decoder_layers(model)
    if layers is None:
        raise ValueError(why_not_compiled(model))
    # the layers share one code object: one cache entry per layer (they differ in constants such
    # as the layer index), and more than the default limit of 8 would leave the rest eager
    config = torch._dynamo.config
    config.cache_size_limit = max(config.cache_size_limit, 4 * len(layers))
    config.accumulated_cache_size_limit = max(config.accumulated_cache_size_limit, 16 * len(layers))
    register_experts_implementation(graph_break=True)
    # submodules given a forward of their own (inference.model.fast_norms' Triton RMSNorm) take
    # their class's eager forward back while compiled: inductor fuses it with its neighbours;
    # forwards marked kept_when_compiled (fast_linears' GEMV, fast_routers' selection) stay
    swapped = [(module, module.__dict__.pop("forward")) for layer in layers for module in layer.modules()
               if "forward" in module.__dict__ and not getattr(module.__dict__["forward"], "kept_when_compiled", False)]
    for layer in layers:
        compiled = layer.__dict__.get(_COMPILED)
        if compiled is None:
            compiled = layer.__dict__[_COMPILED] = torch.compile(type(layer).forward.__get__(layer), dynamic=False)
        layer.forward = compiled
    try:
        yield
    finally:
        for layer in layers:
            layer.__dict__.pop("forward", None)
        for module, forward in swapped:
            module.forward = forward
