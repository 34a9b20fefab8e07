"""Seeded randomness shared by the synth writers: per-piece generators and routing tensors.

Each piece of a synthetic model draws from its own generator, seeded by (seed, piece ids), so
the bytes are a function of the arguments alone, whatever order the writer takes the pieces in.
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from packtools.arch.spec import ArchSpec


def seeded_generator(seed: int, *parts: int) -> torch.Generator:
    """A CPU generator for one named piece of the model, independent of generation order."""
    mixed = seed & 0xFFFFFFFF
    for part in parts:
        mixed = (mixed * 1_000_003 + part + 1) % (2**63 - 1)  # simple, stable mixing; not cryptographic
    return torch.Generator().manual_seed(mixed)


def randomize_routing_state(model: torch.nn.Module, spec: ArchSpec, config: PretrainedConfig, seed: int) -> None:
    """Give the routing tensors transformers initializes to zeros real values.

    deepseek_v4's hash layers route token t to experts tid2eid[t] (zeros by default: every token
    would hit expert 0 k times); correction biases and gpt_oss expert biases are zeros too,
    which would leave their bytes untested. Only materialized tensors are touched.
    """
    std = float(getattr(config, "initializer_range", 0.02))
    num_experts, top_k = spec.num_experts(config), spec.top_k(config)
    with torch.no_grad():
        for index, (name, tensor) in enumerate(model.state_dict(keep_vars=True).items()):
            if tensor.is_meta:
                continue
            generator = seeded_generator(seed, 0x5EED, index)
            if name.endswith(".tid2eid"):
                vocab = tensor.shape[0]
                # k distinct experts per token: the first k of a random permutation
                scores = torch.rand(vocab, num_experts, generator=generator)  # [vocab, E]
                tensor.copy_(scores.argsort(dim=1)[:, :top_k].to(tensor.dtype))
            elif name.endswith(".e_score_correction_bias") or (
                spec.is_routed_runtime_key(name) and name.endswith("_bias")
            ):
                values = torch.randn(tensor.shape, generator=generator) * std
                tensor.copy_(values.to(tensor.dtype))
