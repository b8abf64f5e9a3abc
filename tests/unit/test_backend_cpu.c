/* Checks every op of the CPU backend against a naive reference written here
 * (plain loops, double accumulation) on fixed-seed random inputs of awkward
 * sizes, with NaN/Inf checks and guard floats around every output buffer. */
#include "engine/backend/backend.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/gemm_packed.h"
#include "kernels/cpu/vec_isa.h"
#include "tests/test.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static backend_t *be;

/* ---- random inputs ----------------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rng_next(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_next() >> 40) / 16777216.0);
}

static void fill_uniform(float *x, size_t n, float lo, float hi) {
    for (size_t i = 0; i < n; i++)
        x[i] = rng_uniform(lo, hi);
}

static float *host_uniform(size_t n, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    fill_uniform(x, n, lo, hi);
    return x;
}

/* ---- guarded backend buffers -------------------------------------------- */

/* GUARD floats of SENTINEL (a NaN no op computes) sit before and after the
 * n floats of every buffer; the n floats start as SENTINEL too, so an output
 * an op forgets to write reads as NaN. */
#define GUARD 16
#define SENTINEL 0x7fa5a5a5u

static float *dev_new(size_t n) {
    const size_t total = n + 2 * GUARD;
    float *base = be->alloc(be, total * sizeof(float));
    uint32_t *fill = malloc(total * sizeof *fill);
    for (size_t i = 0; i < total; i++)
        fill[i] = SENTINEL;
    be->upload(be, base, fill, total * sizeof(float));
    free(fill);
    return base + GUARD;
}

static float *dev_from(const float *host, size_t n) {
    float *d = dev_new(n);
    be->upload(be, d, host, n * sizeof(float));
    return d;
}

static float *dev_to_host(const float *d, size_t n) {
    float *h = malloc((n ? n : 1) * sizeof *h);
    be->download(be, h, d, n * sizeof(float));
    return h;
}

static int dev_guards_ok(const float *d, size_t n) {
    uint32_t g[2 * GUARD];
    be->download(be, g, d - GUARD, GUARD * sizeof(float));
    be->download(be, g + GUARD, d + n, GUARD * sizeof(float));
    for (int i = 0; i < 2 * GUARD; i++)
        if (g[i] != SENTINEL)
            return 0;
    return 1;
}

static void dev_del(float *d) { be->free(be, d - GUARD); }

static tensor_t weight_f32(const float *host, int ndim, int64_t d0, int64_t d1, int64_t d2,
                           int64_t d3) {
    const int64_t shape[4] = {d0, d1, d2, d3};
    tensor_t t;
    ar_error_t err = {{0}};
    int rc = be->weight_load(be, &t, host, DTYPE_F32, ndim, shape, &err);
    CHECK_MSG(rc == AR_OK, "weight_load: %s", err.msg);
    return t;
}

/* ---- comparison ----------------------------------------------------------- */

/* Every got[i] must be finite where ref is, and within abs_tol +
 * |ref|*rel_tol of ref[i]; reports the first few misses. */
static void check_close(const char *what, const float *got, const double *ref, size_t n,
                        double abs_tol, double rel_tol) {
    size_t bad = 0;
    double worst = 0;
    for (size_t i = 0; i < n; i++) {
        const double err = fabs((double)got[i] - ref[i]);
        int ok;
        if (isfinite(ref[i]))
            ok = isfinite(got[i]) && err <= abs_tol + fabs(ref[i]) * rel_tol;
        else /* an expected Inf must match in sign, an expected NaN be a NaN */
            ok = isnan(ref[i]) ? isnan(got[i]) : (double)got[i] == ref[i];
        if (isfinite(ref[i]) && isfinite(got[i]) && err > worst)
            worst = err;
        if (!ok && ++bad <= 3)
            fprintf(stderr, "  %s[%zu] = %.9g, expected %.9g\n", what, i, got[i], ref[i]);
    }
    CHECK_MSG(bad == 0, "%s: %zu of %zu values off (abs %.1e + rel %.1e); worst finite %.3g", what,
              bad, n, abs_tol, rel_tol, worst);
}

/* Downloads n outputs from d, checks its guards and compares with ref. */
static void check_dev(const char *what, const float *d, const double *ref, size_t n, double abs_tol,
                      double rel_tol) {
    float *got = dev_to_host(d, n);
    CHECK_MSG(dev_guards_ok(d, n), "%s: guard floats overwritten", what);
    check_close(what, got, ref, n, abs_tol, rel_tol);
    free(got);
}

static double *ref_new(size_t n) { return calloc(n ? n : 1, sizeof(double)); }

/* ---- memory and weights -------------------------------------------------- */

static void test_memory_roundtrip_and_alignment(void) {
    const size_t sizes[] = {0, 1, 7, 64, 1000, 4099};
    for (size_t s = 0; s < sizeof sizes / sizeof *sizes; s++) {
        const size_t n = sizes[s];
        unsigned char *a = be->alloc(be, n), *b = be->alloc(be, n);
        CHECK(a && b);
        CHECK(((uintptr_t)a & 63) == 0 && ((uintptr_t)b & 63) == 0);
        unsigned char *src = malloc(n + 1), *dst = malloc(n + 1);
        for (size_t i = 0; i < n; i++)
            src[i] = (unsigned char)rng_next();
        be->upload(be, a, src, n);
        be->copy(be, b, a, n);
        be->sync(be);
        be->download(be, dst, b, n);
        CHECK(n == 0 || memcmp(src, dst, n) == 0);
        free(src);
        free(dst);
        be->free(be, a);
        be->free(be, b);
    }
    be->free(be, NULL);
    CHECK(strcmp(be->name, "cpu") == 0);
}

static void test_create_rejects_negative_threads(void) {
    ar_error_t err = {{0}};
    CHECK(backend_cpu_create(-1, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "n_threads");
}

static void test_weight_load_f32_4d_from_unaligned_host(void) {
    enum { N = 3 * 5 * 2 * 7 };
    float src[N];
    fill_uniform(src, N, -3, 3);
    unsigned char *raw = malloc(N * 4 + 1); /* source one byte off alignment */
    memcpy(raw + 1, src, N * 4);
    const int64_t shape[4] = {3, 5, 2, 7};
    tensor_t t;
    ar_error_t err = {{0}};
    CHECK(be->weight_load(be, &t, raw + 1, DTYPE_F32, 4, shape, &err) == AR_OK);
    CHECK(t.dtype == DTYPE_F32 && t.ndim == 4 && tensor_numel(&t) == N);
    CHECK(t.shape[0] == 3 && t.shape[1] == 5 && t.shape[2] == 2 && t.shape[3] == 7);
    float got[N];
    be->download(be, got, t.data, sizeof got);
    CHECK(memcmp(got, src, sizeof got) == 0);
    be->weight_free(be, &t);
    CHECK(t.data == NULL);
    free(raw);
}

/* Decodes a binary float with e_bits exponent and m_bits mantissa bits the
 * textbook way, independently of dtype.h. */
static float decode_small_float(uint16_t h, int e_bits, int m_bits) {
    const int sign = h >> (e_bits + m_bits);
    const int e = (h >> m_bits) & ((1 << e_bits) - 1), m = h & ((1 << m_bits) - 1);
    const int bias = (1 << (e_bits - 1)) - 1;
    double v;
    if (e == (1 << e_bits) - 1)
        v = m ? NAN : INFINITY;
    else if (e == 0)
        v = ldexp((double)m, 1 - bias - m_bits);
    else
        v = ldexp(1.0 + ldexp((double)m, -m_bits), e - bias);
    return (float)(sign ? -v : v);
}

/* Loads every 16-bit pattern (twice over, plus 7, so the conversion is
 * split over threads with a ragged end) from an unaligned source, as a
 * vector (converted to fp32 at load) and as a [3, 43693] matrix (kept in
 * its type, read back through the embedding op, which converts), and
 * compares both with decode_small_float. */
static void check_weight_load_16bit(dtype_t dt, int e_bits, int m_bits) {
    enum { N = 3 * 43693 };
    unsigned char *raw = malloc(2 * N + 1);
    for (int i = 0; i < N; i++) {
        const uint16_t h = (uint16_t)i;
        memcpy(raw + 1 + 2 * i, &h, 2);
    }
    const int64_t shape[2] = {3, 43693}, flat[1] = {N};
    tensor_t t, m;
    ar_error_t err = {{0}};
    CHECK(be->weight_load(be, &t, raw + 1, dt, 1, flat, &err) == AR_OK);
    CHECK(t.dtype == DTYPE_F32 && t.ndim == 1 && t.shape[0] == N);
    CHECK(be->weight_load(be, &m, raw + 1, dt, 2, shape, &err) == AR_OK);
    CHECK(m.dtype == dt && m.ndim == 2 && m.shape[0] == 3 && m.shape[1] == 43693);
    float *got = malloc(N * sizeof *got), *rows = malloc(N * sizeof *rows);
    be->download(be, got, t.data, N * sizeof *got);
    be->embedding(be, rows, &m, (const int[]){0, 1, 2}, 3, 0);
    CHECK_MSG(!memcmp(got, rows, N * sizeof *got), "the %s matrix reads back other values",
              dtype_name(dt));
    int bad = 0;
    for (int i = 0; i < N; i++) {
        const float want = decode_small_float((uint16_t)i, e_bits, m_bits);
        const int ok = isnan(want) ? isnan(got[i]) : memcmp(&want, &got[i], 4) == 0;
        if (!ok && ++bad <= 3)
            fprintf(stderr, "  %s 0x%04x -> %.9g, expected %.9g\n", dtype_name(dt), i, got[i],
                    want);
    }
    CHECK_MSG(bad == 0, "%d of %d %s values converted wrongly", bad, N, dtype_name(dt));
    be->weight_free(be, &t);
    be->weight_free(be, &m);
    free(got);
    free(rows);
    free(raw);
}

static void test_weight_load_bf16_all_patterns(void) { check_weight_load_16bit(DTYPE_BF16, 8, 7); }

static void test_weight_load_f16_all_patterns(void) { check_weight_load_16bit(DTYPE_F16, 5, 10); }

static void test_weight_load_rejects_bad_dtype_and_shape(void) {
    const float data[8] = {0};
    const int64_t shape[5] = {2, 2, 2, 1, 1}, neg[2] = {2, -1}, huge[2] = {INT64_MAX / 2, 8};
    tensor_t t;
    ar_error_t err;
    const dtype_t ints[] = {DTYPE_I32, DTYPE_I64, DTYPE_U8};
    for (int i = 0; i < 3; i++) {
        err.msg[0] = 0;
        CHECK(be->weight_load(be, &t, data, ints[i], 1, shape, &err) == AR_ERR);
        CHECK(t.data == NULL);
        CHECK_STR_CONTAINS(err.msg, dtype_name(ints[i]));
    }
    err.msg[0] = 0;
    CHECK(be->weight_load(be, &t, data, DTYPE_F32, 0, shape, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "dimensions");
    err.msg[0] = 0;
    CHECK(be->weight_load(be, &t, data, DTYPE_F32, 5, shape, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "dimensions");
    err.msg[0] = 0;
    CHECK(be->weight_load(be, &t, data, DTYPE_F32, 2, neg, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "negative");
    err.msg[0] = 0;
    CHECK(be->weight_load(be, &t, data, DTYPE_F32, 2, huge, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "too large");
    CHECK(t.data == NULL);
    /* An empty weight is legal. */
    const int64_t empty[2] = {0, 4};
    CHECK(be->weight_load(be, &t, NULL, DTYPE_BF16, 2, empty, &err) == AR_OK);
    CHECK(tensor_numel(&t) == 0 && t.dtype == DTYPE_BF16); /* a matrix keeps its type */
    be->weight_free(be, &t);
}

/* ---- matmul ------------------------------------------------------------------ */

/* fp32 GEMM error grows with k: tolerance 1e-6 + 2e-7 k absolute, 1e-5
 * relative, for inputs in [-1, 1] (about 10x the worst case seen). The last
 * three are large enough to be split over threads: by output columns (one
 * row, and many rows) and by rows (n too narrow to split). */
static void test_matmul_with_and_without_bias(void) {
    const int cases[][3] = {{1, 1, 1},       {2, 3, 1},     {1, 37, 129},  {3, 7, 5},
                            {17, 13, 129},   {5, 31, 1000}, {0, 5, 3},     {64, 1, 67},
                            {1, 1000, 1100}, {33, 77, 500}, {300, 5, 1000}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int m = cases[c][0], n = cases[c][1], k = cases[c][2];
        float *x = host_uniform((size_t)m * k, -1, 1), *w = host_uniform((size_t)n * k, -1, 1);
        float *b = host_uniform((size_t)n, -1, 1);
        tensor_t tw = weight_f32(w, 2, n, k, 1, 1), tb = weight_f32(b, 1, n, 1, 1, 1);
        float *dx = dev_from(x, (size_t)m * k);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            float *dy = dev_new((size_t)m * n);
            be->matmul(be, dy, dx, &tw, with_bias ? &tb : NULL, m);
            double *ref = ref_new((size_t)m * n);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double s = with_bias ? b[j] : 0;
                    for (int l = 0; l < k; l++)
                        s += (double)x[i * k + l] * w[j * k + l];
                    ref[i * n + j] = s;
                }
            char what[64];
            snprintf(what, sizeof what, "matmul m=%d n=%d k=%d bias=%d", m, n, k, with_bias);
            check_dev(what, dy, ref, (size_t)m * n, 1e-6 + 2e-7 * k, 1e-5);
            free(ref);
            dev_del(dy);
        }
        dev_del(dx);
        be->weight_free(be, &tw);
        be->weight_free(be, &tb);
        free(x);
        free(w);
        free(b);
    }
}

/* 16-bit weights (bf16 and fp16, kept so by weight_load) give the sums of
 * the same weights converted to fp32: bit for bit at the decode-sized rows
 * that gemm_rows takes (2 to 128, the FMA order unchanged), within fp32
 * GEMM error at one row and at prefill sizes (converted chunks for
 * OpenBLAS), on every shape that splits over threads or has ragged ends. */
static void test_matmul_16bit_weights(void) {
    /* The last converts its rows in more than one chunk of the scratch panel. */
    const int cases[][3] = {{1, 37, 129},  {2, 3, 1},     {3, 37, 70},     {8, 1000, 257},
                            {128, 33, 48}, {129, 17, 65}, {300, 260, 100}, {130, 200, 24000}};
    const dtype_t types[] = {DTYPE_BF16, DTYPE_F16};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (size_t ti = 0; ti < 2; ti++) {
            const int m = cases[c][0], n = cases[c][1], k = cases[c][2];
            const dtype_t dt = types[ti];
            float *x = host_uniform((size_t)m * k, -1, 1), *w = host_uniform((size_t)n * k, -1, 1);
            uint16_t *h = malloc((size_t)n * k * sizeof *h);
            for (size_t i = 0; i < (size_t)n * k; i++) {
                /* fp16: w's sign and mantissa bits under exponents 2^-5 .. 2^0 */
                uint32_t u;
                memcpy(&u, &w[i], 4);
                h[i] = dt == DTYPE_BF16 ? f32_to_bf16(w[i])
                                        : (uint16_t)((u >> 16 & 0x8000u) | (10u + u % 6u) << 10 |
                                                     (u >> 13 & 0x3ffu));
                w[i] = dt == DTYPE_BF16 ? bf16_to_f32(h[i]) : f16_to_f32(h[i]);
            }
            const int64_t shape[2] = {n, k};
            tensor_t t16, t32 = weight_f32(w, 2, n, k, 1, 1);
            ar_error_t err = {{0}};
            CHECK_MSG(be->weight_load(be, &t16, h, dt, 2, shape, &err) == AR_OK, "%s", err.msg);
            CHECK(t16.dtype == dt);
            float *dx = dev_from(x, (size_t)m * k), *y16 = dev_new((size_t)m * n),
                  *y32 = dev_new((size_t)m * n);
            be->matmul(be, y16, dx, &t16, NULL, m);
            be->matmul(be, y32, dx, &t32, NULL, m);
            char what[80];
            snprintf(what, sizeof what, "%s matmul m=%d n=%d k=%d", dtype_name(dt), m, n, k);
            if (m >= 2 && m <= 128) {
                CHECK_MSG(!memcmp(y16, y32, (size_t)m * n * sizeof *y16),
                          "%s: not the fp32 sums bit for bit", what);
            } else {
                double *ref = ref_new((size_t)m * n);
                for (size_t i = 0; i < (size_t)m * n; i++)
                    ref[i] = y32[i];
                check_dev(what, y16, ref, (size_t)m * n, 1e-6 + 2e-7 * k, 1e-5);
                free(ref);
            }
            dev_del(dx);
            dev_del(y16);
            dev_del(y32);
            be->weight_free(be, &t16);
            be->weight_free(be, &t32);
            free(h);
            free(x);
            free(w);
        }
}

/* ---- transformer ops ----------------------------------------------------------- */

/* Tolerance 1e-5 abs + 1e-5 rel; rows scaled up to 1e3 and down to 1e-3. */
/* A model's Linear weights (weight_prepare: packed in panels): matmul
 * within fp32 GEMM error of a double reference with and without bias, in
 * fp32, bf16 and fp16, on shapes that split over threads by columns and by
 * rows (one panel); the same bytes on one thread and on two, and each row
 * the same bytes alone as among the others (an image does not depend on its
 * batch); no other op may read the packed weight. */
/* cpu_activations bf16: a bf16 Linear weight multiplies x rounded to bf16
 * (to nearest even), on one and two threads, through the AMX tiles where
 * the CPU has them (every row) and the fp32 kernels without: within fp32 summation's error of the
 * double sum over the rounded x, nothing written past y; an fp32 weight ignores the setting. The
 * f32 default does not round (the same sums, bit for bit, as fp32 x). */
static void test_matmul_bf16_activations(void) {
    ar_error_t err = {{0}};
    backend_t *one = backend_cpu_create(1, &err), *two = backend_cpu_create(2, &err);
    CHECK_MSG(one && two, "backend_cpu_create: %s", err.msg);
    if (!one || !two)
        return;
    one->cpu_activations = two->cpu_activations = CPU_ACTIVATIONS_BF16;
    const int cases[][3] = {
        {2, 37, 129}, {31, 40, 33}, {32, 64, 64}, {70, 100, 300}, {300, 17, 31}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int m = cases[c][0], n = cases[c][1], k = cases[c][2];
        float *x = host_uniform((size_t)m * k, -1, 1), *w = host_uniform((size_t)n * k, -1, 1);
        uint16_t *h = malloc((size_t)n * k * sizeof *h);
        for (size_t i = 0; i < (size_t)n * k; i++)
            h[i] = f32_to_bf16(w[i]);
        double *ref = ref_new((size_t)m * n), *mag = ref_new((size_t)m * n);
        for (int r = 0; r < m; r++)
            for (int j = 0; j < n; j++)
                for (int i = 0; i < k; i++) {
                    const double t = (double)bf16_to_f32(f32_to_bf16(x[(size_t)r * k + i])) *
                                     bf16_to_f32(h[(size_t)j * k + i]);
                    ref[(size_t)r * n + j] += t;
                    mag[(size_t)r * n + j] += fabs(t);
                }
        const int64_t shape[2] = {n, k};
        backend_t *bes[2] = {one, two};
        for (int t = 0; t < 2; t++) {
            backend_t *e = bes[t];
            tensor_t tw;
            CHECK(e->weight_load(e, &tw, h, DTYPE_BF16, 2, shape, &err) == AR_OK);
            CHECK(e->weight_prepare(e, &tw, LAYOUT_LINEAR, &err) == AR_OK);
            float *y = malloc(sizeof(float) * ((size_t)m * n + 1));
            y[(size_t)m * n] = 1e30f;
            e->matmul(e, y, x, &tw, NULL, m);
            CHECK(y[(size_t)m * n] == 1e30f);
            int bad = 0;
            for (size_t i = 0; i < (size_t)m * n; i++)
                bad += fabs(y[i] - ref[i]) > 1e-6 + (k + 2) * 6e-8 * mag[i];
            CHECK_MSG(bad == 0, "bf16 activations m=%d n=%d k=%d, %d threads: %d values off", m, n,
                      k, t + 1, bad);
            e->cpu_activations = CPU_ACTIVATIONS_F32; /* the default: x as it is */
            e->matmul(e, y, x, &tw, NULL, m);
            double worst = 0;
            for (size_t i = 0; i < (size_t)m * n; i++)
                worst = fmax(worst, fabs(y[i] - ref[i]));
            CHECK_MSG(worst > 1e-4, "f32 activations m=%d n=%d k=%d look rounded (%.3g)", m, n, k,
                      worst);
            e->cpu_activations = CPU_ACTIVATIONS_BF16;
            e->weight_free(e, &tw);
            free(y);
        }
        free(ref), free(mag), free(x), free(w), free(h);
    }
    printf("bf16 activations: %s\n",
           gemm_amx_usable() ? "AMX tiles, every row" : "no AMX here: the fp32 kernels");
    one->destroy(one);
    two->destroy(two);
}

/* weight_prepare's promise (backend.h) under cpu_activations bf16 too: a
 * row's bytes are the same whatever m, alone or as row r of 1 to 40 rows
 * (on AMX every row goes through the tiles; elsewhere through the fp32
 * kernels). */
static void test_matmul_bf16_activations_rows_independent(void) {
    ar_error_t err = {{0}};
    backend_t *cpu = backend_cpu_create(2, &err);
    CHECK_MSG(cpu, "backend_cpu_create: %s", err.msg);
    if (!cpu)
        return;
    cpu->cpu_activations = CPU_ACTIVATIONS_BF16;
    enum { M = 40, N = 50, K = 96 };
    float *x = host_uniform((size_t)M * K, -1, 1), *w = host_uniform((size_t)N * K, -1, 1);
    uint16_t *h = malloc((size_t)N * K * sizeof *h);
    for (size_t i = 0; i < (size_t)N * K; i++)
        h[i] = f32_to_bf16(w[i]);
    const int64_t shape[2] = {N, K};
    tensor_t tw;
    CHECK(cpu->weight_load(cpu, &tw, h, DTYPE_BF16, 2, shape, &err) == AR_OK);
    CHECK(cpu->weight_prepare(cpu, &tw, LAYOUT_LINEAR, &err) == AR_OK);
    float *all = malloc(sizeof(float) * M * N), *alone = malloc(sizeof(float) * N);
    static const int ms[] = {1, 2, 7, 8, 31, 32, 40};
    int differ = 0;
    for (size_t c = 0; c < sizeof ms / sizeof *ms; c++) {
        cpu->matmul(cpu, all, x, &tw, NULL, ms[c]);
        for (int r = 0; r < ms[c]; r++) {
            cpu->matmul(cpu, alone, x + (size_t)r * K, &tw, NULL, 1);
            if (memcmp(alone, all + (size_t)r * N, sizeof(float) * N) != 0) {
                if (!differ)
                    printf("  m=%d: row %d differs from the row alone\n", ms[c], r);
                differ++;
            }
        }
    }
    CHECK_MSG(differ == 0, "%d rows depend on the batch (%s)", differ,
              gemm_amx_usable() ? "AMX" : "no AMX");
    cpu->weight_free(cpu, &tw);
    free(x), free(w), free(h), free(all), free(alone);
    cpu->destroy(cpu);
}

static void test_matmul_linear_weights(void) {
    ar_error_t err = {{0}};
    backend_t *one = backend_cpu_create(1, &err), *two = backend_cpu_create(2, &err);
    CHECK_MSG(one && two, "backend_cpu_create: %s", err.msg);
    if (!one || !two)
        return;
    const int cases[][3] = {{1, 37, 129},  {2, 3, 1},    {16, 1000, 257},
                            {70, 16, 900}, {9, 77, 500}, {300, 130, 64}};
    const dtype_t types[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (size_t ti = 0; ti < 3; ti++) {
            const int m = cases[c][0], n = cases[c][1], k = cases[c][2];
            const dtype_t dt = types[ti];
            float *x = host_uniform((size_t)m * k, -1, 1), *w = host_uniform((size_t)n * k, -1, 1);
            float *b = host_uniform((size_t)n, -1, 1);
            uint16_t *h = malloc((size_t)n * k * sizeof *h);
            for (size_t i = 0; i < (size_t)n * k; i++) {
                h[i] = dt == DTYPE_F16 ? f32_to_f16(w[i]) : f32_to_bf16(w[i]);
                w[i] = dt == DTYPE_F32   ? w[i]
                       : dt == DTYPE_F16 ? f16_to_f32(h[i])
                                         : bf16_to_f32(h[i]);
            }
            const int64_t shape[2] = {n, k}, bshape[1] = {n};
            tensor_t tw[2], tb[2];
            float *y[2];
            backend_t *bes[2] = {one, two};
            for (int t = 0; t < 2; t++) {
                backend_t *e = bes[t];
                CHECK(e->weight_load(e, &tw[t], dt == DTYPE_F32 ? (const void *)w : h, dt, 2, shape,
                                     &err) == AR_OK);
                CHECK(e->weight_load(e, &tb[t], b, DTYPE_F32, 1, bshape, &err) == AR_OK);
                CHECK(tw[t].layout == LAYOUT_PLAIN);
                CHECK_MSG(e->weight_prepare(e, &tw[t], LAYOUT_LINEAR, &err) == AR_OK, "%s",
                          err.msg);
                CHECK(tw[t].layout == LAYOUT_LINEAR && tw[t].dtype == dt && tw[t].shape[0] == n);
                y[t] = malloc(sizeof(float) * ((size_t)m * n + 1));
                y[t][(size_t)m * n] = 1e30f; /* past the end: never written */
                e->matmul(e, y[t], x, &tw[t], &tb[t], m);
                CHECK(y[t][(size_t)m * n] == 1e30f);
            }
            double *ref = ref_new((size_t)m * n);
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double sum = b[j];
                    for (int l = 0; l < k; l++)
                        sum += (double)x[(size_t)i * k + l] * w[(size_t)j * k + l];
                    ref[(size_t)i * n + j] = sum;
                }
            char what[80];
            snprintf(what, sizeof what, "%s linear matmul m=%d n=%d k=%d", dtype_name(dt), m, n, k);
            check_close(what, y[1], ref, (size_t)m * n, 1e-6 + 2e-7 * k, 1e-5);
            CHECK_MSG(!memcmp(y[0], y[1], sizeof(float) * (size_t)m * n),
                      "%s: one thread and two differ", what);
            float *alone = malloc(sizeof(float) * (size_t)n);
            int differ = 0;
            for (int i = 0; i<m; i += m> 8 ? m / 5 : 1) {
                two->matmul(two, alone, x + (size_t)i * k, &tw[1], &tb[1], 1);
                differ += memcmp(alone, y[1] + (size_t)i * n, sizeof(float) * (size_t)n) != 0;
            }
            CHECK_MSG(differ == 0, "%s: %d rows differ alone", what, differ);
            for (int t = 0; t < 2; t++) {
                bes[t]->weight_free(bes[t], &tw[t]);
                bes[t]->weight_free(bes[t], &tb[t]);
                free(y[t]);
            }
            free(alone), free(ref), free(x), free(w), free(b), free(h);
        }
    one->destroy(one);
    two->destroy(two);
}

/* 8-bit Linear weights (weight_load_8bit, then packed), plain and stacked,
 * with a bias: each matrix's rows the bytes of gemm_packed_scaled over it
 * (the kernel's own definition, tests/unit/test_gemm_packed.c), on one
 * thread and two, and within fp32 rounding of a double-precision product
 * with the weights' values; refused: a float type, a non-finite scale,
 * missing scales. */
static void test_matmul_8bit_weights(void) {
    ar_error_t err = {{0}};
    backend_t *one = backend_cpu_create(1, &err), *two = backend_cpu_create(2, &err);
    CHECK_MSG(one && two, "backend_cpu_create: %s", err.msg);
    if (!one || !two)
        return;
    const int cases[][4] = {{1, 37, 129, 1}, {8, 50, 300, 3}, {200, 33, 65, 2}, {3, 1, 7, 1}};
    const dtype_t types[] = {DTYPE_I8, DTYPE_F8_E4M3};
    backend_t *bes[2] = {one, two};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
        for (int ti = 0; ti < 2; ti++) {
            const int m = cases[c][0], n = cases[c][1], k = cases[c][2], g = cases[c][3];
            const dtype_t dt = types[ti];
            const size_t rows = (size_t)g * n, elems = rows * k;
            const int padded = (n + GEMM_PANEL - 1) / GEMM_PANEL * GEMM_PANEL;
            float *x = host_uniform((size_t)m * k, -1, 1), *scale = host_uniform(rows, 0, 0.1f);
            float *b = host_uniform(rows, -1, 1), *w = malloc(elems * sizeof *w);
            unsigned char *q = malloc(elems);
            for (size_t i = 0; i < elems; i++) {
                q[i] = (unsigned char)(i * 131 + i / 7);
                if (dt == DTYPE_I8 && q[i] == 0x80)
                    q[i] = 0;
                if (dt == DTYPE_F8_E4M3 && (q[i] & 0x7f) == 0x7f)
                    q[i] = 0x7e;
                w[i] = (dt == DTYPE_I8 ? (float)(int8_t)q[i] : f8e4m3_to_f32(q[i])) *
                       scale[i / (size_t)k];
            }
            const int64_t shape3[3] = {g, n, k}, bshape[2] = {g, n};
            const int64_t *shape = g > 1 ? shape3 : shape3 + 1;
            const int nd = g > 1 ? 3 : 2;
            char what[80];
            snprintf(what, sizeof what, "%s m=%d n=%d k=%d groups=%d", dtype_name(dt), m, n, k, g);
            /* The kernel on each matrix, packed here, its scales padded. */
            float *want = malloc(sizeof(float) * (size_t)m * rows), *ks = calloc((size_t)padded, 4);
            void *qp = malloc(gemm_packed_elems(n, k, dt));
            double *ref = ref_new((size_t)m * rows);
            for (int j = 0; j < g; j++) {
                float *yj = want + (size_t)j * m * n;
                for (int r = 0; r < m; r++)
                    memcpy(yj + (size_t)r * n, b + (size_t)j * n, (size_t)n * sizeof(float));
                for (int r = 0; r < n; r++)
                    ks[r] = scale[(size_t)j * n + r] * (dt == DTYPE_F8_E4M3 ? VEC_F8_DIV : 1.0f);
                gemm_packed_pack(qp, q + (size_t)j * n * k, dt, n, k, k);
                gemm_packed_scaled(m, n, k, x, k, qp, dt, ks, yj, n);
                for (int r = 0; r < m; r++)
                    for (int o = 0; o < n; o++) {
                        double sum = b[(size_t)j * n + o];
                        for (int l = 0; l < k; l++)
                            sum += (double)x[(size_t)r * k + l] * w[((size_t)j * n + o) * k + l];
                        ref[(size_t)j * m * n + (size_t)r * n + o] = sum;
                    }
            }
            float *y[2];
            for (int t = 0; t < 2; t++) {
                backend_t *e = bes[t];
                tensor_t t8, tb;
                CHECK_MSG(e->weight_load_8bit(e, &t8, q, dt, scale, nd, shape, &err) == AR_OK,
                          "%s: %s", what, err.msg);
                CHECK(t8.dtype == dt && t8.scale && t8.shape[nd - 2] == n);
                CHECK(e->weight_prepare(e, &t8, LAYOUT_LINEAR, &err) == AR_OK);
                CHECK(e->weight_load(e, &tb, b, DTYPE_F32, g > 1 ? 2 : 1,
                                     g > 1 ? bshape : bshape + 1, &err) == AR_OK);
                y[t] = malloc(sizeof(float) * ((size_t)m * rows + 1));
                y[t][(size_t)m * rows] = 1e30f;
                e->matmul(e, y[t], x, &t8, &tb, m);
                CHECK(y[t][(size_t)m * rows] == 1e30f);
                CHECK_MSG(!memcmp(y[t], want, sizeof(float) * (size_t)m * rows),
                          "%s on %d thread(s): not gemm_packed_scaled's bytes", what, t + 1);
                e->weight_free(e, &t8);
                e->weight_free(e, &tb);
            }
            check_close(what, y[1], ref, (size_t)m * rows, 1e-6 + 2e-7 * k, 1e-5);
            free(y[0]), free(y[1]), free(want), free(ks), free(qp), free(ref), free(x), free(scale);
            free(b), free(w), free(q);
        }
    tensor_t t;
    const signed char q[4] = {1, 2, 3, 4};
    const float good[2] = {1, 1}, bad[2] = {1, NAN};
    const int64_t shape[2] = {2, 2};
    CHECK(one->weight_load_8bit(one, &t, q, DTYPE_BF16, good, 2, shape, &err) == AR_ERR);
    CHECK_MSG(strstr(err.msg, "I8 and F8_E4M3"), "%s", err.msg);
    CHECK(one->weight_load_8bit(one, &t, q, DTYPE_I8, bad, 2, shape, &err) == AR_ERR);
    CHECK_MSG(strstr(err.msg, "row 1") && strstr(err.msg, "not finite"), "%s", err.msg);
    const float huge[2] = {1, 1e37f}; /* finite, but not times fp8's 256 */
    CHECK(one->weight_load_8bit(one, &t, q, DTYPE_F8_E4M3, huge, 2, shape, &err) == AR_ERR);
    CHECK_MSG(strstr(err.msg, "row 1") && strstr(err.msg, "not finite times 256"), "%s", err.msg);
    const unsigned char nan8[4] = {1, 0x7f, 3, 4};
    CHECK(one->weight_load_8bit(one, &t, nan8, DTYPE_F8_E4M3, good, 2, shape, &err) == AR_ERR);
    CHECK_MSG(strstr(err.msg, "element 1 is an fp8 NaN"), "%s", err.msg);
    CHECK(one->weight_load_8bit(one, &t, q, DTYPE_I8, NULL, 2, shape, &err) == AR_ERR);
    CHECK_MSG(strstr(err.msg, "without its scales"), "%s", err.msg);
    CHECK(one->weight_load_8bit(one, &t, q, DTYPE_I8, good, 1, shape, &err) == AR_ERR);
    one->destroy(one);
    two->destroy(two);
}

static void test_rmsnorm_rows_and_in_place(void) {
    const int cases[][2] = {{1, 1}, {3, 7}, {2, 2048}, {0, 5}, {4, 33}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], dim = cases[c][1];
        const size_t n = (size_t)rows * dim;
        float *x = host_uniform(n, -2, 2), *w = host_uniform((size_t)dim, -2, 2);
        for (int r = 0; r < rows; r++)
            for (int i = 0; i < dim; i++)
                x[r * dim + i] *= r % 3 == 1 ? 1e3f : r % 3 == 2 ? 1e-3f : 1;
        tensor_t tw = weight_f32(w, 1, dim, 1, 1, 1);
        const float eps = c % 2 ? 1e-5f : 1e-6f;
        double *ref = ref_new(n);
        for (int r = 0; r < rows; r++) {
            double ss = 0;
            for (int i = 0; i < dim; i++)
                ss += (double)x[r * dim + i] * x[r * dim + i];
            const double inv = 1 / sqrt(ss / dim + eps);
            for (int i = 0; i < dim; i++)
                ref[r * dim + i] = x[r * dim + i] * inv * w[i];
        }
        float *dx = dev_from(x, n), *dy = dev_new(n);
        be->rmsnorm(be, dy, dx, &tw, rows, dim, eps);
        check_dev("rmsnorm", dy, ref, n, 1e-5, 1e-5);
        be->rmsnorm(be, dx, dx, &tw, rows, dim, eps);
        check_dev("rmsnorm in place", dx, ref, n, 1e-5, 1e-5);
        dev_del(dx);
        dev_del(dy);
        be->weight_free(be, &tw);
        free(ref);
        free(x);
        free(w);
    }
}

/* LlamaGen's 2D RoPE written as its Python does it: freqs = 1 / theta **
 * (arange(0, d/2, 2)[: d/4] / (d/2)), the (row, col) table concatenated per
 * grid cell, complex-style rotation of interleaved pairs; condition rows
 * (grid row -1) get zeros. Checked against exact double angles, with the
 * tolerance of the 1D test (2e-6 + 3e-7 * position), on a grid of 24 and
 * positions up to 5000. */
static void test_rope_2d_llamagen_layout(void) {
    static const int pos[][2] = {{-1, -1}, {0, 0}, {0, 1}, {1, 0}, {23, 23}, {7, 19}, {5000, 3}};
    const int rows = sizeof pos / sizeof *pos;
    const int dims[] = {4, 12, 64};
    for (int d = 0; d < 3; d++)
        for (int n_heads = 1; n_heads <= 2; n_heads++) {
            const int hd = dims[d], half = hd / 2, quarter = hd / 4;
            const size_t n = (size_t)rows * n_heads * hd;
            float *x = host_uniform(n, -1, 1);
            double *ref = ref_new(n);
            for (int r = 0; r < rows; r++)
                for (int h = 0; h < n_heads; h++)
                    for (int j = 0; j < half; j++) {
                        const size_t i = ((size_t)r * n_heads + h) * hd + 2 * j;
                        const int f = j % quarter, p = j < quarter ? pos[r][0] : pos[r][1];
                        const double a = p * pow(10000.0, -2.0 * f / half);
                        const double c = pos[r][0] < 0 ? 0 : cos(a),
                                     sn = pos[r][0] < 0 ? 0 : sin(a);
                        ref[i] = x[i] * c - x[i + 1] * sn;
                        ref[i + 1] = x[i + 1] * c + x[i] * sn;
                    }
            float *dx = dev_from(x, n);
            be->rope_2d(be, dx, &pos[0][0], rows, n_heads, hd, 10000.0f);
            CHECK(dev_guards_ok(dx, n));
            float *got = dev_to_host(dx, n);
            size_t bad = 0;
            for (size_t i = 0; i < n; i++) {
                const int r = (int)(i / ((size_t)n_heads * hd));
                const int p = pos[r][0] > pos[r][1] ? pos[r][0] : pos[r][1];
                if (!(fabs(got[i] - ref[i]) <= 2e-6 + 3e-7 * p))
                    bad++;
            }
            CHECK_MSG(bad == 0, "rope_2d: %zu off (d=%d heads=%d)", bad, hd, n_heads);
            for (size_t i = 0; i < (size_t)n_heads * hd; i++)
                CHECK(got[i] == 0.0f); /* the condition row */
            dev_del(dx);
            free(got);
            free(ref);
            free(x);
        }
}

static const int rope_pos[] = {0, 1, 2, 17, 1000, 4095, 16383, 100000};
enum { ROPE_ROWS = sizeof rope_pos / sizeof *rope_pos };

/* Applies the backend's rope to random rows at rope_pos and returns them. */
static float *rope_run(const float *x, int n_heads, int head_dim, float theta) {
    const size_t n = (size_t)ROPE_ROWS * n_heads * head_dim;
    float *dx = dev_from(x, n);
    be->rope(be, dx, rope_pos, ROPE_ROWS, n_heads, head_dim, theta);
    CHECK(dev_guards_ok(dx, n));
    float *got = dev_to_host(dx, n);
    dev_del(dx);
    return got;
}

/* Rotates (x_j, x_{j+d/2}) by the angle given per row and pair. */
static void rope_reference(double *ref, const float *x, int n_heads, int head_dim,
                           double (*angle)(int pos, int j, int head_dim, float theta),
                           float theta) {
    const int half = head_dim / 2;
    for (int r = 0; r < ROPE_ROWS; r++)
        for (int h = 0; h < n_heads; h++)
            for (int j = 0; j < half; j++) {
                const size_t i = ((size_t)r * n_heads + h) * head_dim + j;
                const double a = angle(rope_pos[r], j, head_dim, theta);
                ref[i] = x[i] * cos(a) - x[i + half] * sin(a);
                ref[i + half] = x[i + half] * cos(a) + x[i] * sin(a);
            }
}

static double angle_exact(int pos, int j, int head_dim, float theta) {
    return pos * pow(theta, -2.0 * j / head_dim);
}

/* HF Llama: inv_freq = 1 / theta ** (arange(0, d, 2).float() / d) in fp32,
 * then freqs = inv_freq * pos in fp32 (cos and sin taken of that). */
static double angle_hf(int pos, int j, int head_dim, float theta) {
    const float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
    const float freq = inv_freq * (float)pos;
    return freq;
}

/* Against exact double maths the fp32 angle (as HF forms it) is off by up to
 * about 2 ulp of pos * inv_freq, so the tolerance grows with pos: 2e-6 +
 * 3e-7 * pos (x in [-1, 1]). Against the HF fp32 angle it is 1e-6 flat, at
 * every position (power-of-two head dims, where the exponent is exact). */
static void test_rope_against_double_and_hf_angles(void) {
    const int dims[] = {2, 6, 64, 128};
    const float thetas[] = {10000.0f, 500000.0f};
    for (int t = 0; t < 2; t++)
        for (int d = 0; d < 4; d++)
            for (int n_heads = 1; n_heads <= 3; n_heads += 2) {
                const int hd = dims[d];
                const size_t n = (size_t)ROPE_ROWS * n_heads * hd;
                float *x = host_uniform(n, -1, 1);
                float *got = rope_run(x, n_heads, hd, thetas[t]);
                double *ref = ref_new(n);
                rope_reference(ref, x, n_heads, hd, angle_exact, thetas[t]);
                size_t bad = 0;
                for (size_t i = 0; i < n; i++) {
                    const int pos = rope_pos[i / ((size_t)n_heads * hd)];
                    if (!(fabs(got[i] - ref[i]) <= 2e-6 + 3e-7 * pos))
                        bad++;
                }
                CHECK_MSG(bad == 0, "rope vs double: %zu off (d=%d heads=%d theta=%g)", bad, hd,
                          n_heads, thetas[t]);
                if ((hd & (hd - 1)) == 0) {
                    rope_reference(ref, x, n_heads, hd, angle_hf, thetas[t]);
                    check_close("rope vs hf", got, ref, n, 1e-6, 0);
                }
                free(ref);
                free(got);
                free(x);
            }
    /* No rows: nothing is touched. */
    float *dx = dev_new(8);
    be->rope(be, dx, rope_pos, 0, 2, 4, 10000.0f);
    uint32_t bits[8];
    be->download(be, bits, dx, sizeof bits);
    CHECK(dev_guards_ok(dx, 8) && bits[0] == SENTINEL && bits[7] == SENTINEL);
    dev_del(dx);
}

/* ---- paged KV: append, attention, gather ------------------------------------ */

/* Ragged batch shared by the kv_append and attention tests: sequences with
 * 1, 5, 0 and 2 new rows. */
enum { N_SEQ = 4 };
static const int batch_q_start[N_SEQ + 1] = {0, 1, 6, 6, 8};

/* Block sizes every paged test runs with: one token per block, an odd size
 * that no length in the tests is a multiple of by design, and a power of two. */
static const int test_block_tokens[] = {1, 3, 16};
enum { N_BLOCK_SIZES = sizeof test_block_tokens / sizeof *test_block_tokens };

/* A random permutation of [0, n). */
static int *random_permutation(int n) {
    int *p = malloc((n ? n : 1) * sizeof *p);
    for (int i = 0; i < n; i++)
        p[i] = i;
    for (int i = n - 1; i > 0; i--) {
        const int j = (int)(rng_next() % (uint64_t)(i + 1)), t = p[i];
        p[i] = p[j];
        p[j] = t;
    }
    return p;
}

/* A pool in backend memory (guarded) with its host image, and a block table
 * per (sequence, head) pair: blocks for cap_len[i] tokens, taken from a
 * random permutation of the pool's block ids (scattered, out of order), with
 * spare blocks nobody owns. The host image starts as SENTINEL (NaN), so an
 * op that reads a row it should not makes NaNs the comparisons catch; rows
 * [0, len[i]) of each pair are then filled with K in [-amp, amp] and V in
 * [-1, 1]. */
typedef struct paged {
    kv_blocks_t pool;
    float *host; /* the pool's host image */
    size_t n_floats;
    int n_pairs, n_blocks;
    int **tables;
    kv_view_t *views;
} paged_t;

static size_t paged_k_at(const paged_t *pg, int pair, int j) {
    const int bt = pg->pool.block_tokens, hd = pg->pool.head_dim;
    return ((size_t)pg->tables[pair][j / bt] * 2 * bt + (size_t)(j % bt)) * hd;
}

static size_t paged_v_at(const paged_t *pg, int pair, int j) {
    return paged_k_at(pg, pair, j) + (size_t)pg->pool.block_tokens * pg->pool.head_dim;
}

static void paged_build(paged_t *pg, int bt, int hd, int n_pairs, const int *cap_len,
                        const int *len, float amp, int spare) {
    memset(pg, 0, sizeof *pg);
    pg->n_pairs = n_pairs;
    for (int i = 0; i < n_pairs; i++)
        pg->n_blocks += (cap_len[i] + bt - 1) / bt;
    pg->n_blocks += spare;
    pg->n_floats = (size_t)pg->n_blocks * 2 * bt * hd;
    pg->host = malloc((pg->n_floats ? pg->n_floats : 1) * sizeof(float));
    for (size_t e = 0; e < pg->n_floats; e++)
        memcpy(&pg->host[e], &(uint32_t){SENTINEL}, 4);
    int *perm = random_permutation(pg->n_blocks), next = 0;
    pg->tables = malloc((size_t)n_pairs * sizeof *pg->tables);
    pg->views = malloc((size_t)n_pairs * sizeof *pg->views);
    pg->pool = (kv_blocks_t){NULL, DTYPE_F32, bt, hd};
    for (int i = 0; i < n_pairs; i++) {
        const int nb = (cap_len[i] + bt - 1) / bt;
        pg->tables[i] = malloc((nb ? nb : 1) * sizeof(int));
        for (int b = 0; b < nb; b++)
            pg->tables[i][b] = perm[next++];
        pg->views[i] = (kv_view_t){pg->tables[i], len[i], 1, 1};
        for (int j = 0; j < len[i]; j++) {
            fill_uniform(pg->host + paged_k_at(pg, i, j), hd, -amp, amp);
            fill_uniform(pg->host + paged_v_at(pg, i, j), hd, -1, 1);
        }
    }
    free(perm);
    pg->pool.base = dev_from(pg->host, pg->n_floats);
}

/* The pair's K (or V) rows [0, n) as one contiguous host array. */
static float *paged_rows(const paged_t *pg, int pair, int n, int v) {
    const int hd = pg->pool.head_dim;
    float *out = malloc((n > 0 ? (size_t)n * hd : 1) * sizeof *out);
    for (int j = 0; j < n; j++)
        memcpy(out + (size_t)j * hd,
               pg->host + (v ? paged_v_at(pg, pair, j) : paged_k_at(pg, pair, j)),
               (size_t)hd * sizeof(float));
    return out;
}

static void paged_free(paged_t *pg) {
    dev_del(pg->pool.base);
    for (int i = 0; i < pg->n_pairs; i++)
        free(pg->tables[i]);
    free(pg->tables);
    free(pg->views);
    free(pg->host);
}

/* Each pair holds 0..8 rows (heads of one sequence differ) and gets its
 * sequence's new rows appended; the whole pool, spare blocks and the unused
 * tails of last blocks included, must then equal the old image with exactly
 * those rows written. */
static void test_kv_append_paged_ragged_batch(void) {
    enum { H = 3, D = 5, PAIRS = N_SEQ * H };
    const int rows = batch_q_start[N_SEQ];
    for (int c = 0; c < N_BLOCK_SIZES; c++) {
        const int bt = test_block_tokens[c];
        int old_len[PAIRS], new_len[PAIRS];
        for (int i = 0; i < PAIRS; i++) {
            const int s = i / H;
            old_len[i] = (int)(rng_next() % 9);
            if (i == 0)
                old_len[i] = 0; /* an empty head */
            if (i == 1)
                old_len[i] = bt; /* a head whose last block is full */
            new_len[i] = old_len[i] + batch_q_start[s + 1] - batch_q_start[s];
        }
        paged_t pg;
        paged_build(&pg, bt, D, PAIRS, new_len, old_len, 5, 3);
        for (int i = 0; i < PAIRS; i++)
            pg.views[i].len = new_len[i];
        float *k = host_uniform((size_t)rows * H * D, -1, 1),
              *v = host_uniform((size_t)rows * H * D, -1, 1);
        float *dk = dev_from(k, (size_t)rows * H * D), *dv = dev_from(v, (size_t)rows * H * D);
        be->kv_append(be, &pg.pool, pg.views, dk, dv, batch_q_start, N_SEQ, H);
        double *ref = ref_new(pg.n_floats);
        uint32_t *bits = malloc((pg.n_floats ? pg.n_floats : 1) * sizeof *bits);
        memcpy(bits, pg.host, pg.n_floats * sizeof(float));
        for (int i = 0; i < PAIRS; i++) {
            const int s = i / H, h = i % H;
            for (int r = batch_q_start[s]; r < batch_q_start[s + 1]; r++) {
                const int j = old_len[i] + r - batch_q_start[s];
                memcpy(bits + paged_k_at(&pg, i, j), k + ((size_t)r * H + h) * D, D * 4);
                memcpy(bits + paged_v_at(&pg, i, j), v + ((size_t)r * H + h) * D, D * 4);
            }
        }
        for (size_t e = 0; e < pg.n_floats; e++) {
            float f;
            memcpy(&f, &bits[e], 4);
            ref[e] = f; /* SENTINEL stays a NaN, which check_close wants as a NaN */
        }
        char what[64];
        snprintf(what, sizeof what, "kv_append pool bt=%d", bt);
        check_dev(what, pg.pool.base, ref, pg.n_floats, 0, 0);
        free(bits);
        free(ref);
        dev_del(dk);
        dev_del(dv);
        free(k);
        free(v);
        paged_free(&pg);
    }
}

/* Naive causal attention in double with max-subtraction, over contiguous
 * per-pair rows; also the key mass: mass_ref[pair][j] += each row's p_j. */
static void attention_reference(double *ref, double **mass_ref, const float *q, float *const *k,
                                float *const *v, const int *q_start, const int *kv_len, int n_seq,
                                int n_heads, int hd, float scale) {
    for (int s = 0; s < n_seq; s++) {
        const int n_new = q_start[s + 1] - q_start[s];
        for (int h = 0; h < n_heads; h++) {
            const int i = s * n_heads + h, len = kv_len[i];
            double *p = malloc((len ? len : 1) * sizeof *p);
            for (int t = 0; t < n_new; t++) {
                const size_t row = ((size_t)(q_start[s] + t) * n_heads + h) * hd;
                const int visible = len - n_new + t + 1;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j < visible; j++) {
                    double dot = 0;
                    for (int e = 0; e < hd; e++)
                        dot += (double)q[row + e] * k[i][j * hd + e];
                    p[j] = dot * scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = 0; j < visible; j++)
                    sum += p[j] = exp(p[j] - mx);
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = 0; j < visible; j++)
                        o += p[j] * v[i][j * hd + e];
                    ref[row + e] = o / sum;
                }
                if (mass_ref && mass_ref[i])
                    for (int j = 0; j < visible; j++)
                        mass_ref[i][j] += p[j] / sum;
            }
            free(p);
        }
    }
}

/* Runs attention over the ragged batch with per-(sequence, head) cache
 * lengths kv_len in a paged pool of bt-token blocks; q, k in [-amp, amp],
 * v in [-1, 1]; tolerance abs + rel. With with_mass, every other pair (and
 * the first) also accumulates key mass into an array that starts random
 * (it must be added to, not overwritten), over two calls with different
 * queries: the mass must match the reference's probabilities summed over
 * both calls' rows, and each output its reference. */
static void check_attention(const int *kv_len, int n_heads, int hd, int bt, float amp, float scale,
                            double abs_tol, double rel_tol, int with_mass) {
    const int rows = batch_q_start[N_SEQ], pairs = N_SEQ * n_heads;
    const size_t n = (size_t)rows * n_heads * hd;
    paged_t pg;
    paged_build(&pg, bt, hd, pairs, kv_len, kv_len, amp, 2);
    float **hk = malloc(pairs * sizeof *hk), **hv = malloc(pairs * sizeof *hv);
    float **dmass = calloc(pairs, sizeof *dmass);
    double **mass_ref = calloc(pairs, sizeof *mass_ref);
    for (int i = 0; i < pairs; i++) {
        hk[i] = paged_rows(&pg, i, kv_len[i], 0);
        hv[i] = paged_rows(&pg, i, kv_len[i], 1);
        if (with_mass && i % 2 == 0) {
            float *m0 = host_uniform((size_t)kv_len[i], 0, 3);
            mass_ref[i] = ref_new((size_t)kv_len[i]);
            for (int j = 0; j < kv_len[i]; j++)
                mass_ref[i][j] = m0[j];
            dmass[i] = dev_from(m0, (size_t)kv_len[i]);
            free(m0);
        }
    }
    const attn_batch_t batch = {N_SEQ, batch_q_start, pg.views, with_mass ? dmass : NULL};
    double *ref = ref_new(n);
    for (int call = 0; call < (with_mass ? 2 : 1); call++) {
        float *q = host_uniform(n, -amp, amp);
        float *dq = dev_from(q, n), *dout = dev_new(n);
        be->attention(be, dout, dq, &pg.pool, &batch, n_heads, scale);
        attention_reference(ref, mass_ref, q, hk, hv, batch_q_start, kv_len, N_SEQ, n_heads, hd,
                            scale);
        char what[96];
        snprintf(what, sizeof what, "attention heads=%d hd=%d bt=%d amp=%g mass=%d call=%d",
                 n_heads, hd, bt, amp, with_mass, call);
        check_dev(what, dout, ref, n, abs_tol, rel_tol);
        dev_del(dq);
        dev_del(dout);
        free(q);
    }
    CHECK(dev_guards_ok(pg.pool.base, pg.n_floats));
    for (int i = 0; i < pairs; i++) {
        if (dmass[i]) {
            char what[96];
            snprintf(what, sizeof what, "key mass pair %d len %d bt=%d", i, kv_len[i], bt);
            check_dev(what, dmass[i], mass_ref[i], (size_t)kv_len[i], 1e-6, 1e-5);
            dev_del(dmass[i]);
        }
        free(mass_ref[i]);
        free(hk[i]);
        free(hv[i]);
    }
    paged_free(&pg);
    free(ref);
    free(hk);
    free(hv);
    free(dmass);
    free(mass_ref);
}

/* Seven heads, each with its own cache length: from exactly the new rows
 * (kv_len 1 for the one-row sequence; 0 for the sequence with no new rows)
 * to past two softmax chunks, through block boundaries. Outputs are
 * averages of values in [-1, 1]: 1e-6 abs + 1e-5 rel. */
static void test_attention_paged_ragged_heads_and_lengths(void) {
    enum { H = 7 };
    const int extra[H] = {0, 1, 6, 255, 256, 300, 600};
    int kv_len[N_SEQ * H];
    for (int s = 0; s < N_SEQ; s++)
        for (int h = 0; h < H; h++)
            kv_len[s * H + h] = batch_q_start[s + 1] - batch_q_start[s] + extra[(h + s) % H];
    CHECK(kv_len[0] == 1);
    for (int c = 0; c < N_BLOCK_SIZES; c++)
        for (int with_mass = 0; with_mass < 2; with_mass++) {
            const int bt = test_block_tokens[c];
            check_attention(kv_len, H, 5, bt, 1, 1 / sqrtf(5), 1e-6, 1e-5, with_mass);
            check_attention(kv_len, H, 64, bt, 1, 1 / sqrtf(64), 1e-6, 1e-5, with_mass);
        }
}

/* Lengths on and next to block boundaries: k*bt - 1, k*bt, k*bt + 1. */
static void test_attention_paged_block_boundaries(void) {
    enum { H = 3 };
    for (int c = 0; c < N_BLOCK_SIZES; c++) {
        const int bt = test_block_tokens[c];
        int kv_len[N_SEQ * H];
        for (int i = 0; i < N_SEQ * H; i++) {
            const int s = i / H, n_new = batch_q_start[s + 1] - batch_q_start[s];
            int len = 2 * bt + (i % 3) - 1;
            kv_len[i] = len < n_new ? n_new : len;
        }
        check_attention(kv_len, H, 8, bt, 1, 0.35f, 1e-6, 1e-5, 1);
    }
}

/* Scores in the thousands overflow a softmax without max-subtraction, and
 * the maximum moves between chunks (rescaling the running sums). */
static void test_attention_large_scores(void) {
    enum { H = 2 };
    int kv_len[N_SEQ * H];
    for (int i = 0; i < N_SEQ * H; i++)
        kv_len[i] = batch_q_start[i / H + 1] - batch_q_start[i / H] + 517 + 61 * (i % 3);
    for (int with_mass = 0; with_mass < 2; with_mass++)
        check_attention(kv_len, H, 16, 16, 8, 1.0f, 1e-5, 1e-4, with_mass);
}

/* Chunks of the online softmax are cut by cache index, not by block, so
 * the output (without mass) is the same bit for bit at every block size:
 * the engine's results do not depend on how the pool is cut. */
static void test_attention_same_bits_at_every_block_size(void) {
    enum { H = 3, D = 16 };
    int kv_len[N_SEQ * H];
    for (int i = 0; i < N_SEQ * H; i++)
        kv_len[i] = batch_q_start[i / H + 1] - batch_q_start[i / H] + 40 + 97 * (i % 5);
    const int rows = batch_q_start[N_SEQ];
    const size_t n = (size_t)rows * H * D;
    float *q = host_uniform(n, -1, 1), *first = NULL;
    float **k = malloc(N_SEQ * H * sizeof *k), **v = malloc(N_SEQ * H * sizeof *v);
    for (int i = 0; i < N_SEQ * H; i++) {
        k[i] = host_uniform((size_t)kv_len[i] * D, -1, 1);
        v[i] = host_uniform((size_t)kv_len[i] * D, -1, 1);
    }
    float *dq = dev_from(q, n);
    for (int c = 0; c < N_BLOCK_SIZES; c++) {
        paged_t pg;
        paged_build(&pg, test_block_tokens[c], D, N_SEQ * H, kv_len, kv_len, 1, 0);
        for (int i = 0; i < N_SEQ * H; i++)
            for (int j = 0; j < kv_len[i]; j++) {
                memcpy(pg.host + paged_k_at(&pg, i, j), k[i] + (size_t)j * D, D * 4);
                memcpy(pg.host + paged_v_at(&pg, i, j), v[i] + (size_t)j * D, D * 4);
            }
        be->upload(be, pg.pool.base, pg.host, pg.n_floats * sizeof(float));
        const attn_batch_t batch = {N_SEQ, batch_q_start, pg.views, NULL};
        float *dout = dev_new(n);
        be->attention(be, dout, dq, &pg.pool, &batch, H, 0.25f);
        float *got = dev_to_host(dout, n);
        if (!first)
            first = got;
        else {
            CHECK_MSG(memcmp(first, got, n * sizeof(float)) == 0,
                      "attention with %d-token blocks differs from 1-token blocks",
                      test_block_tokens[c]);
            free(got);
        }
        dev_del(dout);
        paged_free(&pg);
    }
    for (int i = 0; i < N_SEQ * H; i++) {
        free(k[i]);
        free(v[i]);
    }
    free(k);
    free(v);
    free(first);
    free(q);
    dev_del(dq);
}

/* A keep list for a head of len tokens: an ascending subset of [0, len),
 * of a special shape or random (about 40% kept). */
static int random_keep(int *keep, int len, int shape) {
    int n = 0;
    for (int j = 0; j < len; j++) {
        int take;
        switch (shape) {
        case 0:
            take = 1;
            break; /* all */
        case 1:
            take = 0;
            break; /* none */
        case 2:
            take = j < len / 2;
            break; /* a prefix (no copy) */
        case 3:
            take = j >= len / 2;
            break; /* a suffix */
        case 4:
            take = j == len - 1;
            break; /* the newest only */
        default:
            take = (int)(rng_next() % 100) < 40;
            break; /* random */
        }
        if (take)
            keep[n++] = j;
    }
    return n;
}

/* Gathers random keep lists in place for heads of every length from 0 to
 * a few blocks, with and without mass: kept rows (and mass) move to the
 * front, rows past n_keep, the other heads' blocks and the spare blocks are
 * untouched. */
static void test_kv_gather_random_keep_lists(void) {
    enum { D = 6, PAIRS = 2, SHAPES = 8 };
    for (int c = 0; c < N_BLOCK_SIZES; c++) {
        const int bt = test_block_tokens[c];
        for (int len = 0; len <= 3 * bt + 5; len += len < 2 * bt + 2 ? 1 : 3)
            for (int shape = 0; shape < SHAPES; shape++) {
                const int lens[PAIRS] = {len, 7}; /* pair 1 is a bystander */
                paged_t pg;
                paged_build(&pg, bt, D, PAIRS, lens, lens, 2, 2);
                int *keep = malloc((len ? len : 1) * sizeof *keep);
                const int n_keep = random_keep(keep, len, shape);
                float *mass0 = host_uniform((size_t)len, 0, 1);
                float *dmass = shape % 2 ? dev_from(mass0, (size_t)len) : NULL;
                be->kv_gather(be, &pg.pool, pg.tables[0], keep, n_keep, dmass);
                double *ref = ref_new(pg.n_floats);
                float *img = malloc((pg.n_floats ? pg.n_floats : 1) * sizeof *img);
                memcpy(img, pg.host, pg.n_floats * sizeof(float));
                for (int i = 0; i < n_keep; i++) {
                    memcpy(img + paged_k_at(&pg, 0, i), pg.host + paged_k_at(&pg, 0, keep[i]),
                           D * 4);
                    memcpy(img + paged_v_at(&pg, 0, i), pg.host + paged_v_at(&pg, 0, keep[i]),
                           D * 4);
                }
                for (size_t e = 0; e < pg.n_floats; e++)
                    ref[e] = img[e];
                char what[80];
                snprintf(what, sizeof what, "kv_gather bt=%d len=%d shape=%d n_keep=%d", bt, len,
                         shape, n_keep);
                check_dev(what, pg.pool.base, ref, pg.n_floats, 0, 0);
                if (dmass) {
                    double *mref = ref_new((size_t)len);
                    for (int j = 0; j < len; j++)
                        mref[j] = j < n_keep ? mass0[keep[j]] : mass0[j];
                    check_dev("kv_gather mass", dmass, mref, (size_t)len, 0, 0);
                    free(mref);
                    dev_del(dmass);
                }
                free(img);
                free(ref);
                free(mass0);
                free(keep);
                paged_free(&pg);
            }
    }
}

/* ---- element-wise ---------------------------------------------------------- */

static const size_t ew_sizes[] = {0, 1, 1023, 100003};

/* Inputs in [-8, 8] with extremes at the front (0, -0, +-20, +-100, +-1000). */
static float *ew_input(size_t n) {
    static const float specials[] = {0.0f, -0.0f, 20, -20, 100, -100, 1000, -1000};
    float *x = host_uniform(n, -8, 8);
    for (size_t i = 0; i < n && i < sizeof specials / sizeof *specials; i++)
        x[i] = specials[i];
    return x;
}

static double silu_ref(double x) { return x / (1 + exp(-x)); }

/* silu, silu_mul, gelu: 1e-6 abs + 1e-5 rel. add: the fp32 sum exactly. */
static void test_elementwise_ops(void) {
    for (size_t c = 0; c < sizeof ew_sizes / sizeof *ew_sizes; c++) {
        const size_t n = ew_sizes[c];
        float *g = ew_input(n), *u = host_uniform(n, -3, 3);
        double *ref = ref_new(n);
        float *dg = dev_from(g, n), *du = dev_from(u, n), *dout = dev_new(n);

        be->silu_mul(be, dout, dg, du, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = silu_ref(g[i]) * u[i];
        check_dev("silu_mul", dout, ref, n, 1e-6, 1e-5);
        CHECK(dev_guards_ok(dg, n) && dev_guards_ok(du, n));

        be->silu(be, dg, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = silu_ref(g[i]);
        check_dev("silu", dg, ref, n, 1e-6, 1e-5);

        be->upload(be, dg, g, n * sizeof(float));
        be->gelu(be, dg, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = 0.5 * g[i] * (1 + erf(g[i] / sqrt(2.0)));
        check_dev("gelu", dg, ref, n, 1e-6, 1e-5);

        be->upload(be, dg, g, n * sizeof(float));
        be->add(be, dg, du, n);
        for (size_t i = 0; i < n; i++)
            ref[i] = g[i] + u[i];
        check_dev("add", dg, ref, n, 0, 0x1p-24);

        be->upload(be, dg, g, n * sizeof(float));
        be->scale(be, dg, n, -0.37f);
        for (size_t i = 0; i < n; i++)
            ref[i] = g[i] * -0.37f;
        check_dev("scale", dg, ref, n, 0, 0x1p-24);

        dev_del(dg);
        dev_del(du);
        dev_del(dout);
        free(ref);
        free(g);
        free(u);
    }
}

/* Rows with offsets of 1e4 (exp overflows without max-subtraction) and
 * -inf entries (masked): 1e-7 abs + 1e-5 rel, rows sum to 1 within 1e-5. */
static void test_softmax_rows(void) {
    const int cases[][2] = {{1, 1}, {3, 7}, {2, 16384}, {5, 129}, {0, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], cols = cases[c][1];
        const size_t n = (size_t)rows * cols;
        float *x = host_uniform(n, -10, 10);
        for (int r = 0; r < rows; r++) {
            if (r % 3 == 1)
                for (int i = 0; i < cols; i++)
                    x[r * cols + i] += 1e4f;
            if (r % 3 == 2)
                for (int i = 0; i + 1 < cols; i += 3)
                    x[r * cols + i] = -INFINITY;
        }
        double *ref = ref_new(n);
        for (int r = 0; r < rows; r++) {
            double mx = -INFINITY, sum = 0;
            for (int i = 0; i < cols; i++)
                mx = fmax(mx, x[r * cols + i]);
            for (int i = 0; i < cols; i++)
                sum += ref[r * cols + i] = exp(x[r * cols + i] - mx);
            for (int i = 0; i < cols; i++)
                ref[r * cols + i] /= sum;
        }
        float *dx = dev_from(x, n);
        be->softmax(be, dx, rows, cols);
        check_dev("softmax", dx, ref, n, 1e-7, 1e-5);
        float *got = dev_to_host(dx, n);
        for (int r = 0; r < rows; r++) {
            double sum = 0;
            for (int i = 0; i < cols; i++)
                sum += got[r * cols + i];
            CHECK_NEAR(sum, 1.0, 1e-5, 0);
        }
        free(got);
        dev_del(dx);
        free(ref);
        free(x);
    }
}

/* Repeated, first and last ids; one all-zero row (normalised to 0, not
 * NaN); a dim-1 table. 1e-7 abs + 1e-6 rel. */
static void test_embedding_with_and_without_l2(void) {
    const int dims[] = {13, 1};
    const int ids[] = {0, 36, 5, 5, 3, 17};
    const int n = sizeof ids / sizeof *ids;
    for (int d = 0; d < 2; d++) {
        const int vocab = 37, dim = dims[d];
        float *table = host_uniform((size_t)vocab * dim, -2, 2);
        for (int j = 0; j < dim; j++)
            table[3 * dim + j] = 0;
        tensor_t tt = weight_f32(table, 2, vocab, dim, 1, 1);
        for (int l2 = 0; l2 < 2; l2++) {
            double *ref = ref_new((size_t)n * dim);
            for (int i = 0; i < n; i++) {
                double ss = 0;
                for (int j = 0; j < dim; j++)
                    ss += (double)table[ids[i] * dim + j] * table[ids[i] * dim + j];
                const double norm = l2 ? fmax(sqrt(ss), 1e-12) : 1;
                for (int j = 0; j < dim; j++)
                    ref[i * dim + j] = table[ids[i] * dim + j] / norm;
            }
            float *dout = dev_new((size_t)n * dim);
            be->embedding(be, dout, &tt, ids, n, l2);
            check_dev(l2 ? "embedding l2" : "embedding", dout, ref, (size_t)n * dim, 1e-7, 1e-6);
            be->embedding(be, dout, &tt, ids, 0, l2); /* no ids: nothing written */
            check_dev("embedding n=0", dout, ref, (size_t)n * dim, 1e-7, 1e-6);
            dev_del(dout);
            free(ref);
        }
        be->weight_free(be, &tt);
        free(table);
    }
}

/* ---- image ops ----------------------------------------------------------------- */

/* Tolerance as matmul, with k = c_in * kernel^2. Each case runs on the
 * kernels as loaded and on the kernels weight_prepare made conv2d's own:
 * 3x3 ones of CONV_WINOGRAD_MIN_CHANNELS (32) or more channels in and out
 * become Winograd's transformed kernels, the rest stay as they are. */
static void test_conv2d_kernels_pads_and_slices(void) {
    /* c_in, c_out, h, w, kernel, pad. The last three are split over threads;
     * the third from last needs two im2col slices, the second starting
     * mid-row; the last two run as Winograd when prepared (both widths 31
     * and 33 over 2x2 tiles leave a half tile). */
    const int cases[][7] = {{5, 3, 7, 11, 1, 0},    {4, 6, 9, 13, 3, 1},    {3, 2, 8, 5, 3, 0},
                            {2, 3, 6, 4, 1, 1},     {3, 4, 1, 1, 3, 1},     {1, 1, 1, 1, 1, 0},
                            {3, 2, 6, 7, 5, 2},     {64, 33, 40, 41, 1, 0}, {128, 3, 64, 61, 3, 1},
                            {32, 48, 29, 31, 3, 1}, {40, 32, 35, 31, 3, 2}, {31, 64, 9, 9, 3, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ci = cases[c][0], co = cases[c][1], h = cases[c][2], w = cases[c][3];
        const int k = cases[c][4], pad = cases[c][5];
        const int ho = h + 2 * pad - k + 1, wo = w + 2 * pad - k + 1;
        const size_t n_in = (size_t)ci * h * w, n_out = (size_t)co * ho * wo;
        float *in = host_uniform(n_in, -1, 1), *wt = host_uniform((size_t)co * ci * k * k, -1, 1);
        float *b = host_uniform((size_t)co, -1, 1);
        tensor_t tw = weight_f32(wt, 4, co, ci, k, k), tb = weight_f32(b, 1, co, 1, 1, 1);
        tensor_t tp = weight_f32(wt, 4, co, ci, k, k);
        ar_error_t err = {{0}};
        CHECK_MSG(be->weight_prepare(be, &tp, LAYOUT_CONV, &err) == AR_OK, "%s", err.msg);
        CHECK_MSG(tp.layout == (k == 3 && ci >= 32 && co >= 32 ? LAYOUT_CONV : LAYOUT_PLAIN),
                  "case %zu: layout %d", c, (int)tp.layout);
        float *din = dev_from(in, n_in);
        for (int with_bias = 0; with_bias < 2; with_bias++) {
            double *ref = ref_new(n_out);
            for (int o = 0; o < co; o++)
                for (int y = 0; y < ho; y++)
                    for (int x = 0; x < wo; x++) {
                        double s = with_bias ? b[o] : 0;
                        for (int i = 0; i < ci; i++)
                            for (int ky = 0; ky < k; ky++)
                                for (int kx = 0; kx < k; kx++) {
                                    const int iy = y + ky - pad, ix = x + kx - pad;
                                    if (iy >= 0 && iy < h && ix >= 0 && ix < w)
                                        s += (double)wt[((o * ci + i) * k + ky) * k + kx] *
                                             in[((size_t)i * h + iy) * w + ix];
                                }
                        ref[((size_t)o * ho + y) * wo + x] = s;
                    }
            for (int prepared = 0; prepared < 2; prepared++) {
                float *dout = dev_new(n_out);
                be->conv2d(be, dout, din, prepared ? &tp : &tw, with_bias ? &tb : NULL, ci, h, w,
                           pad);
                char what[96];
                snprintf(what, sizeof what, "conv2d %dx%dx%d k=%d pad=%d bias=%d%s", ci, h, w, k,
                         pad, with_bias, tp.layout == LAYOUT_CONV && prepared ? " winograd" : "");
                check_dev(what, dout, ref, n_out, 1e-6 + 2e-7 * ci * k * k, 1e-5);
                CHECK(dev_guards_ok(din, n_in));
                dev_del(dout);
            }
            free(ref);
        }
        dev_del(din);
        be->weight_free(be, &tw);
        be->weight_free(be, &tp);
        be->weight_free(be, &tb);
        free(in);
        free(wt);
        free(b);
    }
}

/* cpu_activations bf16 on an AMX CPU: Winograd convolutions prepared in that
 * mode keep bf16 transformed kernels (the tensor's aux) and take their
 * products on the tiles, patches rounded too: within 2e-2 of the double
 * reference relative to the largest output (inputs and kernels in [-1, 1],
 * 32 to 70 channels: the patches are rounded 32 channels at a time, the
 * last chunk ragged), visibly rounded (the tiles ran), the same bytes on one
 * and two threads (other blocks of tiles); the same kernels in the f32 mode
 * give fp32's result. */
static void test_conv2d_winograd_bf16_activations(void) {
    if (!gemm_amx_usable()) {
        printf("skip: no AMX here; convolutions stay fp32 in cpu_activations bf16\n");
        return;
    }
    ar_error_t err = {{0}};
    backend_t *two = backend_cpu_create(2, &err);
    CHECK_MSG(two, "%s", err.msg);
    if (!two)
        return;
    backend_t *bes[2] = {be, two};
    const int cases[][5] = {{32, 48, 29, 31, 1}, {64, 40, 17, 20, 1}, {70, 33, 21, 26, 1}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ci = cases[c][0], co = cases[c][1], h = cases[c][2], w = cases[c][3];
        const int pad = cases[c][4], ho = h + 2 * pad - 2, wo = w + 2 * pad - 2;
        const size_t n_in = (size_t)ci * h * w, n_out = (size_t)co * ho * wo;
        float *in = host_uniform(n_in, -1, 1), *wt = host_uniform((size_t)co * ci * 9, -1, 1);
        double *ref = ref_new(n_out), largest = 0;
        for (int o = 0; o < co; o++)
            for (int y = 0; y < ho; y++)
                for (int x = 0; x < wo; x++) {
                    double sum = 0;
                    for (int i = 0; i < ci; i++)
                        for (int ky = 0; ky < 3; ky++)
                            for (int kx = 0; kx < 3; kx++) {
                                const int iy = y + ky - pad, ix = x + kx - pad;
                                if (iy >= 0 && iy < h && ix >= 0 && ix < w)
                                    sum += (double)wt[((o * ci + i) * 3 + ky) * 3 + kx] *
                                           in[((size_t)i * h + iy) * w + ix];
                            }
                    ref[((size_t)o * ho + y) * wo + x] = sum;
                    largest = fmax(largest, fabs(sum));
                }
        float *first = malloc(n_out * sizeof *first);
        for (int t = 0; t < 2; t++) {
            backend_t *e = bes[t];
            e->cpu_activations = CPU_ACTIVATIONS_BF16;
            tensor_t tp = weight_f32(wt, 4, co, ci, 3, 3);
            CHECK_MSG(e->weight_prepare(e, &tp, LAYOUT_CONV, &err) == AR_OK, "%s", err.msg);
            CHECK(tp.layout == LAYOUT_CONV && tp.aux);
            float *out = malloc(n_out * sizeof *out);
            e->conv2d(e, out, in, &tp, NULL, ci, h, w, pad);
            if (t == 0)
                memcpy(first, out, n_out * sizeof *out);
            else
                CHECK_MSG(memcmp(first, out, n_out * sizeof *out) == 0,
                          "bf16 winograd %dx%dx%d -> %d: two threads' bytes differ from one's", ci,
                          h, w, co);
            double worst = 0;
            for (size_t i = 0; i < n_out; i++)
                worst = fmax(worst, fabs(out[i] - ref[i]));
            CHECK_MSG(worst <= 2e-2 * largest && worst > 1e-5 * largest,
                      "bf16 winograd %dx%dx%d -> %d, %d threads: worst %.3g of %.3g", ci, h, w, co,
                      t + 1, worst, largest);
            e->cpu_activations = CPU_ACTIVATIONS_F32;
            e->conv2d(e, out, in, &tp, NULL, ci, h, w, pad);
            worst = 0;
            for (size_t i = 0; i < n_out; i++)
                worst = fmax(worst, fabs(out[i] - ref[i]));
            CHECK_MSG(worst <= 1e-6 + 2e-7 * ci * 9 * largest, "f32 winograd: worst %.3g", worst);
            e->weight_free(e, &tp);
            free(out);
        }
        free(first);
        free(ref), free(in), free(wt);
    }
    two->destroy(two);
}

/* Includes C=64 with 32 groups, one group, hw=1, and inputs offset by 100
 * (where E[x^2] - E[x]^2 in fp32 would cancel), and SiLU after it in
 * place. 1e-5 abs + 1e-5 rel. */
static void test_groupnorm_groups_and_offsets(void) {
    /* c, hw, groups, offset */
    const int cases[][4] = {
        {64, 7 * 9, 32, 0}, {6, 1, 3, 0}, {8, 13, 1, 0}, {64, 5, 32, 100}, {32, 1031, 32, 0}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], hw = cases[c][1], groups = cases[c][2];
        const size_t n = (size_t)ch * hw;
        float *x = host_uniform(n, -1, 1), *g = host_uniform((size_t)ch, 0.5f, 1.5f);
        float *b = host_uniform((size_t)ch, -1, 1);
        for (size_t i = 0; i < n; i++)
            x[i] += (float)cases[c][3] + (float)(i / hw % 3);
        tensor_t tg = weight_f32(g, 1, ch, 1, 1, 1), tb = weight_f32(b, 1, ch, 1, 1, 1);
        const float eps = c % 2 ? 1e-5f : 1e-6f;
        double *ref = ref_new(n);
        const int cpg = ch / groups;
        for (int grp = 0; grp < groups; grp++) {
            const size_t m = (size_t)cpg * hw, o = (size_t)grp * m;
            double mean = 0, var = 0;
            for (size_t i = 0; i < m; i++)
                mean += x[o + i];
            mean /= m;
            for (size_t i = 0; i < m; i++)
                var += (x[o + i] - mean) * (x[o + i] - mean);
            var /= m;
            for (size_t i = 0; i < m; i++) {
                const int cc = (int)((o + i) / hw);
                ref[o + i] = (x[o + i] - mean) / sqrt(var + eps) * g[cc] + b[cc];
            }
        }
        float *dx = dev_from(x, n), *dout = dev_new(n);
        be->groupnorm(be, dout, dx, &tg, &tb, ch, hw, groups, eps, 0);
        check_dev("groupnorm", dout, ref, n, 1e-5, 1e-5);
        /* in place, with the SiLU the decoder fuses into it */
        for (size_t i = 0; i < n; i++)
            ref[i] = ref[i] / (1 + exp(-ref[i]));
        be->groupnorm(be, dx, dx, &tg, &tb, ch, hw, groups, eps, 1);
        check_dev("groupnorm+silu in place", dx, ref, n, 1e-5, 1e-5);
        dev_del(dx);
        dev_del(dout);
        be->weight_free(be, &tg);
        be->weight_free(be, &tb);
        free(ref);
        free(x);
        free(g);
        free(b);
    }
}

static void test_upsample_nearest2x_exact(void) {
    const int cases[][3] = {{3, 1, 1}, {2, 5, 7}, {1, 1, 9}, {0, 2, 2}, {4, 48, 45}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], h = cases[c][1], w = cases[c][2];
        const size_t n = (size_t)ch * h * w;
        float *x = host_uniform(n, -1, 1);
        double *ref = ref_new(4 * n);
        for (int i = 0; i < ch; i++)
            for (int y = 0; y < 2 * h; y++)
                for (int xx = 0; xx < 2 * w; xx++)
                    ref[((size_t)i * 2 * h + y) * 2 * w + xx] =
                        x[((size_t)i * h + y / 2) * w + xx / 2];
        float *dx = dev_from(x, n), *dout = dev_new(4 * n);
        be->upsample_nearest2x(be, dout, dx, ch, h, w);
        check_dev("upsample_nearest2x", dout, ref, 4 * n, 0, 0);
        dev_del(dx);
        dev_del(dout);
        free(ref);
        free(x);
    }
}

static void test_transpose_exact(void) {
    const int cases[][2] = {{1, 1}, {1, 17}, {17, 1}, {33, 65}, {100, 37}, {0, 5}, {257, 200}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], cols = cases[c][1];
        const size_t n = (size_t)rows * cols;
        float *x = host_uniform(n, -1, 1);
        double *ref = ref_new(n);
        for (int i = 0; i < rows; i++)
            for (int j = 0; j < cols; j++)
                ref[(size_t)j * rows + i] = x[(size_t)i * cols + j];
        float *dx = dev_from(x, n), *dout = dev_new(n);
        be->transpose(be, dout, dx, rows, cols);
        check_dev("transpose", dout, ref, n, 0, 0);
        dev_del(dx);
        dev_del(dout);
        free(ref);
        free(x);
    }
}

/* ---- next-scale (VAR) ops -------------------------------------------------------- */

/* Dense reference of attention_scale: for each (sequence, head), the keys are
 * the cache's len rows followed by the sequence's n_new rows of k_new / v_new
 * (head h), and every query row of the sequence sees all of them (no causal
 * mask within a scale). Double, max-subtracted; mass_ref[pair][j] += p_j. */
static void attention_scale_reference(double *ref, double **mass_ref, const float *q,
                                      const float *k_new, const float *v_new, float *const *k,
                                      float *const *v, const int *q_start, const int *cache_len,
                                      int n_seq, int n_heads, int hd, float scale) {
    for (int s = 0; s < n_seq; s++) {
        const int n_new = q_start[s + 1] - q_start[s];
        for (int h = 0; h < n_heads; h++) {
            const int i = s * n_heads + h, len = cache_len[i], keys = len + n_new;
            double *p = malloc((keys ? keys : 1) * sizeof *p);
            for (int t = 0; t < n_new; t++) {
                const size_t row = ((size_t)(q_start[s] + t) * n_heads + h) * hd;
                double mx = -INFINITY, sum = 0;
                for (int j = 0; j < keys; j++) {
                    const float *kj =
                        j < len ? k[i] + (size_t)j * hd
                                : k_new + ((size_t)(q_start[s] + j - len) * n_heads + h) * hd;
                    double dot = 0;
                    for (int e = 0; e < hd; e++)
                        dot += (double)q[row + e] * kj[e];
                    p[j] = dot * scale;
                    mx = p[j] > mx ? p[j] : mx;
                }
                for (int j = 0; j < keys; j++)
                    sum += p[j] = exp(p[j] - mx);
                for (int e = 0; e < hd; e++) {
                    double o = 0;
                    for (int j = 0; j < keys; j++) {
                        const float *vj =
                            j < len ? v[i] + (size_t)j * hd
                                    : v_new + ((size_t)(q_start[s] + j - len) * n_heads + h) * hd;
                        o += p[j] * vj[e];
                    }
                    ref[row + e] = o / sum;
                }
                if (mass_ref && mass_ref[i])
                    for (int j = 0; j < keys; j++)
                        mass_ref[i][j] += p[j] / sum;
            }
            free(p);
        }
    }
}

/* attention_scale over a ragged batch (n_new[s] rows per sequence, some 0)
 * whose caches (cache_len per pair, some 0) sit in shuffled blocks of bt
 * tokens; q and k_new in [-amp, amp]. Key mass: pairs i % 3 == 0 start from
 * random values (it must be added to), i % 3 == 1 from zeros, i % 3 == 2
 * collect none. The outputs and every mass must match the dense reference,
 * and each mass must have grown by the number of the sequence's query rows
 * (each row's probabilities sum to 1). */
/* The largest error of check_attention_scale's last output. */
static double scale_worst;

static void check_attention_scale(int n_seq, const int *n_new, const int *cache_len, int n_heads,
                                  int hd, int bt, float amp, float scale, double abs_tol,
                                  double rel_tol) {
    const int pairs = n_seq * n_heads;
    int *q_start = malloc(((size_t)n_seq + 1) * sizeof *q_start);
    q_start[0] = 0;
    for (int s = 0; s < n_seq; s++)
        q_start[s + 1] = q_start[s] + n_new[s];
    const int rows = q_start[n_seq];
    const size_t n = (size_t)rows * n_heads * hd;
    paged_t pg;
    paged_build(&pg, bt, hd, pairs, cache_len, cache_len, amp, 3);
    float **hk = malloc(pairs * sizeof *hk), **hv = malloc(pairs * sizeof *hv);
    float **dmass = calloc(pairs, sizeof *dmass);
    double **mass_ref = calloc(pairs, sizeof *mass_ref), *mass0 = calloc(pairs, sizeof *mass0);
    for (int i = 0; i < pairs; i++) {
        const int keys = cache_len[i] + n_new[i / n_heads];
        hk[i] = paged_rows(&pg, i, cache_len[i], 0);
        hv[i] = paged_rows(&pg, i, cache_len[i], 1);
        if (i % 3 == 2)
            continue;
        float *m0 = host_uniform((size_t)keys, 0, 1);
        mass_ref[i] = ref_new((size_t)keys);
        for (int j = 0; j < keys; j++) {
            if (i % 3 == 1)
                m0[j] = 0;
            mass_ref[i][j] = m0[j];
            mass0[i] += m0[j];
        }
        dmass[i] = dev_from(m0, (size_t)keys);
        free(m0);
    }
    float *q = host_uniform(n, -amp, amp), *kn = host_uniform(n, -amp, amp);
    float *vn = host_uniform(n, -1, 1);
    float *dq = dev_from(q, n), *dk = dev_from(kn, n), *dv = dev_from(vn, n), *dout = dev_new(n);
    const attn_batch_t batch = {n_seq, q_start, pg.views, dmass};
    be->attention_scale(be, dout, dq, dk, dv, &pg.pool, &batch, n_heads, scale);
    double *ref = ref_new(n);
    attention_scale_reference(ref, mass_ref, q, kn, vn, hk, hv, q_start, cache_len, n_seq, n_heads,
                              hd, scale);
    char what[128];
    snprintf(what, sizeof what, "attention_scale seqs=%d heads=%d hd=%d bt=%d amp=%g", n_seq,
             n_heads, hd, bt, amp);
    check_dev(what, dout, ref, n, abs_tol, rel_tol);
    /* Without key mass the rows are split into more work items (groups of
     * a pair, not whole pairs): the same bits. */
    float *dout2 = dev_new(n);
    const attn_batch_t no_mass = {n_seq, q_start, pg.views, NULL};
    be->attention_scale(be, dout2, dq, dk, dv, &pg.pool, &no_mass, n_heads, scale);
    float *with = dev_to_host(dout, n), *without = dev_to_host(dout2, n);
    CHECK_MSG(!memcmp(with, without, n * sizeof(float)), "%s: rows differ without key mass", what);
    free(with), free(without);
    dev_del(dout2);
    float *out = dev_to_host(dout, n);
    scale_worst = 0;
    for (size_t i = 0; i < n; i++)
        scale_worst = fmax(scale_worst, fabs(out[i] - ref[i]));
    free(out);
    CHECK(dev_guards_ok(pg.pool.base, pg.n_floats) && dev_guards_ok(dq, n) &&
          dev_guards_ok(dk, n) && dev_guards_ok(dv, n));
    for (int i = 0; i < pairs; i++) {
        if (!dmass[i])
            continue;
        const int s = i / n_heads, keys = cache_len[i] + n_new[s];
        snprintf(what, sizeof what, "attention_scale mass pair %d (%d cached + %d new) bt=%d", i,
                 cache_len[i], n_new[s], bt);
        /* fp32's mass within 1e-6 + 1e-5 rel whatever the output's bounds; bf16's at its own */
        const int coarse = abs_tol >= 1e-3;
        check_dev(what, dmass[i], mass_ref[i], (size_t)keys, coarse ? abs_tol : 1e-6,
                  coarse ? rel_tol : 1e-5);
        float *got = dev_to_host(dmass[i], (size_t)keys);
        double sum = 0;
        for (int j = 0; j < keys; j++)
            sum += got[j];
        CHECK_NEAR(sum - mass0[i], (double)n_new[s], 1e-4, 0);
        free(got);
        dev_del(dmass[i]);
    }
    for (int i = 0; i < pairs; i++) {
        free(mass_ref[i]);
        free(hk[i]);
        free(hv[i]);
    }
    paged_free(&pg);
    dev_del(dq), dev_del(dk), dev_del(dv), dev_del(dout);
    free(q), free(kn), free(vn), free(ref), free(q_start), free(hk), free(hv), free(dmass),
        free(mass_ref), free(mass0);
}

/* A bf16 or fp16 cache is read where it lies, widened in registers: attention
 * and attention_scale (whose chunks mix cached rows with the scale's new
 * fp32 ones) give the bytes they give on an fp32 cache holding the same
 * values, with key mass, on ragged lengths across chunk boundaries. */
static void test_attention_16bit_cache_equals_its_fp32_widening(void) {
    enum { SEQS = 3, H = 2, HD = 24, BT = 16 };
    const int n_new[SEQS] = {1, 5, 3}, cache_len[SEQS * H] = {0, 7, 250, 300, 33, 256};
    int q_start[SEQS + 1] = {0}, kv_len[SEQS * H];
    for (int s = 0; s < SEQS; s++)
        q_start[s + 1] = q_start[s] + n_new[s];
    for (int i = 0; i < SEQS * H; i++)
        kv_len[i] = cache_len[i] + n_new[i / H];
    const size_t n = (size_t)q_start[SEQS] * H * HD;
    for (int t = 0; t < 2; t++) {
        const dtype_t dt = t ? DTYPE_F16 : DTYPE_BF16;
        paged_t pg;
        paged_build(&pg, BT, HD, SEQS * H, kv_len, kv_len, 1, 2);
        uint16_t *h16 = malloc(pg.n_floats * sizeof *h16);
        for (size_t e = 0; e < pg.n_floats; e++) { /* NaN sentinels stay NaN */
            h16[e] = dt == DTYPE_F16 ? f32_to_f16(pg.host[e]) : f32_to_bf16(pg.host[e]);
            pg.host[e] = dt == DTYPE_F16 ? f16_to_f32(h16[e]) : bf16_to_f32(h16[e]);
        }
        float *wide = dev_from(pg.host, pg.n_floats);
        void *narrow = be->alloc(be, pg.n_floats * sizeof *h16);
        be->upload(be, narrow, h16, pg.n_floats * sizeof *h16);
        const kv_blocks_t pools[2] = {{wide, DTYPE_F32, BT, HD}, {narrow, dt, BT, HD}};
        float *q = host_uniform(n, -1, 1), *kn = host_uniform(n, -1, 1),
              *vn = host_uniform(n, -1, 1);
        float *out[2][2], *mass[2][SEQS * H];
        for (int p = 0; p < 2; p++) {
            for (int i = 0; i < SEQS * H; i++) {
                mass[p][i] = calloc((size_t)kv_len[i], sizeof(float));
                pg.views[i].len = kv_len[i]; /* attention: the new rows are cached */
            }
            attn_batch_t batch = {SEQS, q_start, pg.views, mass[p]};
            out[p][0] = calloc(n, sizeof(float));
            be->attention(be, out[p][0], q, &pools[p], &batch, H, 0.2f);
            for (int i = 0; i < SEQS * H; i++)
                pg.views[i].len = cache_len[i]; /* attention_scale: they are not */
            out[p][1] = calloc(n, sizeof(float));
            be->attention_scale(be, out[p][1], q, kn, vn, &pools[p], &batch, H, 0.2f);
        }
        for (int o = 0; o < 2; o++)
            CHECK_MSG(!memcmp(out[0][o], out[1][o], n * sizeof(float)),
                      "%s cache: %s differs from the fp32 cache's", dtype_name(dt),
                      o ? "attention_scale" : "attention");
        for (int i = 0; i < SEQS * H; i++)
            CHECK_MSG(!memcmp(mass[0][i], mass[1][i], (size_t)kv_len[i] * sizeof(float)),
                      "%s cache: key mass of pair %d differs", dtype_name(dt), i);
        for (int p = 0; p < 2; p++) {
            free(out[p][0]), free(out[p][1]);
            for (int i = 0; i < SEQS * H; i++)
                free(mass[p][i]);
        }
        dev_del(wide);
        be->free(be, narrow);
        free(h16), free(q), free(kn), free(vn);
        paged_free(&pg);
    }
}

/* Five sequences of 1, 4, 0, 3 and 70 new rows (a scale each; 70 is two
 * query tiles, with key mass on some heads and not others); per head a
 * cache of 0 (the first scale), 1, 5, 37, 250 (cached and new keys share a
 * 256-key chunk of the online softmax), 256 or 300 tokens, at every block
 * size; head dims 5 and 64: 1e-6 abs + 1e-5 rel. */
static void test_attention_scale_ragged_paged_against_dense(void) {
    enum { SEQS = 5, H = 3 };
    const int n_new[SEQS] = {1, 4, 0, 3, 70}, lens[] = {0, 1, 5, 250, 37, 256, 300};
    const int n_lens = sizeof lens / sizeof *lens;
    int cache_len[SEQS * H];
    for (int i = 0; i < SEQS * H; i++)
        cache_len[i] = lens[(i * 5) % n_lens];
    cache_len[0] = 0;       /* the one-row sequence's first head: a first scale */
    cache_len[4 * H] = 250; /* 250 cached + 9 new keys straddle a chunk boundary */
    for (int c = 0; c < N_BLOCK_SIZES; c++) {
        const int bt = test_block_tokens[c];
        check_attention_scale(SEQS, n_new, cache_len, H, 5, bt, 1, 1 / sqrtf(5), 1e-6, 1e-5);
        check_attention_scale(SEQS, n_new, cache_len, H, 64, bt, 1, 1 / sqrtf(64), 1e-6, 1e-5);
    }
    const int first_scale[2] = {1, 4}, empty[2 * H] = {0};
    check_attention_scale(2, first_scale, empty, H, 8, 3, 1, 0.35f, 1e-6, 1e-5);
}

/* Scales of hundreds of rows, as the last scales of a 512 px image: a
 * pair's rows in several groups (each packing a key block once for up to
 * ATTN_GROUP_TILES tiles), against caches of 0 to 700 keys, at head dims 64
 * (groups of 1,024 rows) and 200 (of 256): 1e-6 abs + 1e-5 rel, with key
 * mass summed over every group of a pair. */
static void test_attention_scale_many_rows_in_groups(void) {
    enum { SEQS = 2, H = 2 };
    const int n_new[SEQS] = {1100, 530}, cache_len[SEQS * H] = {0, 300, 700, 1};
    check_attention_scale(SEQS, n_new, cache_len, H, 64, 16, 1, 1 / sqrtf(64), 1e-6, 1e-5);
    check_attention_scale(SEQS, n_new, cache_len, H, 200, 7, 1, 1 / sqrtf(200), 1e-6, 1e-5);
}

/* cpu_activations bf16 on an AMX CPU: a scale's attention on the tiles, Q,
 * K, V and the softmax's weights rounded to bf16 (8 bits: a weight or a
 * value off by up to 2^-9 relative), with key mass, at head dims 64 and 24
 * and two block sizes: within 2e-2 of the double reference, and visibly
 * rounded (the tiles ran, not the fp32 kernels). */
static void test_attention_scale_bf16_activations(void) {
    if (!gemm_amx_usable()) {
        printf("skip: no AMX here; attention stays fp32 in cpu_activations bf16\n");
        return;
    }
    enum { SEQS = 5, H = 3 };
    const int n_new[SEQS] = {1, 40, 0, 3, 70}, lens[] = {0, 1, 37, 256, 300};
    const int n_lens = sizeof lens / sizeof *lens;
    int cache_len[SEQS * H];
    for (int i = 0; i < SEQS * H; i++)
        cache_len[i] = lens[(i * 7) % n_lens];
    be->cpu_activations = CPU_ACTIVATIONS_BF16;
    for (int hd = 24; hd <= 64; hd += 40)
        for (int bt = 7; bt <= 16; bt += 9) {
            check_attention_scale(SEQS, n_new, cache_len, H, hd, bt, 1, 1 / sqrtf((float)hd), 2e-2,
                                  2e-2);
            CHECK_MSG(scale_worst > 1e-5, "hd=%d: worst error %.3g, as fp32's", hd, scale_worst);
        }
    const int many[2] = {600, 530}, caches[4] = {0, 300, 700, 1};
    check_attention_scale(2, many, caches, 2, 200, 7, 1, 1 / sqrtf(200), 2e-2, 2e-2);
    be->cpu_activations = CPU_ACTIVATIONS_F32;
}

/* Scores in the thousands, so the running maximum moves between cached and
 * new keys (rescaling the sums). A float's step at 1000 is 6e-5, and a
 * score's rounding moves its probability by as much relatively; the scores
 * are GEMM outputs, one chain of head_dim multiply-adds each (PyTorch's
 * accuracy): 5e-5 abs + 1e-4 rel. */
static void test_attention_scale_large_scores(void) {
    enum { SEQS = 3, H = 2 };
    const int n_new[SEQS] = {2, 7, 5}, cache_len[SEQS * H] = {517, 0, 300, 61, 9, 256};
    check_attention_scale(SEQS, n_new, cache_len, H, 16, 16, 8, 1.0f, 5e-5, 1e-4);
}

/* By hand: all keys 0 (every score equal), so each output is the plain mean
 * of the values and each key's mass is rows / keys. One cached key with
 * value 1, new keys with values 3 and 5: both query rows see both new keys
 * (not causal), out = (1 + 3 + 5) / 3 = 3, mass 2/3 each. */
static void test_attention_scale_by_hand(void) {
    const int q_start[2] = {0, 2}, table[1] = {0};
    const kv_view_t view = {table, 1, 1, 1};
    const float pool_host[2] = {0, 1}; /* block 0 of 1 token, hd 1: K row, V row */
    const float q[2] = {0.7f, -2}, k_new[2] = {0, 0}, v_new[2] = {3, 5};
    float *dpool = dev_from(pool_host, 2), *dq = dev_from(q, 2), *dk = dev_from(k_new, 2);
    float *dv = dev_from(v_new, 2), *dout = dev_new(2), *dmass = dev_from((float[3]){0}, 3);
    const kv_blocks_t pool = {dpool, DTYPE_F32, 1, 1};
    float *mass[1] = {dmass};
    const attn_batch_t batch = {1, q_start, &view, mass};
    be->attention_scale(be, dout, dq, dk, dv, &pool, &batch, 1, 1.0f);
    const double out_ref[2] = {3, 3}, mass_ref[3] = {2.0 / 3, 2.0 / 3, 2.0 / 3};
    check_dev("attention_scale by hand", dout, out_ref, 2, 1e-6, 0);
    check_dev("attention_scale mass by hand", dmass, mass_ref, 3, 1e-6, 0);
    dev_del(dpool), dev_del(dq), dev_del(dk), dev_del(dv), dev_del(dout), dev_del(dmass);
}

/* References computed with PyTorch 2.x (torch.nn.functional as F, float32
 * tensors on the CPU, printed with %.9g) on the inputs defined here:
 * layernorm_rows, gelu_tanh_x, and resize_pattern(c, h, w) as a (1, c, h, w)
 * tensor. Each array's comment is the call that made it. */
static const float layernorm_rows[4 * 7] = {
    1, 2, 3, 4, 5, 6, 7, 1000.5f, 1000.25f, 1000, 1000.75f, 999.5f, 1001, 1000.125f,
    2, 2, 2, 2, 2, 2, 2, -3,      0.5f,     8,    -0.25f,   1e-3f,  4,    -7};
static const float gelu_tanh_x[14] = {-10,   -5,   -3, -1, -0.5f, -1e-3f, 0,
                                      1e-3f, 0.5f, 1,  2,  3,     5,      10};
/* F.interpolate(x, size=(5, 5), mode='bicubic', align_corners=False), x the 3x3 ramp 0..8 */
static const float torch_bicubic_ramp_3x3_to_5x5[25] = {
    -0.383999854f, 0.0280006677f, 0.712000251f, 1.39600039f, 1.80800056f, 0.852001488f, 1.26400173f,
    1.94800138f,   2.63200116f,   3.04400182f,  2.90400028f, 3.31600022f, 4.0f,         4.68400002f,
    5.09600067f,   4.95600033f,   5.36800003f,  6.05200005f, 6.73600054f, 7.14800119f,  6.19200182f,
    6.60400057f,   7.28800106f,   7.97200251f,  8.38400173f};
/* F.interpolate(resize_pattern(2, 4, 6), size=(3, 4), mode='bicubic', align_corners=False) */
static const float torch_bicubic_2x4x6_to_3x4[24] = {
    -1.18854475f,   -0.541327596f, 1.56877553f,    -1.31692648f, 0.769165039f,  -0.875488281f,
    0.131958008f,   1.2668457f,    0.055749476f,   0.340011567f, -1.12134731f,  -0.186654508f,
    0.0360876061f,  0.32034868f,   0.00249572098f, 0.937188208f, 1.07275391f,   -0.621337891f,
    -0.0521240234f, 0.654296875f,  0.559761047f,   1.65863645f,  -0.657280266f, 0.371406406f};
/* F.interpolate(resize_pattern(2, 2, 3), size=(5, 7), mode='bicubic', align_corners=False) */
static const float torch_bicubic_2x2x3_to_5x7[70] = {
    -2.60875535f,  -1.75735915f,   0.107616164f,  1.33074951f,    0.632396996f,  -0.865231156f,
    -1.4994266f,   -2.11916256f,   -1.501773f,    -0.166466206f,  0.753999591f,  0.358314663f,
    -0.609645009f, -1.00983369f,   -1.05466461f,  -0.946064115f,  -0.762390316f, -0.5f,
    -0.237609446f, -0.0539363921f, 0.0546647273f, 0.00983444974f, -0.390354693f, -1.35831499f,
    -1.7540009f,   -0.833534181f,  0.501772821f,  1.11916423f,    0.499426186f,  -0.134769127f,
    -1.63239741f,  -2.33075047f,   -1.10761642f,  0.75735867f,    1.60875678f,   0.248159021f,
    -0.259071916f, -1.50357533f,   -1.97049999f,  -0.689509332f,  1.12484014f,   1.96900606f,
    0.632658958f,  0.138038799f,   -1.01818645f,  -1.58599997f,   -0.70856595f,  0.664393306f,
    1.28716302f,   1.46865857f,    1.00145745f,   0.0371715501f,  -0.75f,        -0.749999821f,
    -0.336733937f, -0.195335269f,  2.30465889f,   1.8648771f,     1.09253061f,   0.0860007554f,
    -0.791433752f, -1.33786225f,   -1.67783511f,  2.68915939f,    2.26198792f,   1.57791913f,
    0.470500052f,  -0.810490668f,  -1.79830885f,  -2.35967731f};
/* F.interpolate(resize_pattern(1, 16, 5), size=(13, 3), mode='area') */
static const float torch_area_1x16x5_to_13x3[39] = {
    -0.75f,        0.0f,         0.75f,  0.0f,          -0.5f,        0.25f,         0.75f,
    -0.166666672f, -0.25f,       0.25f,  0.166666672f,  -0.75f,       -0.5f,         0.111111112f,
    0.166666672f,  0.0f,         -0.5f,  0.25f,         0.75f,        -0.166666672f, -0.25f,
    0.25f,         0.166666672f, -0.75f, -0.5f,         0.111111112f, 0.166666672f,  0.0f,
    -0.5f,         0.25f,        0.75f,  -0.166666672f, -0.25f,       0.25f,         0.166666672f,
    -0.75f,        -0.25f,       0.5f,   0.0f};
/* F.interpolate(resize_pattern(2, 4, 6), size=(3, 4), mode='area') */
static const float torch_area_2x4x6_to_3x4[24] = {
    -0.75f, -0.25f, 0.75f, 0.0f, 0.0f, -0.75f, 0.25f, 0.75f, 0.75f, 0.0f, -0.25f, 0.25f,
    0.25f,  -0.5f,  0.5f,  1.0f, 1.0f, 0.25f,  0.0f,  0.5f,  0.5f,  1.0f, -0.5f,  0.0f};
/* F.interpolate(resize_pattern(2, 2, 3), size=(3, 5), mode='area') */
static const float torch_area_2x2x3_to_3x5[30] = {
    -2.0f, -0.5f, 1.0f,   0.0f,  -1.0f,  -1.0f, -0.75f, -0.5f,  -0.25f, 0.0f,
    0.0f,  -1.0f, -2.0f,  -0.5f, 1.0f,   0.25f, -0.75f, -1.75f, -0.25f, 1.25f,
    1.25f, 0.25f, -0.75f, -0.5f, -0.25f, 2.25f, 1.25f,  0.25f,  -0.75f, -1.75f};
/* F.layer_norm(layernorm_rows.view(4, 7), (7,), eps=1e-6) */
static const float torch_layernorm_eps_1e6[28] = {
    -1.49999976f,  -0.999999881f,  -0.49999994f,  0.0f,          0.49999994f,   0.999999881f,
    1.49999976f,   0.424931049f,   -0.115938306f, -0.656807661f, 0.965800405f,  -1.73854637f,
    1.50666976f,   -0.386372983f,  0.0f,          0.0f,          0.0f,          0.0f,
    0.0f,          0.0f,           0.0f,          -0.749206066f, 0.0402459316f, 1.73192883f,
    -0.128922358f, -0.0723073706f, 0.829697967f,  -1.65143692f};
/* F.layer_norm(layernorm_rows.view(4, 7), (7,), eps=1e-5) */
static const float torch_layernorm_eps_1e5[28] = {
    -1.49999821f,  -0.999998808f,  -0.499999404f, 0.0f,          0.499999404f,  0.999998808f,
    1.49999821f,   0.424922109f,   -0.115935862f, -0.656793833f, 0.965780079f,  -1.73850977f,
    1.50663805f,   -0.386364847f,  0.0f,          0.0f,          0.0f,          0.0f,
    0.0f,          0.0f,           0.0f,          -0.749206007f, 0.0402459279f, 1.73192871f,
    -0.128922343f, -0.0723073632f, 0.829697907f,  -1.65143681f};
/* F.gelu(gelu_tanh_x, approximate='tanh') */
static const float torch_gelu_tanh[14] = {-0.0f,
                                          -2.98023224e-07f,
                                          -0.00363743305f,
                                          -0.158807993f,
                                          -0.154285997f,
                                          -0.000499601068f,
                                          0.0f,
                                          0.000500398979f,
                                          0.345714003f,
                                          0.841192007f,
                                          1.95459771f,
                                          2.99636269f,
                                          4.99999952f,
                                          10.0f};

/* Mean and biased variance in double, as the reference below. */
static void layernorm_reference(double *ref, const float *x, int rows, int dim, double eps) {
    for (int r = 0; r < rows; r++) {
        const float *xr = x + (size_t)r * dim;
        double mean = 0, var = 0;
        for (int i = 0; i < dim; i++)
            mean += xr[i];
        mean /= dim;
        for (int i = 0; i < dim; i++)
            var += (xr[i] - mean) * (xr[i] - mean);
        var /= dim;
        for (int i = 0; i < dim; i++)
            ref[(size_t)r * dim + i] = (xr[i] - mean) / sqrt(var + eps);
    }
}

/* Against PyTorch (layernorm_rows; the ramp by hand: (x - 4) / sqrt(4 +
 * eps)), then random rows of 1 to 4096 (a row of 1 is all zeros), out of
 * place and in place: 1e-6 abs + 1e-5 rel; and the same rows offset by 100,
 * where the mean, rounded to fp32 before it is subtracted (as PyTorch does),
 * may be off by ulp(100) / 2 = 3.8e-6: 1e-5 abs. */
static void test_layernorm_against_torch_and_double(void) {
    const float *torch_ref[2] = {torch_layernorm_eps_1e6, torch_layernorm_eps_1e5};
    const float eps[2] = {1e-6f, 1e-5f};
    for (int e = 0; e < 2; e++) {
        double ref[28];
        for (int i = 0; i < 28; i++)
            ref[i] = torch_ref[e][i];
        float *dx = dev_from(layernorm_rows, 28), *dy = dev_new(28);
        be->layernorm(be, dy, dx, 4, 7, eps[e]);
        check_dev("layernorm vs torch", dy, ref, 28, 1e-6, 1e-5);
        for (int i = 0; i < 7; i++) /* the ramp, by hand */
            ref[i] = (i - 3) / sqrt(4 + (double)eps[e]);
        float *got = dev_to_host(dy, 7);
        check_close("layernorm ramp by hand", got, ref, 7, 1e-7, 1e-6);
        free(got);
        dev_del(dx);
        dev_del(dy);
    }
    const int cases[][2] = {{3, 1}, {2, 4096}, {5, 1000}, {0, 8}, {17, 33}};
    for (int off = 0; off < 2; off++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            const int rows = cases[c][0], dim = cases[c][1];
            const size_t n = (size_t)rows * dim;
            const double tol = off ? 1e-5 : 1e-6;
            float *x = host_uniform(n, -2, 2);
            for (size_t i = 0; i < n; i++)
                x[i] += off ? 100.0f : 0.0f;
            double *ref = ref_new(n);
            layernorm_reference(ref, x, rows, dim, 1e-6);
            float *dx = dev_from(x, n), *dy = dev_new(n);
            be->layernorm(be, dy, dx, rows, dim, 1e-6f);
            check_dev(off ? "layernorm offset 100" : "layernorm", dy, ref, n, tol, 1e-5);
            be->layernorm(be, dx, dx, rows, dim, 1e-6f);
            check_dev("layernorm in place", dx, ref, n, tol, 1e-5);
            dev_del(dx);
            dev_del(dy);
            free(ref);
            free(x);
        }
}

/* modulate: y = x * (1 + scale) + shift per column, by hand and on random
 * rows, in place too; gate_add: y += a * gate per column. Both are one or
 * two fp32 operations per element: 1e-6 rel. */
static void test_modulate_and_gate_add(void) {
    const float x[4] = {1, 2, 3, 4}, sc[2] = {0.5f, -1}, sh[2] = {10, 20}, gate[2] = {2, -0.5f};
    float *dx = dev_from(x, 4), *dsc = dev_from(sc, 2), *dsh = dev_from(sh, 2), *dy = dev_new(4);
    be->modulate(be, dy, dx, dsc, dsh, 2, 2);
    const double mod_ref[4] = {11.5, 20, 14.5, 20};
    check_dev("modulate by hand", dy, mod_ref, 4, 0, 0);
    float *dg = dev_from(gate, 2);
    be->gate_add(be, dy, dx, dg, 2, 2); /* y = mod_ref + x * gate */
    const double gate_ref[4] = {13.5, 19, 20.5, 18};
    check_dev("gate_add by hand", dy, gate_ref, 4, 0, 0);
    dev_del(dx), dev_del(dsc), dev_del(dsh), dev_del(dy), dev_del(dg);

    const int cases[][2] = {{1, 1}, {7, 33}, {0, 5}, {64, 1024}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], dim = cases[c][1];
        const size_t n = (size_t)rows * dim;
        float *xr = host_uniform(n, -3, 3), *a = host_uniform(n, -3, 3);
        float *s = host_uniform((size_t)dim, -1, 1), *t = host_uniform((size_t)dim, -1, 1);
        double *ref = ref_new(n);
        for (size_t i = 0; i < n; i++)
            ref[i] = (double)xr[i] * (1 + (double)s[i % dim]) + t[i % dim];
        float *px = dev_from(xr, n), *py = dev_new(n), *ps = dev_from(s, (size_t)dim);
        float *pt = dev_from(t, (size_t)dim), *pa = dev_from(a, n);
        be->modulate(be, py, px, ps, pt, rows, dim);
        check_dev("modulate", py, ref, n, 1e-6, 1e-6);
        be->modulate(be, px, px, ps, pt, rows, dim);
        check_dev("modulate in place", px, ref, n, 1e-6, 1e-6);
        for (size_t i = 0; i < n; i++)
            ref[i] += (double)a[i] * t[i % dim];
        be->gate_add(be, py, pa, pt, rows, dim);
        check_dev("gate_add", py, ref, n, 1e-6, 1e-6);
        CHECK(dev_guards_ok(pa, n) && dev_guards_ok(pt, (size_t)dim));
        dev_del(px), dev_del(py), dev_del(ps), dev_del(pt), dev_del(pa);
        free(xr), free(a), free(s), free(t), free(ref);
    }
}

/* Per-head L2 normalisation as F.normalize(x, dim=-1) (norm clamped at
 * 1e-12) times mul[h]: by hand ([3, 4] -> [0.6, 0.8], a zero head stays 0),
 * then random rows with a head of 1e-14 values (the clamp), with and
 * without mul: 1e-7 abs + 1e-6 rel. */
static void test_l2norm_heads(void) {
    const float x[8] = {3, 4, 0, 0, 1, 0, -5, 12}, mul[2] = {2, -1};
    const double plain[8] = {0.6, 0.8, 0, 0, 1, 0, -5.0 / 13, 12.0 / 13};
    const double scaled[8] = {1.2, 1.6, 0, 0, 2, 0, 5.0 / 13, -12.0 / 13};
    float *dx = dev_from(x, 8), *dm = dev_from(mul, 2);
    be->l2norm_heads(be, dx, NULL, 2, 2, 2);
    check_dev("l2norm_heads by hand", dx, plain, 8, 1e-7, 1e-6);
    be->upload(be, dx, x, sizeof x);
    be->l2norm_heads(be, dx, dm, 2, 2, 2);
    check_dev("l2norm_heads with mul by hand", dx, scaled, 8, 1e-7, 1e-6);
    dev_del(dx);
    dev_del(dm);

    const int cases[][3] = {{5, 3, 16}, {1, 1, 1}, {0, 2, 8}, {33, 16, 64}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], heads = cases[c][1], hd = cases[c][2];
        const size_t n = (size_t)rows * heads * hd;
        float *xr = host_uniform(n, -2, 2), *m = host_uniform((size_t)heads, 0.5f, 4);
        for (int d = 0; n > 0 && d < hd; d++)
            xr[d] *= 1e-14f; /* row 0, head 0: norm below 1e-12 */
        for (int with_mul = 0; with_mul < 2; with_mul++) {
            double *ref = ref_new(n);
            for (size_t i = 0; i < n / (hd ? hd : 1); i++) {
                double ss = 0;
                for (int d = 0; d < hd; d++)
                    ss += (double)xr[i * hd + d] * xr[i * hd + d];
                const double f = (with_mul ? m[i % heads] : 1) / fmax(sqrt(ss), 1e-12);
                for (int d = 0; d < hd; d++)
                    ref[i * hd + d] = xr[i * hd + d] * f;
            }
            float *px = dev_from(xr, n), *pm = dev_from(m, (size_t)heads);
            be->l2norm_heads(be, px, with_mul ? pm : NULL, rows, heads, hd);
            check_dev(with_mul ? "l2norm_heads mul" : "l2norm_heads", px, ref, n, 1e-7, 1e-6);
            dev_del(px);
            dev_del(pm);
            free(ref);
        }
        free(xr);
        free(m);
    }
}

/* Against PyTorch at gelu_tanh_x, then random inputs against the formula
 * in double: 1e-6 abs + 1e-5 rel (tanh near +-1 loses fp32 bits either
 * way). */

static void test_gelu_tanh_against_torch_and_double(void) {
    double ref14[14];
    for (int i = 0; i < 14; i++)
        ref14[i] = torch_gelu_tanh[i];
    float *dx = dev_from(gelu_tanh_x, 14);
    be->gelu_tanh(be, dx, 14);
    check_dev("gelu_tanh vs torch", dx, ref14, 14, 1e-6, 1e-5);
    dev_del(dx);
    for (size_t c = 0; c < sizeof ew_sizes / sizeof *ew_sizes; c++) {
        const size_t n = ew_sizes[c];
        float *x = ew_input(n);
        double *ref = ref_new(n);
        for (size_t i = 0; i < n; i++) {
            const double v = x[i];
            ref[i] = 0.5 * v * (1 + tanh(sqrt(2 / M_PI) * (v + 0.044715 * v * v * v)));
        }
        float *d = dev_from(x, n);
        be->gelu_tanh(be, d, n);
        check_dev("gelu_tanh", d, ref, n, 1e-6, 1e-5);
        dev_del(d);
        free(ref);
        free(x);
    }
}

/* The test images of the resampling tests: (c, h, w) with values
 * ((7y + 3x + 2c) mod 5) - 2 + c / 4, the same pattern the PyTorch
 * references were computed on. */
static float *resize_pattern(int c, int h, int w) {
    float *x = malloc(((size_t)c * h * w + 1) * sizeof *x);
    for (int ch = 0; ch < c; ch++)
        for (int y = 0; y < h; y++)
            for (int xx = 0; xx < w; xx++)
                x[((size_t)ch * h + y) * w + xx] =
                    (float)((7 * y + 3 * xx + 2 * ch) % 5) - 2 + 0.25f * (float)ch;
    return x;
}

/* Runs one resampling op on in (c, h, w) and compares with ref (c, H, W). */
static void check_resize(const char *what, int bicubic, const float *in, int c, int h, int w, int H,
                         int W, const double *ref, double abs_tol, double rel_tol) {
    const size_t n_in = (size_t)c * h * w, n_out = (size_t)c * H * W;
    float *din = dev_from(in, n_in), *dout = dev_new(n_out);
    if (bicubic)
        be->resize_bicubic(be, dout, din, c, h, w, H, W);
    else
        be->resize_area(be, dout, din, c, h, w, H, W);
    check_dev(what, dout, ref, n_out, abs_tol, rel_tol);
    CHECK_MSG(dev_guards_ok(din, n_in), "%s: input guards", what);
    dev_del(din);
    dev_del(dout);
}

static double *from_floats(const float *f, size_t n) {
    double *d = ref_new(n);
    for (size_t i = 0; i < n; i++)
        d[i] = f[i];
    return d;
}

/* Keys' cubic kernel with A = -0.75, as a function of the distance. */
static double keys_cubic(double d) {
    const double A = -0.75;
    d = fabs(d);
    if (d <= 1)
        return ((A + 2) * d - (A + 3)) * d * d + 1;
    if (d < 2)
        return ((A * d - 5 * A) * d + 8 * A) * d - 4 * A;
    return 0;
}

/* Bicubic in double, written from the definition: output index o samples
 * source position (o + 0.5) * in / out - 0.5, weighting the four nearest
 * source indices by keys_cubic of their distance, indices clamped. */
static void bicubic_reference(double *ref, const float *in, int c, int h, int w, int H, int W) {
    for (int ch = 0; ch < c; ch++)
        for (int oy = 0; oy < H; oy++)
            for (int ox = 0; ox < W; ox++) {
                const double sy = (oy + 0.5) * h / H - 0.5, sx = (ox + 0.5) * w / W - 0.5;
                const int fy = (int)floor(sy), fx = (int)floor(sx);
                double acc = 0;
                for (int iy = fy - 1; iy <= fy + 2; iy++)
                    for (int ix = fx - 1; ix <= fx + 2; ix++) {
                        const int cy = iy < 0 ? 0 : iy >= h ? h - 1 : iy;
                        const int cx = ix < 0 ? 0 : ix >= w ? w - 1 : ix;
                        acc += keys_cubic(sy - iy) * keys_cubic(sx - ix) *
                               in[((size_t)ch * h + cy) * w + cx];
                    }
                ref[((size_t)ch * H + oy) * W + ox] = acc;
            }
}

/* F.interpolate(x, size, mode='bicubic', align_corners=False) in PyTorch
 * 2.x (float32, CPU) on a 3x3 ramp (0..8) to 5x5 (the corners overshoot
 * below 0: clamped borders, not reflection) and on resize_pattern 2x4x6 to
 * 3x4 (down) and 2x2x3 to 5x7 (up): 2e-6 abs + 1e-6 rel. Then against the
 * double reference above on random images (down, up, 1x1 sources, odd
 * ratios): 1e-5 abs; the same size is the identity; a constant image stays
 * constant (the weights sum to 1). */
static void test_resize_bicubic_against_torch_and_double(void) {
    float ramp[9];
    for (int i = 0; i < 9; i++)
        ramp[i] = (float)i;
    double *ref = from_floats(torch_bicubic_ramp_3x3_to_5x5, 25);
    check_resize("bicubic ramp 3x3 -> 5x5 vs torch", 1, ramp, 1, 3, 3, 5, 5, ref, 2e-6, 1e-6);
    free(ref);
    float *p = resize_pattern(2, 4, 6);
    ref = from_floats(torch_bicubic_2x4x6_to_3x4, 24);
    check_resize("bicubic 2x4x6 -> 3x4 vs torch", 1, p, 2, 4, 6, 3, 4, ref, 2e-6, 1e-6);
    free(ref);
    free(p);
    p = resize_pattern(2, 2, 3);
    ref = from_floats(torch_bicubic_2x2x3_to_5x7, 70);
    check_resize("bicubic 2x2x3 -> 5x7 vs torch", 1, p, 2, 2, 3, 5, 7, ref, 2e-6, 1e-6);
    free(ref);
    free(p);

    const int cases[][5] = {{3, 7, 5, 16, 9},    {2, 16, 9, 7, 5},    {1, 1, 1, 3, 2},
                            {2, 13, 16, 16, 13}, {1, 32, 32, 24, 40}, {0, 2, 2, 3, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], h = cases[c][1], w = cases[c][2], H = cases[c][3],
                  W = cases[c][4];
        float *x = host_uniform((size_t)ch * h * w, -1, 1);
        ref = ref_new((size_t)ch * H * W);
        bicubic_reference(ref, x, ch, h, w, H, W);
        char what[64];
        snprintf(what, sizeof what, "bicubic %dx%dx%d -> %dx%d", ch, h, w, H, W);
        check_resize(what, 1, x, ch, h, w, H, W, ref, 1e-5, 0);
        free(ref);
        free(x);
    }
    float *x = host_uniform(3 * 5 * 7, -1, 1);
    ref = from_floats(x, 3 * 5 * 7);
    check_resize("bicubic identity", 1, x, 3, 5, 7, 5, 7, ref, 0, 0);
    free(ref);
    for (int i = 0; i < 3 * 5 * 7; i++)
        x[i] = 0.75f;
    ref = ref_new(3 * 9 * 4);
    for (int i = 0; i < 3 * 9 * 4; i++)
        ref[i] = 0.75;
    check_resize("bicubic constant", 1, x, 3, 5, 7, 9, 4, ref, 1e-6, 0);
    free(ref);
    free(x);
}

/* Adaptive average pooling in double from the definition: output cell i of
 * n_out covers source indices floor(i * n_in / n_out) to
 * ceil((i + 1) * n_in / n_out) - 1. */
static void area_reference(double *ref, const float *in, int c, int h, int w, int H, int W) {
    for (int ch = 0; ch < c; ch++)
        for (int oy = 0; oy < H; oy++)
            for (int ox = 0; ox < W; ox++) {
                const int y0 = (int)floor((double)oy * h / H),
                          y1 = (int)ceil((double)(oy + 1) * h / H);
                const int x0 = (int)floor((double)ox * w / W),
                          x1 = (int)ceil((double)(ox + 1) * w / W);
                double s = 0;
                for (int y = y0; y < y1; y++)
                    for (int xx = x0; xx < x1; xx++)
                        s += in[((size_t)ch * h + y) * w + xx];
                ref[((size_t)ch * H + oy) * W + ox] = s / ((y1 - y0) * (x1 - x0));
            }
}

/* F.interpolate(x, size, mode='area') in PyTorch 2.x (float32, CPU) on
 * resize_pattern 1x16x5 to 13x3 (VAR's 16 -> 13 with overlapping cells),
 * 2x4x6 to 3x4 and 2x2x3 to 3x5 (up: cells repeat): 1e-6 abs + 1e-6 rel.
 * By hand: a 2x2 mean. Then random images against the double reference,
 * and the same size is the identity. */
static void test_resize_area_against_torch_and_double(void) {
    float *p = resize_pattern(1, 16, 5);
    double *ref = from_floats(torch_area_1x16x5_to_13x3, 39);
    check_resize("area 1x16x5 -> 13x3 vs torch", 0, p, 1, 16, 5, 13, 3, ref, 1e-6, 1e-6);
    free(ref);
    free(p);
    p = resize_pattern(2, 4, 6);
    ref = from_floats(torch_area_2x4x6_to_3x4, 24);
    check_resize("area 2x4x6 -> 3x4 vs torch", 0, p, 2, 4, 6, 3, 4, ref, 1e-6, 1e-6);
    free(ref);
    free(p);
    p = resize_pattern(2, 2, 3);
    ref = from_floats(torch_area_2x2x3_to_3x5, 30);
    check_resize("area 2x2x3 -> 3x5 vs torch", 0, p, 2, 2, 3, 3, 5, ref, 1e-6, 1e-6);
    free(ref);
    free(p);

    const float sq[4 * 2] = {1, 2, 10, 20, 3, 4, 30, 40}; /* 2x4 -> 1x2 */
    const double sq_ref[2] = {2.5, 25};
    check_resize("area 2x2 mean by hand", 0, sq, 1, 2, 4, 1, 2, sq_ref, 0, 0);

    const int cases[][5] = {{3, 16, 16, 13, 13}, {2, 7, 9, 3, 4}, {1, 5, 5, 7, 8},
                            {2, 32, 32, 1, 1},   {1, 1, 1, 2, 3}, {0, 4, 4, 2, 2}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], h = cases[c][1], w = cases[c][2], H = cases[c][3],
                  W = cases[c][4];
        float *x = host_uniform((size_t)ch * h * w, -1, 1);
        ref = ref_new((size_t)ch * H * W);
        area_reference(ref, x, ch, h, w, H, W);
        char what[64];
        snprintf(what, sizeof what, "area %dx%dx%d -> %dx%d", ch, h, w, H, W);
        check_resize(what, 0, x, ch, h, w, H, W, ref, 1e-6, 1e-6);
        free(ref);
        free(x);
    }
    float *x = host_uniform(2 * 6 * 3, -1, 1);
    ref = from_floats(x, 2 * 6 * 3);
    check_resize("area identity", 0, x, 2, 6, 3, 6, 3, ref, 0, 0);
    free(ref);
    free(x);
}

/* ---- threading ------------------------------------------------------------------- */

/* The threaded ops split work over independent outputs, so a one-thread and
 * a two-thread backend must agree bit for bit (GEMMs aside: OpenBLAS may
 * block a narrower slice differently). Sizes are above the threading
 * thresholds. */
static void test_results_independent_of_thread_count(void) {
    ar_error_t err = {{0}};
    backend_t *one = backend_cpu_create(1, &err), *two = backend_cpu_create(2, &err);
    CHECK_MSG(one && two, "backend_cpu_create: %s", err.msg);
    if (!one || !two)
        return;
    enum { H = 4, D = 32, L = 700, C = 64, HW = 40 * 40, ROWS = C * HW / (H * D), OPS = 8 };
    enum { BT = 16, NB = (L + BT - 1) / BT };
    const int q_start[2] = {0, 200}, kv_len[H] = {L, L - 100, 300, 200};
    const size_t nq = 200 * H * D, nx = (size_t)C * HW;
    float *q = host_uniform(nq, -1, 1), *x = host_uniform(nx, -3, 3);
    float *kv[H], *g = host_uniform(HW, 0.5f, 1.5f), *b = host_uniform(C, -1, 1);
    float *k3 = host_uniform((size_t)C * C * 9, -0.1f, 0.1f);
    for (int h = 0; h < H; h++)
        kv[h] = host_uniform((size_t)L * D, -1, 1);
    /* The CPU backend's memory is host memory: one pool, head h in blocks
     * [h * NB, (h + 1) * NB), K and V rows both from kv[h]. */
    float *pool_mem = malloc((size_t)H * NB * 2 * BT * D * sizeof(float));
    int tables[H][NB];
    kv_view_t views[H];
    for (int h = 0; h < H; h++) {
        for (int i = 0; i < NB; i++)
            tables[h][i] = h * NB + i;
        for (int j = 0; j < L; j++) {
            float *row = pool_mem + ((size_t)tables[h][j / BT] * 2 * BT + j % BT) * D;
            memcpy(row, kv[h] + (size_t)j * D, D * sizeof(float));
            memcpy(row + BT * D, kv[h] + (size_t)j * D, D * sizeof(float));
        }
        views[h] = (kv_view_t){tables[h], kv_len[h], 1, 1};
    }
    const kv_blocks_t pool = {pool_mem, DTYPE_F32, BT, D};
    float *mass[2][H];
    int pos[ROWS];
    for (int r = 0; r < ROWS; r++)
        pos[r] = 7 * r;
    static const char *names[OPS] = {
        "attention", "groupnorm",           "softmax+gelu", "rmsnorm",
        "rope",      "attention with mass", "conv2d",       "conv2d over Winograd"};
    float *res[2][OPS];
    backend_t *bes[2] = {one, two};
    for (int t = 0; t < 2; t++) {
        backend_t *bk = bes[t];
        for (int o = 0; o < OPS; o++) {
            res[t][o] = malloc(nx * sizeof(float)); /* nq <= nx */
            memcpy(res[t][o], x, nx * sizeof(float));
        }
        const attn_batch_t batch = {1, q_start, views, NULL};
        bk->attention(bk, res[t][0], q, &pool, &batch, H, 0.17f);
        for (int h = 0; h < H; h++)
            mass[t][h] = calloc(L, sizeof(float));
        const attn_batch_t with_mass = {1, q_start, views, mass[t]};
        bk->attention(bk, res[t][5], q, &pool, &with_mass, H, 0.17f);
        tensor_t tg, tb, tw;
        const int64_t shape_c[1] = {C}, shape_hw[1] = {HW};
        CHECK(bk->weight_load(bk, &tg, g, DTYPE_F32, 1, shape_c, &err) == AR_OK);
        CHECK(bk->weight_load(bk, &tb, b, DTYPE_F32, 1, shape_c, &err) == AR_OK);
        CHECK(bk->weight_load(bk, &tw, g, DTYPE_F32, 1, shape_hw, &err) == AR_OK);
        bk->groupnorm(bk, res[t][1], x, &tg, &tb, C, HW, 32, 1e-6f, 1);
        bk->softmax(bk, res[t][2], C, HW);
        bk->gelu(bk, res[t][2], nx);
        bk->rmsnorm(bk, res[t][3], x, &tw, C, HW, 1e-6f);
        bk->rope(bk, res[t][4], pos, ROWS, H, D, 10000.0f);
        tensor_t tk[2];
        const int64_t shape_k[4] = {C, C, 3, 3};
        for (int p = 0; p < 2; p++) {
            CHECK(bk->weight_load(bk, &tk[p], k3, DTYPE_F32, 4, shape_k, &err) == AR_OK);
            if (p)
                CHECK(bk->weight_prepare(bk, &tk[p], LAYOUT_CONV, &err) == AR_OK &&
                      tk[p].layout == LAYOUT_CONV);
            bk->conv2d(bk, res[t][6 + p], x, &tk[p], &tb, C, 40, 40, 1);
            bk->weight_free(bk, &tk[p]);
        }
        bk->weight_free(bk, &tg);
        bk->weight_free(bk, &tb);
        bk->weight_free(bk, &tw);
    }
    for (int o = 0; o < OPS; o++) {
        CHECK_MSG(memcmp(res[0][o], res[1][o], nx * sizeof(float)) == 0,
                  "%s differs between 1 and 2 threads", names[o]);
        free(res[0][o]);
        free(res[1][o]);
    }
    for (int h = 0; h < H; h++) {
        CHECK_MSG(memcmp(mass[0][h], mass[1][h], L * sizeof(float)) == 0,
                  "key mass of head %d differs between 1 and 2 threads", h);
        free(mass[0][h]);
        free(mass[1][h]);
        free(kv[h]);
    }
    free(pool_mem);
    free(q);
    free(x);
    free(g);
    free(b);
    free(k3);
    one->destroy(one);
    two->destroy(two);
}

/* Dense attention (Infinity's cross-attention, attentive pool and T5):
 * ragged sequences with more or fewer keys than queries, keys and values
 * in rows wider than the heads (kv_stride), and T5's relative position
 * bias, against plain double loops. */
static void check_attention_dense(int n_seq, const int *nq, const int *nk, int H, int D, int stride,
                                  int with_bias, float scale) {
    int q_start[8] = {0}, k_start[8] = {0}, span = 1;
    for (int s = 0; s < n_seq; s++) {
        q_start[s + 1] = q_start[s] + nq[s];
        k_start[s + 1] = k_start[s] + nk[s];
        span = nq[s] > span ? nq[s] : span;
        span = nk[s] > span ? nk[s] : span;
    }
    const int rows = q_start[n_seq], keys = k_start[n_seq], nb = 2 * span - 1;
    const size_t row = (size_t)H * D;
    float *q = host_uniform(rows * row, -2, 2), *k = host_uniform((size_t)keys * stride, -2, 2);
    float *v = host_uniform((size_t)keys * stride, -3, 3),
          *bias = host_uniform((size_t)H * nb, -4, 4);
    double *ref = ref_new(rows * row);
    for (int s = 0; s < n_seq; s++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < nq[s]; i++) {
                const float *qi = q + (size_t)(q_start[s] + i) * row + (size_t)h * D;
                double sc[64], mx = -INFINITY, l = 0;
                for (int j = 0; j < nk[s]; j++) {
                    const float *kj = k + (size_t)(k_start[s] + j) * stride + (size_t)h * D;
                    double dot = 0;
                    for (int d = 0; d < D; d++)
                        dot += (double)qi[d] * kj[d];
                    sc[j] = dot * scale + (with_bias ? bias[(size_t)h * nb + j - i + span - 1] : 0);
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                for (int j = 0; j < nk[s]; j++)
                    l += (sc[j] = exp(sc[j] - mx));
                for (int d = 0; d < D; d++) {
                    double acc = 0;
                    for (int j = 0; j < nk[s]; j++)
                        acc += sc[j] * v[(size_t)(k_start[s] + j) * stride + (size_t)h * D + d];
                    ref[(size_t)(q_start[s] + i) * row + (size_t)h * D + d] = acc / l;
                }
            }
    float *dq = dev_from(q, rows * row), *dk = dev_from(k, (size_t)keys * stride);
    float *dv = dev_from(v, (size_t)keys * stride), *db = dev_from(bias, (size_t)H * nb);
    float *dout = dev_new(rows * row);
    be->attention_dense(be, dout, dq, dk, dv, stride, q_start, k_start, n_seq, H, D, scale,
                        with_bias ? db : NULL, span);
    check_dev("attention_dense", dout, ref, rows * row, 1e-5, 1e-5);
    float *bufs[] = {dq, dk, dv, db, dout};
    for (size_t i = 0; i < sizeof bufs / sizeof *bufs; i++)
        dev_del(bufs[i]);
    free(q), free(k), free(v), free(bias), free(ref);
}

static void test_attention_dense_ragged_strided_biased(void) {
    const int nq[3] = {1, 7, 40}, nk[3] = {5, 3, 40};
    check_attention_dense(3, nq, nk, 2, 16, 2 * 2 * 16, 0, 0.25f); /* K and V rows of mat_kv */
    check_attention_dense(3, nq, nk, 3, 8, 3 * 8, 1, 1.0f);        /* T5: bias, no scaling */
    const int one[1] = {1}, many[1] = {37};
    check_attention_dense(1, one, many, 4, 32, 4 * 32, 0, 1 / sqrtf(32)); /* the pool */
}

/* mul: y *= a, element by element, in place. */
static void test_mul(void) {
    const size_t n = 1000;
    float *y = host_uniform(n, -5, 5), *a = host_uniform(n, -5, 5);
    double *ref = ref_new(n);
    for (size_t i = 0; i < n; i++)
        ref[i] = (double)(y[i] * a[i]);
    float *dy = dev_from(y, n), *da = dev_from(a, n);
    be->mul(be, dy, da, n);
    check_dev("mul", dy, ref, n, 0, 0);
    dev_del(dy), dev_del(da);
    free(y), free(a), free(ref);
}

int main(void) {
    ar_error_t err = {{0}};
    be = backend_cpu_create(0, &err);
    if (!be) {
        fprintf(stderr, "backend_cpu_create: %s\n", err.msg);
        return 1;
    }
    TEST_RUN(test_memory_roundtrip_and_alignment);
    TEST_RUN(test_attention_dense_ragged_strided_biased);
    TEST_RUN(test_mul);
    TEST_RUN(test_create_rejects_negative_threads);
    TEST_RUN(test_weight_load_f32_4d_from_unaligned_host);
    TEST_RUN(test_weight_load_bf16_all_patterns);
    TEST_RUN(test_weight_load_f16_all_patterns);
    TEST_RUN(test_weight_load_rejects_bad_dtype_and_shape);
    TEST_RUN(test_matmul_with_and_without_bias);
    TEST_RUN(test_matmul_16bit_weights);
    TEST_RUN(test_matmul_linear_weights);
    TEST_RUN(test_matmul_8bit_weights);
    TEST_RUN(test_matmul_bf16_activations);
    TEST_RUN(test_matmul_bf16_activations_rows_independent);
    TEST_RUN(test_rmsnorm_rows_and_in_place);
    TEST_RUN(test_rope_2d_llamagen_layout);
    TEST_RUN(test_rope_against_double_and_hf_angles);
    TEST_RUN(test_kv_append_paged_ragged_batch);
    TEST_RUN(test_attention_paged_ragged_heads_and_lengths);
    TEST_RUN(test_attention_paged_block_boundaries);
    TEST_RUN(test_attention_large_scores);
    TEST_RUN(test_attention_same_bits_at_every_block_size);
    TEST_RUN(test_kv_gather_random_keep_lists);
    TEST_RUN(test_elementwise_ops);
    TEST_RUN(test_softmax_rows);
    TEST_RUN(test_embedding_with_and_without_l2);
    TEST_RUN(test_conv2d_kernels_pads_and_slices);
    TEST_RUN(test_conv2d_winograd_bf16_activations);
    TEST_RUN(test_groupnorm_groups_and_offsets);
    TEST_RUN(test_upsample_nearest2x_exact);
    TEST_RUN(test_transpose_exact);
    TEST_RUN(test_attention_scale_by_hand);
    TEST_RUN(test_attention_scale_ragged_paged_against_dense);
    TEST_RUN(test_attention_scale_many_rows_in_groups);
    TEST_RUN(test_attention_16bit_cache_equals_its_fp32_widening);
    TEST_RUN(test_attention_scale_large_scores);
    TEST_RUN(test_attention_scale_bf16_activations);
    TEST_RUN(test_layernorm_against_torch_and_double);
    TEST_RUN(test_modulate_and_gate_add);
    TEST_RUN(test_l2norm_heads);
    TEST_RUN(test_gelu_tanh_against_torch_and_double);
    TEST_RUN(test_resize_bicubic_against_torch_and_double);
    TEST_RUN(test_resize_area_against_torch_and_double);
    TEST_RUN(test_results_independent_of_thread_count);
    be->destroy(be);
    return TEST_SUMMARY();
}
