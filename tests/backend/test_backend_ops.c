/* Backend conformance: every op the CUDA backend implements runs on it and on
 * the CPU backend (the reference) with the same fixed-seed random inputs of
 * awkward sizes (0, 1, primes, more than one slice of scratch or staging),
 * weights in every storage type, and the results are compared with a
 * tolerance stated per op and type. Every CUDA output sits between guard
 * floats; NaN and Inf must appear exactly where the reference has them;
 * inputs must come back unchanged; after each test the backend's status
 * must be clean.
 *
 * In CI the CUDA backend is compiled with g++ against tests/cuda_emu and
 * runs on the CPU (make test-backend); tests/gpu runs it on a GPU. */
#include "engine/backend/backend.h"
#include "engine/family/seq_rows.h"
#include "tests/test.h"
#include "tests/test_backend.h"

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static backend_t *cpu, *dut; /* the reference and the device under test */

/* Reservation for the backend under test: its own 96 MiB of scratch and
 * workspace, plus the largest case (the sliced matmul's 72 MB output). */
#define DUT_RESERVE ((size_t)256 << 20)

/* ---- random inputs -------------------------------------------------------- */

static uint64_t rng_state = 0x2545f4914f6cdd1dull;

static uint64_t rng_next(void) { /* xorshift64 */
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static float rng_uniform(float lo, float hi) {
    return lo + (hi - lo) * (float)((double)(rng_next() >> 40) / 16777216.0);
}

static float *host_uniform(size_t n, float lo, float hi) {
    float *x = malloc((n ? n : 1) * sizeof *x);
    for (size_t i = 0; i < n; i++)
        x[i] = rng_uniform(lo, hi);
    return x;
}

/* Round-to-nearest-even fp32 -> fp16 for the finite, normal-range values
 * these tests use (|x| in [2^-14, 65504] or 0). */
static uint16_t f32_to_f16_normal(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t sign = (u >> 16) & 0x8000u, a = u & 0x7fffffffu;
    if (a < 0x38800000u)
        return (uint16_t)sign; /* flushed: the tests avoid such values */
    uint32_t h = ((a >> 23) - 112) << 10 | (a >> 13 & 0x3ffu);
    const uint32_t rest = a & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

/* n floats as stored in dtype: 4 or 2 bytes each; *rounded gets the values
 * the stored bits stand for (what both backends compute with). */
static void *host_as(const float *x, size_t n, dtype_t dt, float *rounded) {
    if (dt == DTYPE_F32) {
        void *p = malloc((n ? n : 1) * 4);
        memcpy(p, x, n * 4);
        memcpy(rounded, x, n * 4);
        return p;
    }
    uint16_t *p = malloc((n ? n : 1) * 2);
    for (size_t i = 0; i < n; i++) {
        p[i] = dt == DTYPE_BF16 ? f32_to_bf16(x[i]) : f32_to_f16_normal(x[i]);
        rounded[i] = dt == DTYPE_BF16 ? bf16_to_f32(p[i]) : f16_to_f32(p[i]);
    }
    return p;
}

/* ---- buffers on both backends --------------------------------------------- */

/* GUARD floats of SENTINEL (a NaN no op computes) before and after every
 * buffer on the backend under test; the buffer itself starts as SENTINEL
 * too, so an output an op forgets to write reads as NaN. */
#define GUARD 16
#define SENTINEL 0x7fa5a5a5u

typedef struct pair {
    float *ref, *dut; /* backend memory on each */
    size_t n;
} pair_t;

static float *dut_new(size_t n) {
    const size_t total = n + 2 * GUARD;
    float *base = dut->alloc(dut, total * sizeof(float));
    if (!base)
        return NULL;
    uint32_t *fill = malloc(total * sizeof *fill);
    for (size_t i = 0; i < total; i++)
        fill[i] = SENTINEL;
    dut->upload(dut, base, fill, total * sizeof(float));
    free(fill);
    return base + GUARD;
}

/* A pair holding host (n floats), or SENTINEL everywhere when host is NULL. */
static pair_t pair_new(const float *host, size_t n) {
    pair_t p = {cpu->alloc(cpu, (n ? n : 1) * sizeof(float)), dut_new(n), n};
    CHECK(p.ref && p.dut);
    if (host) {
        cpu->upload(cpu, p.ref, host, n * sizeof(float));
        dut->upload(dut, p.dut, host, n * sizeof(float));
    } else {
        for (size_t i = 0; i < n; i++)
            memcpy(&p.ref[i], &(uint32_t){SENTINEL}, 4);
    }
    return p;
}

static void pair_del(pair_t p) {
    cpu->free(cpu, p.ref);
    dut->free(dut, p.dut - GUARD);
}

static int dut_guards_ok(const float *d, size_t n) {
    uint32_t g[2 * GUARD];
    dut->download(dut, g, d - GUARD, GUARD * sizeof(float));
    dut->download(dut, g + GUARD, d + n, GUARD * sizeof(float));
    for (int i = 0; i < 2 * GUARD; i++)
        if (g[i] != SENTINEL)
            return 0;
    return 1;
}

/* A weight loaded on both backends from the same stored bits. */
typedef struct wpair {
    tensor_t ref, dut;
} wpair_t;

static wpair_t wpair_load(const void *host, dtype_t dt, int ndim, int64_t d0, int64_t d1,
                          int64_t d2, int64_t d3) {
    const int64_t shape[4] = {d0, d1, d2, d3};
    wpair_t w;
    ar_error_t err = {{0}};
    CHECK_MSG(cpu->weight_load(cpu, &w.ref, host, dt, ndim, shape, &err) == AR_OK, "%s", err.msg);
    CHECK_MSG(dut->weight_load(dut, &w.dut, host, dt, ndim, shape, &err) == AR_OK, "%s", err.msg);
    return w;
}

static void wpair_free(wpair_t *w) {
    cpu->weight_free(cpu, &w->ref);
    dut->weight_free(dut, &w->dut);
}

/* ---- comparison ------------------------------------------------------------ */

/* The backend under test's p.dut against the reference's p.ref: where the
 * reference is finite the result must be finite and within abs_tol +
 * rel_tol * |ref| (+ mag_tol * mag[i] when mag is given: a bound for sums
 * of products, e.g. sum |w||x|); where the reference is NaN or +-Inf the
 * result must be NaN or the same infinity. Also checks the guards and
 * reports the normalised mean squared error of the first failure. */
static void compare(const char *what, pair_t p, double abs_tol, double rel_tol, const double *mag,
                    double mag_tol) {
    const size_t n = p.n;
    float *ref = malloc((n ? n : 1) * 4), *got = malloc((n ? n : 1) * 4);
    cpu->download(cpu, ref, p.ref, n * 4);
    dut->download(dut, got, p.dut, n * 4);
    CHECK_MSG(dut_guards_ok(p.dut, n), "%s: guard floats overwritten", what);
    size_t bad = 0;
    double worst = 0, se = 0, sr = 0;
    for (size_t i = 0; i < n; i++) {
        const double r = ref[i], g = got[i], err = fabs(g - r);
        int ok;
        if (isfinite(r)) {
            const double tol = abs_tol + rel_tol * fabs(r) + (mag ? mag_tol * mag[i] : 0);
            ok = isfinite(g) && err <= tol;
            if (isfinite(g)) {
                worst = err > worst ? err : worst;
                se += err * err;
                sr += r * r;
            }
        } else {
            ok = isnan(r) ? isnan(g) : g == r;
        }
        if (!ok && ++bad <= 3)
            fprintf(stderr, "  %s[%zu] = %.9g, reference %.9g\n", what, i, g, r);
    }
    CHECK_MSG(bad == 0, "%s: %zu of %zu values off; worst finite error %.3g, nmse %.3g", what, bad,
              n, worst, sr > 0 ? se / sr : se);
    free(ref);
    free(got);
}

/* The pair's two copies are still equal to host (an input an op must not
 * touch). */
static void check_unchanged(const char *what, pair_t p, const float *host) {
    float *got = malloc((p.n ? p.n : 1) * 4);
    dut->download(dut, got, p.dut, p.n * 4);
    CHECK_MSG(p.n == 0 || memcmp(got, host, p.n * 4) == 0, "%s: input changed", what);
    CHECK_MSG(dut_guards_ok(p.dut, p.n), "%s: input guards overwritten", what);
    free(got);
}

static void check_status_clean(const char *what) {
    ar_error_t err = {{0}};
    CHECK_MSG(backend_status(dut, &err) == AR_OK, "%s: %s", what, err.msg);
}

static const dtype_t all_types[] = {DTYPE_F32, DTYPE_F16, DTYPE_BF16};
static const char *type_name(dtype_t t) { return dtype_name(t); }

/* A 16-bit weight meets fp32 activations split into hi + lo halves (about
 * 2^-17 relative error for bf16, less for fp16) and fp32 accumulation: the
 * error of a dot product is bounded by a small multiple of sum |w||x|. */
static double gemm_mag_tol(dtype_t wt, int k) {
    return (wt == DTYPE_F32 ? 0 : 0x1p-15) + 4.0 * k * 0x1p-24;
}

/* ---- memory and weights ----------------------------------------------------- */

static void test_memory_roundtrip_alignment_and_reuse(void) {
    const size_t sizes[] = {0, 1, 7, 256, 1000, 4099, (size_t)3 << 20};
    void *held[7];
    for (size_t s = 0; s < 7; s++) {
        const size_t n = sizes[s];
        unsigned char *a = dut->alloc(dut, n), *b = dut->alloc(dut, n);
        CHECK(a && b && a != b);
        CHECK(((uintptr_t)a & 255) == 0 && ((uintptr_t)b & 255) == 0);
        unsigned char *src = malloc(n + 1), *dst = malloc(n + 1);
        for (size_t i = 0; i < n; i++)
            src[i] = (unsigned char)rng_next();
        dut->upload(dut, a, src, n);
        dut->copy(dut, b, a, n);
        dut->sync(dut);
        dut->download(dut, dst, b, n);
        CHECK(n == 0 || memcmp(src, dst, n) == 0);
        free(src);
        free(dst);
        dut->free(dut, a);
        held[s] = b;
    }
    /* Freed space is reused once its neighbours are free again. */
    for (size_t s = 0; s < 7; s++)
        dut->free(dut, held[s]);
    void *big = dut->alloc(dut, (size_t)100 << 20);
    CHECK(big != NULL);
    dut->free(dut, big);
    CHECK(dut->alloc(dut, DUT_RESERVE) == NULL); /* past the reservation: NULL, not an error */
    dut->free(dut, NULL);
    CHECK(strcmp(dut->name, "cuda") == 0);
    check_status_clean("memory");
}

/* Weights keep their stored type and bits on the device. */
static void test_weight_load_keeps_type_and_bits(void) {
    for (int t = 0; t < 3; t++) {
        const dtype_t dt = all_types[t];
        enum { N = 3 * 5 * 2 * 7 };
        float x[N], r[N];
        for (int i = 0; i < N; i++)
            x[i] = rng_uniform(-3, 3);
        void *stored = host_as(x, N, dt, r);
        unsigned char *raw = malloc(N * 4 + 1); /* from an unaligned source */
        memcpy(raw + 1, stored, N * dtype_size(dt));
        const int64_t shape[4] = {3, 5, 2, 7};
        tensor_t w;
        ar_error_t err = {{0}};
        CHECK(dut->weight_load(dut, &w, raw + 1, dt, 4, shape, &err) == AR_OK);
        CHECK(w.dtype == dt && w.ndim == 4 && tensor_numel(&w) == N && w.shape[3] == 7);
        unsigned char got[N * 4];
        dut->download(dut, got, w.data, N * dtype_size(dt));
        CHECK(memcmp(got, stored, N * dtype_size(dt)) == 0);
        dut->weight_free(dut, &w);
        CHECK(w.data == NULL);
        free(raw);
        free(stored);
    }
    tensor_t w;
    ar_error_t err = {{0}};
    const int64_t shape[1] = {4};
    CHECK(dut->weight_load(dut, &w, "abcd", DTYPE_I32, 1, shape, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "I32");
    const int64_t huge[2] = {(int64_t)1 << 20, (int64_t)1 << 20};
    CHECK(dut->weight_load(dut, &w, "", DTYPE_BF16, 2, huge, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "out of device memory");
    check_status_clean("weight_load");
}

/* ---- start-up errors -------------------------------------------------------- */

/* A reservation of 0 takes the free memory less a margin; asking for more
 * than is free, less than the backend's own scratch, or a device that does
 * not exist fails with a message that names the numbers. */
static void test_create_reserves_or_reports_errors(void) {
    ar_error_t err = {{0}};
    backend_t *all = backend_cuda_create(0, 0, &err);
    CHECK_MSG(all != NULL, "%s", err.msg);
    if (all) {
        void *gib = all->alloc(all, (size_t)1 << 30);
        CHECK(gib != NULL);
        all->free(all, gib);
        CHECK(backend_status(all, &err) == AR_OK);
        all->destroy(all);
    }
    CHECK(backend_cuda_create(0, (size_t)1 << 50, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "cannot reserve 1073741824.0 MiB on device 0");
    CHECK_STR_CONTAINS(err.msg, "MiB free of");
    CHECK(backend_cuda_create(0, (size_t)1 << 20, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "less than");
    CHECK(backend_cuda_create(7, 0, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "device 7 does not exist");
}

/* An embedding id outside the table is an error, not a read outside it,
 * and it leaves the backend unusable, naming it (failures are sticky); the
 * CPU backend never is. A fresh backend keeps the shared one's status
 * clean. */
static void test_invalid_ops_fail_loudly(void) {
    ar_error_t err = {{0}};
    backend_t *b;
    b = backend_cuda_create(0, (size_t)128 << 20, &err);
    CHECK_MSG(b != NULL, "%s", err.msg);
    if (!b)
        return;
    const float table[6] = {1, 2, 3, 4, 5, 6};
    const int64_t shape[2] = {3, 2};
    tensor_t t;
    CHECK(b->weight_load(b, &t, table, DTYPE_F32, 2, shape, &err) == AR_OK);
    float *out = b->alloc(b, 64);
    const int ids[2] = {1, 3};
    CHECK(backend_unusable(b) == NULL);
    b->embedding(b, out, &t, ids, 2, 0);
    CHECK(backend_status(b, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "id 3 (at 1) is outside the table's 3 rows");
    const char *why = backend_unusable(b);
    CHECK(why != NULL);
    if (why)
        CHECK_STR_CONTAINS(why, "id 3 (at 1) is outside the table's 3 rows");
    b->destroy(b);
    CHECK(backend_unusable(cpu) == NULL);
}

/* ---- counters and ARSERVE_CUDA_CHECK ------------------------------------------- */

/* A CUDA backend of reserve bytes made with ARSERVE_CUDA_CHECK=check,
 * whatever the environment this test runs in says (tests/gpu reruns the
 * suite with the switch on); the environment is put back. */
static backend_t *create_checked(const char *check, size_t reserve, ar_error_t *err) {
    const char *env = getenv("ARSERVE_CUDA_CHECK");
    char *was = env ? strdup(env) : NULL;
    setenv("ARSERVE_CUDA_CHECK", check, 1);
    backend_t *b = backend_cuda_create(0, reserve, err);
    if (was)
        setenv("ARSERVE_CUDA_CHECK", was, 1);
    else
        unsetenv("ARSERVE_CUDA_CHECK");
    free(was);
    return b;
}

#define STATS_RESERVE ((size_t)128 << 20)

/* s - t, field by field (the counts; the memory figures are s's). */
static backend_stats_t stats_since(backend_t *b, const backend_stats_t *t) {
    backend_stats_t s;
    CHECK(backend_stats(b, &s) == 1);
    s.launches -= t->launches;
    s.kernels -= t->kernels;
    s.h2d_copies -= t->h2d_copies, s.h2d_bytes -= t->h2d_bytes;
    s.d2h_copies -= t->d2h_copies, s.d2h_bytes -= t->d2h_bytes;
    s.d2d_copies -= t->d2d_copies, s.d2d_bytes -= t->d2d_bytes;
    s.syncs -= t->syncs;
    s.graph_launches -= t->graph_launches;
    s.graph_builds -= t->graph_builds;
    s.graph_updates -= t->graph_updates;
    return s;
}

static int stats_no_copies(const backend_stats_t *d) {
    return d->h2d_copies == 0 && d->d2h_copies == 0 && d->d2d_copies == 0 && d->syncs == 0;
}

/* ->stats counts exactly: a copy by its direction and bytes, a wait for
 * every upload, download and sync, a launch for every kernel launcher and
 * cuBLAS call (f32 matmul: the GEMM, plus the bias fill with a bias; a
 * 16-bit weight: split, GEMM, sum), a host array staged as one upload
 * (dense attention's two start arrays together); the memory high-water
 * mark and the reservation. The CPU backend has none. Op by op (graphs
 * off): a step as a graph is counted below. */
static void test_stats_count_launches_copies_syncs_and_memory(void) {
    backend_stats_t s;
    CHECK(backend_stats(cpu, &s) == 0 && s.launches == 0 && s.device_reserved_bytes == 0);
    ar_error_t err = {{0}};
    backend_t *b = create_checked("0", STATS_RESERVE, &err);
    CHECK_MSG(b != NULL, "%s", err.msg);
    if (!b)
        return;
    b->graphs = GRAPHS_OFF;
    backend_stats_t zero = {0}, d = stats_since(b, &zero);
    CHECK(d.launches == 0 && d.h2d_bytes == 0 && d.d2h_bytes == 0 && d.d2d_bytes == 0);
    CHECK(stats_no_copies(&d));
    CHECK(d.device_reserved_bytes == STATS_RESERVE);
    /* its own scratch and cuBLAS workspace, from the start */
    CHECK(d.device_peak_bytes >= ((size_t)96 << 20) && d.device_peak_bytes < STATS_RESERVE);

    float host[1000];
    for (int i = 0; i < 1000; i++)
        host[i] = (float)i;
    float *x = b->alloc(b, sizeof host), *y = b->alloc(b, sizeof host);
    backend_stats_t t;
    backend_stats(b, &t);
    b->upload(b, x, host, sizeof host);
    b->copy(b, y, x, 400);
    b->download(b, host, y, 40);
    b->sync(b);
    d = stats_since(b, &t);
    CHECK(d.h2d_copies == 1 && d.h2d_bytes == sizeof host);
    CHECK(d.d2d_copies == 1 && d.d2d_bytes == 400);
    CHECK(d.d2h_copies == 1 && d.d2h_bytes == 40);
    CHECK_MSG(d.syncs == 2,
              "%llu syncs: upload and download wait once each, sync not at all "
              "(nothing queued since the download)",
              (unsigned long long)d.syncs);
    CHECK(d.launches == 0);
    /* sync waits when work was queued since the last wait, and only then */
    backend_stats(b, &t);
    b->scale(b, x, 10, 1.0f);
    b->sync(b);
    b->sync(b);
    d = stats_since(b, &t);
    CHECK_MSG(d.launches == 1 && d.syncs == 1, "a launch, two syncs: %llu waits",
              (unsigned long long)d.syncs);

    tensor_t w32, w16, w16s, bias;
    const int64_t wshape[2] = {4, 8}, bshape[1] = {4}, sshape[3] = {3, 4, 8};
    uint16_t wbf[96];
    for (int i = 0; i < 96; i++)
        wbf[i] = 0x3f80; /* bf16 1.0 */
    backend_stats(b, &t);
    CHECK(b->weight_load(b, &w32, host, DTYPE_F32, 2, wshape, &err) == AR_OK);
    CHECK(b->weight_load(b, &w16, wbf, DTYPE_BF16, 2, wshape, &err) == AR_OK);
    CHECK(b->weight_load(b, &bias, host, DTYPE_F32, 1, bshape, &err) == AR_OK);
    d = stats_since(b, &t);
    CHECK(d.h2d_copies == 3 && d.h2d_bytes == 32 * 4 + 32 * 2 + 4 * 4 && d.syncs == 3);
    CHECK(b->weight_load(b, &w16s, wbf, DTYPE_BF16, 3, sshape, &err) == AR_OK);

    /* a stack of three bf16 matrices costs what one does; 16-bit
     * activations a cast and a GEMM, split ones a split, a GEMM and a sum;
     * matmul_add the same as matmul (the sum or the GEMM adds into y) */
    const struct {
        const char *what;
        const tensor_t *w, *bias;
        backend_activations_t act;
        int add;
        unsigned long long launches;
    } mm[] = {{"f32", &w32, NULL, ACTIVATIONS_16BIT, 0, 1},
              {"f32 with bias", &w32, &bias, ACTIVATIONS_16BIT, 0, 2},
              {"f32 add", &w32, NULL, ACTIVATIONS_16BIT, 1, 1},
              {"bf16", &w16, NULL, ACTIVATIONS_16BIT, 0, 2},
              {"bf16 with bias", &w16, &bias, ACTIVATIONS_16BIT, 0, 3},
              {"bf16 add", &w16, NULL, ACTIVATIONS_16BIT, 1, 2},
              {"bf16 stacked", &w16s, NULL, ACTIVATIONS_16BIT, 0, 2},
              {"bf16 split", &w16, NULL, ACTIVATIONS_SPLIT, 0, 3},
              {"bf16 split with bias", &w16, &bias, ACTIVATIONS_SPLIT, 0, 3},
              {"bf16 split add", &w16, NULL, ACTIVATIONS_SPLIT, 1, 3},
              {"bf16 split stacked", &w16s, NULL, ACTIVATIONS_SPLIT, 0, 3}};
    for (size_t i = 0; i < sizeof mm / sizeof mm[0]; i++) {
        b->activations = mm[i].act;
        backend_stats(b, &t);
        if (mm[i].add)
            b->matmul_add(b, y, x, mm[i].w, 2);
        else
            b->matmul(b, y, x, mm[i].w, mm[i].bias, 2);
        d = stats_since(b, &t);
        CHECK_MSG(d.launches == mm[i].launches && d.kernels == d.launches && stats_no_copies(&d),
                  "matmul %s: %llu launches, %llu copies in, %llu syncs", mm[i].what,
                  (unsigned long long)d.launches, (unsigned long long)d.h2d_copies,
                  (unsigned long long)d.syncs);
    }
    backend_stats(b, &t);
    b->rmsnorm(b, y, x, &bias, 8, 4, 1e-6f);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.kernels == 1 && stats_no_copies(&d));
    /* GroupNorm's launcher starts three kernels (partial sums, merge, apply) */
    backend_stats(b, &t);
    b->groupnorm(b, y, x, &bias, &bias, 4, 25, 2, 1e-6f, 1);
    d = stats_since(b, &t);
    CHECK_MSG(d.launches == 1 && d.kernels == 3, "groupnorm: %llu launches, %llu kernels",
              (unsigned long long)d.launches, (unsigned long long)d.kernels);
    int pos[2] = {3, 4};
    backend_stats(b, &t);
    b->rope(b, x, pos, 2, 2, 4, 10000.0f);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.h2d_copies == 1 && d.h2d_bytes == sizeof pos && d.syncs == 0);
    /* the same positions again (every layer of a step): kept, not copied;
     * changed ones are */
    backend_stats(b, &t);
    b->rope(b, x, pos, 2, 2, 4, 10000.0f);
    b->rope_2d(b, x, pos, 1, 2, 4, 10000.0f);
    d = stats_since(b, &t);
    CHECK_MSG(d.launches == 2 && d.h2d_copies == 0, "positions kept: %llu copies",
              (unsigned long long)d.h2d_copies);
    pos[1] = 5;
    backend_stats(b, &t);
    b->rope(b, x, pos, 2, 2, 4, 10000.0f);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.h2d_copies == 1 && d.h2d_bytes == sizeof pos);
    backend_stats(b, &t);
    b->mul(b, y, x, 100);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && stats_no_copies(&d));
    /* dense attention stages both host start arrays in one copy */
    const int q_start[3] = {0, 1, 3}, k_start[3] = {0, 2, 4};
    backend_stats(b, &t);
    b->attention_dense(b, y, x, x, x + 8, 16, q_start, k_start, 2, 2, 4, 0.5f, NULL, 0);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.h2d_copies == 1 && d.h2d_bytes == 6 * sizeof(int) && d.syncs == 0);

    /* the high-water mark rises with an allocation and stays after its free */
    backend_stats(b, &t);
    CHECK(t.device_peak_bytes < STATS_RESERVE - ((size_t)8 << 20));
    void *big = b->alloc(b, (size_t)8 << 20);
    CHECK(big != NULL);
    b->free(b, big);
    void *small = b->alloc(b, (size_t)1 << 20);
    d = stats_since(b, &t);
    CHECK_MSG(d.device_peak_bytes == t.device_peak_bytes + ((size_t)8 << 20),
              "peak %zu, was %zu before 8 MiB", d.device_peak_bytes, t.device_peak_bytes);
    b->free(b, small);
    CHECK(backend_status(b, &err) == AR_OK);
    b->weight_free(b, &w32);
    b->weight_free(b, &w16);
    b->weight_free(b, &w16s);
    b->weight_free(b, &bias);
    b->destroy(b);
}

/* One step of a few ops that stage host arrays (RoPE's positions, twice,
 * dense attention's starts, an embedding's ids, a small upload) on a
 * backend with graphs, then a download: b's result, op by op. */
static void graph_step(backend_t *b, float *x, float *y, float *out, const tensor_t *table,
                       const int *pos, int rows, int extra) {
    static const int q_start[3] = {0, 1, 3}, k_start[3] = {0, 2, 4}, ids[3] = {2, 0, 1};
    const float ones[4] = {1, 1, 1, 1};
    b->rope(b, x, pos, rows, 2, 4, 10000.0f);
    b->rope(b, x, pos, rows, 2, 4, 10000.0f); /* the same positions: staged once */
    b->attention_dense(b, y, x, x, x + 8, 16, q_start, k_start, 2, 2, 4, 0.5f, NULL, 0);
    b->embedding(b, y + 48, table, ids, 3, 0);
    b->upload(b, y + 60, ones, sizeof ones);
    b->add(b, y, y + 48, 16);
    for (int i = 0; i < extra; i++) /* each op more: a graph of another shape */
        b->scale(b, y, 16, 0.5f);
    b->download(b, out, y, 64 * sizeof(float));
}

/* With graphs on (the default), a step (what is queued between two waits)
 * is recorded and launched as one graph: one upload of everything staged,
 * one graph launch, one download, one wait, and the bytes of the same
 * step op by op. The next step of the same shape updates the instantiated
 * graph instead of building another; a step of another shape builds one. */
static void test_a_step_runs_as_one_graph(void) {
    ar_error_t err = {{0}};
    backend_t *g = create_checked("0", STATS_RESERVE, &err),
              *e = g ? create_checked("0", STATS_RESERVE, &err) : NULL;
    CHECK_MSG(g && e, "%s", err.msg);
    if (!g || !e)
        goto out;
    g->graphs = GRAPHS_ON;
    e->graphs = GRAPHS_OFF;
    float *hx = host_uniform(64, -1, 1), *hy = host_uniform(64, -1, 1),
          *hw = host_uniform(6, -1, 1);
    const int64_t shape[2] = {3, 2};
    tensor_t tg, te;
    CHECK(g->weight_load(g, &tg, hw, DTYPE_F32, 2, shape, &err) == AR_OK);
    CHECK(e->weight_load(e, &te, hw, DTYPE_F32, 2, shape, &err) == AR_OK);
    float *xg = g->alloc(g, 64 * sizeof(float)), *yg = g->alloc(g, 64 * sizeof(float));
    float *xe = e->alloc(e, 64 * sizeof(float)), *ye = e->alloc(e, 64 * sizeof(float));
    g->upload(g, xg, hx, 64 * sizeof(float));
    g->upload(g, yg, hy, 64 * sizeof(float));
    e->upload(e, xe, hx, 64 * sizeof(float));
    e->upload(e, ye, hy, 64 * sizeof(float));
    float out_g[64], out_e[64];
    int pos[3] = {3, 4, 5};
    for (int step = 0; step < 3; step++) {
        /* the third step has more rows (the same graph) and one op more (another) */
        const int rows = step < 2 ? 2 : 3, extra = step == 2;
        backend_stats_t t, d;
        backend_stats(g, &t);
        graph_step(g, xg, yg, out_g, &tg, pos, rows, extra);
        d = stats_since(g, &t);
        graph_step(e, xe, ye, out_e, &te, pos, rows, extra);
        CHECK_MSG(!memcmp(out_g, out_e, sizeof out_g), "step %d: the graph's bytes differ", step);
        const size_t staged =
            (size_t)rows * sizeof(int) + 6 * sizeof(int) + 3 * sizeof(int) + 4 * sizeof(float);
        CHECK_MSG(d.graph_launches == 1 && d.h2d_copies == 1 && d.d2h_copies == 1 && d.syncs == 1,
                  "step %d: %llu graph launches, %llu uploads, %llu downloads, %llu waits", step,
                  (unsigned long long)d.graph_launches, (unsigned long long)d.h2d_copies,
                  (unsigned long long)d.d2h_copies, (unsigned long long)d.syncs);
        CHECK_MSG(d.h2d_bytes >= staged && d.h2d_bytes < staged + 4 * 16,
                  "step %d: %llu bytes uploaded for %zu staged", step,
                  (unsigned long long)d.h2d_bytes, staged);
        CHECK_MSG(d.launches == 5u + (unsigned)extra && d.d2d_copies == 1,
                  "step %d: %llu launches recorded", step, (unsigned long long)d.launches);
        CHECK_MSG(d.graph_builds == (step == 1 ? 0u : 1u) &&
                      d.graph_updates == (step == 1 ? 1u : 0u),
                  "step %d: %llu graphs built, %llu updated", step,
                  (unsigned long long)d.graph_builds, (unsigned long long)d.graph_updates);
        pos[0] += 3, pos[1] += 3, pos[2] += 3;
    }
    CHECK(backend_status(g, &err) == AR_OK && backend_status(e, &err) == AR_OK);
    free(hx);
    free(hy);
    free(hw);
out:
    if (g)
        g->destroy(g);
    if (e)
        e->destroy(e);
}

/* The instantiated graphs are a cache of eight, the least recently used
 * replaced: eight shapes fill it, the first used again is updated, a ninth
 * shape replaces the second (the least recent), not the first (the most),
 * so the first is updated again and the second built again. */
static void test_the_graph_cache_replaces_the_least_recently_used(void) {
    ar_error_t err = {{0}};
    backend_t *g = create_checked("0", STATS_RESERVE, &err);
    CHECK_MSG(g != NULL, "%s", err.msg);
    if (!g)
        return;
    g->graphs = GRAPHS_ON;
    float *hw = host_uniform(6, -1, 1);
    const int64_t shape[2] = {3, 2};
    tensor_t t;
    CHECK(g->weight_load(g, &t, hw, DTYPE_F32, 2, shape, &err) == AR_OK);
    float *x = g->alloc(g, 64 * sizeof(float)), *y = g->alloc(g, 64 * sizeof(float));
    g->upload(g, x, hw, 6 * sizeof(float));
    g->upload(g, y, hw, 6 * sizeof(float));
    float out[64];
    int pos[3] = {0, 1, 2};
    /* (shape = ops more than the first, built?) in order */
    static const struct {
        int shape, built;
    } steps[] = {{0, 1}, {1, 1}, {2, 1}, {3, 1}, {4, 1}, {5, 1}, {6, 1},
                 {7, 1}, {0, 0}, {8, 1}, {0, 0}, {2, 0}, {1, 1}};
    for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
        backend_stats_t before, d;
        backend_stats(g, &before);
        graph_step(g, x, y, out, &t, pos, 2, steps[i].shape);
        d = stats_since(g, &before);
        CHECK_MSG(d.graph_builds == (unsigned)steps[i].built &&
                      d.graph_updates == (unsigned)!steps[i].built,
                  "step %zu (shape %d): %llu graphs built, %llu updated", i, steps[i].shape,
                  (unsigned long long)d.graph_builds, (unsigned long long)d.graph_updates);
    }
    CHECK(backend_status(g, &err) == AR_OK);
    free(hw);
    g->destroy(g);
}

/* ARSERVE_CUDA_CHECK=1 waits after every op (one more sync each, and an
 * upload's own wait besides), computes the same bits as without it, and
 * a fork inherits it. */
static void test_check_mode_syncs_after_every_op(void) {
    ar_error_t err = {{0}};
    backend_t *b = create_checked("1", (size_t)256 << 20, &err);
    CHECK_MSG(b != NULL, "%s", err.msg);
    if (!b)
        return;
    enum { R = 5, D = 48 };
    float *hx = host_uniform(R * D, -2, 2), *hw = host_uniform(D, 0.5f, 1.5f);
    const int64_t shape[1] = {D};
    tensor_t wb, wd;
    CHECK(b->weight_load(b, &wb, hw, DTYPE_F32, 1, shape, &err) == AR_OK);
    CHECK(dut->weight_load(dut, &wd, hw, DTYPE_F32, 1, shape, &err) == AR_OK);
    float *xb = b->alloc(b, sizeof(float) * R * D), *xd = dut->alloc(dut, sizeof(float) * R * D);
    backend_stats_t t, d;
    backend_stats(b, &t);
    b->upload(b, xb, hx, sizeof(float) * R * D);
    d = stats_since(b, &t);
    CHECK(d.h2d_copies == 1 && d.syncs == 2);
    dut->upload(dut, xd, hx, sizeof(float) * R * D);
    backend_stats(b, &t);
    b->rmsnorm(b, xb, xb, &wb, R, D, 1e-6f);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.syncs == 1);
    backend_stats(b, &t);
    b->copy(b, xb, xb, 0); /* nothing to copy: the check still waits */
    b->silu(b, xb, (size_t)R * D);
    d = stats_since(b, &t);
    CHECK(d.launches == 1 && d.d2d_copies == 0 && d.syncs == 2);
    dut->rmsnorm(dut, xd, xd, &wd, R, D, 1e-6f);
    dut->silu(dut, xd, (size_t)R * D);
    /* the optional ops are checked as every other one: a launch, a wait */
    float *hl = host_uniform(D * D, 0, 0), *tab = b->alloc(b, sizeof(float) * 3 * D);
    const int q_start[2] = {0, R};
    const float *tabs[1] = {tab};
    tensor_t wl;
    CHECK(b->weight_load(b, &wl, hl, DTYPE_F32, 2, (const int64_t[]){D, D}, &err) == AR_OK);
    b->upload(b, tab, hl, sizeof(float) * 3 * D); /* zeros: x * (1 + 0) + 0, x += x * 0 */
    for (int op = 0; op < 3; op++) {
        backend_stats(b, &t);
        if (op == 0)
            b->matmul_add(b, xb, xb, &wl, R); /* x += x 0 */
        else if (op == 1)
            b->modulate_seqs(b, xb, xb, q_start, tabs, 1, 0, D, D);
        else
            b->gate_add_seqs(b, xb, xb, q_start, tabs, 1, 2 * D, D);
        d = stats_since(b, &t);
        CHECK_MSG(d.launches == 1 && d.syncs == 1, "optional op %d: %llu launches, %llu syncs", op,
                  (unsigned long long)d.launches, (unsigned long long)d.syncs);
    }
    b->weight_free(b, &wl);
    b->free(b, tab);
    free(hl);
    float *ob = malloc(sizeof(float) * R * D), *od = malloc(sizeof(float) * R * D);
    b->download(b, ob, xb, sizeof(float) * R * D);
    dut->download(dut, od, xd, sizeof(float) * R * D);
    CHECK(memcmp(ob, od, sizeof(float) * R * D) == 0);
    backend_t *f = b->fork(b, (size_t)1 << 20, 0, &err);
    CHECK_MSG(f != NULL, "%s", err.msg);
    if (f) {
        backend_stats(f, &t);
        f->silu(f, xb, (size_t)R * D);
        d = stats_since(f, &t);
        CHECK(d.launches == 1 && d.syncs == 1);
        CHECK(backend_status(f, &err) == AR_OK);
        f->destroy(f);
    }
    CHECK(backend_status(b, &err) == AR_OK);
    dut->free(dut, xd);
    dut->weight_free(dut, &wd);
    b->destroy(b);
    free(hx), free(hw), free(ob), free(od);
    check_status_clean("ARSERVE_CUDA_CHECK=1");
}

/* ---- GEMMs --------------------------------------------------------------------- */

/* sum over p of |x[i, p] w_g[j, p]| for each output of G stacked matrices
 * wr ([G, n, k], as rounded to their type) over x [m, k]: the bound's scale
 * for every GEMM check (gemm_mag_tol). Freed by the caller. */
static double *gemm_mags(const float *x, const float *wr, int G, int m, int n, int k) {
    double *mag = malloc(((size_t)G * m * n + 1) * sizeof *mag);
    for (int g = 0; g < G; g++)
        for (int i = 0; i < m; i++)
            for (int j = 0; j < n; j++) {
                double sum = 0;
                for (int p = 0; p < k; p++)
                    sum += fabs((double)x[(size_t)i * k + p] * wr[((size_t)g * n + j) * k + p]);
                mag[((size_t)g * m + i) * n + j] = sum;
            }
    return mag;
}

/* y = x w^T (+ bias) for one shape, weight type and bias type. */
static void check_matmul(int m, int n, int k, dtype_t wt, int with_bias, dtype_t bt) {
    float *x = host_uniform((size_t)m * k, -1, 1), *wf = host_uniform((size_t)n * k, -1, 1);
    float *bf = host_uniform((size_t)n, -1, 1);
    float *wr = malloc(((size_t)n * k + 1) * 4), *br = malloc(((size_t)n + 1) * 4);
    void *ws = host_as(wf, (size_t)n * k, wt, wr), *bs = host_as(bf, (size_t)n, bt, br);
    wpair_t w = wpair_load(ws, wt, 2, n, k, 1, 1), b = wpair_load(bs, bt, 1, n, 1, 1, 1);
    pair_t px = pair_new(x, (size_t)m * k), py = pair_new(NULL, (size_t)m * n);
    cpu->matmul(cpu, py.ref, px.ref, &w.ref, with_bias ? &b.ref : NULL, m);
    dut->matmul(dut, py.dut, px.dut, &w.dut, with_bias ? &b.dut : NULL, m);
    double *mag = gemm_mags(x, wr, 1, m, n, k);
    char what[96];
    snprintf(what, sizeof what, "matmul %s m=%d n=%d k=%d bias=%s", type_name(wt), m, n, k,
             with_bias ? type_name(bt) : "none");
    compare(what, py, 1e-6, 1e-6, mag, gemm_mag_tol(wt, k));
    check_unchanged(what, px, x);
    pair_del(px);
    pair_del(py);
    wpair_free(&w);
    wpair_free(&b);
    free(x), free(wf), free(bf), free(wr), free(br), free(ws), free(bs), free(mag);
}

/* Shapes: empty m, empty k (bias or zeros only), one element, primes, a
 * decode row against a wide weight, and one whose output needs three
 * slices of the scratch (n = 400000: 20 rows per slice, m = 45). */
static void test_matmul_types_shapes_and_bias(void) {
    const int shapes[][3] = {{0, 5, 3},     {3, 7, 0},     {1, 1, 1},     {5, 33, 17},
                             {37, 65, 129}, {1, 300, 257}, {70, 31, 1000}};
    for (int t = 0; t < 3; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (int bias = 0; bias < 2; bias++)
                check_matmul(shapes[s][0], shapes[s][1], shapes[s][2], all_types[t], bias,
                             bias && t == 1 ? DTYPE_F16 : DTYPE_F32);
    check_matmul(2, 3, 4, DTYPE_BF16, 1, DTYPE_BF16);
    check_status_clean("matmul");
}

static void test_matmul_sliced_over_scratch(void) {
    check_matmul(45, 400000, 3, DTYPE_BF16, 1, DTYPE_F16);
    check_status_clean("matmul sliced");
}

/* matmul (add: matmul_add over y0, no bias) in activation mode act against
 * the CPU's matmul (then add): split within matmul's tolerance, 16-bit
 * within the rounding of x to the weight's type (2^-8 of each |x| for
 * bf16, 2^-11 for f16) on top. */
static void check_matmul_mode(int m, int n, int k, dtype_t wt, int with_bias, int add,
                              backend_activations_t act) {
    float *x = host_uniform((size_t)m * k, -1, 1), *wf = host_uniform((size_t)n * k, -1, 1);
    float *bf = host_uniform((size_t)n, -1, 1), *y0 = host_uniform((size_t)m * n, -1, 1);
    float *wr = malloc(((size_t)n * k + 1) * 4);
    void *ws = host_as(wf, (size_t)n * k, wt, wr);
    wpair_t w = wpair_load(ws, wt, 2, n, k, 1, 1), b = wpair_load(bf, DTYPE_F32, 1, n, 1, 1, 1);
    pair_t px = pair_new(x, (size_t)m * k), py = pair_new(add ? y0 : NULL, (size_t)m * n);
    pair_t pt = pair_new(NULL, (size_t)m * n);
    dut->activations = act;
    if (add) {
        backend_matmul_add(cpu, py.ref, px.ref, &w.ref, m, pt.ref);
        dut->matmul_add(dut, py.dut, px.dut, &w.dut, m);
    } else {
        cpu->matmul(cpu, py.ref, px.ref, &w.ref, with_bias ? &b.ref : NULL, m);
        dut->matmul(dut, py.dut, px.dut, &w.dut, with_bias ? &b.dut : NULL, m);
    }
    dut->activations = ACTIVATIONS_SPLIT;
    double *mag = gemm_mags(x, wr, 1, m, n, k);
    char what[112];
    snprintf(what, sizeof what, "matmul%s %s activations %s m=%d n=%d k=%d bias=%d",
             add ? "_add" : "", act == ACTIVATIONS_SPLIT ? "split" : "16-bit", type_name(wt), m, n,
             k, with_bias);
    const double x_round = act == ACTIVATIONS_SPLIT ? 0 : wt == DTYPE_BF16 ? 0x1p-8 : 0x1p-11;
    compare(what, py, 1e-6, 1e-6, mag, gemm_mag_tol(wt, k) + x_round);
    check_unchanged(what, px, x);
    pair_del(px), pair_del(py), pair_del(pt);
    wpair_free(&w);
    wpair_free(&b);
    free(x), free(wf), free(bf), free(y0), free(wr), free(ws), free(mag);
}

/* 16-bit activations, and matmul_add in both modes, over the shapes of a
 * decode row, a prime-sized block and more than one scratch slice. */
static void test_matmul_activation_modes_and_add(void) {
    const int shapes[][3] = {{1, 300, 257}, {37, 65, 129}, {3, 7, 0}};
    const dtype_t types[2] = {DTYPE_BF16, DTYPE_F16};
    for (int t = 0; t < 2; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            const int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
            check_matmul_mode(m, n, k, types[t], 0, 0, ACTIVATIONS_16BIT);
            check_matmul_mode(m, n, k, types[t], 1, 0, ACTIVATIONS_16BIT);
            check_matmul_mode(m, n, k, types[t], 0, 1, ACTIVATIONS_16BIT);
            check_matmul_mode(m, n, k, types[t], 0, 1, ACTIVATIONS_SPLIT);
        }
    check_matmul_mode(5, 33, 17, DTYPE_F32, 0, 1, ACTIVATIONS_16BIT);
    check_matmul_mode(45, 400000, 3, DTYPE_BF16, 0, 1, ACTIVATIONS_16BIT);
    check_status_clean("matmul activation modes");
}

/* The dut's z = matmul(w) of rmsnorm's output (produce 0) or silu_mul's
 * (1) over rows x k, in 16-bit activations, with `between` run on the
 * output first when not NULL (0: nothing); the launches taken into
 * *launches. z is read back into host (rows * n floats). */
static void produce_then_matmul(int produce, void (*between)(float *, size_t), const tensor_t *w,
                                const tensor_t *norm_w, float *a, float *b, float *y, float *z,
                                int rows, int k, float *host, unsigned long long *launches) {
    backend_stats_t t, d;
    dut->activations = ACTIVATIONS_16BIT;
    backend_stats(dut, &t);
    if (produce == 0)
        dut->rmsnorm(dut, y, a, norm_w, rows, k, 1e-6f);
    else
        dut->silu_mul(dut, y, a, b, (size_t)rows * k);
    if (between)
        between(y, (size_t)rows * k);
    dut->matmul(dut, z, y, w, NULL, rows);
    d = stats_since(dut, &t);
    *launches = d.launches;
    dut->activations = ACTIVATIONS_SPLIT;
    dut->download(dut, host, z, (size_t)rows * (size_t)w->shape[0] * sizeof(float));
}

static void scale_by_two(float *y, size_t n) { dut->scale(dut, y, n, 2.0f); }
static void copy_to_itself(float *y, size_t n) { dut->copy(dut, y, y, n * sizeof(float)); }

/* In 16-bit activations, rmsnorm and silu_mul leave a bf16 copy of their
 * output that the next matmul of a bf16 weight takes instead of casting it
 * (one launch fewer): the same bytes as the cast; never after another op
 * has run (a stale copy of a changed output would be used), nor for an
 * f16 weight. */
static void test_norm_and_silu_hand_bf16_to_the_next_matmul(void) {
    const int rows = 5, k = 96, n = 40;
    float *ha = host_uniform((size_t)rows * k, -2, 2), *hb = host_uniform((size_t)rows * k, -2, 2);
    float *hn = host_uniform((size_t)k, 0.5f, 1.5f), *hw = host_uniform((size_t)n * k, -1, 1);
    float *wr = malloc((size_t)n * k * 4), *got = malloc((size_t)rows * n * 4),
          *want = malloc((size_t)rows * n * 4);
    void *w16 = host_as(hw, (size_t)n * k, DTYPE_BF16, wr),
         *wf16 = host_as(hw, (size_t)n * k, DTYPE_F16, wr);
    wpair_t wb = wpair_load(w16, DTYPE_BF16, 2, n, k, 1, 1),
            wf = wpair_load(wf16, DTYPE_F16, 2, n, k, 1, 1),
            nw = wpair_load(hn, DTYPE_F32, 1, k, 1, 1, 1);
    pair_t pa = pair_new(ha, (size_t)rows * k), pb = pair_new(hb, (size_t)rows * k);
    pair_t py = pair_new(NULL, (size_t)rows * k), pz = pair_new(NULL, (size_t)rows * n);
    for (int produce = 0; produce < 2; produce++) {
        unsigned long long direct, cast;
        produce_then_matmul(produce, NULL, &wb.dut, &nw.dut, pa.dut, pb.dut, py.dut, pz.dut, rows,
                            k, got, &direct);
        produce_then_matmul(produce, copy_to_itself, &wb.dut, &nw.dut, pa.dut, pb.dut, py.dut,
                            pz.dut, rows, k, want, &cast);
        CHECK_MSG(direct == 2 && cast == 3, "%s then matmul: %llu launches, %llu with a cast",
                  produce ? "silu_mul" : "rmsnorm", direct, cast);
        CHECK_MSG(memcmp(got, want, (size_t)rows * n * 4) == 0,
                  "%s then matmul: the handed bf16 differs from the cast",
                  produce ? "silu_mul" : "rmsnorm");
        /* a changed output and an f16 weight: against the CPU */
        const tensor_t *ws[2] = {&wb.dut, &wf.dut}, *wrf[2] = {&wb.ref, &wf.ref};
        for (int f = 0; f < 2; f++) {
            if (produce == 0)
                cpu->rmsnorm(cpu, py.ref, pa.ref, &nw.ref, rows, k, 1e-6f);
            else
                cpu->silu_mul(cpu, py.ref, pa.ref, pb.ref, (size_t)rows * k);
            if (!f)
                cpu->scale(cpu, py.ref, (size_t)rows * k, 2.0f);
            cpu->matmul(cpu, pz.ref, py.ref, wrf[f], NULL, rows);
            unsigned long long l;
            produce_then_matmul(produce, f ? NULL : scale_by_two, ws[f], &nw.dut, pa.dut, pb.dut,
                                py.dut, pz.dut, rows, k, got, &l);
            double worst = 0, bound = 0;
            for (size_t i = 0; i < (size_t)rows * n; i++) {
                worst = fmax(worst, fabs((double)got[i] - pz.ref[i]));
                bound = fmax(bound, 0.02 * fabs((double)pz.ref[i]) + 0.05);
            }
            CHECK_MSG(worst <= bound, "%s, %s: off by %.3g (bound %.3g)",
                      produce ? "silu_mul" : "rmsnorm",
                      f ? "an f16 weight" : "the output doubled before the matmul", worst, bound);
        }
    }
    pair_del(pa), pair_del(pb), pair_del(py), pair_del(pz);
    wpair_free(&wb), wpair_free(&wf), wpair_free(&nw);
    free(ha), free(hb), free(hn), free(hw), free(wr), free(got), free(want), free(w16), free(wf16);
    check_status_clean("bf16 hand-off");
}

/* The CPU's matmul of each of w's G matrices ([G, n, k], stored as ws in
 * type wt, bias bf [G, n] or NULL) over x, one call each, into y's G
 * blocks; packed: the matrices prepared for matmul first. */
static void cpu_matmul_parts(float *y, const float *x, const void *ws, dtype_t wt, const float *bf,
                             int G, int m, int n, int k, int packed) {
    ar_error_t err = {{0}};
    const size_t part = (size_t)n * k * dtype_size(wt);
    for (int g = 0; g < G; g++) {
        tensor_t w, b;
        CHECK(cpu->weight_load(cpu, &w, (const char *)ws + g * part, wt, 2, (const int64_t[]){n, k},
                               &err) == AR_OK);
        CHECK(!bf || cpu->weight_load(cpu, &b, bf + (size_t)g * n, DTYPE_F32, 1,
                                      (const int64_t[]){n}, &err) == AR_OK);
        CHECK(!packed || cpu->weight_prepare(cpu, &w, LAYOUT_LINEAR, &err) == AR_OK);
        cpu->matmul(cpu, y + (size_t)g * m * n, x, &w, bf ? &b : NULL, m);
        cpu->weight_free(cpu, &w);
        if (bf)
            cpu->weight_free(cpu, &b);
    }
}

/* A stacked weight [G, n, k] (backend.h's matmul): on the CPU, as loaded
 * and prepared, the same bytes as its G matrices one call each; on the
 * backend under test within matmul's tolerance of them. */
static void check_matmul_stacked(int G, int m, int n, int k, dtype_t wt, int with_bias) {
    const size_t nk = (size_t)n * k, out = (size_t)G * m * n;
    float *x = host_uniform((size_t)m * k, -1, 1), *wf = host_uniform(G * nk, -1, 1);
    float *bf = host_uniform((size_t)G * n, -1, 1), *wr = malloc((G * nk + 1) * 4);
    void *ws = host_as(wf, G * nk, wt, wr);
    wpair_t w = wpair_load(ws, wt, 3, G, n, k, 1), b = wpair_load(bf, DTYPE_F32, 2, G, n, 1, 1);
    pair_t px = pair_new(x, (size_t)m * k), py = pair_new(NULL, out);
    cpu->matmul(cpu, py.ref, px.ref, &w.ref, with_bias ? &b.ref : NULL, m);
    dut->matmul(dut, py.dut, px.dut, &w.dut, with_bias ? &b.dut : NULL, m);
    char what[112];
    snprintf(what, sizeof what, "matmul stacked %d x %s m=%d n=%d k=%d bias=%d", G, type_name(wt),
             m, n, k, with_bias);
    float *parts = malloc((out + 1) * 4), *stacked = malloc((out + 1) * 4);
    cpu_matmul_parts(parts, px.ref, ws, wt, with_bias ? bf : NULL, G, m, n, k, 0);
    CHECK_MSG(memcmp(parts, py.ref, out * 4) == 0, "%s: the CPU's stack differs from its parts",
              what);
    ar_error_t err = {{0}};
    tensor_t packed;
    CHECK(cpu->weight_load(cpu, &packed, ws, wt, 3, (const int64_t[]){G, n, k}, &err) == AR_OK);
    CHECK(cpu->weight_prepare(cpu, &packed, LAYOUT_LINEAR, &err) == AR_OK);
    cpu->matmul(cpu, stacked, px.ref, &packed, with_bias ? &b.ref : NULL, m);
    cpu_matmul_parts(parts, px.ref, ws, wt, with_bias ? bf : NULL, G, m, n, k, 1);
    CHECK_MSG(memcmp(parts, stacked, out * 4) == 0,
              "%s: the CPU's prepared stack differs from its prepared parts", what);
    cpu->weight_free(cpu, &packed);
    double *mag = gemm_mags(x, wr, G, m, n, k);
    compare(what, py, 1e-6, 1e-6, mag, gemm_mag_tol(wt, k));
    check_unchanged(what, px, x);
    pair_del(px);
    pair_del(py);
    wpair_free(&w);
    wpair_free(&b);
    free(x), free(wf), free(bf), free(wr), free(ws), free(parts), free(stacked), free(mag);
}

/* q, k and v stacked (3) and gate and up (2), in every type, with and
 * without biases; rows from a decode step to more than one scratch slice. */
static void test_matmul_stacked_equals_its_parts(void) {
    const int shapes[][4] = {{3, 1, 64, 48}, {3, 37, 65, 129}, {2, 5, 33, 17}, {2, 0, 4, 3}};
    for (int t = 0; t < 3; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++)
            for (int bias = 0; bias < 2; bias++)
                check_matmul_stacked(shapes[s][0], shapes[s][1], shapes[s][2], shapes[s][3],
                                     all_types[t], bias);
    check_matmul_stacked(3, 45, 133334, 3, DTYPE_BF16, 1);
    check_status_clean("matmul stacked");
}

/* ---- 8-bit Linear weights ---------------------------------------------------- */

/* An 8-bit weight: G matrices of [n, k] (ndim 3; ndim 2: one, G = 1) of
 * type wt, its elements q (int8 in [-127, 127], or any finite e4m3 code,
 * subnormals and +-448 included), its G * n row scales, and w, what they
 * stand for in fp32: q's value times its row's scale, the definition both
 * backends hold to (docs/model-format.md). */
typedef struct w8 {
    dtype_t wt;
    int ndim, G, n, k;
    unsigned char *q;
    float *scale, *w;
} w8_t;

static float w8_value(dtype_t wt, unsigned char q) {
    return wt == DTYPE_I8 ? (float)(int8_t)q : f8e4m3_to_f32(q);
}

/* pow2: every scale a power of two (2^-3 to 2^-10), so that each value
 * times it is exact in bf16; else about 1 / the type's largest value,
 * with row n / 2 of each matrix at 0 (as a converter scales a row of
 * zeros). */
static w8_t w8_random(dtype_t wt, int ndim, int G, int n, int k, int pow2) {
    const size_t rows = (size_t)G * n, numel = rows * k;
    w8_t h = {
        wt, ndim, G, n, k, malloc(numel + 1), malloc((rows + 1) * 4), malloc((numel + 1) * 4)};
    for (size_t i = 0; i < numel; i++) {
        unsigned char b = (unsigned char)(rng_next() >> 32);
        if (wt == DTYPE_I8)
            b = (unsigned char)(int8_t)((int)((rng_next() >> 32) % 255) - 127);
        else
            while ((b & 0x7f) == 0x7f) /* NaN */
                b = (unsigned char)(rng_next() >> 32);
        h.q[i] = b;
    }
    const float top = wt == DTYPE_I8 ? 127.0f : 448.0f;
    for (size_t r = 0; r < rows; r++)
        h.scale[r] = pow2                       ? ldexpf(1.0f, -3 - (int)((rng_next() >> 32) % 8))
                     : r % n == (size_t)(n / 2) ? 0.0f
                                                : rng_uniform(0.5f, 1.5f) / top;
    for (size_t i = 0; i < numel; i++)
        h.w[i] = w8_value(wt, h.q[i]) * h.scale[i / k];
    return h;
}

static void w8_free(w8_t *h) { free(h->q), free(h->scale), free(h->w); }

static const int64_t *w8_shape(const w8_t *h, int64_t shape[3]) {
    shape[0] = h->G, shape[1] = h->n, shape[2] = h->k;
    return h->ndim == 3 ? shape : shape + 1;
}

/* h on backend b as an 8-bit weight (prepared for matmul where b prepares). */
static void w8_load(backend_t *b, tensor_t *t, const w8_t *h) {
    ar_error_t err = {{0}};
    int64_t s[3];
    CHECK_MSG(b->weight_load_8bit(b, t, h->q, h->wt, h->scale, h->ndim, w8_shape(h, s), &err) ==
                  AR_OK,
              "%s", err.msg);
    CHECK_MSG(!b->weight_prepare || b->weight_prepare(b, t, LAYOUT_LINEAR, &err) == AR_OK, "%s",
              err.msg);
}

/* h's values on backend b as a weight of type dt (the reference's F32, or
 * BF16 where they are exact in it). */
static void w8_load_values(backend_t *b, tensor_t *t, const w8_t *h, dtype_t dt) {
    ar_error_t err = {{0}};
    int64_t s[3];
    float *r = malloc(((size_t)h->G * h->n * h->k + 1) * 4);
    void *stored = host_as(h->w, (size_t)h->G * h->n * h->k, dt, r);
    CHECK_MSG(b->weight_load(b, t, stored, dt, h->ndim, w8_shape(h, s), &err) == AR_OK, "%s",
              err.msg);
    free(r);
    free(stored);
}

/* y = x w^T (+ bias) (add: y0 + x w^T, through matmul_add, no bias) for
 * an 8-bit weight, on the backend under test in activation mode act,
 * against the CPU's matmul of the weight's values in fp32 (the definition)
 * and the CPU's matmul of the 8-bit weight: within the
 * bounds of a bf16 weight (the values are widened to bf16 exactly and the
 * scale applied to the products, so only x is rounded), plus x's rounding
 * in 16-bit activations. Returns the launches the backend's op took. */
static unsigned long long check_matmul_8bit(dtype_t wt, int ndim, int G, int m, int n, int k,
                                            int with_bias, dtype_t bt, int add,
                                            backend_activations_t act) {
    w8_t h = w8_random(wt, ndim, G, n, k, 0);
    const size_t out = (size_t)G * m * n;
    float *x = host_uniform((size_t)m * k, -1, 1), *bf = host_uniform((size_t)G * n, -1, 1);
    float *y0 = host_uniform(out, -1, 1), *br = malloc(((size_t)G * n + 1) * 4);
    void *bs = host_as(bf, (size_t)G * n, bt, br);
    wpair_t b = ndim == 3 ? wpair_load(bs, bt, 2, G, n, 1, 1) : wpair_load(bs, bt, 1, n, 1, 1, 1);
    tensor_t wf, wd, wc;
    w8_load_values(cpu, &wf, &h, DTYPE_F32);
    w8_load(dut, &wd, &h);
    pair_t px = pair_new(x, (size_t)m * k), py = pair_new(add ? y0 : NULL, out);
    float *tmp = add ? cpu->alloc(cpu, out * 4 + 4) : NULL; /* the CPU's matmul before its add */
    dut->activations = act;
    backend_stats_t t0;
    backend_stats(dut, &t0);
    if (add)
        dut->matmul_add(dut, py.dut, px.dut, &wd, m);
    else
        dut->matmul(dut, py.dut, px.dut, &wd, with_bias ? &b.dut : NULL, m);
    const unsigned long long launches = stats_since(dut, &t0).launches;
    dut->activations = ACTIVATIONS_SPLIT;
    double *mag = gemm_mags(x, h.w, G, m, n, k);
    const double tol = gemm_mag_tol(DTYPE_BF16, k) + (act == ACTIVATIONS_SPLIT ? 0 : 0x1p-8);
    char what[160];
    for (int ref = 0; ref < 2; ref++) {
        if (ref)
            w8_load(cpu, &wc, &h);
        const tensor_t *wr = ref ? &wc : &wf;
        if (add) {
            cpu->upload(cpu, py.ref, y0, out * 4);
            backend_matmul_add(cpu, py.ref, px.ref, wr, m, tmp);
        } else {
            cpu->matmul(cpu, py.ref, px.ref, wr, with_bias ? &b.ref : NULL, m);
        }
        snprintf(what, sizeof what,
                 "matmul%s %s%s, %s activations, G=%d m=%d n=%d k=%d bias=%s, against the CPU's "
                 "%s",
                 add ? "_add" : "", ndim == 3 ? "stacked " : "", dtype_name(wt),
                 act == ACTIVATIONS_SPLIT ? "split" : "16-bit", G, m, n, k,
                 with_bias ? dtype_name(bt) : "none", ref ? "8-bit weight" : "fp32 values");
        compare(what, py, 1e-6, 1e-6, mag, tol);
        if (ref)
            cpu->weight_free(cpu, &wc);
    }
    check_unchanged(what, px, x);
    pair_del(px), pair_del(py);
    cpu->free(cpu, tmp);
    cpu->weight_free(cpu, &wf);
    dut->weight_free(dut, &wd);
    CHECK(wd.data == NULL && wd.scale == NULL);
    wpair_free(&b);
    w8_free(&h);
    free(x), free(bf), free(y0), free(br), free(bs), free(mag);
    return launches;
}

/* In 16-bit activations, rmsnorm's bf16 copy of its output is what a
 * matmul of an 8-bit weight [n, k] reads next (want_direct launches, the
 * rmsnorm's included) instead of a cast of it (want_cast): the same bytes. */
static void check_8bit_hand_off(dtype_t wt, int m, int n, int k, unsigned long long want_direct,
                                unsigned long long want_cast) {
    w8_t h = w8_random(wt, 2, 1, n, k, 0);
    float *ha = host_uniform((size_t)m * k, -2, 2), *hn = host_uniform((size_t)k, 0.5f, 1.5f);
    float *got = malloc((size_t)m * n * 4), *want = malloc((size_t)m * n * 4);
    tensor_t w, nw;
    ar_error_t err = {{0}};
    w8_load(dut, &w, &h);
    CHECK(dut->weight_load(dut, &nw, hn, DTYPE_F32, 1, (const int64_t[]){k}, &err) == AR_OK);
    float *a = dut->alloc(dut, (size_t)m * k * 4), *y = dut->alloc(dut, (size_t)m * k * 4);
    float *z = dut->alloc(dut, (size_t)m * n * 4);
    CHECK(a && y && z);
    dut->upload(dut, a, ha, (size_t)m * k * 4);
    unsigned long long direct, cast;
    produce_then_matmul(0, NULL, &w, &nw, a, NULL, y, z, m, k, got, &direct);
    produce_then_matmul(0, copy_to_itself, &w, &nw, a, NULL, y, z, m, k, want, &cast);
    CHECK_MSG(direct == want_direct && cast == want_cast,
              "rmsnorm then matmul of %s m=%d n=%d k=%d: %llu launches, %llu with a cast",
              dtype_name(wt), m, n, k, direct, cast);
    CHECK_MSG(memcmp(got, want, (size_t)m * n * 4) == 0,
              "rmsnorm then matmul of %s m=%d n=%d k=%d: the handed bf16 differs from the cast",
              dtype_name(wt), m, n, k);
    dut->free(dut, a), dut->free(dut, y), dut->free(dut, z);
    dut->weight_free(dut, &w), dut->weight_free(dut, &nw);
    w8_free(&h);
    free(ha), free(hn), free(got), free(want);
}

/* int8 and fp8, one matrix and a stack of three, rows of a decode step, a
 * few and a prefill's, odd sizes, with and without a bias; then no rows,
 * no columns (the bias alone) and a bf16 bias. */
/* seq_rows_matmul (engine/family/seq_rows.c) with a stacked 8-bit weight on
 * the backend under test, batch invariant: a GEMM per sequence and per
 * matrix of the stack, the weight as loaded, each matrix with its own
 * scales: the CPU's one matmul over the stack. */
static void test_seq_rows_8bit_stack_batch_invariant(void) {
    static const dtype_t types[] = {DTYPE_I8, DTYPE_F8_E4M3};
    const int q_start[] = {0, 3, 7}, m = 7, G = 3, n = 37, k = 65;
    for (int t = 0; t < 2; t++) {
        w8_t h = w8_random(types[t], 3, G, n, k, 0);
        float *x = host_uniform((size_t)m * k, -1, 1);
        tensor_t wd, wc;
        w8_load(dut, &wd, &h);
        w8_load(cpu, &wc, &h);
        pair_t px = pair_new(x, (size_t)m * k), py = pair_new(NULL, (size_t)G * m * n);
        const int was = dut->batch_invariant;
        dut->batch_invariant = 1;
        seq_rows_matmul(dut, py.dut, px.dut, &wd, NULL, q_start, 2);
        dut->batch_invariant = was;
        cpu->matmul(cpu, py.ref, px.ref, &wc, NULL, m);
        double *mag = gemm_mags(x, h.w, G, m, n, k);
        char what[96];
        snprintf(what, sizeof what, "seq_rows_matmul, batch invariant, stacked %s G=%d",
                 dtype_name(types[t]), G);
        compare(what, py, 1e-6, 1e-6, mag, gemm_mag_tol(DTYPE_BF16, k));
        pair_del(px), pair_del(py);
        cpu->weight_free(cpu, &wc);
        dut->weight_free(dut, &wd);
        w8_free(&h);
        free(x), free(mag);
    }
}

static void test_matmul_8bit_against_the_cpu(void) {
    const dtype_t types[2] = {DTYPE_I8, DTYPE_F8_E4M3};
    const int ms[3] = {1, 8, 200}, nk[2][2] = {{33, 17}, {65, 129}};
    for (int t = 0; t < 2; t++)
        for (int stacked = 0; stacked < 2; stacked++)
            for (int im = 0; im < 3; im++)
                for (int s = 0; s < 2; s++)
                    for (int bias = 0; bias < 2; bias++)
                        check_matmul_8bit(types[t], stacked ? 3 : 2, stacked ? 3 : 1, ms[im],
                                          nk[s][0], nk[s][1], bias, DTYPE_F32, 0,
                                          ACTIVATIONS_SPLIT);
    for (int t = 0; t < 2; t++) {
        check_matmul_8bit(types[t], 2, 1, 0, 5, 3, 1, DTYPE_F32, 0, ACTIVATIONS_SPLIT);
        check_matmul_8bit(types[t], 3, 2, 3, 7, 0, 1, DTYPE_F32, 0, ACTIVATIONS_SPLIT);
        check_matmul_8bit(types[t], 2, 1, 3, 7, 0, 0, DTYPE_F32, 0, ACTIVATIONS_SPLIT);
        check_matmul_8bit(types[t], 2, 1, 5, 33, 17, 1, DTYPE_BF16, 0, ACTIVATIONS_SPLIT);
    }
    check_status_clean("matmul 8-bit");
}

/* 16-bit activations (a cast of x, as for a bf16 weight), and matmul_add
 * (of a matrix: backend.h gives it no stacks) in both modes. */
static void test_matmul_8bit_activation_modes_and_add(void) {
    const dtype_t types[2] = {DTYPE_I8, DTYPE_F8_E4M3};
    const int shapes[][4] = {{1, 1, 65, 129}, {3, 8, 33, 17}, {1, 37, 31, 257}};
    for (int t = 0; t < 2; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            const int G = shapes[s][0], m = shapes[s][1], n = shapes[s][2], k = shapes[s][3];
            const int ndim = G > 1 ? 3 : 2;
            check_matmul_8bit(types[t], ndim, G, m, n, k, 0, DTYPE_F32, 0, ACTIVATIONS_16BIT);
            check_matmul_8bit(types[t], ndim, G, m, n, k, 1, DTYPE_F32, 0, ACTIVATIONS_16BIT);
            if (G > 1)
                continue;
            check_matmul_8bit(types[t], ndim, G, m, n, k, 0, DTYPE_F32, 1, ACTIVATIONS_16BIT);
            check_matmul_8bit(types[t], ndim, G, m, n, k, 0, DTYPE_F32, 1, ACTIVATIONS_SPLIT);
        }
    check_status_clean("matmul 8-bit activation modes");
}

/* An 8-bit weight larger than half the scratch is widened in slices of its
 * rows, and more rows of x than the rest holds go in slices of rows, as
 * the launches show: 5M rows of k = 3 in split activations (two weight
 * slices of 4194270 rows, whose 32 MiB of split products leave room for
 * one row of x: each slice a widening and three times a split, a GEMM and
 * the scaling), the same in 16-bit ones (one slice, three rows of x), and
 * a stack of three 1401 x 4097 matrices (two slices of 1364 and 37 rows of
 * each matrix, the stack at once, x cast once); rows of rmsnorm's bf16
 * copy in slices. */
static void test_matmul_8bit_sliced_over_scratch(void) {
    unsigned long long l;
    l = check_matmul_8bit(DTYPE_I8, 2, 1, 3, 5000003, 3, 1, DTYPE_F32, 0, ACTIVATIONS_SPLIT);
    CHECK_MSG(l == 2 * (1 + 3 * 3), "5M rows, split: %llu launches", l);
    l = check_matmul_8bit(DTYPE_F8_E4M3, 2, 1, 3, 5000003, 3, 0, DTYPE_F32, 1, ACTIVATIONS_16BIT);
    CHECK_MSG(l == 1 + 3 * 3, "5M rows, 16-bit: %llu launches", l);
    l = check_matmul_8bit(DTYPE_F8_E4M3, 3, 3, 3, 1401, 4097, 1, DTYPE_F32, 0, ACTIVATIONS_SPLIT);
    CHECK_MSG(l == 1 + 2 * 3, "a stack of 1401 x 4097: %llu launches", l);
    /* 4M rows: rmsnorm's bf16 copy stays whole beside the widened weight,
     * which leaves room for two rows of products: two GEMMs on it */
    check_8bit_hand_off(DTYPE_I8, 3, 4000001, 3, 1 + 1 + 2 * 2, 1 + 1 + 2 * 3);
    check_status_clean("matmul 8-bit sliced");
}

/* With every scale a power of two the weight's values are exact in bf16,
 * so an 8-bit weight's matmul is a bf16 weight's of its values, value for
 * value (the GEMMs have the same shapes, and scaling by a power of two is
 * exact): in split activations with and without a bias and through
 * matmul_add, and in 16-bit activations without a bias (with one, the bf16
 * path adds it inside the GEMM). */
static void test_matmul_8bit_is_the_bf16_matmul_of_its_values(void) {
    const int shapes[][4] = {{1, 8, 65, 129}, {3, 5, 33, 17}, {1, 200, 31, 257}};
    for (int t = 0; t < 2; t++)
        for (size_t s = 0; s < sizeof shapes / sizeof *shapes; s++) {
            const int G = shapes[s][0], m = shapes[s][1], n = shapes[s][2], k = shapes[s][3];
            const size_t out = (size_t)G * m * n;
            w8_t h = w8_random(t ? DTYPE_F8_E4M3 : DTYPE_I8, G > 1 ? 3 : 2, G, n, k, 1);
            size_t inexact = 0;
            for (size_t i = 0; i < (size_t)G * n * k; i++)
                inexact += bf16_to_f32(f32_to_bf16(h.w[i])) != h.w[i];
            CHECK_MSG(inexact == 0, "%zu values not exact in bf16", inexact);
            float *x = host_uniform((size_t)m * k, -1, 1), *bf = host_uniform((size_t)G * n, -1, 1);
            float *y0 = host_uniform(out, -1, 1);
            float *a = malloc(out * 4), *b16 = malloc(out * 4);
            tensor_t w8, w16, bias;
            ar_error_t err = {{0}};
            w8_load(dut, &w8, &h);
            w8_load_values(dut, &w16, &h, DTYPE_BF16);
            CHECK(dut->weight_load(dut, &bias, bf, DTYPE_F32, 2, (const int64_t[]){G, n}, &err) ==
                  AR_OK);
            float *dx = dut->alloc(dut, (size_t)m * k * 4), *dy = dut->alloc(dut, out * 4);
            dut->upload(dut, dx, x, (size_t)m * k * 4);
            for (int c = 0; c < 4; c++) { /* split, split + bias, split add, 16-bit */
                const int with_bias = c == 1, add = c == 2;
                if (add && G > 1) /* matmul_add takes a matrix */
                    continue;
                dut->activations = c == 3 ? ACTIVATIONS_16BIT : ACTIVATIONS_SPLIT;
                for (int v = 0; v < 2; v++) {
                    const tensor_t *w = v ? &w16 : &w8;
                    if (add) {
                        dut->upload(dut, dy, y0, out * 4);
                        dut->matmul_add(dut, dy, dx, w, m);
                    } else {
                        dut->matmul(dut, dy, dx, w, with_bias ? &bias : NULL, m);
                    }
                    dut->download(dut, v ? b16 : a, dy, out * 4);
                }
                size_t off = 0;
                for (size_t i = 0; i < out; i++)
                    off += a[i] != b16[i];
                CHECK_MSG(off == 0,
                          "%s G=%d m=%d n=%d k=%d, case %d: %zu of %zu outputs differ from the "
                          "bf16 weight's",
                          dtype_name(h.wt), G, m, n, k, c, off, out);
            }
            dut->activations = ACTIVATIONS_SPLIT;
            dut->free(dut, dx), dut->free(dut, dy);
            dut->weight_free(dut, &w8), dut->weight_free(dut, &w16), dut->weight_free(dut, &bias);
            w8_free(&h);
            free(x), free(bf), free(y0), free(a), free(b16);
        }
    check_status_clean("matmul 8-bit exact");
}

/* The launches an 8-bit matmul costs (op by op, counted): x cast (split:
 * into halves), the weight widened, one GEMM for the whole stack, the
 * scaling; after rmsnorm in 16-bit activations the cast is rmsnorm's bf16
 * copy (one launch fewer, the same bytes). With graphs, the step is one
 * graph of the same bytes. */
static void test_matmul_8bit_launches_hand_off_and_graph(void) {
    const int G = 3, m = 5, n = 40, k = 96;
    w8_t h = w8_random(DTYPE_I8, 3, G, n, k, 0);
    float *ha = host_uniform((size_t)m * k, -2, 2);
    float *got = malloc((size_t)G * m * n * 4), *want = malloc((size_t)G * m * n * 4);
    tensor_t w;
    w8_load(dut, &w, &h);
    float *a = dut->alloc(dut, (size_t)m * k * 4), *z = dut->alloc(dut, (size_t)G * m * n * 4);
    dut->upload(dut, a, ha, (size_t)m * k * 4);
    const backend_graphs_t graphs = dut->graphs;
    dut->graphs = GRAPHS_OFF;
    backend_stats_t t, d;
    backend_stats(dut, &t);
    dut->matmul(dut, z, a, &w, NULL, m);
    d = stats_since(dut, &t);
    CHECK_MSG(d.launches == 4 && d.kernels == 4, "split: %llu launches, %llu kernels",
              (unsigned long long)d.launches, (unsigned long long)d.kernels);
    dut->download(dut, want, z, (size_t)G * m * n * 4);
    dut->graphs = GRAPHS_ON;
    backend_stats(dut, &t);
    dut->matmul(dut, z, a, &w, NULL, m);
    dut->download(dut, got, z, (size_t)G * m * n * 4);
    d = stats_since(dut, &t);
    CHECK_MSG(d.graph_launches == 1 && d.launches == 4,
              "as a graph: %llu graph launches, %llu launches recorded",
              (unsigned long long)d.graph_launches, (unsigned long long)d.launches);
    CHECK_MSG(memcmp(got, want, (size_t)G * m * n * 4) == 0, "the graph's bytes differ");
    dut->graphs = graphs;
    check_8bit_hand_off(DTYPE_F8_E4M3, m, n, k, 1 + 3, 1 + 4);
    dut->free(dut, a), dut->free(dut, z);
    dut->weight_free(dut, &w);
    w8_free(&h);
    free(ha), free(got), free(want);
    check_status_clean("matmul 8-bit launches");
}

/* weight_load_8bit refuses a float type, a scale that is not finite and a
 * shape that is not a Linear weight's, with a message, leaving the tensor
 * empty; weight_free gives the scales back with the elements (a leak of
 * either would exhaust the reservation within the loop). */
static void test_weight_load_8bit_refuses_and_frees(void) {
    ar_error_t err = {{0}};
    tensor_t t;
    const unsigned char q[12] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    float scale[4] = {1, 2, 3, 4};
    const int64_t shape[3] = {2, 2, 3};
    CHECK(dut->weight_load_8bit(dut, &t, q, DTYPE_BF16, scale, 2, shape + 1, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "BF16");
    CHECK(t.data == NULL && t.scale == NULL);
    CHECK(dut->weight_load_8bit(dut, &t, q, DTYPE_F32, scale, 3, shape, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "F32");
    scale[3] = NAN;
    CHECK(dut->weight_load_8bit(dut, &t, q, DTYPE_I8, scale, 3, shape, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "scale of row 3");
    scale[3] = 4;
    scale[1] = -INFINITY;
    CHECK(dut->weight_load_8bit(dut, &t, q, DTYPE_F8_E4M3, scale, 2, shape + 1, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "scale of row 1");
    CHECK(t.data == NULL && t.scale == NULL);
    scale[1] = 2;
    const int64_t four[4] = {1, 2, 2, 3};
    CHECK(dut->weight_load_8bit(dut, &t, q, DTYPE_I8, scale, 4, four, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "4 dimensions");
    /* 8M rows of four elements: 32 MiB of elements and 32 MiB of scales,
     * ten times over the 160 MiB the reservation has left */
    const int64_t rows = (int64_t)8 << 20, tall[2] = {rows, 4};
    unsigned char *qs = calloc((size_t)rows * 4, 1);
    float *ss = calloc((size_t)rows, sizeof *ss);
    for (int i = 0; i < 10; i++) {
        CHECK_MSG(dut->weight_load_8bit(dut, &t, qs, DTYPE_I8, ss, 2, tall, &err) == AR_OK,
                  "load %d: %s", i, err.msg);
        CHECK(t.scale != NULL && t.dtype == DTYPE_I8 && t.ndim == 2 && t.shape[0] == rows);
        dut->weight_free(dut, &t);
        CHECK(t.data == NULL && t.scale == NULL);
    }
    free(qs);
    free(ss);
    check_status_clean("weight_load_8bit");
}

/* Stride-1 convolutions; the last case needs two im2col slices of the
 * scratch (4608 values per output pixel, 3640 pixels per slice). */
static void check_conv2d(int ci, int co, int h, int w, int k, int pad, dtype_t wt, int with_bias) {
    const int ho = h + 2 * pad - k + 1, wo = w + 2 * pad - k + 1, kk = ci * k * k;
    const size_t n_in = (size_t)ci * h * w, n_out = (size_t)co * ho * wo, nw = (size_t)co * kk;
    float *in = host_uniform(n_in, -1, 1), *wf = host_uniform(nw, -1, 1);
    float *bf = host_uniform((size_t)co, -1, 1);
    float *wr = malloc((nw + 1) * 4), *br = malloc(((size_t)co + 1) * 4);
    void *ws = host_as(wf, nw, wt, wr), *bs = host_as(bf, (size_t)co, DTYPE_F16, br);
    wpair_t tw = wpair_load(ws, wt, 4, co, ci, k, k),
            tb = wpair_load(bs, DTYPE_F16, 1, co, 1, 1, 1);
    pair_t pin = pair_new(in, n_in), pout = pair_new(NULL, n_out);
    cpu->conv2d(cpu, pout.ref, pin.ref, &tw.ref, with_bias ? &tb.ref : NULL, ci, h, w, pad);
    dut->conv2d(dut, pout.dut, pin.dut, &tw.dut, with_bias ? &tb.dut : NULL, ci, h, w, pad);
    double *mag = calloc(n_out + 1, sizeof *mag);
    for (int o = 0; o < co; o++)
        for (int y = 0; y < ho; y++)
            for (int x = 0; x < wo; x++) {
                double s = 0;
                for (int i = 0; i < ci; i++)
                    for (int ky = 0; ky < k; ky++)
                        for (int kx = 0; kx < k; kx++) {
                            const int iy = y + ky - pad, ix = x + kx - pad;
                            if (iy >= 0 && iy < h && ix >= 0 && ix < w)
                                s += fabs((double)wr[((size_t)(o * ci + i) * k + ky) * k + kx] *
                                          in[((size_t)i * h + iy) * w + ix]);
                        }
                mag[((size_t)o * ho + y) * wo + x] = s;
            }
    char what[128];
    snprintf(what, sizeof what, "conv2d %s %dx%dx%d -> %d k=%d pad=%d bias=%d", type_name(wt), ci,
             h, w, co, k, pad, with_bias);
    compare(what, pout, 1e-6, 1e-6, mag, gemm_mag_tol(wt, kk));
    check_unchanged(what, pin, in);
    pair_del(pin);
    pair_del(pout);
    wpair_free(&tw);
    wpair_free(&tb);
    free(in), free(wf), free(bf), free(wr), free(br), free(ws), free(bs), free(mag);
}

static void test_conv2d_types_pads_and_slices(void) {
    /* c_in, c_out, h, w, kernel, pad */
    const int cases[][6] = {{5, 3, 7, 11, 1, 0}, {4, 6, 9, 13, 3, 1},  {3, 2, 8, 5, 3, 0},
                            {2, 3, 6, 4, 1, 1},  {3, 4, 1, 1, 3, 1},   {1, 1, 1, 1, 1, 0},
                            {3, 2, 6, 7, 5, 2},  {33, 17, 9, 10, 1, 0}};
    for (int t = 0; t < 3; t++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++)
            check_conv2d(cases[c][0], cases[c][1], cases[c][2], cases[c][3], cases[c][4],
                         cases[c][5], all_types[t], (int)(c + t) % 2);
    check_status_clean("conv2d");
}

static void test_conv2d_sliced_over_scratch(void) {
    check_conv2d(512, 3, 64, 64, 3, 1, DTYPE_F16, 1);
    check_status_clean("conv2d sliced");
}

/* ---- transformer ops ------------------------------------------------------------ */

/* Rows of 1 to 4096 wide (one block per row, a partial last warp), weights
 * in every type, in place and out of place; every third row is scaled by
 * 1e-3, where mean(x^2) is as small as eps: 1e-6 abs + 1e-5 rel. */
static void test_rmsnorm(void) {
    const int cases[][2] = {{1, 1}, {3, 7}, {2, 4096}, {5, 1000}, {0, 8}, {17, 33}};
    for (int t = 0; t < 3; t++)
        for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
            const int rows = cases[c][0], dim = cases[c][1];
            const size_t n = (size_t)rows * dim;
            float *x = host_uniform(n, -2, 2), *wf = host_uniform((size_t)dim, 0.5f, 1.5f);
            for (size_t i = 0; i < n; i++)
                if (i / dim % 3 == 2)
                    x[i] *= 1e-3f;
            float *wr = malloc(((size_t)dim + 1) * 4);
            void *ws = host_as(wf, (size_t)dim, all_types[t], wr);
            wpair_t w = wpair_load(ws, all_types[t], 1, dim, 1, 1, 1);
            pair_t px = pair_new(x, n), py = pair_new(NULL, n);
            const float eps = c % 2 ? 1e-5f : 1e-6f;
            cpu->rmsnorm(cpu, py.ref, px.ref, &w.ref, rows, dim, eps);
            dut->rmsnorm(dut, py.dut, px.dut, &w.dut, rows, dim, eps);
            char what[80];
            snprintf(what, sizeof what, "rmsnorm %s %dx%d", type_name(all_types[t]), rows, dim);
            compare(what, py, 1e-6, 1e-5, NULL, 0);
            check_unchanged(what, px, x);
            cpu->rmsnorm(cpu, px.ref, px.ref, &w.ref, rows, dim, eps);
            dut->rmsnorm(dut, px.dut, px.dut, &w.dut, rows, dim, eps);
            compare(what, px, 1e-6, 1e-5, NULL, 0);
            pair_del(px);
            pair_del(py);
            wpair_free(&w);
            free(x), free(wf), free(wr), free(ws);
        }
    check_status_clean("rmsnorm");
}

/* Positions up to 100000; head dims 2 to 128; the last case has more rows
 * than the staging buffer holds (65540 > 65536), so it goes in two copies.
 * Both backends form the angles the same way: 2e-6 abs (a GPU contracts
 * the rotation into FMAs, an ulp or two). */
static void test_rope(void) {
    const int base_pos[] = {0, 1, 2, 17, 1000, 4095, 16383, 100000};
    const int cases[][3] = {{2, 1, 8},   {6, 3, 8},  {64, 3, 8},
                            {128, 1, 8}, {64, 2, 0}, {2, 1, 65540}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int hd = cases[c][0], heads = cases[c][1], rows = cases[c][2];
        int *pos = malloc(((size_t)rows + 1) * sizeof *pos);
        for (int r = 0; r < rows; r++)
            pos[r] = r < 8 ? base_pos[r] : (int)(rng_next() % 200000);
        const size_t n = (size_t)rows * heads * hd;
        float *x = host_uniform(n, -1, 1);
        pair_t px = pair_new(x, n);
        const float theta = c % 2 ? 500000.0f : 10000.0f;
        /* twice by the same positions (uploaded once: the second call
         * finds them kept), then by changed ones in the same array */
        for (int round = 0; round < 3; round++) {
            if (round == 2)
                for (int r = 0; r < rows; r++)
                    pos[r] = (pos[r] * 7 + 3) % 200000;
            cpu->rope(cpu, px.ref, pos, rows, heads, hd, theta);
            dut->rope(dut, px.dut, pos, rows, heads, hd, theta);
        }
        char what[80];
        snprintf(what, sizeof what, "rope d=%d heads=%d rows=%d", hd, heads, rows);
        compare(what, px, 1e-5, 0, NULL, 0);
        pair_del(px);
        free(x);
        free(pos);
    }
    check_status_clean("rope");
}

/* Condition rows (grid row -1), a 24 x 24 grid and a large position; the
 * last case has more rows than the staging buffer's 32768 pairs. */
static void test_rope_2d(void) {
    const int cases[][3] = {{4, 1, 9}, {12, 2, 9}, {64, 3, 9}, {8, 1, 32800}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int hd = cases[c][0], heads = cases[c][1], rows = cases[c][2];
        int *pos = malloc(((size_t)rows + 1) * 2 * sizeof *pos);
        for (int r = 0; r < rows; r++) {
            pos[2 * r] = r < 2 ? -1 : (r - 2) / 24;
            pos[2 * r + 1] = r < 2 ? -1 : (r - 2) % 24;
        }
        pos[2 * (rows - 1)] = 5000;
        const size_t n = (size_t)rows * heads * hd;
        float *x = host_uniform(n, -1, 1);
        pair_t px = pair_new(x, n);
        cpu->rope_2d(cpu, px.ref, pos, rows, heads, hd, 10000.0f);
        dut->rope_2d(dut, px.dut, pos, rows, heads, hd, 10000.0f);
        char what[80];
        snprintf(what, sizeof what, "rope_2d d=%d heads=%d rows=%d", hd, heads, rows);
        compare(what, px, 2e-6, 0, NULL, 0);
        pair_del(px);
        free(x);
        free(pos);
    }
    check_status_clean("rope_2d");
}

/* LayerNorm rows of 1 to 4096 (a partial last warp; a row of 1 is all
 * zeros), every third row offset by 100 (statistics in double on both),
 * out of place and in place: 1e-6 abs + 1e-5 rel. */
static void test_layernorm(void) {
    const int cases[][2] = {{1, 1}, {3, 7}, {2, 4096}, {5, 1000}, {0, 8}, {17, 33}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], dim = cases[c][1];
        const size_t n = (size_t)rows * dim;
        float *x = host_uniform(n, -2, 2);
        for (size_t i = 0; i < n; i++)
            if (i / dim % 3 == 1)
                x[i] += 100;
        pair_t px = pair_new(x, n), py = pair_new(NULL, n);
        const float eps = c % 2 ? 1e-5f : 1e-6f;
        cpu->layernorm(cpu, py.ref, px.ref, rows, dim, eps);
        dut->layernorm(dut, py.dut, px.dut, rows, dim, eps);
        char what[64];
        snprintf(what, sizeof what, "layernorm %dx%d", rows, dim);
        compare(what, py, 1e-6, 1e-5, NULL, 0);
        check_unchanged(what, px, x);
        cpu->layernorm(cpu, px.ref, px.ref, rows, dim, eps);
        dut->layernorm(dut, px.dut, px.dut, rows, dim, eps);
        compare(what, px, 1e-6, 1e-5, NULL, 0);
        pair_del(px);
        pair_del(py);
        free(x);
    }
    check_status_clean("layernorm");
}

/* AdaLN's modulation and gated residual on rows of 1 to 4000 columns, the
 * last case more elements than the capped grid covers in one pass; in place
 * too. One or two fp32 operations per element (a GPU may fuse them into an
 * FMA): 1e-6 abs + 1e-6 rel. */
static void test_modulate_and_gate_add(void) {
    const int cases[][2] = {{0, 5}, {1, 1}, {7, 33}, {300, 4000}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], dim = cases[c][1];
        const size_t n = (size_t)rows * dim;
        float *x = host_uniform(n, -3, 3), *a = host_uniform(n, -3, 3);
        float *sc = host_uniform((size_t)dim, -1, 1), *sh = host_uniform((size_t)dim, -1, 1);
        pair_t px = pair_new(x, n), pa = pair_new(a, n), py = pair_new(NULL, n);
        pair_t psc = pair_new(sc, (size_t)dim), psh = pair_new(sh, (size_t)dim);
        char what[64];
        snprintf(what, sizeof what, "modulate %dx%d", rows, dim);
        cpu->modulate(cpu, py.ref, px.ref, psc.ref, psh.ref, rows, dim);
        dut->modulate(dut, py.dut, px.dut, psc.dut, psh.dut, rows, dim);
        compare(what, py, 1e-6, 1e-6, NULL, 0);
        check_unchanged(what, px, x);
        check_unchanged(what, psc, sc);
        check_unchanged(what, psh, sh);
        cpu->modulate(cpu, px.ref, px.ref, psc.ref, psh.ref, rows, dim);
        dut->modulate(dut, px.dut, px.dut, psc.dut, psh.dut, rows, dim);
        compare(what, px, 1e-6, 1e-6, NULL, 0);
        snprintf(what, sizeof what, "gate_add %dx%d", rows, dim);
        cpu->upload(cpu, py.ref, x, n * 4);
        dut->upload(dut, py.dut, x, n * 4);
        cpu->gate_add(cpu, py.ref, pa.ref, psc.ref, rows, dim);
        dut->gate_add(dut, py.dut, pa.dut, psc.dut, rows, dim);
        compare(what, py, 1e-6, 1e-6, NULL, 0);
        check_unchanged(what, pa, a);
        pair_del(px), pair_del(pa), pair_del(py), pair_del(psc), pair_del(psh);
        free(x), free(a), free(sc), free(sh);
    }
    check_status_clean("modulate/gate_add");
}

/* modulate_seqs and gate_add_seqs against the CPU's modulate and gate_add
 * sequence by sequence: each sequence's rows (one of them empty) with its
 * own table, the tables at offsets into one buffer as the engine keeps
 * them; n_seq sequences of rows_each rows; the second call of a step reuses
 * the uploaded starts and tables (no copy); 6000 sequences do not fit the
 * kept region and go sequence by sequence. */
static void check_adaln_seqs(int n_seq, int rows_each, int dim) {
    int *q_start = malloc(((size_t)n_seq + 1) * sizeof *q_start);
    q_start[0] = 0;
    for (int s = 0; s < n_seq; s++)
        q_start[s + 1] = q_start[s] + (s == 1 ? 0 : rows_each); /* sequence 1 is empty */
    const int rows = q_start[n_seq];
    const size_t n = (size_t)rows * dim, tab = 3 * (size_t)dim; /* scale, shift, gate */
    float *x = host_uniform(n, -3, 3), *a = host_uniform(n, -3, 3);
    float *t = host_uniform(tab * n_seq, -1, 1);
    pair_t px = pair_new(x, n), pa = pair_new(a, n), py = pair_new(NULL, n);
    pair_t pt = pair_new(t, tab * n_seq);
    const float **tr = malloc((size_t)n_seq * sizeof *tr),
                **td = malloc((size_t)n_seq * sizeof *td);
    for (int s = 0; s < n_seq; s++)
        tr[s] = pt.ref + (size_t)s * tab, td[s] = pt.dut + (size_t)((s * 7) % n_seq) * tab;
    for (int s = 0; s < n_seq; s++) /* the dut's tables in another order, the same values */
        dut->upload(dut, (float *)td[s], t + (size_t)s * tab, tab * sizeof(float));
    for (int s = 0; s < n_seq; s++) {
        const size_t r0 = (size_t)q_start[s] * dim;
        const int nr = q_start[s + 1] - q_start[s];
        cpu->modulate(cpu, py.ref + r0, px.ref + r0, tr[s], tr[s] + dim, nr, dim);
        cpu->gate_add(cpu, py.ref + r0, pa.ref + r0, tr[s] + 2 * dim, nr, dim);
    }
    backend_stats_t t0, d;
    backend_stats(dut, &t0);
    dut->modulate_seqs(dut, py.dut, px.dut, q_start, td, n_seq, 0, (size_t)dim, dim);
    backend_stats_t t1;
    backend_stats(dut, &t1);
    dut->gate_add_seqs(dut, py.dut, pa.dut, q_start, td, n_seq, 2 * (size_t)dim, dim);
    d = stats_since(dut, &t1);
    const int fits = n_seq < 5000;
    CHECK_MSG(!fits || (d.launches == 1 && d.h2d_copies == 0),
              "gate_add_seqs after modulate_seqs: %llu launches, %llu copies",
              (unsigned long long)d.launches, (unsigned long long)d.h2d_copies);
    d = stats_since(dut, &t0);
    CHECK_MSG(!fits || d.launches == 2, "%llu launches", (unsigned long long)d.launches);
    char what[80];
    snprintf(what, sizeof what, "modulate_seqs + gate_add_seqs %d x %d rows x %d", n_seq, rows_each,
             dim);
    compare(what, py, 1e-6, 1e-6, NULL, 0);
    check_unchanged(what, px, x);
    pair_del(px), pair_del(pa), pair_del(py), pair_del(pt);
    free(q_start), free(x), free(a), free(t), free(tr), free(td);
}

static void test_modulate_and_gate_add_over_sequences(void) {
    check_adaln_seqs(3, 5, 33);
    check_adaln_seqs(17, 4, 64);
    check_adaln_seqs(6000, 1, 2);
    check_status_clean("modulate_seqs/gate_add_seqs");
}

/* Per-head L2 normalisation: head dims 1 to 128 (a warp per head, partial
 * and several passes), more heads than one block holds, a head of 1e-14
 * values (the 1e-12 clamp), with and without the per-head multiplier:
 * 1e-7 abs + 1e-6 rel. */
static void test_l2norm_heads(void) {
    const int cases[][3] = {{0, 2, 8},    {1, 1, 1},   {5, 3, 16},
                            {33, 16, 64}, {7, 9, 128}, {4, 5, 20}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], heads = cases[c][1], hd = cases[c][2];
        const size_t n = (size_t)rows * heads * hd;
        float *x = host_uniform(n, -2, 2), *m = host_uniform((size_t)heads, 0.5f, 4);
        for (int d = 0; n > 0 && d < hd; d++)
            x[d] *= 1e-14f;
        pair_t pm = pair_new(m, (size_t)heads);
        for (int with_mul = 0; with_mul < 2; with_mul++) {
            pair_t px = pair_new(x, n);
            cpu->l2norm_heads(cpu, px.ref, with_mul ? pm.ref : NULL, rows, heads, hd);
            dut->l2norm_heads(dut, px.dut, with_mul ? pm.dut : NULL, rows, heads, hd);
            char what[80];
            snprintf(what, sizeof what, "l2norm_heads rows=%d heads=%d hd=%d mul=%d", rows, heads,
                     hd, with_mul);
            compare(what, px, 1e-7, 1e-6, NULL, 0);
            check_unchanged(what, pm, m);
            pair_del(px);
        }
        pair_del(pm);
        free(x), free(m);
    }
    check_status_clean("l2norm_heads");
}

/* ---- element-wise -------------------------------------------------------------- */

/* Values where the formulas break down: +-Inf, NaN, exp overflow, zero. */
static const float specials[] = {INFINITY, -INFINITY, NAN,   100.0f, -100.0f, 88.8f,
                                 -88.8f,   0.0f,      -0.0f, 1e-30f, 30.0f};

static float *ew_input(size_t n) {
    float *x = host_uniform(n, -8, 8);
    for (size_t i = 0; i < n && i < sizeof specials / sizeof *specials; i++)
        x[i] = specials[i];
    return x;
}

/* Sizes 0, 1, a partial block, and more elements than the capped grid
 * covers in one pass (4096 * 256 = 1048576). silu/gelu/gelu_tanh 1e-6 abs +
 * 1e-5 rel (GPU expf/erff/tanhf are within 2 ulp); add, mul and scale are
 * exact fp32, the specials' Inf and NaN included. */
static void test_elementwise(void) {
    const size_t sizes[] = {0, 1, 31, 257, 100003, 1048576 + 1000};
    for (size_t c = 0; c < sizeof sizes / sizeof *sizes; c++) {
        const size_t n = sizes[c];
        float *g = ew_input(n), *u = host_uniform(n, -3, 3);
        pair_t pg = pair_new(g, n), pu = pair_new(u, n), po = pair_new(NULL, n);
        char what[64];
        cpu->silu_mul(cpu, po.ref, pg.ref, pu.ref, n);
        dut->silu_mul(dut, po.dut, pg.dut, pu.dut, n);
        snprintf(what, sizeof what, "silu_mul n=%zu", n);
        compare(what, po, 1e-6, 1e-5, NULL, 0);
        check_unchanged(what, pg, g);
        check_unchanged(what, pu, u);

        cpu->silu(cpu, pg.ref, n);
        dut->silu(dut, pg.dut, n);
        snprintf(what, sizeof what, "silu n=%zu", n);
        compare(what, pg, 1e-6, 1e-5, NULL, 0);

        cpu->upload(cpu, pg.ref, g, n * 4);
        dut->upload(dut, pg.dut, g, n * 4);
        cpu->gelu(cpu, pg.ref, n);
        dut->gelu(dut, pg.dut, n);
        snprintf(what, sizeof what, "gelu n=%zu", n);
        compare(what, pg, 1e-6, 1e-5, NULL, 0);

        cpu->upload(cpu, pg.ref, g, n * 4);
        dut->upload(dut, pg.dut, g, n * 4);
        cpu->gelu_tanh(cpu, pg.ref, n);
        dut->gelu_tanh(dut, pg.dut, n);
        snprintf(what, sizeof what, "gelu_tanh n=%zu", n);
        compare(what, pg, 1e-6, 1e-5, NULL, 0);

        cpu->upload(cpu, pg.ref, g, n * 4);
        dut->upload(dut, pg.dut, g, n * 4);
        cpu->add(cpu, pg.ref, pu.ref, n);
        dut->add(dut, pg.dut, pu.dut, n);
        snprintf(what, sizeof what, "add n=%zu", n);
        compare(what, pg, 0, 0, NULL, 0);

        cpu->mul(cpu, pg.ref, pu.ref, n);
        dut->mul(dut, pg.dut, pu.dut, n);
        snprintf(what, sizeof what, "mul n=%zu", n);
        compare(what, pg, 0, 0, NULL, 0);
        check_unchanged(what, pu, u);

        cpu->scale(cpu, pg.ref, n, -0.37f);
        dut->scale(dut, pg.dut, n, -0.37f);
        snprintf(what, sizeof what, "scale n=%zu", n);
        compare(what, pg, 0, 0, NULL, 0);
        pair_del(pg);
        pair_del(pu);
        pair_del(po);
        free(g);
        free(u);
    }
    check_status_clean("elementwise");
}

/* Rows offset by 1e4 (exp overflows without the max), rows with -inf
 * entries, a row of only -inf (NaN on both), 1 to 16384 columns:
 * 1e-7 abs + 1e-5 rel. */
static void test_softmax(void) {
    const int cases[][2] = {{1, 1}, {3, 7}, {2, 16384}, {5, 129}, {0, 3}, {4, 33}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int rows = cases[c][0], cols = cases[c][1];
        const size_t n = (size_t)rows * cols;
        float *x = host_uniform(n, -10, 10);
        for (int r = 0; r < rows; r++) {
            for (int i = 0; i < cols; i++) {
                if (r % 4 == 1)
                    x[(size_t)r * cols + i] += 1e4f;
                if ((r % 4 == 2 && i % 3 == 0 && i + 1 < cols) || r % 4 == 3)
                    x[(size_t)r * cols + i] = -INFINITY;
            }
        }
        pair_t px = pair_new(x, n);
        cpu->softmax(cpu, px.ref, rows, cols);
        dut->softmax(dut, px.dut, rows, cols);
        char what[64];
        snprintf(what, sizeof what, "softmax %dx%d", rows, cols);
        compare(what, px, 1e-7, 1e-5, NULL, 0);
        pair_del(px);
        free(x);
    }
    check_status_clean("softmax");
}

/* Tables in every type, dims 1, 13 and 300, a zero row (normalised to 0,
 * not NaN), repeated and edge ids, and more ids than the staging buffer
 * holds: copies exact, L2 1e-7 abs + 1e-6 rel. */
static void test_embedding(void) {
    const int dims[] = {13, 1, 300};
    for (int t = 0; t < 3; t++)
        for (int d = 0; d < 3; d++) {
            const int vocab = 37, dim = dims[d];
            const int n = d == 1 && t == 0 ? 70000 : 6;
            float *tf = host_uniform((size_t)vocab * dim, -2, 2);
            for (int j = 0; j < dim; j++)
                tf[3 * dim + j] = 0;
            float *tr = malloc((size_t)vocab * dim * 4);
            void *ts = host_as(tf, (size_t)vocab * dim, all_types[t], tr);
            wpair_t w = wpair_load(ts, all_types[t], 2, vocab, dim, 1, 1);
            int *ids = malloc((size_t)n * sizeof *ids);
            const int base_ids[6] = {0, 36, 5, 5, 3, 17};
            for (int i = 0; i < n; i++)
                ids[i] = i < 6 ? base_ids[i] : (int)(rng_next() % vocab);
            for (int l2 = 0; l2 < 2; l2++) {
                pair_t po = pair_new(NULL, (size_t)n * dim);
                cpu->embedding(cpu, po.ref, &w.ref, ids, n, l2);
                dut->embedding(dut, po.dut, &w.dut, ids, n, l2);
                char what[80];
                snprintf(what, sizeof what, "embedding %s dim=%d n=%d l2=%d",
                         type_name(all_types[t]), dim, n, l2);
                compare(what, po, l2 ? 1e-7 : 0, l2 ? 1e-6 : 0, NULL, 0);
                pair_del(po);
            }
            wpair_free(&w);
            free(tf), free(tr), free(ts), free(ids);
        }
    check_status_clean("embedding");
}

/* ---- image ops ------------------------------------------------------------------- */

/* 32 groups of 64 channels, one channel per group, hw = 1, inputs offset by
 * 100 (cancellation), and groups of 160000 values that the CUDA kernel
 * splits over 40 blocks; gamma/beta in fp32 and fp16; in place with SiLU
 * too: 1e-5 abs + 1e-5 rel. */
static void test_groupnorm(void) {
    /* c, hw, groups, offset */
    const int cases[][4] = {{64, 7 * 9, 32, 0}, {6, 1, 3, 0},      {8, 13, 1, 0},
                            {64, 5, 32, 100},   {32, 1031, 32, 0}, {64, 5000, 2, 3}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], hw = cases[c][1], groups = cases[c][2];
        const dtype_t at = c % 2 ? DTYPE_F16 : DTYPE_F32;
        const size_t n = (size_t)ch * hw;
        float *x = host_uniform(n, -1, 1), *gf = host_uniform((size_t)ch, 0.5f, 1.5f);
        float *bf = host_uniform((size_t)ch, -1, 1);
        for (size_t i = 0; i < n; i++)
            x[i] += (float)cases[c][3] + (float)(i / hw % 3);
        float *gr = malloc((size_t)ch * 4), *br = malloc((size_t)ch * 4);
        void *gs = host_as(gf, (size_t)ch, at, gr), *bs = host_as(bf, (size_t)ch, at, br);
        wpair_t g = wpair_load(gs, at, 1, ch, 1, 1, 1), b = wpair_load(bs, at, 1, ch, 1, 1, 1);
        pair_t px = pair_new(x, n), po = pair_new(NULL, n);
        const float eps = c % 2 ? 1e-5f : 1e-6f;
        cpu->groupnorm(cpu, po.ref, px.ref, &g.ref, &b.ref, ch, hw, groups, eps, 0);
        dut->groupnorm(dut, po.dut, px.dut, &g.dut, &b.dut, ch, hw, groups, eps, 0);
        char what[80];
        snprintf(what, sizeof what, "groupnorm c=%d hw=%d groups=%d", ch, hw, groups);
        compare(what, po, 1e-5, 1e-5, NULL, 0);
        check_unchanged(what, px, x);
        /* in place, with the SiLU the decoder fuses into it */
        cpu->groupnorm(cpu, px.ref, px.ref, &g.ref, &b.ref, ch, hw, groups, eps, 1);
        dut->groupnorm(dut, px.dut, px.dut, &g.dut, &b.dut, ch, hw, groups, eps, 1);
        snprintf(what, sizeof what, "groupnorm+silu c=%d hw=%d groups=%d", ch, hw, groups);
        compare(what, px, 1e-5, 1e-5, NULL, 0);
        pair_del(px);
        pair_del(po);
        wpair_free(&g);
        wpair_free(&b);
        free(x), free(gf), free(bf), free(gr), free(br), free(gs), free(bs);
    }
    check_status_clean("groupnorm");
}

static void test_upsample_and_transpose_exact(void) {
    const int up[][3] = {{0, 2, 2}, {3, 1, 1}, {2, 5, 7}, {1, 33, 40}};
    for (size_t c = 0; c < sizeof up / sizeof *up; c++) {
        const int ch = up[c][0], h = up[c][1], w = up[c][2];
        const size_t n = (size_t)ch * h * w;
        float *x = host_uniform(n, -1, 1);
        pair_t px = pair_new(x, n), po = pair_new(NULL, 4 * n);
        cpu->upsample_nearest2x(cpu, po.ref, px.ref, ch, h, w);
        dut->upsample_nearest2x(dut, po.dut, px.dut, ch, h, w);
        char what[64];
        snprintf(what, sizeof what, "upsample %dx%dx%d", ch, h, w);
        compare(what, po, 0, 0, NULL, 0);
        pair_del(px);
        pair_del(po);
        free(x);
    }
    const int tr[][2] = {{1, 1}, {33, 65},  {100, 3},  {0, 5},
                         {3, 0}, {1000, 2}, {2, 1000}, {64, 64}};
    for (size_t c = 0; c < sizeof tr / sizeof *tr; c++) {
        const int rows = tr[c][0], cols = tr[c][1];
        const size_t n = (size_t)rows * cols;
        float *x = host_uniform(n, -1, 1);
        pair_t px = pair_new(x, n), po = pair_new(NULL, n);
        cpu->transpose(cpu, po.ref, px.ref, rows, cols);
        dut->transpose(dut, po.dut, px.dut, rows, cols);
        char what[64];
        snprintf(what, sizeof what, "transpose %dx%d", rows, cols);
        compare(what, po, 0, 0, NULL, 0);
        check_unchanged(what, px, x);
        pair_del(px);
        pair_del(po);
        free(x);
    }
    check_status_clean("upsample/transpose");
}

/* Bicubic and area resampling, down and up, odd ratios (VAR's 16 -> 13),
 * 1x1 sources, the identity, and more outputs than the capped grid covers
 * in one pass. Both backends use the same fp32 formulas in the same order
 * (a GPU may fuse a multiply-add): bicubic 1e-6 abs + 1e-6 rel, area
 * 1e-7 abs + 1e-6 rel. */
static void test_resize_bicubic_and_area(void) {
    const int cases[][5] = {{3, 7, 5, 16, 9},     {2, 16, 9, 7, 5},      {1, 1, 1, 3, 2},
                            {32, 16, 16, 13, 13}, {0, 2, 2, 3, 3},       {3, 5, 7, 5, 7},
                            {2, 32, 32, 1, 1},    {17, 16, 16, 256, 256}};
    for (size_t c = 0; c < sizeof cases / sizeof *cases; c++) {
        const int ch = cases[c][0], h = cases[c][1], w = cases[c][2], H = cases[c][3],
                  W = cases[c][4];
        const size_t n_in = (size_t)ch * h * w, n_out = (size_t)ch * H * W;
        float *x = host_uniform(n_in, -1, 1);
        pair_t px = pair_new(x, n_in);
        for (int area = 0; area < 2; area++) {
            pair_t po = pair_new(NULL, n_out);
            if (area) {
                cpu->resize_area(cpu, po.ref, px.ref, ch, h, w, H, W);
                dut->resize_area(dut, po.dut, px.dut, ch, h, w, H, W);
            } else {
                cpu->resize_bicubic(cpu, po.ref, px.ref, ch, h, w, H, W);
                dut->resize_bicubic(dut, po.dut, px.dut, ch, h, w, H, W);
            }
            char what[80];
            snprintf(what, sizeof what, "resize_%s %dx%dx%d -> %dx%d", area ? "area" : "bicubic",
                     ch, h, w, H, W);
            compare(what, po, area ? 1e-7 : 1e-6, 1e-6, NULL, 0);
            check_unchanged(what, px, x);
            pair_del(po);
        }
        pair_del(px);
        free(x);
    }
    check_status_clean("resize");
}

/* ---- paged KV cache --------------------------------------------------------- */

/* A pool of n_blocks blocks on both backends, filled with random values (so
 * rows an op must not touch are checked too), and per-(sequence, head)
 * block tables drawn from a shuffled permutation of the pool's blocks
 * (scattered, unordered ids). */
typedef struct kv_case {
    kv_blocks_t ref_pool, dut_pool;
    pair_t blocks;
    int *perm, n_blocks;
} kv_case_t;

/* The cache type the KV tests run with (main runs them with each), and
 * the fp8 scales of K and V their views carry (others ignore them). */
static dtype_t kv_type = DTYPE_F32;
#define KV_K_SCALE 0.03125f
#define KV_V_SCALE 0.0078125f

static kv_view_t kv_view_at(const int *blocks, int len) {
    return (kv_view_t){blocks, len, KV_K_SCALE, KV_V_SCALE};
}

/* The pool's elements are kv_type values of random fp32 in [-1, 1]; the
 * pair holds them as raw bytes (compared as floats: bit patterns of such
 * values are never NaN, so a difference of 0 means the same bytes). */
static kv_case_t kv_case_new(int block_tokens, int head_dim, int n_blocks) {
    kv_case_t c;
    const size_t n = (size_t)n_blocks * 2 * block_tokens * head_dim;
    const size_t n_floats = (n * dtype_size(kv_type) + 3) / 4;
    float *init = host_uniform(n, -1, 1), *raw = calloc(n_floats, sizeof *raw);
    dtype_from_f32(raw, init, kv_type, n);
    c.blocks = pair_new(raw, n_floats);
    free(init), free(raw);
    c.ref_pool = (kv_blocks_t){c.blocks.ref, kv_type, block_tokens, head_dim};
    c.dut_pool = (kv_blocks_t){c.blocks.dut, kv_type, block_tokens, head_dim};
    c.n_blocks = n_blocks;
    c.perm = malloc((size_t)n_blocks * sizeof *c.perm);
    for (int i = 0; i < n_blocks; i++)
        c.perm[i] = i;
    for (int i = n_blocks - 1; i > 0; i--) {
        const int j = (int)(rng_next() % (uint64_t)(i + 1)), t = c.perm[i];
        c.perm[i] = c.perm[j];
        c.perm[j] = t;
    }
    return c;
}

static void kv_case_del(kv_case_t *c) {
    pair_del(c->blocks);
    free(c->perm);
}

/* Attention tolerances: both backends weight the same fp32 scores, the
 * CPU with a double sum over chunks of 256 keys, the CUDA kernels with
 * fp32 sums over splits of 64 keys merged at the end; outputs are
 * averages of values in [-1, 1], so the difference is a few ulps of 1. */
#define ATTN_ABS_TOL 2e-6
#define ATTN_REL_TOL 1e-5
/* Key mass: each probability as exp(s - m) / l on both sides (double on
 * the CPU, fp32 on the device), summed over at most 17 rows. */
#define MASS_ABS_TOL 1e-6
#define MASS_REL_TOL 2e-5

/* One step of a ragged batch: sequence s has n_new[s] new rows; head h of
 * it holds len = n_new[s] + extra tokens, extra random in [0, max_extra]
 * (each head its own, so heads differ). kv_append writes the rows on both
 * backends (the whole pool must then match exactly), attention runs on
 * both with key mass for every pair but every third (mass 0: none). */
static void check_kv_step(int bt, int hd, int n_heads, int n_seq, const int *n_new, int max_extra,
                          int with_mass) {
    int *q_start = malloc(((size_t)n_seq + 1) * sizeof *q_start);
    q_start[0] = 0;
    for (int s = 0; s < n_seq; s++)
        q_start[s + 1] = q_start[s] + n_new[s];
    const int rows = q_start[n_seq], n_pairs = n_seq * n_heads;
    kv_view_t *views = malloc((size_t)n_pairs * sizeof *views);
    int total_blocks = 0, max_len = 0;
    for (int i = 0; i < n_pairs; i++) {
        views[i] =
            kv_view_at(NULL, n_new[i / n_heads] + (int)(rng_next() % (uint64_t)(max_extra + 1)));
        total_blocks += (views[i].len + bt - 1) / bt;
        max_len = views[i].len > max_len ? views[i].len : max_len;
    }
    kv_case_t c = kv_case_new(bt, hd, total_blocks + 3);
    for (int i = 0, at = 0; i < n_pairs; i++) {
        views[i].blocks = c.perm + at;
        at += (views[i].len + bt - 1) / bt;
    }
    const size_t width = (size_t)n_heads * hd;
    float *k = host_uniform((size_t)rows * width, -1, 1),
          *v = host_uniform((size_t)rows * width, -1, 1);
    float *q = host_uniform((size_t)rows * width, -2, 2);
    pair_t pk = pair_new(k, (size_t)rows * width), pv = pair_new(v, (size_t)rows * width);
    pair_t pq = pair_new(q, (size_t)rows * width), po = pair_new(NULL, (size_t)rows * width);
    char what[160];
    snprintf(what, sizeof what, "kv %s bt=%d hd=%d heads=%d seqs=%d rows=%d max_len=%d mass=%d",
             dtype_name(kv_type), bt, hd, n_heads, n_seq, rows, max_len, with_mass);

    cpu->kv_append(cpu, &c.ref_pool, views, pk.ref, pv.ref, q_start, n_seq, n_heads);
    dut->kv_append(dut, &c.dut_pool, views, pk.dut, pv.dut, q_start, n_seq, n_heads);
    char part[200];
    snprintf(part, sizeof part, "%s: pool after kv_append", what);
    compare(part, c.blocks, 0, 0, NULL, 0);

    pair_t *mass = calloc((size_t)n_pairs, sizeof *mass);
    float **ref_mass = calloc((size_t)n_pairs, sizeof *ref_mass);
    float **dut_mass = calloc((size_t)n_pairs, sizeof *dut_mass);
    for (int i = 0; i < n_pairs; i++) {
        if (!with_mass || i % 3 == 2)
            continue;
        float *m0 = host_uniform((size_t)views[i].len, 0, 1); /* accumulated into */
        mass[i] = pair_new(m0, (size_t)views[i].len);
        ref_mass[i] = mass[i].ref;
        dut_mass[i] = mass[i].dut;
        free(m0);
    }
    const attn_batch_t rb = {n_seq, q_start, views, with_mass ? ref_mass : NULL};
    const attn_batch_t db = {n_seq, q_start, views, with_mass ? dut_mass : NULL};
    const float scale = 1.0f / sqrtf((float)hd);
    cpu->attention(cpu, po.ref, pq.ref, &c.ref_pool, &rb, n_heads, scale);
    dut->attention(dut, po.dut, pq.dut, &c.dut_pool, &db, n_heads, scale);
    snprintf(part, sizeof part, "%s: attention", what);
    compare(part, po, ATTN_ABS_TOL, ATTN_REL_TOL, NULL, 0);
    check_unchanged(part, pq, q);
    for (int i = 0; i < n_pairs; i++)
        if (mass[i].ref) {
            snprintf(part, sizeof part, "%s: mass of pair %d (len %d)", what, i, views[i].len);
            compare(part, mass[i], MASS_ABS_TOL, MASS_REL_TOL, NULL, 0);
            pair_del(mass[i]);
        }
    snprintf(part, sizeof part, "%s: pool after attention", what);
    compare(part, c.blocks, 0, 0, NULL, 0);
    pair_del(pk), pair_del(pv), pair_del(pq), pair_del(po);
    kv_case_del(&c);
    free(k), free(v), free(q), free(q_start), free(views), free(mass), free(ref_mass),
        free(dut_mass);
}

/* Block sizes 1, 3 and 16; lengths 0 (a sequence with no new rows and
 * heads left empty), 1 and across block and split (64 keys) boundaries;
 * decode (one row per sequence) and ragged prefill batches of 0, 1 and 5
 * new rows; head dims 8, 20 (not a warp multiple) and 64; mass off and
 * on, with some pairs not collecting. */
static void test_kv_append_and_attention(void) {
    const int decode[] = {1, 1, 1, 1}, ragged[] = {0, 1, 5}, prefill[] = {17, 2};
    check_kv_step(1, 8, 3, 3, ragged, 4, 1);
    check_kv_step(1, 8, 2, 4, decode, 0, 1); /* every cache of length 1 */
    check_kv_step(3, 20, 4, 4, decode, 140, 0);
    check_kv_step(3, 20, 4, 4, decode, 140, 1);
    check_kv_step(3, 20, 3, 3, ragged, 70, 1);
    check_kv_step(16, 64, 2, 3, ragged, 130, 1);
    check_kv_step(16, 64, 2, 2, prefill, 47, 1);
    check_kv_step(16, 64, 2, 2, prefill, 0, 0); /* the prompt's prefill: nothing cached before */
    /* More (sequence, head) pairs than one staging copy holds (7000 items
     * and tables > 256 KiB): the ops go in several launches. */
    enum { MANY = 3500 };
    int *ones = malloc(MANY * sizeof *ones);
    for (int i = 0; i < MANY; i++)
        ones[i] = 1;
    check_kv_step(2, 8, 2, MANY, ones, 3, 1);
    free(ones);
    check_status_clean("kv_append/attention");
}

/* One step of a next-scale model over a ragged batch: sequence s feeds
 * n_new[s] rows (a scale); head h of it has a cache of a random 0 ..
 * max_cached tokens (0: a first scale) in scattered blocks of a random
 * pool. attention_scale runs on both backends, with key mass (len + n_new
 * floats, accumulated into) for every pair but every third; the pool, q,
 * k_new and v_new must come back unchanged. */
static void check_kv_scale_step(int bt, int hd, int n_heads, int n_seq, const int *n_new,
                                int max_cached, int with_mass) {
    int *q_start = malloc(((size_t)n_seq + 1) * sizeof *q_start);
    q_start[0] = 0;
    for (int s = 0; s < n_seq; s++)
        q_start[s + 1] = q_start[s] + n_new[s];
    const int rows = q_start[n_seq], n_pairs = n_seq * n_heads;
    kv_view_t *views = malloc((size_t)n_pairs * sizeof *views);
    int total_blocks = 0, max_len = 0;
    for (int i = 0; i < n_pairs; i++) {
        views[i] = kv_view_at(NULL, (int)(rng_next() % (uint64_t)(max_cached + 1)));
        total_blocks += (views[i].len + bt - 1) / bt;
        max_len = views[i].len > max_len ? views[i].len : max_len;
    }
    kv_case_t c = kv_case_new(bt, hd, total_blocks + 3);
    float *pool_before = malloc(c.blocks.n * sizeof(float));
    cpu->download(cpu, pool_before, c.blocks.ref, c.blocks.n * sizeof(float));
    for (int i = 0, at = 0; i < n_pairs; i++) {
        views[i].blocks = c.perm + at;
        at += (views[i].len + bt - 1) / bt;
    }
    const size_t width = (size_t)n_heads * hd, n = (size_t)rows * width;
    float *k = host_uniform(n, -1, 1), *v = host_uniform(n, -1, 1), *q = host_uniform(n, -2, 2);
    pair_t pk = pair_new(k, n), pv = pair_new(v, n), pq = pair_new(q, n), po = pair_new(NULL, n);
    char what[160], part[200];
    snprintf(what, sizeof what,
             "scale %s bt=%d hd=%d heads=%d seqs=%d rows=%d max_cached=%d mass=%d",
             dtype_name(kv_type), bt, hd, n_heads, n_seq, rows, max_len, with_mass);
    pair_t *mass = calloc((size_t)n_pairs, sizeof *mass);
    float **ref_mass = calloc((size_t)n_pairs, sizeof *ref_mass);
    float **dut_mass = calloc((size_t)n_pairs, sizeof *dut_mass);
    for (int i = 0; i < n_pairs; i++) {
        if (!with_mass || i % 3 == 2)
            continue;
        const size_t keys = (size_t)views[i].len + (size_t)n_new[i / n_heads];
        float *m0 = host_uniform(keys, 0, 1);
        mass[i] = pair_new(m0, keys);
        ref_mass[i] = mass[i].ref;
        dut_mass[i] = mass[i].dut;
        free(m0);
    }
    const attn_batch_t rb = {n_seq, q_start, views, with_mass ? ref_mass : NULL};
    const attn_batch_t db = {n_seq, q_start, views, with_mass ? dut_mass : NULL};
    const float scale = 1.0f / sqrtf((float)hd);
    cpu->attention_scale(cpu, po.ref, pq.ref, pk.ref, pv.ref, &c.ref_pool, &rb, n_heads, scale);
    dut->attention_scale(dut, po.dut, pq.dut, pk.dut, pv.dut, &c.dut_pool, &db, n_heads, scale);
    snprintf(part, sizeof part, "%s: attention_scale", what);
    compare(part, po, ATTN_ABS_TOL, ATTN_REL_TOL, NULL, 0);
    check_unchanged(part, pq, q);
    check_unchanged(part, pk, k);
    check_unchanged(part, pv, v);
    check_unchanged(part, c.blocks, pool_before);
    for (int i = 0; i < n_pairs; i++)
        if (mass[i].ref) {
            snprintf(part, sizeof part, "%s: mass of pair %d (%d + %d keys)", what, i, views[i].len,
                     n_new[i / n_heads]);
            compare(part, mass[i], MASS_ABS_TOL, MASS_REL_TOL, NULL, 0);
            pair_del(mass[i]);
        }
    pair_del(pk), pair_del(pv), pair_del(pq), pair_del(po);
    kv_case_del(&c);
    free(k), free(v), free(q), free(q_start), free(views), free(mass), free(ref_mass),
        free(dut_mass), free(pool_before);
}

/* Block sizes 1, 3, 4 and 16; caches of 0 (every pair: the first scale) to
 * 300 tokens, across block and key-tile (32 keys) boundaries; ragged
 * scales of 0, 1, 4, 9 and 17 rows and one of 40 (row tiles of 8, full and
 * not); head dims 8, 20 (not a warp multiple), 64 and 128 (the tiled
 * kernel) and 160 (the per-row kernel); mass off and on; and more pairs
 * than one staging copy holds (several launches). */
static void test_attention_scale(void) {
    const int ragged[] = {1, 4, 0, 9}, first[] = {1}, big[] = {17, 40};
    check_kv_scale_step(1, 8, 3, 4, ragged, 0, 1); /* nothing cached yet */
    check_kv_scale_step(3, 8, 2, 1, first, 0, 1);
    check_kv_scale_step(1, 8, 3, 4, ragged, 6, 1);
    check_kv_scale_step(3, 20, 4, 4, ragged, 140, 0);
    check_kv_scale_step(3, 20, 4, 4, ragged, 140, 1);
    check_kv_scale_step(16, 64, 2, 2, big, 300, 1);
    check_kv_scale_step(16, 64, 2, 4, ragged, 33, 1);
    check_kv_scale_step(16, 128, 2, 2, big, 70, 1); /* the tiled kernel's widest rows */
    check_kv_scale_step(4, 160, 2, 2, big, 40, 1);  /* wider: the per-row kernel */
    enum { MANY = 3500 };
    int *ones = malloc(MANY * sizeof *ones);
    for (int i = 0; i < MANY; i++)
        ones[i] = 1;
    check_kv_scale_step(2, 8, 2, MANY, ones, 3, 1);
    free(ones);
    check_status_clean("attention_scale");
}

/* Compaction of one head in place with a random ascending keep list (each
 * index kept with probability p; p = 1 keeps all, 0 none), with and without
 * mass: the whole pool and the mass must match exactly. */
static void check_kv_gather(int bt, int hd, int len, double p, int with_mass) {
    const int nb = (len + bt - 1) / bt;
    kv_case_t c = kv_case_new(bt, hd, nb + 2);
    int *keep = malloc(((size_t)len + 1) * sizeof *keep), n_keep = 0;
    for (int j = 0; j < len; j++)
        if ((double)(rng_next() >> 11) / 9007199254740992.0 < p)
            keep[n_keep++] = j;
    float *m0 = host_uniform((size_t)len, 0, 3);
    pair_t m = pair_new(m0, (size_t)len);
    cpu->kv_gather(cpu, &c.ref_pool, c.perm, keep, n_keep, with_mass ? m.ref : NULL);
    dut->kv_gather(dut, &c.dut_pool, c.perm, keep, n_keep, with_mass ? m.dut : NULL);
    char what[128];
    snprintf(what, sizeof what, "kv_gather %s bt=%d hd=%d len=%d keep=%d mass=%d",
             dtype_name(kv_type), bt, hd, len, n_keep, with_mass);
    compare(what, c.blocks, 0, 0, NULL, 0);
    compare(what, m, 0, 0, NULL, 0);
    pair_del(m);
    kv_case_del(&c);
    free(keep), free(m0);
}

static void test_kv_gather(void) {
    check_kv_gather(1, 8, 1, 1.0, 1);
    check_kv_gather(1, 8, 9, 0.5, 1);
    check_kv_gather(3, 20, 10, 0.0, 1);
    check_kv_gather(3, 20, 31, 0.4, 0);
    check_kv_gather(3, 20, 31, 0.7, 1);
    check_kv_gather(16, 64, 70, 0.3, 1);
    check_kv_gather(16, 64, 70, 1.0, 0);
    check_kv_gather(16, 64, 48, 0.9, 1);
    check_status_clean("kv_gather");
}

/* Rounding at every edge: for neighbouring finite values a < b of kv_type
 * (all of fp8's, every 61st of the 16-bit types'), the midpoint and the
 * fp32 values next to it, then values past the largest finite one, as K
 * and V rows (times the view's scales) appended on both backends: the
 * same bytes on both, and the bytes the host's dtype_from_f32 gives. */
static void test_kv_append_rounds_at_every_edge(void) {
    if (kv_type == DTYPE_F32)
        return;
    const int stride = kv_type == DTYPE_F8_E4M3 ? 1 : 61;
    const unsigned top = kv_type == DTYPE_F8_E4M3 ? 0x7eu
                         : kv_type == DTYPE_F16   ? 0x7bffu
                                                  : 0x7f7fu;
    size_t n = 0, cap = 4 * (top / (unsigned)stride + 2) + 8;
    float *x = malloc(cap * sizeof *x);
    for (unsigned c = 0; c + 1 <= top; c += (unsigned)stride) {
        unsigned char lo[2], hi[2];
        uint16_t cl = (uint16_t)c, ch = (uint16_t)(c + 1);
        memcpy(lo, &cl, 2), memcpy(hi, &ch, 2);
        float a, b;
        dtype_to_f32(&a, lo, kv_type, 1);
        dtype_to_f32(&b, hi, kv_type, 1);
        const float mid = a + (b - a) / 2;
        x[n++] = mid;
        x[n++] = nextafterf(mid, 0.0f);
        x[n++] = nextafterf(mid, INFINITY);
        x[n++] = -mid;
    }
    const float past[] = {500.0f, -500.0f, 1e30f, -1e30f, 70000.0f, 3.0e38f, 0.0f, -0.0f};
    for (size_t i = 0; i < sizeof past / sizeof past[0]; i++)
        x[n++] = past[i];
    const int hd = 8, rows = (int)((n + hd - 1) / hd);
    float *k = calloc((size_t)rows * hd, sizeof *k), *v = calloc((size_t)rows * hd, sizeof *v);
    for (size_t i = 0; i < n; i++) {
        const int fp8 = kv_type == DTYPE_F8_E4M3;
        k[i] = x[i] * (fp8 ? KV_K_SCALE : 1.0f);
        v[i] = x[i] * (fp8 ? KV_V_SCALE : 1.0f);
    }
    kv_case_t c = kv_case_new(1, hd, rows);
    kv_view_t view = kv_view_at(c.perm, rows);
    const int q_start[2] = {0, rows};
    pair_t pk = pair_new(k, (size_t)rows * hd), pv = pair_new(v, (size_t)rows * hd);
    cpu->kv_append(cpu, &c.ref_pool, &view, pk.ref, pv.ref, q_start, 1, 1);
    dut->kv_append(dut, &c.dut_pool, &view, pk.dut, pv.dut, q_start, 1, 1);
    char what[96];
    snprintf(what, sizeof what, "kv_append %s at %zu rounding edges", dtype_name(kv_type), n);
    compare(what, c.blocks, 0, 0, NULL, 0);
    const size_t row = (size_t)hd * dtype_size(kv_type);
    unsigned char *got = malloc(c.blocks.n * sizeof(float)), *want = malloc(row);
    cpu->download(cpu, got, c.blocks.ref, c.blocks.n * sizeof(float));
    float *xr = calloc((size_t)hd, sizeof *xr);
    int bad = 0;
    for (int r = 0; r < rows; r++) {
        for (int d = 0; d < hd; d++)
            xr[d] = (size_t)r * hd + d < n ? x[(size_t)r * hd + d] : 0.0f;
        dtype_from_f32(want, xr, kv_type, (size_t)hd);
        const size_t at = (size_t)c.perm[r] * 2 * row;
        bad += memcmp(got + at, want, row) != 0;       /* K */
        bad += memcmp(got + at + row, want, row) != 0; /* V */
    }
    CHECK_MSG(bad == 0, "%s: %d rows differ from dtype_from_f32", what, bad);
    free(x), free(k), free(v), free(got), free(want), free(xr);
    pair_del(pk), pair_del(pv);
    kv_case_del(&c);
    check_status_clean(what);
}

/* kv_read_rows of a random run of a scattered cache, K or V rows, widened
 * on both backends: the same floats exactly; for fp32 the pool's own
 * values. */
static void check_kv_read_rows(int bt, int hd, int len, int j0, int n, int values) {
    const int nb = (len + bt - 1) / bt;
    kv_case_t c = kv_case_new(bt, hd, nb + 2);
    const kv_view_t view = kv_view_at(c.perm, len);
    pair_t out = pair_new(NULL, (size_t)n * hd);
    cpu->kv_read_rows(cpu, out.ref, &c.ref_pool, &view, j0, n, values);
    dut->kv_read_rows(dut, out.dut, &c.dut_pool, &view, j0, n, values);
    char what[128];
    snprintf(what, sizeof what, "kv_read_rows %s %c bt=%d hd=%d len=%d [%d, %d)",
             dtype_name(kv_type), values ? 'V' : 'K', bt, hd, len, j0, j0 + n);
    compare(what, out, 0, 0, NULL, 0);
    /* Row j0 + i against the raw pool, widened here: a block is bt K rows,
     * then bt V rows. */
    const size_t esz = dtype_size(kv_type), row = (size_t)hd * esz;
    const float scale = kv_type == DTYPE_F8_E4M3 ? (values ? KV_V_SCALE : KV_K_SCALE) : 1.0f;
    unsigned char *raw = malloc(c.blocks.n * sizeof(float));
    float *got = malloc((size_t)n * hd * sizeof *got), *want = malloc((size_t)hd * sizeof *want);
    cpu->download(cpu, raw, c.blocks.ref, c.blocks.n * sizeof(float));
    cpu->download(cpu, got, out.ref, (size_t)n * hd * sizeof *got);
    int bad = 0;
    for (int i = 0; i < n; i++) {
        const int j = j0 + i;
        const size_t at =
            ((size_t)c.perm[j / bt] * 2 * bt + (size_t)(values ? bt : 0) + (size_t)(j % bt)) * row;
        dtype_to_f32(want, raw + at, kv_type, (size_t)hd);
        for (int d = 0; d < hd; d++)
            bad += got[(size_t)i * hd + d] != want[d] * scale;
    }
    CHECK_MSG(bad == 0, "%s: %d values differ from the pool's rows", what, bad);
    free(raw), free(got), free(want);
    pair_del(out);
    kv_case_del(&c);
}

static void test_kv_read_rows(void) {
    for (int values = 0; values <= 1; values++) {
        check_kv_read_rows(1, 8, 5, 0, 5, values);
        check_kv_read_rows(3, 20, 31, 7, 17, values);
        check_kv_read_rows(16, 64, 70, 40, 30, values);
    }
    check_status_clean("kv_read_rows");
}

/* ---- dense attention -------------------------------------------------------- */

/* Dense attention of a ragged batch on both backends: sequence s has nq[s]
 * query rows and nk[s] keys (either may be 0; no keys gives zeros). With
 * fused, K and V are the two halves of one buffer's rows (a fused K/V
 * projection: kv_stride = 2 * n_heads * hd, v = k + n_heads * hd); else
 * two buffers whose rows are 3 floats wider than the heads (an odd stride;
 * Infinity's own K and V have stride n_heads * hd, the easy case). With
 * bias, T5's table of span = the longest sequence + 2 (entries no pair
 * reads sit at its ends), values in [-4, 4]. q, K/V and the table must come
 * back unchanged. */
static void check_attention_dense(int n_seq, const int *nq, const int *nk, int n_heads, int hd,
                                  int fused, int with_bias, float scale) {
    int *q_start = malloc(((size_t)n_seq + 1) * sizeof *q_start);
    int *k_start = malloc(((size_t)n_seq + 1) * sizeof *k_start);
    int span = 1;
    q_start[0] = k_start[0] = 0;
    for (int s = 0; s < n_seq; s++) {
        q_start[s + 1] = q_start[s] + nq[s];
        k_start[s + 1] = k_start[s] + nk[s];
        span = nq[s] + 2 > span ? nq[s] + 2 : span;
        span = nk[s] + 2 > span ? nk[s] + 2 : span;
    }
    const int rows = q_start[n_seq], keys = k_start[n_seq];
    const size_t width = (size_t)n_heads * hd, n = (size_t)rows * width;
    const int stride = fused ? 2 * (int)width : (int)width + 3;
    const size_t n_kv = (size_t)keys * stride, n_bias = (size_t)n_heads * (2 * span - 1);
    float *q = host_uniform(n, -2, 2), *k = host_uniform(n_kv, -1, 1);
    float *v = host_uniform(n_kv, -1, 1), *bias = host_uniform(n_bias, -4, 4);
    pair_t pq = pair_new(q, n), pk = pair_new(k, n_kv), pv = pair_new(v, n_kv);
    pair_t pb = pair_new(bias, n_bias), po = pair_new(NULL, n);
    /* fused: V is the second half of K's rows */
    const float *vr = fused ? pk.ref + width : pv.ref, *vd = fused ? pk.dut + width : pv.dut;
    cpu->attention_dense(cpu, po.ref, pq.ref, pk.ref, vr, stride, q_start, k_start, n_seq, n_heads,
                         hd, scale, with_bias ? pb.ref : NULL, span);
    dut->attention_dense(dut, po.dut, pq.dut, pk.dut, vd, stride, q_start, k_start, n_seq, n_heads,
                         hd, scale, with_bias ? pb.dut : NULL, span);
    char what[160];
    snprintf(what, sizeof what,
             "attention_dense seqs=%d rows=%d keys=%d heads=%d hd=%d stride=%d bias=%d", n_seq,
             rows, keys, n_heads, hd, stride, with_bias);
    /* The attention tolerances hold for scores scaled by 1 / sqrt(hd), as
     * the KV tests'; a score's rounding error grows with the score, so T5's
     * unscaled ones (scale 1) get them times scale * sqrt(hd). */
    const double grow = scale * sqrt((double)hd) > 1 ? scale * sqrt((double)hd) : 1;
    compare(what, po, ATTN_ABS_TOL * grow, ATTN_REL_TOL * grow, NULL, 0);
    check_unchanged(what, pq, q);
    check_unchanged(what, pk, k);
    check_unchanged(what, pv, v);
    check_unchanged(what, pb, bias);
    pair_del(pq), pair_del(pk), pair_del(pv), pair_del(pb), pair_del(po);
    free(q), free(k), free(v), free(bias), free(q_start), free(k_start);
}

/* Infinity's three uses and their edges: cross-attention of ragged image
 * rows to texts (sequences without rows, without keys, more keys than a
 * warp tile; fused and separate K/V); T5's encoder (scale 1, the bias
 * table, as many keys as queries, past the CPU's 256-key chunk); the
 * attentive pool (one query, head_dim 224 as Infinity-8B's); head dims 1,
 * 20 (not a warp multiple) and 512 (the kernels' most); and more sequences
 * than one staging copy holds (32767), most of them without rows. */
static void test_attention_dense(void) {
    const int cq[] = {3, 0, 40, 1, 9}, ck[] = {5, 7, 33, 0, 64};
    check_attention_dense(5, cq, ck, 3, 20, 1, 0, 1 / sqrtf(20));
    check_attention_dense(5, cq, ck, 2, 64, 0, 0, 1 / sqrtf(64));
    check_attention_dense(5, cq, ck, 2, 224, 1, 0, 1 / sqrtf(224));
    const int tq[] = {1, 7, 40}, tk[] = {5, 3, 40};
    check_attention_dense(3, tq, tk, 3, 8, 0, 1, 1.0f);
    const int t5[] = {300};
    check_attention_dense(1, t5, t5, 2, 64, 0, 1, 1.0f);
    const int one[] = {1}, text[] = {300};
    check_attention_dense(1, one, text, 2, 224, 0, 0, 1 / sqrtf(224));
    const int sq[] = {2, 1}, sk[] = {3, 40};
    check_attention_dense(2, sq, sk, 1, 1, 0, 1, 1.0f);
    check_attention_dense(2, sq, sk, 2, 512, 1, 0, 1 / sqrtf(512));
    enum { MANY = 40000 };
    int *mq = malloc(MANY * sizeof *mq), *mk = malloc(MANY * sizeof *mk);
    for (int s = 0; s < MANY; s++) {
        mq[s] = s % 997 == 0 || s == MANY - 1 ? 1 + s % 3 : 0;
        mk[s] = 1 + s % 5;
    }
    check_attention_dense(MANY, mq, mk, 2, 8, 1, 0, 1 / sqrtf(8));
    free(mq), free(mk);
    check_status_clean("attention_dense");
}

int main(void) {
    ar_error_t err = {{0}};
    cpu = backend_cpu_create(0, &err);
    dut = cpu ? test_cuda_create(0, DUT_RESERVE, &err) : NULL;
    if (dut) /* the mode held to the CPU's bounds (backend.h) */
        dut->activations = ACTIVATIONS_SPLIT;
    if (!cpu || !dut) {
        fprintf(stderr, "cannot create the backends: %s\n", err.msg);
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_memory_roundtrip_alignment_and_reuse);
    TEST_RUN(test_weight_load_keeps_type_and_bits);
    TEST_RUN(test_create_reserves_or_reports_errors);
    TEST_RUN(test_invalid_ops_fail_loudly);
    TEST_RUN(test_stats_count_launches_copies_syncs_and_memory);
    TEST_RUN(test_a_step_runs_as_one_graph);
    TEST_RUN(test_the_graph_cache_replaces_the_least_recently_used);
    TEST_RUN(test_check_mode_syncs_after_every_op);
    TEST_RUN(test_matmul_types_shapes_and_bias);
    TEST_RUN(test_matmul_sliced_over_scratch);
    TEST_RUN(test_matmul_stacked_equals_its_parts);
    TEST_RUN(test_matmul_activation_modes_and_add);
    TEST_RUN(test_norm_and_silu_hand_bf16_to_the_next_matmul);
    TEST_RUN(test_weight_load_8bit_refuses_and_frees);
    TEST_RUN(test_matmul_8bit_against_the_cpu);
    TEST_RUN(test_seq_rows_8bit_stack_batch_invariant);
    TEST_RUN(test_matmul_8bit_activation_modes_and_add);
    TEST_RUN(test_matmul_8bit_sliced_over_scratch);
    TEST_RUN(test_matmul_8bit_is_the_bf16_matmul_of_its_values);
    TEST_RUN(test_matmul_8bit_launches_hand_off_and_graph);
    TEST_RUN(test_conv2d_types_pads_and_slices);
    TEST_RUN(test_conv2d_sliced_over_scratch);
    TEST_RUN(test_rmsnorm);
    TEST_RUN(test_rope);
    TEST_RUN(test_rope_2d);
    TEST_RUN(test_layernorm);
    TEST_RUN(test_modulate_and_gate_add);
    TEST_RUN(test_modulate_and_gate_add_over_sequences);
    TEST_RUN(test_l2norm_heads);
    TEST_RUN(test_elementwise);
    TEST_RUN(test_softmax);
    TEST_RUN(test_embedding);
    TEST_RUN(test_groupnorm);
    TEST_RUN(test_upsample_and_transpose_exact);
    TEST_RUN(test_resize_bicubic_and_area);
    TEST_RUN(test_attention_dense);
    static const dtype_t kv_types[] = {DTYPE_F32, DTYPE_BF16, DTYPE_F16, DTYPE_F8_E4M3};
    for (size_t t = 0; t < sizeof kv_types / sizeof kv_types[0]; t++) {
        kv_type = kv_types[t];
        printf("KV cache of %s\n", dtype_name(kv_type));
        TEST_RUN(test_kv_append_and_attention);
        TEST_RUN(test_attention_scale);
        TEST_RUN(test_kv_gather);
        TEST_RUN(test_kv_read_rows);
        TEST_RUN(test_kv_append_rounds_at_every_edge);
    }
    dut->destroy(dut);
    cpu->destroy(cpu);
    return TEST_SUMMARY();
}
