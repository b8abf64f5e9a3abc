/* Image kernels for the VQ decoder: the im2col panel that turns a stride-1
 * convolution into a cuBLAS GEMM (see backend_cuda.c's conv2d for why
 * im2col and not an implicit-GEMM kernel), nearest 2x upsampling, and a
 * tiled transpose between channel-major images and token rows. */
#include "kernels/common.cuh"

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
