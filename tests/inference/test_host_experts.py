"""The CPU experts pool (inference/kernels/host_experts.c): whole experts (gate/up, activation,
down) against the bf16-rounded dequantized weights and against the GPU kernels, each compiled
kernel (AVX-512 BF16, AVX2, portable), the activation against torch's, and the jobs it refuses."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from inference.dequant import dequantize_many
from inference.kernels.host_experts import HostExpertsPool, HostExpertsUnavailable, readable
from inference.kernels.ops import gemv_weight, moe_gemv
from packformat import ElementType, Role, RoleEntry
from packformat.constants import tensor_nbytes
from packtools.quants import random_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the kernels")
TYPES = [ElementType.Q4_K, ElementType.MXFP4]
KERNELS = {"x86-64-v3": "avx2", "x86-64": "portable"}  # -march -> the kernels host_experts.c compiles
HIDDEN, INTER = 256, 256


def host_tier(element_type, slots, rng, hidden=HIDDEN, inter=INTER):
    """(uint8 tensor of `slots` objects, slot bytes, gate/up weight, down weight, role entries):
    objects of gate [I, H], up [I, H], down [H, I] roles of random blocks."""
    shapes = [(Role.GATE, (inter, hidden)), (Role.UP, (inter, hidden)), (Role.DOWN, (hidden, inter))]
    entries, offset = [], 0
    for role, shape in shapes:
        nbytes = tensor_nbytes(element_type, shape)
        entries.append(RoleEntry(role, int(element_type), offset, nbytes, shape))
        offset = -(-(offset + nbytes) // 256) * 256
    slot_bytes = -(-offset // 4096) * 4096
    tier = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
    for slot in range(slots):
        for e in entries:
            blocks = random_blocks(element_type, e.shape, rng).reshape(-1)
            start = slot * slot_bytes + e.offset
            tier[start:start + e.nbytes] = torch.from_numpy(np.ascontiguousarray(blocks))
    up = gemv_weight(entries[:2], rows=2 * inter, cols=hidden)
    down = gemv_weight(entries[2:], rows=hidden, cols=inter)
    return tier, slot_bytes, up, down, entries


def reference(tier, slot_bytes, entries, slot, x_row):
    """bf16 [H]: float64 products of the bf16-rounded weights, rounded once per projection, the
    activation in torch's bfloat16."""
    obj = tier[slot * slot_bytes:(slot + 1) * slot_bytes]

    def weight(e):
        raw = obj[e.offset:e.offset + e.nbytes].view(1, -1).contiguous()
        return dequantize_many(raw, ElementType(e.element_type), e.shape, torch.float32)[0].bfloat16().double()

    gate_up = (torch.cat([weight(entries[0]), weight(entries[1])]) @ x_row.double()).bfloat16()
    gate, up = gate_up.chunk(2)
    return (weight(entries[2]) @ (F.silu(gate) * up).double()).bfloat16()


@pytest.fixture
def pool_factory(tmp_path):
    pools = []

    def make(tier, slot_bytes, *, threads=2, march="native"):
        cache = tmp_path / march if march != "native" else None
        pool = HostExpertsPool(host_address=tier.data_ptr(), host_slots=tier.numel() // slot_bytes,
                               slot_bytes=slot_bytes, max_pairs=8, max_cols=HIDDEN, max_rows=HIDDEN, threads=threads,
                               pinned=False, cache_dir=cache, march=march)
        assert march == "native" or pool.kernel == KERNELS[march]  # the kernels asked for, not the native ones
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _close(got: torch.Tensor, expected: torch.Tensor) -> None:
    """Within bf16 rounding of the largest output (an intermediate may round the other way), and
    mostly equal."""
    got, expected = got.float(), expected.float()
    assert torch.all((got - expected).abs() <= expected.abs().amax() * 2**-6)
    assert (got == expected).float().mean() >= 0.5


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])  # v3: AVX2; x86-64: the portable loops
@pytest.mark.parametrize("element_type", TYPES, ids=lambda t: t.name)
def test_experts_equal_the_rounded_weights_reference(pool_factory, element_type, march):
    rng = np.random.default_rng(int(element_type))
    tier, slot_bytes, up, down, entries = host_tier(element_type, 3, rng)
    pool = pool_factory(tier, slot_bytes, march=march)
    kind = pool.add_kind((up,), down)
    pool.start()
    x = torch.randn(3, HIDDEN, generator=torch.Generator().manual_seed(5)).bfloat16()
    slots = [2, -1, 0, 1, 2, 0]  # top_k 2: tokens 0 0 1 1 2 2; pair 1 is not the CPU's
    pool.out.zero_()
    got = pool.run(kind, slots, x, top_k=2)
    assert got.shape == (6, HIDDEN) and got.dtype == torch.bfloat16
    assert torch.equal(got[1], torch.zeros(HIDDEN, dtype=torch.bfloat16))  # untouched
    for p, slot in enumerate(slots):
        if slot >= 0:
            _close(got[p], reference(tier, slot_bytes, entries, slot, x[p // 2]))
    assert pool.stats().jobs == 1 and pool.stats().failed_jobs == 0


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])
def test_mxfp4_rows_of_a_number_of_blocks_not_a_multiple_of_four(pool_factory, march):
    """The MXFP4 kernels sum a row's blocks in four chains: an intermediate size of 96 leaves the
    down rows 3 blocks, the gate/up rows 8."""
    tier, slot_bytes, up, down, entries = host_tier(ElementType.MXFP4, 2, np.random.default_rng(9), inter=96)
    pool = pool_factory(tier, slot_bytes, march=march)
    kind = pool.add_kind((up,), down)
    pool.start()
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(9)).bfloat16()
    got = pool.run(kind, [1, 0], x, top_k=2)
    for p, slot in enumerate([1, 0]):
        _close(got[p], reference(tier, slot_bytes, entries, slot, x[0]))


@pytest.mark.parametrize("element_type", TYPES, ids=lambda t: t.name)
def test_experts_agree_with_the_gpu_kernels(pool_factory, element_type):
    """The pool and the fused GEMVs (triton; interpreted without CUDA) with torch's activation
    between them: the same experts but for float32 summation order and the exponential."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(11)
    tier, slot_bytes, up, down, _ = host_tier(element_type, 4, rng)
    pool = pool_factory(tier, slot_bytes)
    kind = pool.add_kind((up,), down)
    pool.start()
    x = torch.randn(4, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    slots = [3, 1, 0, 2]
    got = pool.run(kind, slots, x, top_k=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = torch.arange(4, device=device)
    slot_map = torch.tensor(slots, dtype=torch.int32, device=device)
    arena = tier.to(device)
    gate_up = moe_gemv(x.to(device), experts, slot_map, arena, slot_bytes, up, top_k=1)
    gate, upper = gate_up.chunk(2, dim=-1)
    expected = moe_gemv((F.silu(gate) * upper).contiguous(), experts, slot_map, arena, slot_bytes, down, top_k=1,
                        x_per_pair=True).cpu()
    for p in range(4):
        _close(got[p], expected[p])


@pytest.mark.parametrize("limit", [None, 3.0])
def test_activation_equals_torch_bfloat16(pool_factory, limit):
    """SiLU(gate) * up (with DeepSeek-V4's clamps when a limit is given), rounded as torch's
    bfloat16 ops round: equal but where the exponential rounds the other way."""
    tier, slot_bytes, up, down, _ = host_tier(ElementType.Q4_K, 1, np.random.default_rng(0))
    pool = pool_factory(tier, slot_bytes)
    kind = pool.add_kind((up,), down, limit)
    gate_up = (torch.randn(8, 2 * INTER, generator=torch.Generator().manual_seed(1)) * 4).bfloat16()
    gate, upper = gate_up.chunk(2, dim=-1)
    if limit is not None:
        gate, upper = gate.clamp(max=limit), upper.clamp(min=-limit, max=limit)
    expected = (F.silu(gate) * upper).float()
    got = pool.activate(kind, gate_up).float()
    assert torch.all((got - expected).abs() <= expected.abs() * 2**-7)
    assert (got == expected).float().mean() >= 0.99


def test_gate_and_up_as_separate_weights_equal_one_two_role_weight(pool_factory):
    rng = np.random.default_rng(4)
    tier, slot_bytes, up, down, entries = host_tier(ElementType.Q4_K, 2, rng)
    pool = pool_factory(tier, slot_bytes)
    both = pool.add_kind((up,), down)
    apart = pool.add_kind((gemv_weight(entries[:1], rows=INTER, cols=HIDDEN),
                           gemv_weight(entries[1:2], rows=INTER, cols=HIDDEN)), down)
    pool.start()
    x = torch.randn(1, HIDDEN).bfloat16()
    assert torch.equal(pool.run(both, [1], x, top_k=1), pool.run(apart, [1], x, top_k=1))


@pytest.mark.parametrize("slots, kind", [([5], 0), ([0], 3), ([-7, 99], 0)],
                         ids=["slot past the tier", "unknown kind", "slot far past the tier"])
def test_malformed_jobs_are_refused_and_the_pool_keeps_serving(pool_factory, slots, kind):
    tier, slot_bytes, up, down, _ = host_tier(ElementType.Q4_K, 2, np.random.default_rng(1))
    pool = pool_factory(tier, slot_bytes)
    good = pool.add_kind((up,), down)
    pool.start()
    x = torch.randn(2, HIDDEN).bfloat16()
    with pytest.raises(HostExpertsUnavailable, match="refused job"):
        pool.run(kind, slots, x, top_k=1)
    assert pool.run(good, [1, 0], x, top_k=1).shape == (2, HIDDEN)
    assert pool.stats().failed_jobs == 1 and pool.stats().jobs == 1


def test_types_the_kernels_cannot_read_are_named():
    w = gemv_weight([RoleEntry(Role.GATE, int(ElementType.Q8_0), 0, tensor_nbytes(ElementType.Q8_0, (8, 256)),
                               (8, 256))], rows=8, cols=256)
    assert "Q8_0" in readable([w])


def test_kinds_that_do_not_fit_are_refused(pool_factory):
    tier, slot_bytes, up, down, entries = host_tier(ElementType.Q4_K, 1, np.random.default_rng(2))
    pool = pool_factory(tier, slot_bytes)
    with pytest.raises(HostExpertsUnavailable, match="refused"):  # gate/up rows must be twice down's columns
        pool.add_kind((gemv_weight(entries[:1], rows=INTER, cols=HIDDEN),), down)


def test_a_job_of_no_pairs_for_the_cpu_is_done_at_once(pool_factory):
    tier, slot_bytes, up, down, _ = host_tier(ElementType.MXFP4, 1, np.random.default_rng(2))
    pool = pool_factory(tier, slot_bytes, threads=3)
    kind = pool.add_kind((up,), down)
    pool.start()
    before = torch.full((1, HIDDEN), 7.0).bfloat16()
    pool.out[:1, :HIDDEN] = before
    assert torch.equal(pool.run(kind, [-1], torch.zeros(1, HIDDEN).bfloat16(), top_k=1), before)
