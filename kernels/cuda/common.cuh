/* Device helpers shared by the kernels in kernels/: weight loads in any
 * storage type, warp and block reductions, grid sizes. C-like C++: no
 * classes, templates only where a type must vary. */
#ifndef ARSERVE_KERNELS_COMMON_CUH
#define ARSERVE_KERNELS_COMMON_CUH

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "kernels/cuda/kernels.h"
#include "kernels/cuda/launch.h"

/* Threads per block of the element-wise and row kernels. */
#define AR_BLOCK 256
/* Grid-stride kernels start at most this many blocks: enough to fill an
 * H100 (132 SMs x 2048 threads / 256) several times over. */
#define AR_MAX_BLOCKS 4096

/* Element i of a weight stored as dtype, as fp32. The branch is uniform
 * across a launch, so it costs no divergence. */
static __device__ __forceinline__ float ld_weight(const void *p, int dtype, size_t i) {
    if (dtype == KERN_BF16)
        return __bfloat162float(((const __nv_bfloat16 *)p)[i]);
    if (dtype == KERN_F16)
        return __half2float(((const __half *)p)[i]);
    return ((const float *)p)[i];
}

/* ---- the KV cache's element types ---- */

static __host__ __device__ __forceinline__ size_t kv_esize(int dtype) {
    return dtype == KERN_F32 ? 4 : dtype == KERN_F8_E4M3 ? 1 : 2;
}

/* fp8 e4m3 to fp32 (base/dtype.h's f8e4m3_to_f32, bit for bit). */
static __device__ __forceinline__ float f8e4m3_to_float(unsigned char b) {
    const float sign = (b & 0x80u) ? -1.0f : 1.0f;
    const int exp = (b >> 3) & 0xf, man = b & 7;
    if (exp == 0xf && man == 7)
        return __uint_as_float(0x7fc00000u);
    if (exp == 0)
        return sign * (float)man * (1.0f / 512.0f);
    return sign * __uint_as_float(((unsigned)(exp - 7 + 127) << 23) | ((unsigned)man << 20));
}

/* fp32 to fp8 e4m3, round to nearest even, saturating at +-448 (NaN stays
 * NaN), as base/dtype.h's f32_to_f8e4m3. */
static __device__ __forceinline__ unsigned char float_to_f8e4m3(float f) {
    const unsigned u = __float_as_uint(f);
    const unsigned char sign = (unsigned char)((u >> 24) & 0x80u);
    const unsigned a = u & 0x7fffffffu;
    if (a > 0x7f800000u)
        return (unsigned char)(sign | 0x7fu);
    if (a >= 0x43e00000u)
        return (unsigned char)(sign | 0x7eu);
    if (a < 0x3c800000u)
        return (unsigned char)(sign | (unsigned char)rintf(__uint_as_float(a) * 512.0f));
    unsigned code = (((a >> 23) - 127u + 7u) << 3) | ((a >> 20) & 7u);
    const unsigned rest = a & 0xfffffu;
    if (rest > 0x80000u || (rest == 0x80000u && (code & 1u)))
        code++;
    return (unsigned char)(sign | (code > 0x7eu ? 0x7eu : code));
}

/* Element i of a cache row of type dtype, as fp32 (fp8 times scale). */
static __device__ __forceinline__ float ld_kv(const void *row, int dtype, int i, float scale) {
    if (dtype == KERN_F8_E4M3)
        return f8e4m3_to_float(((const unsigned char *)row)[i]) * scale;
    return ld_weight(row, dtype, (size_t)i);
}

/* Stores v at element i of a cache row, rounded to nearest even (fp8: v
 * times inv_scale, saturated). */
static __device__ __forceinline__ void st_kv(void *row, int dtype, int i, float v,
                                             float inv_scale) {
    if (dtype == KERN_F8_E4M3)
        ((unsigned char *)row)[i] = float_to_f8e4m3(v * inv_scale);
    else if (dtype == KERN_BF16)
        ((__nv_bfloat16 *)row)[i] = __float2bfloat16(v);
    else if (dtype == KERN_F16)
        ((__half *)row)[i] = __float2half(v);
    else
        ((float *)row)[i] = v;
}

/* Stores fp32 v at element i of a GEMM operand: as is for fp32; for 16-bit
 * operands as the pair hi = round(v), lo = round(v - hi). v - hi is exact
 * in fp32, so hi + lo is v to about 16 significant bits (2^-17 relative for
 * bf16, 2^-22 for fp16, ignoring underflow of lo). */
static __device__ __forceinline__ void split_store(float *hi, float *lo, size_t i, float v) {
    hi[i] = v;
}

static __device__ __forceinline__ void split_store(__nv_bfloat16 *hi, __nv_bfloat16 *lo, size_t i,
                                                   float v) {
    const __nv_bfloat16 h = __float2bfloat16(v);
    hi[i] = h;
    if (lo)
        lo[i] = __float2bfloat16(v - __bfloat162float(h));
}

static __device__ __forceinline__ void split_store(__half *hi, __half *lo, size_t i, float v) {
    const __half h = __float2half(v);
    hi[i] = h;
    if (lo)
        lo[i] = __float2half(v - __half2float(h));
}

/* The sequence holding row r of a ragged batch: the last s < n_seq with q_start[s] <= r
 * (an empty sequence shares its start with the next one, which wins). */
static __device__ __forceinline__ int seq_of(const int *q_start, int n_seq, int r) {
    int lo = 0, hi = n_seq - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (q_start[mid] <= r)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

template <typename T> static __device__ __forceinline__ T warp_sum(T v) {
    for (int o = 16; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

static __device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o /= 2)
        v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

/* Sum over the block, returned to every thread. blockDim.x is a multiple of
 * 32; red is 32 elements of shared memory, free for reuse on return. */
template <typename T> static inline __device__ T block_sum(T v, T *red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : (T)0;
    v = warp_sum(v);
    __syncthreads(); /* everyone has read red before anyone writes it again */
    return v;
}

/* Max over the block (NaN-free inputs propagate as fmaxf does). */
static inline __device__ float block_max(float v, float *red) {
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, n_warps = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0)
        red[warp] = v;
    __syncthreads();
    v = lane < n_warps ? red[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

/* Blocks for n elements at AR_BLOCK per block, capped (grid-stride loops
 * cover the rest). */
static inline unsigned grid_for(size_t n) {
    const size_t b = (n + AR_BLOCK - 1) / AR_BLOCK;
    return (unsigned)(b < AR_MAX_BLOCKS ? b : AR_MAX_BLOCKS);
}

/* Threads for a row kernel over len elements: a multiple of 32, at most
 * AR_BLOCK, no more than the row needs. */
static inline unsigned block_for(size_t len) {
    const size_t t = (len + 31) / 32 * 32;
    return (unsigned)(t < 32 ? 32 : t > AR_BLOCK ? AR_BLOCK : t);
}

#define GRID_STRIDE_LOOP(i, n)                                                                     \
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < (n);                        \
         i += (size_t)gridDim.x * blockDim.x)

#endif
