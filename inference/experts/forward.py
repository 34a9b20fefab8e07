"""The "expertpack" experts implementation registered with transformers' ExpertsInterface.

transformers calls `expertpack_experts_forward(experts_module, hidden_states [T, H],
top_k_index [T, k], top_k_weights [T, k])` in place of the module's own forward. The module's
routed parameters stay on the meta device; the weights come from the expert source. Three paths,
chosen per call:

- **device lookup** (inside a captured decode step or prefill, see inference.engine.decode_graph): the
  slots come from storaged's device-readable slot map, no host sync at all; a pair whose expert
  is absent counts a miss and the caller runs the step again on the acquire path.
- **fused** (CUDA, bfloat16/float16): group the pairs by expert (the one host sync, which also
  carries the next layer's predicted experts as a prefetch hint), acquire the distinct experts,
  then compute from the slots in place (inference.experts.fused). Where the source offers a
  resident lookup (storaged's slot map, read under the session's step fence), the same transfer
  brings the experts' slots, and a layer whose routed experts are all resident skips the
  Acquire; a layer whose *every* expert was resident when the step opened (the lookup's
  `complete` layers) does not even wait for the transfer: its slots, block table and GEMMs stay
  on the device. The model's forward hook (`finish_resident_step`) ends the step once its work
  completed.
- **exact** (CPU, float32 checks, or wherever the fused kernels cannot run): group the pairs by
  expert; acquire; dequantize each weight for all experts at once (LayerPlan.materialize); per
  expert, exactly the ops of transformers' eager forward, in its order (one expert at a time,
  ascending expert id, prefill and decode alike), so float32 results equal it bit for bit.

Inside a batch step (inference.engine.batch) the call first waits for the other sequences'
forwards to reach the same layer; one call then runs over all their tokens, on one of the paths
above.
"""

from __future__ import annotations

import dataclasses

import torch

from inference.experts import fused as F
from inference.experts.host_reads import absent_only, host_tier_pairs
from inference.experts.eager import expert_outputs
from inference.experts.errors import ExpertSourceError, RoutingError, UnboundExpertsError
from inference.experts.plan import LayerPlan
from inference.experts.source import ExpertSource, SlotRows, acquire_rows

IMPLEMENTATION_NAME = "expertpack"
BINDING_ATTRIBUTE = "expertpack_binding"


@dataclasses.dataclass
class DeviceLookup:
    """Where a captured step finds slots without asking anyone: this layer's row of the slot map
    (int32 [E], -1 = absent) inside `arena`, and the step's miss counter (int32 [1]). With `host`,
    `layer_map` is the row of the merged map (inference.experts.host_reads: ids from host.first
    on are host-tier slots, for the GEMV) and `vram_map` the slot map's own row (the GEMM's)."""

    layer_map: torch.Tensor
    arena: torch.Tensor
    stride: int
    misses: torch.Tensor
    vram_map: torch.Tensor | None = None  # None: layer_map
    host: object | None = None  # inference.kernels.ops.HostSlots
    # inference.experts.cpu_experts.CpuShare: a share of the host-tier experts computed by the CPU
    cpu: object | None = None


@dataclasses.dataclass
class ExpertsBinding:
    """What one experts module needs at run time: its layer, its source and its plan.

    `fused` is set when the layer runs on the fused path (bind time); `lookup` only while a
    decode step is being captured or run on the device lookup path; `predict` (optional) maps
    this layer's MoE input to the experts the next MoE layer will probably want, for prefetch.
    """

    layer: int
    source: ExpertSource
    plan: LayerPlan
    fused: object | None = None  # inference.experts.fused.FusedPlan, or None: exact / gather path
    use_fused_kernels: bool = False
    lookup: DeviceLookup | None = None
    predict: object | None = None  # inference.experts.lookahead.NextLayerPredictor
    # the previous MoE layer's NextLayerPredictor, told which experts this layer used (it scores
    # its predictions for this layer by them; inference.experts.hint_policy)
    hinted_by: object | None = None
    # inference.engine.batch.GATHER: sends the call of a batch step's forward to where the step's
    # forwards meet, so that each MoE layer runs once over the union of their tokens (one acquire)
    gather: object | None = None
    # inference.engine.piecewise.PiecewiseStep while it records a step: the call becomes a boundary
    # between two captured pieces, and runs eagerly there when the step is replayed
    segment: object | None = None
    # calls that acquired only the experts in neither tier, reading the others in place (host_reads)
    absent_acquires: int = 0


def expertpack_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                               top_k_weights: torch.Tensor) -> torch.Tensor:
    binding: ExpertsBinding | None = getattr(self, BINDING_ATTRIBUTE, None)
    if binding is None:
        raise UnboundExpertsError(type(self).__name__)
    if binding.segment is not None:
        return binding.segment.boundary(self, hidden_states, top_k_index, top_k_weights)
    if binding.gather is not None and binding.gather.joined():
        return binding.gather.forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    if tokens == 0:
        return torch.zeros_like(hidden_states)
    if binding.lookup is not None:
        return _lookup_forward(self, binding, hidden_states, top_k_index, top_k_weights)

    lookup = _open_resident_lookup(binding)
    if lookup is not None and binding.layer in lookup.complete:
        out = _complete_layer_forward(self, binding, lookup, hidden_states, top_k_index, top_k_weights)
        if out is not None:
            return out

    pair_experts = top_k_index.reshape(-1)  # [S], S = T * k, pair p = (token p // k, slot p % k)
    sorted_experts, pair_order = torch.sort(pair_experts, stable=True)  # pairs grouped by expert
    unique, counts = torch.unique_consecutive(sorted_experts, return_counts=True)
    hint = binding.predict.predict(hidden_states) if binding.predict is not None else None
    if hint is not None and lookup is not None and lookup.host is not None:
        hint = absent_only(hint, lookup.rows.get(binding.predict.next_layer))
    plan = binding.plan
    resident = _resident_slots(lookup, binding, unique, plan.target.num_experts,
                               _reads_host_tier(binding, top_k_index))
    # the one device -> host sync; with a resident lookup it also brings the experts' slots
    expert_ids, expert_counts, predicted, slots = _to_host(unique, counts, hint,
                                                           resident[1] if resident is not None else None)
    for expert in (expert_ids[0], expert_ids[-1]):
        if not 0 <= expert < plan.target.num_experts:
            raise RoutingError(binding.layer, expert, plan.target.num_experts)
    if binding.hinted_by is not None:
        binding.hinted_by.observe(tokens, expert_ids)
    if predicted:
        binding.predict.send(predicted, tokens)

    if resident is not None and min(slots) >= 0:  # every expert resident: no Acquire at all
        rows = SlotRows(resident[0].arena, resident[0].stride, tuple(slots), resident[2])
        return _fused_forward(self, binding, hidden_states, top_k_index, top_k_weights, pair_order, unique,
                              expert_ids, expert_counts, rows)
    if resident is not None and resident[2] is not None:  # the host tier is read in place
        rows = _acquire_absent(binding, unique, expert_ids, slots)
        if rows is not None:
            return _fused_forward(self, binding, hidden_states, top_k_index, top_k_weights, pair_order, unique,
                                  expert_ids, expert_counts, rows)
    groups = _groups(expert_ids, expert_counts, _capacity(binding.source))
    if binding.use_fused_kernels:
        if len(groups) == 1:
            return _fused_forward(self, binding, hidden_states, top_k_index, top_k_weights, pair_order, unique,
                                  expert_ids, expert_counts)
        return _fused_in_groups(self, binding, hidden_states, top_k_index, top_k_weights, pair_order, groups)
    final = torch.zeros_like(hidden_states)
    start = 0
    for ids, counts in groups:  # ascending expert ids: eager's summation order across groups too
        objects = binding.source.acquire(binding.layer, ids)
        if len(objects) != len(ids):
            raise ExpertSourceError(binding.layer, f"asked for {len(ids)} experts {ids}, got {len(objects)} objects")
        weights = plan.materialize(objects)  # name -> [n, *shape], n = the group's experts
        exact_accumulate(self, plan, hidden_states, top_k_index, top_k_weights, pair_order[start:], counts, weights,
                         final)
        start += sum(counts)
    return final


def _capacity(source) -> int | None:
    """Most experts the source can hold at once (storaged: its arena's slots), or None."""
    method = getattr(source, "max_pinned", None)
    return method() if callable(method) else None


def _groups(ids: list[int], counts: list[int], capacity: int | None) -> list[tuple[list[int], list[int]]]:
    """The layer's experts in ascending groups of at most `capacity` (all at once without a limit):
    a prefill touching more experts than the cache holds runs group by group."""
    if capacity is None or len(ids) <= capacity:
        return [(ids, counts)]
    return [(ids[i:i + capacity], counts[i:i + capacity]) for i in range(0, len(ids), capacity)]


def _open_resident_lookup(binding: ExpertsBinding):
    """The source's ResidentLookup (its resident step opened if it was not) when the fused path
    may compute this layer from the slot map without an Acquire, else None."""
    if not binding.use_fused_kernels:
        return None
    lookup_of = getattr(binding.source, "resident_lookup", None)
    lookup = lookup_of() if callable(lookup_of) else None
    if lookup is None or binding.layer not in lookup.rows:
        return None
    return lookup


def _reads_host_tier(binding: ExpertsBinding, top_k_index: torch.Tensor) -> bool:
    """Whether this call's kernels may read host-tier slots in place."""
    tokens, top_k = top_k_index.shape
    return tokens * top_k <= host_tier_pairs(binding)


def _resident_slots(lookup, binding: ExpertsBinding, unique: torch.Tensor, num_experts: int, host_ok: bool):
    """(lookup, int32 slots of `unique` on the device, HostSlots or None), or None without a
    lookup. Host-tier slots count only for a call that may read them in place (`host_ok`)."""
    if lookup is None:
        return None
    rows, host = (lookup.rows, lookup.host) if host_ok else (lookup.vram()[0], None)
    # clamped: an out-of-range id is refused after the transfer, and must not fault the gather first
    return lookup, rows[binding.layer][unique.clamp(0, num_experts - 1)], host


def _acquire_absent(binding: ExpertsBinding, unique: torch.Tensor, expert_ids: list[int], slots: list[int]
                    ) -> SlotRows | None:
    """Acquire only the experts neither tier holds, then find the others in the maps again under
    a new resident step (the Acquire ended the one their slots were read under). Acquiring them
    all would copy the host tier's up to VRAM, each copy pushing another object out of both tiers
    (its VRAM victim demoted, a host entry evicted for it) to be read from disk later. None when
    one of the others went absent meanwhile: the caller then acquires them all."""
    absent = [e for e, s in zip(expert_ids, slots, strict=True) if s < 0]
    acquired = acquire_rows(binding.source, binding.layer, absent)  # pinned until the next acquire
    lookup = _open_resident_lookup(binding)
    if lookup is None or lookup.host is None or acquired.arena.data_ptr() != lookup.arena.data_ptr():
        return None
    found = lookup.rows[binding.layer][unique.clamp(0, binding.plan.target.num_experts - 1)].tolist()
    fetched = dict(zip(absent, acquired.index, strict=True))
    merged = [fetched.get(e, s) for e, s in zip(expert_ids, found, strict=True)]
    if min(merged) < 0:
        return None
    binding.absent_acquires += 1
    return SlotRows(lookup.arena, lookup.stride, tuple(merged), lookup.host)


def _complete_layer_forward(module, binding: ExpertsBinding, lookup, hidden_states, top_k_index, top_k_weights
                            ) -> torch.Tensor | None:
    """A layer whose every expert was resident when the step opened: its slots come from the
    slot map on the device and nothing waits for the host (no routing transfer, no Acquire, no
    hint: the next layers' experts are resident too, or their own transfer sends it). None when
    the layer's weights need the host's grouping (prefill of weights the GEMM cannot read), or
    some of its experts are in the host tier and this call may not read them in place."""
    tokens, top_k = top_k_index.shape
    if _reads_host_tier(binding, top_k_index):  # int32 [E], every entry >= 0, host-tier slots included
        layer_map = lookup.rows[binding.layer]
        if tokens * top_k <= F.GROUPED_PAIRS:
            return _pairs(module, binding, hidden_states, top_k_index, top_k_weights, layer_map, lookup.arena,
                          lookup.stride, host=lookup.host)
        return F.device_grouped_forward(module, binding.plan, binding.fused, hidden_states, top_k_index,
                                        top_k_weights, layer_map, lookup.arena, lookup.stride, host=lookup.host)
    vram_rows, complete_vram = lookup.vram()
    if binding.layer not in complete_vram:
        return None
    layer_map = vram_rows[binding.layer]  # int32 [E], every entry >= 0
    if tokens * top_k <= F.GROUPED_PAIRS:
        return _pairs(module, binding, hidden_states, top_k_index, top_k_weights, layer_map, lookup.arena,
                      lookup.stride)
    if binding.fused is None:
        return None
    return F.device_grouped_forward(module, binding.plan, binding.fused, hidden_states, top_k_index, top_k_weights,
                                    layer_map, lookup.arena, lookup.stride)


def _to_host(unique: torch.Tensor, counts: torch.Tensor, hint: torch.Tensor | None, slots: torch.Tensor | None
             ) -> tuple[list[int], list[int], list[int], list[int] | None]:
    """(distinct experts, their pair counts, the next layer's predicted-expert mask, the slots of
    the distinct experts) in one transfer."""
    parts = [unique, counts]
    if slots is not None:
        parts.append(slots.to(unique.dtype))
    if hint is not None:
        parts.append(hint.to(unique.dtype))
    flat = torch.cat(parts).tolist()
    n = unique.numel()
    if slots is None:
        return flat[:n], flat[n:2 * n], flat[2 * n:], None
    return flat[:n], flat[n:2 * n], flat[3 * n:], flat[2 * n:3 * n]


def exact_accumulate(module: torch.nn.Module, plan: LayerPlan, hidden_states: torch.Tensor,
                     top_k_index: torch.Tensor, top_k_weights: torch.Tensor, pair_order: torch.Tensor,
                     expert_counts: list[int], weights: dict[str, torch.Tensor], final: torch.Tensor) -> None:
    """Eager's loop: per expert (ascending id) its tokens through up, gate, down, times the
    routing weight, index_add_-ed into `final` (zeros at first) in the output dtype. pair_order
    starts at this group's first expert-sorted pair."""
    tokens, top_k = top_k_index.shape
    pair_weights = top_k_weights.reshape(-1)  # [S]
    pair_tokens = pair_order // top_k  # [S] token of each expert-sorted pair
    start = 0
    for i, count in enumerate(expert_counts):
        rows = slice(start, start + count)
        start += count
        token_idx = pair_tokens[rows]
        out = expert_outputs(module, plan, hidden_states[token_idx], weights, i)  # [count, H]
        out = out * pair_weights[pair_order[rows], None]
        final.index_add_(0, token_idx, out.to(final.dtype))


def _fused_forward(module, binding: ExpertsBinding, hidden_states, top_k_index, top_k_weights, pair_order,
                   unique, expert_ids, expert_counts, rows: SlotRows | None = None) -> torch.Tensor:
    """`rows`: the experts' slots when already known (resident lookup), else acquired here."""
    if rows is None:
        rows = acquire_rows(binding.source, binding.layer, expert_ids)
    if len(rows.index) != len(expert_ids):
        raise ExpertSourceError(binding.layer, f"asked for {len(expert_ids)} experts {expert_ids}, "
                                f"got {len(rows.index)} rows")
    device = hidden_states.device
    tokens, top_k = top_k_index.shape
    if tokens * top_k > F.GROUPED_PAIRS:
        return F.grouped_forward(module, binding.plan, binding.fused, hidden_states, top_k_index, top_k_weights,
                                 pair_order, expert_counts, list(rows.index), rows.arena, rows.stride, rows.host)
    index = torch.tensor(rows.index, dtype=torch.int32).to(device, non_blocking=True)  # [n] row of each expert
    lut = torch.full((binding.plan.target.num_experts,), -1, dtype=torch.int32, device=device)  # expert -> row
    lut[unique] = index
    return _pairs(module, binding, hidden_states, top_k_index, top_k_weights, lut, rows.arena, rows.stride,
                  host=rows.host)


def _fused_in_groups(module, binding: ExpertsBinding, hidden_states, top_k_index, top_k_weights, pair_order,
                     groups) -> torch.Tensor:
    """The fused path for a layer whose experts exceed the cache: each group acquired and computed
    (grouped GEMMs) before the next replaces it; one combine over every pair at the end."""
    by_pair = hidden_states.new_empty((pair_order.numel(), hidden_states.shape[-1]))  # [T*k, H]
    start = 0
    for ids, counts in groups:
        rows = acquire_rows(binding.source, binding.layer, ids)
        pairs = pair_order[start:start + sum(counts)]  # this group's pairs, sorted by expert
        by_pair[pairs] = F.grouped_outputs(module, binding.plan, binding.fused, hidden_states, top_k_index.shape[1],
                                           pairs, counts, list(rows.index), rows.arena, rows.stride)
        start += len(pairs)
    return F.moe_combine(by_pair, top_k_weights, top_k_index)


def _pairs(module, binding: ExpertsBinding, hidden_states, top_k_index, top_k_weights, slot_map, arena,
           stride, misses: torch.Tensor | None = None, host=None, cpu=None) -> torch.Tensor:
    if binding.fused is not None:
        return F.pair_forward(module, binding.plan, binding.fused, hidden_states, top_k_index, top_k_weights,
                              slot_map, arena, stride, misses, host=host, cpu=cpu)
    assert host is None, "host-tier slots are read in place by the fused GEMV only"
    return F.gather_forward(module, binding.plan, hidden_states, top_k_index, top_k_weights, slot_map, arena,
                            stride, misses)


def _lookup_forward(module, binding: ExpertsBinding, hidden_states, top_k_index, top_k_weights) -> torch.Tensor:
    lookup = binding.lookup  # this layer's row of the slot map; absent experts counted in lookup.misses
    vram_map = lookup.layer_map if lookup.vram_map is None else lookup.vram_map
    tokens, top_k = top_k_index.shape
    if _reads_host_tier(binding, top_k_index):
        if tokens * top_k <= F.GROUPED_PAIRS:
            return _pairs(module, binding, hidden_states, top_k_index, top_k_weights, lookup.layer_map, lookup.arena,
                          lookup.stride, lookup.misses, host=lookup.host, cpu=lookup.cpu)
        return F.device_grouped_forward(module, binding.plan, binding.fused, hidden_states, top_k_index,
                                        top_k_weights, lookup.layer_map, lookup.arena, lookup.stride, lookup.misses,
                                        host=lookup.host)
    if tokens * top_k > F.GROUPED_PAIRS and binding.fused is not None:  # a prefill captured whole
        return F.device_grouped_forward(module, binding.plan, binding.fused, hidden_states, top_k_index,
                                        top_k_weights, vram_map, lookup.arena, lookup.stride, lookup.misses)
    return _pairs(module, binding, hidden_states, top_k_index, top_k_weights, vram_map, lookup.arena,
                  lookup.stride, lookup.misses)
