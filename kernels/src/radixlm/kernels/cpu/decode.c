/* A step through a Llama-like model's decoder layers in one call (the products and the
 * attention groups split over pool.c's threads, the rest on the caller's): a
 * decode's few rows, or with weights in panels a whole prefill chunk's (each new token a row
 * with its own length): per layer RMSNorm, the q/k/v projection, per-head q/k RMSNorm (Qwen3),
 * the rotary embedding, the new token's K/V written into the pool, attention over each
 * request's cached keys (a sliding window when the layer has one), the output projection,
 * the residual, RMSNorm, gate/up, SiLU x up, the down projection and the residual.
 *
 * The projections are gemv.c's int4 and int8 products (the same arithmetic as the per-layer
 * path: activations rounded to int8 per block of 32 columns) or its float32 one (or panels.c's,
 * for a float32 weight laid out in panels); everything
 * else is float32, in the order the torch path computes it. What this saves is the Python and operator
 * dispatch of the ~60 torch operations per layer a decode step otherwise runs, which on a
 * small model costs more than the products themselves.
 *
 * K/V pools: float32 [slots, kv_heads, head_dim] per layer. Request m's keys are the slots
 * `table[rows[m] * table_stride + i]` for i < lengths[m] (its new token last, already in the
 * table); the new token's K/V go to `out_slots[m]`.
 */
#include <math.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLM_AVX2 1
#endif

int radixlm_int4_gemv(const float *x, int m_rows, int k, const uint8_t *qweight,
                      const float *scales, const float *zeros, int n, int group, float *out);
int radixlm_int8_gemv(const float *x, int m_rows, int k, const int8_t *weight,
                      const float *scales, int n, int group, float *out);
int radixlm_f32_gemv(const float *x, int m_rows, int k, const float *weight, int n, float *out);
int radixlm_f32_panels(const float *x, int m_rows, int k, const float *panels, int n,
                       float *out);

/* LINEAR_F32: a row-major float32 weight; LINEAR_F32_PANELS: one in panels (panels.c) */
enum { LINEAR_INT4 = 1, LINEAR_INT8 = 2, LINEAR_F32 = 3, LINEAR_F32_PANELS = 4 };

typedef struct {
    int32_t kind, n, k, group;
    const void *weight;
    const float *scales, *zeros, *bias; /* scales: int4/int8; zeros: int4; bias may be NULL */
} RlmLinear;

typedef struct {
    const float *input_norm, *post_norm; /* [hidden] */
    const float *q_norm, *k_norm;        /* [head_dim], or NULL */
    RlmLinear qkv, o, gate_up, down;
    float *k_pool, *v_pool;
    int32_t window; /* keys attended per token; 0: all */
    int32_t pad;
} RlmLayer;

typedef struct {
    int32_t hidden, heads, kv_heads, head_dim, intermediate, layers;
    float eps, scaling;
    /* 1: every row's attention takes the same operations whatever the rows beside it
     * (batch-invariant inference); 0: long groups of rows (a prefill) take attend_wide512 */
    int32_t invariant;
} RlmShape;

static int linear(const RlmLinear *l, const float *x, int m_rows, float *out) {
    int code;
    if (l->kind == LINEAR_INT4)
        code = radixlm_int4_gemv(x, m_rows, l->k, (const uint8_t *)l->weight, l->scales, l->zeros,
                                 l->n, l->group, out);
    else if (l->kind == LINEAR_INT8)
        code = radixlm_int8_gemv(x, m_rows, l->k, (const int8_t *)l->weight, l->scales, l->n,
                                 l->group, out);
    else if (l->kind == LINEAR_F32)
        code = radixlm_f32_gemv(x, m_rows, l->k, (const float *)l->weight, l->n, out);
    else if (l->kind == LINEAR_F32_PANELS)
        code = radixlm_f32_panels(x, m_rows, l->k, (const float *)l->weight, l->n, out);
    else
        return -1;
    if (code || !l->bias) return code;
    for (int m = 0; m < m_rows; m++)
        for (int j = 0; j < l->n; j++) out[(size_t)m * l->n + j] += l->bias[j];
    return 0;
}

static inline float dot(const float *a, const float *b, int n) {
    int i = 0;
    float total = 0.0f;
#ifdef RADIXLM_AVX2
    __m256 acc = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    for (; i + 16 <= n; i += 16) {
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), acc1);
    }
    acc = _mm256_add_ps(acc, acc1);
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    total = _mm_cvtss_f32(lo);
#endif
    for (; i < n; i++) total += a[i] * b[i];
    return total;
}

/* y += a * x */
static inline void axpy(float a, const float *x, float *y, int n) {
    int i = 0;
#ifdef RADIXLM_AVX2
    __m256 va = _mm256_set1_ps(a);
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(y + i, _mm256_fmadd_ps(va, _mm256_loadu_ps(x + i), _mm256_loadu_ps(y + i)));
#endif
    for (; i < n; i++) y[i] += a * x[i];
}

/* out = x / rms(x) * weight (x and out may be the same) */
static void rms_norm(const float *x, const float *weight, int n, float eps, float *out) {
    float inv = 1.0f / sqrtf(dot(x, x, n) / (float)n + eps);
    for (int i = 0; i < n; i++) out[i] = weight[i] * (x[i] * inv);
}

/* x = x * cos + swap_halves(x) * signed_sin (the rotate-half layout of models/rope.py) */
static void rotate(float *x, const float *cos, const float *sin, int dim) {
    int half = dim / 2;
    for (int i = 0; i < half; i++) {
        float a = x[i], b = x[half + i];
        x[i] = a * cos[i] + b * sin[i];
        x[half + i] = b * cos[half + i] + a * sin[half + i];
    }
}

#ifdef RADIXLM_AVX2
/* e^x for x <= 88 (a softmax's x <= 0): x = n ln2 + r, |r| <= ln2 / 2, e^r by its degree-7
 * Taylor-like minimax polynomial (Cephes' expf coefficients), 2^n put in the exponent bits;
 * below -87 the result is the smallest normal float instead of tending to 0. About 1 ulp. */
static inline __m256 exp256(__m256 x) {
    x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

/* x[i] = e^(x[i] - max x) in place; returns their sum. */
static float softmax_numerators(float *x, int n) {
    float top = -INFINITY, total = 0.0f;
    int i = 0;
#ifdef RADIXLM_AVX2
    /* the largest, sixteen at a time in two vectors (one at a time, each compare waiting
     * on the last, was about a tenth of a decode row's attention over 300 keys) */
    __m256 most = _mm256_set1_ps(-INFINITY), most1 = most;
    for (; i + 16 <= n; i += 16) {
        most = _mm256_max_ps(_mm256_loadu_ps(x + i), most);
        most1 = _mm256_max_ps(_mm256_loadu_ps(x + i + 8), most1);
    }
    float tops[8];
    _mm256_storeu_ps(tops, _mm256_max_ps(most, most1));
    for (int j = 0; j < 8; j++) top = tops[j] > top ? tops[j] : top;
#endif
    for (; i < n; i++) top = x[i] > top ? x[i] : top;
    i = 0;
#ifdef RADIXLM_AVX2
    __m256 shift = _mm256_set1_ps(top), sum = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), shift));
        _mm256_storeu_ps(x + i, e);
        sum = _mm256_add_ps(sum, e);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, sum);
    for (int j = 0; j < 8; j++) total += lanes[j];
#endif
    for (; i < n; i++) {
        x[i] = expf(x[i] - top);
        total += x[i];
    }
    return total;
}

/* Asks for the cache lines of `floats` floats from `row`. */
static inline void prefetch_row(const float *row, int floats) {
    const char *bytes = (const char *)row;
    for (int off = 0; off < floats * (int)sizeof(float); off += 64) __builtin_prefetch(bytes + off);
}

/* The same into L2 (prefetcht1), not L1: a decode's passes over its keys and values keep
 * DECODE_AHEAD rows asked for. Into L1 each request holds one of the core's few L1 miss
 * buffers until its line arrives, and the pass's own loads waited behind them. SmolLM2's 8
 * requests x 300 keys x 30 layers (one thread, an AVX-512 EPYC, an ad hoc harness): with
 * attend_group512, 7.8 ms with 6 rows into L1, 5.0 with no prefetch, 4.8 with 8 rows into
 * L2, and with each request's keys scattered through the pool (as decode steps place them)
 * 9.3, 12.4 and 7.0 ms; with attend_any (built for AVX2) 6.5, 8.8 and 4.8 ms, scattered
 * 10.7, 11.5 and 7.6 ms. */
#define DECODE_AHEAD 8
static inline void prefetch_row_l2(const float *row, int floats) {
    const char *bytes = (const char *)row;
    for (int off = 0; off < floats * (int)sizeof(float); off += 64) __builtin_prefetch(bytes + off, 0, 2);
}

/* Every query head of one request (q and out [heads, head_dim]) over its keys first ..
 * length - 1: out = softmax(q . k * scaling) . v. One pass over the keys' rows (all KV heads
 * of a slot are contiguous), the row a few slots ahead prefetched: the slots are scattered
 * through the pool, and the loads would otherwise wait on memory one row at a time.
 * `scores` holds heads x (length - first) floats; `totals` heads. */
static void attend_any(const float *q, int heads, int per_kv, const float *k_pool, const float *v_pool,
                   const int32_t *slots, int first, int length, int stride, int head_dim,
                   float scaling, float *scores, float *totals, float *out) {
    const int ahead = DECODE_AHEAD;
    int n = length - first;
    slots += first;
    for (int i = 0; i < n; i++) {
        if (i + ahead < n) prefetch_row_l2(k_pool + (size_t)slots[i + ahead] * stride, stride);
        const float *row = k_pool + (size_t)slots[i] * stride;
        for (int h = 0; h < heads; h++)
            scores[h * n + i] = dot(q + h * head_dim, row + (h / per_kv) * head_dim, head_dim) * scaling;
    }
    for (int h = 0; h < heads; h++) totals[h] = softmax_numerators(scores + h * n, n);
    memset(out, 0, sizeof(float) * heads * head_dim);
    for (int i = 0; i < n; i++) {
        if (i + ahead < n) prefetch_row_l2(v_pool + (size_t)slots[i + ahead] * stride, stride);
        const float *row = v_pool + (size_t)slots[i] * stride;
        for (int h = 0; h < heads; h++)
            axpy(scores[h * n + i], row + (h / per_kv) * head_dim, out + h * head_dim, head_dim);
    }
    for (int h = 0; h < heads; h++) {
        float inv = 1.0f / totals[h];
        for (int d = 0; d < head_dim; d++) out[h * head_dim + d] *= inv;
    }
}

/* The most rows of one request attended together (attend_group512; attend_wide512 takes up
 * to WIDE_ROWS, as many as keep their scores within WIDE_SCORES floats: see wide_rows). */
#define MAX_GROUP 16
#define WIDE_ROWS 64
#define WIDE_SCORES (1 << 18)
/* Keys in a tile of attend_wide512's scores: WIDE_KEYS keys x up to three blocks of sixteen
 * query vectors, 24 sums in registers. (Outside the AVX-512 code: the scratch sizes use it on
 * every CPU.) */
#define WIDE_KEYS 8

#ifdef __AVX512F__
/* attend_group512's values, rows r (their weights in `scores`, r x heads x (hi - lo), and the
 * inverses of their totals in `inv`) over keys lo .. hi - 1: one sweep over the keys, each
 * key's row (all its KV heads) read once, in full, for every row and query head, the sums
 * kept in `out` (zeroed first; in L1). Measured in an ad hoc harness on SmolLM2's shapes (8
 * requests x 300 keys x 30 layers, one thread, an AVX-512 EPYC): sweeping once per KV head
 * instead, each sweep reading a part of every row, the values alone took 4.5 ms (12 GB/s)
 * against 1.7 (32 GB/s) for whole rows in order; and the whole attention took 4.9 ms with
 * this sweep a function of its own against 6.1-7.7 with it inlined into attend_group512.
 * Each sum is the same fused multiply-adds in the same order as before. */
static inline __attribute__((always_inline)) void values512(
    int r, const int *firsts, const int *lengths, int lo, int hi, int heads, int per_kv,
    const float *v_pool, const int32_t *slots, int stride, const int chunks,
    const float *scores, const float *inv, float *out, int out_stride) {
    const int ahead = DECODE_AHEAD, head_dim = chunks * 16, kv_heads = heads / per_kv, span = hi - lo;
    for (int j = 0; j < r; j++)
        memset(out + (size_t)j * out_stride, 0, sizeof(float) * (size_t)heads * head_dim);
    for (int i = lo; i < hi; i++) {
        if (i + ahead < hi) prefetch_row_l2(v_pool + (size_t)slots[i + ahead] * stride, stride);
        const float *row = v_pool + (size_t)slots[i] * stride;
        for (int g = 0; g < kv_heads; g++) {
            __m512 value[8];
            for (int c = 0; c < chunks; c++) value[c] = _mm512_loadu_ps(row + g * head_dim + 16 * c);
            for (int j = 0; j < r; j++) {
                if (i < firsts[j] || i >= lengths[j]) continue;
                for (int t = 0; t < per_kv; t++) {
                    int h = g * per_kv + t;
                    __m512 weight = _mm512_set1_ps(scores[((size_t)j * heads + h) * span + (i - lo)]);
                    float *o = out + (size_t)j * out_stride + h * head_dim;
                    for (int c = 0; c < chunks; c++)
                        _mm512_storeu_ps(o + 16 * c, _mm512_fmadd_ps(weight, value[c], _mm512_loadu_ps(o + 16 * c)));
                }
            }
        }
    }
    for (int j = 0; j < r; j++)
        for (int h = 0; h < heads; h++) {
            __m512 scale = _mm512_set1_ps(inv[j * heads + h]);
            float *o = out + (size_t)j * out_stride + h * head_dim;
            for (int c = 0; c < chunks; c++) _mm512_storeu_ps(o + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(o + 16 * c), scale));
        }
}

/* values512 for head dims 64 and 128, each its own function (see values512). */
static __attribute__((noinline)) void values64(int r, const int *firsts, const int *lengths, int lo, int hi,
                                               int heads, int per_kv, const float *v_pool, const int32_t *slots,
                                               int stride, const float *scores, const float *inv, float *out,
                                               int out_stride) {
    values512(r, firsts, lengths, lo, hi, heads, per_kv, v_pool, slots, stride, 4, scores, inv, out, out_stride);
}
static __attribute__((noinline)) void values128(int r, const int *firsts, const int *lengths, int lo, int hi,
                                                int heads, int per_kv, const float *v_pool, const int32_t *slots,
                                                int stride, const float *scores, const float *inv, float *out,
                                                int out_stride) {
    values512(r, firsts, lengths, lo, hi, heads, per_kv, v_pool, slots, stride, 8, scores, inv, out, out_stride);
}

/* The rows r of one request in this step (a decode alone, or a verify step's token and its
 * drafts) over their keys: row j's queries q + j * q_stride ([heads, head_dim]) over keys
 * firsts[j] .. lengths[j] - 1, into out + j * out_stride. Each key's row is read once for
 * all the rows (from memory once, where one row at a time reads a long context r times);
 * `chunks` = head_dim / 16 (4 or 8: constant where this is inlined, the vectors in
 * registers). A row takes the same operations whatever the other rows of its group: its
 * output does not depend on them. `scores` holds r x heads x (hi - lo) floats, lo and hi the
 * group's least first key and most length; `totals` r x heads. */
static inline __attribute__((always_inline)) void attend_group512(
    const float *q, int q_stride, int r, const int *firsts, const int *lengths, int heads,
    int per_kv, const float *k_pool, const float *v_pool, const int32_t *slots, int stride,
    const int chunks, float scaling, float *scores, float *totals, float *out, int out_stride) {
    const int ahead = DECODE_AHEAD, head_dim = chunks * 16, kv_heads = heads / per_kv;
    int lo = firsts[0], hi = lengths[0];
    for (int j = 1; j < r; j++) {
        lo = firsts[j] < lo ? firsts[j] : lo;
        hi = lengths[j] > hi ? lengths[j] : hi;
    }
    const int span = hi - lo;
    for (int i = lo; i < hi; i++) {
        if (i + ahead < hi) prefetch_row_l2(k_pool + (size_t)slots[i + ahead] * stride, stride);
        const float *row = k_pool + (size_t)slots[i] * stride;
        for (int g = 0; g < kv_heads; g++) {
            __m512 key[8];
            for (int c = 0; c < chunks; c++) key[c] = _mm512_loadu_ps(row + g * head_dim + 16 * c);
            for (int j = 0; j < r; j++) {
                if (i < firsts[j] || i >= lengths[j]) continue;
                const float *qj = q + (size_t)j * q_stride;
                for (int t = 0; t < per_kv; t++) {
                    int h = g * per_kv + t;
                    __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qj + h * head_dim), key[0]);
                    for (int c = 1; c < chunks; c++)
                        acc = _mm512_fmadd_ps(_mm512_loadu_ps(qj + h * head_dim + 16 * c), key[c], acc);
                    scores[((size_t)j * heads + h) * span + (i - lo)] = _mm512_reduce_add_ps(acc) * scaling;
                }
            }
        }
    }
    float *inv = totals;
    for (int j = 0; j < r; j++)
        for (int h = 0; h < heads; h++) {
            float *p = scores + ((size_t)j * heads + h) * span + (firsts[j] - lo);
            inv[j * heads + h] = 1.0f / softmax_numerators(p, lengths[j] - firsts[j]);
        }
    if (chunks == 4)
        values64(r, firsts, lengths, lo, hi, heads, per_kv, v_pool, slots, stride, scores, inv, out, out_stride);
    else
        values128(r, firsts, lengths, lo, hi, heads, per_kv, v_pool, slots, stride, scores, inv, out, out_stride);
}

/* e^x, 16 lanes: exp256's arithmetic (the same clamps and polynomial). */
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.0f)), _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
    return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

/* The fewest query vectors (rows x query heads per KV head) that take attend_wide512: below,
 * most of its lanes would be padding. */
#define WIDE_MIN 8

/* A tile's scores: the keys in `kt` ([WIDE_KEYS][head_dim], a copy) times `nb` blocks of
 * transposed queries from `block` ([nb][head_dim][16]), into scores + i * width (keys i ..
 * i + n - 1), -inf where a lane's ranges (la .. ld) leave the key out (unless `full`: every
 * lane takes every key of the tile), each block's running max in `top`. */
static inline __attribute__((always_inline)) void score_tile(
    const float *kt, const float *block, int head_dim, const int nb, int n, int i, int full,
    const int32_t *la, const int32_t *lb, const int32_t *lc, const int32_t *ld, float *scores,
    int width, float *top) {
    __m512 acc[WIDE_KEYS][3];
    for (int u = 0; u < WIDE_KEYS; u++)
        for (int k = 0; k < nb; k++) acc[u][k] = _mm512_setzero_ps();
    for (int e = 0; e < head_dim; e++) {
        __m512 w[3];
        for (int k = 0; k < nb; k++) w[k] = _mm512_loadu_ps(block + ((size_t)k * head_dim + e) * 16);
        for (int u = 0; u < WIDE_KEYS; u++) {
            __m512 key = _mm512_set1_ps(kt[u * head_dim + e]);
            for (int k = 0; k < nb; k++) acc[u][k] = _mm512_fmadd_ps(key, w[k], acc[u][k]);
        }
    }
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int k = 0; k < nb; k++) {
        __m512i a = _mm512_loadu_si512(la + 16 * k), b = _mm512_loadu_si512(lb + 16 * k);
        __m512i c = _mm512_loadu_si512(lc + 16 * k), d = _mm512_loadu_si512(ld + 16 * k);
        __m512 most = _mm512_loadu_ps(top + 16 * k);
        for (int u = 0; u < n; u++) {
            __m512 x = acc[u][k];
            if (!full) {
                __m512i at = _mm512_set1_epi32(i + u);
                __mmask16 valid = (_mm512_cmp_epi32_mask(at, a, _MM_CMPINT_NLT) &
                                   _mm512_cmp_epi32_mask(at, b, _MM_CMPINT_LT)) |
                                  (_mm512_cmp_epi32_mask(at, c, _MM_CMPINT_NLT) &
                                   _mm512_cmp_epi32_mask(at, d, _MM_CMPINT_LT));
                x = _mm512_mask_blend_ps(valid, neg_inf, x);
            }
            most = _mm512_max_ps(most, x);
            _mm512_storeu_ps(scores + (size_t)(i + u) * width + 16 * k, x);
        }
        _mm512_storeu_ps(top + 16 * k, most);
    }
}

/* The values for `nv` consecutive query vectors from v0 (their weights scores + i * width +
 * v0, zero outside each one's ranges) over keys [from, to): their sums added to acc. */
static inline __attribute__((always_inline)) void value_tile(
    const float *v_pool, const int32_t *keys, int stride, int g, const int chunks,
    const float *scores, int width, int v0, const int nv, int from, int to, int first,
    __m512 acc[6][8]) {
    const int head_dim = chunks * 16, ahead = 16;
    for (int i = from; i < to; i++) {
        if (first && i + ahead < to) prefetch_row(v_pool + (size_t)keys[i + ahead] * stride + g * head_dim, head_dim);
        const float *v = v_pool + (size_t)keys[i] * stride + g * head_dim;
        const float *p = scores + (size_t)i * width + v0;
        __m512 value[8];
        for (int k = 0; k < chunks; k++) value[k] = _mm512_loadu_ps(v + 16 * k);
        for (int t = 0; t < nv; t++) {
            __m512 weight = _mm512_set1_ps(p[t]);
            for (int k = 0; k < chunks; k++) acc[t][k] = _mm512_fmadd_ps(weight, value[k], acc[t][k]);
        }
    }
}

/* Rows r (consecutive in the step: queries q + j * q_stride, [heads, head_dim]) over a list
 * of `span` keys (`keys`: pool slots), row j attending to the keys at list positions
 * [a_j, b_j) and [c_j, d_j), as attend_group512 computes attention, for many query vectors
 * at once (rows x the query heads of a KV head): two products of tiles, as a GEMM's are.
 * One request's rows (a prefill chunk: its keys, one range each), or the rows of several
 * requests that share a cached prefix (their common keys first, each request's own after
 * them: see `cluster`), which then reads the prefix once for all.
 * Per KV head: the queries, scaled, transposed into `work` ([blocks][head_dim][16]: the
 * vectors go across the lanes, so a key's scores for sixteen of them are one vector and
 * need no horizontal sum); the scores [keys][blocks x 16] after them, tile by tile
 * (score_tile), -inf outside a lane's ranges; a softmax down each lane; then the values,
 * six query vectors at a time for head dim 64 (three for 128) over the union of their rows'
 * ranges (each value row loaded once for them; a key outside a vector's ranges weighs
 * exactly 0). The sums run in another order than attend_group512's (a row's results depend
 * on nothing beside it here either, but differ from that path's in the last bits):
 * batch-invariant inference keeps to that one. `work` holds
 * 16 x blocks x (head_dim + span + 6) + WIDE_KEYS x head_dim floats. */
static inline __attribute__((always_inline)) void attend_wide512(
    const float *q, int q_stride, int r, const int *a, const int *b, const int *c, const int *d,
    int heads, int per_kv, const float *k_pool, const float *v_pool, const int32_t *keys,
    int span, int stride, const int chunks, float scaling, float *work, float *out,
    int out_stride, int g_from, int g_to) {
    const int ahead = 2 * WIDE_KEYS, head_dim = chunks * 16;
    const int count = r * per_kv, blocks = (count + 15) / 16, width = blocks * 16;
    float *qt = work, *scores = qt + (size_t)width * head_dim, *inv = scores + (size_t)span * width;
    int32_t *lane_a = (int32_t *)(inv + width), *lane_b = lane_a + width;
    int32_t *lane_c = lane_b + width, *lane_d = lane_c + width;
    float *kt = (float *)(lane_d + width), *tops = kt + WIDE_KEYS * head_dim;
    /* keys every row takes (no mask needed there: a padding lane's query is zero) */
    int full_lo = 0, full_hi = span;
    for (int v = 0; v < width; v++) { /* padding lanes: no key */
        int j = v / per_kv;
        lane_a[v] = v < count ? a[j] : 0, lane_b[v] = v < count ? b[j] : 0;
        lane_c[v] = v < count ? c[j] : 0, lane_d[v] = v < count ? d[j] : 0;
    }
    for (int j = 0; j < r; j++) {
        full_lo = a[j] > full_lo ? a[j] : full_lo;
        full_hi = b[j] < full_hi ? b[j] : full_hi;
    }
    const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
    for (int g = g_from; g < g_to; g++) {
        for (int v = 0; v < width; v++) {
            float *column = qt + (size_t)(v / 16) * head_dim * 16 + v % 16;
            if (v < count) {
                const float *src = q + (size_t)(v / per_kv) * q_stride + (g * per_kv + v % per_kv) * head_dim;
                for (int e = 0; e < head_dim; e++) column[e * 16] = src[e] * scaling;
            } else {
                for (int e = 0; e < head_dim; e++) column[e * 16] = 0.0f;
            }
        }
        for (int v = 0; v < width; v++) tops[v] = -INFINITY;
        for (int i = 0; i < span; i += WIDE_KEYS) {
            const int n = span - i < WIDE_KEYS ? span - i : WIDE_KEYS;
            for (int u = 0; u < WIDE_KEYS; u++) {
                const float *key = k_pool + (size_t)keys[i + (u < n ? u : n - 1)] * stride + g * head_dim;
                for (int k = 0; k < chunks; k++)
                    _mm512_storeu_ps(kt + u * head_dim + 16 * k, _mm512_loadu_ps(key + 16 * k));
            }
            for (int u = 0; u < WIDE_KEYS && i + ahead + u < span; u++)
                prefetch_row(k_pool + (size_t)keys[i + ahead + u] * stride + g * head_dim, head_dim);
            /* blocks whose lanes take none of the tile's keys (a request's own keys, in a
             * cluster: the other rows' lanes) are not multiplied: -inf */
            const int full = i >= full_lo && i + n <= full_hi;
            int first = blocks, last = -1;
            if (full)
                first = 0, last = blocks - 1;
            else
                for (int j = 0; j < r; j++)
                    if ((a[j] < i + n && b[j] > i) || (c[j] < i + n && d[j] > i)) {
                        first = first < j * per_kv / 16 ? first : j * per_kv / 16;
                        last = ((j + 1) * per_kv - 1) / 16;
                    }
            for (int blk = 0; blk < blocks;) {
                float *at = scores + 16 * blk, *top = tops + 16 * blk;
                if (blk < first || blk > last) {
                    for (int u = 0; u < n; u++) _mm512_storeu_ps(at + (size_t)(i + u) * width, neg_inf);
                    blk++;
                    continue;
                }
                const int left = last + 1 - blk, nb = left == 4 ? 2 : left > 3 ? 3 : left;
                const float *block = qt + (size_t)blk * head_dim * 16;
                const int32_t *la = lane_a + 16 * blk, *lb = lane_b + 16 * blk;
                const int32_t *lc = lane_c + 16 * blk, *ld = lane_d + 16 * blk;
                if (nb == 3)
                    score_tile(kt, block, head_dim, 3, n, i, full, la, lb, lc, ld, at, width, top);
                else if (nb == 2)
                    score_tile(kt, block, head_dim, 2, n, i, full, la, lb, lc, ld, at, width, top);
                else
                    score_tile(kt, block, head_dim, 1, n, i, full, la, lb, lc, ld, at, width, top);
                blk += nb;
            }
        }
        for (int blk = 0; blk < blocks; blk++) {
            __m512 most = _mm512_loadu_ps(tops + 16 * blk), total = _mm512_setzero_ps();
            for (int i = 0; i < span; i++) {
                float *at = scores + (size_t)i * width + 16 * blk;
                __m512 x = _mm512_loadu_ps(at);
                __mmask16 valid = _mm512_cmp_ps_mask(x, neg_inf, _CMP_GT_OQ);
                __m512 e = valid ? _mm512_maskz_mov_ps(valid, exp512(_mm512_sub_ps(x, most)))
                                 : _mm512_setzero_ps();
                _mm512_storeu_ps(at, e);
                total = _mm512_add_ps(total, e);
            }
            _mm512_storeu_ps(inv + 16 * blk, _mm512_div_ps(_mm512_set1_ps(1.0f), total));
        }
        const int tile = chunks == 4 ? 6 : 3;
        for (int v0 = 0; v0 < count; v0 += tile) {
            const int nv = count - v0 < tile ? count - v0 : tile;
            /* the union of the tile's rows' ranges, as one range where the two overlap */
            int from1 = span, to1 = 0, from2 = span, to2 = 0;
            for (int j = v0 / per_kv; j <= (v0 + nv - 1) / per_kv; j++) {
                if (a[j] < b[j]) from1 = a[j] < from1 ? a[j] : from1, to1 = b[j] > to1 ? b[j] : to1;
                if (c[j] < d[j]) from2 = c[j] < from2 ? c[j] : from2, to2 = d[j] > to2 ? d[j] : to2;
            }
            if (from2 < to2 && from1 < to1 && from2 < to1 && from1 < to2) {
                from1 = from1 < from2 ? from1 : from2, to1 = to1 > to2 ? to1 : to2;
                from2 = to2 = 0;
            }
            __m512 acc[6][8];
            for (int t = 0; t < tile; t++)
                for (int k = 0; k < chunks; k++) acc[t][k] = _mm512_setzero_ps();
            for (int range = 0; range < 2; range++) {
                const int from = range ? from2 : from1, to = range ? to2 : to1;
                if (from >= to) continue;
                if (nv == tile)
                    value_tile(v_pool, keys, stride, g, chunks, scores, width, v0, tile, from, to, v0 == 0, acc);
                else
                    for (int t = 0; t < nv; t++)
                        value_tile(v_pool, keys, stride, g, chunks, scores, width, v0 + t, 1, from, to, v0 == 0 && t == 0, acc + t);
            }
            for (int t = 0; t < nv; t++) {
                const int v = v0 + t, h = g * per_kv + v % per_kv;
                __m512 scale = _mm512_set1_ps(inv[v]);
                float *o = out + (size_t)(v / per_kv) * out_stride + h * head_dim;
                for (int k = 0; k < chunks; k++) _mm512_storeu_ps(o + 16 * k, _mm512_mul_ps(acc[t][k], scale));
            }
        }
    }
}

/* attend_wide512 for head dims 64 and 128 (the chunk count a constant in each copy). */
static void attend_wide(const float *q, int q_stride, int r, const int *a, const int *b,
                        const int *c, const int *d, int heads, int per_kv, const float *k_pool,
                        const float *v_pool, const int32_t *keys, int span, int stride,
                        int head_dim, float scaling, float *work, float *out, int out_stride,
                        int g_from, int g_to) {
    if (head_dim == 64)
        attend_wide512(q, q_stride, r, a, b, c, d, heads, per_kv, k_pool, v_pool, keys, span,
                       stride, 4, scaling, work, out, out_stride, g_from, g_to);
    else
        attend_wide512(q, q_stride, r, a, b, c, d, heads, per_kv, k_pool, v_pool, keys, span,
                       stride, 8, scaling, work, out, out_stride, g_from, g_to);
}

/* The rows attend_wide512 takes together over keys of up to `longest` positions: the more,
 * the more products each key's row is loaded for, while their scores (rows x per_kv lanes
 * x keys) stay within WIDE_SCORES floats (1 MiB, about a core's L2), MAX_GROUP at least. */
static int wide_rows(int64_t longest, int per_kv) {
    int64_t rows = WIDE_SCORES / (per_kv * (longest > 1 ? longest : 1));
    return rows < MAX_GROUP ? MAX_GROUP : rows > WIDE_ROWS ? WIDE_ROWS : (int)rows;
}

/* Requests that share a cached prefix attend together (attend_wide512 reading the shared
 * keys once for all of them): consecutive requests whose table rows begin with the same
 * slots, at least CLUSTER_MIN of them, `most_rows` rows at most. */
#define CLUSTER_MIN 32

/* The cluster that begins at row m (the first row of a request): the row past its last, or
 * m when fewer than two requests share CLUSTER_MIN keys; `*shared` the keys they share (no
 * more than any of its rows attends to). */
static int cluster(const int32_t *table, int64_t table_stride, const int64_t *rows,
                   const int64_t *lengths, int m, int m_rows, int most_rows, int *shared) {
    const int32_t *first = table + rows[m] * table_stride;
    int end = m, prefix = 0, requests = 0;
    while (end < m_rows) {
        int next = end, least = (int)lengths[end];
        for (; next < m_rows && rows[next] == rows[end]; next++)
            least = lengths[next] < least ? (int)lengths[next] : least;
        if (next - m > most_rows) break;
        int common = requests ? (least < prefix ? least : prefix) : least;
        if (requests) {
            const int32_t *own = table + rows[end] * table_stride;
            int p = 0;
            while (p < common && own[p] == first[p]) p++;
            common = p;
        }
        if (common < CLUSTER_MIN) break;
        prefix = common, end = next, requests++;
    }
    *shared = prefix;
    return requests >= 2 ? end : m;
}

/* A cluster's key list (its shared keys, then each request's own after them) into `keys`,
 * and each of its rows' two ranges of the list; returns the list's length. */
static int cluster_keys(const int32_t *table, int64_t table_stride, const int64_t *rows,
                        const int64_t *lengths, int m, int end, int shared, int32_t *keys,
                        int *a, int *b, int *c, int *d) {
    if (keys) memcpy(keys, table + rows[m] * table_stride, sizeof(int32_t) * (size_t)shared);
    int span = shared;
    for (int start = m, next; start < end; start = next) {
        int most = 0;
        for (next = start; next < end && rows[next] == rows[start]; next++) {
            int length = (int)lengths[next];
            a[next - m] = 0, b[next - m] = shared;
            c[next - m] = span, d[next - m] = span + length - shared;
            most = length > most ? length : most;
        }
        if (keys)
            memcpy(keys + span, table + rows[start] * table_stride + shared,
                   sizeof(int32_t) * (size_t)(most - shared));
        span += most - shared;
    }
    return span;
}
#endif

/* The rows r of one request (see attend_group512) over their keys: the group path where it
 * applies (attend_wide512 for many query vectors unless `invariant`), else row by row. */
static void attend(const float *q, int q_stride, int r, const int *firsts, const int *lengths,
                   int heads, int per_kv, const float *k_pool, const float *v_pool,
                   const int32_t *slots, int stride, int head_dim, float scaling, float *scores,
                   float *totals, float *out, int out_stride, int invariant) {
    (void)invariant; /* (no other path without AVX-512) */
#ifdef __AVX512F__
    if ((head_dim == 64 || head_dim == 128) && !invariant && r * per_kv >= WIDE_MIN) {
        int lo = firsts[0], hi = lengths[0], a[WIDE_ROWS], b[WIDE_ROWS], none[WIDE_ROWS] = {0};
        for (int j = 1; j < r; j++) {
            lo = firsts[j] < lo ? firsts[j] : lo;
            hi = lengths[j] > hi ? lengths[j] : hi;
        }
        for (int j = 0; j < r; j++) a[j] = firsts[j] - lo, b[j] = lengths[j] - lo;
        attend_wide(q, q_stride, r, a, b, none, none, heads, per_kv, k_pool, v_pool, slots + lo,
                    hi - lo, stride, head_dim, scaling, scores, out, out_stride, 0, heads / per_kv);
        return;
    }
    if (head_dim == 64 || head_dim == 128) {
        if (head_dim == 64)
            attend_group512(q, q_stride, r, firsts, lengths, heads, per_kv, k_pool, v_pool,
                            slots, stride, 4, scaling, scores, totals, out, out_stride);
        else
            attend_group512(q, q_stride, r, firsts, lengths, heads, per_kv, k_pool, v_pool,
                            slots, stride, 8, scaling, scores, totals, out, out_stride);
        return;
    }
#endif
    for (int j = 0; j < r; j++)
        attend_any(q + (size_t)j * q_stride, heads, per_kv, k_pool, v_pool, slots, firsts[j],
                   lengths[j], stride, head_dim, scaling, scores, totals,
                   out + (size_t)j * out_stride);
}


static inline float silu(float x) { return x / (1.0f + expf(-x)); }

/* out = silu(gate) * up, eight at a time with exp256 (its clamps keep x / (1 + e^-x) right
 * at both ends: e^88 for x <= -88 gives 0, e^-87 for x >= 87 gives x). */
static void silu_times(const float *gate, const float *up, float *out, int n) {
    int j = 0;
#ifdef RADIXLM_AVX2
    const __m256 one = _mm256_set1_ps(1.0f);
    for (; j + 8 <= n; j += 8) {
        __m256 g = _mm256_loadu_ps(gate + j);
        __m256 e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
        __m256 act = _mm256_div_ps(g, _mm256_add_ps(one, e));
        _mm256_storeu_ps(out + j, _mm256_mul_ps(act, _mm256_loadu_ps(up + j)));
    }
#endif
    for (; j < n; j++) out[j] = silu(gate[j]) * up[j];
}

/* One layer's attention: rows starts[u] .. ends[u] - 1 the rows of unit u (a cluster's: its
 * KV heads kv[u] only, or all where kv[u] < 0), the units taken in turn by the threads, each
 * with its own scratch (`work` floats of scores, heads x MAX_GROUP totals). */
typedef struct {
    const RlmShape *shape;
    const RlmLayer *l;
    int units;
    const int *starts, *ends, *kv;
    const float *wide;
    float *attended;
    const int32_t *table;
    int64_t table_stride;
    const int64_t *rows, *lengths;
    const int *clusters, *spans, *key_at, *ra, *rb, *rc, *rd;
    const int32_t *keys;
    float *scores, *totals;
    size_t work;
    atomic_int next;
} Attention;

static void attention_task(void *arg, int ith, int nth) {
    (void)nth;
    Attention *a = arg;
    const RlmShape *shape = a->shape;
    const RlmLayer *l = a->l;
    const int hd = shape->head_dim, heads = shape->heads, per_kv = heads / shape->kv_heads;
    const int q_size = heads * hd, kv_size = shape->kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    float *scores = a->scores + a->work * ith;
    float *totals = a->totals + (size_t)heads * MAX_GROUP * ith;
    for (int u; (u = atomic_fetch_add(&a->next, 1)) < a->units;) {
        int m = a->starts[u], end = a->ends[u];
#ifdef __AVX512F__
        if (a->clusters[m] && !l->window) {
            int g_from = a->kv[u] < 0 ? 0 : a->kv[u];
            int g_to = a->kv[u] < 0 ? shape->kv_heads : a->kv[u] + 1;
            attend_wide(a->wide + (size_t)m * qkv_size, qkv_size, end - m, a->ra + m, a->rb + m,
                        a->rc + m, a->rd + m, heads, per_kv, l->k_pool, l->v_pool,
                        a->keys + a->key_at[m], a->spans[m], kv_size, hd, shape->scaling, scores,
                        a->attended + (size_t)m * q_size, q_size, g_from, g_to);
            continue;
        }
#endif
        int firsts[WIDE_ROWS], ends[WIDE_ROWS];
        for (int j = m; j < end; j++) {
            int length = (int)a->lengths[j];
            ends[j - m] = length;
            firsts[j - m] = l->window > 0 && length > l->window ? length - l->window : 0;
        }
        attend(a->wide + (size_t)m * qkv_size, qkv_size, end - m, firsts, ends, heads, per_kv,
               l->k_pool, l->v_pool, a->table + a->rows[m] * a->table_stride, kv_size, hd,
               shape->scaling, scores, totals, a->attended + (size_t)m * q_size, q_size,
               shape->invariant);
    }
}

/* hidden [M, hidden] in place through every layer; cos/sin [M, head_dim]. Returns 0, -1 for
 * shapes a product does not take, -2 when memory runs out. */
int radixlm_decode_layers(const RlmShape *shape, const RlmLayer *layers, int m_rows, float *hidden,
                          const float *cos, const float *sin, const int64_t *out_slots,
                          const int32_t *table, int64_t table_stride, const int64_t *rows,
                          const int64_t *lengths) {
    const int h = shape->hidden, hd = shape->head_dim, heads = shape->heads;
    const int kv_heads = shape->kv_heads, inter = shape->intermediate;
    const int q_size = heads * hd, kv_size = kv_heads * hd, qkv_size = q_size + 2 * kv_size;
    const int per_kv = heads / kv_heads;
    int64_t longest = 1;
    for (int m = 0; m < m_rows; m++) longest = lengths[m] > longest ? lengths[m] : longest;
    size_t width = (size_t)(qkv_size > 2 * inter ? qkv_size : 2 * inter);
    float *normed = malloc(sizeof(float) * (size_t)m_rows * (h > inter ? h : inter));
    float *wide = malloc(sizeof(float) * (size_t)m_rows * width);
    float *attended = malloc(sizeof(float) * (size_t)m_rows * q_size);
    float *projected = malloc(sizeof(float) * (size_t)m_rows * h);
    /* rows of one request attended together (see attend) */
    int group_rows = MAX_GROUP;
#ifdef __AVX512F__
    if (!shape->invariant && (hd == 64 || hd == 128)) group_rows = wide_rows(longest, per_kv);
#endif
    /* attend_group512's scores, or attend_wide512's transposed queries, scores and bounds */
    size_t lanes = (size_t)(group_rows * per_kv + 15) / 16 * 16;
    size_t wide_work = lanes * (size_t)(hd + longest + 6) + (size_t)WIDE_KEYS * hd;
    size_t group_work = (size_t)longest * heads * MAX_GROUP;
    size_t work = wide_work > group_work ? wide_work : group_work;
    /* clusters[m]: the row past the cluster that begins at row m, or 0; spans[m] its key
     * list's length, key_at[m] where the list begins in `keys`; ra..rd each row's ranges */
    int *index = calloc((size_t)m_rows * 7, sizeof(int)), total_keys = 0;
    int *clusters = index, *spans = index + m_rows, *key_at = index + 2 * m_rows;
    int *ra = index + 3 * m_rows, *rb = index + 4 * m_rows, *rc = index + 5 * m_rows;
    int *rd = index + 6 * m_rows;
    int32_t *keys = NULL;
    (void)clusters, (void)spans, (void)key_at, (void)ra, (void)rb, (void)rc, (void)rd;
#ifdef __AVX512F__
    if (index && !shape->invariant && (hd == 64 || hd == 128)) {
        for (int m = 0, end; m < m_rows; m = end) {
            int shared;
            end = cluster(table, table_stride, rows, lengths, m, m_rows, group_rows, &shared);
            if (end == m) { /* the next request */
                while (end < m_rows && rows[end] == rows[m]) end++;
                continue;
            }
            clusters[m] = end, key_at[m] = total_keys;
            spans[m] = cluster_keys(table, table_stride, rows, lengths, m, end, shared, NULL,
                                    ra + m, rb + m, rc + m, rd + m);
            total_keys += spans[m];
            size_t lanes_here = (size_t)((end - m) * per_kv + 15) / 16 * 16;
            size_t need = lanes_here * (size_t)(hd + spans[m] + 6) + (size_t)WIDE_KEYS * hd;
            work = need > work ? need : work;
        }
        keys = malloc(sizeof(int32_t) * (size_t)(total_keys > 0 ? total_keys : 1));
        for (int m = 0; keys && m < m_rows; m++)
            if (clusters[m])
                cluster_keys(table, table_stride, rows, lengths, m, clusters[m], rb[m],
                             keys + key_at[m], ra + m, rb + m, rc + m, rd + m);
    }
#endif
    /* each thread's scratch */
    const int threads = radixlm_threads();
    float *scores = malloc(sizeof(float) * work * threads);
    float *totals = malloc(sizeof(float) * (size_t)heads * MAX_GROUP * threads);
    /* units: a cluster's KV heads apart where there are threads to take them */
    int *starts = malloc(sizeof(int) * 3 * (size_t)m_rows * kv_heads);
    int *ends = starts + (size_t)m_rows * kv_heads, *kv = ends + (size_t)m_rows * kv_heads;
    int code = 0;
    if (!normed || !wide || !attended || !projected || !scores || !totals || !index || !starts)
        code = -2;
    if (total_keys && !keys) code = -2;
    for (int layer = 0; layer < shape->layers && !code; layer++) {
        const RlmLayer *l = layers + layer;
        for (int m = 0; m < m_rows; m++)
            rms_norm(hidden + (size_t)m * h, l->input_norm, h, shape->eps, normed + (size_t)m * h);
        if ((code = linear(&l->qkv, normed, m_rows, wide))) break;
        for (int m = 0; m < m_rows; m++) {
            float *q = wide + (size_t)m * qkv_size, *k = q + q_size, *v = k + kv_size;
            const float *c = cos + (size_t)m * hd, *s = sin + (size_t)m * hd;
            for (int head = 0; head < heads; head++) {
                if (l->q_norm) rms_norm(q + head * hd, l->q_norm, hd, shape->eps, q + head * hd);
                rotate(q + head * hd, c, s, hd);
            }
            for (int head = 0; head < kv_heads; head++) {
                if (l->k_norm) rms_norm(k + head * hd, l->k_norm, hd, shape->eps, k + head * hd);
                rotate(k + head * hd, c, s, hd);
            }
            memcpy(l->k_pool + (size_t)out_slots[m] * kv_size, k, sizeof(float) * kv_size);
            memcpy(l->v_pool + (size_t)out_slots[m] * kv_size, v, sizeof(float) * kv_size);
        }
        /* rows of one request together, or of requests that share a prefix (their new K/V
         * all in the pool now: a row's keys end at its own token), a unit each, the units
         * over the threads */
        int units = 0;
        for (int m = 0, end; m < m_rows; m = end) {
#ifdef __AVX512F__
            if (clusters[m] && !l->window) {
                end = clusters[m];
                for (int g = 0; g < (threads > 1 ? kv_heads : 1); g++, units++)
                    starts[units] = m, ends[units] = end, kv[units] = threads > 1 ? g : -1;
                continue;
            }
#endif
            end = m;
            while (end < m_rows && end - m < group_rows && rows[end] == rows[m]) end++;
            starts[units] = m, ends[units] = end, kv[units] = -1, units++;
        }
        Attention job = {shape, l, units, starts, ends, kv, wide, attended, table, table_stride,
                         rows, lengths, clusters, spans, key_at, ra, rb, rc, rd, keys, scores,
                         totals, work};
        atomic_init(&job.next, 0);
        radixlm_parallel(attention_task, &job, units < threads ? units : threads);
        if ((code = linear(&l->o, attended, m_rows, projected))) break;
        for (size_t i = 0; i < (size_t)m_rows * h; i++) hidden[i] += projected[i];
        for (int m = 0; m < m_rows; m++)
            rms_norm(hidden + (size_t)m * h, l->post_norm, h, shape->eps, normed + (size_t)m * h);
        if ((code = linear(&l->gate_up, normed, m_rows, wide))) break;
        for (int m = 0; m < m_rows; m++) {
            const float *gate = wide + (size_t)m * 2 * inter, *up = gate + inter;
            silu_times(gate, up, normed + (size_t)m * inter, inter);
        }
        if ((code = linear(&l->down, normed, m_rows, projected))) break;
        for (size_t i = 0; i < (size_t)m_rows * h; i++) hidden[i] += projected[i];
    }
    free(normed), free(wide), free(attended), free(projected), free(scores), free(totals);
    free(index), free(keys), free(starts);
    return code;
}

/* ---- sampling: a draw per row from softmax(logits / temperature) ---- */

/* Values per block of the draw's sums (sixteen lanes on AVX-512, two vectors of eight on
 * AVX2, sixteen scalars elsewhere: each block's sum then added in order). */
#define DRAW_BLOCK 16

/* e^(s - top) for the sixteen values of x[i .. i + 15] / t (s), 0 where s is NaN or
 * s - top < -87 (a masked -inf logit weighs exactly 0, as torch's exp gives), into e; returns
 * their sum. */
static inline float draw_block(const float *x, float t, float top, float *e) {
#ifdef __AVX512F__
    __m512 s = _mm512_div_ps(_mm512_loadu_ps(x), _mm512_set1_ps(t));
    __m512 d = _mm512_sub_ps(s, _mm512_set1_ps(top));
    __mmask16 keep = _mm512_cmp_ps_mask(d, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
    __m512 v = _mm512_maskz_mov_ps(keep, exp512(d));
    _mm512_storeu_ps(e, v);
    return _mm512_reduce_add_ps(v);
#elif defined(RADIXLM_AVX2)
    __m256 sum = _mm256_setzero_ps();
    for (int h = 0; h < 2; h++) {
        __m256 s = _mm256_div_ps(_mm256_loadu_ps(x + 8 * h), _mm256_set1_ps(t));
        __m256 d = _mm256_sub_ps(s, _mm256_set1_ps(top));
        __m256 keep = _mm256_cmp_ps(d, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
        __m256 v = _mm256_and_ps(keep, exp256(d));
        _mm256_storeu_ps(e + 8 * h, v);
        sum = _mm256_add_ps(sum, v);
    }
    float lanes[8], total = 0.0f;
    _mm256_storeu_ps(lanes, sum);
    for (int j = 0; j < 8; j++) total += lanes[j];
    return total;
#else
    float total = 0.0f;
    for (int j = 0; j < DRAW_BLOCK; j++) {
        float d = x[j] / t - top;
        e[j] = d >= -87.0f ? expf(d) : 0.0f; /* (false for NaN) */
        total += e[j];
    }
    return total;
#endif
}

typedef struct {
    const float *x;
    int rows, n;
    int64_t stride;
    const float *temps, *uniforms;
    int64_t *out;
    atomic_int failed;
} Draws;

/* One row's draw (see radixlm_sample_rows); `work` holds n + 2 * DRAW_BLOCK floats. Its
 * values' e^(x / t - top) in blocks, each block's sum, their total in block order; then the
 * block where the running sum (the same additions in the same order) first exceeds u x the
 * total, and in it the first value at which the running sum, one value at a time, does.
 * A value that weighs 0 is never drawn. */
static int64_t draw_row(const float *x, int n, float t, float u, float *work) {
    /* the largest x / t: the largest x, divided (t > 0: dividing keeps the order), NaNs
     * left out (a vector max keeps its second operand where the first is NaN) */
    float most = -INFINITY;
    int i = 0;
#ifdef __AVX512F__
    __m512 m16 = _mm512_set1_ps(-INFINITY);
    for (; i + 16 <= n; i += 16) m16 = _mm512_max_ps(_mm512_loadu_ps(x + i), m16);
    most = _mm512_reduce_max_ps(m16);
#elif defined(RADIXLM_AVX2)
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    for (; i + 8 <= n; i += 8) m8 = _mm256_max_ps(_mm256_loadu_ps(x + i), m8);
    float lanes[8];
    _mm256_storeu_ps(lanes, m8);
    for (int j = 0; j < 8; j++) most = lanes[j] > most ? lanes[j] : most;
#endif
    for (; i < n; i++) most = x[i] > most ? x[i] : most;
    float top = most / t;
    if (!(top > -INFINITY && top < INFINITY)) return n - 1; /* no mass: as torch's path */
    int blocks = n / DRAW_BLOCK;
    float *e = work, *sums = work + (size_t)n + DRAW_BLOCK;
    float total = 0.0f;
    for (int b = 0; b < blocks; b++) {
        sums[b] = draw_block(x + (size_t)b * DRAW_BLOCK, t, top, e + (size_t)b * DRAW_BLOCK);
        total += sums[b];
    }
    float tail = 0.0f;
    for (int i = blocks * DRAW_BLOCK; i < n; i++) {
        float d = x[i] / t - top;
        e[i] = d >= -87.0f ? expf(d) : 0.0f;
        tail += e[i];
    }
    total += tail;
    float target = u * total, running = 0.0f;
    int64_t last = -1;
    for (int b = 0; b <= blocks; b++) {
        float sum = b < blocks ? sums[b] : tail;
        int from = b * DRAW_BLOCK, to = b < blocks ? from + DRAW_BLOCK : n;
        if (!(running + sum > target)) {
            running += sum;
            for (int i = from; i < to; i++) last = e[i] > 0.0f ? i : last;
            continue;
        }
        float within = running;
        for (int i = from; i < to; i++) {
            if (e[i] > 0.0f) last = i;
            within += e[i];
            if (within > target && e[i] > 0.0f) return i;
        }
        return last; /* rounding kept the block's values' running sum under the target */
    }
    return last < 0 ? n - 1 : last;
}

static void draws_task(void *arg, int ith, int nth) {
    Draws *d = arg;
    int lo, hi;
    radixlm_split(d->rows, 1, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    float *work = malloc(sizeof(float) * ((size_t)d->n + 2 * DRAW_BLOCK + (size_t)d->n / DRAW_BLOCK + 1));
    if (!work) {
        atomic_store(&d->failed, 1);
        return;
    }
    for (int r = lo; r < hi; r++)
        d->out[r] = draw_row(d->x + (size_t)r * (size_t)d->stride, d->n, d->temps[r], d->uniforms[r], work);
    free(work);
}

/* out[r]: a token drawn from softmax(row r of x / temps[r]) with the uniform uniforms[r] in
 * [0, 1): the first token, in id order, whose running mass exceeds uniforms[r] x the total
 * (the torch path's inverse CDF: softmax, cumsum, searchsorted), in two passes over the row
 * and one over its block sums, where torch makes a pass for each of its five operations
 * (10 ms for 32 rows of a 151,936-token vocabulary on one thread). A row without mass
 * (every value -inf or NaN, or a +inf) gives n - 1, as torch's path does. Rows x[r * stride
 * .. r * stride + n - 1], split over the threads of pool.c (each row computed alone: the
 * same token on any thread count). Returns 0, or -2 when memory runs out. */
int radixlm_sample_rows(const float *x, int rows, int n, int64_t stride, const float *temps,
                        const float *uniforms, int64_t *out) {
    Draws d = {x, rows, n, stride, temps, uniforms, out, 0};
    radixlm_parallel(draws_task, &d, rows < radixlm_threads() ? rows : radixlm_threads());
    return atomic_load(&d.failed) ? -2 : 0;
}
