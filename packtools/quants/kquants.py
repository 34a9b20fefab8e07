"""Q2_K..Q6_K quantizers: numpy ports of llama.cpp's quantize_row_q*_K_ref.

Every function takes blocks [N, 256] float32 and returns [N, type_size] uint8 in exactly the
byte layout gguf-py's dequantizers read (ggml's block_q*_K structs). Scales are searched per
sub-block by the helpers in `search`, rounded to the super-block's fp16 scale, and the values
are then requantized against the rounded scales, as the C reference does.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from packtools.quants import search

QK_K = 256  # elements per super-block
_F32 = np.float32


def _fp16(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Round to fp16 like GGML_FP32_TO_FP16; returns ([N, 2] uint8 bytes, the rounded float32)."""
    half = values.astype(np.float16)  # [N]
    return half.view(np.uint8).reshape(-1, 2), half.astype(_F32)


def _requantize(
    x: np.ndarray, step: np.ndarray, offset: np.ndarray, low: int, high: int, empty: int
) -> np.ndarray:
    """Levels of x [N, S, n] on the grid step * L - offset ([N, S] each); `empty` if step is 0."""
    with np.errstate(divide="ignore", invalid="ignore"):
        levels = search.nearest_int((x + offset[..., None]) / step[..., None])
    levels = np.clip(levels, low, high)
    return np.where(step[..., None] != 0, levels, _F32(empty)).astype(np.int16)


def _pack_2bit(levels: np.ndarray) -> np.ndarray:
    """[N, 256] values 0..3 -> [N, 64]: byte h*32+l holds elements h*128 + 32*k + l at bits 2k."""
    quarters = levels.astype(np.uint8).reshape(-1, 2, 4, 32)  # [N, half, k, l]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    return np.bitwise_or.reduce(quarters << shifts, axis=2).reshape(-1, 64)


def _pack_bit_planes(high_bits: np.ndarray) -> np.ndarray:
    """[N, 256] values 0..1 -> [N, 32]: bit b of byte l holds element b*32 + l."""
    planes = high_bits.astype(np.uint8).reshape(-1, 8, 32)  # [N, b, l]
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return np.bitwise_or.reduce(planes << shifts, axis=1)


def _pack_nibbles(levels: np.ndarray) -> np.ndarray:
    """[N, 256] values 0..15 -> [N, 128]: byte c*32+l holds c*64+l (low) and c*64+32+l (high)."""
    pairs = levels.astype(np.uint8).reshape(-1, 4, 2, 32)  # [N, chunk, half, l]
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(-1, 128)


def _pack_scales_6bit_k4(scales: np.ndarray, mins: np.ndarray) -> np.ndarray:
    """Eight 6-bit scales and mins [N, 8] -> the 12-byte field get_scale_min_k4 reads."""
    ls = scales.astype(np.uint8)
    lm = mins.astype(np.uint8)
    out = np.empty((ls.shape[0], 12), dtype=np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)  # scales 0-3, top bits of scales 4-7
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)  # mins 0-3, top bits of mins 4-7
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _quantize_scale_min_k4(blocks: np.ndarray, nmax: int, rmin: float, nstep: int):
    """Shared Q4_K / Q5_K front half: sub-blocks of 32, 6-bit scales and mins, fp16 d/dmin.

    Returns (d bytes, dmin bytes, packed 12-byte scales, levels [N, 256] int16).
    """
    sub = blocks.reshape(-1, 32)  # [N*8, 32]
    rms = np.sqrt((sub * sub).sum(axis=-1) / _F32(32))  # [N*8]
    weights = rms[:, None] + np.abs(sub)  # favours large elements, never zero for a live block
    scales, mins = search.fit_scale_and_min(sub, weights, nmax, rmin, 0.1, nstep, use_mad=False)
    scales, mins = scales.reshape(-1, 8), mins.reshape(-1, 8)  # [N, 8]
    max_scale = np.maximum(scales.max(axis=-1), _F32(0))  # [N]
    max_min = np.maximum(mins.max(axis=-1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(63) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(63) / max_min, _F32(0))
    scale_levels = np.clip(search.nearest_int(inv_scale[:, None] * scales), 0, 63)  # [N, 8]
    min_levels = np.clip(search.nearest_int(inv_min[:, None] * mins), 0, 63)
    d_bytes, d = _fp16(max_scale / _F32(63))
    dmin_bytes, dmin = _fp16(max_min / _F32(63))
    step = d[:, None] * scale_levels  # [N, 8]
    offset = dmin[:, None] * min_levels
    levels = _requantize(blocks.reshape(-1, 8, 32), step, offset, 0, nmax, 0).reshape(-1, QK_K)
    return d_bytes, dmin_bytes, _pack_scales_6bit_k4(scale_levels, min_levels), levels


def quantize_q2_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 256] -> [N, 84]: scales[16] (scale | min << 4), qs[64], d, dmin."""
    sub = blocks.reshape(-1, 16)  # [N*16, 16]
    scales, mins = search.fit_scale_and_min(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales, mins = scales.reshape(-1, 16), mins.reshape(-1, 16)  # [N, 16]
    max_scale = np.maximum(scales.max(axis=-1), _F32(0))  # [N]
    max_min = np.maximum(mins.max(axis=-1), _F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F32(15) / max_scale, _F32(0))
        inv_min = np.where(max_min > 0, _F32(15) / max_min, _F32(0))
    scale_levels = np.clip(search.nearest_int(inv_scale[:, None] * scales), 0, 15)  # [N, 16]
    min_levels = np.clip(search.nearest_int(inv_min[:, None] * mins), 0, 15)
    d_bytes, d = _fp16(max_scale / _F32(15))
    dmin_bytes, dmin = _fp16(max_min / _F32(15))
    step = d[:, None] * scale_levels
    offset = dmin[:, None] * min_levels
    levels = _requantize(blocks.reshape(-1, 16, 16), step, offset, 0, 3, 0).reshape(-1, QK_K)
    packed_scales = scale_levels.astype(np.uint8) | (min_levels.astype(np.uint8) << 4)
    return np.concatenate([packed_scales, _pack_2bit(levels), d_bytes, dmin_bytes], axis=1)


def quantize_q3_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 256] -> [N, 110]: hmask[32], qs[64] (low 2 bits), scales[12] (6-bit, +32), d."""
    scales = search.fit_symmetric_scale_q3(blocks.reshape(-1, 16), 4).reshape(-1, 16)  # [N, 16]
    max_scale = search.signed_absmax(scales)  # [N]
    live = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = np.where(live, _F32(-32) / max_scale, _F32(0))  # [N]
        d_source = np.where(live, _F32(1) / iscale, _F32(0))
    scale_levels = np.clip(search.nearest_int(iscale[:, None] * scales), -32, 31) + 32  # [N, 16]
    scale_levels = np.where(live[:, None], scale_levels, _F32(0)).astype(np.uint8)
    d_bytes, d = _fp16(d_source)
    step = d[:, None] * (scale_levels.astype(_F32) - 32)  # [N, 16]
    levels = _requantize(blocks.reshape(-1, 16, 16), step, np.zeros_like(step), -4, 3, -4)
    levels = (levels + 4).reshape(-1, QK_K)  # 0..7; an empty sub-block stores 0 like ggml

    packed_scales = np.empty((blocks.shape[0], 12), dtype=np.uint8)
    packed_scales[:, 0:8] = (scale_levels[:, 0:8] & 0xF) | ((scale_levels[:, 8:16] & 0xF) << 4)
    top_bits = (scale_levels >> 4).reshape(-1, 4, 4)  # [N, group g = j // 4, k = j % 4]
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 4, 1)
    packed_scales[:, 8:12] = np.bitwise_or.reduce(top_bits << shifts, axis=1)
    hmask = _pack_bit_planes(levels > 3)
    return np.concatenate([hmask, _pack_2bit(levels & 3), packed_scales, d_bytes], axis=1)


def quantize_q4_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 256] -> [N, 144]: d, dmin, scales[12] (6-bit scales and mins), qs[128]."""
    d_bytes, dmin_bytes, packed_scales, levels = _quantize_scale_min_k4(blocks, 15, -1.0, 20)
    return np.concatenate([d_bytes, dmin_bytes, packed_scales, _pack_nibbles(levels)], axis=1)


def quantize_q5_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 256] -> [N, 176]: d, dmin, scales[12], qh[32] (fifth bits), qs[128] (low nibbles)."""
    d_bytes, dmin_bytes, packed_scales, levels = _quantize_scale_min_k4(blocks, 31, -0.5, 15)
    qh = _pack_bit_planes(levels >> 4)
    qs = _pack_nibbles(levels & 0xF)
    return np.concatenate([d_bytes, dmin_bytes, packed_scales, qh, qs], axis=1)


def quantize_q6_k(blocks: np.ndarray) -> np.ndarray:
    """[N, 256] -> [N, 210]: ql[128] (low nibbles), qh[64] (top 2 bits), scales[16] int8, d."""
    scales = search.fit_symmetric_scale(blocks.reshape(-1, 16), 32).reshape(-1, 16)  # [N, 16]
    max_scale = search.signed_absmax(scales)  # [N]
    live = np.abs(max_scale) >= search.GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(live, _F32(-128) / max_scale, _F32(0))
        d_source = np.where(live, _F32(1) / iscale, _F32(0))
    scale_levels = np.minimum(search.nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d_bytes, d = _fp16(d_source)
    step = d[:, None] * scale_levels.astype(_F32)  # [N, 16]
    levels = _requantize(blocks.reshape(-1, 16, 16), step, np.zeros_like(step), -32, 31, 0)
    levels = (levels + 32).astype(np.uint8).reshape(-1, 2, 4, 32)  # [N, half, k, l], 0..63

    ql = np.empty((blocks.shape[0], 2, 64), dtype=np.uint8)  # [N, half, byte]
    ql[:, :, 0:32] = (levels[:, :, 0] & 0xF) | ((levels[:, :, 2] & 0xF) << 4)
    ql[:, :, 32:64] = (levels[:, :, 1] & 0xF) | ((levels[:, :, 3] & 0xF) << 4)
    shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
    qh = np.bitwise_or.reduce((levels >> 4) << shifts, axis=2)  # [N, half, 32]
    out = np.concatenate(
        [ql.reshape(-1, 128), qh.reshape(-1, 64), scale_levels.view(np.uint8), d_bytes], axis=1
    )
    out[~live] = 0  # ggml writes an all-zero block when every scale vanished
    return out


# Super-blocks per numpy pass: small enough that the search's [chunk, 256] float32
# temporaries (1 MiB each) stay in cache, large enough that per-call overhead vanishes.
CHUNK_BLOCKS = 1024


def quantize_k_blocks(
    blocks: np.ndarray, quantize_chunk: Callable[[np.ndarray], np.ndarray], block_bytes: int
) -> np.ndarray:
    """[N, 256] float -> [N, block_bytes] uint8 by one of the quantizers above, in cache-sized chunks."""
    out = np.empty((blocks.shape[0], block_bytes), dtype=np.uint8)
    for start in range(0, blocks.shape[0], CHUNK_BLOCKS):
        chunk = blocks[start : start + CHUNK_BLOCKS].astype(_F32, copy=False)
        out[start : start + CHUNK_BLOCKS] = quantize_chunk(np.ascontiguousarray(chunk))
    return out
