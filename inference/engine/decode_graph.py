"""Decode steps with no host round trip per layer: a static KV cache, experts found through
storaged's slot map on the device, the whole step captured once as a CUDA graph.

    decoder = StaticDecoder.create(model, source, max_len=4096)    # None: not possible, see why_not
    logits = decoder.start(prompt_ids)                             # prefill (eager, acquires experts)
    logits = decoder.step(token)                                   # one decode step
    launched = decoder.launch(token_on_device)                     # or: one not waited for
    if not decoder.settle(launched): logits = decoder.redo(token)  # its logits, or the acquire path's

A step runs optimistically: every MoE layer looks its experts up in the slot map (inference.
experts.forward's device lookup) and counts the absent ones. After the step, one host sync reads
that count with the logits; when an expert was absent, the step is undone (the static cache's
write position moved back: the same position is simply written again) and run once more on the
acquire path, which loads what was missing: on CUDA the same step recorded as graphs split at
the experts calls (inference.engine.piecewise), the experts acquired and computed eagerly between
the pieces. The session's step fence brackets the device work, so storaged never reuses a slot
the step may read.

`launch` starts a step on the slot map without waiting for it (inference.engine.decode_launch).

The prefill runs the same way, a graph per padded length (inference.engine.prefill_graphs).

Where it applies (`why_not` says otherwise): a CUDA device (elsewhere the same step runs
uncaptured, which tests use on the CPU), the fused experts path on every MoE layer, a storaged
source that publishes its slot map on the model's device, a model transformers marks as
capturable whose every cache layer is a plain static attention layer (so a step can be undone
by moving the write position back: not sliding-window, linear-attention or compressed layers,
e.g. gpt_oss, kimi_linear, deepseek_v4), and prompts that fit the static cache.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import time

import torch
from transformers import StaticCache
from transformers.cache_utils import StaticLayer

from inference.engine.compiled_layers import compiled_layers, why_not_compiled
from inference.engine.decode_launch import MAX_BACKOFF_STEPS, LaunchAhead, LaunchedStep
from inference.engine.piecewise import PiecewiseStep
from inference.engine.prefill_graphs import PaddedPrefill, PrefillGraphs
from inference.engine.static_cache import reset_cache
from inference.experts.binding import experts_modules
from inference.experts.forward import BINDING_ATTRIBUTE, DeviceLookup, ExpertsBinding, expertpack_experts_forward
from inference.experts.host_reads import reads_host_tier

log = logging.getLogger(__name__)
def why_not(model: torch.nn.Module, source, device: torch.device) -> str | None:
    """Why `model` cannot decode with StaticDecoder on `device`, or None when it can."""
    bindings = _bindings(model)
    if not bindings:
        return "the model has no expertpack experts modules"
    if not all(b.use_fused_kernels for b in bindings.values()):
        return "the experts are not on the fused path (CPU, or experts_compute='exact')"
    lookup = getattr(source, "device_lookup", None)
    if lookup is None or lookup() is None:
        return "the expert source publishes no slot map on the model's device (storaged with a data plane needed)"
    if not getattr(model, "_can_compile_fullgraph", False):
        return f"transformers does not mark {type(model).__name__} as capturable"
    layer_types = {type(layer).__name__ for layer in StaticCache(config=model.config, max_cache_len=8).layers}
    if layer_types != {StaticLayer.__name__}:
        return f"its cache has {sorted(layer_types)} layers; a step can be undone only with plain static ones"
    return None


def _bindings(model: torch.nn.Module) -> dict[int, ExpertsBinding]:
    found = {}
    for layer, (_, module) in experts_modules(model).items():
        binding = getattr(module, BINDING_ATTRIBUTE, None)
        if binding is not None:
            found[layer] = binding
    return found


class StaticDecoder(PrefillGraphs, LaunchAhead):
    def __init__(self, model: torch.nn.Module, source, max_len: int, *, cache_keyword: str, capture: bool,
                 lookup_prefill: bool | None = None, compile_layers: bool | None = None,
                 piecewise: bool | None = None, cpu_experts=None):
        if piecewise and not capture:
            raise ValueError("piecewise: a piecewise step is made of CUDA graphs, capture must be on")
        self.model = model
        self.source = source
        self.max_len = max_len
        self.cache_keyword = cache_keyword
        self.capture = capture
        self.device = model.get_input_embeddings().weight.device
        self.bindings = _bindings(model)
        self.misses = torch.zeros(1, dtype=torch.int32, device=self.device)  # absent experts in the step
        self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        self.ids = torch.zeros((1, 1), dtype=torch.long, device=self.device)  # the step's token
        self.positions = torch.zeros((1, 1), dtype=torch.long, device=self.device)  # and its position
        self._kv_index = torch.arange(max_len, device=self.device).view(1, 1, 1, max_len)
        self.mask = torch.zeros((1, 1, 1, max_len), dtype=torch.bool, device=self.device)  # keys it may see
        self.length = 0  # tokens in the cache
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_logits: torch.Tensor | None = None
        self.lookup_enabled = True  # off once the daemon revoked our fence: acquire path only
        self.steps = self.lookup_steps = self.redone_steps = self.skipped_steps = 0
        self.abandoned_steps = 0  # launched after a step that missed (or left when a request ended): undone
        self._launched: collections.deque[LaunchedStep] = collections.deque()  # oldest first
        self._settled_at = 0.0  # when the last launched step settled: a pipelined step's time starts there
        # prefill through the slot map (padded, a graph per length when capturing); on by default
        # with capture, where it takes the host's launches out of the prefill
        self.lookup_prefill = capture if lookup_prefill is None else lookup_prefill
        self._prefills: dict[int, PaddedPrefill] = {}
        self.lookup_prefills = self.redone_prefills = 0
        if compile_layers and (reason := why_not_compiled(model)) is not None:
            raise ValueError(f"compile_layers: {reason}")
        # the captured decode step runs inductor-compiled decoder layers: on by default with
        # capture where the model allows it (fewer, fused kernels: 0.49x -> 0.58x llama.cpp's
        # decode on the Qwen3-like shape, docs/benchmarks.md)
        self.compile_layers = (capture and why_not_compiled(model) is None) if compile_layers is None \
            else compile_layers
        # After a step that met an absent expert, the next 1, 2, 4 ... 32 steps go straight to the
        # acquire path: when the cache holds less than the working set, almost every step misses,
        # and replaying the graph first would only add its time to each step.
        self._skip = self._backoff = 0
        # a step on the acquire path replays the dense part as graphs split at the experts calls
        # (inference.engine.piecewise) rather than running it eagerly; on by default with capture
        self.piecewise = capture if piecewise is None else piecewise
        self._piecewise: PiecewiseStep | None = None
        self.piecewise_steps = 0
        self.fence = None
        self._lookups: dict[int, DeviceLookup] = {}
        # with storaged's host tier read in place: the daemon's maps, and the merged map the steps'
        # GEMVs read, recomputed at the start of every step (inference.experts.host_reads)
        self._host_reads = self._slot_map = self._merged = None
        # inference.experts.cpu_experts.CpuExpertsConfig: a CPU pool computes a share of the
        # host-tier experts of each step (a pool per session: it reads the session's host tier)
        self.cpu_experts_config = cpu_experts
        self.cpu_experts = None
        self._follow_source()

    @classmethod
    def create(cls, model: torch.nn.Module, source, *, max_len: int, cache_keyword: str,
               capture: bool | None = None, compile_layers: bool | None = None,
               cpu_experts=None) -> StaticDecoder | None:
        """None where the model or source cannot (logged); cpu_experts (CpuExpertsConfig) is refused
        with a ValueError where no step could use it."""
        device = model.get_input_embeddings().weight.device
        reason = why_not(model, source, device)
        if reason is not None:
            if cpu_experts is not None:
                raise ValueError(f"cpu_experts_threads: CPU experts run inside captured decode steps; {reason}")
            log.info("decode steps run eagerly: %s", reason)
            return None
        return cls(model, source, max_len, cache_keyword=cache_keyword,
                   capture=device.type == "cuda" if capture is None else capture, compile_layers=compile_layers,
                   cpu_experts=cpu_experts)

    def _follow_source(self) -> None:
        """Read the source's slot map, arena and fence again when its session changed (a reconnect
        after storaged restarted: a new arena mapping, a new fence): the old ones are unmapped, and
        a graph captured on them is dropped, to be captured again."""
        lookup = self.source.device_lookup()
        fence = lookup[4] if lookup is not None else None
        if fence is self.fence and self.fence is not None:
            return
        if self._launched:  # launched in the old session: let them run out (its fence is gone with it)
            self._synchronize()
            self.abandoned_steps += len(self._launched)
            self.steps -= len(self._launched)
            self._launched.clear()
        self._graph = self._graph_logits = None
        self._piecewise = None
        self._prefills = {}
        if lookup is None:  # a session without a slot map on this device: acquire path only
            self.close()
            self.fence, self._lookups, self.lookup_enabled = None, {}, False
            self._host_reads = self._slot_map = self._merged = None
            return
        slot_map, rows, arena, stride, fence, host = lookup
        self.fence = fence
        self._host_reads, self._slot_map = host, slot_map
        self._merged = torch.empty_like(slot_map) if host is not None else None  # [rows, E] int32
        self._lookups = {}
        shares = self._start_cpu_experts(host, stride)
        for layer, binding in self.bindings.items():
            row = rows[layer]
            if host is not None and reads_host_tier(binding):
                self._lookups[layer] = DeviceLookup(self._merged[row], arena, stride, self.misses, slot_map[row],
                                                    host.slots, shares.get(layer))
            else:
                self._lookups[layer] = DeviceLookup(slot_map[row], arena, stride, self.misses)
        self.lookup_enabled = True  # a new session's fence is not revoked

    def _start_cpu_experts(self, host, stride: int) -> dict:
        """The CpuShare of each layer whose host-tier experts the CPU pool shares, from a pool made
        for this session's host tier (the previous session's pool stopped first)."""
        if self.cpu_experts is not None:
            self.cpu_experts.close()
            self.cpu_experts = None
        config = self.cpu_experts_config
        if config is None:
            return {}
        if host is None or not host.host_address:
            raise ValueError("cpu_experts_threads: storaged shares no host tier this process reads in place "
                             "(set its host_cache_bytes; the inference side's host reads must be on)")
        from inference.experts.cpu_experts import CpuExperts
        from inference.experts.fused import GROUPED_PAIRS, activation_of

        bindings = {layer: b for layer, b in self.bindings.items() if reads_host_tier(b)}
        modules = experts_modules(self.model)
        activations = {layer: activation_of(modules[layer][1], b) for layer, b in bindings.items()}
        dtype = self.model.get_input_embeddings().weight.dtype
        self.cpu_experts = CpuExperts(config, bindings, activations, host_address=host.host_address,
                                      host_slots=host.host_slots, slot_bytes=stride, max_pairs=GROUPED_PAIRS,
                                      device=self.device, dtype=dtype)
        return self.cpu_experts.layers

    def close(self) -> None:
        """Stop the CPU experts pool, if any (the decoder's steps must have ended)."""
        if self.cpu_experts is not None:
            self.cpu_experts.close()
            self.cpu_experts = None

    # --- the model call -------------------------------------------------------------------------

    def _call(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask, use_cache=True,
                         logits_to_keep=1, **{self.cache_keyword: self.cache})
        return out.logits[0, -1]  # [V]

    def _step_call(self) -> torch.Tensor:
        """The decode step on the static buffers: all device work, no host sync."""
        torch.le(self._kv_index, self.positions.view(1, 1, 1, 1), out=self.mask)
        self.misses.zero_()
        self._merge_maps()
        return self._call(self.ids, self.positions, self.mask)

    def _merge_maps(self) -> None:
        """Both tiers' maps into the one the GEMVs read; inside the step's fence, like every read
        of the maps (device work: captured with the step)."""
        if self._host_reads is not None and self.lookup_enabled:
            self._host_reads.merge(self._slot_map, out=self._merged)

    def _set_lookup(self, on: bool) -> None:
        for layer, binding in self.bindings.items():
            binding.lookup = self._lookups[layer] if on else None

    # --- requests -------------------------------------------------------------------------------

    def prepare(self) -> None:
        """Capture the decode step now (and compile its layers) rather than in the first request,
        which would otherwise wait for it (about 15 s with compilation); nothing to do uncaptured."""
        self._follow_source()
        if self.capture and self._graph is None and self.lookup_enabled:
            self._capture()

    def fits(self, prompt_len: int, max_tokens: int) -> bool:
        return prompt_len + max_tokens <= self.max_len

    def start(self, prompt_ids: list[int]) -> torch.Tensor:
        """Reset the cache and prefill it (acquire path); logits [V] of the last prompt token."""
        self._follow_source()
        self.abandon()  # a step the previous request launched ahead and never needed
        if self.capture and self._graph is None and self.lookup_enabled:
            self._capture()
        reset_cache(self.cache)
        self._skip = self._backoff = 0
        count = len(prompt_ids)
        if not 0 < count < self.max_len:
            raise ValueError(f"a prompt of {count} tokens does not fit a static cache of {self.max_len}")
        self.length = count
        if self.lookup_prefill and self.lookup_enabled:
            logits = self._lookup_prefill(prompt_ids)
            if logits is not None:
                return logits
            reset_cache(self.cache)
        ids = torch.tensor([prompt_ids], dtype=torch.long, device=self.device)  # [1, P]
        positions = torch.arange(count, device=self.device).view(1, count)
        mask = self._kv_index <= positions.view(1, 1, count, 1)  # [1, 1, P, L] causal over the cache
        return self._call(ids, positions, mask)

    def step(self, token: int) -> torch.Tensor:
        """Logits [V] after feeding `token` at the next position; reads experts via the slot map,
        and runs the step again on the acquire path if one of them was absent."""
        assert not self._launched, "step() with launched steps not settled"
        if self.length >= self.max_len:
            raise ValueError(f"the static cache of {self.max_len} tokens is full")
        self.ids.fill_(token)
        self.positions.fill_(self.length)
        self.steps += 1
        logits = None
        if self.lookup_enabled and self._skip == 0:
            started = time.perf_counter()
            logits = self._lookup_step()
            if logits is None:
                self._backoff = min(max(1, 2 * self._backoff), MAX_BACKOFF_STEPS)
                self._skip = self._backoff
            else:
                self._backoff = 0
                if self.cpu_experts is not None:  # the share's tuner learns from the steps' times
                    self.cpu_experts.observe_step(time.perf_counter() - started)
        elif self._skip:
            self._skip -= 1
            self.skipped_steps += 1
        if logits is None:
            self._set_lookup(False)
            logits = self._acquire_step()
        self.length += 1
        return logits

    def _acquire_step(self) -> torch.Tensor:
        """The step on the acquire path, which loads whatever is absent: the piecewise graphs
        with the experts run between them, or (uncaptured) the whole step eagerly."""
        if self._piecewise is None:
            return self._step_call()
        finish = getattr(self.source, "finish_resident_step", None)
        if callable(finish):  # a forward that failed midway may have left the source's resident step open
            finish()
        logits = self._piecewise.replay(expertpack_experts_forward)
        if callable(finish):  # what the model's forward hook does after an eager call
            finish()
        self.piecewise_steps += 1
        return logits

    def _lookup_step(self) -> torch.Tensor | None:
        logits = self._fenced(self._graph.replay if self._graph is not None else None,
                              (lambda: self._graph_logits) if self._graph is not None else self._step_call)
        if logits is None:
            for layer in self.cache.layers:  # undo: the step's position is written again
                layer.cumulative_length.sub_(1)
            self.redone_steps += 1
            return None
        self.lookup_steps += 1
        return logits

    def _fenced(self, replay, result) -> torch.Tensor | None:
        """Run device work that reads experts through the slot map under the session's step fence:
        `replay()` (a graph) then `result()`, or, uncaptured, `result()` with the lookups bound.
        The logits, or None when an expert was absent or the daemon revoked the fence."""
        from storaged.client.dataplane import FenceRevoked

        finish = getattr(self.source, "finish_resident_step", None)
        if callable(finish):  # a forward that failed midway may have left the source's resident step open
            finish()
        try:
            self.fence.begin()
        except FenceRevoked:
            self._revoked()
            return None
        try:
            if replay is not None:
                replay()
                logits = result()
            else:
                self._set_lookup(True)
                try:
                    logits = result()
                finally:
                    self._set_lookup(False)
            absent = int(self.misses.item())  # the one host sync (the work has completed)
        finally:
            try:
                self.fence.end()
            except FenceRevoked:
                self._revoked()
                absent = -1
        return None if absent else logits

    def _revoked(self) -> None:
        log.warning("storaged revoked this session's step fence; decode steps use the acquire path from now on")
        self.lookup_enabled = False

    # --- capture --------------------------------------------------------------------------------

    def _capture(self) -> None:
        """Record one decode step as a CUDA graph (the cache allocated by a first call), then
        leave the cache empty."""
        reset_cache(self.cache)
        self._call(torch.zeros((1, 1), dtype=torch.long, device=self.device),
                   torch.zeros((1, 1), dtype=torch.long, device=self.device),
                   torch.ones((1, 1, 1, self.max_len), dtype=torch.bool, device=self.device))  # allocates the cache
        self.positions.fill_(1)
        if self.compile_layers:
            try:
                with compiled_layers(self.model):
                    self._graph, self._graph_logits = self._capture_graph(self._step_call)
            except Exception as exc:  # inductor or dynamo cannot take this model: eager layers, same graph
                log.warning("compiling the decoder layers failed (%s: %s); the decode step is captured with eager "
                            "layers", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
                self.compile_layers = False
                reset_cache(self.cache)
        if not self.compile_layers:
            self._graph, self._graph_logits = self._capture_graph(self._step_call)
        log.info("decode step captured as a CUDA graph (static cache of %d tokens%s)", self.max_len,
                 ", compiled decoder layers" if self.compile_layers else "")
        if self.piecewise:
            self._record_piecewise()

    def _record_piecewise(self) -> None:
        """Record the acquire path's step as graphs split at the experts calls, with the layers
        the whole-step graph uses (already warm); eager steps where recording fails."""
        reset_cache(self.cache)
        piecewise = PiecewiseStep(self.device)
        try:
            with compiled_layers(self.model) if self.compile_layers else contextlib.nullcontext():
                piecewise.record(list(self.bindings.values()), self._step_call)
        except Exception as exc:  # a model whose step cannot be split: the acquire path stays eager
            log.warning("recording the piecewise decode step failed (%s: %s); steps on the acquire path run "
                        "eagerly", type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
            piecewise = None
        reset_cache(self.cache)
        self._piecewise = piecewise
        if piecewise is not None:
            log.info("acquire-path decode step recorded as %d CUDA graphs between %d experts calls",
                     piecewise.pieces, len(piecewise.boundaries))

    def _capture_graph(self, call) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm `call` up (kernels compiled, workspaces allocated) on a side stream under the
        fence, capture it with the slot-map lookups bound, then leave the cache empty."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        self._set_lookup(True)
        try:
            with torch.cuda.stream(side):
                for _ in range(2):
                    reset_cache(self.cache)  # a prefill as long as the cache must not run past its end
                    with self.fence.step():
                        call()
                        side.synchronize()
            torch.cuda.current_stream(self.device).wait_stream(side)
            reset_cache(self.cache)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = call()
        finally:
            self._set_lookup(False)
        reset_cache(self.cache)
        return graph, logits
