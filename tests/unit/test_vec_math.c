/* Tests for kernels/cpu/vec_math.c on every instruction set this machine runs:
 * exp within 2 ulp of the double-precision value over its whole normal
 * range, its edges (0 below, +inf above, NaN through), SiLU, GELU's tanh
 * form and the softmax's parts (exponentials and their sum, the maximum)
 * against double, on lengths that leave a vector loop's remainder. */
#include "kernels/cpu/vec_isa.h"
#include "kernels/cpu/vec_math.h"
#include "tests/test.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>

/* |got - want| in units of float's last place at want. */
static double ulps(float got, double want) {
    int e;
    frexp(want, &e);
    return fabs(got - want) / ldexp(1.0, e - 24);
}

static void test_exp_within_two_ulp(void) {
    double worst = 0, at = 0;
    for (float x = -87.0f; x <= 88.0f; x += 0.0137f) {
        const double u = ulps(vec_exp(x), exp((double)x));
        if (u > worst) {
            worst = u;
            at = x;
        }
    }
    printf("exp: worst %.2f ulp at %.4f\n", worst, at);
    CHECK_MSG(worst <= 2.0, "exp off by %.2f ulp at %g", worst, at);
    CHECK(vec_exp(0.0f) == 1.0f);
    CHECK(vec_exp(-100.0f) == 0.0f && vec_exp(-INFINITY) == 0.0f);
    CHECK(vec_exp(89.0f) == INFINITY && vec_exp(INFINITY) == INFINITY);
    CHECK(isnan(vec_exp(NAN)));
}

static double silu_ref(double x) { return x / (1 + exp(-x)); }

/* 1e-6 absolute + 4 ulp relative, as the CPU backend's tests ask of it
 * (tests/unit/test_backend_cpu.c) with room to spare. */
static int close_to(float got, double want) {
    if (isnan(want))
        return isnan(got);
    if (isinf(want))
        return got == want;
    return fabs(got - want) <= 1e-6 + 4.8e-7 * fabs(want);
}

/* Runs check(isa, n) on every instruction set this machine runs, at lengths
 * that leave a vector loop's remainder; how many sets ran. */
static int on_every_isa(void (*check)(vec_isa_t isa, size_t n)) {
    static const size_t lengths[] = {1, 7, 16, 17, 1000};
    int ran = 0;
    for (int isa = 0; isa < VEC_N_ISA; isa++) {
        if (!vec_isa_use((vec_isa_t)isa))
            continue;
        ran++;
        for (size_t l = 0; l < sizeof lengths / sizeof *lengths; l++)
            check((vec_isa_t)isa, lengths[l]);
    }
    return ran;
}

static void check_silu(vec_isa_t isa, size_t n) {
    float *x = calloc(n, sizeof *x), *u = calloc(n, sizeof *u);
    float *out = malloc(n * sizeof *out);
    for (size_t i = 0; i < n; i++) {
        x[i] = (float)((double)i / (double)n * 200.0 - 100.0);
        u[i] = (float)(i % 5) - 2.0f;
    }
    static const float specials[] = {NAN, INFINITY, -0.0f, 90.0f, -90.0f, 1e-30f};
    for (size_t i = 0; i < n && i < sizeof specials / sizeof *specials; i++)
        x[n - 1 - i] = specials[i];
    vec_silu_mul(out, x, u, n);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(close_to(out[i], silu_ref(x[i]) * u[i]), "%s silu_mul(%g) * %g = %.9g",
                  vec_isa_name(isa), x[i], u[i], out[i]);
    for (size_t i = 0; i < n; i++)
        out[i] = x[i];
    vec_silu(out, n);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(close_to(out[i], silu_ref(x[i])), "%s silu(%g) = %.9g", vec_isa_name(isa), x[i],
                  out[i]);
    free(x);
    free(u);
    free(out);
}

static void test_silu_on_every_isa(void) { CHECK(on_every_isa(check_silu) >= 1); }

static double gelu_tanh_ref(double x) {
    return 0.5 * x * (1 + tanh(sqrt(2 / M_PI) * (x + 0.044715 * x * x * x)));
}

static void check_gelu_and_softmax_parts(vec_isa_t isa, size_t n) {
    float *x = malloc(n * sizeof *x), *out = malloc(n * sizeof *out);
    for (size_t i = 0; i < n; i++)
        x[i] = (float)((double)i / (double)n * 15.0 - 10.0 + 0.01 * (double)(i % 3));
    x[n / 2] = 7.5f; /* the maximum, not at either end */
    for (size_t i = 0; i < n; i++)
        out[i] = x[i];
    vec_gelu_tanh(out, n);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(close_to(out[i], gelu_tanh_ref(x[i])), "%s gelu_tanh(%g) = %.9g",
                  vec_isa_name(isa), x[i], out[i]);
    const float m = vec_max(x, n);
    CHECK_MSG(m == 7.5f || (n == 1 && m == x[0]), "%s max of %zu = %g", vec_isa_name(isa), n, m);
    double sum_ref = 0;
    for (size_t i = 0; i < n; i++) {
        out[i] = x[i];
        sum_ref += exp((double)x[i] - m);
    }
    const double sum = vec_exp_shift_sum(out, n, m);
    for (size_t i = 0; i < n; i++)
        CHECK_MSG(close_to(out[i], exp((double)x[i] - m)), "%s exp(%g - %g) = %.9g",
                  vec_isa_name(isa), x[i], m, out[i]);
    CHECK_MSG(fabs(sum - sum_ref) <= 4.8e-7 * sum_ref, "%s exp sum %.9g, want %.9g",
              vec_isa_name(isa), sum, sum_ref);
    /* Degree 5, for weights rounded to bf16 next: within 3.5e-6 relative (its
     * float roundings), the sum in float; -inf (a masked score) gives 0. */
    for (size_t i = 0; i < n; i++)
        out[i] = x[i];
    if (n > 2)
        out[1] = -INFINITY;
    const double sum5 = vec_exp5_shift_sum(out, n, m);
    double sum5_ref = 0;
    for (size_t i = 0; i < n; i++) {
        const double want = n > 2 && i == 1 ? 0.0 : exp((double)x[i] - m);
        sum5_ref += want;
        CHECK_MSG(fabs(out[i] - want) <= 3.5e-6 * want, "%s exp5(%g - %g) = %.9g, want %.9g",
                  vec_isa_name(isa), x[i], m, out[i], want);
    }
    CHECK_MSG(fabs(sum5 - sum5_ref) <= 3.5e-6 * sum5_ref, "%s exp5 sum %.9g, want %.9g",
              vec_isa_name(isa), sum5, sum5_ref);
    /* The scores' scaling (and bias) with their maximum: the scalar's bits. */
    float *add = malloc(n * sizeof *add), *want = malloc(n * sizeof *want);
    for (size_t i = 0; i < n; i++)
        add[i] = x[n - 1 - i];
    for (int with_add = 0; with_add < 2; with_add++) {
        float wmax = -INFINITY;
        for (size_t i = 0; i < n; i++) {
            out[i] = x[i];
            want[i] = x[i] * 0.37f + (with_add ? add[i] : 0.0f);
            wmax = want[i] > wmax ? want[i] : wmax;
        }
        const float got = vec_scale_add_max(out, n, 0.37f, with_add ? add : NULL);
        CHECK_MSG(!memcmp(out, want, n * sizeof *out) && got == wmax,
                  "%s scale_add_max of %zu (add %d): max %g, want %g", vec_isa_name(isa), n,
                  with_add, got, wmax);
    }
    free(add), free(want);
    free(x);
    free(out);
    if (n > 1)
        return;
    const float with_nan[] = {1, NAN, 3, 2}; /* once per set */
    CHECK(vec_max(with_nan, 4) == 3 && vec_max(with_nan, 0) == -INFINITY);
    float big[] = {-20, 20, 0};
    vec_gelu_tanh(big, 3);
    CHECK(big[0] == 0 && big[1] == 20 && big[2] == 0);
}

static void test_gelu_and_softmax_parts_on_every_isa(void) {
    CHECK(on_every_isa(check_gelu_and_softmax_parts) >= 1);
}

/* GroupNorm's parts: the sum and the squared deviations in double within
 * a few double ulps of a plain sum (inputs offset by 100, where a float
 * sum would lose the spread), and the affine map bit for bit the scalar
 * (float)(x * sc + sh), SiLU after it bit for bit vec_silu's. */
static void check_moments(vec_isa_t isa, size_t n) {
    float *x = malloc(n * sizeof *x), *out = malloc(n * sizeof *out),
          *want = malloc(n * sizeof *want);
    for (size_t i = 0; i < n; i++)
        x[i] = 100.0f + (float)((double)(i * 37 % 101) / 50.0 - 1.0);
    double sum_ref = 0, sq_ref = 0;
    for (size_t i = 0; i < n; i++)
        sum_ref += x[i];
    const double mean = sum_ref / (double)n;
    for (size_t i = 0; i < n; i++)
        sq_ref += (x[i] - mean) * (x[i] - mean);
    const double sum = vec_sum_f64(x, n), sq = vec_sq_dev_f64(x, n, mean);
    CHECK_MSG(fabs(sum - sum_ref) <= 1e-13 * sum_ref, "%s sum of %zu: %.17g, want %.17g",
              vec_isa_name(isa), n, sum, sum_ref);
    CHECK_MSG(fabs(sq - sq_ref) <= 1e-12 * sq_ref + 1e-300, "%s squares of %zu: %.17g, want %.17g",
              vec_isa_name(isa), n, sq, sq_ref);
    const double sc = 1.7, sh = -170.25;
    for (int silu = 0; silu < 2; silu++) {
        for (size_t i = 0; i < n; i++)
            want[i] = (float)(x[i] * sc + sh);
        if (silu)
            vec_silu(want, n);
        vec_affine_f64(out, x, n, sc, sh, silu);
        CHECK_MSG(!memcmp(out, want, n * sizeof *out), "%s affine%s of %zu differs",
                  vec_isa_name(isa), silu ? "+silu" : "", n);
    }
    free(x), free(out), free(want);
}

static void test_groupnorm_parts_on_every_isa(void) { CHECK(on_every_isa(check_moments) >= 1); }

int main(void) {
    TEST_RUN(test_exp_within_two_ulp);
    TEST_RUN(test_silu_on_every_isa);
    TEST_RUN(test_gelu_and_softmax_parts_on_every_isa);
    TEST_RUN(test_groupnorm_parts_on_every_isa);
    return TEST_SUMMARY();
}
