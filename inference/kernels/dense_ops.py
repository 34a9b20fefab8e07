"""Launchers of the decode step's dense kernels: the one-row GEMV (dense_gemv), the one-query
attention (decode_attention) and a softmax router's top-k (router_topk), each also a torch custom
op so that torch.compile'd layers call it as one opaque kernel (inductor would otherwise trace
into the launcher).

    y = gemv(x, weight, bias)                                  # x [..., K], one row -> [..., N]
    out = attention(query, key, value, mask, scale)           # [B, Hq, 1, D] -> [B, 1, Hq, Dv]
    scores, ids = softmax_topk(logits, k, renormalize=True, dtype=torch.bfloat16)  # [T, E] -> [T, k]

Asynchronous device work with fixed shapes and no host synchronization (capturable in a CUDA
graph). triton is imported on first launch, never on a machine that only computes on the CPU.
"""

from __future__ import annotations

import functools
import os

import torch

GEMV_DTYPES = (torch.bfloat16, torch.float16)
# (N, K) -> (rows per program, columns per step, warps) where measured (bench/dense_kernels.py
# prints the sweep); other shapes take gemv_config's rule
GEMV_TUNING: dict[tuple[int, int], tuple[int, int, int]] = {}
ATTENTION_MERGE_BLOCK_S = 16  # ranges the merge kernel reads per step
ATTENTION_MAX_HEAD_DIM = 512


@functools.lru_cache(maxsize=None)
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # triton's interpreter: the rule below only needs a count
    return torch.cuda.get_device_properties(device).multi_processor_count


def runs_on(device: torch.device) -> bool:
    """Whether the kernels run on tensors of `device`: CUDA, or any under triton's interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def gemv_config(n: int, k: int, device: torch.device) -> tuple[int, int, int]:
    """(rows per program, columns per step, warps) for an [n, k] weight: the measured entry, else
    the most rows per program (up to 8) that still give every SM four programs, steps of up to
    1024 columns, and 8 warps for tiles of up to 1024 weights, 4 above (the fastest of
    bench/dense_kernels.py's sweep on the H200 for the bench shapes' 0.2-32 MiB weights)."""
    tuned = GEMV_TUNING.get((n, k))
    if tuned is not None:
        return tuned
    block_k = min(_pow2(k), 1024)
    block_n = 8
    while block_n > 1 and -(-n // block_n) < 4 * _multiprocessors(device):
        block_n //= 2
    return block_n, block_k, 8 if block_n * block_k <= 1024 else 4


def gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether `gemv` computes F.linear(x, weight, bias): one row of x, same-dtype half weights,
    rows of the weight and x contiguous, on a device the kernels run on."""
    return (x.dtype in GEMV_DTYPES and weight.dtype == x.dtype and weight.dim() == 2 and runs_on(x.device)
            and x.numel() == x.shape[-1] == weight.shape[1] and x.device == weight.device
            and weight.stride(1) == 1 and (bias is None or (bias.dtype == x.dtype and bias.shape == weight.shape[:1]
                                                            and bias.is_contiguous())))


def gemv_launch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    from inference.kernels.dense_gemv import dense_gemv_kernel

    n, k = weight.shape
    out = torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)
    block_n, block_k, warps = gemv_config(n, k, x.device)
    dense_gemv_kernel[(-(-n // block_n),)](
        x.contiguous(), weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
        HAS_BIAS=bias is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps)
    return out


@torch.library.custom_op("expertpack::dense_gemv", mutates_args=())
def _gemv_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return gemv_launch(x, weight, bias)


@_gemv_op.register_fake
def _(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for one row (gemv_fits), by dense_gemv_kernel."""
    if torch.compiler.is_compiling():
        return _gemv_op(x, weight, bias)
    return gemv_launch(x, weight, bias)


def attention_fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                   mask: torch.Tensor | None) -> bool:
    """Whether `attention` computes SDPA here: one query token of [B, Hq, 1, D] over [B, Hkv, L, D]
    keys and [B, Hkv, L, Dv] values of the query's half dtype (Hq a multiple of Hkv), head
    dimensions contiguous and at most ATTENTION_MAX_HEAD_DIM, and no mask or a boolean one of
    [B or 1, 1, 1, L] (True: the key is seen)."""
    if not (query.dim() == key.dim() == value.dim() == 4 and query.shape[2] == 1 and runs_on(query.device)):
        return False
    batch, heads, _, head_dim = query.shape
    kv_batch, kv_heads, length, key_dim = key.shape
    if not (query.dtype in GEMV_DTYPES and key.dtype == value.dtype == query.dtype
            and kv_batch == batch and value.shape[:3] == key.shape[:3] and key_dim == head_dim
            and kv_heads and heads % kv_heads == 0 and max(head_dim, value.shape[3]) <= ATTENTION_MAX_HEAD_DIM
            and query.stride(3) == key.stride(3) == value.stride(3) == 1 and length):
        return False
    if mask is None:
        return True
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[0] in (1, batch)
            and mask.shape[1:] == (1, 1, length))


def attention_config(head_dim: int) -> tuple[int, int]:
    """(keys per block of the split kernel, warps): a block the mask hides is skipped whole; wide
    heads take fewer keys per block so that a [keys, head_dim] tile fits in registers."""
    return (32, 4) if head_dim <= 128 else (16, 4) if head_dim <= 256 else (16, 8)


def attention_launch(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                     scale: float) -> torch.Tensor:
    from inference.kernels.decode_attention import decode_attention_merge_kernel, decode_attention_split_kernel

    batch, heads, _, key_dim = query.shape
    kv_heads, length, value_dim = key.shape[1], key.shape[2], value.shape[3]
    group = heads // kv_heads
    block_n, warps = attention_config(max(key_dim, value_dim))
    blocks = -(-length // block_n)
    # enough ranges to give every SM two programs, each a whole number of key blocks
    splits = max(1, min(blocks, -(-2 * _multiprocessors(query.device) // (batch * kv_heads))))
    chunk = -(-blocks // splits) * block_n
    splits = -(-length // chunk)
    part_acc = torch.empty((batch * heads * splits, value_dim), dtype=torch.float32, device=query.device)
    part_ml = torch.empty((batch * heads * splits, 2), dtype=torch.float32, device=query.device)
    out = torch.empty((batch, 1, heads, value_dim), dtype=query.dtype, device=query.device)
    mask_strides = (mask.stride(0) if mask.shape[0] > 1 else 0, mask.stride(3)) if mask is not None else (0, 0)
    decode_attention_split_kernel[(batch, kv_heads, splits)](
        query, key, value, mask if mask is not None else query, part_acc, part_ml,
        length, group, key_dim, value_dim, float(scale), splits,
        query.stride(0), query.stride(1), key.stride(0), key.stride(1), key.stride(2),
        value.stride(0), value.stride(1), value.stride(2), *mask_strides,
        HAS_MASK=mask is not None, CHUNK=chunk, BLOCK_G=max(16, _pow2(group)), BLOCK_N=block_n,
        BLOCK_DK=max(16, _pow2(key_dim)), BLOCK_DV=max(16, _pow2(value_dim)), num_warps=warps)
    decode_attention_merge_kernel[(batch, heads)](
        part_acc, part_ml, out, value_dim, splits, out.stride(0), out.stride(2),
        BLOCK_S=ATTENTION_MERGE_BLOCK_S, BLOCK_DV=max(16, _pow2(value_dim)), num_warps=4)
    return out


@torch.library.custom_op("expertpack::decode_attention", mutates_args=())
def _attention_op(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
                  scale: float) -> torch.Tensor:
    return attention_launch(query, key, value, mask, scale)


@_attention_op.register_fake
def _(query, key, value, mask, scale):
    return query.new_empty((query.shape[0], 1, query.shape[1], value.shape[3]))


def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
              scale: float) -> torch.Tensor:
    """softmax(q k^T * scale, over the keys the mask shows) v for one query token (attention_fits),
    [B, Hq, 1, Dk] -> [B, 1, Hq, Dv]: query head i reads key/value head i // (Hq / Hkv)."""
    if torch.compiler.is_compiling():
        return _attention_op(query, key, value, mask, scale)
    return attention_launch(query, key, value, mask, scale)


def softmax_topk_launch(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    from inference.kernels.router_topk import softmax_topk_kernel

    tokens, experts = logits.shape
    scores = torch.empty((tokens, k), dtype=dtype, device=logits.device)
    indices = torch.empty((tokens, k), dtype=torch.int64, device=logits.device)
    softmax_topk_kernel[(tokens,)](logits, scores, indices, experts, k, logits.stride(0),
                                   RENORMALIZE=renormalize, BLOCK_E=max(16, _pow2(experts)),
                                   BLOCK_K=max(2, _pow2(k)), num_warps=4 if experts <= 1024 else 8)
    return scores, indices


@torch.library.custom_op("expertpack::softmax_topk", mutates_args=())
def _softmax_topk_op(logits: torch.Tensor, k: int, renormalize: bool, dtype: torch.dtype
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return softmax_topk_launch(logits, k, renormalize, dtype)


@_softmax_topk_op.register_fake
def _(logits, k, renormalize, dtype):
    return (logits.new_empty((logits.shape[0], k), dtype=dtype),
            logits.new_empty((logits.shape[0], k), dtype=torch.int64))


def softmax_topk(logits: torch.Tensor, k: int, *, renormalize: bool, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [T, k] in `dtype`, expert ids [T, k] int64) of logits [T, E] (rows contiguous, k <= E):
    the k largest of softmax(logits) in float32, descending, equal ones by lowest id, divided by
    their sum with `renormalize`."""
    if not (logits.dim() == 2 and logits.stride(1) == 1 and 0 < k <= logits.shape[1]):
        raise ValueError(f"softmax_topk: logits {tuple(logits.shape)} (strides {logits.stride()}) for top-{k}")
    if torch.compiler.is_compiling():
        return _softmax_topk_op(logits, k, renormalize, dtype)
    return softmax_topk_launch(logits, k, renormalize, dtype)
