/* Image kernels for the VQ decoders: the im2col panel that turns a stride-1
 * convolution into a cuBLAS GEMM (see backend_cuda.c's conv2d for why
 * im2col and not an implicit-GEMM kernel), nearest 2x upsampling, bicubic
 * and area resampling (next-scale models' token maps), and a tiled
 * transpose between channel-major images and token rows. */
#include "kernels/cuda/common.cuh"

/* One element of the panel per iteration; 64-bit indices (panels reach
 * hundreds of millions of elements at 384 px). */
template <typename T>
__global__ void im2col_kernel(T *hi, T *lo, const float *in, int h, int w, int k, int pad, int wo,
                              int64_t p0, int np, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t r = i / (size_t)np;
        const int64_t p = p0 + (int64_t)(i % (size_t)np);
        const int kk = k * k, ci = (int)(r / kk), ky = (int)(r % kk) / k, kx = (int)(r % k);
        const int iy = (int)(p / wo) + ky - pad, ix = (int)(p % wo) + kx - pad;
        const float v =
            iy >= 0 && iy < h && ix >= 0 && ix < w ? in[((size_t)ci * h + iy) * w + ix] : 0.0f;
        split_store(hi, lo, i, v);
    }
}

cudaError_t kern_im2col(void *hi, void *lo, kern_dtype_t dtype, const float *in, int c_in, int h,
                        int w, int k, int pad, int wo, int64_t p0, int np, cudaStream_t stream) {
    const size_t n = (size_t)c_in * k * k * (size_t)np;
    if (n == 0)
        return cudaSuccess;
    if (dtype == KERN_F32)
        AR_LAUNCH(im2col_kernel<float>, grid_for(n), AR_BLOCK, 0, stream, (float *)hi, (float *)lo,
                  in, h, w, k, pad, wo, p0, np, n);
    else if (dtype == KERN_BF16)
        AR_LAUNCH(im2col_kernel<__nv_bfloat16>, grid_for(n), AR_BLOCK, 0, stream,
                  (__nv_bfloat16 *)hi, (__nv_bfloat16 *)lo, in, h, w, k, pad, wo, p0, np, n);
    else if (dtype == KERN_F16)
        AR_LAUNCH(im2col_kernel<__half>, grid_for(n), AR_BLOCK, 0, stream, (__half *)hi,
                  (__half *)lo, in, h, w, k, pad, wo, p0, np, n);
    else
        return cudaErrorInvalidValue;
    return cudaGetLastError();
}

/* One output element per iteration: out (c, 2h, 2w) from in (c, h, w). */
__global__ void upsample_nearest2x_kernel(float *out, const float *in, int h, int w, size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t w2 = 2 * (size_t)w, plane2 = 4 * (size_t)h * w;
        const size_t ch = i / plane2, rem = i % plane2, y = rem / w2, x = rem % w2;
        out[i] = in[(ch * h + y / 2) * w + x / 2];
    }
}

cudaError_t kern_upsample_nearest2x(float *out, const float *in, int c, int h, int w,
                                    cudaStream_t stream) {
    const size_t n = 4 * (size_t)c * h * w;
    if (n == 0)
        return cudaSuccess;
    AR_LAUNCH(upsample_nearest2x_kernel, grid_for(n), AR_BLOCK, 0, stream, out, in, h, w, n);
    return cudaGetLastError();
}

/* Keys' cubic convolution weights (A = -0.75) of source indices floor - 1
 * .. floor + 2 for a sample at fraction t past floor: cpu_resize_bicubic's
 * (PyTorch's) formulas, term for term. */
static __device__ __forceinline__ void cubic_weights(float t, float w[4]) {
    const float A = -0.75f;
    const float x1 = t + 1.0f, x2 = 1.0f - t, x3 = 2.0f - t;
    w[0] = ((A * x1 - 5.0f * A) * x1 + 8.0f * A) * x1 - 4.0f * A;
    w[1] = ((A + 2.0f) * t - (A + 3.0f)) * t * t + 1.0f;
    w[2] = ((A + 2.0f) * x2 - (A + 3.0f)) * x2 * x2 + 1.0f;
    w[3] = ((A * x3 - 5.0f * A) * x3 + 8.0f * A) * x3 - 4.0f * A;
}

/* Source position of output index o (align_corners=False, not clamped):
 * its floor, and the fraction past it. */
static __device__ __forceinline__ int cubic_source(int o, int in, int out, float *t) {
    const float real = (float)in / (float)out * ((float)o + 0.5f) - 0.5f;
    const float f = floorf(real);
    *t = real - f;
    return (int)f;
}

static __device__ __forceinline__ int clamp_index(int v, int n) {
    return v < 0 ? 0 : v >= n ? n - 1 : v;
}

/* One output element per iteration: 4 x 4 source pixels, indices clamped
 * at the borders, rows weighted along x first (the CPU's order). */
__global__ void resize_bicubic_kernel(float *out, const float *in, int h, int w, int H, int W,
                                      size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t plane = (size_t)H * W, ch = i / plane, rem = i % plane;
        const int oy = (int)(rem / W), ox = (int)(rem % W);
        float ty, tx, wy[4], wx[4], acc = 0.0f;
        const int y0 = cubic_source(oy, h, H, &ty), x0 = cubic_source(ox, w, W, &tx);
        cubic_weights(ty, wy);
        cubic_weights(tx, wx);
        for (int a = 0; a < 4; a++) {
            const float *r = in + (ch * h + clamp_index(y0 - 1 + a, h)) * w;
            float row = 0.0f;
            for (int b = 0; b < 4; b++)
                row += r[clamp_index(x0 - 1 + b, w)] * wx[b];
            acc += row * wy[a];
        }
        out[i] = acc;
    }
}

/* One output element per iteration: the mean of its source cell, rows
 * floor(oy * h / H) .. ceil((oy + 1) * h / H) - 1 and likewise columns,
 * summed in the CPU's order. */
__global__ void resize_area_kernel(float *out, const float *in, int h, int w, int H, int W,
                                   size_t n) {
    GRID_STRIDE_LOOP(i, n) {
        const size_t plane = (size_t)H * W, ch = i / plane, rem = i % plane;
        const int64_t oy = (int64_t)(rem / W), ox = (int64_t)(rem % W);
        const int y0 = (int)(oy * h / H), y1 = (int)(((oy + 1) * h + H - 1) / H);
        const int x0 = (int)(ox * w / W), x1 = (int)(((ox + 1) * w + W - 1) / W);
        float sum = 0.0f;
        for (int y = y0; y < y1; y++)
            for (int x = x0; x < x1; x++)
                sum += in[(ch * h + y) * w + x];
        out[i] = sum / (float)((y1 - y0) * (x1 - x0));
    }
}

cudaError_t kern_resize_bicubic(float *out, const float *in, int c, int h, int w, int H, int W,
                                cudaStream_t stream) {
    const size_t n = (size_t)c * H * W;
    if (c <= 0 || H <= 0 || W <= 0)
        return cudaSuccess;
    if (h <= 0 || w <= 0)
        return cudaErrorInvalidValue;
    AR_LAUNCH(resize_bicubic_kernel, grid_for(n), AR_BLOCK, 0, stream, out, in, h, w, H, W, n);
    return cudaGetLastError();
}

cudaError_t kern_resize_area(float *out, const float *in, int c, int h, int w, int H, int W,
                             cudaStream_t stream) {
    const size_t n = (size_t)c * H * W;
    if (c <= 0 || H <= 0 || W <= 0)
        return cudaSuccess;
    if (h <= 0 || w <= 0)
        return cudaErrorInvalidValue;
    AR_LAUNCH(resize_area_kernel, grid_for(n), AR_BLOCK, 0, stream, out, in, h, w, H, W, n);
    return cudaGetLastError();
}

/* 32 x 32 tiles through shared memory (a padding column keeps the column
 * reads free of bank conflicts); blocks of 32 x 8 threads, four rows each.
 * x blocks walk the columns, y blocks the rows, striding past 65535. */
enum { TILE = 32, TILE_ROWS = 8 };

__global__ void transpose_kernel(float *out, const float *in, int rows, int cols) {
    __shared__ float tile[TILE][TILE + 1];
    for (int64_t by = blockIdx.y; by * TILE < rows; by += gridDim.y) {
        const int64_t r0 = by * TILE, c0 = (int64_t)blockIdx.x * TILE;
        for (int dy = threadIdx.y; dy < TILE; dy += TILE_ROWS) {
            const int64_t r = r0 + dy, c = c0 + threadIdx.x;
            if (r < rows && c < cols)
                tile[dy][threadIdx.x] = in[r * cols + c];
        }
        __syncthreads();
        for (int dy = threadIdx.y; dy < TILE; dy += TILE_ROWS) {
            const int64_t c = c0 + dy, r = r0 + threadIdx.x; /* out row c, column r */
            if (c < cols && r < rows)
                out[c * rows + r] = tile[threadIdx.x][dy];
        }
        __syncthreads();
    }
}

cudaError_t kern_transpose(float *out, const float *in, int rows, int cols, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0)
        return cudaSuccess;
    const unsigned gx = (unsigned)((cols + TILE - 1) / TILE);
    const unsigned gy_need = (unsigned)((rows + TILE - 1) / TILE);
    const unsigned gy = gy_need < 65535 ? gy_need : 65535;
    AR_LAUNCH(transpose_kernel, dim3(gx, gy), dim3(TILE, TILE_ROWS), 0, stream, out, in, rows,
              cols);
    return cudaGetLastError();
}
