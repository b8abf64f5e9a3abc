/* The Linear GEMM over packed weights (gemm_packed.h): one kernel template
 * (gemm_packed_kernel.inc) instantiated per instruction set, weight type
 * and tile (gemm_packed_tiles.inc), and a driver that blocks rows and k so
 * that a block's rows of x and a panel group's block of w stay in cache
 * while every tile of the block passes over them. */
#include "kernels/cpu/gemm_packed.h"

#include <assert.h>
#include <stdint.h>
#include <string.h>

#include "kernels/cpu/vec_isa.h"

#define VEC_EXTRA_ATTR VEC_NO_TSAN
/* How far ahead of the k it multiplies a short tile prefetches each panel
 * of the weight. In a one-off timing of one row over six Janus-Pro-1B
 * layers' weights (far past the caches, one thread), it made int8 weights
 * 1.2x (AVX-512) and 1.4x (AVX2) faster and bf16 1.05x; 512 to 2048 bytes
 * did about as well. */
#define PACKED_PREFETCH_BYTES 1024
#define PACKED_CAT(isa, w, mr, np) packed_##isa##_##w##_##mr##x##np
#define PACKED_FN(isa, w, mr, np) PACKED_CAT(isa, w, mr, np)
#define PACKED_WIDEN_CAT(isa) packed_##isa##_widen
#define PACKED_WIDEN_FN(isa) PACKED_WIDEN_CAT(isa)

/* ---- AVX-512: 8, 4, 2 or 1 rows x 3 panels (up to 24 of the 32 registers) ---- */

#include "vec_avx512.inc"
#define PACKED_ISA avx512
#define PACKED_MR 8
#define PACKED_NP_MR 3
#define PACKED_NP_4 3
#define PACKED_NP_2 3
#define PACKED_NP_1 3
#include "gemm_packed_types.inc"
#include "vec_undef.inc"

/* ---- AVX2 + FMA: 6 or 4 rows x 1 panel, 2 or 1 rows x 3 panels (up to 12
 * of the 16 registers: short tiles go wide, so that a panel row loaded
 * still serves several multiply-adds) ---- */

#include "vec_avx2.inc"
#define PACKED_ISA avx2
#define PACKED_MR 6
#define PACKED_NP_MR 1
#define PACKED_NP_4 1
#define PACKED_NP_2 3
#define PACKED_NP_1 3
#include "gemm_packed_types.inc"
#include "vec_undef.inc"

/* ---- portable C: 6, 4, 2 or 1 rows x 1 panel ---- */

#include "vec_portable.inc"
#define PACKED_ISA portable
#define PACKED_MR 6
#define PACKED_NP_MR 1
#define PACKED_NP_4 1
#define PACKED_NP_2 1
#define PACKED_NP_1 1
#include "gemm_packed_types.inc"
#include "vec_undef.inc"

/* ---- dispatch ---- */

typedef void (*tile_fn)(int kc, const float *x, int ldx, const void *wp, size_t pstride,
                        const float *scale, float *y, int ldy, int ncols);

enum { W_F32, W_BF16, W_F16, W_I8, W_F8, W_N };
enum { N_HEIGHTS = 4 }; /* the widest tile's rows, 4, 2, 1 */

/* An instruction set's tiles for one weight type: heights mr[h], each
 * np[h] panels wide (wide[h]) and one panel wide (one[h], for the panels
 * short of np[h] at the end of a group); a group is the widest np. */
typedef struct tiles {
    int group, mr[N_HEIGHTS], np[N_HEIGHTS];
    tile_fn wide[N_HEIGHTS], one[N_HEIGHTS];
} tiles_t;

#define PACKED_TILES(isa, w, mr, np_mr, np_4, np_2, np_1)                                          \
    {                                                                                              \
        np_mr > np_2 ? np_mr : np_2, {mr, 4, 2, 1}, {np_mr, np_4, np_2, np_1},                     \
            {PACKED_FN(isa, w, mr, np_mr), PACKED_FN(isa, w, 4, np_4), PACKED_FN(isa, w, 2, np_2), \
             PACKED_FN(isa, w, 1, np_1)},                                                          \
        {                                                                                          \
            PACKED_FN(isa, w, mr, 1), PACKED_FN(isa, w, 4, 1), PACKED_FN(isa, w, 2, 1),            \
                PACKED_FN(isa, w, 1, 1)                                                            \
        }                                                                                          \
    }

static const tiles_t TILES[VEC_N_ISA][W_N] = {
    [VEC_AVX512] = {PACKED_TILES(avx512, f32, 8, 3, 3, 3, 3),
                    PACKED_TILES(avx512, bf16, 8, 3, 3, 3, 3),
                    PACKED_TILES(avx512, f16, 8, 3, 3, 3, 3),
                    PACKED_TILES(avx512, i8, 8, 3, 3, 3, 3),
                    PACKED_TILES(avx512, f8, 8, 3, 3, 3, 3)},
    [VEC_AVX2] = {PACKED_TILES(avx2, f32, 6, 1, 1, 3, 3), PACKED_TILES(avx2, bf16, 6, 1, 1, 3, 3),
                  PACKED_TILES(avx2, f16, 6, 1, 1, 3, 3), PACKED_TILES(avx2, i8, 6, 1, 1, 3, 3),
                  PACKED_TILES(avx2, f8, 6, 1, 1, 3, 3)},
    [VEC_PORTABLE] = {PACKED_TILES(portable, f32, 6, 1, 1, 1, 1),
                      PACKED_TILES(portable, bf16, 6, 1, 1, 1, 1),
                      PACKED_TILES(portable, f16, 6, 1, 1, 1, 1),
                      PACKED_TILES(portable, i8, 6, 1, 1, 1, 1),
                      PACKED_TILES(portable, f8, 6, 1, 1, 1, 1)},
};

/* Rows a block: their k block of x (64 KiB) stays in L2 while the panel
 * groups pass. */
#define PACKED_MC 64

/* The tile height for the next of rem rows: the tallest no taller than
 * an even share of them over as few tiles as the tallest needs (8 rows
 * on AVX2 go 4 + 4, not 6 + 2: a short tile reads the panels for few rows). */
static int height(const tiles_t *t, int rem) {
    const int tiles = (rem + t->mr[0] - 1) / t->mr[0], share = (rem + tiles - 1) / tiles;
    int h = 0;
    while (t->mr[h] > share)
        h++;
    return h;
}

int gemm_packed_depth(int K, dtype_t wt) {
    return wt == DTYPE_BF16 ? (K + GEMM_TILE_DEPTH - 1) / GEMM_TILE_DEPTH * GEMM_TILE_DEPTH : K;
}

size_t gemm_packed_elems(int N, int K, dtype_t wt) {
    return (size_t)((N + GEMM_PANEL - 1) / GEMM_PANEL) * GEMM_PANEL *
           (size_t)gemm_packed_depth(K, wt);
}

const void *gemm_packed_panel(const void *wp, dtype_t wt, int K, int p) {
    return (const char *)wp +
           (size_t)p * GEMM_PANEL * (size_t)gemm_packed_depth(K, wt) * dtype_size(wt);
}

void gemm_packed_pack(void *dst, const void *w, dtype_t wt, int N, int K, int ldw) {
    const size_t es = dtype_size(wt);
    const int n_panels = (N + GEMM_PANEL - 1) / GEMM_PANEL, depth = gemm_packed_depth(K, wt);
    for (int p = 0; p < n_panels; p++) {
        char *panel = (char *)dst + (size_t)p * GEMM_PANEL * depth * es;
        for (int j = 0; j < GEMM_PANEL; j++) {
            const int n = p * GEMM_PANEL + j;
            const char *from = (const char *)w + (size_t)n * ldw * es;
            for (int k = 0; k < depth; k++) {
                const size_t at = wt == DTYPE_BF16
                                      ? (size_t)(k / 2) * 2 * GEMM_PANEL + (size_t)j * 2 + k % 2
                                      : (size_t)k * GEMM_PANEL + j;
                if (n < N && k < K)
                    memcpy(panel + at * es, from + (size_t)k * es, es);
                else
                    memset(panel + at * es, 0, es);
            }
        }
    }
}

static int weight_kind(dtype_t wt) {
    switch (wt) {
    case DTYPE_BF16:
        return W_BF16;
    case DTYPE_F16:
        return W_F16;
    case DTYPE_I8:
        return W_I8;
    case DTYPE_F8_E4M3:
        return W_F8;
    default:
        return W_F32;
    }
}

void gemm_packed(int M, int N, int K, const float *x, int ldx, const void *wp, dtype_t wt, float *y,
                 int ldy) {
    assert(!dtype_is_weight8(wt));
    gemm_packed_scaled(M, N, K, x, ldx, wp, wt, NULL, y, ldy);
}

/* The widening of 16-bit weights, per instruction set
 * (gemm_packed_widen.inc). */
typedef void (*widen_fn)(float *dst, const void *src, dtype_t wt, int np, size_t pstride, int kc);
static const widen_fn WIDEN[VEC_N_ISA] = {[VEC_AVX512] = PACKED_WIDEN_FN(avx512),
                                          [VEC_AVX2] = PACKED_WIDEN_FN(avx2),
                                          [VEC_PORTABLE] = PACKED_WIDEN_FN(portable)};

/* The most panels a group: its k block of widened weights is on the stack. */
#define PACKED_GROUP_MAX 3

/* From how many rows 16-bit weights are widened to fp32, a panel group's k
 * block at a time, for the fp32 tiles of all the rows, in place of each tile
 * converting the weights it reads (about a quarter of an AVX2 6 x 16 tile's
 * time). Measured with bench/gemm_bench on AVX2 (bf16, geometric mean of
 * its shapes, widened over converting, two runs): 1.12x slower at 12 rows,
 * 1.09-1.15x at 16, 0.94-0.99x at 24 and 32, 0.84-0.89x at 64, 0.78-0.85x
 * from 128 to 576. */
#define PACKED_WIDEN_ROWS 24

/* Widened rows go in blocks of at most this many, split evenly: a block's k
 * block of x (up to 256 KiB) stays in L2 while every panel group passes over
 * it, and each weight is widened once a block (a few cycles per 8 weights
 * against the block's 256 multiply-adds per weight). As one block of every
 * row, x's k block streamed from L3 for each panel group once a scale had
 * thousands of rows: `gemm_bench --dtype bf16 --rows 576,2048` on a 2-core
 * AVX2 Zen 3 went from 0.74-0.81x OpenBLAS's speed (geometric mean of the
 * shapes, two runs) to 0.95x at 2,048 rows, 0.96-1.01x to 0.95-0.96x at 576. */
#define PACKED_WIDEN_MC 256

void gemm_packed_scaled(int M, int N, int K, const float *x, int ldx, const void *wp, dtype_t wt,
                        const float *scale, float *y, int ldy) {
    if (M <= 0 || N <= 0 || K <= 0)
        return;
    assert(!dtype_is_weight8(wt) || scale);
    const vec_isa_t isa = vec_isa();
    const size_t es = dtype_size(wt), pstride = (size_t)gemm_packed_depth(K, wt) * GEMM_PANEL;
    const int n_panels = (N + GEMM_PANEL - 1) / GEMM_PANEL;
    const int widen = (wt == DTYPE_BF16 || wt == DTYPE_F16) && M >= PACKED_WIDEN_ROWS;
    const tiles_t *t = &TILES[isa][widen ? W_F32 : weight_kind(wt)];
    const int blocks = (M + PACKED_WIDEN_MC - 1) / PACKED_WIDEN_MC;
    const int mc = widen ? (M + blocks - 1) / blocks : PACKED_MC;
    assert(t->group <= PACKED_GROUP_MAX);
    float wide[PACKED_GROUP_MAX * GEMM_PANEL * GEMM_KC];
    for (int m0 = 0; m0 < M; m0 += mc) {
        const int m1 = M - m0 < mc ? M : m0 + mc;
        for (int g = 0; g < n_panels; g += t->group) {
            const int g_end = n_panels - g < t->group ? n_panels : g + t->group;
            for (int k0 = 0; k0 < K; k0 += GEMM_KC) {
                const int kc = K - k0 < GEMM_KC ? K - k0 : GEMM_KC;
                /* The group's k block: panel p at wk + (p - g) * ps elements of size wes. */
                const char *wk =
                    (const char *)wp + ((size_t)g * pstride + (size_t)k0 * GEMM_PANEL) * es;
                size_t ps = pstride, wes = es;
                if (widen) {
                    WIDEN[isa](wide, wk, wt, g_end - g, pstride, kc);
                    wk = (const char *)wide, ps = (size_t)kc * GEMM_PANEL, wes = sizeof(float);
                }
                for (int m = m0; m < m1;) {
                    const int h = height(t, m1 - m);
                    for (int p = g; p < g_end;) {
                        const int np = g_end - p >= t->np[h] ? t->np[h] : 1;
                        const int n0 = p * GEMM_PANEL;
                        const int cols = N - n0 < np * GEMM_PANEL ? N - n0 : np * GEMM_PANEL;
                        (np == t->np[h] ? t->wide : t->one)[h](
                            kc, x + (size_t)m * ldx + k0, ldx, wk + (size_t)(p - g) * ps * wes, ps,
                            scale ? scale + n0 : NULL, y + (size_t)m * ldy + n0, ldy, cols);
                        p += np;
                    }
                    m += t->mr[h];
                }
            }
        }
    }
}
