/* Element-wise kernels: activations (SiLU, SiLU-gated product, exact and
 * tanh GELU), add, mul, scale, AdaLN's modulation and gated residual, and
 * the helpers around cuBLAS GEMMs (bias broadcast, the hi/lo split of fp32
 * activations into 16-bit halves, the sum of the two half-products).
 * Grid-stride loops; the formulas are the CPU reference's, with the
 * accurate expf/erff (not __expf) so results agree to an ulp or so. */
#include "kernels/cuda/common.cuh"

__global__ void silu_kernel(float *x, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const float v = x[i];
        x[i] = v / (1.0f + expf(-v));
    }
}

__global__ void silu_mul_kernel(float *out, __nv_bfloat16 *out16, const float *gate,
                                const float *up, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const float g = gate[i], v = g / (1.0f + expf(-g)) * up[i];
        out[i] = v;
        if (out16)
            out16[i] = __float2bfloat16(v);
    }
}

__global__ void gelu_kernel(float *x, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));
    }
}

/* The formula and the order of its products are the CPU reference's. */
__global__ void gelu_tanh_kernel(float *x, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const float v = x[i];
        x[i] = 0.5f * v * (1.0f + tanhf(0.7978845608028654f * (v + 0.044715f * v * v * v)));
    }
}

/* y = x * (1 + scale[col]) + shift[col]; y may be x. */
__global__ void modulate_kernel(float *y, const float *x, const float *scale, const float *shift,
                                size_t dim, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t c = i % dim;
        y[i] = x[i] * (1.0f + scale[c]) + shift[c];
    }
}

__global__ void gate_add_kernel(float *y, const float *a, const float *gate, size_t dim, size_t n) {
    GRID_STRIDE_LOOP(i, n) { y[i] += a[i] * gate[i % dim]; }
}

__global__ void adaln_seqs_kernel(float *y, const float *x, const int *q_start,
                                  const float *const *tabs, int n_seq, size_t a, size_t b,
                                  size_t dim, int gate, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const int r = (int)(i / dim);
        const size_t c = i % dim;
        const float *t = tabs[seq_of(q_start, n_seq, r)];
        if (gate)
            y[i] += x[i] * t[a + c];
        else
            y[i] = x[i] * (1.0f + t[a + c]) + t[b + c];
    }
}

__global__ void add_kernel(float *y, const float *a, size_t n) {
    GRID_STRIDE_LOOP(i, n) { y[i] += a[i]; }
}

__global__ void mul_kernel(float *y, const float *a, size_t n) {
    GRID_STRIDE_LOOP(i, n) { y[i] *= a[i]; }
}

__global__ void scale_kernel(float *x, size_t n, float s) {
    GRID_STRIDE_LOOP(i, n) { x[i] *= s; }
}

cudaError_t kern_silu(float *x, size_t n, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(silu_kernel, grid_for(n), AR_BLOCK, 0, stream, x, n);
    return cudaGetLastError();
}

cudaError_t kern_silu_mul(float *out, void *out16, const float *gate, const float *up, size_t n,
                          cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(silu_mul_kernel, grid_for(n), AR_BLOCK, 0, stream, out, (__nv_bfloat16 *)out16, gate,
              up, n);
    return cudaGetLastError();
}

cudaError_t kern_gelu(float *x, size_t n, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(gelu_kernel, grid_for(n), AR_BLOCK, 0, stream, x, n);
    return cudaGetLastError();
}

cudaError_t kern_gelu_tanh(float *x, size_t n, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(gelu_tanh_kernel, grid_for(n), AR_BLOCK, 0, stream, x, n);
    return cudaGetLastError();
}

cudaError_t kern_modulate(float *y, const float *x, const float *scale, const float *shift,
                          int rows, int dim, cudaStream_t stream) {
    const size_t n = (size_t)rows * (size_t)dim;
    if (rows <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(modulate_kernel, grid_for(n), AR_BLOCK, 0, stream, y, x, scale, shift, (size_t)dim,
              n);
    return cudaGetLastError();
}

cudaError_t kern_gate_add(float *y, const float *a, const float *gate, int rows, int dim,
                          cudaStream_t stream) {
    const size_t n = (size_t)rows * (size_t)dim;
    if (rows <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(gate_add_kernel, grid_for(n), AR_BLOCK, 0, stream, y, a, gate, (size_t)dim, n);
    return cudaGetLastError();
}

cudaError_t kern_add(float *y, const float *a, size_t n, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(add_kernel, grid_for(n), AR_BLOCK, 0, stream, y, a, n);
    return cudaGetLastError();
}

cudaError_t kern_mul(float *y, const float *a, size_t n, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(mul_kernel, grid_for(n), AR_BLOCK, 0, stream, y, a, n);
    return cudaGetLastError();
}

cudaError_t kern_scale(float *x, size_t n, float s, cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(scale_kernel, grid_for(n), AR_BLOCK, 0, stream, x, n, s);
    return cudaGetLastError();
}

/* ---- GEMM helpers ---------------------------------------------------------- */

__global__ void fill_bias_kernel(float *y, const void *bias, int bias_dtype, int64_t cols,
                                 int per_row, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t b = per_row ? i / (size_t)cols : i % (size_t)cols;
        y[i] = bias ? ld_weight(bias, bias_dtype, b) : 0.0f;
    }
}

cudaError_t kern_fill_bias(float *y, const void *bias, kern_dtype_t bias_dtype, int64_t rows,
                           int64_t cols, int per_row, cudaStream_t stream) {
    const size_t n = (size_t)rows * (size_t)cols;
    if (rows <= 0 || cols <= 0)
        return cudaSuccess;
    AR_LAUNCH(fill_bias_kernel, grid_for(n), AR_BLOCK, 0, stream, y, bias, (int)bias_dtype, cols,
              per_row, n);
    return cudaGetLastError();
}

template <typename T> __global__ void split_16_kernel(T *hi, T *lo, const float *x, size_t n) {
    GRID_STRIDE_LOOP(i, n) { split_store(hi, lo, i, x[i]); }
}

cudaError_t kern_split_16(void *hi, void *lo, kern_dtype_t dtype, const float *x, size_t n,
                          cudaStream_t stream) {
    if (n == 0)
        return cudaSuccess;
    if (dtype == KERN_BF16)
        AR_LAUNCH(split_16_kernel<__nv_bfloat16>, grid_for(n), AR_BLOCK, 0, stream,
                  (__nv_bfloat16 *)hi, (__nv_bfloat16 *)lo, x, n);
    else if (dtype == KERN_F16)
        AR_LAUNCH(split_16_kernel<__half>, grid_for(n), AR_BLOCK, 0, stream, (__half *)hi,
                  (__half *)lo, x, n);
    else
        return cudaErrorInvalidValue;
    return cudaGetLastError();
}

__global__ void add_pair_bias_kernel(float *y, size_t y_group_stride, const float *prod,
                                     const void *bias, int bias_dtype, int cols, size_t per_group,
                                     int accumulate, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t g = i / per_group, e = i % per_group, col = e % (size_t)cols;
        const float *a = prod + g * 2 * per_group;
        float v = a[e] + a[per_group + e];
        if (bias)
            v += ld_weight(bias, bias_dtype, g * (size_t)cols + col);
        float *out = y + g * y_group_stride + e;
        *out = accumulate ? *out + v : v;
    }
}

cudaError_t kern_add_pair_bias(float *y, size_t y_group_stride, const float *prod, const void *bias,
                               kern_dtype_t bias_dtype, int groups, int rows, int cols,
                               int accumulate, cudaStream_t stream) {
    const size_t per_group = (size_t)rows * (size_t)cols, n = per_group * (size_t)groups;
    if (rows <= 0 || cols <= 0 || groups <= 0)
        return cudaSuccess;
    AR_LAUNCH(add_pair_bias_kernel, grid_for(n), AR_BLOCK, 0, stream, y, y_group_stride, prod, bias,
              (int)bias_dtype, cols, per_group, accumulate, n);
    return cudaGetLastError();
}

cudaError_t kern_adaln_seqs(float *y, const float *x, const int *q_start, const float *const *tabs,
                            int n_seq, int rows, size_t a, size_t b, int dim, int gate,
                            cudaStream_t stream) {
    const size_t n = (size_t)rows * (size_t)dim;
    if (n_seq <= 0 || rows <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(adaln_seqs_kernel, grid_for(n), AR_BLOCK, 0, stream, y, x, q_start, tabs, n_seq, a, b,
              (size_t)dim, gate, n);
    return cudaGetLastError();
}
