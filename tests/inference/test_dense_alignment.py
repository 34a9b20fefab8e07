"""load_dense starts every tensor on a 64-byte boundary, so equal values give transformers' bits.

safetensors maps the file and a build places tensors on any 8-byte step; a kernel that sums
unaligned rows in another order then gives other bits from identical weights (qwen2_moe's shared
expert gate differed from transformers' by 3e-7 that way).
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dense_alignment_probe import ALIGNMENT, misalign_dense
from test_model_fixtures import make_case

from inference.experts import LocalPackSource, routed_parameter_names
from inference.model import load_model

pytestmark = pytest.mark.usefixtures("one_thread")
HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_every_loaded_tensor_is_aligned_even_when_the_file_maps_them_unaligned(tmp_path):
    reference, bundle_dir = make_case("qwen2_moe", tmp_path / "b")
    assert misalign_dense(bundle_dir) > 0  # otherwise this test proves nothing
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        model = loaded.model
        routed = routed_parameter_names(model)
        loaded_tensors = [(name, tensor) for name, tensor in itertools.chain(model.state_dict().items(),
                                                                             model.named_buffers())
                          if name not in routed]
        unaligned = [name for name, tensor in loaded_tensors if tensor.data_ptr() % ALIGNMENT]
        assert not unaligned, unaligned
        expected = reference.state_dict()
        assert all(torch.equal(tensor, expected[name]) for name, tensor in model.state_dict().items()
                   if name not in routed)


@pytest.mark.slow  # a subprocess loading the reference model and ours: ~15 s
def test_dense_linears_give_transformers_bits_with_an_alignment_sensitive_gemv(tmp_path):
    """In a process where MKL uses its SSE4.2 kernels, whose GEMV sums unaligned rows in another
    order: every dense Linear on the hidden state (attention projections, routers, shared expert
    and its gate) gives, for 1 to 16 tokens, exactly the bits of the reference model's."""
    env = {**os.environ, "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
           "PYTHONPATH": os.pathsep.join([str(REPO), str(HERE), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run([sys.executable, str(HERE / "dense_alignment_probe.py"), str(tmp_path)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["mapped_unaligned"] > 0 and result["compared"] >= 6, result
    if not result["unaligned_differs"]:
        pytest.skip("this machine's BLAS gives an unaligned [1, H] weight the same bits (no MKL, or it ignores "
                    "MKL_ENABLE_INSTRUCTIONS): alignment cannot change a result here")
    assert result["differing"] == [], result
