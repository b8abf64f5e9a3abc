/* Tests for kernels/cpu/gemm_amx.c: the rounding to bf16 is to nearest,
 * ties to even, with the padding zero; on a CPU with AMX, the tiles' GEMM
 * matches a double-precision sum over the rounded activations on ragged
 * shapes (rows and columns not multiples of a tile, K not a multiple of
 * 32, one panel alone at the end; deep enough to cross the kernel's blocks
 * of panels and rows), accumulating into y and never writing
 * outside it, the packed bf16 weight is the tiles' layout and the same
 * weight laid out in whole pairs of panels gives the same bits; fp32
 * panels rounded into that layout (the convolutions' patches) are the
 * rounded weights packed. Without AMX the GEMM's checks skip, saying so. */
#include "base/dtype.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/gemm_packed.h"
#include "tests/test.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rand_state = 0x2545F4914F6CDD1DULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define GUARD 1e30f

static float bf16_value(uint16_t h) {
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static void test_rounding_to_nearest_even_and_padding(void) {
    /* 1 + 2^-8 is halfway between bf16's 1 and 1 + 2^-7: even is 1;
     * 1 + 3 * 2^-8 halfway between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6. */
    const float x[2 * 3] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -2.5f, 1e-3f, NAN, 65504.0f};
    uint16_t xb[32 * 32];
    memset(xb, 0xff, sizeof xb);
    gemm_amx_round(xb, x, 3, 2, 3, 0, 32);
    CHECK(gemm_amx_pad(3) == 32 && gemm_amx_pad(32) == 32 && gemm_amx_pad(33) == 64);
    CHECK(bf16_value(xb[0]) == 1.0f);
    CHECK(bf16_value(xb[1]) == 1.0f + 4.0f / 256);
    CHECK(bf16_value(xb[2]) == -2.5f);
    CHECK(xb[32] == f32_to_bf16(1e-3f) && isnan(bf16_value(xb[33])));
    CHECK(xb[34] == f32_to_bf16(65504.0f));
    int nonzero = 0;
    for (int r = 0; r < 32; r++)
        for (int k = 0; k < 32; k++)
            nonzero += (r >= 2 || k >= 3) && xb[r * 32 + k] != 0;
    CHECK_MSG(nonzero == 0, "%d padding elements not zero", nonzero);
}

/* One shape; 0 when every y is within fp32 summation's error of the double
 * sum over the rounded activations and nothing outside y[m][n < N] moved. */
static int check_shape(int M, int N, int K) {
    const int ldx = K + 3, ldy = N + 2, Kp = gemm_amx_pad(K), Mp = gemm_amx_pad(M);
    float *x = malloc(sizeof(float) * (size_t)M * ldx);
    uint16_t *w = malloc(sizeof(uint16_t) * (size_t)N * K);
    float *y = malloc(sizeof(float) * ((size_t)M * ldy + 1));
    for (size_t i = 0; i < (size_t)M * ldx; i++)
        x[i] = rand_float();
    for (size_t i = 0; i < (size_t)N * K; i++)
        w[i] = f32_to_bf16(rand_float());
    for (size_t i = 0; i < (size_t)M * ldy + 1; i++)
        y[i] = GUARD;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++)
            y[(size_t)m * ldy + n] = (float)(m - n) * 0.25f; /* accumulated into */
    uint16_t *wp = malloc(gemm_packed_elems(N, K, DTYPE_BF16) * sizeof(uint16_t));
    gemm_packed_pack(wp, w, DTYPE_BF16, N, K, K);
    uint16_t *xb = malloc(sizeof(uint16_t) * (size_t)Mp * Kp);
    gemm_amx_round(xb, x, ldx, M, K, 0, Mp);
    gemm_amx(M, N, K, xb, wp, y, ldy);
    /* The packed weight is the tiles' layout (gemm_amx_b_at), and the weight
     * laid out by it (as attention lays out its keys: whole pairs of
     * panels, zero past N and K) gives the same bits. */
    const size_t nb = gemm_amx_b_elems(N, K);
    uint16_t *wb = malloc(nb * sizeof *wb);
    float *yb = malloc(sizeof(float) * ((size_t)M * ldy + 1));
    memset(wb, 0, nb * sizeof *wb);
    for (int n = 0; n < N; n++)
        for (int k = 0; k < K; k++)
            wb[gemm_amx_b_at(n, k, Kp)] = w[(size_t)n * K + k];
    int bad = memcmp(wb, wp, gemm_packed_elems(N, K, DTYPE_BF16) * sizeof *wb) != 0;
    if (bad)
        printf("  M=%d N=%d K=%d: the packed weight is not gemm_amx_b_at's layout\n", M, N, K);
    for (size_t i = 0; i < (size_t)M * ldy + 1; i++)
        yb[i] = GUARD;
    for (int m = 0; m < M; m++)
        for (int n = 0; n < N; n++)
            yb[(size_t)m * ldy + n] = (float)(m - n) * 0.25f;
    gemm_amx(M, N, K, xb, wb, yb, ldy);
    if (memcmp(y, yb, sizeof(float) * ((size_t)M * ldy + 1)) != 0) {
        printf("  M=%d N=%d K=%d: whole pairs of panels differ from the packed weight\n", M, N, K);
        bad++;
    }
    /* gemm_amx_store: the sums over a y it never reads, the same bytes as
     * gemm_amx adding them to zeros; nothing past N written. */
    for (size_t i = 0; i < (size_t)M * ldy + 1; i++)
        yb[i] = i % (size_t)ldy < (size_t)N ? NAN : GUARD;
    gemm_amx_store(M, N, K, xb, wp, yb, ldy);
    float *y0 = malloc(sizeof(float) * ((size_t)M * ldy + 1));
    for (size_t i = 0; i < (size_t)M * ldy + 1; i++)
        y0[i] = i % (size_t)ldy < (size_t)N ? 0.0f : GUARD;
    y0[(size_t)M * ldy] = yb[(size_t)M * ldy] = GUARD;
    gemm_amx(M, N, K, xb, wp, y0, ldy);
    if (memcmp(y0, yb, sizeof(float) * ((size_t)M * ldy + 1)) != 0) {
        printf("  M=%d N=%d K=%d: gemm_amx_store differs from gemm_amx on zeros\n", M, N, K);
        bad++;
    }
    free(wb), free(yb), free(y0);
    for (int m = 0; m < M; m++) {
        for (int n = 0; n < ldy; n++) {
            const float got = y[(size_t)m * ldy + n];
            if (n >= N) {
                bad += got != GUARD;
                continue;
            }
            double want = (double)(m - n) * 0.25, mag = fabs(want);
            for (int k = 0; k < K; k++) {
                const double t =
                    (double)bf16_value(xb[(size_t)m * Kp + k]) * bf16_value(w[(size_t)n * K + k]);
                want += t;
                mag += fabs(t);
            }
            if (fabs(got - want) > 1e-6 + (K + 2) * 6e-8 * mag) {
                if (bad < 4)
                    printf("  M=%d N=%d K=%d y[%d][%d] = %.8g, want %.8g\n", M, N, K, m, n, got,
                           want);
                bad++;
            }
        }
    }
    bad += y[(size_t)M * ldy] != GUARD;
    free(x), free(w), free(y), free(wp), free(xb);
    return bad;
}

static void test_amx_gemm_against_double_on_ragged_shapes(void) {
    if (!gemm_amx_usable()) {
        printf("skip: this CPU has no AMX with bf16 (or the kernel did not grant the tile "
               "state); the bf16 activations run through gemm_packed here\n");
        return;
    }
    static const int Ms[] = {1, 17, 32, 33, 70}, Ns[] = {1, 16, 17, 40, 64},
                     Ks[] = {1, 31, 32, 33, 300};
    int bad = 0;
    for (size_t a = 0; a < sizeof Ms / sizeof *Ms; a++)
        for (size_t b = 0; b < sizeof Ns / sizeof *Ns; b++)
            for (size_t c = 0; c < sizeof Ks / sizeof *Ks; c++)
                bad += check_shape(Ms[a], Ns[b], Ks[c]);
    CHECK_MSG(bad == 0, "%d values off", bad);
}

/* Deep enough that the kernel blocks the work (gemm_amx.c: groups of panel
 * pairs and blocks of rows sized to stay in L2): several groups, the last
 * partial and ending in a lone panel, several blocks of rows, the last
 * partial. */
static void test_amx_gemm_across_its_blocks(void) {
    if (!gemm_amx_usable()) {
        printf("skip: no AMX here (see above)\n");
        return;
    }
    const int bad = check_shape(150, 300, 1000) + check_shape(97, 530, 2100);
    CHECK_MSG(bad == 0, "%d values off", bad);
}

/* gemm_amx_pack_f32: fp32 panels (ragged N and K) rounded to nearest even
 * into the tiles' layout: at depth 0 of an operand K deep, bit for bit
 * gemm_packed_pack of the rounded values, zero past K; at depth 32 of a
 * deeper one (a second block of channels), the same values at rows 32 on,
 * rows 0-31 untouched. On any CPU (its portable path where AMX is not). */
static void test_fp32_panels_round_into_the_tiles_layout(void) {
    static const int Ns[] = {1, 16, 40}, Ks[] = {1, 31, 33, 100};
    int bad = 0;
    for (size_t a = 0; a < 3; a++)
        for (size_t c = 0; c < 4; c++) {
            const int N = Ns[a], K = Ks[c], Kp = 32 + gemm_amx_pad(K);
            const int cols = (N + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
            float *w = malloc(sizeof(float) * (size_t)N * K);
            uint16_t *h = malloc(sizeof(uint16_t) * (size_t)N * K);
            for (size_t i = 0; i < (size_t)N * K; i++) {
                w[i] = rand_float() * 3.0f;
                h[i] = f32_to_bf16(w[i]);
            }
            const size_t elems = gemm_packed_elems(N, K, DTYPE_BF16), deep = (size_t)cols * Kp;
            float *wp = malloc(gemm_packed_elems(N, K, DTYPE_F32) * sizeof(float));
            uint16_t *want = malloc(deep * sizeof *want), *got = malloc(deep * sizeof *got);
            gemm_packed_pack(wp, w, DTYPE_F32, N, K, K);
            gemm_packed_pack(want, h, DTYPE_BF16, N, K, K);
            memset(got, 0xff, elems * sizeof *got);
            gemm_amx_pack_f32(got, gemm_amx_pad(K), 0, wp, N, K);
            if (memcmp(got, want, elems * sizeof *got) != 0) {
                printf("  N=%d K=%d: not the rounded weight packed\n", N, K);
                bad++;
            }
            for (int j = 0; j < cols; j++)
                for (int k = 0; k < Kp; k++)
                    want[gemm_amx_b_at(j, k, Kp)] = k < 32 ? 0xffff
                                                    : j < N && k - 32 < K
                                                        ? h[(size_t)j * K + k - 32]
                                                        : 0;
            memset(got, 0xff, deep * sizeof *got);
            gemm_amx_pack_f32(got, Kp, 32, wp, N, K);
            if (memcmp(got, want, deep * sizeof *got) != 0) {
                printf("  N=%d K=%d: not the rounded weight at depth 32 of %d\n", N, K, Kp);
                bad++;
            }
            free(w), free(h), free(wp), free(want), free(got);
        }
    CHECK_MSG(bad == 0, "%d shapes differ", bad);
}

int main(void) {
    TEST_RUN(test_fp32_panels_round_into_the_tiles_layout);
    TEST_RUN(test_rounding_to_nearest_even_and_padding);
    TEST_RUN(test_amx_gemm_against_double_on_ragged_shapes);
    TEST_RUN(test_amx_gemm_across_its_blocks);
    return TEST_SUMMARY();
}
