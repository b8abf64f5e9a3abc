/* 8-bit Linear weights (backend.h's weight_load_8bit) for the cuBLAS GEMM:
 * their int8 or fp8 e4m3 values widened to bf16, which holds every one of
 * them exactly, and the GEMM's fp32 products times each output row's scale
 * afterwards, so the weight itself is never rounded. */
#include "kernels/cuda/common.cuh"

/* An 8-bit weight's element as fp32, exactly (a bf16 holds it exactly too:
 * int8 needs 7 significant bits, e4m3 4, and e4m3's range is bf16's). */
static __device__ __forceinline__ float ld_weight8(const void *p, int dtype, size_t i) {
    if (dtype == KERN_I8)
        return (float)((const signed char *)p)[i];
    return f8e4m3_to_float(((const unsigned char *)p)[i]);
}

/* A run of WIDEN_RUN elements a thread: one division for the run (the group
 * carried from element to element), and one 16-byte store for a whole run
 * (dst is 16-byte aligned, kern_widen_8bit checks, and run t starts 16 t
 * bytes in); a partial last run goes element by element. */
#define WIDEN_RUN 8

__global__ void widen_8bit_kernel(__nv_bfloat16 *dst, const void *src, int dtype, size_t per_group,
                                  size_t src_group_stride, size_t n) {
    GRID_STRIDE_LOOP(t, (n + WIDEN_RUN - 1) / WIDEN_RUN) {
        const size_t i0 = t * WIDEN_RUN, run = n - i0 < WIDEN_RUN ? n - i0 : WIDEN_RUN;
        size_t g = i0 / per_group, e = i0 - g * per_group;
        unsigned short v[WIDEN_RUN];
        for (size_t r = 0; r < run; r++) {
            v[r] = __bfloat16_as_ushort(
                __float2bfloat16(ld_weight8(src, dtype, g * src_group_stride + e)));
            if (++e == per_group)
                e = 0, g++;
        }
        if (run == WIDEN_RUN) {
            uint4 four;
            four.x = v[0] | (unsigned)v[1] << 16;
            four.y = v[2] | (unsigned)v[3] << 16;
            four.z = v[4] | (unsigned)v[5] << 16;
            four.w = v[6] | (unsigned)v[7] << 16;
            *(uint4 *)(dst + i0) = four;
        } else {
            for (size_t r = 0; r < run; r++)
                dst[i0 + r] = __ushort_as_bfloat16(v[r]);
        }
    }
}

cudaError_t kern_widen_8bit(void *dst, const void *src, kern_dtype_t dtype, int groups,
                            size_t per_group, size_t src_group_stride, cudaStream_t stream) {
    const size_t n = per_group * (size_t)(groups > 0 ? groups : 0);
    if (n == 0)
        return cudaSuccess;
    if ((dtype != KERN_I8 && dtype != KERN_F8_E4M3) || ((uintptr_t)dst & 15) != 0)
        return cudaErrorInvalidValue;
    AR_LAUNCH(widen_8bit_kernel, grid_for((n + WIDEN_RUN - 1) / WIDEN_RUN), AR_BLOCK, 0, stream,
              (__nv_bfloat16 *)dst, src, (int)dtype, per_group, src_group_stride, n);
    return cudaGetLastError();
}

__global__ void scale_cols_kernel(float *y, size_t y_group_stride, int64_t ldy, const float *prod,
                                  int pair, const float *scale, const void *bias, int bias_dtype,
                                  size_t sb_group_stride, int64_t cols, size_t per_group,
                                  int accumulate, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t g = i / per_group, e = i - g * per_group;
        const size_t r = e / (size_t)cols, j = e - r * (size_t)cols;
        const float *p = prod + g * (pair ? 2 : 1) * per_group + e;
        const float sum = pair ? p[0] + p[per_group] : p[0];
        float v = sum * scale[g * sb_group_stride + j];
        if (bias)
            v += ld_weight(bias, bias_dtype, g * sb_group_stride + j);
        float *out = y + g * y_group_stride + r * (size_t)ldy + j;
        *out = accumulate ? *out + v : v;
    }
}

cudaError_t kern_scale_cols(float *y, size_t y_group_stride, int64_t ldy, const float *prod,
                            int pair, const float *scale, const void *bias, kern_dtype_t bias_dtype,
                            size_t sb_group_stride, int groups, int rows, int cols, int accumulate,
                            cudaStream_t stream) {
    const size_t per_group = (size_t)rows * (size_t)cols, n = per_group * (size_t)groups;
    if (rows <= 0 || cols <= 0 || groups <= 0)
        return cudaSuccess;
    AR_LAUNCH(scale_cols_kernel, grid_for(n), AR_BLOCK, 0, stream, y, y_group_stride, ldy, prod,
              pair, scale, bias, (int)bias_dtype, sb_group_stride, (int64_t)cols, per_group,
              accumulate, n);
    return cudaGetLastError();
}
