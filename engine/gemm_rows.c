/* The decode-shaped GEMM (gemm_rows.h): one kernel template
 * (gemm_rows_kernel.inc) instantiated per instruction set and rows at a
 * time, and a driver that takes the rows four, two or one at a time. */
#include "gemm_rows.h"

#include <stddef.h>

#include "vec_isa.h"

/* ThreadSanitizer does not instrument the kernels (as it never saw inside
 * OpenBLAS, which did this before): the weights are read-only once loaded
 * and the rows belong to the calling thread, and instrumented the kernels
 * made the TSan suite 40 s slower. */
#if defined(__SANITIZE_THREAD__)
#define NO_TSAN __attribute__((no_sanitize("thread")))
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define NO_TSAN __attribute__((no_sanitize("thread")))
#endif
#endif
#ifndef NO_TSAN
#define NO_TSAN
#endif

#define VEC_EXTRA_ATTR NO_TSAN

/* ---- AVX-512: up to 4 rows at a time (16 accumulators) ---- */

#include "vec_avx512.inc"
#define NAME rows4_avx512
#define MR 4
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx512
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx512
#define MR 1
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- AVX2 + FMA: up to 2 rows (16 registers) ---- */

#include "vec_avx2.inc"
#define NAME rows2_avx2
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx2
#define MR 1
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- portable C ---- */

#include "vec_portable.inc"
#define NAME rows2_portable
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_portable
#define MR 1
#include "gemm_rows_kernel.inc"
#include "vec_undef.inc"

/* ---- dispatch ---- */

typedef void (*rows_fn)(int nr, int K, const float *x, int ldx, const float *w, int ldw, float *y,
                        int ldy);

/* Each instruction set's kernels for 4, 2 and 1 rows at a time (NULL: the
 * next smaller). */
static const rows_fn KERNELS[VEC_N_ISA][3] = {
    [VEC_AVX512] = {rows4_avx512, rows2_avx512, rows1_avx512},
    [VEC_AVX2] = {NULL, rows2_avx2, rows1_avx2},
    [VEC_PORTABLE] = {NULL, rows2_portable, rows1_portable},
};

void gemm_rows(int M, int N, int K, const float *x, int ldx, const float *w, int ldw, float *y,
               int ldy) {
    if (M <= 0 || N <= 0 || K <= 0)
        return;
    const rows_fn *by = KERNELS[vec_isa()];
    /* Weight rows outermost: a block of four is read from memory once and
     * stays in L1 while every group of activation rows uses it. */
    for (int n = 0; n < N; n += 4) {
        const int nr = N - n < 4 ? N - n : 4;
        for (int m = 0; m < M;) {
            const int take = M - m >= 4 && by[0] ? 4 : M - m >= 2 ? 2 : 1;
            by[take == 4   ? 0
               : take == 2 ? 1
                           : 2](nr, K, x + (size_t)m * ldx, ldx, w + (size_t)n * ldw, ldw,
                                y + (size_t)m * ldy + n, ldy);
            m += take;
        }
    }
}
