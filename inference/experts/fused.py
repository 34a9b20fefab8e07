"""The fused experts path: compute from the quantized slots in place, on the GPU.

Two shapes of work, both free of Python loops over experts:
- `pair_forward` (decode, a few tokens): one GEMV per projection over every (token, expert) pair
  at once, reading each pair's weights from its slot (inference.kernels), the activation in
  torch (the module's own `_apply_gate`), then the combine kernel. It needs no host sync and no
  per-layer allocation of the experts' weights, so a decode step made of it can be captured in a
  CUDA graph; a pair whose slot is negative (not resident) yields garbage that the caller,
  who sees the negative slot, throws away.
- `grouped_forward` (prefill, many tokens): the pairs sorted by expert, one grouped GEMM per
  projection that reads the slots in place and dequantizes each expert's weight tiles once per
  block of its pairs (tensor-core dots); weights the kernels cannot read are dequantized whole
  from the slot first, then multiplied by torch's grouped GEMM.

Arithmetic follows transformers' eager experts forward: weights rounded to the module's dtype,
matmul outputs rounded to it, the activation from the module, each contribution rounded, and the
contributions summed per token in ascending expert order. Only the order of the float32
accumulations inside a dot product differs from cuBLAS, so results agree with a resident model
to the last bits of bfloat16, not bit for bit; the exact path (inference.experts.forward) stays
for float32 checks.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.experts.cpu_experts import pair_forward_shared
from inference.experts.eager import expert_outputs
from inference.experts.plan import LayerPlan, Projection, WeightGroup, _relayout
from inference.kernels.dispatch import device_dispatch
from inference.kernels.ops import (GemmBlocks, GemvWeight, HostSlots, gemm_blocks, gemv_weight, moe_combine, moe_gemm,
                                  moe_gemv)

GROUPED_PAIRS = 64  # (token, expert) pairs above which prefill's grouped GEMM beats per-pair GEMVs


@dataclasses.dataclass(frozen=True)
class FusedPlan:
    """The GEMV descriptions of one layer's projections (checked once, at bind time)."""

    up: tuple[GemvWeight, ...]  # segments of gate_up (or up), concatenated in order
    up_layout: str  # column layout of the concatenated up output ("concat" or "interleaved")
    up_biases: tuple[WeightGroup, ...]  # bias groups matching `up`, or () without biases
    down: GemvWeight
    down_bias: WeightGroup | None


def _gemv_of(projection: Projection) -> GemvWeight | None:
    group = projection.weight
    if group.scaled:
        return None
    return gemv_weight(group.roles, rows=group.shape[0], cols=group.shape[1])


def fused_plan(plan: LayerPlan) -> tuple[FusedPlan | None, str | None]:
    """(FusedPlan, None) when every projection of the layer can be read in place, else
    (None, why): block-scaled (separate scale role) or in_out-oriented weights take the
    dequantize-and-multiply fallback."""
    if plan.orientation != "out_in":
        return None, f"layer {plan.layer}: weights are stored in_out (transposed); the GEMV reads out_in rows"
    if plan.fused_up is not None:
        ups, layout = (plan.fused_up,), plan.fused_output_layout
    else:
        ups = tuple(p for p in (plan.gate, plan.up) if p is not None)
        layout = "concat"
    segments = tuple(_gemv_of(p) for p in ups)
    down = _gemv_of(plan.down)
    if None in segments or down is None:
        group = next(p.weight for p in (*ups, plan.down) if _gemv_of(p) is None)
        types = sorted({r.element_type for r in group.roles})
        return None, (f"layer {plan.layer}: weight {group.name!r} (element types {types}"
                      f"{', block-scaled' if group.scaled else ''}) has no in-place GEMV")
    biases = tuple(p.bias for p in ups if p.bias is not None)
    return FusedPlan(segments, layout, biases, down, plan.down.bias), None


def _add_bias(out: torch.Tensor, groups, plan: LayerPlan, rows: torch.Tensor) -> torch.Tensor:
    if not groups:
        return out
    bias = torch.cat([plan.materialize_group_rows(g, rows) for g in groups], dim=1)  # [P, out]
    return out + bias  # eager adds the bias to the rounded matmul output, as F.linear's epilogue does not


def _activate(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan, gate_up: torch.Tensor) -> torch.Tensor:
    gate_up = _relayout(gate_up, fused.up_layout, plan.target.gate_up_layout)
    return module._apply_gate(gate_up) if plan.target.has_gate else module.act_fn(gate_up)


def activation_of(module: torch.nn.Module, binding) -> tuple:
    """(the module's activation of gate/up rows in the fused GEMV's order, its clamp limit or None):
    what the CPU experts pool must reproduce (inference.experts.cpu_experts checks it on a probe)."""
    limit = getattr(module, "limit", None)
    limit = float(limit) if isinstance(limit, (int, float)) and not isinstance(limit, bool) else None
    return (lambda gate_up: _activate(module, binding.plan, binding.fused, gate_up)), limit


def pair_forward(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan, x: torch.Tensor,
                 top_k_index: torch.Tensor, top_k_weights: torch.Tensor, slot_map: torch.Tensor,
                 arena: torch.Tensor, stride: int, misses: torch.Tensor | None = None, *,
                 host: HostSlots | None = None, cpu=None) -> torch.Tensor:
    """[T, H]: the experts' combined output; pair p = (token p // k, its p % k-th expert), the
    expert's object at row slot_map[expert] (int32 [E]; -1: absent, counted in `misses`) of
    `arena` (rows of `stride` bytes), or with `host` in the host tier (ids from host.first on;
    plans without biases only). Four kernels when the module's activation is plain. With `cpu`
    (inference.experts.cpu_experts.CpuShare, and `host`), a share of the host-tier experts is
    computed by the CPU pool meanwhile."""
    tokens, top_k = top_k_index.shape
    experts = top_k_index.reshape(-1)  # [P] int64, p = token * k + slot
    if cpu is not None and host is not None and experts.shape[0] <= cpu.max_pairs:
        scratch_slots = None if cpu.copies is None else HostSlots(1, cpu.copies.scratch.data_ptr() - arena.data_ptr())

        def gemv(inputs, gpu_map, per_pair, first, out=None, scratch=False):
            weights = fused.up if first else (fused.down,)
            if out is None:  # [P, rows of the projection's parts together]
                out = inputs.new_empty(experts.shape[0], sum(w.rows for w in weights))
            column = 0
            for i, w in enumerate(weights):  # each part into its columns: no concatenation
                moe_gemv(inputs, experts, gpu_map, arena, stride, w, top_k=top_k, x_per_pair=per_pair,
                         misses=misses if first and i == 0 and not scratch else None,
                         host=scratch_slots if scratch else host, out=out[:, column:column + w.rows])
                column += w.rows
            return out

        down = pair_forward_shared(cpu, gemv, lambda gate_up: _activate(module, plan, fused, gate_up), x, experts,
                                   slot_map, host.first, top_k, misses)
        if getattr(module, "has_post_expert_norm", False):
            down = module.post_expert_norm(down)
        return moe_combine(down, top_k_weights, top_k_index)
    parts = [moe_gemv(x, experts, slot_map, arena, stride, w, top_k=top_k, misses=misses if i == 0 else None,
                      host=host)
             for i, w in enumerate(fused.up)]  # [P, rows_i]
    gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [P, 2I] (or [P, I])
    needs_rows = fused.up_biases or fused.down_bias is not None
    assert host is None or not needs_rows, "biases are read from arena rows: no host-tier slots here"
    rows = _pair_rows(slot_map[experts], arena, stride) if needs_rows else None
    gate_up = _add_bias(gate_up, fused.up_biases, plan, rows)
    hidden = _activate(module, plan, fused, gate_up)  # [P, I]
    down = moe_gemv(hidden, experts, slot_map, arena, stride, fused.down, top_k=top_k, x_per_pair=True,
                    host=host)  # [P, H]
    down = _add_bias(down, (fused.down_bias,) if fused.down_bias is not None else (), plan, rows)
    if getattr(module, "has_post_expert_norm", False):
        down = module.post_expert_norm(down)
    return moe_combine(down, top_k_weights, top_k_index)


def _pair_rows(pair_slots: torch.Tensor, arena: torch.Tensor, stride: int) -> torch.Tensor:
    """uint8 [P, stride]: a copy of each pair's object row (only for the small bias roles)."""
    count = arena.numel() // stride
    table = arena[: count * stride].view(count, stride)
    return table.index_select(0, pair_slots.clamp(min=0).to(torch.int64))


def gather_forward(module: torch.nn.Module, plan: LayerPlan, x: torch.Tensor, top_k_index: torch.Tensor,
                   top_k_weights: torch.Tensor, slot_map: torch.Tensor, arena: torch.Tensor,
                   stride: int, misses: torch.Tensor | None = None) -> torch.Tensor:
    """pair_forward for weights the GEMV cannot read in place (block-scaled, in_out): each pair's
    object is copied out of its slot and dequantized, then one batched matmul per projection.
    Also free of host syncs (capturable), at the cost of dequantizing per pair."""
    pair_slots = slot_map[top_k_index.reshape(-1)]  # int32 [P]
    if misses is not None:
        misses.add_((pair_slots < 0).sum(dtype=torch.int32))
    rows = _pair_rows(pair_slots, arena, stride)  # uint8 [P, stride]
    weights = plan.materialize_rows(rows)  # name -> [P, ...]
    tokens, top_k = top_k_index.shape
    pair_tokens = torch.arange(tokens * top_k, device=x.device) // top_k  # [P]
    out = expert_outputs(module, plan, x[pair_tokens], weights, None)  # [P, H]
    return moe_combine(out, top_k_weights, top_k_index)


def grouped_outputs(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan | None, x: torch.Tensor, top_k: int,
                    pairs: torch.Tensor, counts: list[int], rows: list[int], arena: torch.Tensor,
                    stride: int, host: HostSlots | None = None) -> torch.Tensor:
    """[S, H]: the outputs of `pairs` (int64 [S] pair indices sorted by expert; `counts` pairs per
    distinct expert, whose objects are arena rows `rows`), in that order, before the routing
    weights. With a FusedPlan: one grouped GEMM per projection reading the slots in place, each
    block of an expert's pairs dequantizing its weights once (inference.kernels); without
    (weights the kernels cannot read): each expert dequantized once, then torch's grouped GEMMs."""
    if fused is not None:
        blocks = gemm_blocks(rows, counts).to(x.device)

        def pair_slots() -> torch.Tensor:  # int32 [S]
            slots = torch.repeat_interleave(torch.tensor(rows, dtype=torch.int32), torch.tensor(counts))
            return slots.to(x.device)

        return _sorted_gemm_outputs(module, plan, fused, x, top_k, pairs, blocks, pair_slots, arena, stride, host)
    assert host is None, "host-tier slots are read in place by the fused kernels only"
    count = arena.numel() // stride
    index = torch.tensor(rows, dtype=torch.int64).to(x.device, non_blocking=True)  # [n]
    objects = arena[: count * stride].view(count, stride).index_select(0, index)  # uint8 [n, stride]
    weights = plan.materialize_rows(objects)  # name -> [n, ...]
    offsets = torch.tensor(counts, dtype=torch.int32).cumsum(0).to(x.device, non_blocking=True)  # [n]
    return expert_outputs(module, plan, x[pairs // top_k], weights, offsets)  # [S, H]


def _sorted_gemm_outputs(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan, x: torch.Tensor, top_k: int,
                         pairs: torch.Tensor, blocks: GemmBlocks, pair_slots, arena: torch.Tensor,
                         stride: int, host: HostSlots | None = None) -> torch.Tensor:
    """grouped_outputs' in-place GEMMs over `blocks` (on x's device); `pair_slots()` gives the
    slot of each sorted pair, needed only for the small bias roles (never with `host`)."""
    total = pairs.numel()
    assert host is None or not (fused.up_biases or fused.down_bias is not None), "biases come from arena rows"
    parts = [moe_gemm(x, pairs, blocks, arena, stride, w, pairs=total, top_k=top_k, gather_tokens=True, host=host)
             for w in fused.up]  # [S, rows_i], sorted order
    gate_up = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)  # [S, 2I] (or [S, I])
    object_rows = None
    if fused.up_biases or fused.down_bias is not None:
        object_rows = _pair_rows(pair_slots(), arena, stride)
    gate_up = _add_bias(gate_up, fused.up_biases, plan, object_rows)
    hidden = _activate(module, plan, fused, gate_up).contiguous()  # [S, I]
    down = moe_gemm(hidden, pairs, blocks, arena, stride, fused.down, pairs=total, top_k=top_k, gather_tokens=False,
                    host=host)
    down = _add_bias(down, (fused.down_bias,) if fused.down_bias is not None else (), plan, object_rows)
    if getattr(module, "has_post_expert_norm", False):
        down = module.post_expert_norm(down)
    return down  # [S, H]


def device_grouped_forward(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan, x: torch.Tensor,
                           top_k_index: torch.Tensor, top_k_weights: torch.Tensor, slot_map: torch.Tensor,
                           arena: torch.Tensor, stride: int, misses: torch.Tensor | None = None, *,
                           host: HostSlots | None = None) -> torch.Tensor:
    """grouped_forward for experts found at slot_map[expert] (int32 [E]): the sort, the block
    table and the GEMMs all stay on the device, so the layer needs no host synchronization (the
    block table is sized for any routing). A pair whose expert is absent (-1) is counted in
    `misses` (int32 [1]) and computed from slot 0: garbage that the caller throws away."""
    tokens, top_k = top_k_index.shape
    grouped = device_dispatch(top_k_index.reshape(-1), slot_map, misses)  # [S] pairs grouped by expert, blocks
    out = _sorted_gemm_outputs(module, plan, fused, x, top_k, grouped.order, grouped.blocks,
                               lambda: slot_map[grouped.sorted_experts].clamp(min=0), arena, stride, host)  # [S, H]
    by_pair = torch.empty_like(out)
    by_pair[grouped.order] = out  # [T*k, H], pair p = (token p // k, slot p % k)
    return moe_combine(by_pair, top_k_weights, top_k_index)


def grouped_forward(module: torch.nn.Module, plan: LayerPlan, fused: FusedPlan | None, x: torch.Tensor,
                    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, pair_order: torch.Tensor,
                    counts: list[int], rows: list[int], arena: torch.Tensor, stride: int,
                    host: HostSlots | None = None) -> torch.Tensor:
    """[T, H] for many tokens: the n distinct experts (arena rows `rows`, ascending expert id;
    `counts` their pair counts) computed over the pairs sorted by expert (`pair_order`, [T*k]
    pair indices), see grouped_outputs; then the combine."""
    out = grouped_outputs(module, plan, fused, x, top_k_index.shape[1], pair_order, counts, rows, arena, stride,
                          host)
    by_pair = torch.empty_like(out)
    by_pair[pair_order] = out  # [T*k, H], pair p = (token p // k, slot p % k)
    return moe_combine(by_pair, top_k_weights, top_k_index)
