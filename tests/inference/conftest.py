"""Fixtures shared by every inference test module."""

import pytest
import torch
from test_server_fixtures import client, server, tiny_server  # noqa: F401  (fixtures of the server tests)

# triton's interpreter on machines without CUDA is switched on in tests/conftest.py


@pytest.fixture
def one_thread():
    """Tiny matmuls: one thread is far faster than two contending on a loaded 2-core machine."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
