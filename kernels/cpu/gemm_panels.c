/* The convolution-shaped GEMM (gemm_panels.h): one kernel template
 * (gemm_panels_kernel.inc) instantiated per instruction set for its widest
 * tile and the narrow tiles that finish C's last rows and panels. */
#include "kernels/cpu/gemm_panels.h"

#include <string.h>

#include "kernels/cpu/vec_isa.h"

#define VEC_EXTRA_ATTR VEC_NO_TSAN

/* ---- AVX-512: 8 rows x 3 panels (24 of the 32 registers) ---- */

#include "vec_avx512.inc"
#define NAME tile_avx512
#define MR 8
#define NP 3
#include "gemm_panels_kernel.inc"
#define NAME rows_avx512
#define MR 1
#define NP 3
#include "gemm_panels_kernel.inc"
#define NAME panel_avx512
#define MR 8
#define NP 1
#include "gemm_panels_kernel.inc"
#define NAME one_avx512
#define MR 1
#define NP 1
#include "gemm_panels_kernel.inc"
#include "vec_undef.inc"

/* ---- AVX2 + FMA: 4 rows x 1 panel (8 of the 16 registers) ---- */

#include "vec_avx2.inc"
#define NAME tile_avx2
#define MR 4
#define NP 1
#include "gemm_panels_kernel.inc"
#define NAME one_avx2
#define MR 1
#define NP 1
#include "gemm_panels_kernel.inc"
#include "vec_undef.inc"

/* ---- portable C ---- */

#include "vec_portable.inc"
#define NAME tile_portable
#define MR 4
#define NP 1
#include "gemm_panels_kernel.inc"
#define NAME one_portable
#define MR 1
#define NP 1
#include "gemm_panels_kernel.inc"
#include "vec_undef.inc"

/* ---- dispatch ---- */

typedef void (*tile_fn)(int K, const float *a, int lda, const float *bp, int ncols,
                        const float *bias, float *c, int ldc);

/* An instruction set's tiles: mr x np (the widest), 1 x np, mr x 1 and
 * 1 x 1 (where np is 1, the first two are the last two). */
typedef struct tiles {
    int mr, np;
    tile_fn full, rows, panel, one;
} tiles_t;

static const tiles_t TILES[VEC_N_ISA] = {
    [VEC_AVX512] = {8, 3, tile_avx512, rows_avx512, panel_avx512, one_avx512},
    [VEC_AVX2] = {4, 1, tile_avx2, one_avx2, tile_avx2, one_avx2},
    [VEC_PORTABLE] = {4, 1, tile_portable, one_portable, tile_portable, one_portable},
};

size_t gemm_panels_floats(int N, int K) {
    return (size_t)((N + GEMM_PANEL - 1) / GEMM_PANEL) * GEMM_PANEL * (size_t)K;
}

void gemm_panels(int M, int N, int K, const float *A, int lda, const float *bp, const float *bias,
                 float *C, int ldc) {
    if (M <= 0 || N <= 0)
        return;
    const tiles_t *t = &TILES[vec_isa()];
    const size_t pstride = (size_t)K * GEMM_PANEL;
    const int n_panels = (N + GEMM_PANEL - 1) / GEMM_PANEL;
    /* Panels outermost: a group of np stays in cache while every row of A
     * (a few hundred KiB at most) passes over it. */
    for (int p = 0; p < n_panels;) {
        const int np = n_panels - p >= t->np ? t->np : 1;
        const int n0 = p * GEMM_PANEL, cols = N - n0 < np * GEMM_PANEL ? N - n0 : np * GEMM_PANEL;
        const float *b = bp + (size_t)p * pstride;
        int m = 0;
        for (; m + t->mr <= M; m += t->mr)
            (np == t->np ? t->full : t->panel)(K, A + (size_t)m * lda, lda, b, cols,
                                               bias ? bias + m : NULL, C + (size_t)m * ldc + n0,
                                               ldc);
        for (; m < M; m++)
            (np == t->np ? t->rows : t->one)(K, A + (size_t)m * lda, lda, b, cols,
                                             bias ? bias + m : NULL, C + (size_t)m * ldc + n0, ldc);
        p += np;
    }
}
