"""packtools.quants: quantize -> gguf-py dequantize round trips, layouts, random blocks, errors."""

from __future__ import annotations


import gguf
import numpy as np
import pytest

from packformat.constants import SELF_CONTAINED_TYPES
from packtools.quants import (
    QUANTIZABLE_TYPES,
    RANDOM_BLOCK_TYPES,
    UnsupportedQuantType,
    dequantize,
    quantize,
    random_blocks,
    search,
)

T = gguf.GGMLQuantizationType
WEIGHT_STD = 0.02  # trained LLM weights are of this order; every case is built around it


def make_case(name: str) -> np.ndarray:
    """[64, 1024] float32 test matrices; seeded, so llama.cpp's numbers below stay valid."""
    rng = np.random.default_rng(20261129)
    values = rng.normal(0.0, WEIGHT_STD, (64, 1024)).astype(np.float32)
    if name == "outliers":
        # 0.5% of the weights 15x larger: the scale search must not let them wreck a block
        mask = rng.random(values.shape) < 0.005
        values[mask] = rng.normal(0.0, 0.3, int(mask.sum())).astype(np.float32)
    elif name == "zero_block":
        values[5, 256:512] = 0.0  # one whole K super-block, eight 32-element blocks
    return values


CASES = ("normal", "outliers", "zero_block")


def relative_rms_error(approx: np.ndarray, exact: np.ndarray) -> float:
    return float(np.sqrt(np.mean((approx - exact) ** 2)) / np.sqrt(np.mean(exact**2)))


# Upper bounds on relative RMS error (normal and zero_block, outliers): about 1.2x what each
# type measures on these matrices (the comment), far below what a wrong bit layout, a swapped
# nibble order or a lost scale gives (>= 0.5), and tight enough that a coarser scale search
# shows. Outliers widen the blocks they sit in, so most types lose precision there.
ERROR_BOUNDS: dict[T, tuple[float, float]] = {
    T.F32: (0.0, 0.0),  # exact
    T.F16: (3e-4, 3e-4),  # 2.1e-4: a 10-bit mantissa
    T.BF16: (2.5e-3, 2.5e-3),  # 1.7e-3: a 7-bit mantissa
    T.Q8_0: (0.0065, 0.012),  # 0.0054 / 0.0099
    T.Q6_K: (0.022, 0.034),  # 0.0179 / 0.0284
    T.Q5_K: (0.044, 0.056),  # 0.0363 / 0.0466
    T.Q5_1: (0.046, 0.058),  # 0.0380 / 0.0483
    T.Q5_0: (0.052, 0.093),  # 0.0428 / 0.0772
    T.Q4_K: (0.086, 0.11),  # 0.0718 / 0.0930
    T.Q4_1: (0.095, 0.12),  # 0.0787 / 0.1012
    T.Q4_0: (0.104, 0.17),  # 0.0864 / 0.1421
    T.MXFP4: (0.136, 0.19),  # 0.1134 / 0.1586
    T.Q3_K: (0.18, 0.20),  # 0.1518 / 0.1667
    T.Q2_K: (0.35, 0.345),  # 0.2974 / 0.2872
}

# llama.cpp's own reference quantizer (quantize_row_q*_K_ref, ggml-quants.c from the
# llama-cpp-python 0.3.36 sdist, built with gcc -O2) on exactly these matrices, then
# dequantized by gguf-py: relative RMS error. Ours must stay within 2% of it; dropping the
# scale search alone costs 5-10%.
LLAMA_CPP_REFERENCE_ERRORS: dict[tuple[T, str], float] = {
    (T.Q2_K, "normal"): 0.29736,
    (T.Q2_K, "outliers"): 0.28773,
    (T.Q3_K, "normal"): 0.15183,
    (T.Q3_K, "outliers"): 0.16670,
    (T.Q4_K, "normal"): 0.07177,
    (T.Q4_K, "outliers"): 0.09297,
    (T.Q5_K, "normal"): 0.03626,
    (T.Q5_K, "outliers"): 0.04663,
    (T.Q6_K, "normal"): 0.01786,
    (T.Q6_K, "outliers"): 0.02844,
}

K_QUANTS = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K)


def test_quantizable_types_are_the_pack_types():
    # the GGML types of a pack; F4_E2M1X2/UE8M0 are only ever copied from checkpoints, never made
    assert QUANTIZABLE_TYPES == SELF_CONTAINED_TYPES
    assert RANDOM_BLOCK_TYPES == SELF_CONTAINED_TYPES
    assert set(ERROR_BOUNDS) == set(QUANTIZABLE_TYPES)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize(
    "element_type", sorted(QUANTIZABLE_TYPES, key=lambda t: t.name), ids=lambda t: t.name
)
def test_round_trip_error_is_bounded(element_type: T, case: str):
    values = make_case(case)
    raw = quantize(values, element_type)
    block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
    assert raw.dtype == np.uint8
    assert raw.shape == (64, 1024 // block_elements * type_size)

    restored = gguf.quants.dequantize(raw, element_type)  # the reference reader, not ours
    assert restored.shape == values.shape
    assert np.isfinite(restored).all()
    bound = ERROR_BOUNDS[element_type][1 if case == "outliers" else 0]
    error = relative_rms_error(restored, values)
    assert error <= bound, f"{element_type.name} {case}: relative RMS error {error:.5f} > {bound}"
    if case == "zero_block":
        assert not restored[5, 256:512].any(), "an all-zero block must come back exactly zero"


@pytest.mark.parametrize("case", ("normal", "outliers"))
@pytest.mark.parametrize("element_type", K_QUANTS, ids=lambda t: t.name)
def test_k_quants_match_llama_cpp_reference_error(element_type: T, case: str):
    values = make_case(case)
    error = relative_rms_error(
        gguf.quants.dequantize(quantize(values, element_type), element_type), values
    )
    reference = LLAMA_CPP_REFERENCE_ERRORS[(element_type, case)]
    assert abs(error / reference - 1) < 0.02, (
        f"{element_type.name} {case}: error {error:.5f} vs llama.cpp {reference:.5f}"
    )


@pytest.mark.parametrize(
    "element_type", [T.Q4_0, T.Q8_0, T.Q5_1, T.MXFP4, T.BF16], ids=lambda t: t.name
)
def test_gguf_quantized_types_are_gguf_bytes(element_type: T):
    values = make_case("outliers")[:, :512]
    ours = quantize(values, element_type)
    golden = gguf.quants.quantize(values, element_type)
    assert ours.dtype == np.uint8
    np.testing.assert_array_equal(ours, golden)


@pytest.mark.parametrize(
    ("element_type", "dtype"), [(T.F32, np.float32), (T.F16, np.float16)], ids=["F32", "F16"]
)
def test_float_types_are_their_raw_bytes(element_type: T, dtype: type):
    values = make_case("normal")[:3, :8]
    raw = quantize(values, element_type)
    assert raw.dtype == np.uint8 and raw.shape == (3, 8 * np.dtype(dtype).itemsize)
    np.testing.assert_array_equal(raw.view(dtype), values.astype(dtype))
    np.testing.assert_array_equal(
        dequantize(raw, element_type), values.astype(dtype).astype(np.float32)
    )


@pytest.mark.parametrize("element_type", K_QUANTS, ids=lambda t: t.name)
def test_leading_dims_dtype_and_strides_do_not_matter(element_type: T):
    values = make_case("normal").reshape(4, 16, 1024)
    flat = quantize(values.reshape(-1, 1024), element_type)
    shaped = quantize(values, element_type)
    assert shaped.shape == (4, 16, flat.shape[-1])
    np.testing.assert_array_equal(shaped.reshape(flat.shape), flat)
    # a transposed (non-contiguous) float64 view holding the same numbers
    transposed = np.ascontiguousarray(values.reshape(64, 1024).T).astype(np.float64).T
    np.testing.assert_array_equal(quantize(transposed, element_type), flat)
    np.testing.assert_array_equal(
        dequantize(flat, element_type), gguf.quants.dequantize(flat, element_type)
    )


# Plain per-group loops written straight from ggml-quants.c (make_qkx2_quants, make_q3_quants,
# make_qx_quants), in float32 like the C code: the vectorized searches must pick the same
# scales. Summation order (pairwise in numpy, sequential in C) may split an exact tie.


def loop_make_qkx2_quants(x, weights, nmax, rmin, rdelta, nstep, use_mad):
    low, high = min(x.min(), 0.0), x.max()
    if high == low:
        return 0.0, -low
    sum_w, sum_x = weights.sum(), (weights * x).sum()
    scale = (high - low) / nmax
    levels = np.clip(np.rint(nmax / (high - low) * (x - low)), 0, nmax)
    diff = scale * levels + low - x
    best = (weights * (np.abs(diff) if use_mad else diff * diff)).sum()
    for step in range(nstep + 1):
        levels = np.clip(np.rint((rmin + rdelta * step + nmax) / (high - low) * (x - low)), 0, nmax)
        sum_l, sum_l2 = (weights * levels).sum(), (weights * levels * levels).sum()
        sum_xl = (weights * levels * x).sum()
        det = sum_w * sum_l2 - sum_l * sum_l
        if det > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / det
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det
            if this_min > 0:
                this_min, this_scale = 0.0, sum_xl / sum_l2
            diff = this_scale * levels + this_min - x
            error = (weights * (np.abs(diff) if use_mad else diff * diff)).sum()
            if error < best:
                best, scale, low = error, this_scale, this_min
    return scale, -low


def loop_make_q3_quants(x, nmax):
    peak = x[np.argmax(np.abs(x))]
    if abs(peak) < 1e-15:
        return 0.0
    levels = np.clip(np.rint(-nmax / peak * x), -nmax, nmax - 1)
    weights = x * x
    sumlx, suml2 = (weights * x * levels).sum(), (weights * levels * levels).sum()
    for _ in range(5):
        changed = 0
        for i in range(len(x)):
            slx = sumlx - weights[i] * x[i] * levels[i]
            if slx > 0:
                sl2 = suml2 - weights[i] * levels[i] ** 2
                new_level = np.clip(np.rint(x[i] * sl2 / slx), -nmax, nmax - 1)
                if new_level != levels[i]:
                    slx += weights[i] * x[i] * new_level
                    sl2 += weights[i] * new_level**2
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        levels[i], sumlx, suml2 = new_level, slx, sl2
                        changed += 1
        if not changed:
            break
    return sumlx / suml2 if suml2 > 0 else 0.0


def loop_make_qx_quants(x, nmax):
    peak = x[np.argmax(np.abs(x))]
    if abs(peak) < 1e-15:
        return 0.0
    weights = x * x

    def sums(iscale):
        levels = np.clip(np.rint(iscale * x), -nmax, nmax - 1)
        return (weights * x * levels).sum(), (weights * levels * levels).sum()

    sumlx, suml2 = sums(-nmax / peak)
    scale = sumlx / suml2 if suml2 else 0.0
    best = scale * sumlx
    for step in [s for s in range(-9, 10) if s]:
        sumlx, suml2 = sums(-(nmax + 0.1 * step) / peak)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


def search_groups(group_size: int) -> np.ndarray:
    """[256, group_size] float32: normal groups, some with an outlier, some all zero."""
    groups = make_case("outliers").reshape(-1, group_size)[:256].copy()
    groups[::37] = 0.0
    return groups


def fraction_close(vectorized: np.ndarray, looped: list[float]) -> float:
    return float(np.mean(np.isclose(vectorized, np.array(looped), rtol=1e-4, atol=1e-9)))


@pytest.mark.parametrize(
    ("group_size", "nmax", "rmin", "nstep", "use_mad"),
    [(16, 3, -0.5, 15, True), (32, 15, -1.0, 20, False), (32, 31, -0.5, 15, False)],
    ids=["Q2_K", "Q4_K", "Q5_K"],
)
def test_scale_and_min_search_matches_loop(group_size, nmax, rmin, nstep, use_mad):
    groups = search_groups(group_size)
    if use_mad:
        weights = np.abs(groups)
    else:
        weights = np.sqrt((groups * groups).mean(axis=-1, keepdims=True)) + np.abs(
            groups
        )  # [G, 32]
    scales, mins = search.fit_scale_and_min(groups, weights, nmax, rmin, 0.1, nstep, use_mad)
    looped = [
        loop_make_qkx2_quants(g, w, nmax, np.float32(rmin), np.float32(0.1), nstep, use_mad)
        for g, w in zip(groups, weights, strict=True)
    ]
    assert fraction_close(scales, [scale for scale, _ in looped]) > 0.99
    assert fraction_close(mins, [low for _, low in looped]) > 0.99


def test_q3_scale_search_matches_loop():
    groups = search_groups(16)
    scales = search.fit_symmetric_scale_q3(groups, 4)
    looped = [loop_make_q3_quants(g, 4) for g in groups]
    assert fraction_close(scales, looped) > 0.99


def test_q6_scale_search_matches_loop():
    groups = search_groups(16)
    scales = search.fit_symmetric_scale(groups, 32)
    looped = [loop_make_qx_quants(g, 32) for g in groups]
    assert fraction_close(scales, looped) > 0.99


@pytest.mark.parametrize(
    "element_type", sorted(RANDOM_BLOCK_TYPES, key=lambda t: t.name), ids=lambda t: t.name
)
def test_random_blocks_are_valid_weights(element_type: T):
    shape = (8, 4, 1024)
    raw = random_blocks(element_type, shape, np.random.default_rng(7))
    block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
    assert raw.dtype == np.uint8
    assert raw.shape == (8, 4, 1024 // block_elements * type_size)
    values = dequantize(raw, element_type)
    assert values.shape == shape
    assert np.isfinite(values).all()
    std = float(values.std())
    assert 0.6 * WEIGHT_STD < std < 1.6 * WEIGHT_STD, f"{element_type.name}: std {std}"
    assert abs(float(values.mean())) < 0.05 * std  # centred, like trained weights
    assert float(np.abs(values).max()) < 10 * WEIGHT_STD
    # not degenerate: most values distinct from their neighbours
    assert np.mean(values[..., 1:] != values[..., :-1]) > 0.5


def test_random_blocks_are_seeded():
    first = random_blocks(T.Q4_K, (16, 256), np.random.default_rng(11))
    np.testing.assert_array_equal(
        first, random_blocks(T.Q4_K, (16, 256), np.random.default_rng(11))
    )
    assert not np.array_equal(first, random_blocks(T.Q4_K, (16, 256), np.random.default_rng(12)))


@pytest.mark.parametrize(
    ("element_type", "name"),
    [(T.IQ2_XXS, "IQ2_XXS"), (T.TQ1_0, "TQ1_0"), (T.Q8_K, "Q8_K"), (1012, "1012")],
)
def test_unsupported_types_are_refused_by_name(element_type: int, name: str):
    values = np.zeros((2, 256), dtype=np.float32)
    with pytest.raises(UnsupportedQuantType) as refused:
        quantize(values, element_type)
    assert isinstance(refused.value, ValueError)
    assert name in str(refused.value)
    with pytest.raises(UnsupportedQuantType, match=name):
        random_blocks(element_type, (2, 256), np.random.default_rng(0))


def test_dequantize_refuses_what_gguf_cannot_read():
    with pytest.raises(UnsupportedQuantType, match="Q8_1"):
        dequantize(np.zeros((1, 36), dtype=np.uint8), T.Q8_1)


@pytest.mark.parametrize("element_type", [T.Q4_K, T.Q8_0, T.MXFP4], ids=lambda t: t.name)
def test_ragged_rows_are_refused(element_type: T):
    block_elements, type_size = gguf.GGML_QUANT_SIZES[element_type]
    with pytest.raises(ValueError, match=element_type.name):
        quantize(np.zeros((2, block_elements + 16), dtype=np.float32), element_type)
    with pytest.raises(ValueError, match=element_type.name):
        random_blocks(element_type, (2, block_elements - 1), np.random.default_rng(0))
    with pytest.raises(ValueError, match=element_type.name):
        dequantize(np.zeros((2, type_size + 1), dtype=np.uint8), element_type)


@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_k_quants_refuse_non_finite_input_with_its_index(bad: float):
    values = make_case("normal")[:2, :512].copy()
    values[1, 300] = bad
    with pytest.raises(ValueError, match=r"\(1, 300\).*Q4_K"):
        quantize(values, T.Q4_K)


def test_quantize_never_aliases_its_input():
    values = make_case("normal")[:2, :32].copy()
    raw = quantize(values, T.F32)
    values[0, 0] = 5.0
    assert raw.view(np.float32)[0, 0] != 5.0
