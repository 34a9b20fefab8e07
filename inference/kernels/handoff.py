"""Launchers of the device side of the CPU experts handoff (handoff_triton.py), over the pool's
mailbox (inference.kernels.host_experts). All device work with fixed shapes and no host sync, so a
decode step that hands experts to the CPU is still one CUDA graph:

    box = Mailbox.of(pool, device)
    gpu_map = split_publish(box, x, experts, merged_row, host_first, share, kind=kind, top_k=k,
                            gpu_map=..., cpu_pairs=...)      # the CPU starts on its pairs' experts
    down = ... the GPU's GEMVs of the other pairs (slot -2 skipped), activation, GEMVs ...
    collect(box, down, cpu_pairs, misses, timeout_ns)         # the CPU's rows into down

With a copy agent (inference.kernels.copy_agent), split_publish also posts the GPU's host-tier
experts to it (copies=CopyBox.of(agent, device), copy_map=...), and the GEMVs of those experts run
after copy_wait(copies, misses, timeout_ns), reading the scratch slots.
"""

from __future__ import annotations

import dataclasses
import os

import torch

from inference.kernels.ops import triton_module

SPLIT_BLOCK_C = 512
COLLECT_BLOCK = 512
CPU_COMPUTED = -2  # a slot-map entry the GEMV skips: the CPU computes that expert's pairs


class _Interface:
    """A CUDA array over host memory the device reads and writes in place (page-locked, mapped)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (address, False), "version": 3}


@dataclasses.dataclass(frozen=True)
class Mailbox:
    """The pool's mailbox as the kernels take it (on the model's device)."""

    words: torch.Tensor  # int64 [n]
    x: torch.Tensor  # bfloat16 [max_pairs, max_cols]
    out: torch.Tensor  # bfloat16 [max_pairs, max_rows]

    @classmethod
    def of(cls, pool, device: torch.device) -> Mailbox:
        if device.type != "cuda":  # the kernels run interpreted, on the host tensors themselves
            return cls(pool.words, pool.x, pool.out)

        def view(tensor: torch.Tensor, typestr: str) -> torch.Tensor:
            return torch.as_tensor(_Interface(tensor.data_ptr(), tuple(tensor.shape), typestr), device=device)

        return cls(view(pool.words, "<i8"), view(pool.x.view(torch.int16), "<i2").view(torch.bfloat16),
                   view(pool.out.view(torch.int16), "<i2").view(torch.bfloat16))


@dataclasses.dataclass(frozen=True)
class CopyBox:
    """The copy agent's side of a decoder (inference.kernels.copy_agent), as the kernels take it."""

    words: torch.Tensor  # int64 [n]: its mailbox, on the model's device
    mark: torch.Tensor  # int32 [1]: where its stream marks a job's copies landed
    count: torch.Tensor  # int32 [1]: the copies the current layer posted (0: nothing to wait for)
    scratch: torch.Tensor  # uint8 [max_copies * slot_bytes]: the copies' slots
    max_copies: int

    @classmethod
    def of(cls, agent, device: torch.device) -> CopyBox:
        words = agent.words
        if device.type == "cuda":
            words = torch.as_tensor(_Interface(words.data_ptr(), tuple(words.shape), "<i8"), device=device)
        return cls(words, agent.mark, torch.zeros(1, dtype=torch.int32, device=device), agent.scratch,
                   agent.max_copies)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    module = triton_module()
    assert module is not None, "the handoff needs triton"
    from inference.kernels import handoff_triton

    return handoff_triton


def split_publish(box: Mailbox, x: torch.Tensor, experts: torch.Tensor, slot_map: torch.Tensor, host_first: int,
                  share: torch.Tensor, *, kind: int, top_k: int, gpu_map: torch.Tensor,
                  cpu_pairs: torch.Tensor, copies: CopyBox | None = None,
                  copy_map: torch.Tensor | None = None) -> torch.Tensor:
    """Hand the CPU ceil(share * n) of the n host-tier experts the pairs use (slot_map: int32 [E],
    the merged map; experts: int64 [P]; share: int32 [2], numerator and denominator, on the device,
    read when the kernel runs); post x [T, H] and the job (the pool's expert `kind`) when the CPU
    takes at least one expert, else no job (collect then waits for none). Fills gpu_map
    (int32 [E]: slot_map with the CPU's experts -2) and cpu_pairs (int32 [>= P]: 1 for the CPU's
    pairs); returns gpu_map.

    With `copies`, the other host-tier experts (up to its max_copies, lowest ids first) go to the
    copy agent: copy_map (int32 [E]) gets 1 + their scratch slot (-2 elsewhere), gpu_map -2 for
    them too, and the job is posted when there is at least one (copy_wait then waits for it)."""
    pairs, n_experts = experts.shape[0], slot_map.shape[0]
    assert x.stride(-1) == 1 and x.shape[0] <= box.x.shape[0] and x.shape[1] <= box.x.shape[1], tuple(x.shape)
    assert pairs <= box.out.shape[0] and cpu_pairs.shape[0] >= pairs
    assert share.dtype == torch.int32 and share.shape == (2,), (share.dtype, tuple(share.shape))
    assert (copies is None) == (copy_map is None) and (copy_map is None or copy_map.shape[0] == n_experts)
    _kernels().split_publish_kernel[(1,)](
        experts, slot_map, gpu_map, cpu_pairs, box.words, box.x, box.x.stride(0), x, x.stride(0), x.shape[0],
        x.shape[1], n_experts, pairs, host_first, share, kind, top_k,
        gpu_map if copy_map is None else copy_map, box.words if copies is None else copies.words,
        cpu_pairs if copies is None else copies.count, 0 if copies is None else copies.max_copies,
        EP=triton_next_power_of_2(n_experts), PP=triton_next_power_of_2(pairs), BLOCK_C=SPLIT_BLOCK_C,
        COPY=copies is not None, num_warps=4)
    return gpu_map


def copy_wait(copies: CopyBox, misses: torch.Tensor, timeout_ns: int) -> None:
    """Wait on the device until the copy agent marks the layer's copies landed (none posted: no
    wait); one that does not in timeout_ns, or refused the job, adds to misses (int32 [1])."""
    _kernels().copy_wait_kernel[(1,)](copies.mark, copies.words, copies.count, misses, timeout_ns,
                                      INTERP=_interpreted(), num_warps=1)


def collect(box: Mailbox, out: torch.Tensor, cpu_pairs: torch.Tensor, misses: torch.Tensor, timeout_ns: int) -> None:
    """Copy the CPU's rows of the posted job into out [P, rows] once the pool reports it done; a
    pool that does not (in timeout_ns) or refused the job adds to misses (int32 [1])."""
    pairs, rows = out.shape
    assert out.stride(-1) == 1 and rows <= box.out.shape[1]
    if pairs == 0:
        return
    _kernels().collect_kernel[(pairs,)](out, out.stride(0), rows, cpu_pairs, box.words, box.out, box.out.stride(0),
                                        misses, timeout_ns, BLOCK=COLLECT_BLOCK, INTERP=_interpreted(), num_warps=4)


def triton_next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
