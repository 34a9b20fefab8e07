"""inference.engine.compiled_layers: which submodule forwards compiled decoder layers keep. The
fused RMSNorm gives way to the class's forward (inductor fuses it with its neighbours); the
dense GEMV and the fused router stay (custom ops, the kernels they are there for). Checked on
the modules' forwards inside the block, without compiling anything."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from inference.engine.compiled_layers import compiled_layers
from inference.model.fast_linears import fuse_linears
from inference.model.fast_norms import fuse_rms_norms
from inference.model.fast_routers import fuse_routers
from packtools.arch import tiny_config


def test_compiled_layers_keep_the_dense_kernels_and_give_norms_back():
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16).eval()
    assert fuse_linears(model, torch.bfloat16) > 0 and fuse_routers(model, torch.bfloat16) > 0
    assert fuse_rms_norms(model, torch.bfloat16) > 0
    layer_modules = [m for layer in model.model.layers for m in layer.modules()]
    linears = [m for m in layer_modules if type(m) is torch.nn.Linear]
    routers = [m for m in layer_modules if type(m).__name__.endswith("TopKRouter")]
    layer_norms = [m for m in layer_modules if "RMSNorm" in type(m).__name__]
    before = {id(m): m.__dict__["forward"] for m in linears + routers + layer_norms}
    with compiled_layers(model):
        assert all("forward" in m.__dict__ for m in linears + routers)
        assert not any("forward" in m.__dict__ for m in layer_norms)
        assert all("forward" in layer.__dict__ for layer in model.model.layers)  # the compiled forward
    assert all(m.__dict__["forward"] is before[id(m)] for m in linears + routers + layer_norms)
    assert not any("forward" in layer.__dict__ for layer in model.model.layers)
