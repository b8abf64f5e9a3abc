/* Normalisations and softmax: RMSNorm and LayerNorm (fused: statistics and
 * scaling in one kernel, one block per row), per-head L2 normalisation (one
 * warp per head), row softmax (one block per row) and GroupNorm (statistics
 * split over several blocks per group, merged with Chan's formula, then one
 * element-wise pass). References: engine/backend/backend_cpu.c. */
#include "kernels/cuda/common.cuh"

/* ---- RMSNorm ---------------------------------------------------------------- */

/* One block per row: the sum of squares in fp32 per thread and over the
 * block (rows are at most a few thousand wide), then y = x * inv * w. Each
 * thread reads and writes only its own elements, so y may be x. */
__global__ void rmsnorm_kernel(float *y, __nv_bfloat16 *y16, const float *x, const void *w,
                               int w_dtype, int dim, float eps) {
    __shared__ float red[32];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float inv = rsqrtf(ss / (float)dim + eps);
    __nv_bfloat16 *y16r = y16 ? y16 + (size_t)blockIdx.x * dim : NULL;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) {
        const float v = (xr[i] * inv) * ld_weight(w, w_dtype, (size_t)i);
        yr[i] = v;
        if (y16r)
            y16r[i] = __float2bfloat16(v);
    }
}

cudaError_t kern_rmsnorm(float *y, void *y16, const float *x, const void *w, kern_dtype_t w_dtype,
                         int rows, int dim, float eps, cudaStream_t stream) {
    if (rows <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(rmsnorm_kernel, rows, block_for((size_t)dim), 0, stream, y, (__nv_bfloat16 *)y16, x,
              w, (int)w_dtype, dim, eps);
    return cudaGetLastError();
}

/* ---- LayerNorm (no affine) ---------------------------------------------------- */

/* One block per row: mean, then the biased variance around it, both summed
 * in double as the CPU reference does (rows offset far from 0 would lose
 * digits in fp32), then y = (x - mean) * rstd with the mean rounded to fp32
 * as there. Each thread reads and writes only its own elements, so y may
 * be x. */
__global__ void layernorm_kernel(float *y, const float *x, int dim, float eps) {
    __shared__ double red[32];
    const float *xr = x + (size_t)blockIdx.x * dim;
    float *yr = y + (size_t)blockIdx.x * dim;
    double sum = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        sum += xr[i];
    const double mean = block_sum(sum, red) / dim;
    double sq = 0.0;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        sq += (xr[i] - mean) * (xr[i] - mean);
    sq = block_sum(sq, red);
    const float inv = (float)(1.0 / sqrt(sq / dim + (double)eps)), mu = (float)mean;
    for (int i = threadIdx.x; i < dim; i += blockDim.x)
        yr[i] = (xr[i] - mu) * inv;
}

cudaError_t kern_layernorm(float *y, const float *x, int rows, int dim, float eps,
                           cudaStream_t stream) {
    if (rows <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(layernorm_kernel, rows, block_for((size_t)dim), 0, stream, y, x, dim, eps);
    return cudaGetLastError();
}

/* ---- per-head L2 normalisation -------------------------------------------------- */

/* Heads a block of AR_BLOCK threads normalises, a warp each. */
#define L2_HEADS_PER_BLOCK (AR_BLOCK / 32)

/* One warp per (row, head): the sum of squares in double (as the CPU), then
 * x / max(norm, 1e-12) * mul[h]. A warp past the last head still takes part
 * in the shuffles, with nothing to add. */
__global__ void l2norm_heads_kernel(float *x, const float *mul, int64_t n, int n_heads, int hd) {
    const int64_t i = (int64_t)blockIdx.x * L2_HEADS_PER_BLOCK + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    float *xi = x + (size_t)(i < n ? i : 0) * hd;
    double ss = 0.0;
    for (int d = lane; i < n && d < hd; d += 32)
        ss += (double)xi[d] * xi[d];
    ss = warp_sum(ss);
    if (i >= n)
        return;
    const float norm = fmaxf((float)sqrt(ss), 1e-12f);
    const float m = mul ? mul[i % n_heads] : 1.0f;
    for (int d = lane; d < hd; d += 32)
        xi[d] = xi[d] / norm * m;
}

cudaError_t kern_l2norm_heads(float *x, const float *mul, int rows, int n_heads, int head_dim,
                              cudaStream_t stream) {
    const int64_t n = (int64_t)rows * n_heads;
    if (n <= 0 || head_dim <= 0)
        return cudaSuccess;
    const int64_t blocks = (n + L2_HEADS_PER_BLOCK - 1) / L2_HEADS_PER_BLOCK;
    if (blocks > INT32_MAX)
        return cudaErrorInvalidValue;
    AR_LAUNCH(l2norm_heads_kernel, (unsigned)blocks, AR_BLOCK, 0, stream, x, mul, n, n_heads,
              head_dim);
    return cudaGetLastError();
}

/* ---- softmax ------------------------------------------------------------------ */

/* One block per row: max, exponentials (kept in x) and their sum, scale.
 * Like the CPU reference, a row of only -inf gives NaN (exp(-inf - -inf)). */
__global__ void softmax_kernel(float *x, int cols) {
    __shared__ float red[32];
    float *xr = x + (size_t)blockIdx.x * cols;
    float m = -INFINITY;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        m = fmaxf(m, xr[i]);
    m = block_max(m, red);
    float sum = 0.0f;
    for (int i = threadIdx.x; i < cols; i += blockDim.x) {
        const float e = expf(xr[i] - m);
        xr[i] = e;
        sum += e;
    }
    sum = block_sum(sum, red);
    const float inv = 1.0f / sum;
    for (int i = threadIdx.x; i < cols; i += blockDim.x)
        xr[i] *= inv;
}

cudaError_t kern_softmax(float *x, int rows, int cols, cudaStream_t stream) {
    if (rows <= 0 || cols <= 0)
        return cudaSuccess;
    AR_LAUNCH(softmax_kernel, rows, block_for((size_t)cols), 0, stream, x, cols);
    return cudaGetLastError();
}

/* ---- GroupNorm ------------------------------------------------------------------ */

/* A group is (c / groups) * hw contiguous floats, up to millions in the VQ
 * decoder's last levels, and there are only 32 groups: one block per group
 * would leave most of a GPU idle. So each group is cut into `splits`
 * chunks; a block computes its chunk's count, mean and M2 (sum of squared
 * deviations, two passes over the chunk, in double), the partials are
 * merged per group with Chan et al.'s pairwise formula, and one pass applies
 * the per-channel affine. Statistics in double, as in the CPU reference. */
enum { GN_MIN_CHUNK = 4096, GN_TARGET_BLOCKS = 256 };

static int gn_splits(int c, int hw, int groups) {
    const int64_t n = (int64_t)(c / groups) * hw;
    int64_t s = (GN_TARGET_BLOCKS + groups - 1) / groups;
    const int64_t by_size = (n + GN_MIN_CHUNK - 1) / GN_MIN_CHUNK;
    if (s > by_size)
        s = by_size;
    return s < 1 ? 1 : (int)s;
}

size_t kern_groupnorm_scratch(int c, int hw, int groups) {
    /* (count, mean, M2) per chunk, then (scale, shift) per channel */
    return (size_t)3 * groups * gn_splits(c, hw, groups) + (size_t)2 * c;
}

__global__ void groupnorm_partial_kernel(double *part, const float *in, int64_t group_len,
                                         int64_t chunk) {
    __shared__ double red[32];
    const int g = blockIdx.y, s = blockIdx.x;
    const int64_t lo = (int64_t)s * chunk;
    const int64_t hi = lo + chunk < group_len ? lo + chunk : group_len;
    const float *x = in + (size_t)g * group_len;
    double sum = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        sum += x[i];
    sum = block_sum(sum, red);
    const double cnt = (double)(hi > lo ? hi - lo : 0);
    const double mean = cnt > 0 ? sum / cnt : 0.0;
    double m2 = 0.0;
    for (int64_t i = lo + threadIdx.x; i < hi; i += blockDim.x)
        m2 += (x[i] - mean) * (x[i] - mean);
    m2 = block_sum(m2, red);
    if (threadIdx.x == 0) {
        double *p = part + 3 * ((size_t)g * gridDim.x + s);
        p[0] = cnt;
        p[1] = mean;
        p[2] = m2;
    }
}

/* One thread per group merges its chunks and writes every channel's
 * (scale, shift): out = x * scale + shift. */
__global__ void groupnorm_merge_kernel(double *affine, const double *part, int splits,
                                       const void *gamma, const void *beta, int affine_dtype,
                                       int groups, int cpg, float eps) {
    const int g = blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= groups)
        return;
    const double *p = part + 3 * (size_t)g * splits;
    double n = p[0], mean = p[1], m2 = p[2];
    for (int s = 1; s < splits; s++) {
        const double nb = p[3 * s], mb = p[3 * s + 1], m2b = p[3 * s + 2];
        if (nb == 0)
            continue;
        const double nab = n + nb, delta = mb - mean;
        mean += delta * nb / nab;
        m2 += m2b + delta * delta * n * nb / nab;
        n = nab;
    }
    const double rstd = 1.0 / sqrt(m2 / n + (double)eps);
    for (int ch = g * cpg; ch < (g + 1) * cpg; ch++) {
        const double sc = rstd * ld_weight(gamma, affine_dtype, (size_t)ch);
        affine[2 * ch] = sc;
        affine[2 * ch + 1] = ld_weight(beta, affine_dtype, (size_t)ch) - mean * sc;
    }
}

/* y blocks stride over channels, x blocks over each channel's hw pixels. */
__global__ void groupnorm_apply_kernel(float *out, const float *in, const double *affine, int c,
                                       int hw, int silu) {
    for (int ch = blockIdx.y; ch < c; ch += gridDim.y) {
        const double sc = affine[2 * ch], sh = affine[2 * ch + 1];
        const size_t base = (size_t)ch * hw;
        for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < hw; i += gridDim.x * blockDim.x) {
            const float y = (float)(in[base + i] * sc + sh);
            out[base + i] = silu ? y / (1.0f + expf(-y)) : y;
        }
    }
}

/* groups is at most 65535 (a grid dimension); models use 32. */
cudaError_t kern_groupnorm(float *out, const float *in, const void *gamma, const void *beta,
                           kern_dtype_t affine_dtype, int c, int hw, int groups, float eps,
                           int silu, double *scratch, cudaStream_t stream) {
    if (c <= 0 || hw <= 0 || groups <= 0)
        return cudaSuccess;
    if (groups > 65535)
        return cudaErrorInvalidValue;
    const int splits = gn_splits(c, hw, groups), cpg = c / groups;
    const int64_t group_len = (int64_t)cpg * hw, chunk = (group_len + splits - 1) / splits;
    double *part = scratch, *affine = scratch + (size_t)3 * groups * splits;
    AR_LAUNCH(groupnorm_partial_kernel, dim3(splits, groups), block_for((size_t)chunk), 0, stream,
              part, in, group_len, chunk);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return e;
    AR_LAUNCH(groupnorm_merge_kernel, (groups + 31) / 32, 32, 0, stream, affine, part, splits,
              gamma, beta, (int)affine_dtype, groups, cpg, eps);
    if ((e = cudaGetLastError()) != cudaSuccess)
        return e;
    const unsigned gx = grid_for((size_t)hw) < 64 ? grid_for((size_t)hw) : 64;
    AR_LAUNCH(groupnorm_apply_kernel, dim3(gx, c < 65535 ? c : 65535), AR_BLOCK, 0, stream, out, in,
              affine, c, hw, silu);
    return cudaGetLastError();
}
