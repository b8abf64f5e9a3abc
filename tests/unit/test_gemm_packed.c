/* Tests for kernels/cpu/gemm_packed.c: the packing puts w(n, k) where the
 * header says; every instruction set's kernels match a double-precision
 * reference on ragged shapes (rows not a multiple of any tile, columns not
 * a multiple of a panel or a panel group, K across several k blocks), with
 * strides wider than the rows, accumulating into y and never writing
 * outside it; bf16 and fp16 weights sum as the same weights in fp32, bit for
 * bit, and int8 and fp8 weights as gemm_packed_scaled defines their sums; and each row's sums are
 * the same bytes whatever the number of rows and wherever the row sits among them (batch
 * invariance). */
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rand_state = 0x9E3779B97F4A7C15ULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define GUARD 1e30f

/* w [N, ldw] packed, in a fresh allocation. */
static void *pack(const void *w, dtype_t wt, int N, int K, int ldw) {
    void *wp = malloc(gemm_packed_elems(N, K, wt) * dtype_size(wt));
    gemm_packed_pack(wp, w, wt, N, K, ldw);
    return wp;
}

static void test_packing_puts_each_element_where_the_header_says(void) {
    const int N = 37, K = 5, ldw = 7;
    float w[37 * 7];
    for (int i = 0; i < N * ldw; i++)
        w[i] = (float)i;
    CHECK(gemm_packed_elems(N, K, DTYPE_F32) == (size_t)48 * K);
    float *wp = pack(w, DTYPE_F32, N, K, ldw);
    int bad = 0;
    for (int n = 0; n < 48; n++)
        for (int k = 0; k < K; k++) {
            const float got =
                wp[(n / GEMM_PANEL) * K * GEMM_PANEL + k * GEMM_PANEL + n % GEMM_PANEL];
            bad += got != (n < N ? w[n * ldw + k] : 0.0f);
        }
    CHECK_MSG(bad == 0, "%d elements misplaced", bad);
    CHECK(gemm_packed_panel(wp, DTYPE_F32, K, 2) == wp + 2 * GEMM_PANEL * K);
    free(wp);
}

/* bf16 panels: 32 deep per 32 k or part (zeros past K), pairs of k side by
 * side, as gemm_amx.h's tiles read them. */
static void test_bf16_packing_keeps_pairs_of_k_side_by_side(void) {
    const int N = 37, K = 45, ldw = 47;
    uint16_t w[37 * 47];
    for (int i = 0; i < N * ldw; i++)
        w[i] = (uint16_t)(i + 1);
    CHECK(gemm_packed_depth(K, DTYPE_BF16) == 64 && gemm_packed_depth(K, DTYPE_F16) == K);
    CHECK(gemm_packed_elems(N, K, DTYPE_BF16) == (size_t)48 * 64);
    uint16_t *wp = pack(w, DTYPE_BF16, N, K, ldw);
    int bad = 0;
    for (int n = 0; n < 48; n++)
        for (int k = 0; k < 64; k++) {
            const uint16_t got = wp[(n / GEMM_PANEL) * 64 * GEMM_PANEL + (k / 2) * 2 * GEMM_PANEL +
                                    (n % GEMM_PANEL) * 2 + k % 2];
            bad += got != (n < N && k < K ? w[n * ldw + k] : 0);
        }
    CHECK_MSG(bad == 0, "%d elements misplaced", bad);
    CHECK(gemm_packed_panel(wp, DTYPE_BF16, K, 2) == wp + 2 * GEMM_PANEL * 64);
    free(wp);
}

/* One shape on the current kernels; 0 when every y matches. */
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
    float *wp = pack(w, DTYPE_F32, N, K, ldw);
    gemm_packed(M, N, K, x, ldx, wp, DTYPE_F32, y, ldy);
    int bad = 0;
    for (int m = 0; m < M; m++) {
        for (int n = 0; n < ldy; n++) {
            const float got = y[(size_t)m * ldy + n];
            if (n >= N) {
                bad += got != GUARD;
                continue;
            }
            double want = 0.5, mag = 0.5;
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
    free(wp);
    free(y);
    return bad;
}

static void test_every_kernel_matches_the_reference(void) {
    /* Rows past the largest tile (8) and the row block (64); columns
     * short of a panel, of a 3-panel group, and past several; K past the
     * k block (256). */
    static const int Ms[] = {1, 2, 3, 5, 6, 7, 9, 13, 16, 70};
    static const int Ns[] = {1, 5, 16, 17, 40, 100};
    static const int Ks[] = {1, 7, 16, 33, 300, 600};
    int ran = 0;
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa)) {
            fprintf(stderr, "  (%s: not on this machine)\n", vec_isa_name(isa));
            continue;
        }
        ran++;
        for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
            for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++)
                    CHECK_MSG(check_shape(Ms[a], Ns[b], Ks[c]) == 0, "%s M=%d N=%d K=%d",
                              vec_isa_name(isa), Ms[a], Ns[b], Ks[c]);
    }
    CHECK(ran >= 1);
}

/* 16-bit weights on one shape: the sums of the same weights in fp32, bit
 * for bit. 0 when equal. */
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
    void *hp = pack(h, wt, N, K, ldw), *wp = pack(w, DTYPE_F32, N, K, ldw);
    gemm_packed(M, N, K, x, ldx, hp, wt, y16, ldy);
    gemm_packed(M, N, K, x, ldx, wp, DTYPE_F32, y32, ldy);
    const int bad = memcmp(y16, y32, sizeof(float) * (size_t)M * ldy) != 0;
    free(x);
    free(w);
    free(h);
    free(hp);
    free(wp);
    free(y16);
    free(y32);
    return bad;
}

static void test_16bit_weights_match_fp32(void) {
    /* Under PACKED_WIDEN_ROWS (24) the tiles convert the weights; from it
     * they are widened first, for every block of up to PACKED_WIDEN_MC
     * (256) rows: 300 rows are two blocks, 520 three. */
    static const int Ms[] = {1, 3, 8, 11, 23, 24, 70, 300, 520};
    static const int Ns[] = {1, 17, 50};
    static const int Ks[] = {1, 33, 300, 601}; /* odd, across k blocks */
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

/* A row's sums, alone and as row r of M rows, are the same bytes on every
 * kernel (the tiles that take it differ: 1, 2, 4, 6 or 8 rows high). */
static void test_a_rows_sums_do_not_depend_on_the_other_rows(void) {
    enum { N = 45, K = 700, MAX_M = 75 };
    float *x = malloc(sizeof(float) * MAX_M * K), *w = malloc(sizeof(float) * N * K);
    float *alone = malloc(sizeof(float) * N), *all = malloc(sizeof(float) * MAX_M * N);
    for (int i = 0; i < MAX_M * K; i++)
        x[i] = rand_float();
    for (int i = 0; i < N * K; i++)
        w[i] = rand_float();
    float *wp = pack(w, DTYPE_F32, N, K, K);
    static const int Ms[] = {2, 3, 5, 7, 9, 16, 31, 75};
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++) {
            const int M = Ms[a];
            memset(all, 0, sizeof(float) * MAX_M * N);
            gemm_packed(M, N, K, x, K, wp, DTYPE_F32, all, N);
            int differ = 0;
            for (int r = 0; r < M; r++) {
                memset(alone, 0, sizeof(float) * N);
                gemm_packed(1, N, K, x + (size_t)r * K, K, wp, DTYPE_F32, alone, N);
                differ += memcmp(alone, all + (size_t)r * N, sizeof(float) * N) != 0;
            }
            CHECK_MSG(differ == 0, "%s M=%d: %d rows differ from the row alone", vec_isa_name(isa),
                      M, differ);
        }
    }
    free(x);
    free(w);
    free(wp);
    free(alone);
    free(all);
}

/* y as gemm_packed_scaled defines it for an 8-bit weight: per k block,
 * the chain of x * q from zero, then sum * scale + y, fused where the
 * instruction set is (every one but portable C). */
static float step(int fused, float a, float b, float c) {
    return fused ? fmaf(a, b, c) : a * b + c;
}

/* 8-bit weights on one shape, against that definition, bit for bit; every
 * int8 value and every finite fp8 pattern (subnormals and zero included)
 * occurs, with scales from tiny to large, K across k blocks. 0 when equal. */
static int check_8bit(int M, int N, int K, dtype_t wt, int fused) {
    const int ldx = K + 3, ldw = K + 5, ldy = N + 2;
    const int padded = (N + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
    float *x = malloc(sizeof(float) * (size_t)M * ldx),
          *q = malloc(sizeof(float) * (size_t)N * ldw), *kernel_scale = calloc((size_t)padded, 4);
    unsigned char *bytes = malloc((size_t)N * ldw);
    float *y8 = malloc(sizeof(float) * (size_t)M * ldy),
          *want = malloc(sizeof(float) * (size_t)M * ldy);
    for (size_t i = 0; i < (size_t)M * ldx; i++)
        x[i] = rand_float();
    for (size_t i = 0; i < (size_t)M * ldy; i++)
        y8[i] = want[i] = rand_float(); /* accumulated into */
    for (int n = 0; n < N; n++) {
        const float scale = ldexpf(1.0f + rand_float(), n % 40 - 30);
        kernel_scale[n] = wt == DTYPE_F8_E4M3 ? scale * VEC_F8_DIV : scale;
    }
    for (size_t i = 0; i < (size_t)N * ldw; i++) {
        bytes[i] = (unsigned char)(i * 37 + i / (size_t)ldw); /* every byte value */
        if (wt == DTYPE_I8 && bytes[i] == 0x80)
            bytes[i] = 0x81; /* -128 is not an int8 weight's */
        if (wt == DTYPE_F8_E4M3 && (bytes[i] & 0x7f) == 0x7f)
            bytes[i] ^= 1; /* NaN */
        q[i] = wt == DTYPE_I8 ? (float)(int8_t)bytes[i] : f8e4m3_to_f32(bytes[i]) / VEC_F8_DIV;
    }
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++) {
            float y = want[(size_t)m * ldy + n];
            for (int k0 = 0; k0 < K; k0 += GEMM_KC) {
                float sum = 0;
                for (int k = k0; k < K && k < k0 + GEMM_KC; k++)
                    sum = step(fused, x[(size_t)m * ldx + k], q[(size_t)n * ldw + k], sum);
                y = step(fused, sum, kernel_scale[n], y);
            }
            want[(size_t)m * ldy + n] = y;
        }
    void *qp = pack(bytes, wt, N, K, ldw);
    gemm_packed_scaled(M, N, K, x, ldx, qp, wt, kernel_scale, y8, ldy);
    const int bad = memcmp(y8, want, sizeof(float) * (size_t)M * ldy) != 0;
    free(x);
    free(q);
    free(kernel_scale);
    free(bytes);
    free(qp);
    free(y8);
    free(want);
    return bad;
}

static void test_8bit_weights_sum_by_k_block_then_scale(void) {
    static const int Ms[] = {1, 2, 3, 8, 11};
    static const int Ns[] = {1, 17, 50};
    static const int Ks[] = {1, 33, 300, 600};
    static const dtype_t types[] = {DTYPE_I8, DTYPE_F8_E4M3};
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        for (int t = 0; t < 2; t++)
            for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
                for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
                    for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++)
                        CHECK_MSG(check_8bit(Ms[a], Ns[b], Ks[c], types[t], isa != VEC_PORTABLE) ==
                                      0,
                                  "%s %s M=%d N=%d K=%d", vec_isa_name(isa), dtype_name(types[t]),
                                  Ms[a], Ns[b], Ks[c]);
    }
}

static void test_empty_shapes_touch_nothing(void) {
    float y[2] = {3, 4};
    const float x[2] = {1, 1};
    float wp[GEMM_PANEL * 2] = {1, 1};
    gemm_packed(0, 1, 2, x, 2, wp, DTYPE_F32, y, 1);
    gemm_packed(1, 0, 2, x, 2, wp, DTYPE_F32, y, 1);
    gemm_packed(1, 1, 0, x, 2, wp, DTYPE_F32, y, 1);
    CHECK(y[0] == 3 && y[1] == 4);
}

int main(void) {
    TEST_RUN(test_packing_puts_each_element_where_the_header_says);
    TEST_RUN(test_bf16_packing_keeps_pairs_of_k_side_by_side);
    TEST_RUN(test_every_kernel_matches_the_reference);
    TEST_RUN(test_16bit_weights_match_fp32);
    TEST_RUN(test_8bit_weights_sum_by_k_block_then_scale);
    TEST_RUN(test_a_rows_sums_do_not_depend_on_the_other_rows);
    TEST_RUN(test_empty_shapes_touch_nothing);
    return TEST_SUMMARY();
}
