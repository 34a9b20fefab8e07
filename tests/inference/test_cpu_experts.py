"""The CPU experts handoff (inference.experts.cpu_experts, inference.kernels.handoff): a layer's
decode-sized call with a share of its host-tier experts computed by the CPU pool equals the same
call computed by the GPU alone; the split takes the share asked; a pool that does not answer is a
miss (the step is redone), never a wrong result. Without CUDA the kernels run interpreted."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from test_host_experts import HIDDEN, host_tier

from inference.experts.cpu_experts import CpuExpertsConfig, CpuShare, pair_forward_shared
from inference.kernels import handoff
from inference.kernels.copy_agent import W_COUNT, CopyAgent
from inference.kernels.host_experts import W_TICKET, HostExpertsPool
from inference.kernels.ops import HostSlots, moe_gemv
from packformat import ElementType

pytest.importorskip("triton")
pytestmark = [pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                 reason="no C compiler to build the CPU kernels"),
              pytest.mark.usefixtures("one_thread")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
EXPERTS, TOP_K = 8, 4
VRAM_SLOTS = 3  # experts 0..2 in the arena, 3..7 in the host tier


class Layer:
    """A host tier, an arena, the merged map, and the GPU-only reference of a layer's calls."""

    def __init__(self, element_type, rng):
        data, self.slot_bytes, self.up, self.down, _ = host_tier(element_type, EXPERTS, rng)
        self.arena = data[: VRAM_SLOTS * self.slot_bytes].clone().to(DEVICE)
        self.tier = data[VRAM_SLOTS * self.slot_bytes:].clone()
        if DEVICE == "cuda":
            self.tier = self.tier.pin_memory()
        self.host = HostSlots(VRAM_SLOTS, self.tier.data_ptr() - self.arena.data_ptr())
        ids = list(range(VRAM_SLOTS)) + [VRAM_SLOTS + h for h in range(EXPERTS - VRAM_SLOTS)]
        self.slot_map = torch.tensor(ids, dtype=torch.int32, device=DEVICE)  # merged: host ids from VRAM_SLOTS on

    def gemv(self, experts, misses, scratch_slots=None):
        def run(inputs, slot_map, per_pair, first, out=None, scratch=False):
            return moe_gemv(inputs, experts, slot_map, self.arena, self.slot_bytes, self.up if first else self.down,
                            top_k=TOP_K, x_per_pair=per_pair, misses=misses if first and not scratch else None,
                            host=scratch_slots if scratch else self.host, out=out)
        return run

    def reference(self, x, experts):
        misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        gemv = self.gemv(experts, misses)
        return gemv(activate(gemv(x, self.slot_map, False, True)).contiguous(), self.slot_map, True, False)


def activate(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.fixture
def pools():
    made = []
    yield made
    for pool in made:
        pool.close()


def _share(layer, pools, share=(1, 2), start=True, timeout_ns=200_000_000, copies=None):
    pool = HostExpertsPool(host_address=layer.tier.data_ptr(), host_slots=EXPERTS - VRAM_SLOTS,
                           slot_bytes=layer.slot_bytes, max_pairs=16, max_cols=HIDDEN, max_rows=HIDDEN, threads=2,
                           pinned=DEVICE == "cuda")
    pools.append(pool)
    kind = pool.add_kind((layer.up,), layer.down)
    if start:
        pool.start()
    cpu = CpuShare(handoff.Mailbox.of(pool, torch.device(DEVICE)), kind,
                   torch.tensor(share, dtype=torch.int32, device=DEVICE),
                   torch.empty(EXPERTS, dtype=torch.int32, device=DEVICE),
                   torch.zeros(16, dtype=torch.int32, device=DEVICE), 16, timeout_ns, copies=copies,
                   copy_map=None if copies is None else torch.empty(EXPERTS, dtype=torch.int32, device=DEVICE))
    return pool, cpu


def _copies(layer, pools, max_copies=4, start=True):
    """A copy agent over the layer's host tier (memcpy into a host scratch without CUDA), its
    CopyBox and the HostSlots by which the GEMV reads its scratch."""
    agent = CopyAgent(host_address=layer.tier.data_ptr(), host_slots=EXPERTS - VRAM_SLOTS,
                      slot_bytes=layer.slot_bytes, max_copies=max_copies, device=torch.device(DEVICE))
    pools.append(agent)
    if start:
        agent.start()
    box = handoff.CopyBox.of(agent, torch.device(DEVICE))
    return agent, box, HostSlots(1, agent.scratch.data_ptr() - layer.arena.data_ptr())


@pytest.mark.parametrize("element_type", [ElementType.Q4_K, ElementType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2])
def test_shared_call_equals_the_gpu_alone(pools, element_type, tokens):
    """Half of the host-tier experts (rounded up) go to the CPU, lowest ids first; the rows agree
    with the GPU-only call to bf16 rounding (summation order alone differs), and nothing is missed."""
    rng = np.random.default_rng(int(element_type) + tokens)
    layer = Layer(element_type, rng)
    pool, cpu = _share(layer, pools)
    routing = [[4, 0, 6, 3], [7, 5, 1, 4]][:tokens]  # host-tier experts: 3..7
    experts = torch.tensor(routing, dtype=torch.int64, device=DEVICE).reshape(-1)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = pair_forward_shared(cpu, layer.gemv(experts, misses), activate, x, experts, layer.slot_map, VRAM_SLOTS,
                              TOP_K, misses)
    expected = layer.reference(x, experts)
    assert int(misses.item()) == 0
    host_used = sorted({e for row in routing for e in row if e >= VRAM_SLOTS})
    taken = host_used[: -(-len(host_used) // 2)]
    assert cpu.gpu_map.cpu().tolist() == [-2 if e in taken else s for e, s in enumerate(layer.slot_map.tolist())]
    on_cpu = [int(e) in taken for e in experts.tolist()]
    assert cpu.cpu_pairs[: len(on_cpu)].cpu().tolist() == [int(c) for c in on_cpu]
    assert pool.stats().jobs == 1  # one handoff a layer: the CPU computes its experts whole
    got, expected = got.float().cpu(), expected.float().cpu()
    gpu_rows = torch.tensor([not c for c in on_cpu])
    assert torch.equal(got[gpu_rows], expected[gpu_rows])  # the GPU's own rows: the same kernels
    # the CPU's: its summation order and exponential; one rounding apart can move a row by a bf16 ulp
    # of an intermediate, hence the bound on the largest output
    scale = expected.abs().amax(dim=1, keepdim=True)
    assert torch.all((got - expected).abs() <= scale * 2**-6), "CPU rows beyond bf16 rounding of the GPU's"
    assert (got == expected).float().mean() >= 0.5


@pytest.mark.parametrize("share, taken", [((1, 1), 4), ((1, 3), 2), ((1, 64), 1)])
def test_share_of_the_host_tier_experts(pools, share, taken):
    rng = np.random.default_rng(3)
    layer = Layer(ElementType.Q4_K, rng)
    _, cpu = _share(layer, pools, share=share)
    experts = torch.tensor([3, 5, 6, 7], dtype=torch.int64, device=DEVICE)  # all four in the host tier
    x = torch.randn(1, HIDDEN).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pair_forward_shared(cpu, layer.gemv(experts, misses), activate, x, experts, layer.slot_map, VRAM_SLOTS, TOP_K,
                        misses)
    assert int(misses.item()) == 0
    assert cpu.cpu_pairs[:4].cpu().tolist() == [1] * taken + [0] * (4 - taken)


def test_the_share_is_read_at_every_call(pools):
    """The share lives in device memory (a captured step reads what the tuner wrote since); 0
    leaves every pair to the GPU, and the rows are the same whoever computes them."""
    layer = Layer(ElementType.Q4_K, np.random.default_rng(6))
    pool, cpu = _share(layer, pools, share=(4, 16))
    experts = torch.tensor([3, 5, 6, 7], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(6)).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    taken, rows = [], []
    for numerator in (4, 12, 0):
        cpu.share[0] = numerator
        rows.append(pair_forward_shared(cpu, layer.gemv(experts, misses), activate, x, experts, layer.slot_map,
                                        VRAM_SLOTS, TOP_K, misses).float().cpu())
        taken.append(int(cpu.cpu_pairs[:4].sum()))
    assert int(misses.item()) == 0
    assert taken == [1, 3, 0]
    assert (pool.stats().jobs, int(pool.words[W_TICKET])) == (2, 2)  # a share of 0 posts no job
    scale = rows[2].abs().amax(dim=1, keepdim=True)
    for got in rows[:2]:
        assert torch.all((got - rows[2]).abs() <= scale * 2**-6)


def test_a_layer_whose_pairs_use_no_host_tier_expert_posts_no_job(pools):
    """Every job posted is one the device waits for: with no host-tier expert in the layer's
    pairs the CPU takes none and nothing is posted (a pool that never started is not waited on,
    so no miss), and the rows are the GPU-only call's."""
    layer = Layer(ElementType.Q4_K, np.random.default_rng(8))
    pool, cpu = _share(layer, pools, start=False, timeout_ns=2_000_000)
    experts = torch.tensor([2, 0, 1, 2], dtype=torch.int64, device=DEVICE)  # VRAM slots only
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(8)).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = pair_forward_shared(cpu, layer.gemv(experts, misses), activate, x, experts, layer.slot_map, VRAM_SLOTS,
                              TOP_K, misses)
    assert int(misses.item()) == 0
    assert int(pool.words[W_TICKET]) == 0 and cpu.cpu_pairs[:4].cpu().tolist() == [0] * 4
    assert torch.equal(got.cpu(), layer.reference(x, experts).cpu())


def test_a_pool_that_does_not_answer_is_a_miss(pools):
    """Threads never started: the device's wait times out and counts a miss, so the decode step
    is thrown away and redone on the acquire path."""
    rng = np.random.default_rng(5)
    layer = Layer(ElementType.Q4_K, rng)
    _, cpu = _share(layer, pools, start=False, timeout_ns=2_000_000)
    experts = torch.tensor([3, 0, 1, 2], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, HIDDEN).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pair_forward_shared(cpu, layer.gemv(experts, misses), activate, x, experts, layer.slot_map, VRAM_SLOTS, TOP_K,
                        misses)
    assert int(misses.item()) >= 1


@pytest.mark.parametrize("threads, share", [(0, 0.5), (True, 0.5), (2, 0.0), (2, 1.5), (2, "half"), (2, True)])
def test_config_refuses_bad_values(threads, share):
    with pytest.raises(ValueError, match="cpu_experts"):
        CpuExpertsConfig(threads, share)


def test_config_without_a_share_is_tuned():
    assert CpuExpertsConfig(2).share is None and CpuExpertsConfig(2, 1).share == 1


@pytest.mark.parametrize("element_type", [ElementType.Q4_K, ElementType.MXFP4], ids=lambda t: t.name)
@pytest.mark.parametrize("tokens", [1, 2])
def test_copied_experts_equal_the_gpu_alone(pools, element_type, tokens):
    """With a copy agent, the host-tier experts the CPU does not take are copied into scratch
    slots (lowest ids first) and read there by the same GEMV: their rows equal the GPU-only call's
    bit for bit, the CPU's to bf16 rounding; one copy job a layer, nothing missed."""
    rng = np.random.default_rng(20 + int(element_type) + tokens)
    layer = Layer(element_type, rng)
    agent, box, scratch_slots = _copies(layer, pools)
    pool, cpu = _share(layer, pools, share=(1, 3), copies=box)
    routing = [[4, 0, 6, 3], [7, 5, 1, 4]][:tokens]  # host-tier experts: 3..7
    experts = torch.tensor(routing, dtype=torch.int64, device=DEVICE).reshape(-1)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = pair_forward_shared(cpu, layer.gemv(experts, misses, scratch_slots), activate, x, experts,
                              layer.slot_map, VRAM_SLOTS, TOP_K, misses)
    expected = layer.reference(x, experts)
    assert int(misses.item()) == 0
    host_used = sorted({e for row in routing for e in row if e >= VRAM_SLOTS})
    taken = host_used[: -(-len(host_used) // 3)]
    copied = [e for e in host_used if e not in taken]
    slots = layer.slot_map.tolist()
    assert cpu.gpu_map.cpu().tolist() == [-2 if e in host_used else s for e, s in enumerate(slots)]
    assert cpu.copy_map.cpu().tolist() == [1 + copied.index(e) if e in copied else -2 for e in range(EXPERTS)]
    assert (agent.stats().jobs, agent.stats().copies, agent.stats().refused) == (1, len(copied), 0)
    assert int(box.count.item()) == len(copied) and int(agent.words[W_COUNT]) == len(copied)
    assert pool.stats().jobs == 1
    got, expected = got.float().cpu(), expected.float().cpu()
    on_cpu = torch.tensor([int(e) in taken for e in experts.tolist()])
    assert torch.equal(got[~on_cpu], expected[~on_cpu])  # VRAM and copied experts: the same kernels, bytes
    scale = expected.abs().amax(dim=1, keepdim=True)
    assert torch.all((got[on_cpu] - expected[on_cpu]).abs() <= scale[on_cpu] * 2**-6)


def test_experts_beyond_the_scratch_are_read_in_place(pools):
    """A layer using more host-tier experts than the scratch has slots copies the first ones and
    reads the others in place: the same rows."""
    layer = Layer(ElementType.Q4_K, np.random.default_rng(31))
    agent, box, scratch_slots = _copies(layer, pools, max_copies=1)
    _, cpu = _share(layer, pools, share=(1, 4), copies=box)
    experts = torch.tensor([3, 5, 6, 7], dtype=torch.int64, device=DEVICE)  # CPU: 3; copied: 5; in place: 6, 7
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(31)).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    got = pair_forward_shared(cpu, layer.gemv(experts, misses, scratch_slots), activate, x, experts,
                              layer.slot_map, VRAM_SLOTS, TOP_K, misses)
    assert int(misses.item()) == 0
    assert cpu.copy_map.cpu().tolist() == [-2] * 5 + [1, -2, -2]
    assert cpu.gpu_map.cpu().tolist()[3:] == [-2, 4, -2, 6, 7]
    assert agent.stats().copies == 1
    expected = layer.reference(x, experts).float().cpu()
    assert torch.equal(got.float().cpu()[1:], expected[1:])


def test_a_layer_the_cpu_takes_whole_posts_no_copy_job(pools):
    """Every copy job posted is one the device waits for: with every host-tier expert on the CPU
    nothing is posted to the agent (never started here, so a wait would be a miss)."""
    layer = Layer(ElementType.Q4_K, np.random.default_rng(32))
    agent, box, scratch_slots = _copies(layer, pools, start=False)
    _, cpu = _share(layer, pools, share=(1, 1), copies=box)
    experts = torch.tensor([3, 0, 5, 1], dtype=torch.int64, device=DEVICE)
    x = torch.randn(1, HIDDEN).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pair_forward_shared(cpu, layer.gemv(experts, misses, scratch_slots), activate, x, experts, layer.slot_map,
                        VRAM_SLOTS, TOP_K, misses)
    assert int(misses.item()) == 0
    assert int(agent.words[0]) == 0 and int(box.count.item()) == 0


def test_a_copy_agent_that_does_not_answer_is_a_miss(pools):
    """The agent's thread never started: the device's wait for the mark times out and counts a
    miss, so the step is redone on the acquire path rather than reading stale scratch."""
    layer = Layer(ElementType.Q4_K, np.random.default_rng(33))
    _, box, scratch_slots = _copies(layer, pools, start=False)
    _, cpu = _share(layer, pools, share=(1, 2), timeout_ns=2_000_000, copies=box)
    experts = torch.tensor([3, 5, 0, 1], dtype=torch.int64, device=DEVICE)  # CPU: 3; copied: 5
    x = torch.randn(1, HIDDEN).bfloat16().to(DEVICE)
    misses = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    pair_forward_shared(cpu, layer.gemv(experts, misses, scratch_slots), activate, x, experts, layer.slot_map,
                        VRAM_SLOTS, TOP_K, misses)
    assert int(misses.item()) >= 1


def test_config_takes_the_copy_engine_as_a_flag():
    assert CpuExpertsConfig(2).copy_engine is False and CpuExpertsConfig(2, copy_engine=True).copy_engine
    with pytest.raises(ValueError, match="copy_engine"):
        CpuExpertsConfig(2, copy_engine="yes")
