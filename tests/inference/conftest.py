"""Fixtures shared by every inference test module."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (the fused experts path) run on the CPU under triton's interpreter; the
    # decision is made when a kernel is decorated, so before any of them is imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is far faster than two contending on a loaded 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
