/* Element-wise SiLU (vec_math.h): one scalar definition of exp that the
 * compiler vectorises per instruction set (omp simd loops in functions
 * compiled for AVX-512, AVX2 with FMA, and the build's baseline), chosen by
 * vec_isa(). */
#include "kernels/cpu/vec_math.h"

#include <math.h>
#include <stdint.h>

#include "kernels/cpu/vec_isa.h"

/* e^x = 2^n * e^r with n = round(x / ln 2) and |r| <= ln 2 / 2, e^r by
 * Taylor's series to r^degree, 2^n built in the exponent bits, for x
 * clamped by the caller so that n converts to int in range. Plain
 * multiplies and adds (fmaf is a library call where the machine lacks FMA,
 * and rintf one without SSE4.1), so that every instruction set's loop
 * vectorises: n is rounded by adding and taking away 1.5 * 2^23, and ln 2
 * is split in two, its first part short enough that n * it is exact and
 * x - n ln 2 loses nothing. */
static inline __attribute__((always_inline)) float exp_series(float x, int degree) {
    static const float inv_factorial[] = {
        1.0f, 1.0f, 0.5f, 1.0f / 6.0f, 1.0f / 24.0f, 1.0f / 120.0f, 1.0f / 720.0f, 1.0f / 5040.0f};
    const float round = 12582912.0f;
    const float n = (x * 1.44269504088896341f + round) - round;
    const float r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
    float p = inv_factorial[degree];
#pragma GCC unroll 8
    for (int d = degree - 1; d >= 0; d--)
        p = p * r + inv_factorial[d];
    union {
        int32_t i;
        float f;
    } scale = {.i = ((int32_t)n + 127) * (1 << 23)};
    return p * scale.f;
}

/* e^x to degree 7 (the remainder below 6e-9 relative): +inf above 88, 0
 * below -87.3, NaN for NaN. Every branch is a choice between values
 * computed anyway, so the loops stay branch-free; x is clamped first (NaN
 * to 0). */
static inline __attribute__((always_inline)) float exp_body(float x) {
    const float xc = isgreater(x, 88.0f) ? 88.0f : isless(x, -87.3f) ? -87.3f : x == x ? x : 0.0f;
    const float e = exp_series(xc, 7);
    return isgreater(x, 88.0f) ? INFINITY : isless(x, -87.3f) ? 0.0f : x == x ? e : x;
}

/* To degree 5 (within 3.5e-6 relative: the remainder 2.4e-6, then float's
 * roundings): for weights that are rounded to bf16 next (a step of 2^-8),
 * where degree 7's precision is lost anyway. Only for x <= 88 (a softmax's
 * scores less their maximum): the one clamp is below, where -inf (a masked
 * score) gives 0; NaN stays NaN. */
static inline __attribute__((always_inline)) float exp5_body(float x) {
    const float e = exp_series(x < -87.3f ? -87.3f : x, 5);
    return x < -87.3f ? 0.0f : e;
}

#define DEFINE_SILU(suffix, target)                                                                \
    target static void silu_##suffix(float *x, size_t n) {                                         \
        _Pragma("omp simd") for (size_t i = 0; i < n; i++) x[i] = x[i] / (1.0f + exp_body(-x[i])); \
    }                                                                                              \
    target static void silu_mul_##suffix(float *out, const float *gate, const float *up,           \
                                         size_t n) {                                               \
        _Pragma("omp simd") for (size_t i = 0; i < n; i++) out[i] =                                \
            gate[i] / (1.0f + exp_body(-gate[i])) * up[i];                                         \
    }

DEFINE_SILU(avx512, __attribute__((target("avx512f"))))
DEFINE_SILU(avx2, __attribute__((target("avx2,fma"))))
DEFINE_SILU(portable, )

/* GELU's tanh form through 0.5 (1 + tanh(u)) = 1 / (1 + e^(-2u)); the
 * softmax's pieces: exponentials summed in double, a maximum. */
#define DEFINE_SOFTMAX_PARTS(suffix, target)                                                       \
    target static void gelu_tanh_##suffix(float *x, size_t n) {                                    \
        _Pragma("omp simd") for (size_t i = 0; i < n; i++) {                                       \
            const float u = 0.7978845608028654f * (x[i] + 0.044715f * x[i] * x[i] * x[i]);         \
            x[i] = x[i] / (1.0f + exp_body(-2.0f * u));                                            \
        }                                                                                          \
    }                                                                                              \
    target static double exp_shift_sum_##suffix(float *x, size_t n, float m) {                     \
        double sum = 0;                                                                            \
        _Pragma("omp simd reduction(+ : sum)") for (size_t i = 0; i < n; i++) {                    \
            x[i] = exp_body(x[i] - m);                                                             \
            sum += x[i];                                                                           \
        }                                                                                          \
        return sum;                                                                                \
    }                                                                                              \
    target static double exp5_shift_sum_##suffix(float *x, size_t n, float m) {                    \
        float sum = 0;                                                                             \
        _Pragma("omp simd reduction(+ : sum)") for (size_t i = 0; i < n; i++) {                    \
            x[i] = exp5_body(x[i] - m);                                                            \
            sum += x[i];                                                                           \
        }                                                                                          \
        return sum;                                                                                \
    }                                                                                              \
    target static float scale_add_max_##suffix(float *x, size_t n, float scale,                    \
                                               const float *add) {                                 \
        float m = -INFINITY;                                                                       \
        if (add) {                                                                                 \
            _Pragma("omp simd reduction(max : m)") for (size_t i = 0; i < n; i++) {                \
                x[i] = x[i] * scale + add[i];                                                      \
                m = x[i] > m ? x[i] : m;                                                           \
            }                                                                                      \
        } else {                                                                                   \
            _Pragma("omp simd reduction(max : m)") for (size_t i = 0; i < n; i++) {                \
                x[i] = x[i] * scale + 0.0f;                                                        \
                m = x[i] > m ? x[i] : m;                                                           \
            }                                                                                      \
        }                                                                                          \
        return m;                                                                                  \
    }                                                                                              \
    target static float max_##suffix(const float *x, size_t n) {                                   \
        float m = -INFINITY;                                                                       \
        _Pragma("omp simd reduction(max : m)") for (size_t i = 0; i < n; i++) m =                  \
            x[i] > m ? x[i] : m;                                                                   \
        return m;                                                                                  \
    }

DEFINE_SOFTMAX_PARTS(avx512, __attribute__((target("avx512f"))))
DEFINE_SOFTMAX_PARTS(avx2, __attribute__((target("avx2,fma"))))
DEFINE_SOFTMAX_PARTS(portable, )

/* A group's moments for GroupNorm, in double with the lanes' partial sums
 * (the order the vector registers give), and its affine map back to float,
 * with SiLU after it where asked (the decoder's every norm but one). */
#define DEFINE_MOMENTS(suffix, target)                                                             \
    target static double sum_f64_##suffix(const float *x, size_t n) {                              \
        double sum = 0;                                                                            \
        _Pragma("omp simd reduction(+ : sum)") for (size_t i = 0; i < n; i++) sum += x[i];         \
        return sum;                                                                                \
    }                                                                                              \
    target static double sq_dev_f64_##suffix(const float *x, size_t n, double mean) {              \
        double sq = 0;                                                                             \
        _Pragma("omp simd reduction(+ : sq)") for (size_t i = 0; i < n; i++) sq +=                 \
            (x[i] - mean) * (x[i] - mean);                                                         \
        return sq;                                                                                 \
    }                                                                                              \
    target static void affine_f64_##suffix(float *out, const float *x, size_t n, double sc,        \
                                           double sh, int silu) {                                  \
        if (silu) {                                                                                \
            _Pragma("omp simd") for (size_t i = 0; i < n; i++) {                                   \
                const float y = (float)(x[i] * sc + sh);                                           \
                out[i] = y / (1.0f + exp_body(-y));                                                \
            }                                                                                      \
        } else {                                                                                   \
            _Pragma("omp simd") for (size_t i = 0; i < n; i++) out[i] = (float)(x[i] * sc + sh);   \
        }                                                                                          \
    }

DEFINE_MOMENTS(avx512, __attribute__((target("avx512f"))))
DEFINE_MOMENTS(avx2, __attribute__((target("avx2,fma"))))
DEFINE_MOMENTS(portable, )

/* Calls the instruction set's version of fn. */
#define VEC_DISPATCH(fn, ...)                                                                      \
    (vec_isa() == VEC_AVX512 ? fn##_avx512(__VA_ARGS__)                                            \
     : vec_isa() == VEC_AVX2 ? fn##_avx2(__VA_ARGS__)                                              \
                             : fn##_portable(__VA_ARGS__))

void vec_gelu_tanh(float *x, size_t n) { VEC_DISPATCH(gelu_tanh, x, n); }

double vec_exp_shift_sum(float *x, size_t n, float m) {
    return VEC_DISPATCH(exp_shift_sum, x, n, m);
}

double vec_exp5_shift_sum(float *x, size_t n, float m) {
    return VEC_DISPATCH(exp5_shift_sum, x, n, m);
}

float vec_max(const float *x, size_t n) { return VEC_DISPATCH(max, x, n); }

float vec_scale_add_max(float *x, size_t n, float scale, const float *add) {
    return VEC_DISPATCH(scale_add_max, x, n, scale, add);
}

float vec_exp(float x) { return exp_body(x); }

float vec_exp5(float x) { return exp5_body(x); }

double vec_sum_f64(const float *x, size_t n) { return VEC_DISPATCH(sum_f64, x, n); }

double vec_sq_dev_f64(const float *x, size_t n, double mean) {
    return VEC_DISPATCH(sq_dev_f64, x, n, mean);
}

void vec_affine_f64(float *out, const float *x, size_t n, double sc, double sh, int silu) {
    VEC_DISPATCH(affine_f64, out, x, n, sc, sh, silu);
}

void vec_silu(float *x, size_t n) {
    switch (vec_isa()) {
    case VEC_AVX512:
        silu_avx512(x, n);
        return;
    case VEC_AVX2:
        silu_avx2(x, n);
        return;
    default:
        silu_portable(x, n);
    }
}

void vec_silu_mul(float *out, const float *gate, const float *up, size_t n) {
    switch (vec_isa()) {
    case VEC_AVX512:
        silu_mul_avx512(out, gate, up, n);
        return;
    case VEC_AVX2:
        silu_mul_avx2(out, gate, up, n);
        return;
    default:
        silu_mul_portable(out, gate, up, n);
    }
}
