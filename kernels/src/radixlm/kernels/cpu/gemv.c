/* int4 x float32 matrix products for few rows (decode) on x86 CPUs with AVX2, and a portable
 * scalar version of the same arithmetic elsewhere.
 *
 * Weights in radixlm's int4 layout: qweight [N, K/2] bytes, column 2j in the low nibble of
 * byte j and 2j+1 in its high one; per group of `group` columns a float scale s and zero
 * point z, w = (q - z) * s. The activations are quantized per block of 32 columns to int8
 * (scale = absmax / 127), as llama.cpp multiplies its 4-bit blocks, so each block's dot
 * product is one multiply-add of unsigned 4-bit codes by signed 8-bit values:
 *
 *   y[m, n] = sum_b s[n, b] * xs[m, b] * (dot(q[n, b], xq[m, b]) - z[n, b] sum(xq[m, b]))
 *
 * (the zero points' part over the same rounded activations). One thread: no OpenMP runtime of its own
 * beside torch's (two would spin against each other): the public products at the end split
 * their output columns over pool.c's threads. Built by radixlm.kernels.cpu (compiled on first
 * use).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>

#include "pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLM_AVX2 1
#endif

/* AVX-512 with VNNI (Zen 4, Ice Lake and later): a block pair's dot product is one
 * `vpdpbusd` over 64 bytes, the per-block scales applied in 16 float lanes. */
#if defined(RADIXLM_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__) &&                 \
    defined(__AVX512DQ__) && defined(__AVX512VNNI__)
#define RADIXLM_VNNI 1
#endif

#define BLOCK 32

/* Per row m and block b: the int8 values (with `interleave` 1, even columns first, then odd
 * ones: the order int4 nibbles unpack in; with 2, per pair of blocks b and b + 1, b's even
 * columns, b + 1's, b's odd ones, b + 1's: the order pair_codes unpacks a pair in), their
 * scale and the sum of the rounded values
 * (scale x the codes' sum, llama.cpp's Q8_1 sum: the zero points' part then rounds as the
 * codes' part does, so an activation's rounding error is weighted by its weight, not by
 * its code). */
static void quantize_rows(const float *x, int m_rows, int k, int interleave, int8_t *xq, float *xs,
                          float *xsum) {
    int blocks = k / BLOCK;
    for (int m = 0; m < m_rows; m++) {
        for (int b = 0; b < blocks; b++) {
            const float *v = x + (size_t)m * k + (size_t)b * BLOCK;
            float amax = 0.0f;
#ifdef RADIXLM_VNNI
            amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(v)),
                                                      _mm512_abs_ps(_mm512_loadu_ps(v + 16))));
#else
            for (int i = 0; i < BLOCK; i++) {
                float a = fabsf(v[i]);
                amax = a > amax ? a : amax;
            }
#endif
            float scale = amax / 127.0f;
            float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
            int8_t *out = xq + ((size_t)m * blocks + b) * BLOCK;
            int sum = 0;
            /* interleave 2 (block pairs): a pair's even columns (block b's, then b + 1's),
             * then its odd ones, as a pair's nibbles unpack; a lone last block as 1 */
            int paired = interleave == 2 && (b | 1) < blocks;
            int8_t *base = paired ? xq + ((size_t)m * blocks + (b & ~1)) * BLOCK : out;
            int evens = paired ? (b & 1) * BLOCK / 2 : 0, odds = paired ? BLOCK + evens : BLOCK / 2;
#ifdef RADIXLM_VNNI
            /* the same arithmetic sixteen at a time (the conversion rounds to nearest even,
             * as lrintf does in the default rounding mode): the same bytes */
            const __m512 by = _mm512_set1_ps(inv);
            __m512i low = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v), by));
            __m512i high = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(v + 16), by));
            sum = _mm512_reduce_add_epi32(_mm512_add_epi32(low, high));
            if (interleave) {
                const __m512i even_columns = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16,
                                                              14, 12, 10, 8, 6, 4, 2, 0);
                const __m512i odd_columns = _mm512_add_epi32(even_columns, _mm512_set1_epi32(1));
                _mm_storeu_si128((__m128i *)(base + evens),
                                 _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(low, even_columns, high)));
                _mm_storeu_si128((__m128i *)(base + odds),
                                 _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(low, odd_columns, high)));
            } else {
                _mm_storeu_si128((__m128i *)out, _mm512_cvtepi32_epi8(low));
                _mm_storeu_si128((__m128i *)(out + 16), _mm512_cvtepi32_epi8(high));
            }
            xs[(size_t)m * blocks + b] = scale;
            xsum[(size_t)m * blocks + b] = scale * (float)sum;
            continue;
#endif
            for (int i = 0; i < BLOCK / 2; i++) {
                int even = interleave ? evens + i : 2 * i, odd = interleave ? odds + i : 2 * i + 1;
                base[even] = (int8_t)lrintf(v[2 * i] * inv);
                base[odd] = (int8_t)lrintf(v[2 * i + 1] * inv);
                sum += base[even] + base[odd];
            }
            xs[(size_t)m * blocks + b] = scale;
            xsum[(size_t)m * blocks + b] = scale * (float)sum;
        }
    }
}

/* The activations of one call, rounded to int8 per block (see quantize_rows). */
typedef struct {
    int8_t *q;
    float *scale, *sum;
    /* VNNI builds: each block's scale eight times over (its lanes of a pair's product), so
     * that a pair's scales are one load */
    float *wide;
} Activations;

static void release(Activations *a) { free(a->q), free(a->scale), free(a->sum), free(a->wide); }

/* Allocates and fills `a`; nonzero (nothing held) when memory runs out. */
static int prepare(const float *x, int m_rows, int k, int interleave, Activations *a) {
    size_t blocks = (size_t)m_rows * (k / BLOCK);
    a->q = malloc((size_t)m_rows * k);
    a->scale = malloc(sizeof(float) * blocks);
    a->sum = malloc(sizeof(float) * blocks);
#ifdef RADIXLM_VNNI
    a->wide = malloc(sizeof(float) * blocks * 8);
#else
    a->wide = NULL;
#endif
    if (!a->q || !a->scale || !a->sum
#ifdef RADIXLM_VNNI
        || !a->wide
#endif
    ) {
        release(a);
        return 1;
    }
    quantize_rows(x, m_rows, k, interleave, a->q, a->scale, a->sum);
#ifdef RADIXLM_VNNI
    if (interleave == 2) { /* a pair's lanes: b's four, b + 1's four, b's four, b + 1's four */
        int per_row = k / BLOCK;
        for (int m = 0; m < m_rows; m++)
            for (int b = 0; b < per_row; b += 2) {
                const float *xs = a->scale + (size_t)m * per_row + b;
                float *lanes = a->wide + ((size_t)m * per_row + b) * 8;
                if (b + 1 == per_row) { /* a lone last block: its eight */
                    _mm256_storeu_ps(lanes, _mm256_set1_ps(xs[0]));
                    continue;
                }
                __m128 first = _mm_set1_ps(xs[0]), second = _mm_set1_ps(xs[1]);
                _mm_storeu_ps(lanes, first), _mm_storeu_ps(lanes + 4, second);
                _mm_storeu_ps(lanes + 8, first), _mm_storeu_ps(lanes + 12, second);
            }
    } else {
        for (size_t b = 0; b < blocks; b++)
            _mm256_storeu_ps(a->wide + b * 8, _mm256_set1_ps(a->scale[b]));
    }
#endif
    return 0;
}

#ifdef RADIXLM_AVX2
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

/* The int4 codes of one block of 32 weights as 32 unsigned bytes, in the order the
 * activations are stored (even columns, then odd ones). */
static inline __m256i block_codes(const uint8_t *q) {
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i packed = _mm_loadu_si128((const __m128i *)q);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(packed, 4), mask),
                            _mm_and_si128(packed, mask));
}

/* 8 partial sums (int32 -> float) of a block's dot product of codes and int8 values. */
static inline __m256 block_dot(__m256i codes, const int8_t *values) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256i v = _mm256_loadu_si256((const __m256i *)values);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(codes, v), ones));
}

#define TILE 4

/* Outputs of activation rows m0 .. m0 + tile - 1 (tile <= TILE) for one weight row: each
 * block's codes unpacked once per tile, two accumulators per row (consecutive blocks do not
 * wait on each other's multiply-add). Every row takes the same operations in the same order
 * whatever the tile and the call's row count: a row's output does not depend on the other
 * rows of the call (a decode alone, in a batch, or a speculative verify row agree bit for
 * bit). */
static inline void tile_dot(const uint8_t *q, const float *s, const float *z, const int8_t *xq,
                            const float *xs, const float *xsum, int blocks, int per_group,
                            int m0, int tile, float *got) {
    __m256 acc0[TILE], acc1[TILE];
    float off[TILE];
    for (int m = 0; m < TILE; m++) acc0[m] = acc1[m] = _mm256_setzero_ps(), off[m] = 0.0f;
    if (per_group == 1) {
        int b = 0;
        for (; b + 1 < blocks; b += 2) {
            __m256i c0 = block_codes(q + (size_t)b * 16), c1 = block_codes(q + (size_t)(b + 1) * 16);
            for (int m = 0; m < TILE; m++) {
                if (m < tile) {
                    size_t at = (size_t)(m0 + m) * blocks + b;
                    acc0[m] = _mm256_fmadd_ps(block_dot(c0, xq + at * BLOCK),
                                              _mm256_set1_ps(s[b] * xs[at]), acc0[m]);
                    acc1[m] = _mm256_fmadd_ps(block_dot(c1, xq + (at + 1) * BLOCK),
                                              _mm256_set1_ps(s[b + 1] * xs[at + 1]), acc1[m]);
                    float first = s[b] * z[b] * xsum[at];
                    float second = s[b + 1] * z[b + 1] * xsum[at + 1];
                    off[m] += first + second;
                }
            }
        }
        for (; b < blocks; b++) {
            __m256i c0 = block_codes(q + (size_t)b * 16);
            for (int m = 0; m < TILE; m++) {
                if (m < tile) {
                    size_t at = (size_t)(m0 + m) * blocks + b;
                    acc0[m] = _mm256_fmadd_ps(block_dot(c0, xq + at * BLOCK),
                                              _mm256_set1_ps(s[b] * xs[at]), acc0[m]);
                    float first = s[b] * z[b] * xsum[at];
                    off[m] += first;
                }
            }
        }
    } else {
        for (int g = 0, b = 0; b < blocks; g++) {
            float scale = s[g], sum[TILE] = {0.0f, 0.0f, 0.0f, 0.0f};
            for (int j = 0; j < per_group; j++, b++) {
                __m256i codes = block_codes(q + (size_t)b * 16);
                for (int m = 0; m < TILE; m++) {
                    if (m < tile) {
                        size_t at = (size_t)(m0 + m) * blocks + b;
                        __m256 d = block_dot(codes, xq + at * BLOCK);
                        __m256 sc = _mm256_set1_ps(scale * xs[at]);
                        if (j & 1)
                            acc1[m] = _mm256_fmadd_ps(d, sc, acc1[m]);
                        else
                            acc0[m] = _mm256_fmadd_ps(d, sc, acc0[m]);
                        sum[m] += xsum[at];
                    }
                }
            }
            for (int m = 0; m < tile; m++) {
                float shift = scale * z[g] * sum[m];
                off[m] += shift;
            }
        }
    }
    for (int m = 0; m < tile; m++) got[m] = hsum(_mm256_add_ps(acc0[m], acc1[m])) - off[m];
}
#endif

#ifdef RADIXLM_VNNI
#define VNNI_TILE 8
/* Weight rows ahead that an int8 product's first tile fetches while it multiplies one */
#define PF_ROWS 4
/* Bytes ahead of a weight stream that a one-row product asks for into L2 */
#define STREAM_AHEAD 16384

/* Lanes 0-7 p[0], lanes 8-15 p[1] (the scales of a block pair; with `one`, p[0] and zeros:
 * an odd last block, nothing read past it). */
static inline __m512 pair_scale(const float *p, int one) {
    const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_permutexvar_ps(halves, _mm512_maskz_loadu_ps(one ? 0x1 : 0x3, p));
}

/* The scales of a block pair in the lanes of its codes (pair_codes): lanes 0-3 and 8-11
 * p[0], 4-7 and 12-15 p[1] (two broadcasts from memory and a blend: no shuffle); with
 * `one`, p[0] everywhere (an odd last block's eight lanes; nothing read past it). */
static inline __m512 pair_lanes(const float *p, int one) {
    if (one) return _mm512_set1_ps(p[0]);
    return _mm512_mask_blend_ps(0xF0F0, _mm512_set1_ps(p[0]), _mm512_set1_ps(p[1]));
}

/* 256 bits in the low half of 512, zeros above. */
static inline __m512i widen(__m256i v) { return _mm512_inserti64x4(_mm512_setzero_si512(), v, 0); }

/* The int4 codes of blocks b and b + 1 (32 bytes from q) as 64 unsigned bytes in the order
 * a pair's activations are stored (quantize_rows' pair layout): the low nibbles (even
 * columns, b's sixteen then b + 1's), then the high ones (odd columns). One load of the 32
 * bytes into both halves, the upper half shifted down four bits: no shuffle across lanes. */
static inline __m512i pair_codes(const uint8_t *q) {
    const __m512i mask = _mm512_set1_epi8(0x0F);
    const __m512i shifts = _mm512_set_epi64(4, 4, 4, 4, 0, 0, 0, 0);
    __m512i both = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)q));
    return _mm512_and_si512(_mm512_srlv_epi64(both, shifts), mask); /* l0 l1 h0 h1 */
}

/* Each block's group scale (and zero point, when z is not NULL) of one weight row, for
 * groups of more than one block. */
static void block_scales(const float *s, const float *z, int groups, int per_group, float *bs,
                         float *bz) {
    for (int g = 0, b = 0; g < groups; g++)
        for (int j = 0; j < per_group; j++, b++) {
            bs[b] = s[g];
            if (z) bz[b] = z[g];
        }
}

#define LANES_UP_TO(count) ((count) >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (count)) - 1))

/* Outputs of activation rows m0 .. m0 + tile - 1 (tile <= VNNI_TILE) for one int4 weight row
 * with block scales bs and zero points bz: per block pair the codes unpacked and the weight
 * scales set once, then per row one `vpdpbusd` (exact int32 sums of code x int8 value), one
 * conversion and one multiply-add by the pair's weight x activation scales; the zero points'
 * part (scale x zero x the activations' sum, per block) is taken off the same lanes, 16
 * blocks at a time, before their one sum. As in `tile_dot`, every row takes the same
 * operations whatever the tile: a row's output does not depend on the call's other rows. */
static inline __attribute__((always_inline)) void tile_dot_vnni(
    const uint8_t *q, const float *bs, const float *bz, const Activations *a, int blocks,
    int m0, int tile, float *got) {
    __m512 acc[VNNI_TILE];
    for (int m = 0; m < VNNI_TILE; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b += 2) {
        int one = b + 1 == blocks; /* an odd last block, in the low half */
        __m512i codes = one ? widen(block_codes(q + (size_t)b * 16)) : pair_codes(q + (size_t)b * 16);
        __m512 ws = pair_lanes(bs + b, one);
        for (int m = 0; m < VNNI_TILE; m++) {
            if (m < tile) {
                size_t at = (size_t)(m0 + m) * blocks + b;
                const int8_t *xq = a->q + at * BLOCK;
                __m512i xv = one ? widen(_mm256_loadu_si256((const __m256i *)xq))
                                 : _mm512_loadu_si512((const void *)xq);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes, xv);
                __m512 sc = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(one ? 0xFF : 0xFFFF, a->wide + at * 8));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[m]);
            }
        }
    }
    for (int c = 0; c < blocks; c += 16) {
        __mmask16 lanes = LANES_UP_TO(blocks - c);
        __m512 shift = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, bs + c), _mm512_maskz_loadu_ps(lanes, bz + c));
        for (int m = 0; m < VNNI_TILE; m++) {
            if (m < tile) {
                const float *sums = a->sum + (size_t)(m0 + m) * blocks + c;
                acc[m] = _mm512_fnmadd_ps(shift, _mm512_maskz_loadu_ps(lanes, sums), acc[m]);
            }
        }
    }
    for (int m = 0; m < tile; m++) got[m] = _mm512_reduce_add_ps(acc[m]);
}

/* tile_dot_vnni's operations (so the same bits) for every weight row of a call of one
 * activation row (a decode of one request), two weight rows at a time: each pair of blocks'
 * activations loaded once for both, and two rows' chains of multiply-adds in flight where
 * one row's alone left the core waiting on it (SmolLM2's 4-bit projections, one at a time:
 * 14-16 GB/s of weights whether they came from memory or from L3). Each row's weights,
 * scales and zero points are asked for STREAM_AHEAD bytes (of codes) ahead into L2. */
static inline __attribute__((always_inline)) void row_dot4_vnni(
    const uint8_t *qweight, const float *scales, const float *zeros, const Activations *a,
    int blocks, int k, int n, float *out) {
    enum { R = 2 };
    int row = 0;
    for (; row + R <= n; row += R) {
        const uint8_t *q[R];
        const float *s[R], *z[R];
        __m512 acc[R];
        for (int r = 0; r < R; r++) {
            q[r] = qweight + (size_t)(row + r) * (k / 2);
            s[r] = scales + (size_t)(row + r) * blocks;
            z[r] = zeros + (size_t)(row + r) * blocks;
            acc[r] = _mm512_setzero_ps();
        }
        for (int b = 0; b < blocks; b += 2) {
            int one = b + 1 == blocks;
            for (int r = 0; r < R; r++) {
                if (!(b & 3)) /* a line of codes every two pairs, of scales every eight */
                    _mm_prefetch((const char *)(q[r] + (size_t)b * 16 + STREAM_AHEAD), _MM_HINT_T1);
                if (!(b & 15)) {
                    _mm_prefetch((const char *)(s[r] + b) + STREAM_AHEAD / 4, _MM_HINT_T1);
                    _mm_prefetch((const char *)(z[r] + b) + STREAM_AHEAD / 4, _MM_HINT_T1);
                }
            }
            const int8_t *xq = a->q + (size_t)b * BLOCK;
            __m512i xv = one ? widen(_mm256_loadu_si256((const __m256i *)xq))
                             : _mm512_loadu_si512((const void *)xq);
            __m512 wide = _mm512_maskz_loadu_ps(one ? 0xFF : 0xFFFF, a->wide + (size_t)b * 8);
            for (int r = 0; r < R; r++) {
                const uint8_t *codes = q[r] + (size_t)b * 16;
                __m512i c = one ? widen(block_codes(codes)) : pair_codes(codes);
                __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c, xv);
                __m512 sc = _mm512_mul_ps(pair_lanes(s[r] + b, one), wide);
                acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[r]);
            }
        }
        for (int c = 0; c < blocks; c += 16) {
            __mmask16 lanes = LANES_UP_TO(blocks - c);
            __m512 sums = _mm512_maskz_loadu_ps(lanes, a->sum + c);
            for (int r = 0; r < R; r++) {
                __m512 shift = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, s[r] + c),
                                             _mm512_maskz_loadu_ps(lanes, z[r] + c));
                acc[r] = _mm512_fnmadd_ps(shift, sums, acc[r]);
            }
        }
        for (int r = 0; r < R; r++) out[row + r] = _mm512_reduce_add_ps(acc[r]);
    }
    for (; row < n; row++) {
        float got[1];
        tile_dot_vnni(qweight + (size_t)row * (k / 2), scales + (size_t)row * blocks,
                      zeros + (size_t)row * blocks, a, blocks, 0, 1, got);
        out[row] = got[0];
    }
}

/* As tile_dot_vnni for one int8 weight row (signed x signed): the weights are offset by 128
 * as they are loaded (w ^ 0x80: unsigned), and each pair's sums start at -128 x the sum of
 * the activations of each group of four (`neg`, computed once per call for every activation
 * row, not per weight row), so a lane's int32 is the exact sum of w x value. `bs` the
 * blocks' scales, or NULL with one scale for the whole row (`row_scale`): the same
 * products either way. */
static inline __attribute__((always_inline)) void tile_dot8_vnni(
    const int8_t *w, const float *bs, float row_scale, const Activations *a, const int32_t *neg,
    int blocks, int m0, int tile, float *got, const int8_t *ahead) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    const __m512 rs = _mm512_set1_ps(row_scale);
    __m512 acc[VNNI_TILE];
    for (int m = 0; m < VNNI_TILE; m++) acc[m] = _mm512_setzero_ps();
    for (int b = 0; b < blocks; b += 2) {
        int one = b + 1 == blocks;
        const int8_t *wb = w + (size_t)b * BLOCK;
        if (ahead) _mm_prefetch((const char *)(ahead + (size_t)b * BLOCK), _MM_HINT_T0);
        __m512i wv = one ? widen(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wb),
                                                  _mm512_castsi512_si256(flip)))
                         : _mm512_xor_si512(_mm512_loadu_si512((const void *)wb), flip);
        __m512 ws = bs ? pair_scale(bs + b, one) : rs;
        for (int m = 0; m < VNNI_TILE; m++) {
            if (m < tile) {
                size_t at = (size_t)(m0 + m) * blocks + b;
                const int8_t *xq = a->q + at * BLOCK;
                __m512i xv = one ? widen(_mm256_loadu_si256((const __m256i *)xq))
                                 : _mm512_loadu_si512((const void *)xq);
                __m512i start = _mm512_maskz_loadu_epi32(one ? 0xFF : 0xFFFF, neg + at * 8);
                __m512i dot = _mm512_dpbusd_epi32(start, wv, xv);
                __m512 sc = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(one ? 0xFF : 0xFFFF, a->wide + at * 8));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc[m]);
            }
        }
    }
    for (int m = 0; m < tile; m++) got[m] = _mm512_reduce_add_ps(acc[m]);
}

/* tile_dot8_vnni's operations for every weight row of a call of one activation row (a
 * decode of one request), so the same bits, in a loop of their own without the tile's
 * bookkeeping; `per_row`: one scale per weight row. Each step asks for the line
 * STREAM_AHEAD bytes on into L2: the hardware's prefetchers alone kept SmolLM2's weights
 * (on huge pages) coming at about 23 GB/s, its LM head with a scale per block at 18, where a
 * plain read of them reaches 27; with it they come at 26-29 (a line 2 KB ahead, or one into
 * L1, was slower than none). Past a matrix's end it asks for the next one's first lines,
 * which a decode step reads next where they are on huge pages in that order. */
static inline __attribute__((always_inline)) void row_dot8_vnni(
    const int8_t *weight, const float *scales, int groups, int per_row, const Activations *a,
    const int32_t *neg, int blocks, int k, int n, float *out) {
    const __m512i flip = _mm512_set1_epi8((char)0x80);
    for (int row = 0; row < n; row++) {
        const int8_t *w = weight + (size_t)row * k;
        const float *bs = scales + (size_t)row * groups;
        const __m512 rs = _mm512_set1_ps(bs[0]);
        __m512 acc = _mm512_setzero_ps();
        for (int b = 0; b < blocks; b += 2) {
            int one = b + 1 == blocks;
            const int8_t *wb = w + (size_t)b * BLOCK;
            _mm_prefetch((const char *)(wb + STREAM_AHEAD), _MM_HINT_T1);
            __m512i wv = one ? widen(_mm256_xor_si256(_mm256_loadu_si256((const __m256i *)wb),
                                                      _mm512_castsi512_si256(flip)))
                             : _mm512_xor_si512(_mm512_loadu_si512((const void *)wb), flip);
            __m512 ws = per_row ? rs : pair_scale(bs + b, one);
            const int8_t *xq = a->q + (size_t)b * BLOCK;
            __m512i xv = one ? widen(_mm256_loadu_si256((const __m256i *)xq))
                             : _mm512_loadu_si512((const void *)xq);
            __m512i start = _mm512_maskz_loadu_epi32(one ? 0xFF : 0xFFFF, neg + (size_t)b * 8);
            __m512i dot = _mm512_dpbusd_epi32(start, wv, xv);
            __m512 sc = _mm512_mul_ps(ws, _mm512_maskz_loadu_ps(one ? 0xFF : 0xFFFF, a->wide + (size_t)b * 8));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), sc, acc);
        }
        out[row] = _mm512_reduce_add_ps(acc);
    }
}
#endif

#define MAX_ROWS 16
/* How an int4 product stores its activations (quantize_rows' `interleave`): in block pairs
 * as pair_codes unpacks them on VNNI, else each block's even columns, then its odd ones. */
#ifdef RADIXLM_VNNI
#define INT4_LAYOUT 2
#else
#define INT4_LAYOUT 1
#endif
/* The float32 product's tiles take any row count: up to this many rows meet each block of
 * weight rows while it is in cache (a prefill chunk reads the weights once per call). */
#define F32_MAX_ROWS 64

/* out[M, N] = x[M, K] @ dequant(qweight)^T for N weight rows (one thread's slice of the
 * product: out's rows `ldo` apart); M <= MAX_ROWS, K a multiple of `group`, `group` a
 * multiple of 32. Returns 0, or -1 when memory runs out. */
static int int4_cols(const float *x, int m_rows, int k, const uint8_t *qweight,
                     const float *scales, const float *zeros, int n, int group, float *out,
                     int ldo) {
    if (m_rows < 1 || m_rows > MAX_ROWS || group % BLOCK || k % group) return -1;
    int blocks = k / BLOCK, per_group = group / BLOCK, groups = k / group;
    Activations a;
    if (prepare(x, m_rows, k, INT4_LAYOUT, &a)) return -1;
#ifdef RADIXLM_VNNI
    /* groups of several blocks: each block's scale and zero point, per weight row */
    float *expanded = per_group > 1 ? malloc(sizeof(float) * 2 * (size_t)blocks) : NULL;
    if (per_group > 1 && !expanded) {
        release(&a);
        return -1;
    }
    if (m_rows == 1 && !expanded) {
        row_dot4_vnni(qweight, scales, zeros, &a, blocks, k, n, out);
        n = 0; /* done */
    }
    for (int row = 0; row < n; row++) {
        const uint8_t *q = qweight + (size_t)row * (k / 2);
        const float *bs = scales + (size_t)row * groups, *bz = zeros + (size_t)row * groups;
        if (expanded) {
            block_scales(bs, bz, groups, per_group, expanded, expanded + blocks);
            bs = expanded, bz = expanded + blocks;
        }
        for (int m0 = 0, tile; m0 < m_rows; m0 += tile) {
            float got[VNNI_TILE];
            tile = m_rows - m0 < VNNI_TILE ? m_rows - m0 : VNNI_TILE;
            switch (tile) { /* constant tiles: their loops unroll */
            case 1: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 1, got); break;
            case 2: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 2, got); break;
            case 3: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 3, got); break;
            case 4: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 4, got); break;
            case 5: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 5, got); break;
            case 6: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 6, got); break;
            case 7: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 7, got); break;
            default: tile_dot_vnni(q, bs, bz, &a, blocks, m0, 8, got);
            }
            for (int m = 0; m < tile; m++) out[(size_t)(m0 + m) * ldo + row] = got[m];
        }
    }
    free(expanded);
    release(&a);
    return 0;
#endif
    const int8_t *xq = a.q;
    const float *xs = a.scale, *xsum = a.sum;
    for (int row = 0; row < n; row++) {
        const uint8_t *q = qweight + (size_t)row * (k / 2);
        const float *s = scales + (size_t)row * groups;
        const float *z = zeros + (size_t)row * groups;
#ifdef RADIXLM_AVX2
        /* Activation rows four at a time: each block's codes unpacked once per tile, the
         * tile's accumulators in registers. */
        for (int m0 = 0; m0 < m_rows; m0 += TILE) {
            int tile = m_rows - m0 < TILE ? m_rows - m0 : TILE;
            float got[TILE];
            tile_dot(q, s, z, xq, xs, xsum, blocks, per_group, m0, tile, got);
            for (int m = 0; m < tile; m++) out[(size_t)(m0 + m) * ldo + row] = got[m];
        }
#else
        float acc[MAX_ROWS] = {0}, offset[MAX_ROWS] = {0};
        for (int b = 0; b < blocks; b++) {
            int g = b / per_group; /* (the scalar path is not the fast one) */
            const uint8_t *bytes = q + (size_t)b * (BLOCK / 2);
            for (int m = 0; m < m_rows; m++) {
                size_t at = (size_t)m * blocks + b;
                const int8_t *v = xq + at * BLOCK;
                int32_t dot = 0;
                for (int i = 0; i < BLOCK / 2; i++) {
                    dot += (bytes[i] & 0x0F) * v[i] + (bytes[i] >> 4) * v[BLOCK / 2 + i];
                }
                acc[m] += s[g] * xs[at] * (float)dot;
                offset[m] += s[g] * z[g] * xsum[at];
            }
        }
        for (int m = 0; m < m_rows; m++) out[(size_t)m * ldo + row] = acc[m] - offset[m];
#endif
    }
    release(&a);
    return 0;
}

#ifdef RADIXLM_AVX2
/* Outputs of activation rows m0 .. m0 + tile - 1 (tile <= TILE) for one int8 weight row:
 * each block's |w| computed once per tile, two accumulators per row by block parity; as in
 * `tile_dot`, a row's output does not depend on the call's other rows. */
static inline void tile_dot8(const int8_t *w, const float *ws, const int8_t *xq, const float *xs,
                             int blocks, int per_group, int m0, int tile, float *got) {
    const __m256i ones = _mm256_set1_epi16(1);
    __m256 acc0[TILE], acc1[TILE];
    for (int m = 0; m < TILE; m++) acc0[m] = acc1[m] = _mm256_setzero_ps();
    for (int b = 0; b < blocks; b++) {
        __m256i wv = _mm256_loadu_si256((const __m256i *)(w + (size_t)b * BLOCK));
        /* signed x signed: |w| times x carrying w's sign (|w|, |x| <= 127: no saturation) */
        __m256i magnitude = _mm256_sign_epi8(wv, wv);
        float scale = ws[b / per_group];
        for (int m = 0; m < TILE; m++) {
            if (m < tile) {
                size_t at = (size_t)(m0 + m) * blocks + b;
                __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + at * BLOCK));
                __m256i pairs = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(xv, wv));
                __m256 dot = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, ones));
                __m256 sc = _mm256_set1_ps(scale * xs[at]);
                if (b & 1)
                    acc1[m] = _mm256_fmadd_ps(dot, sc, acc1[m]);
                else
                    acc0[m] = _mm256_fmadd_ps(dot, sc, acc0[m]);
            }
        }
    }
    for (int m = 0; m < tile; m++) got[m] = hsum(_mm256_add_ps(acc0[m], acc1[m]));
}
#endif

/* out[M, N] = x[M, K] @ (w * scale)^T for int8 weights w [N, K] with a float scale per group
 * of `group` columns (scales [N, K / group]; group = K: one per row). Activations rounded to
 * int8 per block of 32 (llama.cpp's Q8_0 x Q8_0). One thread's slice: out's rows `ldo`
 * apart. Returns 0, or -1 when memory runs out. */
static int int8_cols(const float *x, int m_rows, int k, const int8_t *weight,
                     const float *scales, int n, int group, float *out, int ldo) {
    if (m_rows < 1 || m_rows > MAX_ROWS || group % BLOCK || k % group) return -1;
    int blocks = k / BLOCK, per_group = group / BLOCK, groups = k / group;
    Activations a;
    if (prepare(x, m_rows, k, 0, &a)) return -1;
#ifdef RADIXLM_VNNI
    /* one scale per row: broadcast; else per block (a copy when groups span blocks) */
    int per_row = groups == 1;
    float *expanded = per_group > 1 && !per_row ? malloc(sizeof(float) * (size_t)blocks) : NULL;
    int32_t *neg = malloc(sizeof(int32_t) * (size_t)m_rows * k / 4);
    if ((per_group > 1 && !per_row && !expanded) || !neg) {
        free(expanded), free(neg);
        release(&a);
        return -1;
    }
    for (size_t i = 0; i < (size_t)m_rows * k / 4; i++)
        neg[i] = -128 * (a.q[4 * i] + a.q[4 * i + 1] + a.q[4 * i + 2] + a.q[4 * i + 3]);
    if (m_rows == 1 && !expanded) {
        if (per_row)
            row_dot8_vnni(weight, scales, groups, 1, &a, neg, blocks, k, n, out);
        else
            row_dot8_vnni(weight, scales, groups, 0, &a, neg, blocks, k, n, out);
        n = 0; /* done */
    }
    for (int row = 0; row < n; row++) {
        const int8_t *w = weight + (size_t)row * k;
        const float *bs = scales + (size_t)row * groups;
        float row_scale = bs[0];
        if (per_row) {
            bs = NULL;
        } else if (expanded) {
            block_scales(bs, NULL, groups, per_group, expanded, NULL);
            bs = expanded;
        }
        for (int m0 = 0, tile; m0 < m_rows; m0 += tile) {
            float got[VNNI_TILE];
            /* the first tile meets each row from memory: fetch a later one early */
            const int8_t *ahead = m0 == 0 && row + PF_ROWS < n ? w + (size_t)PF_ROWS * k : NULL;
            tile = m_rows - m0 < VNNI_TILE ? m_rows - m0 : VNNI_TILE;
            switch (tile) { /* constant tiles: their loops unroll */
            case 1: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 1, got, ahead); break;
            case 2: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 2, got, ahead); break;
            case 3: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 3, got, ahead); break;
            case 4: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 4, got, ahead); break;
            case 5: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 5, got, ahead); break;
            case 6: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 6, got, ahead); break;
            case 7: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 7, got, ahead); break;
            default: tile_dot8_vnni(w, bs, row_scale, &a, neg, blocks, m0, 8, got, ahead);
            }
            for (int m = 0; m < tile; m++) out[(size_t)(m0 + m) * ldo + row] = got[m];
        }
    }
    free(expanded), free(neg);
    release(&a);
    return 0;
#endif
    const int8_t *xq = a.q;
    const float *xs = a.scale;
    for (int row = 0; row < n; row++) {
        const int8_t *w = weight + (size_t)row * k;
        const float *ws = scales + (size_t)row * groups;
#ifdef RADIXLM_AVX2
        for (int m0 = 0; m0 < m_rows; m0 += TILE) {
            int tile = m_rows - m0 < TILE ? m_rows - m0 : TILE;
            float got[TILE];
            tile_dot8(w, ws, xq, xs, blocks, per_group, m0, tile, got);
            for (int m = 0; m < tile; m++) out[(size_t)(m0 + m) * ldo + row] = got[m];
        }
#else
        for (int m = 0; m < m_rows; m++) {
            size_t at = (size_t)m * blocks;
            float acc = 0.0f;
            for (int b = 0; b < blocks; b++) {
                int32_t dot = 0;
                for (int i = 0; i < BLOCK; i++) dot += w[b * BLOCK + i] * xq[(at + b) * BLOCK + i];
                acc += ws[b / per_group] * xs[at + b] * (float)dot;
            }
            out[(size_t)m * ldo + row] = acc;
        }
#endif
    }
    release(&a);
    return 0;
}

#ifdef RADIXLM_AVX2
/* Outputs of activation rows x[0 .. tile-1] (tile <= TILE, rows `k` apart) for the two
 * float32 weight rows w0 and w1: eight accumulators, each 8-column step loading the two
 * weight vectors once for every row of the tile. Columns past the last multiple of 8 are
 * the caller's. */
static inline __attribute__((always_inline)) void f32_tile(const float *x, int k, int k8,
                                                           const float *w0, const float *w1,
                                                           const float *ahead, int tile,
                                                           float got[TILE][2]) {
    __m256 a0[TILE], a1[TILE];
    for (int m = 0; m < TILE; m++) a0[m] = _mm256_setzero_ps(), a1[m] = _mm256_setzero_ps();
    for (int i = 0; i < k8; i += 8) {
        if (ahead && !(i & 15)) { /* the next pair's rows, one cache line each per 16 columns */
            _mm_prefetch((const char *)(ahead + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k + i), _MM_HINT_T1);
        }
        __m256 v0 = _mm256_loadu_ps(w0 + i), v1 = _mm256_loadu_ps(w1 + i);
        /* in registers: without this gcc folds each use into the FMA as another load */
        __asm__("" : "+x"(v0), "+x"(v1));
        for (int m = 0; m < TILE; m++) {
            if (m < tile) {
                __m256 xv = _mm256_loadu_ps(x + (size_t)m * k + i);
                a0[m] = _mm256_fmadd_ps(xv, v0, a0[m]);
                a1[m] = _mm256_fmadd_ps(xv, v1, a1[m]);
            }
        }
    }
    for (int m = 0; m < tile; m++) got[m][0] = hsum(a0[m]), got[m][1] = hsum(a1[m]);
}

/* One activation row against four weight rows (batch 1: bound by reading the weights). */
static inline void f32_row4(const float *x, int k8, const float *w, int k, float got[4]) {
    __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
    for (int i = 0; i < k8; i += 8) {
        __m256 xv = _mm256_loadu_ps(x + i);
        for (int r = 0; r < 4; r++)
            a[r] = _mm256_fmadd_ps(xv, _mm256_loadu_ps(w + (size_t)r * k + i), a[r]);
    }
    for (int r = 0; r < 4; r++) got[r] = hsum(a[r]);
}
#endif

/* Weight rows per block of the float32 product over more than one row: each block (16 rows
 * of K floats, in L2) meets the activation rows one tile at a time (in L1). The float32
 * tiles ask for the next rows' lines into L2 (prefetcht1; into L1 the requests held the
 * core's few L1 miss buffers and the products' loads waited: SmolLM2's 30 layers streamed
 * from memory at 8 rows took 37.6 ms that way, 23.7 ms this way, at 4 rows 30.3 -> 15.9). */
#define F32_BLOCK_ROWS 16

#if defined(RADIXLM_AVX2) && defined(__AVX512F__)
#define RADIXLM_F32_AVX512 1
/* The four sums of a, b, c and d's lanes. */
static inline __m128 hsum4_512(__m512 a, __m512 b, __m512 c, __m512 d) {
#define HALVES(v)                                                                              \
    _mm256_add_ps(_mm512_castps512_ps256(v),                                                   \
                  _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))
    __m256 ab = _mm256_hadd_ps(HALVES(a), HALVES(b)), cd = _mm256_hadd_ps(HALVES(c), HALVES(d));
#undef HALVES
    __m256 abcd = _mm256_hadd_ps(ab, cd);
    return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/* The sum of v's lanes, added in the order hsum4_512 adds each of its vectors' (so that both
 * tiles give a row the same bits). */
static inline float hsum512(__m512 v) {
    __m256 h = _mm256_add_ps(_mm512_castps512_ps256(v),
                             _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)));
    __m256 t = _mm256_hadd_ps(h, h);
    t = _mm256_hadd_ps(t, t);
    return _mm_cvtss_f32(_mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
}

/* Outputs of activation rows x[0 .. tile-1] (tile <= 4, rows `k` apart, k a multiple of 16)
 * for the four float32 weight rows from w (`k` apart), into out (rows `n` apart): sixteen
 * 512-bit accumulators, each 16-column step loading four weight and four activation
 * vectors for sixteen multiply-adds (AVX2's tile loads six for eight). */
static inline __attribute__((always_inline)) void f32_tile4x4(const float *x, int k,
                                                              const float *w,
                                                              const float *ahead, int tile,
                                                              float *out, int n) {
    __m512 acc[4][4];
    for (int m = 0; m < 4; m++)
        for (int r = 0; r < 4; r++) acc[m][r] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        if (ahead)
            for (int r = 0; r < 4; r++) _mm_prefetch((const char *)(ahead + (size_t)r * k + i), _MM_HINT_T1);
        __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + k + i);
        __m512 w2 = _mm512_loadu_ps(w + 2 * (size_t)k + i), w3 = _mm512_loadu_ps(w + 3 * (size_t)k + i);
        __asm__("" : "+v"(w0), "+v"(w1), "+v"(w2), "+v"(w3));
        for (int m = 0; m < 4; m++) {
            if (m < tile) {
                __m512 xv = _mm512_loadu_ps(x + (size_t)m * k + i);
                acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
                acc[m][2] = _mm512_fmadd_ps(xv, w2, acc[m][2]);
                acc[m][3] = _mm512_fmadd_ps(xv, w3, acc[m][3]);
            }
        }
    }
    for (int m = 0; m < tile; m++)
        _mm_storeu_ps(out + (size_t)m * n, hsum4_512(acc[m][0], acc[m][1], acc[m][2], acc[m][3]));
}

/* As f32_tile4x4 for two weight rows and up to eight activation rows (one pass of a block
 * for a batch of eight). */
static inline __attribute__((always_inline)) void f32_tile2x8(const float *x, int k,
                                                              const float *w,
                                                              const float *ahead, int tile,
                                                              float *out, int n) {
    __m512 acc[8][2];
    for (int m = 0; m < 8; m++) acc[m][0] = _mm512_setzero_ps(), acc[m][1] = _mm512_setzero_ps();
    for (int i = 0; i < k; i += 16) {
        if (ahead) {
            _mm_prefetch((const char *)(ahead + i), _MM_HINT_T1);
            _mm_prefetch((const char *)(ahead + k + i), _MM_HINT_T1);
        }
        __m512 w0 = _mm512_loadu_ps(w + i), w1 = _mm512_loadu_ps(w + k + i);
        __asm__("" : "+v"(w0), "+v"(w1));
        for (int m = 0; m < 8; m++) {
            if (m < tile) {
                __m512 xv = _mm512_loadu_ps(x + (size_t)m * k + i);
                acc[m][0] = _mm512_fmadd_ps(xv, w0, acc[m][0]);
                acc[m][1] = _mm512_fmadd_ps(xv, w1, acc[m][1]);
            }
        }
    }
    for (int m = 0; m < tile; m++) {
        out[(size_t)m * n] = hsum512(acc[m][0]);
        out[(size_t)m * n + 1] = hsum512(acc[m][1]);
    }
}

/* The product over 1..F32_MAX_ROWS rows with 512-bit vectors, for K a multiple of 16 and N of 4:
 * tiles of 4 x 4 below eight rows, of 2 weight rows x 8 from eight on (measured on an
 * AVX-512 EPYC: 2 x 8 is 5-20% faster at 8-16 rows, 4 x 4 faster below). */
static void f32_gemv_avx512(const float *x, int m_rows, int k, const float *weight, int n,
                            float *out, int ldo) {
    const int wide = m_rows >= 8; /* tiles of eight rows: one pass over a block at batch 8 */
    const int rows_per_tile = wide ? 8 : 4, weights_per_tile = wide ? 2 : 4;
    for (int first = 0; first < n; first += F32_BLOCK_ROWS) {
        int last = first + F32_BLOCK_ROWS < n ? first + F32_BLOCK_ROWS : n;
        for (int m0 = 0; m0 < m_rows; m0 += rows_per_tile) {
            int tile = m_rows - m0 < rows_per_tile ? m_rows - m0 : rows_per_tile;
            const float *xm = x + (size_t)m0 * k;
            for (int row = first; row < last; row += weights_per_tile) {
                const float *w = weight + (size_t)row * k;
                /* the first tile meets each group from memory: fetch the next one early */
                const float *next = w + (size_t)weights_per_tile * k;
                const float *ahead = m0 == 0 && row + 2 * weights_per_tile <= n ? next : NULL;
                float *o = out + (size_t)m0 * ldo + row;
                /* full tiles with constant sizes (unrolled), the last one as it comes */
                if (wide && tile == 8)
                    f32_tile2x8(xm, k, w, ahead, 8, o, ldo);
                else if (wide)
                    f32_tile2x8(xm, k, w, ahead, tile, o, ldo);
                else if (tile == 4)
                    f32_tile4x4(xm, k, w, ahead, 4, o, ldo);
                else
                    f32_tile4x4(xm, k, w, ahead, tile, o, ldo);
            }
        }
    }
}
#endif

/* out[M, N] = x[M, K] @ w^T for float32 weights w [N, K] (any K), in float32 with fused
 * multiply-adds: a product for few rows without a library's dispatch. One thread's slice of
 * a product of `whole_n` weight rows (which picks the vector path: every slice takes the
 * same one), out's rows `ldo` apart. Returns 0. */
static int f32_cols(const float *x, int m_rows, int k, const float *weight, int n, float *out,
                    int ldo, int whole_n) {
    if (m_rows < 1 || m_rows > F32_MAX_ROWS || k < 1) return -1;
    int k8 = 0, row = 0;
#ifdef RADIXLM_F32_AVX512
    /* Every row count (one too) takes the same tiles: a row's output does not depend on
     * the call's other rows. */
    if (k % 16 == 0 && whole_n % 4 == 0) { /* (the whole product's N: one path for every slice) */
        f32_gemv_avx512(x, m_rows, k, weight, n, out, ldo);
        return 0;
    }
#endif
#ifdef RADIXLM_AVX2
    k8 = k & ~7;
    if (m_rows == 1) {
        for (; row + 4 <= n; row += 4) f32_row4(x, k8, weight + (size_t)row * k, k, out + row);
    } else {
        /* Pairs of weight rows up to the last multiple of 4, as the one-row loop above: the
         * rest take the plain loop at every row count (a row's bits do not depend on it). */
        int pairs = n & ~3;
        for (int first = 0; first < pairs; first += F32_BLOCK_ROWS) {
            int last = first + F32_BLOCK_ROWS < pairs ? first + F32_BLOCK_ROWS : pairs;
            for (int m0 = 0; m0 < m_rows; m0 += TILE) {
                int tile = m_rows - m0 < TILE ? m_rows - m0 : TILE;
                const float *xm = x + (size_t)m0 * k;
                for (row = first; row < last; row += 2) {
                    const float *w0 = weight + (size_t)row * k, *w1 = w0 + k;
                    /* the first tile meets each pair from memory: fetch the next one early */
                    const float *ahead = m0 == 0 && row + 3 < n ? w1 + k : NULL;
                    float got[TILE][2];
                    if (tile == TILE)
                        f32_tile(xm, k, k8, w0, w1, ahead, TILE, got);
                    else
                        f32_tile(xm, k, k8, w0, w1, ahead, tile, got);
                    for (int m = 0; m < tile; m++) {
                        out[(size_t)(m0 + m) * ldo + row] = got[m][0];
                        out[(size_t)(m0 + m) * ldo + row + 1] = got[m][1];
                    }
                }
            }
        }
        row = pairs;
    }
    /* the columns past k8 of the rows done above */
    if (k8 < k)
        for (int r = 0; r < row; r++)
            for (int m = 0; m < m_rows; m++) {
                float tail = 0.0f;
                for (int i = k8; i < k; i++) tail += x[(size_t)m * k + i] * weight[(size_t)r * k + i];
                out[(size_t)m * ldo + r] += tail;
            }
#endif
    /* the rows no vector loop took (all of them without AVX2) */
    for (; row < n; row++)
        for (int m = 0; m < m_rows; m++) {
            float acc = 0.0f;
            for (int i = 0; i < k; i++) acc += x[(size_t)m * k + i] * weight[(size_t)row * k + i];
            out[(size_t)m * ldo + row] = acc;
        }
    return 0;
}

/* ---- the public products: output columns split over the threads of pool.c ---- */

/* Output columns per unit of a split: whole tiles, and the same vector paths per column. */
#define SPLIT 64

typedef struct {
    int kind; /* 4, 8 or 32 */
    const float *x;
    int m_rows, k, n, group;
    const void *weight;
    const float *scales, *zeros;
    float *out;
    atomic_int code;
} Product;

static void product_task(void *arg, int ith, int nth) {
    Product *p = arg;
    int lo, hi, code = 0;
    radixlm_split(p->n, SPLIT, ith, nth, &lo, &hi);
    if (lo >= hi) return;
    if (p->kind == 4) {
        int groups = p->k / p->group;
        code = int4_cols(p->x, p->m_rows, p->k, (const uint8_t *)p->weight + (size_t)lo * (p->k / 2),
                         p->scales + (size_t)lo * groups, p->zeros + (size_t)lo * groups, hi - lo,
                         p->group, p->out + lo, p->n);
    } else if (p->kind == 8) {
        int groups = p->k / p->group;
        code = int8_cols(p->x, p->m_rows, p->k, (const int8_t *)p->weight + (size_t)lo * p->k,
                         p->scales + (size_t)lo * groups, hi - lo, p->group, p->out + lo, p->n);
    } else {
        code = f32_cols(p->x, p->m_rows, p->k, (const float *)p->weight + (size_t)lo * p->k,
                        hi - lo, p->out + lo, p->n, p->n);
    }
    if (code) atomic_store(&p->code, code);
}

static int product(Product *p) {
    atomic_init(&p->code, 0);
    radixlm_parallel(product_task, p, radixlm_threads_for((long)p->n * p->k));
    return atomic_load(&p->code);
}

/* out[M, N] = x[M, K] @ dequant(qweight)^T; M <= MAX_ROWS, K a multiple of `group`, `group`
 * a multiple of 32. Returns 0, or -1 for shapes it does not take. */
int radixlm_int4_gemv(const float *x, int m_rows, int k, const uint8_t *qweight,
                      const float *scales, const float *zeros, int n, int group, float *out) {
    if (m_rows < 1 || m_rows > MAX_ROWS || group < BLOCK || group % BLOCK || k % group) return -1;
    Product p = {.kind = 4, .x = x, .m_rows = m_rows, .k = k, .n = n, .group = group,
                 .weight = qweight, .scales = scales, .zeros = zeros, .out = out};
    return product(&p);
}

/* out[M, N] = x[M, K] @ (w * scale)^T for int8 weights w [N, K] with a float scale per group
 * of `group` columns (see int8_cols). Returns 0, or -1 for shapes it does not take. */
int radixlm_int8_gemv(const float *x, int m_rows, int k, const int8_t *weight,
                      const float *scales, int n, int group, float *out) {
    if (m_rows < 1 || m_rows > MAX_ROWS || group < BLOCK || group % BLOCK || k % group) return -1;
    Product p = {.kind = 8, .x = x, .m_rows = m_rows, .k = k, .n = n, .group = group,
                 .weight = weight, .scales = scales, .out = out};
    return product(&p);
}

/* out[M, N] = x[M, K] @ w^T for float32 weights w [N, K] (see f32_cols). Returns 0, or -1 for
 * row counts it does not take. */
int radixlm_f32_gemv(const float *x, int m_rows, int k, const float *weight, int n, float *out) {
    if (m_rows < 1 || m_rows > F32_MAX_ROWS || k < 1) return -1;
    Product p = {.kind = 32, .x = x, .m_rows = m_rows, .k = k, .n = n, .weight = weight,
                 .out = out};
    return product(&p);
}

/* out[r] = the index of the largest of x[r * stride .. r * stride + n - 1], the first of
 * equal ones; a row with a NaN gives its first NaN (as torch.argmax does). A greedy decode
 * step's tokens: torch's argmax compares one float at a time (4 ms for 32 rows of a
 * 151,936-token vocabulary on one thread, where its max alone takes 0.4). Two passes: the
 * largest (and whether there is a NaN) sixteen at a time, then its first place, the row
 * in cache by then. */
void radixlm_argmax_rows(const float *x, int rows, int n, int64_t stride, int64_t *out) {
    for (int r = 0; r < rows; r++) {
        const float *v = x + (size_t)r * (size_t)stride;
        float top = -INFINITY;
        int nan = 0, i = 0;
#ifdef __AVX512F__
        __m512 most = _mm512_set1_ps(-INFINITY);
        __mmask16 unordered = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 e = _mm512_loadu_ps(v + i);
            unordered |= _mm512_cmp_ps_mask(e, e, _CMP_UNORD_Q);
            most = _mm512_max_ps(most, e);
        }
        nan = unordered != 0;
        top = _mm512_reduce_max_ps(most);
#endif
        for (; i < n; i++) {
            nan |= v[i] != v[i];
            top = v[i] > top ? v[i] : top;
        }
        int64_t at = 0;
        i = 0;
        if (nan) {
            while (v[i] == v[i]) i++;
            at = i;
        } else {
#ifdef __AVX512F__
            const __m512 want = _mm512_set1_ps(top);
            for (; i + 16 <= n; i += 16) {
                __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(v + i), want, _CMP_EQ_OQ);
                if (hit) break;
            }
#endif
            while (i < n && v[i] != top) i++;
            at = i < n ? i : 0; /* (n > 0: the largest is there) */
        }
        out[r] = at;
    }
}
