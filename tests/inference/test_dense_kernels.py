"""inference.kernels.dense_ops: the one-row GEMV and the one-query attention against float64
references (on a machine without CUDA under triton's interpreter, tests/conftest.py), and the
model-level swaps (inference.model.fast_linears, fast_attention) on real transformers models."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from inference.engine.generate import _cache_keyword
from inference.kernels import dense_ops
from inference.model.fast_attention import DECODE_OR_SDPA, use_decode_attention
from inference.model.fast_linears import fuse_linears
from packtools.arch import tiny_config

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HALF = [torch.bfloat16, torch.float16]


def _mantissa_bits(dtype: torch.dtype) -> int:
    return {torch.bfloat16: 7, torch.float16: 10}[dtype]


def _within_one_ulp(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Whether each element of `got` is one of the two `dtype` values around `exact` (float64)."""
    info = torch.finfo(dtype)
    exponent = torch.floor(torch.log2(exact.abs().clamp(min=info.tiny)))
    ulp = torch.exp2(exponent - _mantissa_bits(dtype))
    # float32 sums of K products differ from the float64 sum by far less than an ulp: one ulp
    # plus that slack covers both roundings
    return (got.double() - exact).abs() <= ulp * 1.01


# (N, K, bias): square, tall, wide, N not a multiple of the rows per program, K not a power of two
GEMV_CASES = [(64, 64, False), (96, 200, True), (513, 128, False), (8, 1000, True), (1, 32, False)]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("n,k,bias", GEMV_CASES)
def test_gemv_is_the_rounded_product(n, k, bias, dtype):
    g = torch.Generator().manual_seed(n * 7 + k)
    x = torch.randn(1, 1, k, generator=g).to(DEVICE, dtype)
    weight = torch.randn(n, k, generator=g).to(DEVICE, dtype)
    b = torch.randn(n, generator=g).to(DEVICE, dtype) if bias else None
    assert dense_ops.gemv_fits(x, weight, b)
    got = dense_ops.gemv(x, weight, b)
    assert got.shape == (1, 1, n) and got.dtype == dtype
    exact = x.double().reshape(-1) @ weight.double().T + (b.double() if bias else 0)
    # the bias is added in float32 before the one rounding, as cuBLAS's epilogue does
    assert _within_one_ulp(got.reshape(-1).cpu(), exact.cpu(), dtype).all()


@pytest.mark.parametrize("shape,reason", [
    ((2, 64), "two rows"),
    ((1, 63), "K of the input differs from the weight's"),
])
def test_gemv_refuses_what_it_does_not_compute(shape, reason):
    weight = torch.randn(32, 64, dtype=torch.bfloat16, device=DEVICE)
    assert dense_ops.gemv_fits(torch.randn(1, 64, dtype=torch.bfloat16, device=DEVICE), weight, None)
    assert not dense_ops.gemv_fits(torch.randn(shape, dtype=torch.bfloat16, device=DEVICE), weight, None), reason


def test_gemv_refuses_other_dtypes_and_strided_weights():
    def rand(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, dtype=dtype, device=DEVICE)

    x = rand(1, 64)
    assert dense_ops.gemv_fits(x, rand(32, 64), rand(32))
    assert not dense_ops.gemv_fits(x.float(), rand(32, 64, dtype=torch.float32), None)
    assert not dense_ops.gemv_fits(x, rand(32, 64, dtype=torch.float16), None)
    assert not dense_ops.gemv_fits(x, rand(64, 32).T, None)
    assert not dense_ops.gemv_fits(x, rand(32, 64), rand(32, dtype=torch.float32))


def _reference_attention(query, key, value, mask, scale):
    """float64 softmax attention, key/value head i // group for query head i: [B, 1, Hq, Dv]."""
    group = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = (query.double() @ k.transpose(-1, -2)) * scale  # [B, Hq, 1, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return (scores.softmax(-1) @ v).transpose(1, 2)


# (batch, query heads, kv heads, cache length, key dim, value dim, visible keys per sequence
# or None for no mask): GQA groups of 8 and 1, a cache longer than one split, MLA-like 192/128
ATTENTION_CASES = [
    (1, 8, 1, 40, 64, 64, [17]),
    (1, 32, 4, 300, 128, 128, [123]),
    (2, 4, 4, 100, 32, 32, [100, 3]),
    (1, 16, 16, 70, 192, 128, [70]),
    (1, 6, 2, 33, 16, 16, None),
    (1, 4, 2, 90, 512, 512, [61]),  # the Qwen3-like bench shape's wide heads
]


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("batch,heads,kv_heads,length,dk,dv,visible", ATTENTION_CASES)
def test_attention_over_the_visible_keys(batch, heads, kv_heads, length, dk, dv, visible, dtype):
    g = torch.Generator().manual_seed(length + heads)
    # the query as transformers hands it over: [B, 1, H, D] transposed to [B, H, 1, D]
    query = torch.randn(batch, 1, heads, dk, generator=g).to(DEVICE, dtype).transpose(1, 2)
    key = torch.randn(batch, kv_heads, length, dk, generator=g).to(DEVICE, dtype)
    value = torch.randn(batch, kv_heads, length, dv, generator=g).to(DEVICE, dtype)
    mask = None
    if visible is not None:
        mask = torch.zeros(batch, 1, 1, length, dtype=torch.bool, device=DEVICE)
        for b, count in enumerate(visible):
            mask[b, ..., :count] = True
        # what the mask hides must not be read: infinities there would poison any sum
        hidden = ~mask[:, 0, 0, :]  # [B, L]
        key[hidden.unsqueeze(1).expand(-1, kv_heads, -1)] = float("inf")
        value[hidden.unsqueeze(1).expand(-1, kv_heads, -1)] = float("nan")
    scale = 1 / math.sqrt(dk)
    assert dense_ops.attention_fits(query, key, value, mask)
    got = dense_ops.attention(query, key, value, mask, scale)
    assert got.shape == (batch, 1, heads, dv) and got.dtype == dtype
    exact = _reference_attention(query, key.nan_to_num(posinf=0.0), value.nan_to_num(), mask, scale)
    assert torch.isfinite(got).all()
    # the output's own rounding and tf32 probabilities: a few units of the dtype's precision
    # relative to the values' scale
    tolerance = 4 * 2.0 ** -_mantissa_bits(dtype)
    assert (got.double().cpu() - exact.cpu()).abs().max() <= tolerance


def test_attention_mask_of_one_broadcasts_over_the_batch():
    g = torch.Generator().manual_seed(3)
    query = torch.randn(3, 4, 1, 32, generator=g).to(DEVICE, torch.bfloat16)
    key = torch.randn(3, 2, 50, 32, generator=g).to(DEVICE, torch.bfloat16)
    value = torch.randn(3, 2, 50, 32, generator=g).to(DEVICE, torch.bfloat16)
    mask = torch.arange(50, device=DEVICE).view(1, 1, 1, 50) < 20
    got = dense_ops.attention(query, key, value, mask, 0.2)
    exact = _reference_attention(query, key, value, mask.expand(3, 1, 1, 50), 0.2)
    assert (got.double().cpu() - exact.cpu()).abs().max() <= 4 * 2.0 ** -7


@pytest.mark.parametrize("change,reason", [
    (lambda q, k, v, m: (q.expand(-1, -1, 2, -1), k, v, m), "two query tokens"),
    (lambda q, k, v, m: (q, k, v, m.float()), "an additive float mask"),
    (lambda q, k, v, m: (q, k, v, m.expand(1, 4, 1, -1)), "a mask per head"),
    (lambda q, k, v, m: (q.float(), k.float(), v.float(), m), "float32"),
    (lambda q, k, v, m: (q[:, :3], k, v, m), "query heads not a multiple of kv heads"),
    (lambda q, k, v, m: (q, k.transpose(2, 3).contiguous().transpose(2, 3), v, m), "key dim strided"),
])
def test_attention_refuses_what_it_does_not_compute(change, reason):
    q = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16, device=DEVICE)
    k = torch.randn(1, 2, 10, 16, dtype=torch.bfloat16, device=DEVICE)
    v = torch.randn(1, 2, 10, 16, dtype=torch.bfloat16, device=DEVICE)
    m = torch.ones(1, 1, 1, 10, dtype=torch.bool, device=DEVICE)
    assert dense_ops.attention_fits(q, k, v, m)
    assert not dense_ops.attention_fits(*change(q, k, v, m)), reason


@pytest.mark.parametrize("model_type", ["qwen3_moe", "deepseek_v3"])
def test_swapped_model_decodes_as_before(model_type, monkeypatch):
    """A tiny model with the GEMV and the decode attention gives the logits of its own forwards at
    each step over a static cache (bfloat16 rounding apart), and its decode steps do run both
    kernels. The swapped run is fed the tokens the first run picked: random tiny models have near
    ties among their bfloat16 logits, which a rounding may break the other way."""
    from transformers import StaticCache

    launches = {"gemv": 0, "attention": 0}

    def counted(name, launch):
        def run(*args):
            launches[name] += 1
            return launch(*args)
        return run

    monkeypatch.setattr(dense_ops, "gemv_launch", counted("gemv", dense_ops.gemv_launch))
    monkeypatch.setattr(dense_ops, "attention_launch", counted("attention", dense_ops.attention_launch))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type), dtype=torch.bfloat16).eval().to(DEVICE)
    prompt = torch.randint(3, model.config.vocab_size, (1, 6), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    steps = 4
    keyword = _cache_keyword(model)  # transformers 5.2x's `cache`, 5.17's `past_key_values`

    def decode(fed: list[int] | None) -> tuple[list[int], list[torch.Tensor]]:
        cache = StaticCache(config=model.config, max_cache_len=16)
        index = torch.arange(16, device=DEVICE).view(1, 1, 1, 16)
        picked, logits = [], []
        with torch.no_grad():
            out = model(input_ids=prompt, **{keyword: cache}, use_cache=True,
                        position_ids=torch.arange(6, device=DEVICE).view(1, -1))
            for step in range(steps):
                logits.append(out.logits[0, -1].float())
                token = int(out.logits[0, -1].argmax()) if fed is None else fed[step]
                picked.append(token)
                mask = index <= 6 + step  # the static decoder's boolean mask over the cache
                out = model(input_ids=torch.tensor([[token]], device=DEVICE), **{keyword: cache}, use_cache=True,
                            attention_mask=mask, position_ids=torch.tensor([[6 + step]], device=DEVICE))
            logits.append(out.logits[0, -1].float())
        return picked, logits

    tokens, logits = decode(None)
    assert launches == {"gemv": 0, "attention": 0}
    assert fuse_linears(model, torch.bfloat16) > 0
    assert use_decode_attention(model) >= 1 and model.config._attn_implementation == DECODE_OR_SDPA
    _, fast_logits = decode(tokens)
    layers = model.config.num_hidden_layers
    # the prefill's many rows stay with cuBLAS and SDPA; each decode step is one row throughout
    assert launches["attention"] == steps * layers
    assert launches["gemv"] >= steps * (4 * layers + 1)  # q, k, v, o of every layer and the LM head at least
    for expected, got in zip(logits, fast_logits):
        assert (got - expected).abs().max() <= 0.05 * expected.abs().max()


def test_swaps_leave_other_modules_alone():
    model = AutoModelForCausalLM.from_config(tiny_config("qwen3_moe"), dtype=torch.bfloat16).to(DEVICE)
    model.config._attn_implementation_internal = "eager"
    assert use_decode_attention(model) == 0  # only "sdpa" configs are switched
    assert model.config._attn_implementation == "eager"
    assert fuse_linears(model, torch.float16) == 0  # weights of another dtype keep F.linear
    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    assert fuse_linears(model, torch.bfloat16) == len(linears)
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.bfloat16, device=DEVICE)  # several rows: F.linear's
    assert torch.equal(model.lm_head(x), F.linear(x, model.lm_head.weight))


# (tokens, experts, k, renormalize): Qwen3's 128 top-8, DeepSeek's 256 top-6, experts not a
# power of two, k == E, a single expert
TOPK_CASES = [(1, 128, 8, True), (3, 256, 6, False), (2, 60, 4, True), (1, 8, 8, False), (1, 16, 1, True)]


@pytest.mark.parametrize("tokens,experts,k,renormalize", TOPK_CASES)
def test_softmax_topk_picks_the_largest_probabilities(tokens, experts, k, renormalize):
    g = torch.Generator().manual_seed(experts + k)
    # distinct logits (steps of 8 / E, exact in bfloat16): no ties for topk to order its own way
    logits = torch.stack([(torch.randperm(experts, generator=g) - experts / 2) * (8 / experts)
                          for _ in range(tokens)]).to(DEVICE, torch.bfloat16)
    scores, ids = dense_ops.softmax_topk(logits, k, renormalize=renormalize, dtype=torch.float32)
    probs = logits.double().softmax(-1)
    want, want_ids = probs.topk(k, dim=-1)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
    assert ids.dtype == torch.int64 and torch.equal(ids.cpu(), want_ids.cpu())
    assert torch.allclose(scores.double().cpu(), want.cpu(), rtol=2 ** -20, atol=0)


def test_softmax_topk_breaks_ties_by_the_lowest_expert_and_rounds_once():
    logits = torch.tensor([[0.5, 2.0, 1.0, 2.0, 2.0, -1.0]], device=DEVICE, dtype=torch.bfloat16)
    scores, ids = dense_ops.softmax_topk(logits, 2, renormalize=True, dtype=torch.bfloat16)
    assert ids.tolist() == [[1, 3]]  # 1, 3 and 4 tie: the lowest ids, in order
    assert scores.dtype == torch.bfloat16 and scores.float().tolist() == [[0.5, 0.5]]


@pytest.mark.parametrize("shape,k", [((4, 8), 9), ((4, 8), 0), ((8,), 2)])
def test_softmax_topk_refuses_bad_arguments_naming_them(shape, k):
    with pytest.raises(ValueError, match="softmax_topk"):
        dense_ops.softmax_topk(torch.zeros(shape, dtype=torch.bfloat16), k, renormalize=True, dtype=torch.bfloat16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="on a machine without CUDA every device is interpreted")
def test_kernels_refuse_cpu_tensors_where_triton_compiles_for_cuda(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    weight = torch.randn(8, 16, dtype=torch.bfloat16)
    assert not dense_ops.gemv_fits(torch.randn(1, 16, dtype=torch.bfloat16), weight, None)
    assert fuse_linears(torch.nn.Linear(16, 8, dtype=torch.bfloat16), torch.bfloat16) == 0
