/* Tests for kernels/cpu/vec_attn.c: every kernel this machine runs against a
 * double-precision reference, on head sizes that are and are not multiples
 * of the vector widths, keys scattered in memory, and the values'
 * accumulation adding into acc without touching past d; and bf16 and fp16
 * rows giving the same bytes as the same rows widened to fp32 first. */
#include "kernels/cpu/vec_attn.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rand_state = 0x9E3779B97F4A7C15ULL;
static float rand_float(void) { return test_xorshift_float(&rand_state); }

#define MAX_N 300
#define MAX_D 160
#define GUARD 1e30f

/* Rows of d floats at scattered places (every third row of a larger
 * buffer, in reverse order): no kernel may assume they follow each other. */
static void scattered_rows(float *buf, const float **rows, int n, int d) {
    for (int j = 0; j < n; j++) {
        rows[j] = buf + (size_t)(3 * (n - 1 - j)) * d;
        for (int i = 0; i < d; i++)
            ((float *)rows[j])[i] = rand_float();
    }
}

static int check(int n, int d) {
    static float kbuf[3 * MAX_N * MAX_D], vbuf[3 * MAX_N * MAX_D];
    const float *k[MAX_N], *v[MAX_N];
    float q[MAX_D], scores[MAX_N + 1], p[MAX_N], acc[MAX_D + 1], acc0[MAX_D];
    scattered_rows(kbuf, k, n, d);
    scattered_rows(vbuf, v, n, d);
    for (int i = 0; i < d; i++)
        q[i] = rand_float();
    for (int j = 0; j < n; j++)
        p[j] = (rand_float() + 1) / 2;
    for (int i = 0; i < d; i++)
        acc[i] = acc0[i] = rand_float();
    acc[d] = scores[n] = GUARD;
    const float scale = 0.125f;
    vec_dots(scores, q, (const void *const *)k, DTYPE_F32, n, d, scale);
    vec_axpys(acc, p, (const void *const *)v, DTYPE_F32, n, d);
    int bad = scores[n] != GUARD || acc[d] != GUARD;
    for (int j = 0; j < n; j++) {
        double want = 0, mag = 0;
        for (int i = 0; i < d; i++) {
            want += (double)q[i] * k[j][i];
            mag += fabs((double)q[i] * k[j][i]);
        }
        bad += !(fabs(scores[j] - want * scale) <= 1e-6 * (mag * scale + 1));
    }
    for (int i = 0; i < d; i++) {
        double want = acc0[i], mag = fabs(acc0[i]);
        for (int j = 0; j < n; j++) {
            want += (double)p[j] * v[j][i];
            mag += fabs((double)p[j] * v[j][i]);
        }
        bad += !(fabs(acc[i] - want) <= 1e-6 * (mag + 1));
    }
    return bad;
}

static void test_every_kernel_matches_the_reference(void) {
    static const int ns[] = {1, 2, 3, 9, 64, 256, MAX_N};
    static const int ds[] = {1, 7, 8, 15, 16, 17, 32, 48, 64, 80, 128, MAX_D};
    int ran = 0;
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        ran++;
        for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
            for (size_t b = 0; b < sizeof ds / sizeof *ds; b++)
                CHECK_MSG(check(ns[a], ds[b]) == 0, "%s n=%d d=%d", vec_isa_name(isa), ns[a],
                          ds[b]);
    }
    CHECK(ran >= 1);
}

/* 16-bit rows of type t (scattered, as above) against the same rows
 * widened to fp32 first: the same scores and sums, bit for bit. 0 when
 * equal. */
static int check_16bit(int n, int d, dtype_t t) {
    static uint16_t kh[MAX_N * MAX_D], vh[MAX_N * MAX_D];
    static float kf[MAX_N * MAX_D], vf[MAX_N * MAX_D];
    const void *k16[MAX_N], *v16[MAX_N], *k32[MAX_N], *v32[MAX_N];
    float q[MAX_D], p[MAX_N], s16[MAX_N], s32[MAX_N], a16[MAX_D], a32[MAX_D];
    for (int j = 0; j < n; j++) {
        const size_t at = (size_t)(n - 1 - j) * d; /* reverse order */
        for (int i = 0; i < d; i++) {
            const float a = rand_float(), b = rand_float();
            kh[at + i] = t == DTYPE_F16 ? f32_to_f16(a) : f32_to_bf16(a);
            vh[at + i] = t == DTYPE_F16 ? f32_to_f16(b) : f32_to_bf16(b);
            kf[at + i] = t == DTYPE_F16 ? f16_to_f32(kh[at + i]) : bf16_to_f32(kh[at + i]);
            vf[at + i] = t == DTYPE_F16 ? f16_to_f32(vh[at + i]) : bf16_to_f32(vh[at + i]);
        }
        k16[j] = kh + at, v16[j] = vh + at, k32[j] = kf + at, v32[j] = vf + at;
        p[j] = (rand_float() + 1) / 2;
    }
    for (int i = 0; i < d; i++)
        q[i] = rand_float(), a16[i] = a32[i] = rand_float();
    vec_dots(s16, q, k16, t, n, d, 0.125f);
    vec_dots(s32, q, k32, DTYPE_F32, n, d, 0.125f);
    vec_axpys(a16, p, v16, t, n, d);
    vec_axpys(a32, p, v32, DTYPE_F32, n, d);
    return memcmp(s16, s32, sizeof(float) * (size_t)n) != 0 ||
           memcmp(a16, a32, sizeof(float) * (size_t)d) != 0;
}

static void test_16bit_rows_match_their_fp32_widening(void) {
    static const int ns[] = {1, 9, 256};
    static const int ds[] = {1, 7, 16, 17, 64, 80, MAX_D};
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        for (int t = 0; t < 2; t++)
            for (size_t a = 0; a < sizeof ns / sizeof *ns; a++)
                for (size_t b = 0; b < sizeof ds / sizeof *ds; b++) {
                    const dtype_t dt = t ? DTYPE_F16 : DTYPE_BF16;
                    CHECK_MSG(check_16bit(ns[a], ds[b], dt) == 0, "%s %s n=%d d=%d",
                              vec_isa_name(isa), dtype_name(dt), ns[a], ds[b]);
                }
    }
}

int main(void) {
    TEST_RUN(test_every_kernel_matches_the_reference);
    TEST_RUN(test_16bit_rows_match_their_fp32_widening);
    return TEST_SUMMARY();
}
