/* Tests for kernels/cpu/vec_attn.c: every kernel this machine runs against a
 * double-precision reference, on head sizes that are and are not multiples
 * of the vector widths, keys scattered in memory, and the values'
 * accumulation adding into acc without touching past d. */
#include "kernels/cpu/vec_attn.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdlib.h>

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
    vec_dots(scores, q, k, n, d, scale);
    vec_axpys(acc, p, v, n, d);
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

int main(void) {
    TEST_RUN(test_every_kernel_matches_the_reference);
    return TEST_SUMMARY();
}
