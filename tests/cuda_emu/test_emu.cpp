/* Tests of the CUDA emulator itself (tests/cuda_emu): barriers, warp
 * shuffles and votes, shared memory, atomics, half/bfloat16 conversions
 * against the bit patterns the hardware produces, launch-configuration and
 * memory errors, deadlock reports, the cuBLAS GEMM shim, and stream
 * capture with graph replay. Kernels here are
 * written as they would be for nvcc and launched through AR_LAUNCH. */
#include "kernels/cuda/launch.h"

#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdlib.h>

#include "tests/test.h"

/* A device buffer of n T, copied from host (or filled with 0). */
template <typename T> static T *dev_alloc(size_t n, const T *host = nullptr) {
    T *d = nullptr;
    CHECK(cudaMalloc((void **)&d, n * sizeof(T)) == cudaSuccess);
    if (host)
        CHECK(cudaMemcpy(d, host, n * sizeof(T), cudaMemcpyHostToDevice) == cudaSuccess);
    else
        CHECK(cudaMemset(d, 0, n * sizeof(T)) == cudaSuccess);
    return d;
}

template <typename T> static void to_host(T *host, const T *d, size_t n) {
    CHECK(cudaMemcpy(host, d, n * sizeof(T), cudaMemcpyDeviceToHost) == cudaSuccess);
}

/* ---- barriers and shared memory ------------------------------------------- */

/* A shared-memory tree reduction: correct only if every step's writes are
 * seen by every thread after __syncthreads. blockDim.x is a power of two. */
__global__ void block_sum_kernel(float *out, const float *in, int n) {
    __shared__ float buf[1024];
    const int t = threadIdx.x;
    float acc = 0;
    for (int i = blockIdx.x * blockDim.x + t; i < n; i += gridDim.x * blockDim.x)
        acc += in[i];
    buf[t] = acc;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s /= 2) {
        if (t < s)
            buf[t] += buf[t + s];
        __syncthreads();
    }
    if (t == 0)
        out[blockIdx.x] = buf[0];
}

static void test_block_reduction_with_syncthreads(void) {
    const int n = 100003;
    float *h = (float *)malloc(n * sizeof(float));
    double want = 0;
    for (int i = 0; i < n; i++)
        want += h[i] = (float)(i % 7) - 3.0f;
    const int sizes[] = {1, 32, 256, 1024};
    for (int s = 0; s < 4; s++) {
        const int grid = 37;
        float *d_in = dev_alloc(n, h), *d_out = dev_alloc<float>(grid);
        AR_LAUNCH(block_sum_kernel, grid, sizes[s], 0, 0, d_out, d_in, n);
        CHECK(cudaGetLastError() == cudaSuccess);
        float out[grid];
        to_host(out, d_out, grid);
        double got = 0;
        for (int b = 0; b < grid; b++)
            got += out[b];
        CHECK_MSG(got == want, "block size %d: %g, expected %g", sizes[s], got, want);
        cudaFree(d_in);
        cudaFree(d_out);
    }
    free(h);
}

/* Threads that return early count as arrived at later barriers. */
__global__ void early_exit_kernel(int *out) {
    __shared__ int v[64];
    const int t = threadIdx.x;
    if (t >= 40)
        return;
    v[t] = t * t;
    __syncthreads();
    out[t] = v[39 - t];
}

static void test_returned_threads_do_not_block_syncthreads(void) {
    int *d = dev_alloc<int>(64);
    AR_LAUNCH(early_exit_kernel, 1, 64, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess);
    int h[64];
    to_host(h, d, 64);
    for (int t = 0; t < 40; t++)
        CHECK(h[t] == (39 - t) * (39 - t));
    cudaFree(d);
}

/* Every built-in variable in three dimensions. */
__global__ void ids_kernel(int *out) {
    const int bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    const int tx = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    const int nt = blockDim.x * blockDim.y * blockDim.z;
    out[bx * nt + tx] = bx * 1000 + tx;
}

static void test_builtin_indices_3d(void) {
    const dim3 grid(3, 2, 2), block(4, 3, 5);
    const int n = 12 * 60;
    int *d = dev_alloc<int>(n);
    AR_LAUNCH(ids_kernel, grid, block, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess);
    int h[n];
    to_host(h, d, n);
    for (int i = 0; i < n; i++)
        CHECK(h[i] == (i / 60) * 1000 + i % 60);
    cudaFree(d);
}

/* Dynamic shared memory: reversal through it, and the poison it starts
 * with (0xff bytes) is visible before anything is written. */
__global__ void reverse_kernel(float *out, unsigned *poison, const float *in, int n) {
    AR_DYNAMIC_SHARED(float, s);
    const int t = threadIdx.x;
    if (t == 0)
        *poison = __float_as_uint(s[n - 1]);
    __syncthreads();
    s[t] = in[blockIdx.x * n + t];
    __syncthreads();
    out[blockIdx.x * n + t] = s[n - 1 - t];
}

static void test_dynamic_shared_memory(void) {
    const int n = 200, blocks = 9;
    float h[n * blocks], got[n * blocks];
    for (int i = 0; i < n * blocks; i++)
        h[i] = (float)i;
    float *d_in = dev_alloc(n * blocks, h), *d_out = dev_alloc<float>(n * blocks);
    unsigned *d_poison = dev_alloc<unsigned>(1), poison = 0;
    AR_LAUNCH(reverse_kernel, blocks, n, n * sizeof(float), 0, d_out, d_poison, d_in, n);
    CHECK(cudaGetLastError() == cudaSuccess);
    to_host(got, d_out, n * blocks);
    to_host(&poison, d_poison, 1);
    for (int b = 0; b < blocks; b++)
        for (int t = 0; t < n; t++)
            CHECK(got[b * n + t] == h[b * n + n - 1 - t]);
    CHECK(poison == 0xffffffffu);
    cudaFree(d_in);
    cudaFree(d_out);
    cudaFree(d_poison);
}

/* ---- warp operations ------------------------------------------------------ */

__global__ void shuffle_kernel(int *out) {
    const int t = threadIdx.x, lane = t % 32;
    int v = t + 1;
    int xsum = v; /* butterfly: every lane ends with the warp's sum */
    for (int o = 16; o > 0; o /= 2)
        xsum += __shfl_xor_sync(0xffffffffu, xsum, o);
    int dsum = v; /* tree: lane 0 ends with the sum */
    for (int o = 16; o > 0; o /= 2)
        dsum += __shfl_down_sync(0xffffffffu, dsum, o);
    const int bcast = __shfl_sync(0xffffffffu, v * 10, 5);
    int scan = v; /* inclusive prefix sum within segments of 8 lanes */
    for (int o = 1; o < 8; o *= 2) {
        const int up = __shfl_up_sync(0xffffffffu, scan, o, 8);
        if ((lane & 7) >= o)
            scan += up;
    }
    const unsigned ballot = __ballot_sync(0xffffffffu, lane % 3 == 0);
    const float f = __shfl_sync(0xffffffffu, (float)t * 0.5f, 31 - lane);
    out[t * 6 + 0] = xsum;
    out[t * 6 + 1] = lane == 0 ? dsum : -1;
    out[t * 6 + 2] = bcast;
    out[t * 6 + 3] = scan;
    out[t * 6 + 4] = (int)ballot;
    out[t * 6 + 5] = (int)(f * 2);
}

static void test_warp_shuffles_and_ballot(void) {
    const int nt = 96; /* three warps */
    int *d = dev_alloc<int>(nt * 6), h[nt * 6];
    AR_LAUNCH(shuffle_kernel, 2, nt, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess);
    to_host(h, d, nt * 6);
    unsigned want_ballot = 0;
    for (int l = 0; l < 32; l += 3)
        want_ballot |= 1u << l;
    for (int t = 0; t < nt; t++) {
        const int w0 = t / 32 * 32, lane = t % 32, seg0 = t / 8 * 8;
        int wsum = 0, scan = 0;
        for (int i = w0; i < w0 + 32; i++)
            wsum += i + 1;
        for (int i = seg0; i <= t; i++)
            scan += i + 1;
        CHECK(h[t * 6 + 0] == wsum);
        CHECK(h[t * 6 + 1] == (lane == 0 ? wsum : -1));
        CHECK(h[t * 6 + 2] == (w0 + 5 + 1) * 10);
        CHECK_MSG(h[t * 6 + 3] == scan, "thread %d scan %d, expected %d", t, h[t * 6 + 3], scan);
        CHECK(h[t * 6 + 4] == (int)want_ballot);
        CHECK(h[t * 6 + 5] == w0 + 31 - lane);
    }
    cudaFree(d);
}

/* A lane that races ahead to its next shuffle must not change what the
 * other lanes read from the previous one. */
__global__ void chained_shuffle_kernel(int *out) {
    int v = threadIdx.x;
    for (int r = 0; r < 5; r++)
        v = __shfl_sync(0xffffffffu, v, (threadIdx.x + 1) % 32) + 100;
    out[threadIdx.x] = v;
}

static void test_chained_shuffles_keep_their_values(void) {
    int *d = dev_alloc<int>(32), h[32];
    AR_LAUNCH(chained_shuffle_kernel, 1, 32, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess);
    to_host(h, d, 32);
    for (int t = 0; t < 32; t++)
        CHECK(h[t] == (t + 5) % 32 + 500);
    cudaFree(d);
}

/* Two half-warp masks in one warp, each voting on its own predicate: each
 * half's ballot holds its own lanes' votes only. */
__global__ void half_mask_ballot_kernel(unsigned *out) {
    const int lane = threadIdx.x % 32;
    const unsigned mask = lane < 16 ? 0x0000ffffu : 0xffff0000u;
    out[threadIdx.x] = __ballot_sync(mask, lane < 16 ? lane % 2 == 0 : lane % 4 == 1);
}

static void test_half_warp_masks_vote_apart(void) {
    unsigned *d = dev_alloc<unsigned>(64), h[64];
    AR_LAUNCH(half_mask_ballot_kernel, 1, 64, 0, 0, d);
    CHECK(cudaGetLastError() == cudaSuccess);
    to_host(h, d, 64);
    unsigned low = 0, high = 0;
    for (int l = 0; l < 32; l++) {
        if (l < 16 && l % 2 == 0)
            low |= 1u << l;
        if (l >= 16 && l % 4 == 1)
            high |= 1u << l;
    }
    for (int t = 0; t < 64; t++)
        CHECK_MSG(h[t] == (t % 32 < 16 ? low : high), "thread %d: ballot 0x%08x", t, h[t]);
    cudaFree(d);
}

/* One mask, two operations: half of the warp shuffles, the other half votes. */
__global__ void divergent_warp_op_kernel(int *out) {
    if (threadIdx.x < 16)
        out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
    else
        out[threadIdx.x] = (int)__ballot_sync(0xffffffffu, 1);
}

static void test_divergent_warp_operations_fault(void) {
    int *d = dev_alloc<int>(32);
    AR_LAUNCH(divergent_warp_op_kernel, 1, 32, 0, 0, d);
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "reached different warp operations");
    CHECK(cudaDeviceReset() == cudaSuccess);
    cudaFree(d);
}

/* ---- atomics ------------------------------------------------------------- */

__global__ void atomics_kernel(int *count, float *fsum, int *maxv, unsigned *cas_count) {
    const int id = blockIdx.x * blockDim.x + threadIdx.x;
    atomicAdd(count, 1);
    atomicAdd(fsum, 0.5f);
    atomicMax(maxv, (id * 7919) % 100003);
    unsigned old = *cas_count, seen; /* an increment made of compare-and-swap */
    do {
        seen = old;
        old = atomicCAS(cas_count, seen, seen + 1);
    } while (old != seen);
}

static void test_atomics_from_many_blocks(void) {
    const int blocks = 300, threads = 64, n = blocks * threads;
    int *d_count = dev_alloc<int>(1), *d_max = dev_alloc<int>(1);
    float *d_sum = dev_alloc<float>(1);
    unsigned *d_cas = dev_alloc<unsigned>(1);
    AR_LAUNCH(atomics_kernel, blocks, threads, 0, 0, d_count, d_sum, d_max, d_cas);
    CHECK(cudaGetLastError() == cudaSuccess);
    int count, maxv;
    float sum;
    unsigned cas;
    to_host(&count, d_count, 1);
    to_host(&sum, d_sum, 1);
    to_host(&maxv, d_max, 1);
    to_host(&cas, d_cas, 1);
    int want_max = 0;
    for (int id = 0; id < n; id++)
        want_max = (id * 7919) % 100003 > want_max ? (id * 7919) % 100003 : want_max;
    CHECK(count == n);
    CHECK(sum == 0.5f * n); /* exact: halves up to 2^24 */
    CHECK(maxv == want_max);
    CHECK(cas == (unsigned)n);
    cudaFree(d_count);
    cudaFree(d_sum);
    cudaFree(d_max);
    cudaFree(d_cas);
}

/* ---- half and bfloat16 ---------------------------------------------------- */

__global__ void convert_kernel(unsigned short *h, unsigned short *b, const float *in, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        h[i] = __half_as_ushort(__float2half(in[i]));
        b[i] = __bfloat16_as_ushort(__float2bfloat16(in[i]));
    }
}

__global__ void widen_kernel(float *fh, float *fb, const unsigned short *bits, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) {
        fh[i] = __half2float(__ushort_as_half(bits[i]));
        fb[i] = __bfloat162float(__ushort_as_bfloat16(bits[i]));
    }
}

/* Input float bits and what cvt.rn.f16.f32 / cvt.rn.bf16.f32 give on the
 * hardware (round to nearest even, overflow to infinity, canonical NaN
 * 0x7fff). */
static const struct {
    uint32_t f;
    uint16_t half, bf16;
} conv_cases[] = {
    {0x3f800000u, 0x3c00, 0x3f80}, /* 1 */
    {0x80000000u, 0x8000, 0x8000}, /* -0 */
    {0x3dcccccdu, 0x2e66, 0x3dcd}, /* 0.1 */
    {0xc0490fdbu, 0xc248, 0xc049}, /* -pi */
    {0x477fe000u, 0x7bff, 0x4780}, /* 65504, the largest half */
    {0x477fefffu, 0x7bff, 0x4780}, /* just below 65520: still 65504 */
    {0x477ff000u, 0x7c00, 0x4780}, /* 65520: rounds to infinity in half */
    {0x501502f9u, 0x7c00, 0x5015}, /* 1e10 */
    {0xff800000u, 0xfc00, 0xff80}, /* -inf */
    {0x7fc00000u, 0x7fff, 0x7fff}, /* NaN */
    {0xffc00001u, 0x7fff, 0x7fff}, /* negative NaN with payload: canonical */
    {0x7f800001u, 0x7fff, 0x7fff}, /* signalling NaN */
    {0x38800000u, 0x0400, 0x3880}, /* 2^-14, the smallest normal half */
    {0x387fc000u, 0x03ff, 0x3880}, /* the largest subnormal half */
    {0x33800000u, 0x0001, 0x3380}, /* 2^-24, the smallest subnormal half */
    {0x33000000u, 0x0000, 0x3300}, /* 2^-25: a tie, to even (zero) */
    {0x33000001u, 0x0001, 0x3300}, /* just above: rounds up */
    {0x33c00000u, 0x0002, 0x33c0}, /* 1.5 * 2^-24: a tie, to even (2) */
    {0x3f801000u, 0x3c00, 0x3f80}, /* 1 + 2^-11: a half tie, to even */
    {0x3f803000u, 0x3c02, 0x3f80}, /* 1 + 3 * 2^-11: a half tie, to even (up) */
    {0x3f808000u, 0x3c04, 0x3f80}, /* 1 + 2^-8: a bf16 tie, to even */
    {0x3f818000u, 0x3c0c, 0x3f82}, /* 1 + 3 * 2^-8: a bf16 tie, to even (up) */
    {0x3f808001u, 0x3c04, 0x3f81}, /* just above the bf16 tie */
    {0x7f7fffffu, 0x7c00, 0x7f80}, /* the largest float: bf16 rounds to infinity */
    {0x00000001u, 0x0000, 0x0000}, /* the smallest float subnormal */
    {0x00018000u, 0x0000, 0x0002}, /* a bf16 subnormal tie, to even (up) */
    {0xc77ff000u, 0xfc00, 0xc780}, /* -65520 */
};

static void test_half_bf16_conversion_bit_patterns(void) {
    const int n = sizeof conv_cases / sizeof *conv_cases;
    float in[n];
    for (int i = 0; i < n; i++)
        memcpy(&in[i], &conv_cases[i].f, 4);
    float *d_in = dev_alloc(n, in);
    unsigned short *d_h = dev_alloc<unsigned short>(n), *d_b = dev_alloc<unsigned short>(n);
    AR_LAUNCH(convert_kernel, 1, 32, 0, 0, d_h, d_b, d_in, n);
    CHECK(cudaGetLastError() == cudaSuccess);
    unsigned short h[n], b[n];
    to_host(h, d_h, n);
    to_host(b, d_b, n);
    for (int i = 0; i < n; i++) {
        CHECK_MSG(h[i] == conv_cases[i].half, "half(0x%08x) = 0x%04x, expected 0x%04x",
                  conv_cases[i].f, h[i], conv_cases[i].half);
        CHECK_MSG(b[i] == conv_cases[i].bf16, "bf16(0x%08x) = 0x%04x, expected 0x%04x",
                  conv_cases[i].f, b[i], conv_cases[i].bf16);
    }
    cudaFree(d_in);
    cudaFree(d_h);
    cudaFree(d_b);
}

/* Every 16-bit pattern widened to float and narrowed again comes back, NaNs
 * as the canonical 0x7fff; widening is exact (checked by value for half
 * against the textbook decoding, by bits for bf16). */
static void test_half_bf16_round_trip_all_patterns(void) {
    const int n = 65536;
    unsigned short *bits = (unsigned short *)malloc(n * 2);
    for (int i = 0; i < n; i++)
        bits[i] = (unsigned short)i;
    unsigned short *d_bits = dev_alloc(n, bits);
    float *d_fh = dev_alloc<float>(n), *d_fb = dev_alloc<float>(n);
    AR_LAUNCH(widen_kernel, n / 256, 256, 0, 0, d_fh, d_fb, d_bits, n);
    float *fh = (float *)malloc(n * 4), *fb = (float *)malloc(n * 4);
    to_host(fh, d_fh, n);
    to_host(fb, d_fb, n);
    unsigned short *d_h = dev_alloc<unsigned short>(n), *d_b = dev_alloc<unsigned short>(n);
    unsigned short *h = (unsigned short *)malloc(n * 2), *b = (unsigned short *)malloc(n * 2);
    AR_LAUNCH(convert_kernel, n / 256, 256, 0, 0, d_h, d_b, d_fh, n);
    to_host(h, d_h, n);
    AR_LAUNCH(convert_kernel, n / 256, 256, 0, 0, d_h, d_b, d_fb, n);
    to_host(b, d_b, n);
    CHECK(cudaGetLastError() == cudaSuccess);
    int bad_h = 0, bad_b = 0, bad_val = 0;
    for (int i = 0; i < n; i++) {
        const int h_nan = (i & 0x7c00) == 0x7c00 && (i & 0x3ff);
        const int b_nan = (i & 0x7f80) == 0x7f80 && (i & 0x7f);
        bad_h += h[i] != (h_nan ? 0x7fff : i);
        bad_b += b[i] != (b_nan ? 0x7fff : i);
        const int e = (i >> 10) & 31, m = i & 1023;
        double v = e == 31  ? (m ? NAN : INFINITY)
                   : e == 0 ? ldexp(m, -24)
                            : ldexp(1024 + m, e - 25);
        if (i & 0x8000)
            v = -v;
        bad_val += !(h_nan ? isnan(fh[i]) : (double)fh[i] == v);
        uint32_t ub;
        memcpy(&ub, &fb[i], 4);
        bad_val += ub != (uint32_t)i << 16;
    }
    CHECK_MSG(bad_h == 0, "%d half patterns do not round-trip", bad_h);
    CHECK_MSG(bad_b == 0, "%d bf16 patterns do not round-trip", bad_b);
    CHECK_MSG(bad_val == 0, "%d widened values are wrong", bad_val);
    cudaFree(d_bits);
    cudaFree(d_fh);
    cudaFree(d_fb);
    cudaFree(d_h);
    cudaFree(d_b);
    free(bits);
    free(fh);
    free(fb);
    free(h);
    free(b);
}

/* ---- errors ---------------------------------------------------------------- */

__global__ void nop_kernel(int *p) {
    if (p && threadIdx.x == 0 && blockIdx.x == 0)
        *p = 1;
}

static void test_launch_configuration_errors(void) {
    CHECK(cudaGetLastError() == cudaSuccess);
    const struct {
        dim3 grid, block;
        size_t shmem;
        cudaError_t want;
    } cases[] = {
        {dim3(1), dim3(1025), 0, cudaErrorInvalidConfiguration},      /* too many threads */
        {dim3(1), dim3(32, 32, 2), 0, cudaErrorInvalidConfiguration}, /* 2048 in total */
        {dim3(1), dim3(1, 1, 65), 0, cudaErrorInvalidConfiguration},  /* z over 64 */
        {dim3(0), dim3(32), 0, cudaErrorInvalidConfiguration},        /* empty grid */
        {dim3(1), dim3(0), 0, cudaErrorInvalidConfiguration},         /* empty block */
        {dim3(1, 65536), dim3(32), 0, cudaErrorInvalidConfiguration}, /* grid y over 65535 */
        {dim3(1), dim3(32), 64 * 1024, cudaErrorInvalidValue},        /* 64 KiB dynamic smem */
        {dim3(2, 3), dim3(32, 32), 48 * 1024, cudaSuccess},           /* at the limits */
    };
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        AR_LAUNCH(nop_kernel, cases[c].grid, cases[c].block, cases[c].shmem, 0, (int *)nullptr);
        const cudaError_t e = cudaGetLastError();
        CHECK_MSG(e == cases[c].want, "case %zu: %s, expected %s", c, cudaGetErrorName(e),
                  cudaGetErrorName(cases[c].want));
        /* not sticky: the next call sees no error */
        CHECK(cudaGetLastError() == cudaSuccess);
    }
    CHECK(strcmp(cudaGetErrorString(cudaErrorInvalidConfiguration),
                 "invalid configuration argument") == 0);
    cudaStream_t s;
    CHECK(cudaStreamCreate(&s) == cudaSuccess);
    int *d = dev_alloc<int>(1), h = 0;
    AR_LAUNCH(nop_kernel, 1, 1, 0, s, d);
    CHECK(cudaGetLastError() == cudaSuccess && cudaStreamSynchronize(s) == cudaSuccess);
    to_host(&h, d, 1);
    CHECK(h == 1);
    CHECK(cudaStreamDestroy(s) == cudaSuccess);
    cudaFree(d);
}

/* Half of a warp at a shuffle, the other half at __syncthreads: a hang on
 * the GPU, a sticky launch failure here, cleared by cudaDeviceReset. */
__global__ void deadlock_kernel(int *out) {
    if (threadIdx.x < 16)
        out[threadIdx.x] = __shfl_sync(0xffffffffu, (int)threadIdx.x, 0);
    else
        __syncthreads();
}

/* A full-mask shuffle after some lanes returned. */
__global__ void exited_lane_shuffle_kernel(int *out, int n) {
    if ((int)threadIdx.x >= n)
        return;
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}

static void test_kernel_faults_are_sticky_until_reset(void) {
    int *d = dev_alloc<int>(32);
    AR_LAUNCH(deadlock_kernel, 3, 32, 0, 0, d);
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "deadlock");
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "deadlock_kernel");
    void *p = nullptr;
    CHECK(cudaMalloc(&p, 16) == cudaErrorLaunchFailure); /* every call fails now */
    CHECK(cudaDeviceSynchronize() == cudaErrorLaunchFailure);
    CHECK(cudaDeviceReset() == cudaSuccess);
    CHECK(cudaGetLastError() == cudaSuccess);

    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 20);
    CHECK(cudaGetLastError() == cudaErrorLaunchFailure);
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "returned");
    CHECK(cudaDeviceReset() == cudaSuccess);
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32); /* all lanes: fine */
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaFree(d);
}

/* A planted fault lets the launches before it run, fails its own as a
 * device fault does (sticky until reset, the kernel named), and is gone
 * after a reset; a disarmed one never fires. */
static void test_planted_fault_fires_on_its_launch(void) {
    int *d = dev_alloc<int>(32);
    const unsigned long long ran = cuda_emu_launch_count();
    cuda_emu_fault_launch(2, cudaErrorIllegalAddress);
    for (int i = 0; i < 2; i++) {
        AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
        CHECK(cudaGetLastError() == cudaSuccess);
    }
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress);
    CHECK(cuda_emu_launch_count() == ran + 2); /* the faulting launch did not run */
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "exited_lane_shuffle_kernel");
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "planted");
    CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress); /* sticky */
    CHECK(cudaMemset(d, 0, 4) == cudaErrorIllegalAddress);
    CHECK(cudaDeviceReset() == cudaSuccess);
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32); /* fired once, not again */
    CHECK(cudaGetLastError() == cudaSuccess);

    cuda_emu_fault_launch(0, cudaErrorIllegalAddress);
    cuda_emu_fault_launch(0, cudaSuccess); /* disarmed */
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaGetLastError() == cudaSuccess);
    cuda_emu_fault_launch(0, cudaErrorIllegalAddress);
    CHECK(cudaDeviceReset() == cudaSuccess); /* a reset disarms too */
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaGetLastError() == cudaSuccess);
    cudaFree(d);
}

/* An asynchronous planted fault is a GPU's: its launch reports success,
 * the kernel does not run, and the next call that touches the device (here
 * a synchronisation; a copy or a launch would do) fails, sticky until a
 * reset. */
static void test_planted_async_fault_surfaces_at_the_next_call(void) {
    int *d = dev_alloc<int>(32);
    const unsigned long long ran = cuda_emu_launch_count();
    cuda_emu_fault_launch_async(1, cudaErrorIllegalAddress);
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaGetLastError() == cudaSuccess);
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32); /* the faulting one */
    CHECK(cudaGetLastError() == cudaSuccess);                  /* not yet */
    CHECK(cuda_emu_launch_count() == ran + 1);
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "exited_lane_shuffle_kernel");
    CHECK_STR_CONTAINS(cuda_emu_last_fault(), "cuda_emu_fault_launch_async");
    CHECK(cudaDeviceSynchronize() == cudaErrorIllegalAddress); /* now */
    CHECK(cudaGetLastError() == cudaErrorIllegalAddress);      /* and sticky */
    CHECK(cudaMemset(d, 0, 4) == cudaErrorIllegalAddress);
    CHECK(cudaDeviceReset() == cudaSuccess);
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(cudaDeviceSynchronize() == cudaSuccess);

    cuda_emu_fault_launch_async(0, cudaErrorIllegalAddress); /* fired, not yet reported */
    AR_LAUNCH(exited_lane_shuffle_kernel, 1, 32, 0, 0, d, 32);
    CHECK(cudaDeviceReset() == cudaSuccess); /* a reset forgets it */
    CHECK(cudaDeviceSynchronize() == cudaSuccess);
    cudaFree(d);
}

static void test_memory_errors_and_accounting(void) {
    size_t free0, total;
    CHECK(cudaMemGetInfo(&free0, &total) == cudaSuccess);
    void *p = nullptr;
    CHECK(cudaMalloc(&p, 1000) == cudaSuccess && p && ((uintptr_t)p & 255) == 0);
    size_t free1;
    CHECK(cudaMemGetInfo(&free1, &total) == cudaSuccess && free1 == free0 - 1000);
    char host[2000] = {0};
    CHECK(cudaMemcpy(p, host, 1000, cudaMemcpyHostToDevice) == cudaSuccess);
    CHECK(cudaMemcpy(p, host, 1001, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    CHECK(cudaMemcpy(host, host + 8, 8, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
    CHECK(cudaMemset((char *)p + 999, 0, 2) == cudaErrorInvalidValue);
    CHECK(cudaFree(host) == cudaErrorInvalidValue);
    CHECK(cudaGetLastError() == cudaErrorInvalidValue);
    void *big = nullptr;
    CHECK(cudaMalloc(&big, total) == cudaErrorMemoryAllocation && big == nullptr);
    CHECK(cudaGetLastError() == cudaErrorMemoryAllocation);
    CHECK(cudaFree(p) == cudaSuccess);
    CHECK(cudaMemGetInfo(&free1, &total) == cudaSuccess && free1 == free0);
}

/* ---- cuBLAS ------------------------------------------------------------------ */

/* C (m x n, column-major) = alpha op(A) op(B) + beta C with A, B converted to
 * the given storage type and back, checked against a double loop. */
static void check_gemm(cudaDataType t, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                       int k) {
    const int lda = (ta == CUBLAS_OP_N ? m : k) + 2, ldb = (tb == CUBLAS_OP_N ? k : n) + 1;
    const int ldc = m + 3;
    const size_t na = (size_t)lda * (ta == CUBLAS_OP_N ? k : m);
    const size_t nb = (size_t)ldb * (tb == CUBLAS_OP_N ? n : k), nc = (size_t)ldc * n;
    float *a = (float *)malloc(na * 4), *b = (float *)malloc(nb * 4), *c = (float *)malloc(nc * 4);
    unsigned short *a16 = (unsigned short *)malloc(na * 2), *b16 = (unsigned short *)malloc(nb * 2);
    for (size_t i = 0; i < na; i++) {
        a[i] = (float)((int)(i * 37 % 19) - 9) / 8;
        a16[i] = t == CUDA_R_16F ? __half_as_ushort(__float2half(a[i]))
                                 : __bfloat16_as_ushort(__float2bfloat16(a[i]));
    }
    for (size_t i = 0; i < nb; i++) {
        b[i] = (float)((int)(i * 53 % 23) - 11) / 4;
        b16[i] = t == CUDA_R_16F ? __half_as_ushort(__float2half(b[i]))
                                 : __bfloat16_as_ushort(__float2bfloat16(b[i]));
    }
    for (size_t i = 0; i < nc; i++)
        c[i] = (float)(i % 5);
    const size_t es = t == CUDA_R_32F ? 4 : 2;
    void *da, *db;
    float *dc;
    CHECK(cudaMalloc(&da, na * es) == cudaSuccess && cudaMalloc(&db, nb * es) == cudaSuccess);
    CHECK(cudaMalloc((void **)&dc, nc * 4) == cudaSuccess);
    cudaMemcpy(da, t == CUDA_R_32F ? (void *)a : (void *)a16, na * es, cudaMemcpyHostToDevice);
    cudaMemcpy(db, t == CUDA_R_32F ? (void *)b : (void *)b16, nb * es, cudaMemcpyHostToDevice);
    cudaMemcpy(dc, c, nc * 4, cudaMemcpyHostToDevice);
    cublasHandle_t h;
    CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    const float alpha = 1.5f, beta = 0.5f;
    CHECK(cublasGemmEx(h, ta, tb, m, n, k, &alpha, da, t, lda, db, t, ldb, &beta, dc, CUDA_R_32F,
                       ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_SUCCESS);
    float *got = (float *)malloc(nc * 4);
    to_host(got, dc, nc);
    int bad = 0;
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int p = 0; p < k; p++) {
                const double av =
                    ta == CUBLAS_OP_N ? a[(size_t)p * lda + i] : a[(size_t)i * lda + p];
                const double bv =
                    tb == CUBLAS_OP_N ? b[(size_t)j * ldb + p] : b[(size_t)p * ldb + j];
                s += av * bv; /* the test values are exact in every type */
            }
            const double want = alpha * s + beta * c[(size_t)j * ldc + i];
            bad += fabs(got[(size_t)j * ldc + i] - want) > 1e-4 * (1 + fabs(want));
        }
    for (int j = 0; j < n; j++) /* padding rows of C untouched */
        for (int i = m; i < ldc; i++)
            bad += got[(size_t)j * ldc + i] != c[(size_t)j * ldc + i];
    CHECK_MSG(bad == 0, "gemm type %d op %d%d %dx%dx%d: %d wrong", (int)t, (int)ta, (int)tb, m, n,
              k, bad);
    cublasDestroy(h);
    cudaFree(da);
    cudaFree(db);
    cudaFree(dc);
    free(a), free(b), free(c), free(a16), free(b16), free(got);
}

static void test_cublas_gemm_types_and_transposes(void) {
    const cudaDataType types[] = {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF};
    for (int t = 0; t < 3; t++)
        for (int ta = 0; ta < 2; ta++)
            for (int tb = 0; tb < 2; tb++)
                check_gemm(types[t], (cublasOperation_t)ta, (cublasOperation_t)tb, 7, 5, 13);
    check_gemm(CUDA_R_16BF, CUBLAS_OP_T, CUBLAS_OP_N, 1, 1, 1);
}

static void test_cublas_argument_errors_and_beta_zero(void) {
    cublasHandle_t h;
    CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS);
    float *a, *c;
    CHECK(cudaMalloc((void **)&a, 64 * 4) == cudaSuccess);
    CHECK(cudaMalloc((void **)&c, 64 * 4) == cudaSuccess); /* 0xff bytes: NaN */
    CHECK(cudaMemset(a, 0, 64 * 4) == cudaSuccess);
    const float one = 1, zero = 0;
    CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a, CUDA_R_16BF, 4, a, CUDA_R_32F,
                       4, &zero, c, CUDA_R_32F, 4, CUBLAS_COMPUTE_32F,
                       CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a, 3, a, 4, &zero, c, 4) ==
          CUBLAS_STATUS_INVALID_VALUE);
    CHECK(cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 4, 4, &one, a, 4, a, 4, &zero, c, 4) ==
          CUBLAS_STATUS_SUCCESS);
    float got[16];
    to_host(got, c, 16);
    for (int i = 0; i < 16; i++)
        CHECK(got[i] == 0.0f); /* beta 0: the NaNs in C are not read */
    CHECK(strcmp(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED),
                 "the functionality requested is not supported") == 0);
    cudaFree(a);
    cudaFree(c);
    cublasDestroy(h);
}

/* ---- stream capture and graphs -------------------------------------------- */

__global__ void add_scalar_kernel(float *x, float v, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n)
        x[i] += v;
}

/* A capture records (nothing runs), a launch replays in order, a replay
 * reads device memory as it is then, and an update swaps in new arguments. */
static void test_capture_records_and_graph_replays(void) {
    const int n = 40;
    float h[n], out[n];
    for (int i = 0; i < n; i++)
        h[i] = (float)i;
    float one_h = 1.0f;
    float *a = dev_alloc(n, h), *b = dev_alloc<float>(n), *one = dev_alloc(1, &one_h);
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st) == cudaSuccess);
    cublasHandle_t blas;
    CHECK(cublasCreate(&blas) == CUBLAS_STATUS_SUCCESS);
    CHECK(cublasSetStream(blas, st) == CUBLAS_STATUS_SUCCESS);
    const unsigned long long launches = cuda_emu_launch_count();

    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    cudaStreamCaptureStatus status;
    CHECK(cudaStreamIsCapturing(st, &status) == cudaSuccess &&
          status == cudaStreamCaptureStatusActive);
    AR_LAUNCH(add_scalar_kernel, 1, 64, 0, st, a, 1.0f, n); /* a += 1 */
    CHECK(cudaGetLastError() == cudaSuccess);
    CHECK(cudaMemcpyAsync(b, a, n * sizeof(float), cudaMemcpyDeviceToDevice, st) == cudaSuccess);
    const float two = 2.0f, zero = 0.0f;
    /* b (1 x n, ld 1) = 2 * b: a GEMM of m = 1, k = 1 with a 1x1 "matrix" of 1 */
    CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, 1, n, 1, &two, one, 1, b, 1, &zero, b, 1) ==
          CUBLAS_STATUS_SUCCESS);
    CHECK(cudaMemsetAsync(a, 0, sizeof(float), st) == cudaSuccess); /* a[0] = 0 */
    cudaGraph_t g;
    CHECK(cudaStreamEndCapture(st, &g) == cudaSuccess && g);
    CHECK(cuda_emu_launch_count() == launches);
    to_host(out, a, n);
    CHECK_MSG(out[0] == 0.0f && out[5] == 5.0f, "the capture ran: a[0] %g, a[5] %g", out[0],
              out[5]);
    size_t nodes = 0;
    CHECK(cudaGraphGetNodes(g, NULL, &nodes) == cudaSuccess && nodes == 4);

    cudaGraphExec_t exec;
    CHECK(cudaGraphInstantiate(&exec, g, 0) == cudaSuccess);
    for (int rep = 1; rep <= 2; rep++) { /* each replay adds 1 to what a holds then */
        CHECK(cudaGraphLaunch(exec, st) == cudaSuccess);
        CHECK(cudaStreamSynchronize(st) == cudaSuccess);
        to_host(out, b, n);
        CHECK_MSG(out[7] == 2.0f * (7.0f + (float)rep), "replay %d: b[7] = %g", rep, out[7]);
        to_host(out, a, n);
        CHECK(out[0] == 0.0f && out[7] == 7.0f + (float)rep);
    }
    CHECK(cuda_emu_launch_count() == launches + 2);

    /* The same nodes with another scalar: the update takes; one node fewer: refused. */
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    AR_LAUNCH(add_scalar_kernel, 1, 64, 0, st, a, 100.0f, n);
    CHECK(cudaMemcpyAsync(b, a, n * sizeof(float), cudaMemcpyDeviceToDevice, st) == cudaSuccess);
    CHECK(cublasSgemm(blas, CUBLAS_OP_N, CUBLAS_OP_N, 1, n, 1, &two, one, 1, b, 1, &zero, b, 1) ==
          CUBLAS_STATUS_SUCCESS);
    CHECK(cudaMemsetAsync(a, 0, sizeof(float), st) == cudaSuccess);
    cudaGraph_t g2;
    CHECK(cudaStreamEndCapture(st, &g2) == cudaSuccess);
    cudaGraphExecUpdateResultInfo info;
    CHECK(cudaGraphExecUpdate(exec, g2, &info) == cudaSuccess &&
          info.result == cudaGraphExecUpdateSuccess);
    CHECK(cudaGraphLaunch(exec, st) == cudaSuccess);
    to_host(out, a, n);
    CHECK_MSG(out[7] == 109.0f, "updated replay: a[7] = %g", out[7]);
    CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
    AR_LAUNCH(add_scalar_kernel, 1, 64, 0, st, a, 1.0f, n);
    cudaGraph_t g3;
    CHECK(cudaStreamEndCapture(st, &g3) == cudaSuccess);
    CHECK(cudaGraphExecUpdate(exec, g3, &info) == cudaErrorGraphExecUpdateFailure &&
          info.result == cudaGraphExecUpdateErrorTopologyChanged);
    CHECK(cudaGetLastError() == cudaErrorGraphExecUpdateFailure);

    CHECK(cudaGraphExecDestroy(exec) == cudaSuccess);
    CHECK(cudaGraphDestroy(g) == cudaSuccess && cudaGraphDestroy(g2) == cudaSuccess &&
          cudaGraphDestroy(g3) == cudaSuccess);
    cublasDestroy(blas);
    cudaStreamDestroy(st);
    cudaFree(a);
    cudaFree(b);
    cudaFree(one);
}

/* What a capture refuses: host copies (recorded host memory could change
 * before the replay), a wait for the capturing stream, synchronous calls
 * from the capturing thread; each invalidates the capture. */
static void test_capture_refuses_host_copies_and_waits(void) {
    float h[4] = {0}, *d = dev_alloc<float>(4);
    cudaStream_t st;
    CHECK(cudaStreamCreate(&st) == cudaSuccess);
    for (int what = 0; what < 4; what++) {
        CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
        AR_LAUNCH(add_scalar_kernel, 1, 32, 0, st, d, 1.0f, 4);
        cudaError_t e;
        if (what == 0)
            e = cudaMemcpyAsync(d, h, sizeof h, cudaMemcpyHostToDevice, st);
        else if (what == 1)
            e = cudaStreamSynchronize(st);
        else if (what == 2)
            e = cudaMemcpy(h, d, sizeof h, cudaMemcpyDeviceToHost);
        else {
            void *p;
            e = cudaMalloc(&p, 16);
        }
        CHECK_MSG(e == cudaErrorStreamCaptureUnsupported, "case %d: %s", what, cudaGetErrorName(e));
        cudaStreamCaptureStatus status;
        CHECK(cudaStreamIsCapturing(st, &status) == cudaSuccess &&
              status == cudaStreamCaptureStatusInvalidated);
        cudaGraph_t g = (cudaGraph_t)1;
        CHECK(cudaStreamEndCapture(st, &g) == cudaErrorStreamCaptureInvalidated && !g);
        CHECK(cudaGetLastError() == cudaErrorStreamCaptureInvalidated);
    }
    to_host(h, d, 4);
    CHECK_MSG(h[0] == 0.0f, "a kernel of an invalidated capture ran: %g", h[0]);
    CHECK(cudaStreamBeginCapture(NULL, cudaStreamCaptureModeThreadLocal) ==
          cudaErrorStreamCaptureUnsupported);
    CHECK(cudaGetLastError() == cudaErrorStreamCaptureUnsupported);
    cudaStreamDestroy(st);
    cudaFree(d);
}

int main(void) {
    TEST_RUN(test_block_reduction_with_syncthreads);
    TEST_RUN(test_returned_threads_do_not_block_syncthreads);
    TEST_RUN(test_builtin_indices_3d);
    TEST_RUN(test_dynamic_shared_memory);
    TEST_RUN(test_warp_shuffles_and_ballot);
    TEST_RUN(test_half_warp_masks_vote_apart);
    TEST_RUN(test_divergent_warp_operations_fault);
    TEST_RUN(test_chained_shuffles_keep_their_values);
    TEST_RUN(test_atomics_from_many_blocks);
    TEST_RUN(test_half_bf16_conversion_bit_patterns);
    TEST_RUN(test_half_bf16_round_trip_all_patterns);
    TEST_RUN(test_launch_configuration_errors);
    TEST_RUN(test_kernel_faults_are_sticky_until_reset);
    TEST_RUN(test_planted_fault_fires_on_its_launch);
    TEST_RUN(test_planted_async_fault_surfaces_at_the_next_call);
    TEST_RUN(test_memory_errors_and_accounting);
    TEST_RUN(test_cublas_gemm_types_and_transposes);
    TEST_RUN(test_cublas_argument_errors_and_beta_zero);
    TEST_RUN(test_capture_records_and_graph_replays);
    TEST_RUN(test_capture_refuses_host_copies_and_waits);
    return TEST_SUMMARY();
}
