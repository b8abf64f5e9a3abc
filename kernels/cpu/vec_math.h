/* The CPU backend's element-wise SiLU, GELU, softmax and GroupNorm parts, vectorised for the
 * machine (vec_isa.h) around a polynomial exp: libm's expf is a call per element, which no compiler
 * vectorises, and it was a tenth of an image decode. */
#ifndef ARSERVE_VEC_MATH_H
#define ARSERVE_VEC_MATH_H

#include <stddef.h>

/* e^x within 2 ulp (normal results; the tests bound it): 0 below -87.3
 * (where float's results leave the normal range), +inf above 88 (a few ulp
 * short of float's largest exp, 88.72), NaN for NaN. */
float vec_exp(float x);

/* x[i] = x[i] / (1 + e^-x[i]) for i < n. */
void vec_silu(float *x, size_t n);

/* out[i] = gate[i] / (1 + e^-gate[i]) * up[i] for i < n; out may be gate or up. */
void vec_silu_mul(float *out, const float *gate, const float *up, size_t n);

/* x[i] = x[i] * (1 + tanh(u)) / 2 with u = sqrt(2 / pi) (x[i] + 0.044715 x[i]^3)
 * (GELU's tanh form), for i < n. */
void vec_gelu_tanh(float *x, size_t n);

/* x[i] = e^(x[i] - m) for i < n; returns their sum, added in double. */
double vec_exp_shift_sum(float *x, size_t n, float m);

/* vec_exp_shift_sum for weights rounded to bf16 next (cpu_activations
 * bf16's softmax), where x[i] - m <= 88 (m the row's maximum): the
 * exponential vec_exp's to degree 5, within 3.5e-6 relative (a thousandth
 * of the step the rounding takes), the sum added in float. */
double vec_exp5_shift_sum(float *x, size_t n, float m);

/* One value of that exponential, the same bits. */
float vec_exp5(float x);

/* The largest x[i], i < n (-inf for n = 0); NaNs are passed over. */
float vec_max(const float *x, size_t n);

/* x[i] = x[i] * scale + add[i] (+ 0 where add is NULL), i < n, each rounded
 * once as the separate multiply and add (no fused multiply-add); returns
 * the largest, as vec_max. */
float vec_scale_add_max(float *x, size_t n, float scale, const float *add);

/* The sum of x[i], i < n, in double (the lanes' partial sums, then theirs). */
double vec_sum_f64(const float *x, size_t n);

/* The sum of (x[i] - mean)^2, i < n, in double, as vec_sum_f64 adds. */
double vec_sq_dev_f64(const float *x, size_t n, double mean);

/* out[i] = (float)(x[i] * sc + sh) computed in double (out may be x),
 * then, where silu, out[i] / (1 + e^-out[i]) as vec_silu gives it. */
void vec_affine_f64(float *out, const float *x, size_t n, double sc, double sh, int silu);

#endif
