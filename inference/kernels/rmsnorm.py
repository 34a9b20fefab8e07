"""One kernel for transformers' RMSNorm: `weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)`.

An eager RMSNorm is six or seven kernels (casts, pow, mean, add, rsqrt, two multiplies); a
decoder layer has four of them (two around attention, the q and k norms), so in a decode step
replayed as a CUDA graph they are a third of the kernels. Importing this module imports triton.
"""

from __future__ import annotations

import triton
import triton.language as tl

from inference.kernels.quant_dot import round_weights


@triton.jit
def rms_norm_kernel(x_ptr, x_stride, w_ptr, out_ptr, out_stride, H, eps,
                    BLOCK: tl.constexpr, XR: tl.constexpr, WR: tl.constexpr):
    """Row r: y = round_x(x * rsqrt(mean(x^2) + eps)); out = round_out(w * y). XR / WR: the rounding
    of the input dtype and of the output dtype (quant_dot.round_weights codes), done on the bits
    so the compiler cannot turn the products into native bfloat16 arithmetic."""
    row = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, BLOCK)
    mask = h < H
    x = tl.load(x_ptr + row * x_stride + h, mask=mask, other=0.0).to(tl.float32)
    variance = tl.sum(x * x, axis=0) / H
    y = round_weights(x * tl.rsqrt(variance + eps), XR, True)
    w = tl.load(w_ptr + h, mask=mask, other=0.0).to(tl.float32)
    out = round_weights(w * y, WR, True)
    tl.store(out_ptr + row * out_stride + h, out.to(out_ptr.dtype.element_ty), mask=mask)
