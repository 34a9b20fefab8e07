"""Triton kernels of the device side of the CPU experts handoff (inference.kernels.handoff).

`split_publish_kernel` (one program): picks the layer's experts the CPU computes (the lowest-id
`take` of the host-tier experts the pairs use, take = ceil(n * share), the share an int32 [2]
numerator and denominator read from device memory at every call), writes the GPU's slot map with those marked -2
(the GEMV skips them), a device mask of the CPU's pairs, each pair's host slot into the mailbox,
the hidden states, the job's header, then the ticket (a system-scope release, after a barrier:
the pool sees every input once it sees the ticket); no job when the CPU takes none, so every job
posted is one that `collect_kernel` waits for. The pool computes those experts whole.
`collect_kernel` (a program per pair): the CPU's pairs wait until the pool reports the ticket
done, then copy its rows into the GPU's output; a pool that does not answer in `timeout_ns`
(or refused the job) counts a miss, so the caller redoes the step on the acquire path.

The mailbox's layout is inference.kernels.host_experts's (int64 words: ticket 0, done 8,
expert kind 16, pairs 17, top-k 18, slots from 24).
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import globaltimer

W_TICKET = tl.constexpr(0)
W_DONE = tl.constexpr(8)
W_PROJECTION = tl.constexpr(16)
W_PAIRS = tl.constexpr(17)
W_TOP_K = tl.constexpr(18)
W_SLOTS = tl.constexpr(24)
W_COUNT = tl.constexpr(16)  # the copy agent's mailbox: its ticket is word 0 too, its slots from 24
MARK_MASK = tl.constexpr(0x3FFFFFFF)  # inference.kernels.copy_agent's marks
MARK_REFUSED = tl.constexpr(0x40000000)


@triton.jit
def _post(box_ptr, xbox_ptr, xbox_stride, x_ptr, x_stride, x_rows, cols, kind, pairs, top_k,
          BLOCK_C: tl.constexpr):
    """The hidden states, the header, then the next ticket."""
    for r in range(x_rows):
        for c0 in range(0, cols, BLOCK_C):
            c = c0 + tl.arange(0, BLOCK_C)
            v = tl.load(x_ptr + r * x_stride + c, mask=c < cols)
            tl.store(xbox_ptr + r * xbox_stride + c, v, mask=c < cols)
    tl.store(box_ptr + W_PROJECTION, kind)  # int64 words: the stores widen (scalar arguments
    tl.store(box_ptr + W_PAIRS, pairs)  # equal to 1 arrive as constants, which have no .to)
    tl.store(box_ptr + W_TOP_K, top_k)
    tl.debug_barrier()
    ticket = tl.load(box_ptr + W_TICKET, volatile=True) + 1
    tl.atomic_xchg(box_ptr + W_TICKET, ticket, sem="release", scope="sys")


@triton.jit
def split_publish_kernel(expert_ptr, map_ptr, gpu_map_ptr, cpu_pair_ptr, box_ptr, xbox_ptr, xbox_stride,
                         x_ptr, x_stride, x_rows, cols, n_experts, pairs, host_first, share_ptr, kind, top_k,
                         copy_map_ptr, cbox_ptr, copy_count_ptr, max_copies,
                         EP: tl.constexpr, PP: tl.constexpr, BLOCK_C: tl.constexpr, COPY: tl.constexpr):
    e = tl.arange(0, EP)
    emask = e < n_experts
    slot = tl.load(map_ptr + e, mask=emask, other=-1)  # [EP] int32: merged map (host slots >= host_first)
    p = tl.arange(0, PP)
    pmask = p < pairs
    pair_expert = tl.load(expert_ptr + p, mask=pmask, other=-1).to(tl.int32)  # [PP]
    hit = (pair_expert[None, :] == e[:, None]) & pmask[None, :]  # [EP, PP]: pair p uses expert e
    used = tl.sum(hit.to(tl.int32), axis=1) > 0  # [EP]
    hosted = (used & (slot >= host_first)).to(tl.int32)
    take_num = tl.load(share_ptr)  # the share, read at every call (a captured graph sees it change)
    take_den = tl.load(share_ptr + 1)
    take = (tl.sum(hosted) * take_num + take_den - 1) // take_den
    cpu = (hosted > 0) & (tl.cumsum(hosted, 0) <= take)  # [EP] the lowest-id `take` host-tier experts
    if COPY:  # the GPU's host-tier experts go to the copy agent, as many as its scratch holds
        copying = ((hosted > 0) & (cpu == 0)).to(tl.int32)
        order = tl.cumsum(copying, 0) - 1  # [EP] scratch slot of each copied expert
        copied = (copying > 0) & (order < max_copies)  # [EP] the others are read in place
        tl.store(copy_map_ptr + e, tl.where(copied, order + 1, -2), mask=emask)  # scratch ids from 1 (HostSlots)
        tl.store(gpu_map_ptr + e, tl.where(cpu | copied, -2, slot), mask=emask)
        tl.store(cbox_ptr + W_SLOTS + order, (slot - host_first).to(tl.int64), mask=emask & copied)
        copies = tl.sum(copied.to(tl.int32))
        tl.store(copy_count_ptr, copies)
        if copies > 0:
            tl.store(cbox_ptr + W_COUNT, copies)
            tl.debug_barrier()
            copy_ticket = tl.load(cbox_ptr + W_TICKET, volatile=True) + 1
            tl.atomic_xchg(cbox_ptr + W_TICKET, copy_ticket, sem="release", scope="sys")
    else:
        tl.store(gpu_map_ptr + e, tl.where(cpu, -2, slot), mask=emask)
    pair_cpu = tl.sum((hit & cpu[:, None]).to(tl.int32), axis=0)  # [PP] 0 or 1
    pair_slot = tl.sum(tl.where(hit, slot[:, None], 0), axis=0)  # [PP] the slot of the pair's one expert
    tl.store(cpu_pair_ptr + p, pair_cpu, mask=pmask)
    tl.store(box_ptr + W_SLOTS + p, tl.where(pair_cpu > 0, pair_slot - host_first, -1).to(tl.int64), mask=pmask)
    # Only a job the collect will wait for is posted: an unawaited one would let the next layer's
    # post overwrite the mailbox while the pool still reads it (it would serve one of the two).
    if tl.sum(pair_cpu) > 0:
        _post(box_ptr, xbox_ptr, xbox_stride, x_ptr, x_stride, x_rows, cols, kind, pairs, top_k, BLOCK_C)


@triton.jit
def _clock(step, INTERP: tl.constexpr):
    if INTERP:  # the interpreter has no timer: count polls instead (a poll there takes microseconds)
        return step * 1000
    else:
        return globaltimer()


@triton.jit
def collect_kernel(out_ptr, out_stride, rows, cpu_pair_ptr, box_ptr, obox_ptr, obox_stride, miss_ptr, timeout_ns,
                   BLOCK: tl.constexpr, INTERP: tl.constexpr):
    p = tl.program_id(0).to(tl.int64)
    if tl.load(cpu_pair_ptr + p) == 0:
        return
    ticket = tl.load(box_ptr + W_TICKET, volatile=True)
    done = tl.load(box_ptr + W_DONE, volatile=True)
    start = _clock(0, INTERP)
    now = start
    step = 0
    while (done != ticket) & (done != -ticket) & (now - start < timeout_ns):
        done = tl.load(box_ptr + W_DONE, volatile=True)
        step += 1
        now = _clock(step, INTERP)
    if done != ticket:  # late or refused: the step is redone on the acquire path
        tl.atomic_add(miss_ptr, 1)
        return
    for n0 in range(0, rows, BLOCK):
        n = n0 + tl.arange(0, BLOCK)
        v = tl.load(obox_ptr + p * obox_stride + n, mask=n < rows, volatile=True)
        tl.store(out_ptr + p * out_stride + n, v, mask=n < rows)


@triton.jit
def copy_wait_kernel(mark_ptr, cbox_ptr, copy_count_ptr, miss_ptr, timeout_ns, INTERP: tl.constexpr):
    """Until the copy agent marks the layer's copies landed (one program; nothing to wait for when
    the layer posted none); a mark that does not come in `timeout_ns`, or a refusal, is a miss."""
    if tl.load(copy_count_ptr) == 0:
        return
    ticket = (tl.load(cbox_ptr + W_TICKET, volatile=True) & MARK_MASK).to(tl.int32)
    mark = tl.load(mark_ptr, volatile=True)
    start = _clock(0, INTERP)
    now = start
    step = 0
    while (mark != ticket) & (mark != (ticket | MARK_REFUSED)) & (now - start < timeout_ns):
        mark = tl.load(mark_ptr, volatile=True)
        step += 1
        now = _clock(step, INTERP)
    if mark != ticket:  # late or refused: the step is redone on the acquire path
        tl.atomic_add(miss_ptr, 1)
