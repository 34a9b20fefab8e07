"""Dense weights stored off a 64-byte boundary, and a probe of their bits in a fresh process.

`misalign_dense` rewrites a bundle's dense.safetensors so that its data section (and with it
every tensor of a tiny model, whose tensors are multiples of 64 bytes) starts at 56 mod 64, as
packtools' builds can place them. Run as a script, this module compares a qwen2_moe bundle's
dense Linear layers with transformers' own in a process whose MKL was told, before torch loaded
it, to use its SSE4.2 kernels (MKL_ENABLE_INSTRUCTIONS, set by the caller): their GEMV sums
unaligned rows in another order, as the default kernels of some CPUs do.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save

ALIGNMENT = 64
MISALIGNED_BY = 56  # what the issue measured: data_ptr % 64 == 56


def misalign_dense(bundle_dir: Path) -> int:
    """Rewrite dense.safetensors with its data section at MISALIGNED_BY mod ALIGNMENT (a metadata
    entry of the right length shifts it); returns how many tensors the file now maps unaligned."""
    path = bundle_dir / "dense.safetensors"
    tensors = load_file(path)
    for pad in range(ALIGNMENT):
        blob = save(tensors, metadata={"pad": "x" * pad})
        data_start = 8 + int.from_bytes(blob[:8], "little")
        if data_start % ALIGNMENT == MISALIGNED_BY:
            break
    else:
        raise AssertionError("no metadata length puts the data section at the wanted offset")
    path.write_bytes(blob)
    manifest = json.loads((bundle_dir / "manifest.json").read_text())
    manifest["dense"]["size"] = path.stat().st_size
    (bundle_dir / "manifest.json").write_text(json.dumps(manifest))
    with safe_open(str(path), framework="pt", device="cpu") as dense:  # maps the file, as load_dense does
        return sum(dense.get_tensor(key).data_ptr() % ALIGNMENT != 0 for key in dense.keys())


def _unaligned_copy(tensor: torch.Tensor) -> torch.Tensor:
    storage = torch.empty(tensor.numel() + ALIGNMENT // tensor.element_size(), dtype=tensor.dtype)
    skip = (MISALIGNED_BY - storage.data_ptr() % ALIGNMENT) % ALIGNMENT // tensor.element_size()
    copy = storage[skip:skip + tensor.numel()].view(tensor.shape)
    copy.copy_(tensor)
    return copy


@torch.no_grad()
def probe(work: Path) -> dict:
    """Every dense nn.Linear on the hidden state of the loaded bundle against the reference's."""
    from test_model_fixtures import make_case

    from inference.experts import LocalPackSource
    from inference.model import load_model

    torch.set_num_threads(1)
    reference, bundle_dir = make_case("qwen2_moe", work / "bundle")
    mapped_unaligned = misalign_dense(bundle_dir)
    linears = {name: module for name, module in reference.named_modules() if isinstance(module, torch.nn.Linear)}
    generator = torch.Generator().manual_seed(3)
    # 1 to 16 tokens: decode steps and short prefills (MKL picks GEMV or GEMM kernels by shape)
    inputs = [torch.randn(tokens, reference.config.hidden_size, generator=generator) for tokens in range(1, 17)]
    differing = []
    with load_model(bundle_dir, device="cpu", dtype=torch.float32, expert_source=LocalPackSource) as loaded:
        ours = dict(loaded.model.named_modules())
        for name, module in linears.items():
            if module.in_features != reference.config.hidden_size:
                continue
            if any(not torch.equal(ours[name](x), module(x)) for x in inputs):  # x [T, H]
                differing.append(name)
    gate = reference.model.layers[0].mlp.shared_expert_gate.weight  # [1, H]
    unaligned_differs = any(not torch.equal(torch.nn.functional.linear(x, _unaligned_copy(gate)),
                                            torch.nn.functional.linear(x, gate)) for x in inputs)
    return {"mapped_unaligned": mapped_unaligned, "compared": sum(m.in_features == reference.config.hidden_size
                                                                   for m in linears.values()),
            "differing": differing, "unaligned_differs": unaligned_differs}


if __name__ == "__main__":
    print(json.dumps(probe(Path(sys.argv[1]))))
