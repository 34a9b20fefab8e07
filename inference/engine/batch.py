"""One step of a batch of sequences: their forwards in lockstep, meeting at every MoE layer.

Each running sequence keeps the model's own cache object (DynamicCache, the recurrent KDA state
of kimi_linear / kimi_k3, DeepSeek-V4's compressed cache...), so nothing about attention or
recurrent state needs batching, padding or paging, and every architecture batches the same way.
A step runs every sequence's forward at once, each on a thread of a pool; at each MoE layer the
experts call (inference.experts.forward) hands its tokens to an ExpertsRendezvous and waits. When
every forward still running has arrived, one experts call runs over the union of their tokens:
one acquire (one storaged data-plane request) for the union of the batch's experts, one pass of
the expert kernels over all tokens, and each forward gets its rows back. A sequence's result
differs from its result alone only by the experts' reduction order over more rows.

The dense parts (attention, norms, routers, lm_head) run per sequence: on a CPU they overlap on
torch's threads; on CUDA they queue on the same stream. A sequence on the static CUDA-graph
decoder (one running request) steps alone, after the others.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence as Seq
from concurrent.futures import ThreadPoolExecutor

import torch

from inference.experts.binding import experts_modules
from inference.experts.forward import BINDING_ATTRIBUTE, expertpack_experts_forward


class BatchDivergedError(RuntimeError):
    """The forwards of a batch step reached different experts modules at the same rendezvous."""


class _Arrival:
    __slots__ = ("module", "hidden", "index", "weights", "output", "error", "done")

    def __init__(self, module, hidden, index, weights):
        self.module, self.hidden, self.index, self.weights = module, hidden, index, weights
        self.output: torch.Tensor | None = None
        self.error: BaseException | None = None
        self.done = False


_member_of = threading.local()  # .rendezvous: the step whose forward this thread is running, if any


class _Gather:
    """Set on every experts binding: sends the experts calls of a thread that is running a batch
    step's forward to that step's rendezvous; every other call (a forward alone) goes on as usual."""

    def joined(self) -> bool:
        return getattr(_member_of, "rendezvous", None) is not None

    def forward(self, module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return _member_of.rendezvous.forward(module, hidden, index, weights)


GATHER = _Gather()


def install(model: torch.nn.Module) -> None:
    """Route the experts calls of batch-step threads of `model` through their rendezvous."""
    for _, module in experts_modules(model).values():
        binding = getattr(module, BINDING_ATTRIBUTE, None)
        if binding is not None:
            binding.gather = GATHER


class ExpertsRendezvous:
    """Where the forwards of one step meet at each MoE layer. `open(n)` before starting n forwards,
    each inside `member()`; a forward that ends (or fails) leaves, so the others never wait for it."""

    def __init__(self):
        self._cond = threading.Condition()
        self._members = 0  # forwards of the step still running
        self._arrived: list[_Arrival] = []

    def open(self, members: int) -> None:
        with self._cond:
            assert self._members == 0 and not self._arrived, "a step is already open"
            self._members = members

    def member(self) -> _Membership:
        return _Membership(self)

    def forward(self, module, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        arrival = _Arrival(module, hidden, index, weights)
        with self._cond:
            self._arrived.append(arrival)
            batch = self._take_if_complete()
            if batch is None:
                while not arrival.done:
                    self._cond.wait()
        if batch is not None:
            self._run(batch)
        if arrival.error is not None:
            raise arrival.error
        return arrival.output

    def _leave(self) -> None:
        with self._cond:
            self._members -= 1
            batch = self._take_if_complete()
        if batch is not None:
            self._run(batch)

    def _take_if_complete(self) -> list[_Arrival] | None:
        if not self._arrived or len(self._arrived) < self._members:
            return None
        batch, self._arrived = self._arrived, []
        return batch

    def _run(self, batch: list[_Arrival]) -> None:
        """One experts call over every arrival's tokens (on this thread), and each its rows back."""
        try:
            module = batch[0].module
            if any(a.module is not module for a in batch):
                names = sorted({type(a.module).__name__ + f"@{id(a.module):x}" for a in batch})
                raise BatchDivergedError(f"the forwards of a batch step met at different experts modules: {names}")
            was, _member_of.rendezvous = getattr(_member_of, "rendezvous", None), None
            try:  # as a plain call: this thread runs the union
                output = expertpack_experts_forward(module, torch.cat([a.hidden for a in batch]),
                                                    torch.cat([a.index for a in batch]),
                                                    torch.cat([a.weights for a in batch]))
            finally:
                _member_of.rendezvous = was
            rows = output.split([a.hidden.shape[0] for a in batch])
            for arrival, part in zip(batch, rows):
                arrival.output = part
        except BaseException as exc:  # every forward of the union fails with it
            for arrival in batch:
                arrival.error = exc
        with self._cond:
            for arrival in batch:
                arrival.done = True
            self._cond.notify_all()


class _Membership:
    def __init__(self, rendezvous: ExpertsRendezvous):
        self.rendezvous = rendezvous

    def __enter__(self):
        _member_of.rendezvous = self.rendezvous

    def __exit__(self, *exc):
        _member_of.rendezvous = None
        self.rendezvous._leave()


class BatchStepper:
    """Runs the forwards of a step's sequences: alone on the calling thread when one, else in
    lockstep on a pool of `max_num_seqs` threads. Returns each failed sequence's exception."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int):
        self.max_num_seqs = max_num_seqs
        install(model)
        self.rendezvous = ExpertsRendezvous()
        self._pool: ThreadPoolExecutor | None = None  # started with the first batch of two

    def step(self, sequences: Seq) -> dict[object, BaseException]:
        assert len(sequences) <= self.max_num_seqs, f"{len(sequences)} sequences > max_num_seqs {self.max_num_seqs}"
        failed: dict[object, BaseException] = {}
        together = [s for s in sequences if s.static is None]
        if len(together) == 1:
            self._alone(together[0], failed)
        elif together:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_num_seqs, thread_name_prefix="inference-batch")
            self.rendezvous.open(len(together))
            futures = [(s, self._pool.submit(self._member, s)) for s in together]
            for sequence, future in futures:
                error = future.result()
                if error is not None:
                    failed[sequence] = error
        for sequence in sequences:
            if sequence.static is not None:
                self._alone(sequence, failed)
        return failed

    @staticmethod
    def _alone(sequence, failed: dict) -> None:
        try:
            with torch.inference_mode():
                sequence.forward()
        except Exception as exc:
            failed[sequence] = exc

    def _member(self, sequence) -> BaseException | None:
        try:
            with torch.inference_mode(), self.rendezvous.member():  # grad mode is per thread
                sequence.forward()
        except Exception as exc:
            return exc
        return None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
