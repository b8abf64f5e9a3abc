/* The decode-shaped GEMM (gemm_rows.h): one kernel template
 * (gemm_rows_kernel.inc) instantiated per instruction set and rows at a
 * time, and a driver that takes the rows four, two or one at a time. */
#include "kernels/cpu/gemm_rows.h"

#include <stddef.h>
#include <stdint.h>

#include "kernels/cpu/vec_isa.h"

#define VEC_EXTRA_ATTR VEC_NO_TSAN

/* ---- AVX-512: up to 4 rows at a time (16 accumulators) ---- */

#include "vec_avx512.inc"
#define NAME rows4_avx512
#define MR 4
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx512
#define MR 2
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx512
#define MR 1
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows4_avx512_bf16
#define MR 4
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx512_bf16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx512_bf16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows4_avx512_f16
#define MR 4
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx512_f16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx512_f16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- AVX2 + FMA (+ F16C for fp16): up to 2 rows (16 registers) ---- */

#include "vec_avx2.inc"
#define NAME rows2_avx2
#define MR 2
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx2
#define MR 1
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx2_bf16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx2_bf16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx2_f16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx2_f16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- portable C ---- */

#include "vec_portable.inc"
#define NAME rows2_portable
#define MR 2
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows1_portable
#define MR 1
#define WT float
#define WLOAD VLOAD
#define WTOF(v) (v)
#include "gemm_rows_kernel.inc"
#define NAME rows2_portable_bf16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_portable_bf16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_BF16
#define WTOF bf16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows2_portable_f16
#define MR 2
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#define NAME rows1_portable_f16
#define MR 1
#define WT uint16_t
#define WLOAD VLOAD_F16
#define WTOF f16_to_f32
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- dispatch ---- */

/* A kernel of any weight type (w points at WT elements). */
typedef void (*rows_fn)(int nr, int K, const float *x, int ldx, const void *w, int ldw, float *y,
                        int ldy, int fetch);

enum { W_F32, W_BF16, W_F16, W_N };

/* Each instruction set's kernels per weight type for 4, 2 and 1 rows at a
 * time (NULL: the next smaller). */
static const rows_fn KERNELS[VEC_N_ISA][W_N][3] = {
    [VEC_AVX512] = {{rows4_avx512, rows2_avx512, rows1_avx512},
                    {rows4_avx512_bf16, rows2_avx512_bf16, rows1_avx512_bf16},
                    {rows4_avx512_f16, rows2_avx512_f16, rows1_avx512_f16}},
    [VEC_AVX2] = {{NULL, rows2_avx2, rows1_avx2},
                  {NULL, rows2_avx2_bf16, rows1_avx2_bf16},
                  {NULL, rows2_avx2_f16, rows1_avx2_f16}},
    [VEC_PORTABLE] = {{NULL, rows2_portable, rows1_portable},
                      {NULL, rows2_portable_bf16, rows1_portable_bf16},
                      {NULL, rows2_portable_f16, rows1_portable_f16}},
};

static const rows_fn *kernels_for(dtype_t wt) {
    return KERNELS[vec_isa()][wt == DTYPE_BF16 ? W_BF16 : wt == DTYPE_F16 ? W_F16 : W_F32];
}

/* Bytes of weight rows taken as a group: each group of activation rows
 * passes over all of it before the next (an L2's share, so the group is
 * read from memory once and from L2 by every group of activation rows,
 * whose own rows stay in L1). */
#define W_GROUP_BYTES ((size_t)128 << 10)

/* Rows up to which the kernels prefetch the next weight rows. */
#define GEMM_ROWS_FETCH_MAX_M 16

void gemm_rows_typed(int M, int N, int K, const float *x, int ldx, const void *w, dtype_t wt,
                     int ldw, float *y, int ldy) {
    if (M <= 0 || N <= 0 || K <= 0)
        return;
    const rows_fn *by = kernels_for(wt);
    const size_t wsize = dtype_size(wt), row_bytes = (size_t)K * wsize;
    int group = (int)(W_GROUP_BYTES / row_bytes) / 4 * 4;
    if (group < 4)
        group = 4;
    /* Prefetching pays where the weights' reads bound the time; at more
     * rows the multiplies do, and the extra instructions cost (`make
     * bench-gemm`). */
    const int fetch = M <= GEMM_ROWS_FETCH_MAX_M;
    for (int g = 0; g < N; g += group) {
        const int g_end = N - g < group ? N : g + group;
        for (int m = 0; m < M;) {
            const int take = M - m >= 4 && by[0] ? 4 : M - m >= 2 ? 2 : 1;
            const rows_fn f = by[take == 4 ? 0 : take == 2 ? 1 : 2];
            /* The group's weight rows four at a time, each block loaded
             * once into registers for all of this kernel's rows. */
            for (int n = g; n < g_end; n += 4)
                f(g_end - n < 4 ? g_end - n : 4, K, x + (size_t)m * ldx, ldx,
                  (const char *)w + (size_t)n * ldw * wsize, ldw, y + (size_t)m * ldy + n, ldy,
                  fetch);
            m += take;
        }
    }
}

void gemm_rows(int M, int N, int K, const float *x, int ldx, const float *w, int ldw, float *y,
               int ldy) {
    gemm_rows_typed(M, N, K, x, ldx, w, DTYPE_F32, ldw, y, ldy);
}
