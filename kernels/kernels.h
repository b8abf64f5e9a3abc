/* Launchers of arserve's CUDA kernels (kernels/ *.cu), callable from C: the
 * CUDA backend (engine/backend_cuda.c) calls these and cuBLAS, nothing else.
 *
 * Contract: each launcher queues its kernel(s) on `stream` and returns the
 * launch error (cudaGetLastError() right after each launch), cudaSuccess
 * when all went in. Empty work (a zero size) launches nothing. Pointers are
 * device memory unless a parameter says host; `dtype` arguments are the
 * storage types of weights kept as loaded (DTYPE_F32, DTYPE_F16,
 * DTYPE_BF16). Shapes follow engine/backend.h; the caller checks them. */
#ifndef ARSERVE_KERNELS_H
#define ARSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#include "engine/dtype.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ---- norms and softmax (kernels/norm.cu) ---- */

/* y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w[:]; y may be x. */
cudaError_t kern_rmsnorm(float *y, const float *x, const void *w, dtype_t w_dtype, int rows,
                         int dim, float eps, cudaStream_t stream);

/* Row-wise softmax in place over cols; a row of only -inf becomes NaN. */
cudaError_t kern_softmax(float *x, int rows, int cols, cudaStream_t stream);

/* Doubles of scratch kern_groupnorm needs for these sizes. */
size_t kern_groupnorm_scratch(int c, int hw, int groups);
/* GroupNorm of (c, hw) in `groups` groups with affine gamma/beta [c]; out
 * may be in; scratch holds kern_groupnorm_scratch(c, hw, groups) doubles. */
cudaError_t kern_groupnorm(float *out, const float *in, const void *gamma, const void *beta,
                           dtype_t affine_dtype, int c, int hw, int groups, float eps,
                           double *scratch, cudaStream_t stream);

/* ---- rotary embeddings (kernels/rope.cu) ---- */

/* Rotate-half RoPE in place at positions pos[r] (device, rows ints). */
cudaError_t kern_rope(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                      cudaStream_t stream);
/* LlamaGen's 2D RoPE in place: pos holds (grid row, grid column) per row
 * (device, 2 * rows ints); see backend.h's rope_2d. */
cudaError_t kern_rope_2d(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                         cudaStream_t stream);

/* ---- element-wise (kernels/elementwise.cu) ---- */

cudaError_t kern_silu(float *x, size_t n, cudaStream_t stream);
cudaError_t kern_silu_mul(float *out, const float *gate, const float *up, size_t n,
                          cudaStream_t stream);
cudaError_t kern_gelu(float *x, size_t n, cudaStream_t stream);                /* exact erf form */
cudaError_t kern_add(float *y, const float *a, size_t n, cudaStream_t stream); /* y += a */
cudaError_t kern_scale(float *x, size_t n, float s, cudaStream_t stream);      /* x *= s */

/* y[r, j] = bias[per_row ? r : j] for a rows x cols y; zeros when bias is
 * NULL. */
cudaError_t kern_fill_bias(float *y, const void *bias, dtype_t bias_dtype, int64_t rows,
                           int64_t cols, int per_row, cudaStream_t stream);

/* Splits fp32 x into two 16-bit values of type dtype (F16 or BF16) with
 * hi = round(x) and lo = round(x - hi), so hi + lo carries about 16 bits of
 * x's 24-bit significand: GEMMs on both halves with fp32 accumulation give
 * nearly fp32 products from tensor cores. n elements each. */
cudaError_t kern_split_16(void *hi, void *lo, dtype_t dtype, const float *x, size_t n,
                          cudaStream_t stream);

/* y[r, j] = a[r, j] + b[r, j] (+ bias[j] when bias is not NULL). */
cudaError_t kern_add_pair_bias(float *y, const float *a, const float *b, const void *bias,
                               dtype_t bias_dtype, int rows, int cols, cudaStream_t stream);

/* ---- lookups (kernels/embedding.cu) ---- */

/* out[i, :] = table[ids[i], :] (ids on the device, already checked against
 * the vocabulary), optionally divided by max(L2 norm, 1e-12). */
cudaError_t kern_embedding(float *out, const void *table, dtype_t table_dtype, int dim,
                           const int *ids, int n, int l2_normalize, cudaStream_t stream);

/* ---- images (kernels/image.cu) ---- */

/* The im2col panel of output pixels [p0, p0 + np) of a stride-1 k x k
 * convolution with zero padding pad: row r = (ci*k + ky)*k + kx, column
 * p - p0, np columns. dtype F32 writes floats to hi (lo unused); F16/BF16
 * write the kern_split_16 halves to hi and lo. */
cudaError_t kern_im2col(void *hi, void *lo, dtype_t dtype, const float *in, int c_in, int h, int w,
                        int k, int pad, int wo, int64_t p0, int np, cudaStream_t stream);
cudaError_t kern_upsample_nearest2x(float *out, const float *in, int c, int h, int w,
                                    cudaStream_t stream);
/* out[j, i] = in[i, j] for a rows x cols in; out must not be in. */
cudaError_t kern_transpose(float *out, const float *in, int rows, int cols, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
