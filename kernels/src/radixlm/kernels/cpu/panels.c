/* Float32 products over weights laid out in panels, for any number of activation rows (the
 * pairs of panels split over pool.c's threads).
 *
 * A weight W [N, K] in panels (`radixlm.kernels.cpu.pack_f32_panels`): N is padded with zero
 * rows to a multiple of PANEL, and panel p holds rows PANEL*p .. PANEL*p + PANEL-1 column by
 * column, [K][PANEL]: column i of the panel's sixteen rows is one 64-byte line. A product
 * then multiplies each activation value, broadcast, by a whole line and adds it into sixteen
 * outputs at once: the weights stream from memory in the order they lie, every output is a
 * sum over the columns in a fixed order (one fused multiply-add per column in chunks of
 * CHUNK columns, the chunks' sums added in order: a row's result does not depend on the
 * call's other rows, nor on the tile or the vector width), and no horizontal sum is needed. The row-major product (gemv.c's f32) needs one per output, which at small K
 * (a 256- or 576-wide LM head) costs as much as the products themselves: measured on an
 * AVX-512 EPYC, a 151,936 x 256 head took 15.5 / 19.2 / 28.2 ms at 1 / 8 / 16 rows row-major
 * and 9.0 / 12.8 / 19.1 ms in panels (the weights alone stream in 9.1 ms); with each row
 * count a copy of its own and the prefetch below, 7-8 / 11 / 15.5 ms.
 *
 * Tiles: two panels (32 outputs) against up to TILE_ROWS activation rows, the accumulators in
 * registers; the pair stays in cache while every tile of rows meets it. Each row count up to
 * TILE_ROWS has its own copy of the tile (no test per row in the inner loop: 6 rows took
 * 12.3 ms with one, 9.8 without). Tiles of 4 rows or more ask for the next pair's lines as
 * they go (16 rows: 18.6 -> 15.5 ms); fewer rows leave the stream to the hardware prefetcher
 * (asking by hand made one row 10-40 % slower there). They ask for them into L2
 * (prefetcht1), not L1: each request into L1 holds one of the core's few L1 miss buffers
 * until its line arrives, and the products' own loads waited behind them. SmolLM2's 30
 * layers of products streamed from memory (406 MB on huge pages, one thread, an AVX-512
 * EPYC): 4 rows 22.1 -> 17.8 ms, 8 rows 24.7 -> 17.7 ms (the weights' read at 24 GB/s),
 * 16 rows 36.4 -> 33.2 ms (the FMAs' rate).
 */
#include <math.h>
#include <stddef.h>

#include "pool.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RADIXLM_PANELS_AVX2 1
#endif
#if defined(RADIXLM_PANELS_AVX2) && defined(__AVX512F__)
#define RADIXLM_PANELS_AVX512 1
#endif

#define PANEL 16
/* Columns summed in one run of multiply-adds before the run's sum is added into the total:
 * a sum over K in order would round K times in a row (its error grows with K); in chunks it
 * rounds about CHUNK + K / CHUNK times, fewer than the row-major product's 16 lanes. */
#define CHUNK 32

/* out[m, j] for j in [first, first + count) (count <= 2 * PANEL), rows m of this tile. */
static inline void store(float *out, size_t n, int first, int count, int m, const float *acc) {
    float *o = out + (size_t)m * n + first;
    for (int j = 0; j < count; j++) o[j] = acc[j];
}

#ifdef RADIXLM_PANELS_AVX512
#define TILE_ROWS 8
/* The tile's rows when a call has more than MANY_FROM rows (a prefill's): six rows' 12
 * accumulators and 12 totals stay in registers where eight rows' 32 did not (spilled at each
 * chunk's end). Float32 products on SmolLM2's shapes (weights in L3), one thread, an AVX-512
 * EPYC, tiles of 8 / 6 rows: 107-108 / 110-111 GFLOP/s at 128-512 rows, about even at 64,
 * 110.9 / 103.3 at 16 (a loop of FMAs alone: 116.8). Decode steps keep tiles of 8: up to 8
 * rows the weights stream from memory once, and a few more rows fill fewer tiles. */
#define MANY_ROWS 6
#define MANY_FROM 64
/* Up to TILE_ROWS rows x (one or two panels): 2 x 8 accumulators of 16 lanes for a chunk of
 * columns, added into the totals (in memory) after each chunk. */
static inline __attribute__((always_inline)) void tile512(const float *x, int k, int tile,
                                                          const float *p0, const float *p1,
                                                          float *out, size_t n,
                                                          int first, int count) {
    __m512 t0[TILE_ROWS], t1[TILE_ROWS];
    for (int start = 0; start < k; start += CHUNK) {
        int end = start + CHUNK < k ? start + CHUNK : k;
        __m512 a0[TILE_ROWS], a1[TILE_ROWS];
        for (int m = 0; m < TILE_ROWS; m++) a0[m] = _mm512_setzero_ps(), a1[m] = _mm512_setzero_ps();
        for (int i = start; i < end; i++) {
            __m512 w0 = _mm512_load_ps(p0 + (size_t)i * PANEL);
            __m512 w1 = p1 ? _mm512_load_ps(p1 + (size_t)i * PANEL) : _mm512_setzero_ps();
            if (tile >= 4 && p1) { /* the next pair's lines, at the same column */
                _mm_prefetch((const char *)(p1 + (size_t)(k + i) * PANEL), _MM_HINT_T1);
                _mm_prefetch((const char *)(p1 + (size_t)(2 * k + i) * PANEL), _MM_HINT_T1);
            }
            for (int m = 0; m < TILE_ROWS; m++) {
                if (m < tile) {
                    __m512 xv = _mm512_set1_ps(x[(size_t)m * k + i]);
                    a0[m] = _mm512_fmadd_ps(xv, w0, a0[m]);
                    if (p1) a1[m] = _mm512_fmadd_ps(xv, w1, a1[m]);
                }
            }
        }
        for (int m = 0; m < tile; m++) {
            t0[m] = start ? _mm512_add_ps(t0[m], a0[m]) : a0[m];
            t1[m] = start ? _mm512_add_ps(t1[m], a1[m]) : a1[m];
        }
    }
    float lanes[2 * PANEL];
    for (int m = 0; m < tile; m++) {
        _mm512_storeu_ps(lanes, t0[m]);
        _mm512_storeu_ps(lanes + PANEL, t1[m]);
        store(out, n, first, count, m, lanes);
    }
}
#elif defined(RADIXLM_PANELS_AVX2)
#define TILE_ROWS 4
/* Up to TILE_ROWS rows x (one or two panels): 4 x 4 accumulators of 8 lanes per chunk. */
static inline __attribute__((always_inline)) void tile256(const float *x, int k, int tile,
                                                          const float *p0, const float *p1,
                                                          float *out, size_t n,
                                                          int first, int count) {
    __m256 t[TILE_ROWS][4];
    for (int start = 0; start < k; start += CHUNK) {
        int end = start + CHUNK < k ? start + CHUNK : k;
        __m256 a[TILE_ROWS][4];
        for (int m = 0; m < TILE_ROWS; m++)
            for (int q = 0; q < 4; q++) a[m][q] = _mm256_setzero_ps();
        for (int i = start; i < end; i++) {
            const float *l0 = p0 + (size_t)i * PANEL;
            __m256 w0 = _mm256_load_ps(l0), w1 = _mm256_load_ps(l0 + 8);
            __m256 w2 = _mm256_setzero_ps(), w3 = _mm256_setzero_ps();
            if (p1) {
                const float *l1 = p1 + (size_t)i * PANEL;
                w2 = _mm256_load_ps(l1), w3 = _mm256_load_ps(l1 + 8);
            }
            for (int m = 0; m < TILE_ROWS; m++) {
                if (m < tile) {
                    __m256 xv = _mm256_broadcast_ss(x + (size_t)m * k + i);
                    a[m][0] = _mm256_fmadd_ps(xv, w0, a[m][0]);
                    a[m][1] = _mm256_fmadd_ps(xv, w1, a[m][1]);
                    if (p1) {
                        a[m][2] = _mm256_fmadd_ps(xv, w2, a[m][2]);
                        a[m][3] = _mm256_fmadd_ps(xv, w3, a[m][3]);
                    }
                }
            }
        }
        for (int m = 0; m < tile; m++)
            for (int q = 0; q < 4; q++) t[m][q] = start ? _mm256_add_ps(t[m][q], a[m][q]) : a[m][q];
    }
    float lanes[2 * PANEL];
    for (int m = 0; m < tile; m++) {
        for (int q = 0; q < 4; q++) _mm256_storeu_ps(lanes + 8 * q, t[m][q]);
        store(out, n, first, count, m, lanes);
    }
}
#else
#define TILE_ROWS 4
/* The same sums in plain C: per chunk one fused multiply-add per column, in column order,
 * each chunk's sum then added into the total. */
static void tile_c(const float *x, int k, int tile, const float *p0, const float *p1,
                   float *out, size_t n, int first, int count) {
    float total[2 * PANEL], lanes[2 * PANEL];
    for (int m = 0; m < tile; m++) {
        for (int start = 0; start < k; start += CHUNK) {
            int end = start + CHUNK < k ? start + CHUNK : k;
            for (int j = 0; j < 2 * PANEL; j++) lanes[j] = 0.0f;
            for (int i = start; i < end; i++) {
                float v = x[(size_t)m * k + i];
                for (int j = 0; j < PANEL; j++) {
                    lanes[j] = fmaf(v, p0[(size_t)i * PANEL + j], lanes[j]);
                    if (p1) lanes[PANEL + j] = fmaf(v, p1[(size_t)i * PANEL + j], lanes[PANEL + j]);
                }
            }
            for (int j = 0; j < 2 * PANEL; j++) total[j] = start ? total[j] + lanes[j] : lanes[j];
        }
        store(out, n, first, count, m, total);
    }
}
#endif

/* out[M, N] = x[M, K] @ W^T for W [N, K] in panels, one thread's slice (whole pairs of
 * panels; out's rows `ldo` apart). */
static void panels_cols(const float *x, int m_rows, int k, const float *panels, int n,
                        float *out, int ldo) {
    int count = (n + PANEL - 1) / PANEL;
    size_t stride = (size_t)k * PANEL;
#ifdef MANY_ROWS
    const int rows = m_rows <= MANY_FROM ? TILE_ROWS : MANY_ROWS;
#else
    const int rows = TILE_ROWS;
#endif
    for (int p = 0; p < count; p += 2) {
        const float *p0 = panels + (size_t)p * stride;
        const float *p1 = p + 1 < count ? p0 + stride : NULL;
        int first = p * PANEL;
        int width = n - first < 2 * PANEL ? n - first : 2 * PANEL;
        for (int m0 = 0; m0 < m_rows; m0 += rows) {
            int tile = m_rows - m0 < rows ? m_rows - m0 : rows;
            const float *xm = x + (size_t)m0 * k;
            float *om = out + (size_t)m0 * ldo;
#ifdef RADIXLM_PANELS_AVX512
            /* each row count its own copy (no test per row in the inner loop) */
            switch (p1 ? tile : 0) {
            case 8: tile512(xm, k, 8, p0, p1, om, (size_t)ldo, first, width); break;
            case 7: tile512(xm, k, 7, p0, p1, om, (size_t)ldo, first, width); break;
            case 6: tile512(xm, k, 6, p0, p1, om, (size_t)ldo, first, width); break;
            case 5: tile512(xm, k, 5, p0, p1, om, (size_t)ldo, first, width); break;
            case 4: tile512(xm, k, 4, p0, p1, om, (size_t)ldo, first, width); break;
            case 3: tile512(xm, k, 3, p0, p1, om, (size_t)ldo, first, width); break;
            case 2: tile512(xm, k, 2, p0, p1, om, (size_t)ldo, first, width); break;
            case 1: tile512(xm, k, 1, p0, p1, om, (size_t)ldo, first, width); break;
            default: tile512(xm, k, tile, p0, p1, om, (size_t)ldo, first, width);
            }
#elif defined(RADIXLM_PANELS_AVX2)
            switch (p1 ? tile : 0) {
            case 4: tile256(xm, k, 4, p0, p1, om, (size_t)ldo, first, width); break;
            case 3: tile256(xm, k, 3, p0, p1, om, (size_t)ldo, first, width); break;
            case 2: tile256(xm, k, 2, p0, p1, om, (size_t)ldo, first, width); break;
            case 1: tile256(xm, k, 1, p0, p1, om, (size_t)ldo, first, width); break;
            default: tile256(xm, k, tile, p0, p1, om, (size_t)ldo, first, width);
            }
#else
            tile_c(xm, k, tile, p0, p1, om, (size_t)ldo, first, width);
#endif
        }
    }
}

/* ---- the public product: pairs of panels split over the threads of pool.c ---- */

typedef struct {
    const float *x, *panels;
    int m_rows, k, n;
    float *out;
} PanelProduct;

static void panels_task(void *arg, int ith, int nth) {
    PanelProduct *p = arg;
    int lo, hi;
    radixlm_split(p->n, 2 * PANEL, ith, nth, &lo, &hi); /* whole pairs: the same tiles */
    if (lo < hi)
        panels_cols(p->x, p->m_rows, p->k, p->panels + (size_t)lo * p->k, hi - lo, p->out + lo,
                    p->n);
}

/* out[M, N] = x[M, K] @ W^T for W [N, K] in panels (`panels`: ceil(N / 16) panels of K x 16
 * floats, 64-byte aligned; rows past N zero). Any M >= 1. Returns 0, or -1 for shapes or an
 * alignment it does not take. */
int radixlm_f32_panels(const float *x, int m_rows, int k, const float *panels, int n,
                       float *out) {
    if (m_rows < 1 || k < 1 || n < 1 || ((size_t)panels & 63)) return -1;
    PanelProduct p = {x, panels, m_rows, k, n, out};
    radixlm_parallel(panels_task, &p, radixlm_threads_for((long)n * k));
    return 0;
}
