/* Tests for kernels/cpu/gemm_panels.c: every instruction set's kernels against a
 * double-precision reference, on shapes that take each tile (rows not a
 * multiple of the widest tile's, panels not a multiple of its panels, a
 * last panel partly filled), with and without a bias, writing C (not adding
 * to it) and nothing outside its rows' first N columns. */
#include "kernels/cpu/gemm_panels.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdlib.h>

static uint64_t rand_state = 0x9E3779B97F4A7C15ULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define GUARD 1e30f

/* B(k, n) of a row-major K x N matrix, packed as gemm_panels.h says; the
 * padding columns get garbage, which must not reach C. */
static float *pack(const float *b, int N, int K) {
    float *bp = malloc(gemm_panels_floats(N, K) * sizeof(float));
    for (size_t i = 0; i < gemm_panels_floats(N, K); i++)
        bp[i] = 1e20f;
    for (int k = 0; k < K; k++)
        for (int n = 0; n < N; n++)
            bp[(size_t)(n / GEMM_PANEL) * K * GEMM_PANEL + (size_t)k * GEMM_PANEL +
               n % GEMM_PANEL] = b[(size_t)k * N + n];
    return bp;
}

/* One shape on the current kernels; the number of wrong elements. */
static int check_shape(int M, int N, int K, int with_bias) {
    const int lda = K + 3, ldc = N + 5;
    float *a = malloc(sizeof(float) * (size_t)M * lda), *b = malloc(sizeof(float) * (size_t)K * N);
    float *bias = malloc(sizeof(float) * (size_t)M);
    float *c = malloc(sizeof(float) * ((size_t)M * ldc + 1));
    for (size_t i = 0; i < (size_t)M * lda; i++)
        a[i] = rand_float();
    for (size_t i = 0; i < (size_t)K * N; i++)
        b[i] = rand_float();
    for (int m = 0; m < M; m++)
        bias[m] = rand_float();
    for (size_t i = 0; i < (size_t)M * ldc + 1; i++)
        c[i] = GUARD; /* overwritten in the first N columns, kept elsewhere */
    float *bp = pack(b, N, K);
    gemm_panels(M, N, K, a, lda, bp, with_bias ? bias : NULL, c, ldc);
    int bad = 0;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < ldc; n++) {
            const float got = c[(size_t)m * ldc + n];
            if (n >= N) {
                bad += got != GUARD;
                continue;
            }
            double want = with_bias ? bias[m] : 0, mag = fabs(want);
            for (int k = 0; k < K; k++) {
                want += (double)a[(size_t)m * lda + k] * b[(size_t)k * N + n];
                mag += fabs((double)a[(size_t)m * lda + k] * b[(size_t)k * N + n]);
            }
            if (!(fabs(got - want) <= 1e-6 * (mag + 1))) {
                if (!bad)
                    fprintf(stderr, "  %s M=%d N=%d K=%d bias=%d: C[%d][%d] = %.9g, want %.9g\n",
                            vec_isa_name(vec_isa()), M, N, K, with_bias, m, n, got, want);
                bad++;
            }
        }
    bad += c[(size_t)M * ldc] != GUARD;
    free(a);
    free(b);
    free(bias);
    free(c);
    free(bp);
    return bad;
}

static void test_every_kernel_matches_the_reference(void) {
    static const int Ms[] = {1, 3, 4, 5, 8, 9, 17, 64};
    static const int Ns[] = {1, 15, 16, 17, 48, 50, 64, 96, 113};
    static const int Ks[] = {1, 9, 72, 300};
    int ran = 0;
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa)) {
            fprintf(stderr, "  (%s: not on this machine)\n", vec_isa_name(isa));
            continue;
        }
        ran++;
        for (size_t i = 0; i < sizeof Ms / sizeof *Ms; i++)
            for (size_t j = 0; j < sizeof Ns / sizeof *Ns; j++)
                for (size_t k = 0; k < sizeof Ks / sizeof *Ks; k++)
                    for (int with_bias = 0; with_bias < 2; with_bias++)
                        CHECK_MSG(check_shape(Ms[i], Ns[j], Ks[k], with_bias) == 0,
                                  "%s M=%d N=%d K=%d bias=%d", vec_isa_name(isa), Ms[i], Ns[j],
                                  Ks[k], with_bias);
    }
    CHECK(ran >= 1);
}

static void test_sizes_and_empty_shapes(void) {
    CHECK(gemm_panels_floats(1, 3) == (size_t)GEMM_PANEL * 3);
    CHECK(gemm_panels_floats(GEMM_PANEL, 3) == (size_t)GEMM_PANEL * 3);
    CHECK(gemm_panels_floats(GEMM_PANEL + 1, 3) == (size_t)GEMM_PANEL * 6);
    float c[2] = {3, 4};
    const float a[2] = {1, 1}, bp[2 * GEMM_PANEL] = {1, 1};
    gemm_panels(0, 1, 2, a, 2, bp, NULL, c, 1);
    gemm_panels(1, 0, 2, a, 2, bp, NULL, c, 1);
    CHECK(c[0] == 3 && c[1] == 4);
    const float bias[1] = {7};
    gemm_panels(1, 1, 0, a, 2, bp, bias, c, 1); /* an empty sum: C is the bias */
    CHECK(c[0] == 7 && c[1] == 4);
}

int main(void) {
    TEST_RUN(test_every_kernel_matches_the_reference);
    TEST_RUN(test_sizes_and_empty_shapes);
    return TEST_SUMMARY();
}
