/* The CPU backend: the reference implementation of every op in backend.h.
 * fp32 activations; a model's Linear weights are packed at load and
 * multiplied by gemm_packed.c at any number of rows, other matrices' GEMMs
 * of a few rows go to gemm_rows.c and the rest to OpenBLAS, convolutions to
 * gemm_packed.c too (the im2col columns as its panels),
 * everything else is plain loops;
 * all threading is OpenMP, where the work is large enough to pay. */
#include "engine/backend/backend.h"
#include "kernels/cpu/conv_winograd.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/gemm_rows.h"
#include "kernels/cpu/vec_attn.h"
#include "kernels/cpu/vec_isa.h"
#include "kernels/cpu/vec_math.h"

#include <assert.h>
#include <cblas.h>
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>

/* Loops with fewer elements than this run on the calling thread: starting
 * an OpenMP team costs a few microseconds, about the time of this much work. */
#define PAR_MIN_WORK 32768

/* GEMMs with fewer multiply-adds than this run on one thread. */
#define GEMM_PAR_MIN_WORK ((int64_t)1 << 20)

/* Stack buffers in rope and attention are sized for this; real models use
 * 64 to 256. */
#define MAX_HEAD_DIM 512

/* Keys scored at a time by the online softmax in attention. */
#define ATTN_CHUNK 256

/* The scratch panel, in floats (16 MiB): conv2d's im2col tiles (one per
 * thread), the 16-bit weights' converted chunks and groupnorm's per-channel
 * affine. Allocated once at creation so that no op allocates (and so none
 * can fail). A backend is driven by one thread at a time. */
#define SCRATCH_FLOATS ((size_t)1 << 22)

typedef struct cpu_impl {
    int n_threads; /* OpenMP team size for threaded loops */
    void *scratch; /* SCRATCH_FLOATS floats, see above */
    /* cpu_activations bf16: a GEMM's activations rounded (matmul_bf16),
     * grown to the largest GEMM's; NULL until the first. */
    void *rounded;
    size_t rounded_bytes;
} cpu_impl_t;

static int team(const backend_t *be) { return ((const cpu_impl_t *)be->impl)->n_threads; }

/* ---- memory ------------------------------------------------------------ */

static void *cpu_alloc(backend_t *be, size_t bytes) {
    if (bytes > SIZE_MAX - 63)
        return NULL;
    size_t rounded = (bytes + 63) & ~(size_t)63; /* aligned_alloc wants a multiple */
    return aligned_alloc(64, rounded ? rounded : 64);
}

static void cpu_free(backend_t *be, void *p) { free(p); }

static void cpu_memcpy(backend_t *be, void *dst, const void *src, size_t bytes) {
    if (bytes)
        memcpy(dst, src, bytes);
}

static void cpu_sync(backend_t *be) {}

/* ---- weights ----------------------------------------------------------- */

static int cpu_weight_load(backend_t *be, tensor_t *out, const void *host_src, dtype_t src_dtype,
                           int ndim, const int64_t *shape, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    int64_t numel;
    if (backend_check_weight("cpu", host_src, src_dtype, ndim, shape, &numel, err) != AR_OK)
        return AR_ERR;
    /* Matrices (Linear weights, stacks of them, embedding tables) stay in
     * their 16-bit type: matmul converts them in registers and embedding
     * row by row, so a decode step reads half the bytes. Everything else
     * is fp32. */
    const dtype_t keep =
        (ndim == 2 || ndim == 3) && dtype_size(src_dtype) == 2 ? src_dtype : DTYPE_F32;
    const size_t src_size = dtype_size(src_dtype), size = dtype_size(keep);
    void *data = cpu_alloc(be, (size_t)numel * size);
    if (!data)
        return ar_errorf(err, "out of memory for a weight of %lld elements (%zu bytes)",
                         (long long)numel, (size_t)numel * size);
    /* Conversion is memory-bound; slices of 64 Ki elements spread it over the team. */
    const int64_t slice = 65536, n_slices = (numel + slice - 1) / slice;
#pragma omp parallel for num_threads(team(be)) if (n_slices > 1) schedule(static)
    for (int64_t s = 0; s < n_slices; s++) {
        int64_t i0 = s * slice, n = numel - i0 < slice ? numel - i0 : slice;
        const unsigned char *from = (const unsigned char *)host_src + (size_t)i0 * src_size;
        if (keep == DTYPE_F32)
            dtype_to_f32((float *)data + i0, from, src_dtype, (size_t)n);
        else
            memcpy((char *)data + (size_t)i0 * size, from, (size_t)n * size);
    }
    out->data = data;
    out->dtype = keep;
    out->ndim = ndim;
    for (int i = 0; i < 4; i++)
        out->shape[i] = i < ndim ? shape[i] : 1;
    return AR_OK;
}

/* An 8-bit Linear weight: its elements as they are, its scales per matrix
 * of the stack padded to a whole number of panels (zeros past n), as
 * gemm_packed_scaled reads them, with fp8's VEC_F8_DIV multiplied in. */
static int cpu_weight_load_8bit(backend_t *be, tensor_t *out, const void *host_src,
                                dtype_t src_dtype, const float *host_scale, int ndim,
                                const int64_t *shape, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    int64_t numel, rows;
    if (backend_check_weight_8bit("cpu", host_src, src_dtype, host_scale, ndim, shape, &numel,
                                  &rows, err) != AR_OK)
        return AR_ERR;
    const int64_t groups = ndim == 3 ? shape[0] : 1, n = shape[ndim - 2];
    const int64_t padded = (n + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
    void *data = cpu_alloc(be, (size_t)numel);
    float *scale = cpu_alloc(be, (size_t)(groups * padded) * sizeof(float));
    if (!data || !scale) {
        free(data);
        free(scale);
        return ar_errorf(err, "out of memory for an 8-bit weight of %lld elements",
                         (long long)numel);
    }
    if (numel > 0)
        memcpy(data, host_src, (size_t)numel);
    const float mul = src_dtype == DTYPE_F8_E4M3 ? VEC_F8_DIV : 1.0f;
    for (int64_t g = 0; g < groups; g++)
        for (int64_t r = 0; r < padded; r++)
            scale[g * padded + r] = r < n ? host_scale[g * n + r] * mul : 0.0f;
    out->data = data;
    out->scale = scale;
    out->dtype = src_dtype;
    out->ndim = ndim;
    for (int i = 0; i < 4; i++)
        out->shape[i] = i < ndim ? shape[i] : 1;
    return AR_OK;
}

static void cpu_weight_free(backend_t *be, tensor_t *t) {
    if (!t)
        return;
    free(t->data);
    free(t->aux);
    free(t->scale);
    memset(t, 0, sizeof *t);
}

/* A Linear weight's shape: G stacked matrices (1 for a plain one) of
 * [n, k] (backend.h's matmul). */
typedef struct linear_shape {
    int groups, n, k;
} linear_shape_t;

static linear_shape_t linear_shape(const tensor_t *w) {
    assert(w->ndim == 2 || w->ndim == 3);
    const int64_t *d = w->shape + (w->ndim - 2);
    assert(d[0] <= INT32_MAX && d[1] <= INT32_MAX && (w->ndim == 2 || w->shape[0] <= INT32_MAX));
    return (linear_shape_t){w->ndim == 3 ? (int)w->shape[0] : 1, (int)d[0], (int)d[1]};
}

/* Bytes from one stacked matrix to the next, in w's layout. */
static size_t linear_group_bytes(const tensor_t *w, linear_shape_t s) {
    const size_t elems =
        w->layout == LAYOUT_LINEAR ? gemm_packed_elems(s.n, s.k, w->dtype) : (size_t)s.n * s.k;
    return elems * dtype_size(w->dtype);
}

/* A matrix (or each of a stack) from now on only matmul's weight:
 * repacked in gemm_packed's panels, in its own type. */
static int linear_pack(backend_t *be, tensor_t *w, ar_error_t *err) {
    const linear_shape_t s = linear_shape(w);
    const size_t group = gemm_packed_elems(s.n, s.k, w->dtype) * dtype_size(w->dtype),
                 bytes = group * (size_t)s.groups;
    void *packed = cpu_alloc(be, bytes);
    if (!packed)
        return ar_errorf(err, "out of memory packing a Linear weight [%d, %d, %d] (%zu bytes)",
                         s.groups, s.n, s.k, bytes);
    const size_t plain = (size_t)s.n * s.k * dtype_size(w->dtype);
    for (int g = 0; g < s.groups; g++)
        gemm_packed_pack((char *)packed + g * group, (const char *)w->data + g * plain, w->dtype,
                         s.n, s.k, s.k);
    free(w->data);
    w->data = packed;
    w->layout = LAYOUT_LINEAR;
    return AR_OK;
}

/* 3x3 convolutions with at least this many input and output channels run
 * as Winograd F(2x2, 3x3): 16 multiplies a tile where the direct
 * convolution makes 36, for transforms that cost additions per channel
 * rather than per channel pair. `make bench-conv` puts the crossover at 16
 * channels on AVX2 and AVX-512, but at 16 the AVX-512 margin is within
 * run-to-run noise (1.00x to 1.08x at 48 pixels): 32 leaves a margin. Their
 * kernels take 16/9 of the memory. */
#define CONV_WINOGRAD_MIN_CHANNELS 32

/* Kernels from now on only conv2d's weight: 3x3 ones wide enough are
 * stored transformed (conv_winograd.h), in fp32 as every conv weight is
 * here; the rest stay as loaded. */
static int conv_transform(backend_t *be, tensor_t *w, ar_error_t *err) {
    assert(w->ndim == 4 && w->dtype == DTYPE_F32);
    const int64_t c_out = w->shape[0], c_in = w->shape[1];
    if (w->shape[2] != 3 || w->shape[3] != 3 || c_out < CONV_WINOGRAD_MIN_CHANNELS ||
        c_in < CONV_WINOGRAD_MIN_CHANNELS)
        return AR_OK;
    assert(c_out <= INT32_MAX && c_in <= INT32_MAX);
    const size_t bytes = winograd_weight_floats((int)c_out, (int)c_in) * sizeof(float);
    float *u = cpu_alloc(be, bytes);
    if (!u)
        return ar_errorf(err,
                         "out of memory transforming a 3x3 convolution's kernels [%lld, %lld] "
                         "(%zu bytes)",
                         (long long)c_out, (long long)c_in, bytes);
    winograd_weights(u, w->data, (int)c_out, (int)c_in);
    free(w->data);
    w->data = u;
    w->layout = LAYOUT_CONV;
    if (be->cpu_activations == CPU_ACTIVATIONS_BF16 && gemm_amx_usable()) {
        const size_t half = winograd_weight_bf16_elems((int)c_out, (int)c_in) * sizeof(uint16_t);
        if (!(w->aux = cpu_alloc(be, half)))
            return ar_errorf(err, "out of memory for a 3x3 convolution's bf16 kernels (%zu bytes)",
                             half);
        winograd_weights_bf16(w->aux, u, (int)c_out, (int)c_in);
    }
    return AR_OK;
}

static int cpu_weight_prepare(backend_t *be, tensor_t *w, tensor_layout_t use, ar_error_t *err) {
    assert(w->layout == LAYOUT_PLAIN);
    return use == LAYOUT_LINEAR ? linear_pack(be, w, err)
           : use == LAYOUT_CONV ? conv_transform(be, w, err)
                                : AR_OK;
}

/* ---- linear algebra ---------------------------------------------------- */

/* Rows of a Linear GEMM that go to gemm_rows, which reads the weight once
 * for all of them (`make bench-gemm`, one thread, AVX-512, the worst over
 * the served models' shapes: 3.5x OpenBLAS's sgemm at 2 rows, still 1.07x
 * at 128; at one row OpenBLAS's sgemv is 1.27x faster). */
#define GEMM_ROWS_MIN_M 2
#define GEMM_ROWS_MAX_M 128

/* C[M, N] += A[M, K] * B, with B [K, N], or B^T with B [N, K] when b_trans
 * (a Linear weight), on the calling thread. */
static void gemm_one(int M, int N, int K, const float *A, int lda, const float *B, int ldb,
                     int b_trans, float *C, int ldc) {
    if (M == 1 && b_trans) /* one row, a matrix-vector product */
        cblas_sgemv(CblasRowMajor, CblasNoTrans, N, K, 1.0f, B, ldb, A, 1, 1.0f, C, 1);
    else if (b_trans && M >= GEMM_ROWS_MIN_M && M <= GEMM_ROWS_MAX_M) /* decode, small prefill */
        gemm_rows(M, N, K, A, lda, B, ldb, C, ldc);
    else
        cblas_sgemm(CblasRowMajor, CblasNoTrans, b_trans ? CblasTrans : CblasNoTrans, M, N, K, 1.0f,
                    A, lda, B, ldb, 1.0f, C, ldc);
}

/* Start of part t of len split n ways, rounded down to a multiple of align. */
static int64_t split_at(int64_t len, int t, int n, int align) {
    return t == n ? len : len * t / n / align * align;
}

/* gemm_one on the OpenMP team: each thread takes a slice of N (of M when N
 * is narrow) and makes one single-threaded OpenBLAS call. OpenBLAS is set to
 * one thread at creation so that a single pool of threads, OpenMP's, works
 * the cores: with OpenBLAS's own pool busy-waiting beside OpenMP's on a
 * 2-core machine, a 3x3 conv ran 2x and decode (GEMV then attention) 3.5x
 * slower. */
static void gemm(const backend_t *be, int M, int N, int K, const float *A, int lda, const float *B,
                 int ldb, int b_trans, float *C, int ldc) {
    const int nt = (int64_t)M * N * K >= GEMM_PAR_MIN_WORK ? team(be) : 1;
    if (nt == 1) {
        gemm_one(M, N, K, A, lda, B, ldb, b_trans, C, ldc);
        return;
    }
    const int split_n = N >= 16 * nt || M < nt;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), n = omp_get_num_threads();
        if (split_n) { /* columns of C: rows of B^T or columns of B; 16 keeps 64-byte alignment */
            const int lo = split_at(N, t, n, 16), hi = split_at(N, t + 1, n, 16);
            if (hi > lo)
                gemm_one(M, hi - lo, K, A, lda, b_trans ? B + (size_t)lo * ldb : B + lo, ldb,
                         b_trans, C + lo, ldc);
        } else { /* rows of C and A */
            const int lo = split_at(M, t, n, 1), hi = split_at(M, t + 1, n, 1);
            if (hi > lo)
                gemm_one(hi - lo, N, K, A + (size_t)lo * lda, lda, B, ldb, b_trans,
                         C + (size_t)lo * ldc, ldc);
        }
    }
}

/* y += x w^T for a 16-bit weight [n, k], on the team, each thread a slice
 * of n: decode-sized m through gemm_rows_typed (converting in registers);
 * larger m converts chunks of its weight rows to fp32 in its part of the
 * scratch panel for OpenBLAS's sgemm, so prefill sums as with fp32 weights. */
static void matmul_16bit(const backend_t *be, float *y, const float *x, const tensor_t *w, int m,
                         int n, int k) {
    const int nt = (int64_t)m * n * k >= GEMM_PAR_MIN_WORK ? team(be) : 1;
    float *scratch = ((const cpu_impl_t *)be->impl)->scratch;
    const size_t esize = dtype_size(w->dtype);
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), nth = omp_get_num_threads();
        const int lo = split_at(n, t, nth, 16), hi = split_at(n, t + 1, nth, 16);
        const char *rows = (const char *)w->data + (size_t)lo * k * esize;
        if (hi > lo && m <= GEMM_ROWS_MAX_M) {
            gemm_rows_typed(m, hi - lo, k, x, k, rows, w->dtype, k, y + lo, n);
        } else if (hi > lo) {
            float *panel = scratch + (size_t)t * (SCRATCH_FLOATS / (size_t)nth);
            const size_t fit = SCRATCH_FLOATS / (size_t)nth / (size_t)k;
            const int chunk = fit < 1 ? 1 : fit > (size_t)(hi - lo) ? hi - lo : (int)fit;
            assert(fit >= 1); /* k of at most 2 Mi per thread */
            for (int r0 = lo; r0 < hi; r0 += chunk) {
                const int nr = hi - r0 < chunk ? hi - r0 : chunk;
                dtype_to_f32(panel, (const char *)w->data + (size_t)r0 * k * esize, w->dtype,
                             (size_t)nr * k);
                cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, nr, k, 1.0f, x, k, panel, k,
                            1.0f, y + r0, n);
            }
        }
    }
}

/* y += x w^T for a packed weight (linear_pack), on the team: each
 * thread a slice of n's panels, or of m's rows where n has too few panels
 * for every thread. The sums are the same bytes whatever the split
 * (gemm_packed.h). */
static void matmul_packed(const backend_t *be, float *y, const float *x, const tensor_t *w, int m,
                          int n, int k) {
    const float *scale = w->scale;
    const int nt = (int64_t)m * n * k >= GEMM_PAR_MIN_WORK ? team(be) : 1;
    const int panels = (n + GEMM_PANEL - 1) / GEMM_PANEL, split_n = panels >= 4 * nt || m < nt;
#pragma omp parallel num_threads(nt)
    {
        const int t = omp_get_thread_num(), nth = omp_get_num_threads();
        if (split_n) {
            const int lo = (int)split_at(panels, t, nth, 1),
                      hi = (int)split_at(panels, t + 1, nth, 1);
            const int c0 = lo * GEMM_PANEL, c1 = hi * GEMM_PANEL < n ? hi * GEMM_PANEL : n;
            if (c1 > c0)
                gemm_packed_scaled(m, c1 - c0, k, x, k, gemm_packed_panel(w->data, w->dtype, k, lo),
                                   w->dtype, scale ? scale + c0 : NULL, y + c0, n);
        } else {
            const int lo = (int)split_at(m, t, nth, 1), hi = (int)split_at(m, t + 1, nth, 1);
            if (hi > lo)
                gemm_packed_scaled(hi - lo, n, k, x + (size_t)lo * k, k, w->data, w->dtype, scale,
                                   y + (size_t)lo * n, n);
        }
    }
}

/* The rounded-activations buffer, at least bytes long; NULL when it cannot
 * grow (the caller multiplies in fp32 instead). */
static void *rounded_buffer(const backend_t *be, size_t bytes) {
    cpu_impl_t *impl = be->impl;
    if (impl->rounded_bytes >= bytes)
        return impl->rounded;
    void *p = cpu_alloc(NULL, bytes);
    if (!p)
        return NULL;
    free(impl->rounded);
    impl->rounded = p;
    impl->rounded_bytes = bytes;
    return p;
}

/* cpu_activations bf16 on a bf16 Linear weight: x rounded to bf16 once,
 * then, with AMX, pairs of panels split over the team (the tiles read the
 * packed panels as they lie); without, the rounded values widened back to
 * fp32 through gemm_packed. Every m takes the same path, so a row's bytes do
 * not depend on the batch (weight_prepare's promise); on the tiles one or two
 * rows run at about 0.8x the fp32 kernels' speed, 8 rows at 1.3x, 32 at 5x
 * (a 2048 x 2048 weight, one core). 0 where the buffer cannot grow, and
 * nothing done. */
static int matmul_bf16(const backend_t *be, float *y, const float *x, const tensor_t *w, int m,
                       int n, int k) {
    const int nt = (int64_t)m * n * k >= GEMM_PAR_MIN_WORK ? team(be) : 1;
    if (gemm_amx_usable()) {
        const int mp = gemm_amx_pad(m), kp = gemm_amx_pad(k);
        uint16_t *xb = rounded_buffer(be, (size_t)mp * kp * sizeof(uint16_t));
        if (!xb)
            return 0;
        const int pairs = (n + 2 * GEMM_PANEL - 1) / (2 * GEMM_PANEL);
#pragma omp parallel num_threads(nt)
        {
            const int t = omp_get_thread_num(), nth = omp_get_num_threads();
            gemm_amx_round(xb, x, k, m, k, (int)split_at(mp, t, nth, 1),
                           (int)split_at(mp, t + 1, nth, 1));
#pragma omp barrier
            const int lo = (int)split_at(pairs, t, nth, 1),
                      hi = (int)split_at(pairs, t + 1, nth, 1);
            const int c0 = lo * 2 * GEMM_PANEL,
                      c1 = hi * 2 * GEMM_PANEL < n ? hi * 2 * GEMM_PANEL : n;
            if (c1 > c0)
                gemm_amx(m, c1 - c0, k, xb, gemm_packed_panel(w->data, w->dtype, k, 2 * lo), y + c0,
                         n);
        }
        return 1;
    }
    float *xr = rounded_buffer(be, (size_t)m * k * sizeof(float));
    if (!xr)
        return 0;
#pragma omp parallel for num_threads(nt) if (nt > 1)
    for (int r = 0; r < m; r++)
        for (int i = 0; i < k; i++)
            xr[(size_t)r * k + i] = bf16_to_f32(f32_to_bf16(x[(size_t)r * k + i]));
    matmul_packed(be, y, xr, w, m, n, k);
    return 1;
}

/* y is written first (bias rows or zeros) and the GEMM accumulates into it:
 * with beta = 0 some OpenBLAS versions scale y by zero, which keeps a NaN
 * left in an uninitialised output. */
static void matmul_one(backend_t *be, float *y, const float *x, const tensor_t *w,
                       const float *bias, int m, int n, int k) {
    for (int r = 0; r < m; r++) {
        if (bias)
            memcpy(y + (size_t)r * n, bias, (size_t)n * sizeof(float));
        else
            memset(y + (size_t)r * n, 0, (size_t)n * sizeof(float));
    }
    assert(!dtype_is_weight8(w->dtype) || w->layout == LAYOUT_LINEAR);
    if (k > 0 && w->layout == LAYOUT_LINEAR && w->dtype == DTYPE_BF16 &&
        be->cpu_activations == CPU_ACTIVATIONS_BF16 && matmul_bf16(be, y, x, w, m, n, k))
        return;
    if (k > 0 && w->layout == LAYOUT_LINEAR)
        matmul_packed(be, y, x, w, m, n, k);
    else if (k > 0 && w->dtype == DTYPE_F32)
        gemm(be, m, n, k, x, k, w->data, k, 1, y, n);
    else if (k > 0)
        matmul_16bit(be, y, x, w, m, n, k);
}

/* A stacked weight is its matrices one after the other, each as matmul_one
 * runs a plain one: the same bytes either way. */
static void cpu_matmul(backend_t *be, float *y, const float *x, const tensor_t *w,
                       const tensor_t *bias, int m) {
    const linear_shape_t s = linear_shape(w);
    assert(m >= 0);
    assert(!bias || (bias->dtype == DTYPE_F32 && tensor_numel(bias) == (int64_t)s.groups * s.n));
    if (m == 0 || s.n == 0)
        return;
    const size_t group = linear_group_bytes(w, s);
    const size_t scales = (size_t)(s.n + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
    for (int g = 0; g < s.groups; g++) {
        tensor_t part = *w;
        part.data = (char *)w->data + g * group;
        if (w->scale)
            part.scale = (float *)w->scale + g * scales;
        matmul_one(be, y + (size_t)g * m * s.n, x, &part,
                   bias ? (const float *)bias->data + (size_t)g * s.n : NULL, m, s.n, s.k);
    }
}

/* ---- transformer ops --------------------------------------------------- */

/* Follows HF Llama in fp32: y = (x * rsqrt(mean(x^2) + eps)) * w; the sum of
 * squares is accumulated in double. */
static void cpu_rmsnorm(backend_t *be, float *y, const float *x, const tensor_t *w, int rows,
                        int dim, float eps) {
    assert(w->dtype == DTYPE_F32 && tensor_numel(w) == dim && rows >= 0 && dim > 0);
    const float *wd = w->data;
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * dim >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        double ss = 0;
        for (int i = 0; i < dim; i++)
            ss += (double)xr[i] * xr[i];
        const float inv = (float)(1.0 / sqrt(ss / dim + eps));
        for (int i = 0; i < dim; i++)
            yr[i] = (xr[i] * inv) * wd[i];
    }
}

/* LlamaGen's apply_rotary_emb with precompute_freqs_cis_2d's table: the
 * frequencies as in cpu_rope (below) with d = head_dim/2 (torch forms them the same
 * way), pair j turned by the grid row for j < head_dim/4 and by the column
 * after; condition rows (negative grid row) rotate by cos = sin = 0. */
static void cpu_rope_2d(backend_t *be, float *x, const int *pos, int rows, int n_heads,
                        int head_dim, float theta) {
    assert(head_dim > 0 && head_dim % 4 == 0 && head_dim <= MAX_HEAD_DIM);
    assert(rows >= 0 && n_heads >= 0 && theta > 0);
    const int half = head_dim / 2, quarter = head_dim / 4;
    float inv_freq[MAX_HEAD_DIM / 4];
    for (int f = 0; f < quarter; f++) {
        const float e = (float)(2 * f) / (float)half;
        inv_freq[f] = 1.0f / (float)pow((double)theta, (double)e);
    }
    const int64_t work = (int64_t)rows * n_heads * head_dim;
#pragma omp parallel for num_threads(team(be)) if (work >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++) {
        const int row = pos[2 * r], col = pos[2 * r + 1];
        assert(row < 0 || (row < (1 << 24) && col >= 0 && col < (1 << 24)));
        float c[MAX_HEAD_DIM / 2], s[MAX_HEAD_DIM / 2];
        for (int j = 0; j < half; j++) {
            c[j] = s[j] = 0.0f;
            if (row < 0)
                continue;
            const int p = j < quarter ? row : col;
            const float angle = (float)((double)p * (double)inv_freq[j % quarter]);
            c[j] = (float)cos((double)angle);
            s[j] = (float)sin((double)angle);
        }
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + ((size_t)r * n_heads + h) * head_dim;
            for (int j = 0; j < half; j++) {
                const float a = xh[2 * j], b = xh[2 * j + 1];
                xh[2 * j] = a * c[j] - b * s[j];
                xh[2 * j + 1] = b * c[j] + a * s[j];
            }
        }
    }
}

/* Follows HF Llama's rotary embedding step by step: inv_freq[j] = 1 /
 * theta^(2j/d) in fp32 (exponent divided in fp32, as torch does; the power
 * taken in double and rounded, which torch's fp32 pow matches for
 * power-of-two d), angle = fp32(pos * inv_freq[j]) (formed exactly in double,
 * rounded once, as the fp32 product is), then cos and sin of that fp32 angle
 * in double, rounded to fp32. Positions must be below 2^24 (exact in fp32). */
static void cpu_rope(backend_t *be, float *x, const int *pos, int rows, int n_heads, int head_dim,
                     float theta) {
    assert(head_dim > 0 && head_dim % 2 == 0 && head_dim <= MAX_HEAD_DIM);
    assert(rows >= 0 && n_heads >= 0 && theta > 0);
    const int half = head_dim / 2;
    float inv_freq[MAX_HEAD_DIM / 2];
    for (int j = 0; j < half; j++) {
        const float e = (float)(2 * j) / (float)head_dim;
        inv_freq[j] = 1.0f / (float)pow((double)theta, (double)e);
    }
    const int64_t work = (int64_t)rows * n_heads * head_dim;
#pragma omp parallel for num_threads(team(be)) if (work >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++) {
        assert(pos[r] >= 0 && pos[r] < (1 << 24));
        float c[MAX_HEAD_DIM / 2], s[MAX_HEAD_DIM / 2];
        for (int j = 0; j < half; j++) {
            const float angle = (float)((double)pos[r] * (double)inv_freq[j]);
            c[j] = (float)cos((double)angle);
            s[j] = (float)sin((double)angle);
        }
        for (int h = 0; h < n_heads; h++) {
            float *xh = x + ((size_t)r * n_heads + h) * head_dim;
            for (int j = 0; j < half; j++) {
                const float a = xh[j], b = xh[j + half];
                xh[j] = a * c[j] - b * s[j];
                xh[j + half] = b * c[j] + a * s[j];
            }
        }
    }
}

/* A position in a paged cache, stepped key by key: the block (index into
 * the table) and the row within it, so the walks below stay free of
 * divisions. Offsets are in bytes: a pool holds any cache type. */
typedef struct kv_walk {
    char *base;
    const int *blocks;
    size_t block_bytes, v_offset, row_bytes; /* 2 * bt * row_bytes, bt * row_bytes, hd * size */
    int block_tokens;
    int b, o;
} kv_walk_t;

static kv_walk_t walk_at(const kv_blocks_t *pool, const int *blocks, int j) {
    const size_t bt = (size_t)pool->block_tokens,
                 row = (size_t)pool->head_dim * dtype_size(pool->dtype);
    return (kv_walk_t){pool->base,
                       blocks,
                       2 * bt * row,
                       bt * row,
                       row,
                       pool->block_tokens,
                       j / pool->block_tokens,
                       j % pool->block_tokens};
}

static inline void *walk_k(const kv_walk_t *w) {
    return w->base + (size_t)w->blocks[w->b] * w->block_bytes + (size_t)w->o * w->row_bytes;
}

static inline void *walk_v(const kv_walk_t *w) { return (char *)walk_k(w) + w->v_offset; }

static inline void walk_next(kv_walk_t *w) {
    if (++w->o == w->block_tokens) {
        w->o = 0;
        w->b++;
    }
}

/* A row of n cache elements of type t to fp32: each fp8 element times
 * scale (the view's; the 16-bit types are exact and take none). */
static void kv_row_to_f32(float *dst, const void *src, dtype_t t, int n, float scale) {
    if (t == DTYPE_BF16) {
        const uint16_t *h = src;
#pragma omp simd
        for (int i = 0; i < n; i++) {
            const uint32_t u = (uint32_t)h[i] << 16;
            memcpy(&dst[i], &u, 4);
        }
    } else if (t == DTYPE_F8_E4M3) {
        const uint8_t *b = src;
        assert(scale > 0);
        for (int i = 0; i < n; i++)
            dst[i] = f8e4m3_to_f32(b[i]) * scale;
    } else {
        dtype_to_f32(dst, src, t, (size_t)n);
    }
}

/* fp32 to a row of cache elements: rounded to nearest even; fp8 elements
 * are x / scale, saturated at +-448. */
static void kv_row_from_f32(void *dst, const float *src, dtype_t t, int n, float scale) {
    if (t == DTYPE_F8_E4M3) {
        uint8_t *b = dst;
        assert(scale > 0);
        const float inv = 1.0f / scale;
        for (int i = 0; i < n; i++)
            b[i] = f32_to_f8e4m3(src[i] * inv);
    } else {
        dtype_from_f32(dst, src, t, (size_t)n);
    }
}

static void cpu_kv_append(backend_t *be, const kv_blocks_t *pool, const kv_view_t *kv,
                          const float *k, const float *v, const int *q_start, int n_seq,
                          int n_heads) {
    const int head_dim = pool->head_dim;
    assert(n_seq >= 0 && n_heads >= 0 && head_dim > 0 && pool->block_tokens > 0);
    const size_t row = (size_t)n_heads * head_dim;
    for (int s = 0; s < n_seq; s++) {
        const int n_new = q_start[s + 1] - q_start[s];
        assert(n_new >= 0);
        for (int h = 0; h < n_heads; h++) {
            const kv_view_t *c = &kv[s * n_heads + h];
            if (!c->blocks)
                continue; /* this head does not cache these rows */
            assert(c->len >= n_new);
            kv_walk_t w = walk_at(pool, c->blocks, c->len - n_new);
            for (int r = q_start[s]; r < q_start[s + 1]; r++, walk_next(&w)) {
                const size_t at = (size_t)r * row + (size_t)h * head_dim;
                kv_row_from_f32(walk_k(&w), k + at, pool->dtype, head_dim, c->k_scale);
                kv_row_from_f32(walk_v(&w), v + at, pool->dtype, head_dim, c->v_scale);
            }
        }
    }
}

/* Floats of the per-thread buffer attention widens a chunk's K and V rows
 * into where it widens them (kv_widened). */
static size_t kv_conv_floats(int head_dim) { return (size_t)2 * ATTN_CHUNK * (size_t)head_dim; }

/* Attention widens a cache's rows into a buffer only for fp8 (its scale):
 * the kernels read fp32, bf16 and fp16 rows where they lie. */
static int kv_widened(const kv_blocks_t *pool) { return pool->dtype == DTYPE_F8_E4M3; }

/* The type attention's kernels read pool's rows in. */
static dtype_t kv_read_type(const kv_blocks_t *pool) {
    return kv_widened(pool) ? DTYPE_F32 : pool->dtype;
}

/* The team for an attention op over pool: every thread's share of the
 * scratch panel must hold kv_conv_floats when rows are widened. */
static int attn_team(const backend_t *be, const kv_blocks_t *pool) {
    int n = team(be);
    if (kv_widened(pool)) {
        const int fit = (int)(SCRATCH_FLOATS / kv_conv_floats(pool->head_dim));
        n = n < fit ? n : fit;
    }
    return n > 0 ? n : 1;
}

/* The calling thread's widening buffer (NULL where rows are not widened). */
static float *kv_conv_buffer(const backend_t *be, const kv_blocks_t *pool) {
    if (!kv_widened(pool))
        return NULL;
    const size_t share = SCRATCH_FLOATS / (size_t)attn_team(be, pool);
    return (float *)((const cpu_impl_t *)be->impl)->scratch + (size_t)omp_get_thread_num() * share;
}

/* Pointers to the K and V rows (v may be NULL: keys only) of cache indices
 * [j0, j0 + nj) of a paged sequence: into the pool (elements of its type)
 * when conv is NULL, else to the rows widened to fp32 into conv
 * (kv_conv_floats floats). */
static void paged_rows_at(const kv_blocks_t *pool, const kv_view_t *view, int j0, int nj,
                          const void **k, const void **v, float *conv) {
    kv_walk_t w = walk_at(pool, view->blocks, j0);
    const int hd = pool->head_dim;
    for (int j = 0; j < nj; j++, walk_next(&w)) {
        if (!conv) {
            k[j] = walk_k(&w);
            if (v)
                v[j] = walk_v(&w);
            continue;
        }
        float *kj = conv + (size_t)j * hd, *vj = conv + (size_t)(ATTN_CHUNK + j) * hd;
        kv_row_to_f32(kj, walk_k(&w), pool->dtype, hd, view->k_scale);
        k[j] = kj;
        if (v) {
            kv_row_to_f32(vj, walk_v(&w), pool->dtype, hd, view->v_scale);
            v[j] = vj;
        }
    }
}

/* Online softmax over one chunk of nj keys whose K and V rows are given by
 * pointer: the running max m, sum l and weighted sum acc of a query row. */
static void attend_chunk(float *acc, float *m, double *l, const float *q, const void *const *k,
                         const void *const *v, dtype_t kvt, int nj, int head_dim, float scale) {
    float sc[ATTN_CHUNK], cm = -INFINITY;
    vec_dots(sc, q, k, kvt, nj, head_dim, scale);
    for (int j = 0; j < nj; j++)
        cm = sc[j] > cm ? sc[j] : cm;
    if (cm > *m) {
        const float rescale = expf(*m - cm); /* 0 on the first chunk */
        *l *= rescale;
        for (int d = 0; d < head_dim; d++)
            acc[d] *= rescale;
        *m = cm;
    }
    for (int j = 0; j < nj; j++) {
        sc[j] = expf(sc[j] - *m);
        *l += sc[j];
    }
    vec_axpys(acc, sc, v, kvt, nj, head_dim);
}

/* One query row against its visible keys [0, n_keys): a softmax computed
 * online over chunks of ATTN_CHUNK keys (running max m, running sum l, the
 * output rescaled when m grows), so no buffer grows with the context.
 * Chunks are cut by cache index, not by block, so the arithmetic (and the
 * result, bit for bit) does not depend on the block size. */
static void attend_row(float *out, const float *q, const kv_blocks_t *pool, const kv_view_t *view,
                       int n_keys, float scale, float *conv) {
    const int head_dim = pool->head_dim;
    const dtype_t kvt = kv_read_type(pool);
    float acc[MAX_HEAD_DIM], m = -INFINITY;
    const void *k[ATTN_CHUNK], *v[ATTN_CHUNK];
    double l = 0;
    for (int d = 0; d < head_dim; d++)
        acc[d] = 0;
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_CHUNK) {
        const int nj = n_keys - j0 < ATTN_CHUNK ? n_keys - j0 : ATTN_CHUNK;
        paged_rows_at(pool, view, j0, nj, k, v, conv);
        attend_chunk(acc, &m, &l, q, k, v, kvt, nj, head_dim, scale);
    }
    const float inv = (float)(1.0 / l);
    for (int d = 0; d < head_dim; d++)
        out[d] = acc[d] * inv;
}

/* attend_row for a step whose key mass a policy wants: two passes, the
 * first for the softmax's max and sum (online, as above, without the
 * values), the second forming each probability p_j = exp(s_j - m) / l once,
 * weighting v_j with it and adding it to mass[j]. The mass is exactly the
 * softmax the output used; the price is computing every score twice. */
static void attend_row_mass(float *out, float *mass, const float *q, const kv_blocks_t *pool,
                            const kv_view_t *view, int n_keys, float scale, float *conv) {
    const int head_dim = pool->head_dim;
    const dtype_t kvt = kv_read_type(pool);
    float acc[MAX_HEAD_DIM], sc[ATTN_CHUNK];
    const void *k[ATTN_CHUNK], *v[ATTN_CHUNK];
    float m = -INFINITY;
    double l = 0;
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_CHUNK) {
        const int nj = n_keys - j0 < ATTN_CHUNK ? n_keys - j0 : ATTN_CHUNK;
        float cm = -INFINITY;
        paged_rows_at(pool, view, j0, nj, k, NULL, conv);
        vec_dots(sc, q, k, kvt, nj, head_dim, scale);
        for (int j = 0; j < nj; j++)
            cm = sc[j] > cm ? sc[j] : cm;
        if (cm > m) {
            l *= exp((double)m - cm);
            m = cm;
        }
        for (int j = 0; j < nj; j++)
            l += exp((double)sc[j] - m);
    }
    const double inv = 1.0 / l;
    for (int d = 0; d < head_dim; d++)
        acc[d] = 0;
    for (int j0 = 0; j0 < n_keys; j0 += ATTN_CHUNK) {
        const int nj = n_keys - j0 < ATTN_CHUNK ? n_keys - j0 : ATTN_CHUNK;
        paged_rows_at(pool, view, j0, nj, k, v, conv);
        vec_dots(sc, q, k, kvt, nj, head_dim, scale);
        for (int j = 0; j < nj; j++) {
            sc[j] = (float)(exp((double)sc[j] - m) * inv);
            mass[j0 + j] += sc[j];
        }
        vec_axpys(acc, sc, v, kvt, nj, head_dim);
    }
    for (int d = 0; d < head_dim; d++)
        out[d] = acc[d];
}

static void cpu_attention(backend_t *be, float *out, const float *q, const kv_blocks_t *pool,
                          const attn_batch_t *batch, int n_heads, float scale) {
    const int head_dim = pool->head_dim;
    assert(batch->n_seq >= 0 && n_heads >= 0 && head_dim > 0 && head_dim <= MAX_HEAD_DIM);
    assert(pool->block_tokens > 0);
    const int n_pairs = batch->n_seq * n_heads;
    const int *q_start = batch->q_start;
    const kv_view_t *kv = batch->kv;
    int64_t work = 0;
    for (int i = 0; i < n_pairs; i++) {
        const int s = i / n_heads, n_new = q_start[s + 1] - q_start[s];
        assert(n_new >= 0 && kv[i].len >= n_new);
        work += (int64_t)n_new * kv[i].len;
    }
    const size_t row = (size_t)n_heads * head_dim;
    /* Pairs differ in cost (ragged lengths), hence the dynamic schedule. A
     * pair's mass array is written by the one thread that runs the pair. */
#pragma omp parallel for num_threads(attn_team(be, pool)) if (work * head_dim >= PAR_MIN_WORK)     \
    schedule(dynamic, 1)
    for (int i = 0; i < n_pairs; i++) {
        const int s = i / n_heads, h = i % n_heads;
        const int n_new = q_start[s + 1] - q_start[s];
        float *mass = batch->mass ? batch->mass[i] : NULL;
        float *conv = kv_conv_buffer(be, pool);
        for (int t = 0; t < n_new; t++) {
            const size_t r = (size_t)q_start[s] + (size_t)t;
            const size_t at = r * row + (size_t)h * head_dim;
            const int n_keys = kv[i].len - n_new + t + 1;
            if (mass)
                attend_row_mass(out + at, mass, q + at, pool, &kv[i], n_keys, scale, conv);
            else
                attend_row(out + at, q + at, pool, &kv[i], n_keys, scale, conv);
        }
    }
}

/* ---- attention for many query rows ------------------------------------- */

/* A next-scale step runs every row of a scale against the same keys, and a
 * cross-attention every image row against the same prompt: compute-bound
 * work, done as GEMMs. A group of up to attn_group_rows query rows meets a
 * block of ATTN_CHUNK keys at a time: the block's K and V rows are packed
 * once for the group (for gemm_packed, widened to fp32: K in panels of
 * GEMM_PANEL keys, V transposed into panels of GEMM_PANEL dimensions; for
 * the AMX tiles, in bf16 straight into their operand layout), then each
 * tile of ATTN_Q_TILE rows of the group gets its scores (one GEMM), their
 * online softmax (running max and sum per row, the output rescaled when the
 * max grows) and the weighted values (a second GEMM into the group's
 * output). Packing once a group, not once a tile, keeps it a small part of
 * the work at the many rows of a large scale, and the buffers are a
 * group's, whatever the context. */
#define ATTN_Q_TILE 64
#define ATTN_GROUP_FLOATS (64 * 1024) /* a group's output, at most */
#define ATTN_GROUP_TILES 16           /* and its tiles */

/* The keys of a (sequence, head) pair: n_cached rows of a paged cache (pool
 * and view; none where pool is NULL), then fp32 rows of k_new and v_new,
 * stride floats apart. */
typedef struct attn_keys {
    const kv_blocks_t *pool;
    const kv_view_t *view;
    int n_cached, n_keys;
    const float *k_new, *v_new;
    size_t stride;
} attn_keys_t;

static int round_panel(int n) { return (n + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL; }

/* Query rows of a group at head dimension d: whole tiles, as many as leave
 * its output within ATTN_GROUP_FLOATS (at least one tile, at most ATTN_GROUP_TILES). */
static int attn_group_rows(int d) {
    const int tiles = ATTN_GROUP_FLOATS / ATTN_Q_TILE / round_panel(d);
    return ATTN_Q_TILE * (tiles < 1 ? 1 : tiles > ATTN_GROUP_TILES ? ATTN_GROUP_TILES : tiles);
}

/* cpu_activations bf16 on a CPU with AMX: attention's two products on the
 * tiles too (kernels/cpu/gemm_amx.h), Q, K, V and the softmax's weights
 * rounded to bf16 as PyTorch's bf16 autocast feeds its attention. The bf16
 * copies, in elements: the group's Q (rows padded to 32), a tile's weights,
 * the block's K and V in the tiles' operand layout. */
static size_t attn_bf16_elems(int d) {
    const size_t d32 = (size_t)gemm_amx_pad(d);
    return (size_t)attn_group_rows(d) * d32 + ATTN_Q_TILE * ATTN_CHUNK +
           gemm_amx_b_elems(ATTN_CHUNK, d) + gemm_amx_b_elems(d, ATTN_CHUNK);
}

/* Floats of one thread's buffers at head dimension d: the packed K and V
 * of a block, a tile's scores, the group's output, the bf16 copies. */
static size_t attn_tile_floats(int d) {
    const size_t dp = (size_t)round_panel(d);
    return 2 * ATTN_CHUNK * dp + (size_t)ATTN_Q_TILE * ATTN_CHUNK +
           (size_t)attn_group_rows(d) * dp + (attn_bf16_elems(d) + 1) / 2;
}

/* The team for tiled attention: as many threads as the scratch panel holds
 * buffers for. */
static int attn_tile_team(const backend_t *be, int d) {
    const int fit = (int)(SCRATCH_FLOATS / attn_tile_floats(d)), n = team(be);
    return n < fit ? n : fit;
}

typedef struct attn_tile_buf {
    float *kp, *vp, *s, *o;      /* packed K and V of a block, a tile's scores, the output */
    int amx;                     /* the products on AMX tiles, in bf16 */
    uint16_t *qb, *pb, *kb, *vb; /* Q and the weights rounded, K and V as the tiles' operands */
} attn_tile_buf_t;

static attn_tile_buf_t attn_tile_buffers(const backend_t *be, int d) {
    const size_t dp = (size_t)round_panel(d);
    float *at = (float *)((const cpu_impl_t *)be->impl)->scratch +
                (size_t)omp_get_thread_num() * attn_tile_floats(d);
    attn_tile_buf_t b = {.kp = at, .vp = at + ATTN_CHUNK * dp, .s = at + 2 * ATTN_CHUNK * dp};
    b.o = b.s + (size_t)ATTN_Q_TILE * ATTN_CHUNK;
    b.amx = be->cpu_activations == CPU_ACTIVATIONS_BF16 && gemm_amx_usable();
    b.qb = (uint16_t *)(b.o + (size_t)attn_group_rows(d) * dp);
    b.pb = b.qb + (size_t)attn_group_rows(d) * gemm_amx_pad(d);
    b.kb = b.pb + (size_t)ATTN_Q_TILE * ATTN_CHUNK;
    b.vb = b.kb + gemm_amx_b_elems(ATTN_CHUNK, d);
    return b;
}

/* Packs keys [j0, j0 + nb) of ak: K into kp, gemm_packed's layout of an
 * [nb, d] weight (key j, element i at (j / P) * d * P + i * P + j % P for
 * P = GEMM_PANEL, keys past nb zero), and, unless vp is NULL, V into vp as
 * a [d, nb] weight (element i of key j at (i / P) * nb * P + j * P + i % P,
 * elements past d zero). Cached rows are widened to fp32 (fp8 times the
 * view's scale). */
static void attn_pack_block(float *kp, float *vp, const attn_keys_t *ak, int j0, int nb, int d) {
    float kw[MAX_HEAD_DIM], vw[MAX_HEAD_DIM];
    const int dp = round_panel(d), nbp = round_panel(nb);
    kv_walk_t w = {0};
    if (j0 < ak->n_cached)
        w = walk_at(ak->pool, ak->view->blocks, j0);
    for (int j = 0; j < nb; j++) {
        const float *k, *v;
        if (j0 + j < ak->n_cached) {
            kv_row_to_f32(kw, walk_k(&w), ak->pool->dtype, d, ak->view->k_scale);
            if (vp)
                kv_row_to_f32(vw, walk_v(&w), ak->pool->dtype, d, ak->view->v_scale);
            walk_next(&w);
            k = kw, v = vw;
        } else {
            const size_t r = (size_t)(j0 + j - ak->n_cached) * ak->stride;
            k = ak->k_new + r, v = ak->v_new + r;
        }
        float *kpan = kp + (size_t)(j / GEMM_PANEL) * d * GEMM_PANEL + j % GEMM_PANEL;
        for (int i = 0; i < d; i++)
            kpan[(size_t)i * GEMM_PANEL] = k[i];
        if (!vp)
            continue;
        for (int i0 = 0; i0 < dp; i0 += GEMM_PANEL) {
            float *vpan = vp + (size_t)i0 * nb + (size_t)j * GEMM_PANEL;
            const int n = d - i0 < GEMM_PANEL ? d - i0 : GEMM_PANEL;
            memcpy(vpan, v + i0, (size_t)n * sizeof(float));
            memset(vpan + n, 0, (size_t)(GEMM_PANEL - n) * sizeof(float));
        }
    }
    for (int j = nb; j < nbp; j++)
        for (int i = 0; i < d; i++)
            kp[(size_t)(j / GEMM_PANEL) * d * GEMM_PANEL + (size_t)i * GEMM_PANEL +
               j % GEMM_PANEL] = 0;
}

/* Key j's row (K or V) in bf16: a bf16 cache's own bytes, else rounded
 * into tmp (cached rows widened first, fp8 times the view's scale). */
static const uint16_t *attn_row_bf16(uint16_t *tmp, const attn_keys_t *ak, const kv_walk_t *w,
                                     int j, int v, int d) {
    if (j < ak->n_cached) {
        const void *src = v ? walk_v(w) : walk_k(w);
        if (ak->pool->dtype == DTYPE_BF16)
            return src;
        float f[MAX_HEAD_DIM];
        kv_row_to_f32(f, src, ak->pool->dtype, d, v ? ak->view->v_scale : ak->view->k_scale);
        gemm_amx_to_bf16(tmp, f, (size_t)d);
    } else {
        const size_t r = (size_t)(j - ak->n_cached) * ak->stride;
        gemm_amx_to_bf16(tmp, (v ? ak->v_new : ak->k_new) + r, (size_t)d);
    }
    return tmp;
}

/* The same keys for the tiles, in bf16 (the values the fp32 packing would
 * round to): K into kb as the scores' weight (column j, depth i), and,
 * unless vb is NULL, V into vb as the weighted sum's (column i, depth j);
 * gemm_amx's layout, everything past nb keys and d elements zero. */
static void attn_pack_block_bf16(uint16_t *kb, uint16_t *vb, const attn_keys_t *ak, int j0, int nb,
                                 int d) {
    static const uint16_t zeros[MAX_HEAD_DIM];
    const int d32 = gemm_amx_pad(d), nb32 = gemm_amx_pad(nb);
    uint16_t kt[MAX_HEAD_DIM], vt[2][MAX_HEAD_DIM];
    memset(kb, 0, gemm_amx_b_elems(nb, d) * sizeof *kb);
    if (vb)
        memset(vb, 0, gemm_amx_b_elems(d, nb) * sizeof *vb);
    kv_walk_t w = {0};
    if (j0 < ak->n_cached)
        w = walk_at(ak->pool, ak->view->blocks, j0);
    /* Keys two at a time: a pair of keys is one depth row of V's panels. */
    for (int j = 0; j < nb; j += 2) {
        const uint16_t *v[2] = {zeros, zeros};
        for (int h = 0; h < 2 && j + h < nb; h++) {
            /* K's column j + h: its pairs of elements 32 apart. */
            const uint16_t *k = attn_row_bf16(kt, ak, &w, j0 + j + h, 0, d);
            uint16_t *kcol = kb + gemm_amx_b_at(j + h, 0, d32);
            for (int i = 0; i < d; i += 2)
                memcpy(kcol + i * 16, k + i, (size_t)(d - i < 2 ? 1 : 2) * sizeof *k);
            if (vb)
                v[h] = attn_row_bf16(vt[h], ak, &w, j0 + j + h, 1, d);
            if (j0 + j + h < ak->n_cached)
                walk_next(&w);
        }
        /* V's depth row j / 2 of each panel of 16 columns: the two keys' elements side by
         * side. */
        for (int c = 0; vb && c < d; c += GEMM_PANEL) {
            uint16_t *row =
                vb + (size_t)(c / GEMM_PANEL) * nb32 * GEMM_PANEL + (size_t)(j / 2) * 32;
            const int n = d - c < GEMM_PANEL ? d - c : GEMM_PANEL;
            for (int t = 0; t < n; t++) {
                row[2 * t] = v[0][c + t];
                row[2 * t + 1] = v[1][c + t];
            }
        }
    }
}

/* Scores of rows [r0, r0 + rows) of a group against the block packed in b:
 * s[r][j] = scale * (q_r . k_j) (+ bias(r, j), key j's bias for the row at
 * bias[r * bias_row + j] where bias is not NULL), ATTN_CHUNK floats a row,
 * and each row's largest into row_max[r] where it is not NULL; on the
 * tiles, from the group's rounded Q (b->qb). */
static void attn_tile_scores(const attn_tile_buf_t *b, const float *q, size_t ldq, int r0, int rows,
                             int nb, int d, float scale, const float *bias, ptrdiff_t bias_row,
                             float *row_max) {
    float *s = b->s;
    if (b->amx) {
        gemm_amx_store(rows, nb, d, b->qb + (size_t)r0 * gemm_amx_pad(d), b->kb, s, ATTN_CHUNK);
    } else {
        for (int r = 0; r < rows; r++)
            memset(s + (size_t)r * ATTN_CHUNK, 0, (size_t)nb * sizeof(float));
        gemm_packed(rows, nb, d, q + (size_t)r0 * ldq, (int)ldq, b->kp, DTYPE_F32, s, ATTN_CHUNK);
    }
    for (int r = 0; r < rows; r++) {
        const float m = vec_scale_add_max(s + (size_t)r * ATTN_CHUNK, (size_t)nb, scale,
                                          bias ? bias + (r0 + r) * bias_row : NULL);
        if (row_max)
            row_max[r] = m;
    }
}

/* Keys [j0, j0 + nb) of ak packed into b for the group's GEMMs (V too
 * unless k_only). */
static void attn_pack(const attn_tile_buf_t *b, const attn_keys_t *ak, int j0, int nb, int d,
                      int k_only) {
    if (b->amx)
        attn_pack_block_bf16(b->kb, k_only ? NULL : b->vb, ak, j0, nb, d);
    else
        attn_pack_block(b->kp, k_only ? NULL : b->vp, ak, j0, nb, d);
}

/* Rows [0, rows) (rows <= attn_group_rows(d)) of a pair (query and output
 * rows ldq floats apart) against every key of ak: the online softmax over
 * blocks, as above. With mass, each key's probability summed over the rows
 * is added to mass[j] in a second pass, once the softmax's max m and sum l
 * are final: p_j = exp(s_j - m) / l, exactly what weighted the values (on
 * the tiles, where the weights are rounded to bf16, exp is vec_exp5, which
 * the sum l was made of, and p_j the weight before its rounding). bias, as
 * attn_tile_scores', for row 0 (NULL: none); bias_row also steps between
 * rows. */
static void attend_group(const attn_tile_buf_t *b, float *out, const float *q, size_t ldq, int rows,
                         const attn_keys_t *ak, int d, float scale, const float *bias,
                         ptrdiff_t bias_row, float *mass) {
    const int dp = round_panel(d);
    float m[ATTN_GROUP_TILES * ATTN_Q_TILE];
    double l[ATTN_GROUP_TILES * ATTN_Q_TILE];
    assert(rows <= attn_group_rows(d) && attn_group_rows(d) <= ATTN_GROUP_TILES * ATTN_Q_TILE);
    for (int r = 0; r < rows; r++) {
        m[r] = -INFINITY, l[r] = 0;
        memset(b->o + (size_t)r * dp, 0, (size_t)dp * sizeof(float));
    }
    if (b->amx)
        gemm_amx_round(b->qb, q, (int)ldq, rows, d, 0, gemm_amx_pad(rows));
    for (int j0 = 0; j0 < ak->n_keys; j0 += ATTN_CHUNK) {
        const int nb = ak->n_keys - j0 < ATTN_CHUNK ? ak->n_keys - j0 : ATTN_CHUNK;
        attn_pack(b, ak, j0, nb, d, 0);
        for (int t0 = 0; t0 < rows; t0 += ATTN_Q_TILE) {
            const int tr = rows - t0 < ATTN_Q_TILE ? rows - t0 : ATTN_Q_TILE;
            float *o = b->o + (size_t)t0 * dp;
            float tile_max[ATTN_Q_TILE];
            attn_tile_scores(b, q, ldq, t0, tr, nb, d, scale, bias ? bias + j0 : NULL, bias_row,
                             tile_max);
            const int nbp = gemm_amx_pad(nb);
            for (int r = 0; r < tr; r++) {
                float *sr = b->s + (size_t)r * ATTN_CHUNK;
                const float cm = tile_max[r];
                if (cm > m[t0 + r]) {
                    const float rescale = expf(m[t0 + r] - cm); /* 0 on the first block */
                    float *orow = o + (size_t)r * dp;
                    l[t0 + r] *= rescale;
                    for (int i = 0; i < d; i++)
                        orow[i] *= rescale;
                    m[t0 + r] = cm;
                }
                if (!b->amx) {
                    l[t0 + r] += vec_exp_shift_sum(sr, (size_t)nb, m[t0 + r]);
                    continue;
                }
                /* On the tiles the weights go to bf16 while the row is in cache. */
                uint16_t *pr = b->pb + (size_t)r * nbp;
                l[t0 + r] += vec_exp5_shift_sum(sr, (size_t)nb, m[t0 + r]);
                gemm_amx_to_bf16(pr, sr, (size_t)nb);
                memset(pr + nb, 0, (size_t)(nbp - nb) * sizeof *pr);
            }
            if (b->amx) {
                memset(b->pb + (size_t)tr * nbp, 0,
                       (size_t)(gemm_amx_pad(tr) - tr) * nbp * sizeof *b->pb);
                gemm_amx(tr, dp, nb, b->pb, b->vb, o, dp);
            } else {
                gemm_packed(tr, dp, nb, b->s, ATTN_CHUNK, b->vp, DTYPE_F32, o, dp);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        const float inv = l[r] > 0 ? (float)(1.0 / l[r]) : 0.0f;
        for (int i = 0; i < d; i++)
            out[(size_t)r * ldq + i] = b->o[(size_t)r * dp + i] * inv;
    }
    for (int j0 = 0; mass && j0 < ak->n_keys; j0 += ATTN_CHUNK) {
        const int nb = ak->n_keys - j0 < ATTN_CHUNK ? ak->n_keys - j0 : ATTN_CHUNK;
        attn_pack(b, ak, j0, nb, d, 1);
        for (int t0 = 0; t0 < rows; t0 += ATTN_Q_TILE) {
            const int tr = rows - t0 < ATTN_Q_TILE ? rows - t0 : ATTN_Q_TILE;
            attn_tile_scores(b, q, ldq, t0, tr, nb, d, scale, bias ? bias + j0 : NULL, bias_row,
                             NULL);
            for (int r = 0; r < tr; r++)
                for (int j = 0; j < nb; j++) {
                    /* the exponential the sum l was made of */
                    const float sj = b->s[(size_t)r * ATTN_CHUNK + j];
                    const double e =
                        b->amx ? (double)vec_exp5(sj - m[t0 + r]) : exp((double)sj - m[t0 + r]);
                    mass[j0 + j] += (float)(e / l[t0 + r]);
                }
        }
    }
}

/* The work items of a tiled attention over n_pairs (sequence, head) pairs
 * of n_rows(pair) query rows: one per group of a pair, or one per pair where
 * a pair's key mass is summed (its groups on one thread, in order). */
static int attn_groups(int n_rows, int per_pair, int group) {
    return per_pair ? 1 : (n_rows + group - 1) / group;
}

static void cpu_attention_scale(backend_t *be, float *out, const float *q, const float *k_new,
                                const float *v_new, const kv_blocks_t *pool,
                                const attn_batch_t *batch, int n_heads, float scale) {
    const int head_dim = pool->head_dim, group = attn_group_rows(head_dim);
    assert(batch->n_seq >= 0 && n_heads >= 0 && head_dim > 0 && head_dim <= MAX_HEAD_DIM);
    const int n_pairs = batch->n_seq * n_heads, *q_start = batch->q_start;
    const int whole = batch->mass != NULL;
    const size_t row = (size_t)n_heads * head_dim;
    int64_t work = 0;
    int max_groups = 0;
    for (int i = 0; i < n_pairs; i++) {
        const int n_new = q_start[i / n_heads + 1] - q_start[i / n_heads];
        const int groups = attn_groups(n_new, whole, group);
        work += (int64_t)n_new * (batch->kv[i].len + n_new);
        max_groups = groups > max_groups ? groups : max_groups;
    }
    const int n_items = n_pairs * max_groups;
#pragma omp parallel for num_threads(                                                              \
    attn_tile_team(be, head_dim)) if (work * head_dim >= PAR_MIN_WORK) schedule(dynamic, 1)
    for (int it = 0; it < n_items; it++) {
        const int i = it / max_groups, t = it % max_groups, s = i / n_heads, h = i % n_heads;
        const int n_new = q_start[s + 1] - q_start[s];
        if (t >= attn_groups(n_new, whole, group))
            continue;
        const size_t head = (size_t)q_start[s] * row + (size_t)h * head_dim;
        const attn_keys_t ak = {pool,
                                &batch->kv[i],
                                batch->kv[i].len,
                                batch->kv[i].len + n_new,
                                k_new + head,
                                v_new + head,
                                row};
        const attn_tile_buf_t b = attn_tile_buffers(be, head_dim);
        /* With mass arrays, an item is a whole pair (attn_groups), whether
         * or not this pair has one. */
        float *mass = batch->mass ? batch->mass[i] : NULL;
        const int r_end = whole || (t + 1) * group >= n_new ? n_new : (t + 1) * group;
        for (int r0 = whole ? 0 : t * group; r0 < r_end; r0 += group) {
            const int rows = r_end - r0 < group ? r_end - r0 : group;
            const size_t at = head + (size_t)r0 * row;
            attend_group(&b, out + at, q + at, row, rows, &ak, head_dim, scale, NULL, 0, mass);
        }
    }
}

static void cpu_attention_dense(backend_t *be, float *out, const float *q, const float *k,
                                const float *v, int kv_stride, const int *q_start,
                                const int *k_start, int n_seq, int n_heads, int head_dim,
                                float scale, const float *bias, int bias_span) {
    assert(n_seq >= 0 && n_heads > 0 && head_dim > 0 && head_dim <= MAX_HEAD_DIM);
    const int group = attn_group_rows(head_dim);
    const size_t row = (size_t)n_heads * head_dim;
    int64_t work = 0;
    int max_groups = 0;
    for (int s = 0; s < n_seq; s++) {
        const int n_rows = q_start[s + 1] - q_start[s], groups = attn_groups(n_rows, 0, group);
        work += (int64_t)n_rows * (k_start[s + 1] - k_start[s]);
        max_groups = groups > max_groups ? groups : max_groups;
    }
    const int n_items = n_seq * n_heads * max_groups;
#pragma omp parallel for num_threads(attn_tile_team(be, head_dim)) if (work * row >= PAR_MIN_WORK) \
    schedule(dynamic, 1)
    for (int it = 0; it < n_items; it++) {
        const int i = it / max_groups, t = it % max_groups, s = i / n_heads, h = i % n_heads;
        const int r0 = t * group, n_rows = q_start[s + 1] - q_start[s];
        if (r0 >= n_rows)
            continue;
        const int rows = n_rows - r0 < group ? n_rows - r0 : group;
        const int nk = k_start[s + 1] - k_start[s];
        const size_t kv_at = (size_t)k_start[s] * kv_stride + (size_t)h * head_dim;
        const attn_keys_t ak = {NULL, NULL, 0, nk, k + kv_at, v + kv_at, (size_t)kv_stride};
        /* Key j's bias for row qi is at (j - qi) + span - 1: the row's biases start there. */
        const float *b =
            bias ? bias + (size_t)h * (2 * bias_span - 1) + (bias_span - 1 - r0) : NULL;
        assert(!bias || (n_rows <= bias_span && nk <= bias_span));
        const size_t at = ((size_t)q_start[s] + (size_t)r0) * row + (size_t)h * head_dim;
        const attn_tile_buf_t bufs = attn_tile_buffers(be, head_dim);
        attend_group(&bufs, out + at, q + at, row, rows, &ak, head_dim, scale, b, -1, NULL);
    }
}

/* Forward copies: keep is strictly ascending, so keep[i] >= i and the row
 * read at step i has not been overwritten by an earlier step. */
static void cpu_kv_gather(backend_t *be, const kv_blocks_t *pool, const int *blocks,
                          const int *keep, int n_keep, float *mass) {
    assert(n_keep >= 0 && pool->block_tokens > 0 && pool->head_dim > 0);
    const size_t bytes = (size_t)pool->head_dim * dtype_size(pool->dtype);
    kv_walk_t dst = walk_at(pool, blocks, 0);
    for (int i = 0; i < n_keep; i++, walk_next(&dst)) {
        assert(keep[i] >= i && (i == 0 || keep[i] > keep[i - 1]));
        if (keep[i] == i)
            continue;
        const kv_walk_t src = walk_at(pool, blocks, keep[i]);
        memcpy(walk_k(&dst), walk_k(&src), bytes);
        memcpy(walk_v(&dst), walk_v(&src), bytes);
        if (mass)
            mass[i] = mass[keep[i]];
    }
}

static void cpu_kv_read_rows(backend_t *be, float *out, const kv_blocks_t *pool,
                             const kv_view_t *view, int j0, int n, int values) {
    assert(j0 >= 0 && n >= 0 && j0 + n <= view->len);
    kv_walk_t w = walk_at(pool, view->blocks, j0);
    for (int j = 0; j < n; j++, walk_next(&w))
        kv_row_to_f32(out + (size_t)j * pool->head_dim, values ? walk_v(&w) : walk_k(&w),
                      pool->dtype, pool->head_dim, values ? view->v_scale : view->k_scale);
}

/* ---- element-wise ------------------------------------------------------ */

/* Element-wise ops over the team: thread t takes the t-th of equal
 * slices, each a whole number of cache lines. */
static void cpu_silu_mul(backend_t *be, float *out, const float *gate, const float *up, size_t n) {
#pragma omp parallel num_threads(team(be)) if (n >= PAR_MIN_WORK)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const size_t lo = (size_t)split_at((int64_t)n, t, nt, 16);
        vec_silu_mul(out + lo, gate + lo, up + lo,
                     (size_t)split_at((int64_t)n, t + 1, nt, 16) - lo);
    }
}

static void cpu_silu(backend_t *be, float *x, size_t n) {
#pragma omp parallel num_threads(team(be)) if (n >= PAR_MIN_WORK)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const size_t lo = (size_t)split_at((int64_t)n, t, nt, 16);
        vec_silu(x + lo, (size_t)split_at((int64_t)n, t + 1, nt, 16) - lo);
    }
}

static void cpu_gelu(backend_t *be, float *x, size_t n) {
    const float inv_sqrt2 = 0.70710678118654752f;
#pragma omp parallel for num_threads(team(be)) if (n >= PAR_MIN_WORK)
    for (size_t i = 0; i < n; i++)
        x[i] = 0.5f * x[i] * (1.0f + erff(x[i] * inv_sqrt2));
}

static void cpu_gelu_tanh(backend_t *be, float *x, size_t n) {
    const size_t slice = 16384, n_slices = (n + slice - 1) / slice;
#pragma omp parallel for num_threads(team(be)) if (n >= PAR_MIN_WORK)
    for (size_t s = 0; s < n_slices; s++)
        vec_gelu_tanh(x + s * slice, n - s * slice < slice ? n - s * slice : slice);
}

/* Mean and variance in double, as a reference should. */
static void cpu_layernorm(backend_t *be, float *y, const float *x, int rows, int dim, float eps) {
    assert(rows >= 0 && dim > 0);
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * dim >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        float *yr = y + (size_t)r * dim;
        /* in double, over the vector lanes' partial sums */
        const double mean = vec_sum_f64(xr, (size_t)dim) / dim;
        const double sq = vec_sq_dev_f64(xr, (size_t)dim, mean);
        const float inv = (float)(1.0 / sqrt(sq / dim + eps)), mu = (float)mean;
        for (int i = 0; i < dim; i++)
            yr[i] = (xr[i] - mu) * inv;
    }
}

static void cpu_modulate(backend_t *be, float *y, const float *x, const float *scale,
                         const float *shift, int rows, int dim) {
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * dim >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < dim; i++) {
            const size_t at = (size_t)r * dim + i;
            y[at] = x[at] * (1.0f + scale[i]) + shift[i];
        }
}

static void cpu_gate_add(backend_t *be, float *y, const float *a, const float *gate, int rows,
                         int dim) {
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * dim >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++)
        for (int i = 0; i < dim; i++) {
            const size_t at = (size_t)r * dim + i;
            y[at] += a[at] * gate[i];
        }
}

static void cpu_l2norm_heads(backend_t *be, float *x, const float *mul, int rows, int n_heads,
                             int head_dim) {
    const int n = rows * n_heads;
#pragma omp parallel for num_threads(team(be)) if ((int64_t)n * head_dim >= PAR_MIN_WORK)
    for (int i = 0; i < n; i++) {
        float *xi = x + (size_t)i * head_dim;
        const double ss = vec_sq_dev_f64(xi, (size_t)head_dim, 0.0);
        const float norm = fmaxf((float)sqrt(ss), 1e-12f);
        const float m = mul ? mul[i % n_heads] : 1.0f;
        for (int d = 0; d < head_dim; d++)
            xi[d] = xi[d] / norm * m;
    }
}

static void cpu_add(backend_t *be, float *y, const float *a, size_t n) {
#pragma omp parallel for num_threads(team(be)) if (n >= PAR_MIN_WORK)
    for (size_t i = 0; i < n; i++)
        y[i] += a[i];
}

static void cpu_mul(backend_t *be, float *y, const float *a, size_t n) {
#pragma omp parallel for num_threads(team(be)) if (n >= PAR_MIN_WORK)
    for (size_t i = 0; i < n; i++)
        y[i] *= a[i];
}

static void cpu_scale(backend_t *be, float *x, size_t n, float s) {
#pragma omp parallel for num_threads(team(be)) if (n >= PAR_MIN_WORK)
    for (size_t i = 0; i < n; i++)
        x[i] *= s;
}

/* exp(x - max) / sum; a row of only -inf becomes NaN, as in torch. */
static void cpu_softmax(backend_t *be, float *x, int rows, int cols) {
    assert(rows >= 0 && cols > 0);
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * cols >= PAR_MIN_WORK)
    for (int r = 0; r < rows; r++) {
        float *xr = x + (size_t)r * cols;
        float m = xr[0];
        for (int i = 1; i < cols; i++)
            m = xr[i] > m ? xr[i] : m;
        double sum = 0;
        for (int i = 0; i < cols; i++) {
            xr[i] = expf(xr[i] - m);
            sum += xr[i];
        }
        const float inv = (float)(1.0 / sum);
        for (int i = 0; i < cols; i++)
            xr[i] *= inv;
    }
}

/* Like torch F.normalize: x / max(||x||_2, 1e-12), the norm summed in double. */
static void cpu_embedding(backend_t *be, float *out, const tensor_t *table, const int *ids, int n,
                          int l2_normalize) {
    assert(table->ndim == 2 && table->layout == LAYOUT_PLAIN && n >= 0);
    const size_t dim = (size_t)table->shape[1], esize = dtype_size(table->dtype);
    for (int i = 0; i < n; i++) {
        assert(ids[i] >= 0 && ids[i] < table->shape[0]);
        float *o = out + (size_t)i * dim;
        dtype_to_f32(o, (const char *)table->data + (size_t)ids[i] * dim * esize, table->dtype,
                     dim);
        if (l2_normalize) {
            double ss = 0;
            for (size_t j = 0; j < dim; j++)
                ss += (double)o[j] * o[j];
            const float norm = fmaxf((float)sqrt(ss), 1e-12f);
            for (size_t j = 0; j < dim; j++)
                o[j] /= norm;
        }
    }
}

/* ---- image ops --------------------------------------------------------- */

/* Packs the im2col columns of output pixels [p0, p0 + n) (flattened over
 * ho x wo) as panels (gemm_packed.h's layout, K = c_in * k * k): row r = (ci*k + ky)*k + kx of
 * pixel (oy, ox) holds input (ci, oy + ky - pad, ox + kx - pad), 0 outside the image, and columns
 * past n are 0. */
static void im2col_panels(float *bp, const float *in, int c_in, int h, int w, int k, int pad,
                          int wo, int64_t p0, int n) {
    const int kk = c_in * k * k;
    for (int q = 0; q * GEMM_PANEL < n; q++) {
        float *dst = bp + (size_t)q * kk * GEMM_PANEL; /* row r at dst + r * GEMM_PANEL */
        const int64_t first = p0 + (int64_t)q * GEMM_PANEL;
        const int cols = n - q * GEMM_PANEL < GEMM_PANEL ? n - q * GEMM_PANEL : GEMM_PANEL;
        const int oy0 = (int)(first / wo), ox0 = (int)(first % wo);
        /* The panel's pixels share an output row: each row of the panel is
         * a run of the input's row, copied whole where it lies inside. */
        const int one_row = cols == GEMM_PANEL && ox0 + GEMM_PANEL <= wo;
        for (int ci = 0; ci < c_in; ci++) {
            const float *plane = in + (size_t)ci * h * w;
            for (int ky = 0; ky < k; ky++)
                for (int kx = 0; kx < k; kx++, dst += GEMM_PANEL) {
                    const int ix0 = ox0 + kx - pad;
                    if (one_row) {
                        const int iy = oy0 + ky - pad;
                        if (iy < 0 || iy >= h) {
                            memset(dst, 0, GEMM_PANEL * sizeof(float));
                            continue;
                        }
                        const float *src = plane + (size_t)iy * w;
                        if (ix0 >= 0 && ix0 + GEMM_PANEL <= w) {
                            memcpy(dst, src + ix0, GEMM_PANEL * sizeof(float));
                            continue;
                        }
                        for (int j = 0; j < GEMM_PANEL; j++)
                            dst[j] = ix0 + j >= 0 && ix0 + j < w ? src[ix0 + j] : 0.0f;
                        continue;
                    }
                    int oy = oy0, ox = ox0;
                    for (int j = 0; j < GEMM_PANEL; j++) {
                        const int iy = oy + ky - pad, ix = ox + kx - pad;
                        dst[j] = j < cols && iy >= 0 && iy < h && ix >= 0 && ix < w
                                     ? plane[(size_t)iy * w + ix]
                                     : 0.0f;
                        if (++ox == wo) {
                            ox = 0;
                            oy++;
                        }
                    }
                }
        }
    }
}

/* Output pixels a conv2d tile packs and multiplies at most: two AVX-512
 * tiles of gemm_packed, fewer where c_in * k * k is large, so that a tile's
 * panels stay within about 256 KiB (a core's L2). */
#define CONV_TILE_PANELS 6
#define CONV_TILE_BUDGET_FLOATS ((size_t)1 << 16)

/* Threads of a team of nt that each take a share of `share` floats of the
 * scratch: as many as fit, and no more than the items they split. */
static int scratch_team(int nt, size_t share, int64_t items) {
    assert(share <= SCRATCH_FLOATS);
    if ((size_t)nt * share > SCRATCH_FLOATS)
        nt = (int)(SCRATCH_FLOATS / share);
    return nt > items ? (int)items : nt;
}

/* conv2d over transformed kernels (conv_transform): the output's tiles go
 * in blocks to the team, each thread transforming, multiplying and
 * transforming back its blocks in its share of the scratch. Blocks are cut
 * evenly for the team in whole panels (a 24 x 24 image has 144 tiles) and
 * made smaller where the team's shares would not fit the scratch. */
static void conv2d_winograd(backend_t *be, float *out, const float *in, const tensor_t *w,
                            const float *bias, int c_in, int h, int w_, int pad) {
    const int c_out = (int)w->shape[0];
    const int ho = h + 2 * pad - 2, wo = w_ + 2 * pad - 2;
    const int64_t tiles = winograd_tiles(ho, wo);
    const int bf16 = w->aux && be->cpu_activations == CPU_ACTIVATIONS_BF16 && gemm_amx_usable();
    const int most = bf16 ? WINOGRAD_BLOCK_TILES_BF16 : WINOGRAD_BLOCK_TILES;
    int nt = (int64_t)c_out * c_in * ho * wo * 9 >= GEMM_PAR_MIN_WORK ? team(be) : 1;
    int64_t per = (tiles + nt - 1) / nt;
    per = (per + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
    int block = per < most ? (int)per : most;
    while (block > GEMM_PANEL &&
           (size_t)nt * winograd_scratch_floats(c_in, c_out, block) > SCRATCH_FLOATS)
        block -= GEMM_PANEL;
    const size_t share = winograd_scratch_floats(c_in, c_out, block);
    const int64_t n_blocks = (tiles + block - 1) / block;
    nt = scratch_team(nt, share, n_blocks);
    float *scratch = ((cpu_impl_t *)be->impl)->scratch;
#pragma omp parallel num_threads(nt)
    {
        float *mine = scratch + (size_t)omp_get_thread_num() * share;
#pragma omp for schedule(static)
        for (int64_t b = 0; b < n_blocks; b++) {
            const int64_t t0 = b * block;
            const int n = (int)(tiles - t0 < block ? tiles - t0 : block);
            if (bf16)
                winograd_conv3x3_bf16(out, in, w->aux, bias, c_in, c_out, h, w_, pad, t0, n, mine);
            else
                winograd_conv3x3(out, in, w->data, bias, c_in, c_out, h, w_, pad, t0, n, mine);
        }
    }
}

/* out[co, p] = bias[co] + sum over (ci, ky, kx) of w[co, ci, ky, kx] *
 * in[ci, shifted p]. The output pixels go in tiles to the team; each
 * thread packs its tile's im2col panels in its share of the scratch and
 * multiplies them at once (gemm_packed, on the output started at the
 * bias), while they are in its cache. Transformed kernels go to
 * conv2d_winograd instead. */
static void cpu_conv2d(backend_t *be, float *out, const float *in, const tensor_t *w,
                       const tensor_t *bias, int c_in, int h, int w_, int pad) {
    assert(w->dtype == DTYPE_F32 && w->ndim == 4 && w->shape[1] == c_in);
    assert(w->shape[2] == w->shape[3] && pad >= 0 && h >= 0 && w_ >= 0);
    const int c_out = (int)w->shape[0], k = (int)w->shape[2];
    const int ho = h + 2 * pad - k + 1, wo = w_ + 2 * pad - k + 1;
    assert(!bias || (bias->dtype == DTYPE_F32 && tensor_numel(bias) == c_out));
    assert(ho >= 0 && wo >= 0);
    const int64_t npix = (int64_t)ho * wo;
    assert(npix <= INT32_MAX);
    if (c_out == 0 || npix == 0)
        return;
    const int kk = c_in * k * k;
    const float *b = bias ? bias->data : NULL;
    if (w->layout == LAYOUT_CONV) {
        assert(k == 3 && c_in > 0);
        conv2d_winograd(be, out, in, w, b, c_in, h, w_, pad);
        return;
    }
    if (kk == 0) {
        for (int co = 0; co < c_out; co++)
            for (int64_t p = 0; p < npix; p++)
                out[(size_t)co * npix + p] = b ? b[co] : 0.0f;
        return;
    }
    const size_t panel_floats = (size_t)kk * GEMM_PANEL;
    int tile_panels = (int)(CONV_TILE_BUDGET_FLOATS / panel_floats);
    tile_panels = tile_panels < 1                  ? 1
                  : tile_panels > CONV_TILE_PANELS ? CONV_TILE_PANELS
                                                   : tile_panels;
    const int64_t tile_pix = (int64_t)tile_panels * GEMM_PANEL;
    const int64_t n_tiles = (npix + tile_pix - 1) / tile_pix;
    /* Each thread's share of the scratch holds one tile. */
    const size_t tile_floats = (size_t)tile_panels * panel_floats;
    const int nt = scratch_team((int64_t)c_out * npix * kk >= GEMM_PAR_MIN_WORK ? team(be) : 1,
                                tile_floats, n_tiles);
    float *scratch = ((cpu_impl_t *)be->impl)->scratch;
#pragma omp parallel num_threads(nt)
    {
        float *bp = scratch + (size_t)omp_get_thread_num() * tile_floats;
#pragma omp for schedule(static)
        for (int64_t t = 0; t < n_tiles; t++) {
            const int64_t p0 = t * tile_pix;
            const int n = (int)(npix - p0 < tile_pix ? npix - p0 : tile_pix);
            im2col_panels(bp, in, c_in, h, w_, k, pad, wo, p0, n);
            for (int co = 0; co < c_out; co++) {
                float *o = out + (size_t)co * npix + p0;
                for (int j = 0; j < n; j++)
                    o[j] = b ? b[co] : 0.0f;
            }
            gemm_packed(c_out, n, kk, w->data, kk, bp, DTYPE_F32, out + p0, (int)npix);
        }
    }
}

/* Like torch GroupNorm: per group of c/groups channels, mean and biased
 * variance over (c/groups) * hw values (two passes in double), eps inside the
 * square root, then the per-channel affine. The statistics are folded into a
 * per-channel (scale, shift) pair, kept in the scratch panel so that nothing
 * is allocated here. */
static void cpu_groupnorm(backend_t *be, float *out, const float *in, const tensor_t *gamma,
                          const tensor_t *beta, int c, int hw, int groups, float eps, int silu) {
    assert(groups > 0 && c % groups == 0 && hw > 0);
    assert((size_t)c * 2 * sizeof(double) <= SCRATCH_FLOATS * sizeof(float));
    assert(gamma->dtype == DTYPE_F32 && tensor_numel(gamma) == c);
    assert(beta->dtype == DTYPE_F32 && tensor_numel(beta) == c);
    const int cpg = c / groups;
    const int64_t n = (int64_t)cpg * hw;
    const float *g = gamma->data, *b = beta->data;
    double *affine = ((cpu_impl_t *)be->impl)->scratch; /* scale, shift per channel */
    const int par = (int64_t)c * hw >= PAR_MIN_WORK;
#pragma omp parallel for num_threads(team(be)) if (par)
    for (int grp = 0; grp < groups; grp++) {
        const float *x = in + (size_t)grp * n;
        const double mean = vec_sum_f64(x, (size_t)n) / (double)n;
        const double sq = vec_sq_dev_f64(x, (size_t)n, mean);
        const double rstd = 1.0 / sqrt(sq / (double)n + eps);
        for (int ch = grp * cpg; ch < (grp + 1) * cpg; ch++) {
            affine[2 * ch] = rstd * g[ch];
            affine[2 * ch + 1] = b[ch] - mean * rstd * g[ch];
        }
    }
#pragma omp parallel for num_threads(team(be)) if (par)
    for (int ch = 0; ch < c; ch++) {
        vec_affine_f64(out + (size_t)ch * hw, in + (size_t)ch * hw, (size_t)hw, affine[2 * ch],
                       affine[2 * ch + 1], silu);
    }
}

static void cpu_upsample_nearest2x(backend_t *be, float *out, const float *in, int c, int h,
                                   int w) {
    assert(c >= 0 && h >= 0 && w >= 0);
    const int64_t rows = (int64_t)c * h;
#pragma omp parallel for num_threads(team(be)) if (rows * w * 4 >= PAR_MIN_WORK)
    for (int64_t r = 0; r < rows; r++) { /* input row r = ch * h + y */
        const float *src = in + (size_t)r * w;
        float *dst = out + (size_t)r * 4 * w; /* output rows 2y, 2y+1 of channel ch */
        for (int x = 0; x < w; x++)
            dst[2 * x] = dst[2 * x + 1] = src[x];
        memcpy(dst + 2 * w, dst, (size_t)2 * w * sizeof(float));
    }
}

/* Keys' cubic convolution coefficients (A = -0.75) for a sample at
 * fraction t past source index floor: weights of floor-1 .. floor+2. */
static void cubic_weights(float t, float w[4]) {
    const float A = -0.75f;
    const float x1 = t + 1.0f, x2 = 1.0f - t, x3 = 2.0f - t;
    w[0] = ((A * x1 - 5.0f * A) * x1 + 8.0f * A) * x1 - 4.0f * A;
    w[1] = ((A + 2.0f) * t - (A + 3.0f)) * t * t + 1.0f;
    w[2] = ((A + 2.0f) * x2 - (A + 3.0f)) * x2 * x2 + 1.0f;
    w[3] = ((A * x3 - 5.0f * A) * x3 + 8.0f * A) * x3 - 4.0f * A;
}

/* Source position of output index o (align_corners=False, not clamped for
 * cubic): its floor and fraction. */
static void cubic_source(int o, int in, int out, int *floor_, float *t) {
    const float real = (float)in / (float)out * ((float)o + 0.5f) - 0.5f;
    *floor_ = (int)floorf(real);
    *t = real - (float)*floor_;
}

static inline int clampi(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

static void cpu_resize_bicubic(backend_t *be, float *out, const float *in, int c, int h, int w,
                               int H, int W) {
#pragma omp parallel for num_threads(team(be)) if ((int64_t)c * H * W * 16 >= PAR_MIN_WORK)
    for (int ch = 0; ch < c; ch++)
        for (int oy = 0; oy < H; oy++) {
            int y0;
            float ty, wy[4];
            cubic_source(oy, h, H, &y0, &ty);
            cubic_weights(ty, wy);
            for (int ox = 0; ox < W; ox++) {
                int x0;
                float tx, wx[4], acc = 0;
                cubic_source(ox, w, W, &x0, &tx);
                cubic_weights(tx, wx);
                for (int i = 0; i < 4; i++) {
                    const float *r = in + ((size_t)ch * h + clampi(y0 - 1 + i, 0, h - 1)) * w;
                    float row = 0;
                    for (int j = 0; j < 4; j++)
                        row += r[clampi(x0 - 1 + j, 0, w - 1)] * wx[j];
                    acc += row * wy[i];
                }
                out[((size_t)ch * H + oy) * W + ox] = acc;
            }
        }
}

static void cpu_resize_area(backend_t *be, float *out, const float *in, int c, int h, int w, int H,
                            int W) {
#pragma omp parallel for num_threads(team(be)) if ((int64_t)c * h * w >= PAR_MIN_WORK)
    for (int ch = 0; ch < c; ch++)
        for (int oy = 0; oy < H; oy++) {
            const int y0 = (int)((int64_t)oy * h / H),
                      y1 = (int)(((int64_t)oy + 1) * h + H - 1) / H;
            for (int ox = 0; ox < W; ox++) {
                const int x0 = (int)((int64_t)ox * w / W),
                          x1 = (int)(((int64_t)ox + 1) * w + W - 1) / W;
                float sum = 0;
                for (int y = y0; y < y1; y++)
                    for (int x = x0; x < x1; x++)
                        sum += in[((size_t)ch * h + y) * w + x];
                out[((size_t)ch * H + oy) * W + ox] = sum / (float)((y1 - y0) * (x1 - x0));
            }
        }
}

/* In 32 x 32 tiles so both the reads and the writes stay in cache. */
static void cpu_transpose(backend_t *be, float *out, const float *in, int rows, int cols) {
    assert(rows >= 0 && cols >= 0 && (out != in || rows == 0 || cols == 0));
    enum { TILE = 32 };
    const int tiles = (rows + TILE - 1) / TILE;
#pragma omp parallel for num_threads(team(be)) if ((int64_t)rows * cols >= PAR_MIN_WORK)
    for (int t = 0; t < tiles; t++) {
        const int i0 = t * TILE, i1 = i0 + TILE < rows ? i0 + TILE : rows;
        for (int j0 = 0; j0 < cols; j0 += TILE) {
            const int j1 = j0 + TILE < cols ? j0 + TILE : cols;
            for (int i = i0; i < i1; i++)
                for (int j = j0; j < j1; j++)
                    out[(size_t)j * rows + i] = in[(size_t)i * cols + j];
        }
    }
}

/* ---- lifetime ---------------------------------------------------------- */

static void cpu_destroy(backend_t *be) {
    if (!be)
        return;
    cpu_impl_t *impl = be->impl;
    if (impl) {
        free(impl->scratch);
        free(impl->rounded);
    }
    free(impl);
    free(be);
}

/* Host memory is shared by every thread: a fork is a backend of its own
 * (its own scratch panel and team size) over the same weights. */
static backend_t *cpu_fork(backend_t *be, size_t bytes, int n_threads, ar_error_t *err) {
    backend_t *f = backend_cpu_create(n_threads > 0 ? n_threads : team(be), err);
    if (f) {
        f->batch_invariant = be->batch_invariant;
        f->activations = be->activations;
        f->cpu_activations = be->cpu_activations;
    }
    return f;
}

backend_t *backend_cpu_create(int n_threads, ar_error_t *err) {
    if (n_threads < 0) {
        ar_errorf(err, "cpu backend: n_threads must be 0 (all cores) or positive, not %d",
                  n_threads);
        return NULL;
    }
    backend_t *be = calloc(1, sizeof *be);
    cpu_impl_t *impl = calloc(1, sizeof *impl);
    void *scratch = cpu_alloc(NULL, SCRATCH_FLOATS * sizeof(float));
    if (!be || !impl || !scratch) {
        free(be);
        free(impl);
        free(scratch);
        ar_errorf(err, "cpu backend: out of memory");
        return NULL;
    }
    /* OpenBLAS runs single-threaded inside our OpenMP team, see gemm(). */
    openblas_set_num_threads(1);
    if (n_threads > 0)
        omp_set_num_threads(n_threads);
    /* Every threaded loop names its team size: omp_set_num_threads only
     * reaches the calling thread, and ops may run on another. */
    impl->n_threads = n_threads > 0 ? n_threads : omp_get_max_threads();
    impl->scratch = scratch;

    be->name = "cpu";
    be->impl = impl;
    be->alloc = cpu_alloc;
    be->free = cpu_free;
    be->upload = cpu_memcpy;
    be->download = cpu_memcpy;
    be->copy = cpu_memcpy;
    be->sync = cpu_sync;
    be->weight_load = cpu_weight_load;
    be->weight_free = cpu_weight_free;
    be->weight_prepare = cpu_weight_prepare;
    be->weight_load_8bit = cpu_weight_load_8bit;
    be->matmul = cpu_matmul;
    be->rmsnorm = cpu_rmsnorm;
    be->rope = cpu_rope;
    be->rope_2d = cpu_rope_2d;
    be->kv_append = cpu_kv_append;
    be->attention = cpu_attention;
    be->attention_scale = cpu_attention_scale;
    be->kv_gather = cpu_kv_gather;
    be->kv_read_rows = cpu_kv_read_rows;
    be->silu_mul = cpu_silu_mul;
    be->silu = cpu_silu;
    be->gelu = cpu_gelu;
    be->gelu_tanh = cpu_gelu_tanh;
    be->layernorm = cpu_layernorm;
    be->modulate = cpu_modulate;
    be->gate_add = cpu_gate_add;
    be->l2norm_heads = cpu_l2norm_heads;
    be->add = cpu_add;
    be->mul = cpu_mul;
    be->attention_dense = cpu_attention_dense;
    be->scale = cpu_scale;
    be->softmax = cpu_softmax;
    be->embedding = cpu_embedding;
    be->conv2d = cpu_conv2d;
    be->groupnorm = cpu_groupnorm;
    be->upsample_nearest2x = cpu_upsample_nearest2x;
    be->resize_bicubic = cpu_resize_bicubic;
    be->resize_area = cpu_resize_area;
    be->transpose = cpu_transpose;
    be->fork = cpu_fork;
    be->destroy = cpu_destroy;
    return be;
}
