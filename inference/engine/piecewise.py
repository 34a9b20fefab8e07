"""A decode step as CUDA graphs split at the routed-experts calls: the dense part replayed, the
experts run eagerly between the pieces.

When the cache holds less than the working set, almost every decode step meets an absent expert,
so the whole-step graph of inference.engine.decode_graph cannot be used: the experts must be
acquired (a host sync to learn which, a data-plane request, a copy), and that needs the host in
the middle of the step. Run eagerly, the rest of the step (norms, attention, rotary, residuals,
the router: a few hundred launches of Python per layer) then bounds the step. Here it is
captured once, as one graph per stretch between two experts calls:

    piece 0: embedding, layer 0's attention and router        -> experts of layer 0 (eager)
    piece 1: layer 0's combine, layer 1's attention and router -> experts of layer 1 (eager)
    ...
    piece n: the last layer's combine, the final norm, the logits

Recording runs the step once with every experts call swapped for a boundary: the open capture
ends there, the call's inputs (produced inside the graphs' shared memory pool) are kept, a static
output buffer stands in for its result, and the next capture begins. A replay then runs piece i,
the experts of boundary i on its kept inputs (the usual acquire path: inference.experts.forward)
into its buffer, piece i + 1, and so on. The pieces share one memory pool and are replayed in the
order they were captured, which is what makes sharing it safe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch


@dataclasses.dataclass(frozen=True)
class _Boundary:
    """One routed-experts call of the recorded step: its module and kept inputs, its output buffer."""

    module: torch.nn.Module
    hidden_states: torch.Tensor  # [T, H] inside the pool, written by the piece before
    top_k_index: torch.Tensor  # [T, k]
    top_k_weights: torch.Tensor  # [T, k]
    out: torch.Tensor  # [T, H] read by the piece after


class PiecewiseStep:
    """Record with `record(bindings, call)` (CUDA only); then `replay(experts)` runs the step."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"a piecewise step is made of CUDA graphs; the model is on {device}")
        self.device = device
        self.graphs: list[torch.cuda.CUDAGraph] = []
        self.boundaries: list[_Boundary] = []
        self.output: torch.Tensor | None = None
        self._pool = None
        self._open: torch.cuda.CUDAGraph | None = None

    @property
    def pieces(self) -> int:
        return len(self.graphs)

    def record(self, bindings, call: Callable[[], torch.Tensor]) -> None:
        """Capture `call()` (kernels already warm: compiled, workspaces allocated), split at every
        experts call of `bindings` (ExpertsBinding, whose `segment` routes the call here)."""
        self._pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        torch.cuda.synchronize(self.device)
        for binding in bindings:
            binding.segment = self
        try:
            with torch.cuda.stream(side):
                self._begin()
                try:
                    output = call()
                finally:  # an exception must not leave the stream capturing
                    self._end()
        finally:
            for binding in bindings:
                binding.segment = None
        current.wait_stream(side)
        if not self.boundaries:
            raise ValueError("the recorded step called no experts module: nothing to split at")
        self.output = output

    def boundary(self, module: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                 top_k_weights: torch.Tensor) -> torch.Tensor:
        """Called in place of an experts call while recording: ends the piece, keeps the inputs,
        returns the buffer the next piece reads the experts' result from."""
        self._end()
        out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype, device=hidden_states.device)  # [T, H]
        self.boundaries.append(_Boundary(module, hidden_states, top_k_index, top_k_weights, out))
        self._begin()
        return out

    def _begin(self) -> None:
        self._open = torch.cuda.CUDAGraph()
        self._open.capture_begin(pool=self._pool)

    def _end(self) -> None:
        graph, self._open = self._open, None
        if graph is not None:
            graph.capture_end()
            self.graphs.append(graph)

    def replay(self, experts: Callable[[torch.nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
               ) -> torch.Tensor:
        """One step: every piece replayed, `experts(module, hidden_states, top_k_index,
        top_k_weights)` run eagerly at each boundary; the recorded call's output (static)."""
        assert self.output is not None and len(self.graphs) == len(self.boundaries) + 1
        for graph, edge in zip(self.graphs, self.boundaries):
            graph.replay()
            edge.out.copy_(experts(edge.module, edge.hidden_states, edge.top_k_index, edge.top_k_weights))
        self.graphs[-1].replay()
        return self.output
