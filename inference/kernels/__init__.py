"""Device kernels of the experts forward: a GEMV that reads quantized weights in place from
arena slots, and the combine (inference.kernels.ops launches them; moe_triton holds the Triton
code, quant_dot the per-type block arithmetic)."""
