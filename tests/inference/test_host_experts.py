"""The CPU experts pool (inference/kernels/host_experts.c): its GEMVs against the bf16-rounded
dequantized weights and the GPU kernel's results, each compiled kernel (AVX-512 BF16, AVX2,
portable), and the jobs it refuses."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import torch

from inference.dequant import dequantize_many
from inference.kernels.host_experts import HostExpertsPool, HostExpertsUnavailable, build_library, readable
from inference.kernels.ops import gemv_weight, moe_gemv
from packformat import ElementType, Role, RoleEntry
from packformat.constants import tensor_nbytes
from packtools.quants import random_blocks

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler to build the kernels")
TYPES = [ElementType.Q4_K, ElementType.MXFP4]


def _host_tier(element_type, rows, cols, slots, rng):
    """(uint8 tensor of `slots` objects, slot bytes, role bytes, second role's offset): each object a
    gate role then an up role, each [rows, cols] of random blocks."""
    nbytes = tensor_nbytes(element_type, (rows, cols))
    second = -(-nbytes // 256) * 256
    slot_bytes = -(-(second + nbytes) // 4096) * 4096
    tier = torch.zeros(slots * slot_bytes, dtype=torch.uint8)
    for slot in range(slots):
        for offset in (0, second):
            start = slot * slot_bytes + offset
            blocks = random_blocks(element_type, (rows, cols), rng).reshape(-1)
            tier[start:start + nbytes] = torch.from_numpy(np.ascontiguousarray(blocks))
    return tier, slot_bytes, nbytes, second


def _weight(element_type, rows, cols, nbytes, second):
    return gemv_weight([RoleEntry(Role.GATE, int(element_type), 0, nbytes, (rows, cols)),
                        RoleEntry(Role.UP, int(element_type), second, nbytes, (rows, cols))], rows=2 * rows, cols=cols)


def _reference(tier, slot_bytes, element_type, rows, cols, nbytes, second, slot, x_row):
    """float64 products of the bf16-rounded weights with x, and the sums of their magnitudes."""
    obj = tier[slot * slot_bytes:(slot + 1) * slot_bytes]
    w = torch.cat([dequantize_many(obj[o:o + nbytes].view(1, -1).contiguous(), element_type, (rows, cols),
                                   torch.float32)[0] for o in (0, second)]).bfloat16().double()  # [2 rows, cols]
    return w @ x_row.double(), w.abs() @ x_row.double().abs()


@pytest.fixture
def pool_factory(tmp_path):
    pools = []

    def make(tier, slot_bytes, *, threads=2, march="native"):
        if march != "native":
            build_library(tmp_path / march, march=march)
        pool = HostExpertsPool(host_address=tier.data_ptr(), host_slots=tier.numel() // slot_bytes,
                               slot_bytes=slot_bytes, max_pairs=8, max_cols=512, max_rows=64, threads=threads,
                               pinned=False, cache_dir=tmp_path / march if march != "native" else None)
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


@pytest.mark.parametrize("march", ["native", "x86-64-v3", "x86-64"])  # v3: AVX2; x86-64: the portable loops
@pytest.mark.parametrize("element_type", TYPES, ids=lambda t: t.name)
def test_rows_equal_the_rounded_weights_times_x(pool_factory, element_type, march):
    """Row p is W(slot p) . x[p // top_k] of the bf16-rounded dequantized weights, rounded once:
    within one bf16 ulp plus float32 accumulation's error of the exact value, and mostly equal."""
    rng = np.random.default_rng(int(element_type))
    rows, cols = 24, 512
    tier, slot_bytes, nbytes, second = _host_tier(element_type, rows, cols, 3, rng)
    pool = pool_factory(tier, slot_bytes, march=march)
    weight = _weight(element_type, rows, cols, nbytes, second)
    projection = pool.add_projection([weight])
    pool.start()
    x = torch.randn(3, cols, generator=torch.Generator().manual_seed(5)).bfloat16()
    slots = [2, -1, 0, 1, 2, 0]  # top_k 2: tokens 0 0 1 1 2 2; pair 1 is not the CPU's
    got = pool.run(projection, slots, x, top_k=2)
    assert got.shape == (6, 2 * rows) and got.dtype == torch.bfloat16
    equal = []
    for p, slot in enumerate(slots):
        if slot < 0:
            continue
        exact, spread = _reference(tier, slot_bytes, element_type, rows, cols, nbytes, second, slot, x[p // 2])
        expected = exact.bfloat16().float()
        ulp = (expected.abs() * 2**-7).clamp(min=1e-30)
        assert torch.all((got[p].float() - expected).abs() <= ulp + spread.float() * 2**-16), (p, march)
        equal.append((got[p].float() == expected).float().mean().item())
    assert np.mean(equal) >= 0.95
    assert pool.stats().jobs == 1 and pool.stats().failed_jobs == 0


@pytest.mark.parametrize("element_type", TYPES, ids=lambda t: t.name)
def test_rows_agree_with_the_gpu_gemv(pool_factory, element_type):
    """The pool and the fused GEMV (triton; interpreted without CUDA) compute the same rows but for
    float32 summation order: equal to within a bf16 ulp, nearly all bit for bit."""
    pytest.importorskip("triton")
    rng = np.random.default_rng(11)
    rows, cols = 32, 512
    tier, slot_bytes, nbytes, second = _host_tier(element_type, rows, cols, 4, rng)
    pool = pool_factory(tier, slot_bytes)
    weight = _weight(element_type, rows, cols, nbytes, second)
    projection = pool.add_projection([weight])
    pool.start()
    x = torch.randn(4, cols, generator=torch.Generator().manual_seed(2)).bfloat16()
    slots = [3, 1, 0, 2]  # x_per_pair: top_k 1
    got = pool.run(projection, slots, x, top_k=1)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    experts = torch.arange(4, device=device)
    slot_map = torch.tensor(slots, dtype=torch.int32, device=device)
    expected = moe_gemv(x.to(device), experts, slot_map, tier.to(device), slot_bytes, weight, top_k=1,
                        x_per_pair=True).cpu()
    ulp = (expected.float().abs() * 2**-7).clamp(min=2**-100)
    assert torch.all((got.float() - expected.float()).abs() <= 2 * ulp)
    assert (got == expected).float().mean() >= 0.9


def test_split_projections_concatenate_their_rows(pool_factory):
    """Gate and up as two projections segments (separate GemvWeights) give the rows of the one
    two-role weight, in order."""
    rng = np.random.default_rng(4)
    rows, cols = 16, 256
    tier, slot_bytes, nbytes, second = _host_tier(ElementType.Q4_K, rows, cols, 2, rng)
    pool = pool_factory(tier, slot_bytes)
    both = pool.add_projection([_weight(ElementType.Q4_K, rows, cols, nbytes, second)])
    gate = gemv_weight([RoleEntry(Role.GATE, int(ElementType.Q4_K), 0, nbytes, (rows, cols))], rows=rows, cols=cols)
    up = gemv_weight([RoleEntry(Role.UP, int(ElementType.Q4_K), second, nbytes, (rows, cols))], rows=rows, cols=cols)
    apart = pool.add_projection([gate, up])
    pool.start()
    x = torch.randn(1, cols).bfloat16()
    assert torch.equal(pool.run(both, [1], x, top_k=1), pool.run(apart, [1], x, top_k=1))


@pytest.mark.parametrize("slots, projection", [([5], 0), ([0], 3), ([-7, 99], 0)],
                         ids=["slot past the tier", "unknown projection", "slot far past the tier"])
def test_malformed_jobs_are_refused_and_the_pool_keeps_serving(pool_factory, slots, projection):
    rng = np.random.default_rng(1)
    tier, slot_bytes, nbytes, second = _host_tier(ElementType.Q4_K, 8, 256, 2, rng)
    pool = pool_factory(tier, slot_bytes)
    good = pool.add_projection([_weight(ElementType.Q4_K, 8, 256, nbytes, second)])
    pool.start()
    x = torch.randn(2, 256).bfloat16()
    with pytest.raises(HostExpertsUnavailable, match="refused job"):
        pool.run(projection, slots, x, top_k=1)
    assert pool.run(good, [1, 0], x, top_k=1).shape == (2, 16)
    assert pool.stats().failed_jobs == 1 and pool.stats().jobs == 1


def test_types_the_kernels_cannot_read_are_named():
    w = gemv_weight([RoleEntry(Role.GATE, int(ElementType.Q8_0), 0, tensor_nbytes(ElementType.Q8_0, (8, 256)),
                               (8, 256))], rows=8, cols=256)
    assert "Q8_0" in readable([w])


def test_a_job_of_no_pairs_for_the_cpu_is_done_at_once(pool_factory):
    rng = np.random.default_rng(2)
    tier, slot_bytes, nbytes, second = _host_tier(ElementType.MXFP4, 8, 256, 1, rng)
    pool = pool_factory(tier, slot_bytes, threads=3)
    projection = pool.add_projection([_weight(ElementType.MXFP4, 8, 256, nbytes, second)])
    pool.start()
    before = torch.full((1, 16), 7.0).bfloat16()
    pool.out[:1, :16] = before
    assert torch.equal(pool.run(projection, [-1], torch.zeros(1, 256).bfloat16(), top_k=1), before)
