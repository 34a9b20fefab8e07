"""Vectorized scale searches of llama.cpp's K-quant reference quantizers.

Each function is the numpy twin of one helper in ggml-quants.c, run over many groups at
once: `x` is [groups, n] float32 and every result has one entry per group. The arithmetic
stays in float32 like the C code so the chosen scales match llama.cpp's nearly always; sums
are pairwise in numpy instead of sequential, so a rare tie may resolve differently.
"""

from __future__ import annotations

import numpy as np

# llama.cpp's GROUP_MAX_EPS: a group whose largest |x| is below this counts as all zero.
GROUP_MAX_EPS = np.float32(1e-15)

_F32 = np.float32


def nearest_int(values: np.ndarray) -> np.ndarray:
    """Round half to even, as ggml's nearest_int (the 1.5 * 2**23 trick) does; stays float."""
    return np.rint(values)


def signed_absmax(x: np.ndarray) -> np.ndarray:
    """[groups, n] -> [groups]: the element of largest magnitude, sign kept (first on ties)."""
    index = np.argmax(np.abs(x), axis=-1)  # argmax keeps the first maximum, like C's strict >
    return np.take_along_axis(x, index[:, None], axis=-1)[:, 0]


def _safe_divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return numerator / denominator


def fit_scale_and_min(
    x: np.ndarray,
    weights: np.ndarray,
    nmax: int,
    rmin: float,
    rdelta: float,
    nstep: int,
    use_mad: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """make_qkx2_quants: x ~ scale * L - the_min with L in [0, nmax]; returns (scale, the_min).

    Starts from the min/max grid, then tries nstep+1 stretched grids, refits scale and min by
    weighted least squares on each and keeps the one with the lowest weighted error. The
    levels themselves are not returned: every caller requantizes after rounding the scales.
    """
    x = x.astype(_F32, copy=False)  # [G, n]
    weights = weights.astype(_F32, copy=False)  # [G, n]
    low = np.minimum(x.min(axis=-1), _F32(0))  # [G]; the min is never positive
    high = x.max(axis=-1)  # [G]
    sum_w = weights.sum(axis=-1)  # [G]
    sum_x = (weights * x).sum(axis=-1)  # [G]
    flat = high == low  # [G]; C returns scale 0 for these before any search

    def weighted_error(scale: np.ndarray, offset: np.ndarray, levels: np.ndarray) -> np.ndarray:
        diff = scale[:, None] * levels + offset[:, None] - x  # [G, n]
        diff = np.abs(diff) if use_mad else diff * diff
        return (weights * diff).sum(axis=-1)  # [G]

    def levels_for(iscale: np.ndarray, offset: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            return np.clip(nearest_int(iscale[:, None] * (x - offset[:, None])), 0, nmax)

    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = _F32(nmax) / (high - low)  # [G]; inf on flat groups, masked below
        scale = _F32(1) / iscale
    best_error = weighted_error(scale, low, levels_for(iscale, low))

    for step in range(nstep + 1):
        stretch = _F32(rmin) + _F32(rdelta) * _F32(step) + _F32(nmax)
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = stretch / (high - low)
        levels = levels_for(iscale, low)  # [G, n]
        weighted_levels = weights * levels
        sum_l = weighted_levels.sum(axis=-1)
        sum_l2 = (weighted_levels * levels).sum(axis=-1)
        sum_xl = (weighted_levels * x).sum(axis=-1)
        determinant = sum_w * sum_l2 - sum_l * sum_l
        this_scale = _safe_divide(sum_w * sum_xl - sum_x * sum_l, determinant)
        this_min = _safe_divide(sum_l2 * sum_x - sum_l * sum_xl, determinant)
        # A positive offset is not representable (mins are subtracted): refit through zero.
        positive = this_min > 0
        this_scale = np.where(positive, _safe_divide(sum_xl, sum_l2), this_scale)
        this_min = np.where(positive, _F32(0), this_min)
        with np.errstate(invalid="ignore", over="ignore"):
            error = weighted_error(this_scale, this_min, levels)
            better = (determinant > 0) & (error < best_error) & ~flat
        best_error = np.where(better, error, best_error)
        scale = np.where(better, this_scale, scale)
        low = np.where(better, this_min, low)

    scale = np.where(flat, _F32(0), scale)
    return scale.astype(_F32), (-low).astype(_F32)


def fit_symmetric_scale_q3(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_q3_quants(do_rmse=true): scale with x ~ scale * L, L in [-nmax, nmax-1].

    Weighted by x**2; after the first rounding, up to five coordinate-descent passes move one
    level at a time when that raises sumlx**2/suml2. C stops after a pass without changes;
    running all five is the same, since a pass over an unchanged state changes nothing.
    """
    x = x.astype(_F32, copy=False)  # [G, n]
    peak = signed_absmax(x)  # [G]
    all_zero = np.abs(peak) < GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = np.where(all_zero, _F32(0), _F32(-nmax) / peak)  # [G]
    columns = np.ascontiguousarray(x.T)  # [n, G]: one element of every group per row
    weights = columns * columns
    levels = np.clip(nearest_int(iscale[None, :] * columns), -nmax, nmax - 1)  # [n, G]
    weighted_x = weights * columns  # w * x, the C evaluation order of w*x[i]*L[i]
    sumlx = (weighted_x * levels).sum(axis=0)  # [G]
    suml2 = (weights * levels * levels).sum(axis=0)
    for _ in range(5):
        for i in range(columns.shape[0]):
            x_i, w_i, wx_i, level = columns[i], weights[i], weighted_x[i], levels[i]
            slx = sumlx - wx_i * level
            sl2 = suml2 - w_i * level * level
            with np.errstate(divide="ignore", invalid="ignore"):
                new_level = np.clip(nearest_int(x_i * sl2 / slx), -nmax, nmax - 1)
            slx_new = slx + wx_i * new_level
            sl2_new = sl2 + w_i * new_level * new_level
            with np.errstate(invalid="ignore"):
                accept = (
                    (slx > 0)
                    & (new_level != level)
                    & (sl2_new > 0)
                    & (slx_new * slx_new * suml2 > sumlx * sumlx * sl2_new)
                )
            levels[i] = np.where(accept, new_level, level)
            sumlx = np.where(accept, slx_new, sumlx)
            suml2 = np.where(accept, sl2_new, suml2)
    scale = np.where(suml2 > 0, _safe_divide(sumlx, suml2), _F32(0))
    return np.where(all_zero, _F32(0), scale).astype(_F32)


def fit_symmetric_scale(x: np.ndarray, nmax: int) -> np.ndarray:
    """make_qx_quants(rmse_type=1, no importance): scale with x ~ scale * L, L in [-nmax, nmax-1].

    Weighted by x**2; tries the plain grid and 18 slightly stretched or shrunk ones and keeps
    the least-squares scale of the grid that maximises sumlx**2/suml2 (least weighted error).
    """
    x = x.astype(_F32, copy=False)  # [G, n]
    peak = signed_absmax(x)  # [G]
    all_zero = np.abs(peak) < GROUP_MAX_EPS
    safe_peak = np.where(all_zero, _F32(1), peak)
    weights = x * x
    weighted_x = weights * x

    def sums(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        levels = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)  # [G, n]
        return (weighted_x * levels).sum(axis=-1), (weights * levels * levels).sum(axis=-1)

    sumlx, suml2 = sums(_F32(-nmax) / safe_peak)
    scale = np.where(suml2 > 0, _safe_divide(sumlx, suml2), _F32(0))
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        sumlx, suml2 = sums(-(_F32(nmax) + _F32(0.1) * _F32(step)) / safe_peak)
        better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        scale = np.where(better, _safe_divide(sumlx, suml2), scale)
        best = np.where(better, scale * sumlx, best)
    return np.where(all_zero, _F32(0), scale).astype(_F32)
