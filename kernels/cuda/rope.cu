/* Rotary position embeddings, in place on rows of n_heads heads of head_dim:
 * rotate-half 1D RoPE (Llama, Janus) and LlamaGen's 2D RoPE over image
 * rows and columns. One block per row; a thread computes the cosine and
 * sine of one frequency once and rotates that pair in every head. The
 * angles are formed exactly as the CPU reference forms them (HF's fp32
 * inv_freq, the fp32 product with the position, cos/sin of it in double,
 * rounded): a few double operations per pair cost nothing next to the
 * memory traffic, and the backends then agree to the last bit or two. */
#include "kernels/cuda/common.cuh"

/* 1 / theta^(num / den) with the exponent divided in fp32, the power in
 * double, as backend_cpu.c. */
static __device__ __forceinline__ float inv_freq_of(float theta, int num, int den) {
    const float e = (float)num / (float)den;
    return 1.0f / (float)pow((double)theta, (double)e);
}

/* cos and sin of fp32(pos * inv_freq), each rounded from double. */
static __device__ __forceinline__ void rope_cos_sin(int pos, float inv_freq, float *c, float *s) {
    const float angle = (float)((double)pos * (double)inv_freq);
    double sd, cd;
    sincos((double)angle, &sd, &cd);
    *c = (float)cd;
    *s = (float)sd;
}

/* Pair (j, j + half) of every head. */
__global__ void rope_kernel(float *x, const int *pos, int n_heads, int head_dim, float theta) {
    const int r = blockIdx.x, half = head_dim / 2;
    const int p = pos[r];
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        float c, s;
        rope_cos_sin(p, inv_freq_of(theta, 2 * j, head_dim), &c, &s);
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + ((size_t)r * n_heads + h) * head_dim;
            const float a = xh[j], b = xh[j + half];
            xh[j] = a * c - b * s;
            xh[j + half] = b * c + a * s;
        }
    }
}

cudaError_t kern_rope(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                      cudaStream_t stream) {
    if (rows <= 0 || n_heads <= 0 || head_dim < 2)
        return cudaSuccess;
    AR_LAUNCH(rope_kernel, rows, block_for((size_t)head_dim / 2), 0, stream, x, pos, n_heads,
              head_dim, theta);
    return cudaGetLastError();
}

/* Interleaved pairs (2j, 2j + 1), j < head_dim / 2: the first quarter of the
 * pairs turns with the grid row, the second with the column, each at
 * frequencies 1 / theta^(2f / (head_dim / 2)), f < head_dim / 4 (LlamaGen's
 * precompute_freqs_cis_2d). A row with a negative grid row is a condition
 * token: cos = sin = 0, as LlamaGen's cache holds for them. */
__global__ void rope_2d_kernel(float *x, const int *pos, int n_heads, int head_dim, float theta) {
    const int r = blockIdx.x, half = head_dim / 2, quarter = head_dim / 4;
    const int row = pos[2 * r], col = pos[2 * r + 1];
    for (int j = threadIdx.x; j < half; j += blockDim.x) {
        const int f = j < quarter ? j : j - quarter;
        float c = 0.0f, s = 0.0f;
        if (row >= 0)
            rope_cos_sin(j < quarter ? row : col, inv_freq_of(theta, 2 * f, half), &c, &s);
        for (int h = 0; h < n_heads; h++) {
            float *xp = x + ((size_t)r * n_heads + h) * head_dim + 2 * j;
            const float a = xp[0], b = xp[1];
            xp[0] = a * c - b * s;
            xp[1] = b * c + a * s;
        }
    }
}

cudaError_t kern_rope_2d(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                         cudaStream_t stream) {
    if (rows <= 0 || n_heads <= 0 || head_dim < 4)
        return cudaSuccess;
    AR_LAUNCH(rope_2d_kernel, rows, block_for((size_t)head_dim / 2), 0, stream, x, pos, n_heads,
              head_dim, theta);
    return cudaGetLastError();
}
