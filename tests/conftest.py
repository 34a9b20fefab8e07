"""Set-up every test package shares, loaded before any test module is collected."""

import os

import torch

if not torch.cuda.is_available():
    # Triton kernels (the fused experts path) run on the CPU under triton's interpreter. The
    # decision is made when triton and each kernel are first imported, and a test module of any
    # package may import them while being collected (tests/bench imports the serving stack), so
    # it is made here, before the first collection.
    os.environ.setdefault("TRITON_INTERPRET", "1")
