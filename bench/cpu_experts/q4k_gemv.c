/* Q4_K weights times a float32 vector on the CPU, computed from the quantized bytes in place: the
 * kernel bench/cpu_expert_probe.py times against the host's memory bandwidth, to size computing
 * host-tier experts on the CPU beside the GPU's reads over the link.
 *
 * A Q4_K block is 256 weights in 144 bytes: d and dmin (fp16), 12 bytes of 6-bit scales and mins
 * for 8 sub-blocks of 32, then 128 bytes of 4-bit quants (gguf-py's layout). Weight i of sub-block
 * s is d * scale_s * q_i - dmin * min_s, so a sub-block's dot with x is
 * d * scale_s * sum(q_i * x_i) - dmin * min_s * sum(x_i): the sums of x per sub-block (xsum) are
 * shared by every row and computed once per vector.
 */
#include <stdint.h>
#include <immintrin.h>

static inline float half_to_float(const uint8_t *p) {
    const uint16_t h = (uint16_t)(p[0] | (p[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else  /* IEEE half -> float by hand: sign, exponent rebias, subnormals scaled, inf/nan kept */
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    union { uint32_t u; float f; } out;
    if (exponent == 0) {
        out.f = (float)mantissa * 0x1p-24f;
        out.u |= sign;
    } else if (exponent == 31) {
        out.u = sign | 0x7F800000u | (mantissa << 13);
    } else {
        out.u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    return out.f;
#endif
}

static inline void scale_min(int j, const uint8_t *q, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63);
        *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

#if defined(__AVX2__) && defined(__FMA__)
/* 8 quants of one nibble half (shift 0: low, 4: high) of qs[0..8) as floats */
static inline __m256 nibbles(const uint8_t *qs, int shift) {
    __m256i q = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)qs));
    q = _mm256_and_si256(_mm256_srli_epi32(q, shift), _mm256_set1_epi32(0xF));
    return _mm256_cvtepi32_ps(q);
}

/* sum over a sub-block of 32 weights (qs[0..32), one nibble half) of q_i * x_i, in 8 lanes */
static inline __m256 sub_block(const uint8_t *qs, int shift, const float *x) {
    __m256 sum = _mm256_mul_ps(nibbles(qs, shift), _mm256_loadu_ps(x));
    sum = _mm256_fmadd_ps(nibbles(qs + 8, shift), _mm256_loadu_ps(x + 8), sum);
    sum = _mm256_fmadd_ps(nibbles(qs + 16, shift), _mm256_loadu_ps(x + 16), sum);
    return _mm256_fmadd_ps(nibbles(qs + 24, shift), _mm256_loadu_ps(x + 24), sum);
}

/* 64 weights' two sub-blocks (low nibbles of qs[0..32) times x[0..32), high nibbles times
 * x[32..64)), scaled by d * scale, added to the row's 8-lane accumulator */
typedef __m256 accumulator;
static inline accumulator acc_zero(void) { return _mm256_setzero_ps(); }
static inline accumulator acc_pair(accumulator acc, const uint8_t *qs, const float *x, float ds1, float ds2) {
    acc = _mm256_fmadd_ps(sub_block(qs, 0, x), _mm256_set1_ps(ds1), acc);
    return _mm256_fmadd_ps(sub_block(qs, 4, x + 32), _mm256_set1_ps(ds2), acc);
}
static inline float acc_total(accumulator acc) {
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    half = _mm_add_ss(half, _mm_movehdup_ps(half));
    return _mm_cvtss_f32(half);
}
#else
typedef float accumulator;
static inline accumulator acc_zero(void) { return 0.0f; }
static inline accumulator acc_pair(accumulator acc, const uint8_t *qs, const float *x, float ds1, float ds2) {
    float lo = 0.0f, hi = 0.0f;
    for (int l = 0; l < 32; l++) {
        lo += (float)(qs[l] & 0xF) * x[l];
        hi += (float)(qs[l] >> 4) * x[l + 32];
    }
    return acc + ds1 * lo + ds2 * hi;
}
static inline float acc_total(accumulator acc) { return acc; }
#endif

static float row_dot(const uint8_t *row, int64_t blocks, const float *x, const float *xsum) {
    accumulator acc = acc_zero();
    float mins = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        const uint8_t *block = row + b * 144;           /* [144] bytes */
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        const uint8_t *scales = block + 4, *qs = block + 16;
        const float *xb = x + b * 256, *sb = xsum + b * 8;
        for (int j = 0; j < 4; j++) {                  /* 64 weights: low nibbles, then high */
            float s1, m1, s2, m2;
            scale_min(2 * j, scales, &s1, &m1);
            scale_min(2 * j + 1, scales, &s2, &m2);
            acc = acc_pair(acc, qs, xb, d * s1, d * s2);
            mins += dmin * (m1 * sb[2 * j] + m2 * sb[2 * j + 1]);
            qs += 32;
            xb += 64;
        }
    }
    return acc_total(acc) - mins;
}

/* For each of `count` matrices m (rows x cols, Q4_K, row-major, cols % 256 == 0):
 * y[m][r] = W_m[r, :] . x[m] with xsum[m] = sums of x[m] per 32; rows spread over `threads`. */
void q4k_gemv_many(int count, const uint8_t *const *w, const float *const *x, const float *const *xsum,
                   float *const *y, int64_t rows, int64_t cols, int threads) {
    const int64_t blocks = cols / 256, row_bytes = blocks * 144;
#pragma omp parallel for collapse(2) schedule(static) num_threads(threads)
    for (int m = 0; m < count; m++)
        for (int64_t r = 0; r < rows; r++)
            y[m][r] = row_dot(w[m] + r * row_bytes, blocks, x[m], xsum[m]);
}
