"""Give transformers' dense projections (nn.Linear) the one-row GEMV kernel for decode steps.

A decode step multiplies one row by every attention projection, shared expert and the LM head;
inference.kernels.dense_gemv reads those weights at a higher share of memory bandwidth than
cuBLAS's M=1 kernels. A swapped module computes F.linear as before for every other input (more
than one row, another dtype). The GEMV sums in float32 in another order than cuBLAS and rounds
once: outputs agree with F.linear's to a unit in the last place, not bit for bit. Only for the
fused (GPU) path: the exact path keeps eager's kernels.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from inference.kernels import dense_ops
from inference.kernels.ops import triton_module


def _gemv_forward(self: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if dense_ops.gemv_fits(x, self.weight, self.bias):
        return dense_ops.gemv(x, self.weight, self.bias)
    return F.linear(x, self.weight, self.bias)


# inference.engine.compiled_layers keeps this forward in compiled layers: inductor would call
# cuBLAS for the product, the kernel this forward is there to replace
_gemv_forward.kept_when_compiled = True


def fuse_linears(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Give every nn.Linear (the class itself: subclasses may compute otherwise) whose weight is
    `dtype`, on a device the kernels run on, the GEMV forward; returns how many changed."""
    if triton_module() is None or dtype not in dense_ops.GEMV_DTYPES:
        return 0
    changed = 0
    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == dtype and dense_ops.runs_on(module.weight.device):
            module.forward = types.MethodType(_gemv_forward, module)
            changed += 1
    return changed
