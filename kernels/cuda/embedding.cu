/* Embedding lookup: one block per id copies its table row (any storage
 * type) to fp32 and, for L2-normalised codebooks (Janus's VQ), divides it by
 * max(||row||, 1e-12) like torch's F.normalize. */
#include "kernels/cuda/common.cuh"

__global__ void embedding_kernel(float *out, const void *table, int table_dtype, int dim,
                                 const int *ids, int l2_normalize) {
    __shared__ float red[32];
    const size_t row = (size_t)ids[blockIdx.x] * dim;
    float *o = out + (size_t)blockIdx.x * dim;
    float ss = 0.0f;
    for (int j = threadIdx.x; j < dim; j += blockDim.x) {
        const float v = ld_weight(table, table_dtype, row + j);
        o[j] = v;
        ss += v * v;
    }
    if (!l2_normalize) /* uniform across the block: no thread skips a barrier alone */
        return;
    ss = block_sum(ss, red);
    const float norm = fmaxf(sqrtf(ss), 1e-12f);
    for (int j = threadIdx.x; j < dim; j += blockDim.x)
        o[j] /= norm;
}

cudaError_t kern_embedding(float *out, const void *table, kern_dtype_t table_dtype, int dim,
                           const int *ids, int n, int l2_normalize, cudaStream_t stream) {
    if (n <= 0 || dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(embedding_kernel, n, block_for((size_t)dim), 0, stream, out, table, (int)table_dtype,
              dim, ids, l2_normalize);
    return cudaGetLastError();
}
