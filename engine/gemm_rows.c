/* The decode-shaped GEMM (gemm_rows.h): one kernel template
 * (gemm_rows_kernel.inc) instantiated per instruction set and rows at a
 * time, and a driver that takes the rows four, two or one at a time. */
#include "gemm_rows.h"

#include <immintrin.h>
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

/* ---- AVX-512: 16 floats a vector, up to 4 rows (16 accumulators) ---- */

#define TARGET NO_TSAN __attribute__((target("avx512f")))
#define VEC __m512
#define VLEN 16
#define VZERO() _mm512_setzero_ps()
#define VLOAD(p) _mm512_loadu_ps(p)
#define VFMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define VHSUM(v) _mm512_reduce_add_ps(v)
#define NAME rows4_avx512
#define MR 4
#include "gemm_rows_kernel.inc"
#define NAME rows2_avx512
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx512
#define MR 1
#include "gemm_rows_kernel.inc"
#undef TARGET
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VHSUM

/* ---- AVX2 + FMA: 8 floats a vector, up to 2 rows (16 registers) ---- */

__attribute__((target("avx2,fma"))) static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

#define TARGET NO_TSAN __attribute__((target("avx2,fma")))
#define VEC __m256
#define VLEN 8
#define VZERO() _mm256_setzero_ps()
#define VLOAD(p) _mm256_loadu_ps(p)
#define VFMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define VHSUM(v) hsum_avx2(v)
#define NAME rows2_avx2
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_avx2
#define MR 1
#include "gemm_rows_kernel.inc"
#undef TARGET
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VHSUM

/* ---- portable C: one float a "vector" ---- */

#define TARGET NO_TSAN
#define VEC float
#define VLEN 1
#define VZERO() 0.0f
#define VLOAD(p) (*(p))
#define VFMA(a, b, c) ((a) * (b) + (c))
#define VHSUM(v) (v)
#define NAME rows2_portable
#define MR 2
#include "gemm_rows_kernel.inc"
#define NAME rows1_portable
#define MR 1
#include "gemm_rows_kernel.inc"
#undef TARGET
#undef VEC
#undef VLEN
#undef VZERO
#undef VLOAD
#undef VFMA
#undef VHSUM

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
