"""The streamed synth path: a checkpoint too large to materialize, written piece by piece.

Dense weights are the model's own initialization on real memory (every other module stays on
the meta device), saved under checkpoint names through transformers' reverse conversion, as
save_pretrained would. Routed experts are drawn one (layer, expert) at a time from a generator
seeded by (seed, layer, expert, role) and streamed into safetensors shards; peak memory is the
dense weights plus one expert.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.core_model_loading import revert_weight_conversion

from packtools.arch.spec import ArchSpec
from packtools.safetensors_stream import StreamingSafetensorsWriter, dtype_name
from packtools.synth.seeding import randomize_routing_state, seeded_generator

INDEX_FILE = "model.safetensors.index.json"


@dataclasses.dataclass(frozen=True)
class ExpertTensorPlan:
    """One checkpoint tensor of routed experts and the (expert, role, shape) pieces it is written from."""

    name: str
    layer: int
    shape: tuple[int, ...]
    pieces: tuple[tuple[int, int, tuple[int, ...]], ...]  # (expert, role id, piece shape), in file order


def _expert_plans(spec: ArchSpec, config: PretrainedConfig) -> list[ExpertTensorPlan]:
    shapes = spec.role_shapes(config)
    num_experts = spec.num_experts(config)
    plans = []
    for layer in spec.moe_layers(config):
        if spec.per_expert_parts:  # save_pretrained's form: one tensor per expert and role
            for expert in range(num_experts):
                for role in spec.layout.roles:
                    plans.append(ExpertTensorPlan(spec.per_expert_key(layer, expert, role), layer, shapes[role],
                                                  ((expert, int(role), shapes[role]),)))
        else:  # fused [E, ...] tensors, written expert by expert
            for part, fused in spec.fused_parts.items():
                role_shape = shapes[fused.roles[0]]
                piece_shape = (role_shape[0] * fused.splits, *role_shape[1:])
                pieces = tuple((expert, int(fused.roles[0]), piece_shape) for expert in range(num_experts))
                plans.append(ExpertTensorPlan(spec.fused_key(layer, part), layer, (num_experts, *piece_shape), pieces))
    return plans


def _dense_state(spec: ArchSpec, config: PretrainedConfig, seed: int, dtype: torch.dtype) -> tuple[dict, str]:
    """Checkpoint-named dense tensors, initialized the way transformers initializes them."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    for name, module in model.named_modules():
        if not name.endswith(".mlp.experts"):
            module.to_empty(device="cpu", recurse=False)
    with torch.no_grad():
        for tensor in model.state_dict(keep_vars=True).values():
            if tensor.is_meta:
                continue
            # NaN: a float weight the initializer skips cannot pass unnoticed; zero: integer
            # buffers (tid2eid) are deterministic even before they are set
            tensor.fill_(float("nan") if tensor.is_floating_point() else 0)
    torch.manual_seed(seed)
    model.initialize_weights()
    randomize_routing_state(model, spec, config, seed)
    dense = {k: v.detach() for k, v in model.state_dict().items() if not spec.is_routed_runtime_key(k)}
    for name, tensor in dense.items():
        if tensor.is_meta or (tensor.is_floating_point() and not torch.isfinite(tensor).all()):
            raise RuntimeError(f"dense weight {name} was not initialized by {type(model).__name__}.initialize_weights")
    return revert_weight_conversion(model, dense), type(model).__name__


def _random_piece(seed: int, layer: int, expert: int, role: int, shape: tuple[int, ...], std: float,
                  dtype: torch.dtype) -> torch.Tensor:
    generator = seeded_generator(seed, layer, expert, role)
    return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=generator)


def _pieces_in_order(shard: list[ExpertTensorPlan], seed: int, std: float, dtype: torch.dtype,
                     workers: int) -> Iterator[tuple[str, torch.Tensor]]:
    """(tensor name, piece) in file order, generated ahead on a few threads (torch's RNG kernels
    release the GIL); at most 2 * workers pieces are held at once."""
    jobs = ((plan.name, plan.layer, expert, role, shape) for plan in shard for expert, role, shape in plan.pieces)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        pending: deque = deque()
        for name, layer, expert, role, shape in jobs:
            pending.append((name, pool.submit(_random_piece, seed, layer, expert, role, shape, std, dtype)))
            if len(pending) >= 2 * workers:
                name_out, future = pending.popleft()
                yield name_out, future.result()
        while pending:
            name_out, future = pending.popleft()
            yield name_out, future.result()


def _shard(plans: list[ExpertTensorPlan], element_size: int, max_shard_bytes: int) -> list[list[ExpertTensorPlan]]:
    shards: list[list[ExpertTensorPlan]] = [[]]
    size = 0
    for plan in plans:
        nbytes = math.prod(plan.shape) * element_size
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(plan)
        size += nbytes
    return shards if shards[-1] else shards[:-1]


def write_streamed(spec: ArchSpec, config: PretrainedConfig, out_dir: Path, *, seed: int, dtype: torch.dtype,
                   max_shard_bytes: int) -> list[str]:
    """Write config.json, dense and expert shards and the index; returns the file names."""
    dense, architecture = _dense_state(spec, config, seed, dtype)
    element_size = torch.empty((), dtype=dtype).element_size()
    expert_shards = _shard(_expert_plans(spec, config), element_size, max_shard_bytes)
    count = 1 + len(expert_shards)
    names = [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]
    weight_map: dict[str, str] = {}
    total = 0

    dense_entries = [(name, t.dtype, tuple(t.shape)) for name, t in dense.items()]
    with StreamingSafetensorsWriter(out_dir / names[0], dense_entries, metadata={"format": "pt"}) as writer:
        for name, tensor in dense.items():
            writer.write(name, tensor)
            weight_map[name] = names[0]
            total += tensor.numel() * tensor.element_size()
    del dense

    std = float(getattr(config, "initializer_range", 0.02))
    workers = max(1, min(8, os.cpu_count() or 1))
    for file_name, shard in zip(names[1:], expert_shards):
        entries = [(plan.name, dtype_name(dtype), plan.shape) for plan in shard]
        with StreamingSafetensorsWriter(out_dir / file_name, entries, metadata={"format": "pt"}) as writer:
            for name, piece in _pieces_in_order(shard, seed, std, dtype, workers):
                writer.write_part(name, piece)
        for plan in shard:
            weight_map[plan.name] = file_name
            total += math.prod(plan.shape) * element_size

    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    config.architectures = [architecture]
    config.dtype = dtype
    config.save_pretrained(out_dir)
    return [*names, INDEX_FILE, "config.json"]
