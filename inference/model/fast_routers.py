"""Give transformers' softmax top-k routers one GEMV and one kernel for a decode step's token.

A router qualifies when it looks like one (a 2-D `weight` of [experts, hidden], an integer
`top_k`, a forward of the hidden states alone returning (logits, scores, expert ids)) and,
checked on random rows in the model's dtype, the fused computation (inference.kernels.dense_gemv
for the logits, router_topk for softmax, top-k and the optional renormalization) picks the same
experts with scores within a unit in the last place of the module's own; whether the module
renormalizes and whether its scores stay float32 is found by that check (all four are tried).
Routers of another formula (sigmoid scores, bias-corrected or grouped selection) fail it and
keep their forward. A swapped router computes as before for more than one row. Only for the
fused (GPU) path.
"""

from __future__ import annotations

import inspect
import types

import torch

from inference.kernels import dense_ops
from inference.kernels.ops import triton_module


def _choose(self: torch.nn.Module, logits: torch.Tensor, renormalize: bool, float_scores: bool):
    return dense_ops.softmax_topk(logits, self.top_k, renormalize=renormalize,
                                  dtype=torch.float32 if float_scores else logits.dtype)


def _fused(self: torch.nn.Module, hidden_states: torch.Tensor, renormalize: bool, float_scores: bool):
    logits = dense_ops.gemv(hidden_states.reshape(-1, self.weight.shape[1]), self.weight, _bias(self))  # [1, E]
    return logits, *_choose(self, logits, renormalize, float_scores)


def _bias(module: torch.nn.Module) -> torch.Tensor | None:
    """The router's logit bias (gpt-oss), added by its linear layer: a `bias` of [experts]."""
    bias = getattr(module, "bias", None)
    return bias if isinstance(bias, torch.Tensor) else None


def _fused_forward(self: torch.nn.Module, hidden_states: torch.Tensor):
    if hidden_states.numel() == self.weight.shape[1] and dense_ops.gemv_fits(
            hidden_states.reshape(1, -1), self.weight, _bias(self)):
        return _fused(self, hidden_states, *self._expertpack_router_variant)
    return type(self).forward(self, hidden_states)


# inference.engine.compiled_layers keeps this forward in compiled layers: the point is fewer kernels
_fused_forward.kept_when_compiled = True


def _looks_like_router(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    top_k = getattr(module, "top_k", None)
    if not (isinstance(weight, torch.nn.Parameter) and weight.dim() == 2 and weight.device.type != "meta"
            and isinstance(top_k, int) and not isinstance(top_k, bool) and 0 < top_k <= weight.shape[0]
            and "forward" not in module.__dict__):
        return False
    bias = getattr(module, "bias", None)
    if bias is not None and not (isinstance(bias, torch.Tensor) and bias.shape == weight.shape[:1]):
        return False  # a bias the fused logits would not add as a linear layer does
    parameters = list(inspect.signature(module.forward).parameters.values())
    return len(parameters) == 1 and parameters[0].kind in (inspect.Parameter.POSITIONAL_ONLY,
                                                            inspect.Parameter.POSITIONAL_OR_KEYWORD)


VARIANTS = [(renormalize, float_scores) for renormalize in (True, False) for float_scores in (False, True)]


def _agreeing_variant(module: torch.nn.Module, dtype: torch.dtype) -> tuple[bool, bool] | None:
    """The (renormalize, float32 scores) that makes the fused computation agree with the module
    on random rows, or None when none does."""
    hidden = module.weight.shape[1]
    rows = torch.randn(8, hidden, generator=torch.Generator().manual_seed(0)).to(module.weight.device, dtype)
    with torch.no_grad():
        try:
            expected = [module.forward(row.view(1, hidden)) for row in rows]
        except Exception:  # a router that needs more than the hidden states
            return None
        # the fused logits are the GEMV's, in the weight's dtype: a module computing them in
        # another (float32 routers) is not what the fused forward would compute
        if not all(isinstance(out, tuple) and len(out) == 3 and out[0].dtype == dtype for out in expected):
            return None
        # logits of a plain linear layer (a router that scales them or adds noise is another)
        for row, out in zip(rows, expected):
            logits, want = _fused(module, row.view(1, hidden), True, False)[0].float(), out[0].float()
            if logits.shape != want.shape or ((logits - want).abs()
                                              > want.abs() * 2.0 ** -7 + want.abs().max() * 2.0 ** -12).any():
                return None
        # the selection's formula, from the module's own logits (the GEMV is tested on its own:
        # its logits may differ from cuBLAS's by an ulp, and a score with them)
        for variant in VARIANTS:
            if all(_same_choice(out, _choose(module, out[0].reshape(1, -1), *variant))
                   for out in expected):
                return variant
    return None


def _same_choice(expected, got) -> bool:
    """The same experts (up to ties: where probabilities are equal, torch.topk may order them or
    take them otherwise) with the same scores, to an ulp of the scores' dtype."""
    logits, scores, indices = expected
    fused_scores, fused_indices = got
    if fused_indices.shape != indices.shape or fused_scores.dtype != scores.dtype:
        return False
    row = logits.reshape(-1)
    theirs, ours = indices.reshape(-1).to(torch.int64), fused_indices.reshape(-1)
    if not torch.equal(row[theirs].sort().values, row[ours].sort().values):
        return False
    precision = {torch.bfloat16: 2.0 ** -7, torch.float16: 2.0 ** -10}.get(scores.dtype, 2.0 ** -20)
    expected_scores = scores.reshape(-1).float().sort().values
    fused = fused_scores.reshape(-1).float().sort().values
    return bool(((fused - expected_scores).abs() <= expected_scores.abs() * precision).all())


def fuse_routers(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every qualifying router the fused forward; returns how many changed."""
    if triton_module() is None or dtype not in dense_ops.GEMV_DTYPES:
        return 0
    changed = 0
    checked: dict[type, tuple[bool, bool] | None] = {}
    for module in model.modules():
        if not _looks_like_router(module) or module.weight.dtype != dtype \
                or not dense_ops.runs_on(module.weight.device):
            continue
        kind = type(module)
        if kind not in checked:
            checked[kind] = _agreeing_variant(module, dtype)
        if checked[kind] is not None:
            module._expertpack_router_variant = checked[kind]
            module.forward = types.MethodType(_fused_forward, module)
            changed += 1
    return changed
