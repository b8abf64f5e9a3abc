/* Tests for kernels/cpu/gemm_rows.c: every kernel this machine runs against a
 * double-precision reference, on shapes with ragged edges (rows not a
 * multiple of four, weight rows not a multiple of four, K not a multiple of
 * the vector width, weight rows spanning several of the driver's groups),
 * with strides wider than the rows, accumulating into y,
 * and never writing outside it; and its bf16 and fp16 weights against the
 * same weights in fp32, on every kernel. */
#include "kernels/cpu/gemm_rows.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rand_state = 0x2545F4914F6CDD1DULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define GUARD 1e30f

/* One shape on the current kernel; 0 when every y matches. */
static int check_shape(int M, int N, int K) {
    const int ldx = K + 3, ldw = K + 5, ldy = N + 2;
    float *x = malloc(sizeof(float) * (size_t)M * ldx);
    float *w = malloc(sizeof(float) * (size_t)N * ldw);
    float *y = malloc(sizeof(float) * ((size_t)M * ldy + 1));
    for (size_t i = 0; i < (size_t)M * ldx; i++)
        x[i] = rand_float();
    for (size_t i = 0; i < (size_t)N * ldw; i++)
        w[i] = rand_float();
    for (size_t i = 0; i < (size_t)M * ldy + 1; i++)
        y[i] = GUARD; /* padding keeps it: only y[m][n < N] may change */
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++)
            y[(size_t)m * ldy + n] = 0.5f; /* accumulated into, not overwritten */
    gemm_rows(M, N, K, x, ldx, w, ldw, y, ldy);
    int bad = 0;
    for (int m = 0; m < M; m++) {
        for (int n = 0; n < ldy; n++) {
            const float got = y[(size_t)m * ldy + n];
            if (n >= N) {
                bad += got != GUARD;
                continue;
            }
            double want = 0.5, mag = 0;
            for (int k = 0; k < K; k++) {
                want += (double)x[(size_t)m * ldx + k] * w[(size_t)n * ldw + k];
                mag += fabs((double)x[(size_t)m * ldx + k] * w[(size_t)n * ldw + k]);
            }
            if (!(fabs(got - want) <= 1e-6 * (mag + 1))) {
                if (!bad)
                    fprintf(stderr, "  %s M=%d N=%d K=%d: y[%d][%d] = %.9g, want %.9g\n",
                            vec_isa_name(vec_isa()), M, N, K, m, n, got, want);
                bad++;
            }
        }
    }
    bad += y[(size_t)M * ldy] != GUARD;
    free(x);
    free(w);
    free(y);
    return bad;
}

static void test_every_kernel_matches_the_reference(void) {
    static const int Ms[] = {1, 2, 3, 4, 5, 7, 8, 9, 16};
    static const int Ns[] = {1, 3, 4, 5, 17, 64};
    /* K = 4096: weight rows of 16 KiB, several groups (gemm_rows.c's
     * W_GROUP_BYTES) across N = 17 and 64. */
    static const int Ks[] = {1, 7, 8, 15, 16, 17, 33, 256, 300, 4096};
    int ran = 0;
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa)) {
            fprintf(stderr, "  (%s: not on this machine)\n", vec_isa_name(isa));
            continue;
        }
        CHECK(vec_isa() == (vec_isa_t)isa);
        ran++;
        for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
            for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++)
                    CHECK_MSG(check_shape(Ms[a], Ns[b], Ks[c]) == 0, "%s M=%d N=%d K=%d",
                              vec_isa_name(isa), Ms[a], Ns[b], Ks[c]);
    }
    CHECK(ran >= 1);
    CHECK(vec_isa_supported(VEC_PORTABLE));
}

/* 16-bit weights on one shape of the current kernel: the sums of the same
 * weights converted to fp32, bit for bit (the conversion happens in
 * registers; the order of the FMAs is the fp32 kernel's). 0 when equal. */
static int check_16bit(int M, int N, int K, dtype_t wt) {
    const int ldx = K + 3, ldw = K + 5, ldy = N + 2;
    float *x = malloc(sizeof(float) * (size_t)M * ldx),
          *w = malloc(sizeof(float) * (size_t)N * ldw);
    uint16_t *h = malloc(sizeof(uint16_t) * (size_t)N * ldw);
    float *y16 = calloc((size_t)M * ldy, sizeof(float)),
          *y32 = calloc((size_t)M * ldy, sizeof(float));
    for (size_t i = 0; i < (size_t)M * ldx; i++)
        x[i] = rand_float();
    for (size_t i = 0; i < (size_t)N * ldw; i++) {
        /* every bit pattern but the exponents that overflow or underflow */
        h[i] = (uint16_t)(rand_state >> 20);
        rand_float();
        if (wt == DTYPE_F16)
            h[i] = (uint16_t)((h[i] & 0x83ffu) | (uint16_t)(10 + h[i] % 10) << 10);
        else
            h[i] = (uint16_t)((h[i] & 0x807fu) | (uint16_t)(120 + h[i] % 10) << 7);
        w[i] = wt == DTYPE_F16 ? f16_to_f32(h[i]) : bf16_to_f32(h[i]);
    }
    gemm_rows_typed(M, N, K, x, ldx, h, wt, ldw, y16, ldy);
    gemm_rows(M, N, K, x, ldx, w, ldw, y32, ldy);
    const int bad = memcmp(y16, y32, sizeof(float) * (size_t)M * ldy) != 0;
    free(x);
    free(w);
    free(h);
    free(y16);
    free(y32);
    return bad;
}

static void test_16bit_weights_match_fp32(void) {
    static const int Ms[] = {1, 2, 3, 4, 5, 9};
    static const int Ns[] = {1, 3, 5, 17};
    static const int Ks[] = {1, 7, 16, 17, 33, 300};
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        for (int t = 0; t < 2; t++)
            for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
                for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                    for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++) {
                        const dtype_t wt = t ? DTYPE_F16 : DTYPE_BF16;
                        CHECK_MSG(check_16bit(Ms[a], Ns[b], Ks[c], wt) == 0, "%s %s M=%d N=%d K=%d",
                                  vec_isa_name(isa), dtype_name(wt), Ms[a], Ns[b], Ks[c]);
                    }
    }
}

static void test_empty_shapes_touch_nothing(void) {
    float y[2] = {3, 4};
    const float x[2] = {1, 1}, w[2] = {1, 1};
    gemm_rows(0, 1, 2, x, 2, w, 2, y, 1);
    gemm_rows(1, 0, 2, x, 2, w, 2, y, 1);
    gemm_rows(1, 1, 0, x, 2, w, 2, y, 1);
    CHECK(y[0] == 3 && y[1] == 4);
    CHECK(!vec_isa_use(VEC_N_ISA));
}

int main(void) {
    TEST_RUN(test_every_kernel_matches_the_reference);
    TEST_RUN(test_16bit_weights_match_fp32);
    TEST_RUN(test_empty_shapes_touch_nothing);
    return TEST_SUMMARY();
}
