/* Images per second of any model at batch 1 and at a larger batch,
 * measured side by side in one run: the engine's half of `make bench`
 * (bench/speed_bench.py puts PyTorch beside it) and all of `make
 * bench-scale`. A wave is B images started together and stepped in
 * lockstep (one gen_step over all of them per step, as the batcher does
 * when they arrive together), then decoded one by one; the two batch sizes
 * alternate wave sets --reps times, and the medians are compared. A
 * text-prompted model draws --prompt with seeds 0, 1, ...; a
 * class-conditional one classes 0, 1, ... The full KV cache, stored as
 * --kv-dtype (default auto: the weights' type, as serve), the model's
 * sampling settings.
 *
 *   build/speed_bench --model DIR [--prompt TEXT] [--batch N] [--images N]
 *                     [--reps N] [--threads N] [--kv-dtype TYPE] [--json]
 *                     [--cpu-activations f32|bf16] [--steps N]
 *
 * --steps N stops each wave after its first N steps past the prompt (no
 * image is drawn): the step times of a large model in minutes rather than
 * hours; images/s is then waves of N steps a second.
 *
 * Besides images/s, per batch size: the median time of a decode step (a
 * raster model's steps after the first, which feeds the prompt), the VQ
 * decode's time per image, for next-scale models each step's (scale's)
 * seconds a wave, averaged over the sets, and for raster models the step's memory
 * roofline: the bytes of weights a step reads (raster_step_weight_bytes)
 * over this machine's read bandwidth, measured here on the same threads
 * (a buffer twice the last-level cache, within 256 MiB to 1 GiB), as a share of the
 * measured step; and its compute roofline: the multiply-adds of those
 * weights for every row (two per image: the CFG pair) at this machine's
 * peak rate of fused multiply-adds, measured on the same threads at the
 * widest vectors the kernels use (vec_isa), as a share of the step. Prints a table, or with --json
 * one JSON object (with the prompt rows, so another implementation can run the same input).
 * --measure speed skips the bandwidth's buffer (whose pages would be the
 * process's peak RSS), --measure roofline runs no images.
 *
 * --backend NAME (default cpu; the names backend_open takes) runs it on
 * another backend. On a device backend (one with counters, ->stats), each
 * batch size also gets the kernel launches, host<->device copies (and
 * their bytes) and stream waits a decode step costs, averaged over its
 * steps, and the backend's peak device memory; and the memory roofline is
 * the step's weight bytes over the device's bandwidth, measured as a large
 * device-to-device copy through the backend (bytes read and written), not
 * the CPU's (there is no compute roofline on a device). */
#include <cjson/cJSON.h>
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/clock.h"
#include "cli/flags.h"
#include "engine/family/family_raster.h"
#include "engine/generate.h"
#include "engine/planner.h"
#include "kernels/cpu/vec_isa.h"

#define MAX_BATCH 256
#define MAX_REPS 64
#define MAX_SCALES 64 /* a next-scale model's steps a wave, timed one by one */

static int cmp_double(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof v[0], cmp_double);
    return n ? v[n / 2] : 0;
}

typedef struct bench {
    backend_t *be;
    int has_stats; /* be has counters (a device backend) */
    model_t m;
    kv_pool_t pool;
    int is_raster;
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt; /* text */
    uint8_t *rgb;
    int max_steps;             /* --steps: 0, or the steps a wave stops after */
    double *step_s, *decode_s; /* per wave set: decode steps, decodes */
    int n_step, n_decode, cap_step, cap_decode;
    /* What the timed decode steps of the last run_waves cost the device
     * (the counters' sums; memory figures unused), and how many there were. */
    backend_stats_t step_counts;
    long counted_steps;
    /* A next-scale model's last run_waves: each step's seconds summed over
     * its waves, by step (scale), and the waves. */
    double scale_s[MAX_SCALES];
    int n_scales, waves;
} bench_t;

/* sum += b - a, the counts only. */
static void note(double *v, int *n, int cap, double s) {
    if (*n < cap)
        v[(*n)++] = s;
}

static int request_init(bench_t *b, gen_request_t *r, int i, ar_error_t *err) {
    model_t *m = &b->m;
    if (b->n_prompt)
        return gen_request_init(r, m, &b->pool, NULL, b->cond, b->uncond, b->n_prompt,
                                &m->cfg.sampling, (uint64_t)i, 0, err);
    int cond, uncond, len;
    if (model_prompt_from_class(m, i % m->cfg.condition.num_classes, &cond, &uncond, &len, err))
        return AR_ERR;
    return gen_request_init(r, m, &b->pool, NULL, &cond, &uncond, len, &m->cfg.sampling,
                            (uint64_t)i, 0, err);
}

/* Runs `images` images in waves of `batch`; the seconds taken, or < 0. */
static double run_waves(bench_t *b, int batch, int images) {
    gen_request_t *reqs = calloc((size_t)batch, sizeof *reqs);
    gen_request_t **ptrs = calloc((size_t)batch, sizeof *ptrs);
    ar_error_t err = {{0}};
    const double t0 = clock_now_s();
    double took = -1;
    b->n_step = b->n_decode = 0;
    b->step_counts = (backend_stats_t){0};
    b->counted_steps = 0;
    memset(b->scale_s, 0, sizeof b->scale_s);
    b->n_scales = b->waves = 0;
    for (int done = 0; reqs && ptrs && done < images; done += batch) {
        const int n = images - done < batch ? images - done : batch;
        for (int i = 0; i < n; i++) {
            ptrs[i] = &reqs[i];
            if (request_init(b, &reqs[i], done + i, &err) != AR_OK)
                goto out;
        }
        while (!gen_request_done(&reqs[0]) &&
               (!b->max_steps || reqs[0].step <= b->max_steps - !b->is_raster)) {
            const int timed = reqs[0].step != 0 || !b->is_raster;
            backend_stats_t c0, c1;
            if (b->has_stats)
                backend_stats(b->be, &c0);
            const double s0 = clock_now_s();
            if (gen_step(ptrs, n, &err) != AR_OK)
                goto out;
            if (!timed)
                continue;
            const double took_s = clock_now_s() - s0;
            note(b->step_s, &b->n_step, b->cap_step, took_s);
            const int at = reqs[0].step - 1;
            if (!b->is_raster && at < MAX_SCALES) {
                b->scale_s[at] += took_s;
                b->n_scales = at + 1 > b->n_scales ? at + 1 : b->n_scales;
            }
            if (b->has_stats) {
                backend_stats(b->be, &c1);
                backend_stats_add(&b->step_counts, &c1, &c0);
                b->counted_steps++;
            }
        }
        b->waves++;
        for (int i = 0; i < n; i++) {
            const double s0 = clock_now_s();
            if (!gen_request_done(&reqs[i])) { /* cut short by --steps */
                gen_request_free(&reqs[i]);
                continue;
            }
            if (gen_decode(&reqs[i], b->rgb, &err) != AR_OK)
                goto out;
            note(b->decode_s, &b->n_decode, b->cap_decode, clock_now_s() - s0);
            gen_request_free(&reqs[i]);
        }
    }
    took = clock_now_s() - t0;
out:
    if (took < 0)
        fprintf(stderr, "speed_bench: %s\n", err.msg);
    for (int i = 0; reqs && i < batch; i++)
        gen_request_free(&reqs[i]);
    free(reqs);
    free(ptrs);
    return took;
}

typedef float v4f __attribute__((vector_size(16)));

/* Bytes per second of reading a buffer far larger than the caches on
 * `threads` threads (0: OpenMP's default), best of 5 passes. */
static double read_bandwidth(int threads) {
    const size_t lo = (size_t)256 << 20, hi = (size_t)1 << 30;
    const long llc = sysconf(_SC_LEVEL3_CACHE_SIZE);
    size_t bytes = llc > 0 ? 2 * (size_t)llc : lo;
    bytes = bytes < lo ? lo : bytes > hi ? hi : bytes;
    const size_t n = bytes / sizeof(v4f);
    v4f *buf = aligned_alloc(64, n * sizeof(v4f));
    if (!buf)
        return 0;
    memset(buf, 1, n * sizeof(v4f));
    double best = 0;
    volatile float sink = 0;
    for (int pass = 0; pass < 5; pass++) {
        const double t0 = clock_now_s();
        float total = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads()) reduction(+ : total)
        {
            v4f a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
#pragma omp for schedule(static)
            for (size_t i = 0; i < n; i += 4) {
                a0 += buf[i];
                a1 += buf[i + 1];
                a2 += buf[i + 2];
                a3 += buf[i + 3];
            }
            const v4f s = a0 + a1 + a2 + a3;
            total += s[0] + s[1] + s[2] + s[3];
        }
        const double bw = (double)(n * sizeof(v4f)) / (clock_now_s() - t0);
        sink = sink + total;
        if (bw > best)
            best = bw;
    }
    free(buf);
    return best;
}

/* Fused multiply-adds a second on one thread: twelve independent chains
 * of `iters` dependent FMAs each, vectors of the instruction set's width
 * (a chain per register the latency needs, with room), in FLOPs. */
#define FMA_CHAINS 12
#define FMA_PEAK_BODY(VEC, SET1, FMA, LANES)                                                       \
    VEC acc[FMA_CHAINS];                                                                           \
    for (int i = 0; i < FMA_CHAINS; i++)                                                           \
        acc[i] = SET1(1e-3f * (float)i);                                                           \
    const VEC mul = SET1(0.999f), add = SET1(1e-4f);                                               \
    const double t0 = clock_now_s();                                                               \
    for (long k = 0; k < iters; k++)                                                               \
        _Pragma("GCC unroll 12") for (int i = 0; i < FMA_CHAINS; i++) acc[i] =                     \
            FMA(acc[i], mul, add);                                                                 \
    const double took = clock_now_s() - t0;                                                        \
    float lanes[LANES];                                                                            \
    for (int i = 0; i < FMA_CHAINS; i++) {                                                         \
        memcpy(lanes, &acc[i], sizeof lanes);                                                      \
        *sink += lanes[0];                                                                         \
    }                                                                                              \
    return 2.0 * LANES * FMA_CHAINS * (double)iters / took;

__attribute__((target("avx512f"))) static double fma_rate_avx512(long iters, volatile float *sink) {
    FMA_PEAK_BODY(__m512, _mm512_set1_ps, _mm512_fmadd_ps, 16)
}

__attribute__((target("avx2,fma"))) static double fma_rate_avx2(long iters, volatile float *sink) {
    FMA_PEAK_BODY(__m256, _mm256_set1_ps, _mm256_fmadd_ps, 8)
}

/* The machine's FMA peak in FLOPs a second on `threads` threads (each
 * running the chains at once), at the kernels' vector width; 0 for the
 * portable kernels, which have none to measure. Best of 3. */
static double fma_peak(int threads) {
    const vec_isa_t isa = vec_isa();
    if (isa != VEC_AVX512 && isa != VEC_AVX2)
        return 0;
    double best = 0;
    for (int pass = 0; pass < 3; pass++) {
        double total = 0;
#pragma omp parallel num_threads(threads > 0 ? threads : omp_get_max_threads()) reduction(+ : total)
        {
            volatile float sink = 0;
            total += isa == VEC_AVX512 ? fma_rate_avx512(20000000, &sink)
                                       : fma_rate_avx2(20000000, &sink);
        }
        if (total > best)
            best = total;
    }
    return best;
}

/* The device copy that measures a device's bandwidth: large enough that a
 * copy's fixed cost is noise (on a GPU, tens of microseconds against a
 * launch's few), halved while the backend cannot hold two of them. */
#define DEVICE_COPY_BYTES ((size_t)128 << 20)
#define DEVICE_COPY_MIN_BYTES ((size_t)8 << 20)
/* Copies are queued back to back for about this long between waits, so
 * that the wait's own cost is noise too. */
#define DEVICE_COPY_PASS_S 0.02

/* Bytes a second that be moves in a device-to-device copy (each byte read
 * and written: twice the copy's size), queued through ->copy and waited
 * for with ->sync; best of 3 passes. *bytes: the copy's size. 0 when no
 * two buffers fit or the backend failed. */
static double device_copy_bandwidth(backend_t *be, size_t *bytes) {
    void *src = NULL, *dst = NULL;
    size_t n = DEVICE_COPY_BYTES;
    for (; n >= DEVICE_COPY_MIN_BYTES; n /= 2) {
        src = be->alloc(be, n);
        dst = src ? be->alloc(be, n) : NULL;
        if (dst)
            break;
        be->free(be, src);
        src = NULL;
    }
    *bytes = dst ? n : 0;
    if (!dst)
        return 0;
    /* One copy first: it touches the pages and says how many make a pass. */
    double t0 = clock_now_s();
    be->copy(be, dst, src, n);
    be->sync(be);
    const double one = clock_now_s() - t0;
    const int reps = one <= 0                          ? 100
                     : one >= DEVICE_COPY_PASS_S       ? 1
                     : DEVICE_COPY_PASS_S / one >= 100 ? 100
                                                       : (int)(DEVICE_COPY_PASS_S / one) + 1;
    double best = 0;
    for (int pass = 0; pass < 3; pass++) {
        t0 = clock_now_s();
        for (int r = 0; r < reps; r++)
            be->copy(be, dst, src, n);
        be->sync(be);
        const double bw = 2.0 * (double)n * reps / (clock_now_s() - t0);
        if (bw > best)
            best = bw;
    }
    be->free(be, dst);
    be->free(be, src);
    ar_error_t err = {{0}};
    if (backend_status(be, &err) != AR_OK) {
        fprintf(stderr, "speed_bench: the device copy failed: %s\n", err.msg);
        return 0;
    }
    return best;
}

/* What the command line asks. */
typedef struct args {
    const char *model_dir, *prompt, *kv_name, *backend;
    long long batch, images, reps, threads, steps;
    int json, measure;   /* measure: 0 all, 1 speed, 2 roofline */
    int batch_invariant; /* backend.h's batch_invariant */
    int activations;     /* backend.h's backend_activations_t */
    int cpu_activations; /* backend.h's backend_cpu_activations_t */
    int graphs;          /* backend.h's backend_graphs_t */
} args_t;

/* 0 to go on, else main's exit status (help printed: 0 with *done set). */
static int args_parse(args_t *a, int argc, char **argv, int *done) {
    *a = (args_t){.prompt = "a red circle on the left",
                  .kv_name = "auto",
                  .backend = "cpu",
                  .batch = 16,
                  .images = 32,
                  .reps = 3,
                  .threads = 1};
    static const char *const measures[] = {"all", "speed", "roofline", NULL};
    static const char *const on_off[] = {"off", "on", NULL};
    char names[128], rule[256], backend_help[512];
    snprintf(backend_help, sizeof backend_help,
             "%s, or %s: %s (default cpu); a device backend adds launches, copies and peak "
             "device memory per step",
             backend_list(0, names, sizeof names), BACKEND_AUTO,
             backend_auto_rule(rule, sizeof rule));
    const cli_flag_t flags[] = {
        {"model", 0, CLI_STRING, &a->model_dir, .metavar = "DIR", .help = "a model directory"},
        {"prompt", 0, CLI_STRING, &a->prompt, .metavar = "TEXT",
         .help = "what a text-prompted model draws (default \"a red circle on the left\")"},
        {"batch", 0, CLI_INT, &a->batch, 2, MAX_BATCH, .metavar = "N",
         .help = "the batch compared with batch 1 (default 16)"},
        {"images", 0, CLI_INT, &a->images, 1, 1 << 16, .metavar = "N",
         .help = "images per wave set, a multiple of --batch (default 32)"},
        {"reps", 0, CLI_INT, &a->reps, 1, MAX_REPS, .metavar = "N",
         .help = "wave sets of each batch size, alternating (default 3)"},
        {"threads", 0, CLI_INT, &a->threads, 0, 1024, .metavar = "N",
         .help = "CPU threads, 0 = every core (default 1)"},
        {"backend", 0, CLI_STRING, &a->backend, .metavar = "NAME", .help = backend_help},
        {"kv-dtype", 0, CLI_STRING, &a->kv_name, .metavar = "TYPE",
         .help = "K and V in the pool: auto (the weights' type, default), f32, bf16, f16 or fp8"},
        {"batch-invariant", 0, CLI_CHOICE, &a->batch_invariant, .choices = on_off,
         .metavar = "on|off",
         .help = "next-scale models: a GEMM per image where the backend's rows depend on the "
                 "batch (default off: one GEMM over the batch's rows)"},
        {"gpu-activations", 0, CLI_CHOICE, &a->activations, .choices = backend_activations_names,
         .metavar = "MODE",
         .help = "a device backend's GEMMs with 16-bit weights: bf16 (default) or split "
                 "(backend.h)"},
        {"cpu-activations", 0, CLI_CHOICE, &a->cpu_activations,
         .choices = backend_cpu_activations_names, .metavar = "f32|bf16",
         .help = "the CPU backend's GEMMs with bf16 weights: f32 (default) or bf16, on AMX "
                 "tiles where the CPU has them (backend.h)"},
        {"gpu-graphs", 0, CLI_CHOICE, &a->graphs, .choices = backend_graphs_names,
         .metavar = "on|off",
         .help = "a device backend's steps as CUDA graphs (default on) or op by op (backend.h)"},
        {"steps", 0, CLI_INT, &a->steps, 0, 1 << 20, .metavar = "N",
         .help = "stop each wave after N steps past the prompt, drawing no image (default 0: "
                 "whole images)"},
        {"json", 0, CLI_BOOL, &a->json, .help = "print one JSON object instead of a table"},
        {"measure", 0, CLI_CHOICE, &a->measure, .choices = measures, .metavar = "WHAT",
         .help = "all (default), speed (no bandwidth buffer: peak RSS is the engine's) or "
                 "roofline (no images)"},
        {0}};
    int help = 0, rc = cli_flags_parse("speed_bench", flags, argc, argv, &help);
    *done = rc || help;
    if (*done) {
        if (help)
            cli_flags_usage(stdout, flags);
        return rc;
    }
    if (!a->model_dir || a->images % a->batch) {
        fprintf(stderr, "speed_bench: give --model, and --images a multiple of --batch\n");
        *done = 1;
        return 2;
    }
    return 0;
}

/* Loads the model onto be and makes b's pool (batch full-cache images) and
 * buffers; *kv_mib = one image's KV. 0, or main's exit status (printed). */
static int bench_open(bench_t *b, const args_t *a, backend_t *be, dtype_t *kv_dtype,
                      double *kv_mib) {
    ar_error_t err = {{0}};
    model_t *m = &b->m;
    b->be = be;
    b->has_stats = be->stats != NULL;
    if (model_load(m, a->model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "speed_bench: %s\n", err.msg);
        return 1;
    }
    if (planner_kv_dtype_choose(a->kv_name, m->weight_dtype, kv_dtype, &err) != AR_OK) {
        fprintf(stderr, "speed_bench: --kv-dtype: %s\n", err.msg);
        return 2;
    }
    b->is_raster = m->family == model_family_find("raster");
    if (!model_is_class_conditional(m) &&
        model_prompt_from_text(m, a->prompt, b->cond, b->uncond, &b->n_prompt, &err) != AR_OK) {
        fprintf(stderr, "speed_bench: --prompt: %s\n", err.msg);
        return 2;
    }
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    planner_plan_t plan;
    const int bt = planner_block_tokens(&m->cfg);
    const size_t block = kv_pool_block_bytes(bt, m->cfg.llm.head_dim, *kv_dtype);
    b->cap_step = (int)a->images * model_steps(&m->cfg);
    b->cap_decode = (int)a->images;
    b->max_steps = (int)a->steps;
    b->step_s = malloc(sizeof(double) * (size_t)b->cap_step);
    b->decode_s = malloc(sizeof(double) * (size_t)b->cap_decode);
    b->rgb =
        malloc((size_t)model_config_image_height(&m->cfg) * model_config_image_width(&m->cfg) * 3);
    if (!b->rgb || !b->step_s || !b->decode_s ||
        planner_plan_dtype(&plan, &m->cfg, &full, b->n_prompt ? b->n_prompt : 1, bt,
                           planner_kv_same(*kv_dtype), NULL, &err) != AR_OK ||
        kv_pool_init(&b->pool, be, (int)(a->batch * (long long)(plan.peak_bytes / block)), bt,
                     m->cfg.llm.head_dim, *kv_dtype, &err) != AR_OK) {
        fprintf(stderr, "speed_bench: %s\n", err.msg[0] ? err.msg : "out of memory");
        return 1;
    }
    *kv_mib = plan.peak_bytes / 1048576.0;
    planner_plan_free(&plan);
    return 0;
}

static void bench_close(bench_t *b) {
    kv_pool_free(&b->pool);
    model_free(&b->m);
    free(b->rgb);
    free(b->step_s);
    free(b->decode_s);
}

/* The medians of a batch size's wave sets; on a device backend, what its
 * timed steps cost the device, summed over every set, and the backend's
 * memory high-water mark after its first set (batch 1's sets run first,
 * so each size's is its own; both hold the weights and the KV pool, which
 * is made once, for the larger batch). */
typedef struct timing {
    double took[MAX_REPS], step[MAX_REPS], decode[MAX_REPS];
    double scale[MAX_SCALES]; /* a next-scale step's seconds a wave, summed over the reps */
    int n_scales;
    backend_stats_t counts;
    long steps;
    size_t device_peak;
} timing_t;

/* The machine's limits and the step's weights, for the rooflines. On a
 * device backend, bw is the device copy's bandwidth and there is no
 * compute peak (0). */
typedef struct roofline {
    int on, device;
    size_t weight_bytes, weight_elems;
    size_t copy_bytes; /* the device copy's size */
    double bw, peak;
} roofline_t;

static cJSON *report_head(const bench_t *b, const args_t *a, dtype_t kv_dtype, double kv_mib,
                          const roofline_t *rl) {
    const model_t *m = &b->m;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddArrayToObject(o, "batches"); /* report_row's */
    cJSON_AddStringToObject(o, "model", m->cfg.name);
    cJSON_AddStringToObject(o, "backend", b->be->name);
    cJSON_AddBoolToObject(o, "batch_invariant", b->be->batch_invariant);
    cJSON_AddStringToObject(o, "gpu_activations", backend_activations_names[b->be->activations]);
    cJSON_AddStringToObject(o, "cpu_activations",
                            backend_cpu_activations_names[b->be->cpu_activations]);
    cJSON_AddStringToObject(o, "gpu_graphs", backend_graphs_names[b->be->graphs]);
    cJSON_AddNumberToObject(o, "threads", (double)a->threads);
    cJSON_AddNumberToObject(o, "images", (double)a->images);
    cJSON_AddNumberToObject(o, "reps", (double)a->reps);
    cJSON_AddNumberToObject(o, "steps", (double)a->steps);
    cJSON_AddNumberToObject(o, "kv_mib_per_image", kv_mib);
    cJSON_AddStringToObject(o, "kv_dtype", planner_kv_dtype_name(kv_dtype));
    if (model_is_class_conditional(m))
        cJSON_AddNumberToObject(o, "num_classes", m->cfg.condition.num_classes);
    if (b->n_prompt) {
        cJSON_AddItemToObject(o, "cond", cJSON_CreateIntArray(b->cond, b->n_prompt));
        cJSON_AddItemToObject(o, "uncond", cJSON_CreateIntArray(b->uncond, b->n_prompt));
    }
    if (rl->on) {
        cJSON_AddNumberToObject(o, "step_weight_bytes", (double)rl->weight_bytes);
        cJSON_AddNumberToObject(o, "read_bytes_per_s", rl->bw);
        cJSON_AddNumberToObject(o, "step_weight_elems", (double)rl->weight_elems);
        cJSON_AddNumberToObject(o, "fma_flops_per_s", rl->peak);
        cJSON_AddStringToObject(o, "vector_isa", vec_isa_name(vec_isa()));
        cJSON_AddStringToObject(o, "roofline_bandwidth", rl->device ? "device copy" : "cpu read");
        if (rl->device)
            cJSON_AddNumberToObject(o, "device_copy_bytes", (double)rl->copy_bytes);
    }
    if (b->has_stats) {
        backend_stats_t st;
        backend_stats(b->be, &st);
        cJSON_AddNumberToObject(o, "device_reserved_bytes", (double)st.device_reserved_bytes);
    }
    return o;
}

/* One batch size's row (JSON into rows; a line unless --json); its images/s.
 * A device backend's counters (has_stats) are per timed step. */
static double report_row(const args_t *a, int size, timing_t *t, const roofline_t *rl,
                         int has_stats, cJSON *rows) {
    const int reps = (int)a->reps;
    const double set_s = median(t->took, reps);
    const double step_s = median(t->step, reps), decode_s = median(t->decode, reps);
    const double share = rl->bw > 0 && step_s > 0 ? rl->weight_bytes / rl->bw / step_s : 0;
    /* Two rows an image (the CFG pair), a multiply-add (2 FLOPs) per
     * weight per row. */
    const double flops = 2.0 * 2 * size * (double)rl->weight_elems;
    const double compute = rl->peak > 0 && step_s > 0 ? flops / rl->peak / step_s : 0;
    const double ips = a->images / set_s;
    cJSON *row = cJSON_CreateObject();
    cJSON_AddNumberToObject(row, "batch", size);
    cJSON_AddNumberToObject(row, "images_per_s", ips);
    cJSON_AddNumberToObject(row, "step_s", step_s);
    cJSON_AddNumberToObject(row, "decode_s", decode_s);
    if (t->n_scales) {
        cJSON *sc = cJSON_AddArrayToObject(row, "scale_s");
        for (int i = 0; i < t->n_scales; i++)
            cJSON_AddItemToArray(sc, cJSON_CreateNumber(t->scale[i] / reps));
    }
    if (rl->on) {
        cJSON_AddNumberToObject(row, "roofline", share);
        cJSON_AddNumberToObject(row, "compute_roofline", compute);
    }
    const double steps = t->steps > 0 ? (double)t->steps : 1;
    const backend_stats_t *c = &t->counts;
    const double launches = (double)c->launches / steps, syncs = (double)c->syncs / steps;
    const double h2d = (double)c->h2d_copies / steps, d2h = (double)c->d2h_copies / steps;
    const double bytes = (double)(c->h2d_bytes + c->d2h_bytes) / steps;
    if (has_stats) {
        cJSON_AddNumberToObject(row, "launches_per_step", launches);
        cJSON_AddNumberToObject(row, "kernels_per_step", (double)c->kernels / steps);
        cJSON_AddNumberToObject(row, "h2d_copies_per_step", h2d);
        cJSON_AddNumberToObject(row, "d2h_copies_per_step", d2h);
        cJSON_AddNumberToObject(row, "copy_bytes_per_step", bytes);
        cJSON_AddNumberToObject(row, "d2d_copies_per_step", (double)c->d2d_copies / steps);
        cJSON_AddNumberToObject(row, "syncs_per_step", syncs);
        cJSON_AddNumberToObject(row, "graph_launches_per_step", (double)c->graph_launches / steps);
        cJSON_AddNumberToObject(row, "graph_builds", (double)c->graph_builds);
        cJSON_AddNumberToObject(row, "device_peak_bytes", (double)t->device_peak);
    }
    cJSON_AddItemToArray(rows, row);
    if (!a->json) {
        printf("batch %3d: %8.2f images/s (median %.2f s per set; min %.2f, max %.2f); "
               "step %.2f ms, VQ decode %.1f ms",
               size, ips, set_s, t->took[0], t->took[reps - 1], step_s * 1e3, decode_s * 1e3);
        if (rl->on && rl->device)
            printf(", %.0f%% of the memory roofline", 100 * share);
        else if (rl->on)
            printf(", %.0f%% of the memory roofline, %.0f%% of the compute roofline", 100 * share,
                   100 * compute);
        printf("\n");
        for (int i = 0; i < t->n_scales; i++)
            printf("%s%.4f%s", i ? " " : "           scales (s a wave): ", t->scale[i] / reps,
                   i == t->n_scales - 1 ? "\n" : "");
        char line[256];
        if (has_stats)
            printf("           per step: %s; peak device memory %.1f MiB\n",
                   backend_stats_per_step(c, steps, line, sizeof line), t->device_peak / 1048576.0);
    }
    return ips;
}

int main(int argc, char **argv) {
    args_t a;
    int done, rc = args_parse(&a, argc, argv, &done);
    if (done)
        return rc;
    ar_error_t err = {{0}};
    backend_t *be = backend_open(a.backend, (int)a.threads, &err);
    if (!be) {
        fprintf(stderr, "speed_bench: %s\n", err.msg);
        return 1;
    }
    be->batch_invariant = a.batch_invariant;
    be->activations = (backend_activations_t)a.activations;
    be->cpu_activations = (backend_cpu_activations_t)a.cpu_activations;
    be->graphs = (backend_graphs_t)a.graphs;
    static bench_t b;
    dtype_t kv_dtype;
    double kv_mib;
    if ((rc = bench_open(&b, &a, be, &kv_dtype, &kv_mib)))
        return rc;
    const int sizes[2] = {1, (int)a.batch};
    static timing_t t[2];
    const int timed = a.measure != 2;
    if (!timed)
        a.reps = 0;
    else
        run_waves(&b, 1, 1); /* warm-up: workspaces, page faults */
    for (int r = 0; r < a.reps; r++)
        for (int s = 0; s < 2; s++) {
            if ((t[s].took[r] = run_waves(&b, sizes[s], (int)a.images)) < 0)
                return 1;
            t[s].step[r] = median(b.step_s, b.n_step);
            for (int i = 0; i < b.n_scales; i++)
                t[s].scale[i] += b.scale_s[i] / b.waves;
            t[s].n_scales = b.n_scales;
            t[s].decode[r] = median(b.decode_s, b.n_decode);
            const backend_stats_t zero = {0};
            backend_stats_add(&t[s].counts, &b.step_counts, &zero);
            t[s].steps += b.counted_steps;
            backend_stats_t st;
            if (r == 0 && backend_stats(be, &st))
                t[s].device_peak = st.device_peak_bytes;
        }
    /* After the runs: the device copy's buffers must not count in their peak. */
    roofline_t rl = {.on = b.is_raster && a.measure != 1, .device = b.has_stats};
    if (rl.on) {
        rl.weight_bytes = raster_step_weight_bytes(&raster_net_of(&b.m)->lm);
        rl.weight_elems = raster_step_weight_elems(&raster_net_of(&b.m)->lm);
        rl.bw =
            rl.device ? device_copy_bandwidth(be, &rl.copy_bytes) : read_bandwidth((int)a.threads);
        rl.peak = rl.device ? 0 : fma_peak((int)a.threads);
        if (rl.device && rl.bw <= 0) {
            fprintf(stderr,
                    "speed_bench: no room on the device for two %.0f MiB buffers to "
                    "measure its bandwidth\n",
                    DEVICE_COPY_MIN_BYTES / 1048576.0);
            return 1;
        }
    }
    cJSON *o = report_head(&b, &a, kv_dtype, kv_mib, &rl);
    cJSON *rows = cJSON_GetObjectItemCaseSensitive(o, "batches");
    if (!a.json && timed)
        printf("%s on the %s backend: %lld images per wave set, %lld sets each, %lld thread(s), "
               "KV %.2f MiB per image (full cache, %s)\n",
               b.m.cfg.name, be->name, a.images, a.reps, a.threads, kv_mib,
               planner_kv_dtype_name(kv_dtype));
    if (!a.json && timed && a.steps)
        printf("waves cut at %lld steps past the prompt: no image drawn, images/s is waves of "
               "that many steps\n",
               a.steps);
    double ips[2];
    for (int s = 0; timed && s < 2; s++)
        ips[s] = report_row(&a, sizes[s], &t[s], &rl, b.has_stats, rows);
    if (a.json) {
        char *text = cJSON_PrintUnformatted(o);
        printf("%s\n", text ? text : "{}");
        free(text);
    } else {
        if (rl.on && rl.device)
            printf("roofline: device copy bandwidth: %.1f MiB of weights per step at %.1f GB/s "
                   "(a %.0f MiB device-to-device copy, bytes read and written); no compute "
                   "roofline on a device\n",
                   rl.weight_bytes / 1048576.0, rl.bw / 1e9, rl.copy_bytes / 1048576.0);
        else if (rl.on)
            printf("roofline: CPU read bandwidth: %.1f MiB of weights per step at %.1f GB/s read; "
                   "%.1f M multiply-adds per row at %.1f GFLOP/s (%s FMA peak)\n",
                   rl.weight_bytes / 1048576.0, rl.bw / 1e9, rl.weight_elems / 1e6, rl.peak / 1e9,
                   vec_isa_name(vec_isa()));
        if (timed)
            printf("batch %d / batch 1: %.2fx\n", sizes[1], ips[1] / ips[0]);
    }
    cJSON_Delete(o);
    bench_close(&b);
    be->destroy(be);
    return 0;
}
