/* Host-tier experts computed on the CPU, beside the GPU: a pool of threads that serves GEMVs over
 * storaged's host tier (mapped into this process) through a mailbox in page-locked host memory.
 *
 * The protocol (inference/kernels/host_experts.py holds the Python side, handoff_triton.py the
 * device side):
 *   the device writes a job's inputs into the mailbox (the expert kind id, the pairs' host slots,
 *   the hidden states in bfloat16), then the job's ticket with a system-scope release;
 *   the pool's leader sees the ticket and runs, for every pair with a slot >= 0, the whole expert
 *   in three phases the threads share: gate/up rows (W_up(slot) . x[p / top_k], into scratch),
 *   the activation (SiLU(gate) * up, with the kind's clamp if any), the down rows into the
 *   mailbox's output; then it writes `done` = ticket (or -ticket when the job named a slot outside
 *   the host tier or an unknown kind), and the device, spinning on `done`, copies the rows.
 *
 * Arithmetic equals the GPU's GEMV (inference/kernels/moe_triton.py) but for the order of the
 * float32 additions: each weight dequantized as gguf-py does (no FMA contraction: build with
 * -ffp-contract=off) and rounded to bfloat16, as the resident model holds it, times x, summed in
 * float32, the sum rounded to bfloat16 (to nearest even). MXFP4 weights are exact in bfloat16
 * already (a 4-bit value times a power of two), so their blocks are summed first and scaled once.
 * The activation rounds where torch's bfloat16 ops do (clamp, SiLU, the product); the caller
 * checks it against the module's own on a probe before it lets the pool compute a layer.
 *
 * Kernels: AVX-512 BF16 (dot products of bfloat16 pairs into float32), else AVX2 + FMA, else
 * plain C; host_experts_kernel() names the one compiled.
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#include <time.h>

#include "mailbox_wait.h"  /* PAUSE, now_ns, SPIN_NS, next_ticket */

enum { KIND_Q4_K = 1, KIND_MXFP4 = 2 };
enum { MAX_SEGMENTS = 2, ITEM_ROWS = 32 };
/* mailbox words (int64): each hot word on a cache line of its own */
enum { W_TICKET = 0, W_DONE = 8, W_PROJECTION = 16, W_PAIRS = 17, W_TOP_K = 18, W_SLOTS = 24 };

typedef struct {
    int32_t kind;
    int64_t rows, row_bytes, first_offset, second_offset, split;
} segment_t;

typedef struct {
    int32_t segments;
    int64_t cols, rows;  /* rows: the segments' rows together, the output row's length */
    segment_t seg[MAX_SEGMENTS];
} projection_t;

typedef struct {
    projection_t up, down;  /* up: gate rows then up rows (2I); down: H rows of I columns */
    int32_t has_limit;
    float limit;  /* gate clamped to <= limit, up to [-limit, limit] (e.g. DeepSeek-V4's swiglu_limit) */
} expert_kind_t;

enum { PHASE_PROJECT = 0, PHASE_ACTIVATE = 1, ACTIVATE_CHUNK = 256 };

typedef struct pool pool_t;
typedef struct { pool_t *pool; int id; } worker_t;

struct pool {
    uint8_t *mailbox;
    int64_t max_pairs, x_offset, x_stride, out_offset, out_stride;  /* bytes; strides in elements */
    const uint8_t *host;  /* host slot 0 */
    int64_t host_slots, slot_bytes;
    expert_kind_t *kinds;
    int32_t kind_count, kind_capacity;
    uint16_t *gate_up, *hidden;  /* scratch: [max_pairs, up_stride], [max_pairs, hidden_stride] */
    int64_t up_stride, hidden_stride;
    int threads;
    pthread_t *handles;
    worker_t *workers;
    /* the phase being served: written by the leader before it publishes `job` (release) */
    int64_t job_pairs[1024], job_count, job_items, job_items_per_pair;
    int32_t job_phase;
    const expert_kind_t *job_kind;
    const projection_t *job_projection;
    const uint16_t *job_x;           /* x row of pair p: job_x + (p / job_x_div) * job_x_stride */
    int64_t job_x_div, job_x_stride;
    uint16_t *job_out;               /* output row of pair p: job_out + p * job_out_stride */
    int64_t job_out_stride;
    int64_t phase_seq;               /* the leader's count of phases */
    int64_t start_ticket;            /* the mailbox's ticket when the threads started */
    _Atomic int64_t job;        /* the phase being served (0: none yet) */
    _Atomic uint64_t claim;     /* (phase's low 32 bits) << 32 | next item */
    _Atomic int64_t finished;   /* items of the phase completed */
    _Atomic int stop;
    _Atomic int sleepers;
    pthread_mutex_t mutex;
    pthread_cond_t wake;
    /* statistics */
    _Atomic int64_t jobs, failed_jobs, busy_ns;
};

static inline volatile int64_t *word(pool_t *p, int index) { return (volatile int64_t *)p->mailbox + index; }

/* ---------------------------------------------------------------------------------------------- */
/* numbers                                                                                          */

static inline float half_to_float(const uint8_t *b) {
    const uint16_t h = (uint16_t)(b[0] | (b[1] << 8));
#ifdef __F16C__
    return _cvtsh_ss(h);
#else
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

static inline float bf16_to_float(uint16_t v) {
    union { uint32_t u; float f; } out = { .u = (uint32_t)v << 16 };
    return out.f;
}

static inline uint16_t float_to_bf16(float f) {  /* to nearest even; NaN stays NaN */
    union { float f; uint32_t u; } in = { .f = f };
    if ((in.u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((in.u >> 16) | 0x40);
    return (uint16_t)((in.u + 0x7FFFu + ((in.u >> 16) & 1u)) >> 16);
}

static inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

/* gguf-py's E8M0 scale halved (MXFP4's d): 2^(e - 128) built on the bits, subnormal below e = 2 */
static inline float e8m0_half(uint8_t e) {
    union { uint32_t u; float f; } out = { .u = e < 2 ? (0x00200000u << e) : ((uint32_t)(e - 1) << 23) };
    return out.f;
}

static const int8_t MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

static inline void q4k_scale_min(int j, const uint8_t *q, float *scale, float *min) {
    if (j < 4) {
        *scale = (float)(q[j] & 63);
        *min = (float)(q[j + 4] & 63);
    } else {
        *scale = (float)((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4));
        *min = (float)((q[j + 4] >> 4) | ((q[j] >> 6) << 4));
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* row dots: one output row, W's quantized row times x (bfloat16), float32                          */

#if defined(__AVX512BF16__) && defined(__AVX512F__) && defined(__AVX512BW__)
#define KERNEL_NAME "avx512bf16"
#define ROWS_AT_ONCE 4
/* Q4_K rows are computed four at a time: each row's sum is its own dependency chain (a dot-product
 * instruction's latency is several cycles, one chain would wait on it), and x is loaded once; MXFP4
 * rows one at a time with four chains over consecutive blocks. On an AVX-512 BF16 core, against one
 * chain a row: Q4_K 1.6x, MXFP4 1.7x (rows streamed from memory). */

/* A block's scales and mins, multiplied out: ds[s] = d * scale(s), ds[8 + s] = dmin * min(s) of sub-block s
 * (the six-bit fields unpacked four at a time, as q4k_scale_min reads them one by one) */
static inline __attribute__((always_inline)) void q4k_block_scales(const uint8_t *block, float *ds) {
    uint32_t u[4];  /* bytes: scales 0..7, then mins 0..7 */
    memcpy(u, block + 4, 12);
    u[3] = ((u[2] >> 4) & 0x0F0F0F0Fu) | (((u[1] >> 6) & 0x03030303u) << 4);  /* mins 4..7 */
    const uint32_t mins = u[1] & 0x3F3F3F3Fu;                                /* mins 0..3 */
    u[1] = (u[2] & 0x0F0F0F0Fu) | (((u[0] >> 6) & 0x03030303u) << 4);         /* scales 4..7 */
    u[2] = mins;
    u[0] &= 0x3F3F3F3Fu;                                                       /* scales 0..3 */
    const __m512 fields = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)u)));  /* [16] */
    const __m512 factor = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(half_to_float(block)),
                                               _mm512_set1_ps(half_to_float(block + 2)));
    _mm512_storeu_ps(ds, _mm512_mul_ps(fields, factor));
}

/* A sub-block's 32 weights take 16 values: ds * q - dm for q = 0..15. Both sub-blocks of a 32-byte
 * chunk (2j low nibbles, 2j+1 high) are dequantized as a table of 32 bf16 words (the same multiply,
 * subtract and rounding as weight by weight, done once per value), then looked up by nibble. */
static inline __attribute__((always_inline)) __m512 q4k_chunk(__m512 acc, const uint8_t *qs, const float *ds,
                                                               __m512bh x_low, __m512bh x_high) {
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i low = _mm512_set1_epi16(0xF), high = _mm512_set1_epi16(16);
    const __m512 first = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(ds[0])), _mm512_set1_ps(ds[8]));
    const __m512 second = _mm512_sub_ps(_mm512_mul_ps(iota, _mm512_set1_ps(ds[1])), _mm512_set1_ps(ds[9]));
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(second, first);  /* words 0..15: 2j's, 16..31: 2j+1's */
    const __m512i q = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)qs));  /* [32] bytes as words */
    const __m512i w_low = _mm512_permutexvar_epi16(_mm512_and_si512(q, low), table);
    const __m512i w_high = _mm512_permutexvar_epi16(_mm512_or_si512(_mm512_srli_epi16(q, 4), high), table);
    acc = _mm512_dpbf16_ps(acc, (__m512bh)w_low, x_low);
    return _mm512_dpbf16_ps(acc, (__m512bh)w_high, x_high);
}

/* out[i] = rows[i] . x for i < n, n a constant at each call (the loops over rows unroll) */
static inline __attribute__((always_inline)) void q4k_rows_n(const uint8_t *const *rows, int n, int64_t cols,
                                                              const uint16_t *x, float *out) {
    __m512 acc[ROWS_AT_ONCE];
#pragma GCC unroll 4
    for (int i = 0; i < n; i++) acc[i] = _mm512_setzero_ps();
    for (int64_t b = 0; b < cols / 256; b++) {  /* blocks of [144] bytes: d, dmin, scales[12], qs[128] */
        float ds[ROWS_AT_ONCE][16];
#pragma GCC unroll 4
        for (int i = 0; i < n; i++) q4k_block_scales(rows[i] + b * 144, ds[i]);
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {  /* 64 weights a chunk */
            const __m512bh x_low = (__m512bh)_mm512_loadu_si512(x + b * 256 + 64 * j);
            const __m512bh x_high = (__m512bh)_mm512_loadu_si512(x + b * 256 + 64 * j + 32);
#pragma GCC unroll 4
            for (int i = 0; i < n; i++)
                acc[i] = q4k_chunk(acc[i], rows[i] + b * 144 + 16 + 32 * j, ds[i] + 2 * j, x_low, x_high);
        }
    }
#pragma GCC unroll 4
    for (int i = 0; i < n; i++) out[i] = _mm512_reduce_add_ps(acc[i]);
}

/* MXFP4_VALUES as bfloat16 bits (exact: small integers), padded to a 32-word table */
static const uint16_t MXFP4_BF16[32] = {0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40C0, 0x4100, 0x4140,
                                        0x0000, 0xBF80, 0xC000, 0xC040, 0xC080, 0xC0C0, 0xC100, 0xC140};

/* 32 MXFP4 weights as bf16, looked up by nibble */
static inline __attribute__((always_inline)) __m512bh mxfp4_weights(const uint8_t *qs) {
    const __m512i table = _mm512_loadu_si512(MXFP4_BF16);
    const __m256i q = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)qs));  /* [16] bytes as words */
    const __m512i nibbles = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_and_si256(q, _mm256_set1_epi16(0xF))),
                                               _mm256_srli_epi16(q, 4), 1);  /* low nibbles: 0..15, high: 16..31 */
    return (__m512bh)_mm512_permutexvar_epi16(nibbles, table);
}

/* One row: four sums over consecutive blocks (each block's partial sum waits on its own chain only).
 * Rows go one at a time: read several at once, MXFP4's rows (17-byte blocks) came slower from memory. */
static float mxfp4_row(const uint8_t *row, int64_t cols, const uint16_t *x) {
    __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    const int64_t blocks = cols / 32;  /* blocks of [17] bytes: e, qs[16] */
    for (int64_t b = 0; b < blocks; b += 4) {
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            if (b + i < blocks) {
                const uint8_t *block = row + (b + i) * 17;
                const __m512 part = _mm512_dpbf16_ps(_mm512_setzero_ps(), mxfp4_weights(block + 1),
                                                     (__m512bh)_mm512_loadu_si512(x + (b + i) * 32));
                acc[i] = _mm512_fmadd_ps(part, _mm512_set1_ps(e8m0_half(block[0])), acc[i]);  /* exact: d is 2^k */
            }
        }
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(acc[0], acc[1]), _mm512_add_ps(acc[2], acc[3])));
}

static void q4k_rows(const uint8_t *const *rows, int n, int64_t cols, const uint16_t *x, float *out) {
    switch (n) {
    case 4: q4k_rows_n(rows, 4, cols, x, out); break;
    case 3: q4k_rows_n(rows, 3, cols, x, out); break;
    case 2: q4k_rows_n(rows, 2, cols, x, out); break;
    default: q4k_rows_n(rows, 1, cols, x, out); break;
    }
}

static void mxfp4_rows(const uint8_t *const *rows, int n, int64_t cols, const uint16_t *x, float *out) {
    for (int i = 0; i < n; i++) out[i] = mxfp4_row(rows[i], cols, x);
}
#elif defined(__AVX2__) && defined(__FMA__)
#define KERNEL_NAME "avx2"
static inline __m256 x8(const uint16_t *x) {  /* 8 bfloat16 as float32 */
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)x)), 16));
}

static inline __m256 round8(__m256 w) {  /* to bfloat16 and back, to nearest even (finite weights) */
    __m256i bits = _mm256_castps_si256(w);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    bits = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    return _mm256_castsi256_ps(_mm256_and_si256(bits, _mm256_set1_epi32((int)0xFFFF0000u)));
}

static inline __m256 q4k_product(const uint8_t *q, int shift, __m256 ds, __m256 dm, const uint16_t *x, __m256 acc) {
    __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)q));
    v = _mm256_and_si256(_mm256_srli_epi32(v, shift), _mm256_set1_epi32(0xF));
    const __m256 w = round8(_mm256_sub_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(v), ds), dm));
    return _mm256_fmadd_ps(w, x8(x), acc);
}

static inline float sum8(__m256 v) {
    __m128 h = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    h = _mm_add_ps(h, _mm_movehl_ps(h, h));
    return _mm_cvtss_f32(_mm_add_ss(h, _mm_movehdup_ps(h)));
}

static float q4k_row(const uint8_t *row, int64_t cols, const uint16_t *x) {
    __m256 acc = _mm256_setzero_ps(), acc2 = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 256; b++) {
        const uint8_t *block = row + b * 144;
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        const uint8_t *scales = block + 4, *qs = block + 16;
        const uint16_t *xb = x + b * 256;
        for (int j = 0; j < 4; j++, qs += 32, xb += 64) {
            float s1, m1, s2, m2;
            q4k_scale_min(2 * j, scales, &s1, &m1);
            q4k_scale_min(2 * j + 1, scales, &s2, &m2);
            const __m256 ds1 = _mm256_set1_ps(d * s1), dm1 = _mm256_set1_ps(dmin * m1);
            const __m256 ds2 = _mm256_set1_ps(d * s2), dm2 = _mm256_set1_ps(dmin * m2);
            for (int l = 0; l < 32; l += 8) {  /* two sums: each waits on its own FMAs only */
                acc = q4k_product(qs + l, 0, ds1, dm1, xb + l, acc);
                acc2 = q4k_product(qs + l, 4, ds2, dm2, xb + 32 + l, acc2);
            }
        }
    }
    return sum8(_mm256_add_ps(acc, acc2));
}

static float mxfp4_row(const uint8_t *row, int64_t cols, const uint16_t *x) {
    const __m128i table = _mm_loadu_si128((const __m128i *)MXFP4_VALUES);
    __m256 acc = _mm256_setzero_ps();
    for (int64_t b = 0; b < cols / 32; b++) {
        const uint8_t *block = row + b * 17;
        const __m128i bytes = _mm_loadu_si128((const __m128i *)(block + 1));
        const __m128i lo = _mm_shuffle_epi8(table, _mm_and_si128(bytes, _mm_set1_epi8(0xF)));
        const __m128i hi = _mm_shuffle_epi8(table, _mm_and_si128(_mm_srli_epi16(bytes, 4), _mm_set1_epi8(0xF)));
        const uint16_t *xb = x + b * 32;
        __m256 part = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(lo)), x8(xb));
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(lo, 8))), x8(xb + 8), part);
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(hi)), x8(xb + 16), part);
        part = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(hi, 8))), x8(xb + 24), part);
        acc = _mm256_fmadd_ps(part, _mm256_set1_ps(e8m0_half(block[0])), acc);
    }
    return sum8(acc);
}
#else
#define KERNEL_NAME "portable"
static float q4k_row(const uint8_t *row, int64_t cols, const uint16_t *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < cols / 256; b++) {
        const uint8_t *block = row + b * 144;
        const float d = half_to_float(block), dmin = half_to_float(block + 2);
        const uint8_t *scales = block + 4, *qs = block + 16;
        const uint16_t *xb = x + b * 256;
        for (int j = 0; j < 4; j++, qs += 32, xb += 64) {
            float s1, m1, s2, m2;
            q4k_scale_min(2 * j, scales, &s1, &m1);
            q4k_scale_min(2 * j + 1, scales, &s2, &m2);
            const float ds1 = d * s1, dm1 = dmin * m1, ds2 = d * s2, dm2 = dmin * m2;
            for (int l = 0; l < 32; l++) {
                acc += round_bf16((float)(qs[l] & 0xF) * ds1 - dm1) * bf16_to_float(xb[l]);
                acc += round_bf16((float)(qs[l] >> 4) * ds2 - dm2) * bf16_to_float(xb[32 + l]);
            }
        }
    }
    return acc;
}

static float mxfp4_row(const uint8_t *row, int64_t cols, const uint16_t *x) {
    float acc = 0.0f;
    for (int64_t b = 0; b < cols / 32; b++) {
        const uint8_t *block = row + b * 17;
        float part = 0.0f;
        for (int l = 0; l < 16; l++) {
            part += (float)MXFP4_VALUES[block[1 + l] & 0xF] * bf16_to_float(x[b * 32 + l]);
            part += (float)MXFP4_VALUES[block[1 + l] >> 4] * bf16_to_float(x[b * 32 + 16 + l]);
        }
        acc += part * e8m0_half(block[0]);
    }
    return acc;
}
#endif

#ifndef ROWS_AT_ONCE
#define ROWS_AT_ONCE 1
static void q4k_rows(const uint8_t *const *rows, int n, int64_t cols, const uint16_t *x, float *out) {
    for (int i = 0; i < n; i++) out[i] = q4k_row(rows[i], cols, x);
}

static void mxfp4_rows(const uint8_t *const *rows, int n, int64_t cols, const uint16_t *x, float *out) {
    for (int i = 0; i < n; i++) out[i] = mxfp4_row(rows[i], cols, x);
}
#endif

const char *host_experts_kernel(void) { return KERNEL_NAME; }

/* output row n of `projection` in `object`: its bytes and its segment's element kind */
static inline const uint8_t *projection_row(const projection_t *projection, const uint8_t *object, int64_t n,
                                            int32_t *kind) {
    const segment_t *seg = projection->seg;
    while (n >= seg->rows) {  /* the segment holding output row n */
        n -= seg->rows;
        seg++;
    }
    *kind = seg->kind;
    return object + (n < seg->split ? seg->first_offset + n * seg->row_bytes
                                    : seg->second_offset + (n - seg->split) * seg->row_bytes);
}

/* rows [first, first + count) of `projection` for one object, x one row of cols bfloat16; rows of
 * one element kind go to the kernels ROWS_AT_ONCE at a time */
static void project_rows(const projection_t *projection, const uint8_t *object, const uint16_t *x,
                         int64_t first, int64_t count, uint16_t *out) {
    const int64_t end = first + count < projection->rows ? first + count : projection->rows;
    for (int64_t n = first; n < end;) {
        const uint8_t *rows[ROWS_AT_ONCE];
        int32_t kind, next_kind;
        rows[0] = projection_row(projection, object, n, &kind);
        int group = 1;
        while (group < ROWS_AT_ONCE && n + group < end) {
            const uint8_t *row = projection_row(projection, object, n + group, &next_kind);
            if (next_kind != kind) break;
            rows[group++] = row;
        }
        float y[ROWS_AT_ONCE];
        if (kind == KIND_Q4_K) q4k_rows(rows, group, projection->cols, x, y);
        else mxfp4_rows(rows, group, projection->cols, x, y);
        for (int i = 0; i < group; i++) out[n + i] = float_to_bf16(y[i]);
        n += group;
    }
}

/* ---------------------------------------------------------------------------------------------- */
/* the pool                                                                                         */

/* SiLU(gate) * up of one element, rounded where torch's bfloat16 ops round */
static inline uint16_t activate_one(const expert_kind_t *kind, uint16_t gate, uint16_t up) {
    float g = bf16_to_float(gate), u = bf16_to_float(up);
    if (kind->has_limit) {
        g = round_bf16(g < kind->limit ? g : kind->limit);
        u = round_bf16(u < kind->limit ? (u > -kind->limit ? u : -kind->limit) : kind->limit);
    }
    const float silu = round_bf16(g / (1.0f + expf(-g)));
    return float_to_bf16(silu * u);
}

/* hidden[0, n) from a gate/up row of 2n: gate first, up second */
static void activate_row(const expert_kind_t *kind, const uint16_t *gate_up, int64_t n, int64_t first, int64_t count,
                         uint16_t *hidden) {
    for (int64_t i = first; i < first + count && i < n; i++) hidden[i] = activate_one(kind, gate_up[i], gate_up[n + i]);
}

/* Item i of the phase: rows (or activations) [ITEM_ROWS * (i % per_pair), ...) of the (i / per_pair)-th pair. */
static void run_item(pool_t *p, int64_t item) {
    const int64_t pair = p->job_pairs[item / p->job_items_per_pair];
    const int64_t part = item % p->job_items_per_pair;
    const uint16_t *x = p->job_x + (pair / p->job_x_div) * p->job_x_stride;
    uint16_t *out = p->job_out + pair * p->job_out_stride;
    if (p->job_phase == PHASE_ACTIVATE) {
        activate_row(p->job_kind, x, p->job_kind->down.cols, part * ACTIVATE_CHUNK, ACTIVATE_CHUNK, out);
        return;
    }
    const int64_t slot = word(p, W_SLOTS)[pair];
    project_rows(p->job_projection, p->host + slot * p->slot_bytes, x, part * ITEM_ROWS, ITEM_ROWS, out);
}

/* Claim and run items of phase `job` until none is left (or another phase began). */
static void serve(pool_t *p, int64_t job) {
    const uint64_t tag = (uint64_t)(uint32_t)job << 32;
    for (;;) {
        uint64_t claim = atomic_load_explicit(&p->claim, memory_order_acquire);
        if ((claim & 0xFFFFFFFF00000000ull) != tag || (int64_t)(claim & 0xFFFFFFFFu) >= p->job_items) return;
        if (!atomic_compare_exchange_weak_explicit(&p->claim, &claim, claim + 1, memory_order_acq_rel,
                                                   memory_order_relaxed))
            continue;
        run_item(p, (int64_t)(claim & 0xFFFFFFFFu));
        atomic_fetch_add_explicit(&p->finished, 1, memory_order_acq_rel);
    }
}

/* Read the job from the mailbox; 0 when it is malformed (then nothing is computed). */
static int prepare(pool_t *p) {
    const int64_t kind = word(p, W_PROJECTION)[0], pairs = word(p, W_PAIRS)[0], top_k = word(p, W_TOP_K)[0];
    if (kind < 0 || kind >= p->kind_count || pairs < 0 || pairs > p->max_pairs || top_k < 1) return 0;
    int64_t count = 0;
    for (int64_t i = 0; i < pairs; i++) {
        const int64_t slot = word(p, W_SLOTS)[i];
        if (slot < 0) continue;
        if (slot >= p->host_slots) return 0;
        p->job_pairs[count++] = i;
    }
    p->job_kind = &p->kinds[kind];
    p->job_count = count;
    return 1;
}

/* One phase over the job's pairs, shared with the threads; returns once every item is done. */
static void run_phase(pool_t *p, int32_t phase, const projection_t *projection, const uint16_t *x, int64_t x_div,
                      int64_t x_stride, uint16_t *out, int64_t out_stride) {
    p->job_phase = phase;
    p->job_projection = projection;
    p->job_x = x;
    p->job_x_div = x_div;
    p->job_x_stride = x_stride;
    p->job_out = out;
    p->job_out_stride = out_stride;
    const int64_t length = phase == PHASE_ACTIVATE ? p->job_kind->down.cols : projection->rows;
    const int64_t chunk = phase == PHASE_ACTIVATE ? ACTIVATE_CHUNK : ITEM_ROWS;
    p->job_items_per_pair = (length + chunk - 1) / chunk;
    p->job_items = p->job_count * p->job_items_per_pair;
    const int64_t seq = ++p->phase_seq;
    atomic_store_explicit(&p->finished, 0, memory_order_relaxed);
    atomic_store_explicit(&p->claim, (uint64_t)(uint32_t)seq << 32, memory_order_release);
    atomic_store_explicit(&p->job, seq, memory_order_release);
    if (atomic_load(&p->sleepers) > 0) {
        pthread_mutex_lock(&p->mutex);
        pthread_cond_broadcast(&p->wake);
        pthread_mutex_unlock(&p->mutex);
    }
    serve(p, seq);
    while (atomic_load_explicit(&p->finished, memory_order_acquire) < p->job_items) PAUSE();
}

static void run_job(pool_t *p) {
    const expert_kind_t *kind = p->job_kind;
    const uint16_t *x = (const uint16_t *)(p->mailbox + p->x_offset);
    uint16_t *out = (uint16_t *)(p->mailbox + p->out_offset);
    run_phase(p, PHASE_PROJECT, &kind->up, x, word(p, W_TOP_K)[0], p->x_stride, p->gate_up, p->up_stride);
    run_phase(p, PHASE_ACTIVATE, NULL, p->gate_up, 1, p->up_stride, p->hidden, p->hidden_stride);
    run_phase(p, PHASE_PROJECT, &kind->down, p->hidden, 1, p->hidden_stride, out, p->out_stride);
}

static void lead(pool_t *p) {
    int64_t last = p->start_ticket, idle_since = now_ns();
    for (;;) {
        const int64_t ticket = next_ticket(word(p, W_TICKET), last, idle_since, &p->stop);
        if (ticket == last) return;  /* stopped */
        const int64_t started = now_ns();
        last = ticket;
        if (!prepare(p)) {
            atomic_fetch_add(&p->failed_jobs, 1);
            __atomic_store_n(word(p, W_DONE), -ticket, __ATOMIC_RELEASE);
            idle_since = now_ns();
            continue;
        }
        run_job(p);
        /* counted before `done` is published: a caller that has seen its job end reads it counted */
        idle_since = now_ns();
        atomic_fetch_add(&p->jobs, 1);
        atomic_fetch_add(&p->busy_ns, idle_since - started);
        __atomic_store_n(word(p, W_DONE), ticket, __ATOMIC_RELEASE);
    }
}

static void *thread_main(void *arg) {
    worker_t *self = arg;
    pool_t *p = self->pool;
    if (self->id == 0) {
        lead(p);
        return NULL;
    }
    int64_t last = atomic_load(&p->job), idle_since = now_ns();
    while (!atomic_load_explicit(&p->stop, memory_order_relaxed)) {
        const int64_t job = atomic_load_explicit(&p->job, memory_order_acquire);
        if (job != last) {
            last = job;
            serve(p, job);
            idle_since = now_ns();
        } else if (now_ns() - idle_since > SPIN_NS) {
            pthread_mutex_lock(&p->mutex);
            atomic_fetch_add(&p->sleepers, 1);
            if (atomic_load(&p->job) == last && !atomic_load(&p->stop)) {
                struct timespec until;
                clock_gettime(CLOCK_REALTIME, &until);
                until.tv_nsec += 100000000;
                if (until.tv_nsec >= 1000000000) { until.tv_sec++; until.tv_nsec -= 1000000000; }
                pthread_cond_timedwait(&p->wake, &p->mutex, &until);
            }
            atomic_fetch_sub(&p->sleepers, 1);
            pthread_mutex_unlock(&p->mutex);
            idle_since = now_ns();
        } else {
            PAUSE();
        }
    }
    return NULL;
}

pool_t *host_experts_create(uint8_t *mailbox, int64_t max_pairs, int64_t x_offset, int64_t x_stride,
                            int64_t out_offset, int64_t out_stride, const uint8_t *host, int64_t host_slots,
                            int64_t slot_bytes) {
    if (max_pairs < 1 || max_pairs > 1024) return NULL;
    pool_t *p = calloc(1, sizeof(pool_t));
    if (p == NULL) return NULL;
    p->mailbox = mailbox;
    p->max_pairs = max_pairs;
    p->x_offset = x_offset;
    p->x_stride = x_stride;
    p->out_offset = out_offset;
    p->out_stride = out_stride;
    p->host = host;
    p->host_slots = host_slots;
    p->slot_bytes = slot_bytes;
    pthread_mutex_init(&p->mutex, NULL);
    pthread_cond_init(&p->wake, NULL);
    return p;
}

static int make_projection(projection_t *projection, int32_t segments, const int32_t *kinds, const int64_t *rows,
                           const int64_t *row_bytes, const int64_t *first_offsets, const int64_t *second_offsets,
                           const int64_t *splits, int64_t cols) {
    if (segments < 1 || segments > MAX_SEGMENTS || cols < 1) return 0;
    *projection = (projection_t){.segments = segments, .cols = cols, .rows = 0};
    for (int i = 0; i < segments; i++) {
        const int64_t block = kinds[i] == KIND_Q4_K ? 256 : kinds[i] == KIND_MXFP4 ? 32 : 0;
        if (block == 0 || cols % block || rows[i] < 1 || splits[i] < 0 || splits[i] > rows[i]) return 0;
        projection->seg[i] = (segment_t){kinds[i], rows[i], row_bytes[i], first_offsets[i], second_offsets[i], splits[i]};
        projection->rows += rows[i];
    }
    return 1;
}

/* Register an expert kind (before start): segments [0, up_segments) make the gate/up projection
 * (hidden columns), the last one the down projection (intermediate columns); has_limit/limit the
 * activation's clamp. Its id, or -1 when malformed. */
int32_t host_experts_add_kind(pool_t *p, int32_t up_segments, const int32_t *kinds, const int64_t *rows,
                              const int64_t *row_bytes, const int64_t *first_offsets, const int64_t *second_offsets,
                              const int64_t *splits, int64_t hidden, int64_t intermediate, int32_t has_limit,
                              float limit) {
    expert_kind_t kind = {.has_limit = has_limit, .limit = limit};
    const int u = up_segments;
    if (p->handles != NULL ||
        !make_projection(&kind.up, u, kinds, rows, row_bytes, first_offsets, second_offsets, splits, hidden) ||
        !make_projection(&kind.down, 1, kinds + u, rows + u, row_bytes + u, first_offsets + u, second_offsets + u,
                         splits + u, intermediate) ||
        kind.up.rows != 2 * intermediate || kind.down.rows != hidden || hidden > p->x_stride ||
        hidden > p->out_stride)
        return -1;
    if (kind.up.rows > p->up_stride || intermediate > p->hidden_stride) {  /* grow the scratch */
        const int64_t up_stride = kind.up.rows > p->up_stride ? kind.up.rows : p->up_stride;
        const int64_t hidden_stride = intermediate > p->hidden_stride ? intermediate : p->hidden_stride;
        uint16_t *gate_up = calloc((size_t)(p->max_pairs * up_stride), sizeof(uint16_t));
        uint16_t *act = calloc((size_t)(p->max_pairs * hidden_stride), sizeof(uint16_t));
        if (gate_up == NULL || act == NULL) { free(gate_up); free(act); return -1; }
        free(p->gate_up);
        free(p->hidden);
        p->gate_up = gate_up;
        p->hidden = act;
        p->up_stride = up_stride;
        p->hidden_stride = hidden_stride;
    }
    if (p->kind_count == p->kind_capacity) {
        const int32_t capacity = p->kind_capacity ? 2 * p->kind_capacity : 16;
        expert_kind_t *grown = realloc(p->kinds, (size_t)capacity * sizeof(expert_kind_t));
        if (grown == NULL) return -1;
        p->kinds = grown;
        p->kind_capacity = capacity;
    }
    p->kinds[p->kind_count] = kind;
    return p->kind_count++;
}

/* The activation of `rows` gate/up rows of kind `id` on the calling thread (the caller's check
 * of it against the module's own); -1 for an unknown kind. */
int host_experts_activate(pool_t *p, int32_t id, int64_t rows, const uint16_t *gate_up, uint16_t *hidden) {
    if (id < 0 || id >= p->kind_count) return -1;
    const expert_kind_t *kind = &p->kinds[id];
    const int64_t n = kind->down.cols;
    for (int64_t r = 0; r < rows; r++) activate_row(kind, gate_up + r * 2 * n, n, 0, n, hidden + r * n);
    return 0;
}

int host_experts_start(pool_t *p, int threads) {
    if (p->handles != NULL || threads < 1) return -1;
    /* read here, not by the leader once it runs: a job posted before that must still be served */
    p->start_ticket = __atomic_load_n(word(p, W_TICKET), __ATOMIC_ACQUIRE);
    p->handles = calloc((size_t)threads, sizeof(pthread_t));
    p->workers = calloc((size_t)threads, sizeof(worker_t));
    if (p->handles == NULL || p->workers == NULL) return -1;
    p->threads = threads;
    for (int i = 0; i < threads; i++) {
        p->workers[i] = (worker_t){p, i};
        if (pthread_create(&p->handles[i], NULL, thread_main, &p->workers[i]) != 0) {
            atomic_store(&p->stop, 1);
            for (int j = 0; j < i; j++) pthread_join(p->handles[j], NULL);
            p->threads = 0;
            return -1;
        }
    }
    return 0;
}

/* jobs served, jobs refused (malformed), nanoseconds the leader spent serving */
void host_experts_stats(pool_t *p, int64_t *out) {
    out[0] = atomic_load(&p->jobs);
    out[1] = atomic_load(&p->failed_jobs);
    out[2] = atomic_load(&p->busy_ns);
}

void host_experts_destroy(pool_t *p) {
    if (p == NULL) return;
    atomic_store(&p->stop, 1);
    pthread_mutex_lock(&p->mutex);
    pthread_cond_broadcast(&p->wake);
    pthread_mutex_unlock(&p->mutex);
    for (int i = 0; i < p->threads; i++) pthread_join(p->handles[i], NULL);
    free(p->handles);
    free(p->workers);
    free(p->kinds);
    free(p->gate_up);
    free(p->hidden);
    pthread_mutex_destroy(&p->mutex);
    pthread_cond_destroy(&p->wake);
    free(p);
}
