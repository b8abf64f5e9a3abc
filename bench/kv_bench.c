/* The measuring half of `make bench-kv`: for each row (a KV policy, budget
 * and knobs) it drives image requests through the KV planner and the paged
 * pool the way the daemon's scheduler does (FIFO admission of whole
 * trajectories into one fixed pool, one gen_step per iteration over every
 * running image, decode when an image is done), writes the PNGs, and
 * prints one JSON document of measurements; bench/kv_bench.py scores the
 * PNGs and prints the table.
 *
 *   build/kv_bench --model DIR --prompts FILE --out DIR [--pool-images N]
 *                  [--threads N] [--waves N] [--fallback POLICY:KNOBS]... --row SPEC...
 *
 * SPEC is `full` or POLICY:BUDGET[:knob=value,...] (budget 0.25 or 1/4);
 * --fallback POLICY:knob=value,... gives the knobs a row of that policy
 * runs with when its own do not fit the model (the row says so). FILE holds
 * one "id<TAB>seed<TAB>prompt" per line. Per row, two runs:
 *   quality:  every prompt with its seed, continuous batching into the
 *             pool; PNGs go to OUT/<row>/<id>.png;
 *   capacity: copies of the reference prompt (the prompts' median length)
 *             admitted into the empty pool until the planner refuses one:
 *             that count is the concurrency; the images/s of running them
 *             to the end (steps and decodes, no PNG encoding), --waves
 *             (default 2) times over, is the speed.
 * The pool holds N (default 2) full-cache images of the reference prompt.
 * Checks, in both runs: every image's measured peak (its blocks after a
 * step's appends, gen_request_t.kv_peak_blocks) equals its planned peak, and
 * at every iteration the pool's high-water mark equals the planner's
 * reservation. Both are exact for a policy whose plan is
 * (kv_policy_plan_exact). A worst-case plan's peak is exact where
 * kv_policy_peak_exact says so (HeadKV's, every head planned global, when
 * it comes before heads are grouped: the table's rows), else a bound
 * (`<=`); the pool's use per iteration is always a bound under a
 * worst-case plan, since some heads hold less than it.
 * Exit status: 0; 1 on an error; 3 when a check failed (the JSON says where). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/clock.h"
#include "base/text.h"
#include "cli/flags.h"
#include "engine/batcher.h"
#include "engine/format/png_io.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "engine/policy/kv_policy.h"

#define MAX_ROWS 64
#define MAX_PROMPTS 4096
#define MAX_CAPACITY 4096 /* images the capacity run may admit */

typedef struct prompt {
    int id;
    uint64_t seed;
    char *text;
    int n_prompt;
    int *cond, *uncond;
} prompt_t;

typedef struct row {
    char spec[256], name[64];
    kv_policy_params_t p;
    unsigned char knobs_set[KV_POLICY_N_KNOBS]; /* 1: kv_policy_knobs[i] given in the spec */
} row_t;

typedef struct bench {
    model_t model;
    kv_pool_t pool;
    int steps, block_tokens, width, height;
    size_t block_bytes, pool_bytes;
    prompt_t *prompts;
    int n_prompts, ref; /* ref: index of the reference prompt */
    int waves;          /* capacity run: times the pool is filled and run to the end */
    int fills;          /* sustained run: pool-fills of copies queued at once */
    const char *out_dir;
} bench_t;

/* One image of a run: a one-image job of the batcher. */
typedef struct item {
    const prompt_t *prompt;
    size_t *traj; /* planned bytes per step */
    size_t planned_peak;
    gen_job_t gen;
    uint64_t id;
} item_t;

/* What a run measured. */
typedef struct run_result {
    int images, admitted_first; /* images run; admitted at the first iteration */
    int peak_mismatches, step_mismatches, iterations;
    long long image_iterations; /* images stepped, summed over iterations */
    size_t max_measured_peak, max_planned_peak;
    double wall_s;
    cJSON *images_json; /* quality run: per image */
} run_result_t;

static void usage(FILE *f, const cli_flag_t *flags) {
    fprintf(f, "usage: kv_bench --model DIR --prompts FILE --out DIR [--pool-images N] "
               "[--threads N] [--waves N]\n"
               "                [--fallback POLICY:knob=v,...]... --row SPEC...\n"
               "SPEC: full | POLICY:BUDGET[:knob=v,...]   (budget 0.25 or 1/4)\n\n");
    cli_flags_usage(f, flags);
}

/* ---- parsing ---- */

static int parse_budget(const char *s, double *out) {
    return text_parse_real(s, out) == NUMBER_OK && *out > 0 && *out <= 1;
}

/* "knob=v,knob=v" onto p, set[i] = 1 for each knob set; AR_ERR on a bad one. */
static int parse_knobs(const char *s, kv_policy_kind_t kind, kv_policy_params_t *p,
                       unsigned char *set, const char *what) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            fprintf(stderr, "kv_bench: %s: '%s' is not knob=value\n", what, tok);
            return AR_ERR;
        }
        *eq = 0;
        const kv_policy_knob_t *k = kv_policy_knob_find(tok);
        double v;
        if (!k || !kv_policy_knob_of(k, kind)) {
            fprintf(stderr, "kv_bench: %s: '%s' is not a knob of %s\n", what, tok,
                    kv_policy_name(kind));
            return AR_ERR;
        }
        if (text_parse_real(eq + 1, &v) != NUMBER_OK || !kv_policy_knob_ok(k, v)) {
            fprintf(stderr, "kv_bench: %s: bad value for %s\n", what, tok);
            return AR_ERR;
        }
        kv_policy_knob_set(p, k, v);
        set[k - kv_policy_knobs] = 1;
    }
    return AR_OK;
}

static int parse_row(const char *spec, row_t *r) {
    memset(r, 0, sizeof *r);
    snprintf(r->spec, sizeof r->spec, "%s", spec);
    char buf[256];
    snprintf(buf, sizeof buf, "%s", spec);
    char *budget = strchr(buf, ':'), *knobs = NULL;
    if (budget) {
        *budget++ = 0;
        if ((knobs = strchr(budget, ':')))
            *knobs++ = 0;
    }
    int kind = kv_policy_parse(buf);
    if (kind < 0) {
        fprintf(stderr, "kv_bench: --row %s: unknown policy '%s'\n", spec, buf);
        return AR_ERR;
    }
    kv_policy_defaults(&r->p, (kv_policy_kind_t)kind);
    if (kind == KV_POLICY_FULL) {
        if (budget) {
            fprintf(stderr, "kv_bench: --row %s: full takes no budget\n", spec);
            return AR_ERR;
        }
        snprintf(r->name, sizeof r->name, "full");
        return AR_OK;
    }
    if (!budget || !parse_budget(budget, &r->p.budget)) {
        fprintf(stderr, "kv_bench: --row %s: needs a budget in (0, 1]\n", spec);
        return AR_ERR;
    }
    if (knobs && parse_knobs(knobs, (kv_policy_kind_t)kind, &r->p, r->knobs_set, spec) != AR_OK)
        return AR_ERR;
    snprintf(r->name, sizeof r->name, "%.16s-%.24s%s", buf, budget, knobs ? "-knobs" : "");
    for (char *c = r->name; *c; c++)
        if (*c == '/')
            *c = '_';
    return AR_OK;
}

static int read_prompts(bench_t *b, const char *path) {
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "kv_bench: %s: %s\n", path, strerror(errno));
        return AR_ERR;
    }
    b->prompts = calloc(MAX_PROMPTS, sizeof *b->prompts);
    char line[4096];
    int rc = AR_OK;
    while (b->prompts && fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0])
            continue;
        char *t1 = strchr(line, '\t'), *t2 = t1 ? strchr(t1 + 1, '\t') : NULL;
        if (!t2 || b->n_prompts == MAX_PROMPTS) {
            fprintf(stderr, "kv_bench: %s: a line is not id<TAB>seed<TAB>prompt\n", path);
            rc = AR_ERR;
            break;
        }
        prompt_t *p = &b->prompts[b->n_prompts++];
        p->id = atoi(line);
        p->seed = strtoull(t1 + 1, NULL, 10);
        p->text = strdup(t2 + 1);
    }
    fclose(f);
    if (!b->prompts || (rc == AR_OK && b->n_prompts == 0)) {
        fprintf(stderr, "kv_bench: %s: no prompts\n", path);
        return AR_ERR;
    }
    return rc;
}

/* ---- planning ---- */

/* The plan of one image of prompt p under pol (whose knobs suit it: the
 * row checked them); NULL with err set otherwise. */
static size_t *plan(const bench_t *b, const kv_policy_params_t *pol, const prompt_t *p,
                    size_t *peak, ar_error_t *err) {
    planner_plan_t pl;
    if (planner_plan(&pl, &b->model.cfg, pol, p->n_prompt, b->block_tokens, NULL, err) != AR_OK)
        return NULL;
    size_t *t = pl.bytes; /* taken over */
    *peak = pl.peak_bytes;
    pl.bytes = NULL;
    planner_plan_free(&pl);
    return t;
}

/* Is the planned peak of pol exact for prompt p (see the top of the file)? */
static int plan_is_exact(const bench_t *b, const kv_policy_params_t *pol, const prompt_t *p) {
    kv_geometry_t g;
    model_geometry(&b->model.cfg, p->n_prompt, &g);
    return kv_policy_peak_exact(pol, &g);
}

/* ---- runs ---- */

/* One run over the batcher. */
typedef struct runner {
    bench_t *b;
    batcher_t *batcher;
    item_t *items;
    int n;
    int exact, step_exact;
    const char *png_dir; /* the quality run writes every image there */
    uint8_t *rgb;
    run_result_t *res;
} runner_t;

static item_t *item_of(runner_t *r, void *work) {
    return (item_t *)((char *)work - offsetof(item_t, gen));
}

/* A finished image: its measured peak against its plan, then decoded (and
 * written, in the quality run). */
static int item_finished(runner_t *r, item_t *it, ar_error_t *err) {
    run_result_t *res = r->res;
    const size_t peak = (size_t)it->gen.images[0].kv_peak_blocks * r->b->block_bytes;
    if (r->exact ? peak != it->planned_peak : peak > it->planned_peak) {
        if (res->peak_mismatches++ == 0)
            fprintf(stderr, "kv_bench: prompt %d: measured peak %zu bytes, planned %zu\n",
                    it->prompt->id, peak, it->planned_peak);
    }
    res->max_measured_peak = peak > res->max_measured_peak ? peak : res->max_measured_peak;
    res->max_planned_peak =
        it->planned_peak > res->max_planned_peak ? it->planned_peak : res->max_planned_peak;
    res->images++;
    if (gen_decode(&it->gen.images[0], r->rgb, err) != AR_OK)
        return AR_ERR;
    if (!r->png_dir)
        return AR_OK;
    char path[2048];
    snprintf(path, sizeof path, "%s/%05d.png", r->png_dir, it->prompt->id);
    if (png_write_file(path, r->rgb, r->b->width, r->b->height, err) != AR_OK)
        return AR_ERR;
    cJSON *o = cJSON_CreateObject();
    cJSON_AddNumberToObject(o, "id", it->prompt->id);
    cJSON_AddNumberToObject(o, "n_prompt", it->prompt->n_prompt);
    cJSON_AddNumberToObject(o, "planned_peak_bytes", (double)it->planned_peak);
    cJSON_AddNumberToObject(o, "peak_bytes", (double)peak);
    cJSON_AddItemToArray(res->images_json, o);
    return AR_OK;
}

/* Handles the batcher's events; *admitted counts the admissions. */
static int handle_events(runner_t *r, int *admitted, ar_error_t *err) {
    batcher_event_t ev[256];
    int n, rc = AR_OK;
    while ((n = batcher_take_events(r->batcher, ev, 256)) > 0)
        for (int i = 0; i < n; i++) {
            item_t *it = item_of(r, ev[i].work);
            if (ev[i].type == BATCHER_ADMITTED && admitted)
                (*admitted)++;
            if (ev[i].type != BATCHER_ENDED)
                continue;
            if (ev[i].end == BATCHER_END_FAILED)
                rc = ar_errorf(err, "prompt %d: %s", it->prompt->id, ev[i].why);
            else if (ev[i].end == BATCHER_END_FINISHED && rc == AR_OK)
                rc = item_finished(r, it, err);
            gen_job_free(&it->gen);
        }
    return rc;
}

/* After a step: the pool's high-water mark against the planner's
 * reservation (equal when the plans are exact step by step). */
static void check_step(runner_t *r) {
    batcher_stats_t st;
    batcher_stats(r->batcher, &st);
    r->res->iterations++;
    r->res->image_iterations += st.last_images;
    const size_t measured = st.last_kv_peak_bytes, planned = st.last_reserved_bytes;
    if (r->step_exact ? measured != planned : measured > planned) {
        if (r->res->step_mismatches++ == 0)
            fprintf(stderr, "kv_bench: iteration %lld: pool peak %zu bytes, planned %zu\n",
                    st.iterations - 1, measured, planned);
    }
}

/* One step of the batch batcher_admit fixed, then its events. */
static int step_batch(runner_t *r, ar_error_t *err) {
    const int rc = batcher_step(r->batcher, err);
    batcher_finish(r->batcher, rc, err);
    if (rc == AR_OK)
        check_step(r);
    const int events_rc = handle_events(r, NULL, err);
    return rc != AR_OK ? AR_ERR : events_rc;
}

/* Iterates until nothing runs; *admitted (may be NULL) counts the jobs the
 * first iteration admits. */
static int run_to_end(runner_t *r, int *admitted, ar_error_t *err) {
    for (int first = 1;; first = 0) {
        const int n = batcher_admit(r->batcher, 0);
        if (handle_events(r, first ? admitted : NULL, err) != AR_OK)
            return AR_ERR;
        if (n == 0)
            return AR_OK;
        if (step_batch(r, err) != AR_OK)
            return AR_ERR;
    }
}

static int submit_item(runner_t *r, item_t *it, ar_error_t *err) {
    batcher_job_t j = {.n_images = 1,
                       .steps = r->b->steps,
                       .kv_bytes = it->traj,
                       .deadline = INFINITY,
                       .work = &it->gen};
    batcher_refusal_t why = batcher_submit(r->batcher, &j, &it->id);
    if (why != BATCHER_ACCEPTED)
        return ar_errorf(err, "an image of prompt %d is refused: %s", it->prompt->id,
                         batcher_refusal_name(why));
    return AR_OK;
}

/* The quality (and sustained) run: every item queued at once, continuous
 * FIFO admission. */
static int run_quality(runner_t *r, ar_error_t *err) {
    for (int i = 0; i < r->n; i++)
        if (submit_item(r, &r->items[i], err) != AR_OK)
            return AR_ERR;
    if (run_to_end(r, &r->res->admitted_first, err) != AR_OK)
        return AR_ERR;
    return r->res->admitted_first ? AR_OK : ar_errorf(err, "no image fits the empty pool");
}

/* The capacity run: waves times, the empty pool filled with as many items
 * as fit (the concurrency), run to the end; items left over wait for the
 * next wave. */
static int run_capacity(runner_t *r, int waves, ar_error_t *err) {
    int next = 0;
    for (int w = 0; w < waves && next < r->n; w++) {
        for (int i = next; i < r->n; i++)
            if (submit_item(r, &r->items[i], err) != AR_OK)
                return AR_ERR;
        batcher_admit(r->batcher, 0);
        int admitted = 0;
        if (handle_events(r, &admitted, err) != AR_OK)
            return AR_ERR;
        if (w == 0)
            r->res->admitted_first = admitted;
        for (int i = next + admitted; i < r->n; i++)
            batcher_cancel(r->batcher, r->items[i].id, BATCHER_END_CANCELLED);
        next += admitted;
        if (admitted == 0)
            return ar_errorf(err, "no image fits the empty pool");
        if (step_batch(r, err) != AR_OK || run_to_end(r, NULL, err) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

/* Runs items[0..n) through the batcher into the pool. exact: the plans are
 * exact (else bounds). waves > 0: the capacity run; 0: the quality run,
 * writing each image to png_dir (or, png_dir NULL, the sustained run: all
 * queued at once, continuous admission). tighten 0: plans never tighten. */
static int run(bench_t *b, const kv_policy_params_t *pol, int exact, item_t *items, int n,
               int waves, const char *png_dir, int tighten, run_result_t *res, ar_error_t *err) {
    memset(res, 0, sizeof *res);
    batcher_options_t bo = {
        .pool_bytes = b->pool_bytes, .max_running = MAX_CAPACITY, .max_waiting = n};
    kv_geometry_t geo;
    model_geometry(&b->model.cfg, items[0].prompt->n_prompt, &geo);
    runner_t r = {.b = b,
                  .items = items,
                  .n = n,
                  .exact = exact,
                  /* Layered requests at different steps peak at different
                   * layers: the pool's peak is then below the plans' sum. */
                  .step_exact = exact && kv_policy_plan_exact(pol->kind) &&
                                (waves > 0 || !kv_policy_kind_layered(pol->kind, &geo)),
                  .png_dir = png_dir,
                  .rgb = malloc((size_t)b->width * b->height * 3),
                  .res = res};
    for (int i = 0; i < n; i++)
        items[i].gen = (gen_job_t){.model = &b->model,
                                   .cond = items[i].prompt->cond,
                                   .uncond = items[i].prompt->uncond,
                                   .n_prompt = items[i].prompt->n_prompt,
                                   .n_images = 1,
                                   .params = b->model.cfg.sampling,
                                   .seed = items[i].gen.seed,
                                   .policy = *pol};
    if (png_dir)
        res->images_json = cJSON_CreateArray();
    batcher_ops_t ops = gen_batcher_ops;
    if (!tighten)
        ops.remaining = NULL; /* every request keeps its admission-time plan */
    r.batcher = batcher_create(&bo, &ops, &b->pool, err);
    int rc = r.batcher && r.rgb ? AR_OK : AR_ERR;
    if (!r.rgb)
        ar_errorf(err, "out of memory");
    const double t0 = clock_now_s();
    if (rc == AR_OK)
        rc = waves ? run_capacity(&r, waves, err) : run_quality(&r, err);
    res->wall_s = clock_now_s() - t0;
    batcher_destroy(r.batcher);
    for (int i = 0; i < n; i++)
        gen_job_free(&items[i].gen);
    free(r.rgb);
    return rc;
}

static void free_items(item_t *items, int n) {
    for (int i = 0; items && i < n; i++)
        free(items[i].traj);
    free(items);
}

/* The row's knobs, else its policy's fallback knobs, must suit every
 * prompt: 1 when they do (r->p holds the knobs run with), else 0 and the
 * policy's message in why. The row's JSON says which knobs ran. */
static int row_knobs_fit(const bench_t *b, row_t *r, const row_t *fallbacks, int n_fallbacks,
                         cJSON *o, ar_error_t *why) {
    int fits = 1, scaled = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        fits = 1;
        for (int i = 0; i < b->n_prompts && fits; i++) {
            kv_geometry_t g;
            model_geometry(&b->model.cfg, b->prompts[i].n_prompt, &g);
            fits = kv_policy_check(&r->p, &g, NULL, why) == AR_OK;
        }
        if (fits || attempt == 1)
            break;
        const row_t *fb = NULL;
        for (int i = 0; i < n_fallbacks; i++)
            if (fallbacks[i].p.kind == r->p.kind)
                fb = &fallbacks[i];
        if (!fb)
            break;
        cJSON_AddStringToObject(o, "defaults_refused", why->msg);
        for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
            if (fb->knobs_set[i] && !r->knobs_set[i])
                kv_policy_knob_set(&r->p, &kv_policy_knobs[i],
                                   kv_policy_knob_get(&fb->p, &kv_policy_knobs[i]));
        scaled = 1;
    }
    cJSON_AddBoolToObject(o, "scaled", scaled);
    cJSON *knobs = cJSON_AddObjectToObject(o, "knobs");
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        if (kv_policy_knob_of(&kv_policy_knobs[i], r->p.kind))
            cJSON_AddNumberToObject(knobs, kv_policy_knobs[i].name,
                                    kv_policy_knob_get(&r->p, &kv_policy_knobs[i]));
    return fits;
}

/* The quality run of a row: every prompt, its PNGs in the row's folder. */
static int row_quality(bench_t *b, const row_t *r, int exact, cJSON *o, run_result_t *q,
                       ar_error_t *err) {
    char dir[2048];
    snprintf(dir, sizeof dir, "%s/%s", b->out_dir, r->name);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return ar_errorf(err, "%s: %s", dir, strerror(errno));
    cJSON_AddStringToObject(o, "dir", dir);
    item_t *items = calloc((size_t)b->n_prompts, sizeof *items);
    int ok = items != NULL;
    for (int i = 0; ok && i < b->n_prompts; i++) {
        items[i].prompt = &b->prompts[i];
        items[i].gen.seed = b->prompts[i].seed;
        ok = (items[i].traj = plan(b, &r->p, &b->prompts[i], &items[i].planned_peak, err)) != NULL;
    }
    int rc = ok ? run(b, &r->p, exact, items, b->n_prompts, 0, dir, 1, q, err) : AR_ERR;
    free_items(items, b->n_prompts);
    if (rc == AR_OK) {
        cJSON_AddItemToObject(o, "images", q->images_json);
        cJSON_AddNumberToObject(o, "quality_wall_s", q->wall_s);
    } else {
        cJSON_Delete(q->images_json);
    }
    q->images_json = NULL;
    return rc;
}

/* Copies of the reference prompt: the capacity run of a row (waves > 0),
 * or n of them queued at once (the sustained run, waves 0; tighten 0: plans
 * never tighten). */
static int row_copies(bench_t *b, const row_t *r, int exact, int n, int waves, int tighten,
                      run_result_t *c, ar_error_t *err) {
    const prompt_t *ref = &b->prompts[b->ref];
    item_t *items = calloc(MAX_CAPACITY, sizeof *items);
    size_t ref_peak = 0, *traj = plan(b, &r->p, ref, &ref_peak, err);
    int ok = items && traj;
    for (int i = 0; ok && i < MAX_CAPACITY; i++) {
        items[i].prompt = ref;
        items[i].gen.seed = 1000003u * (uint64_t)(i + 1);
        ok = (items[i].traj = malloc((size_t)b->steps * sizeof *traj)) != NULL;
        if (ok) {
            memcpy(items[i].traj, traj, (size_t)b->steps * sizeof *traj);
            items[i].planned_peak = ref_peak;
        }
    }
    free(traj);
    int rc =
        ok ? run(b, &r->p, exact, items, waves ? MAX_CAPACITY : n, waves, NULL, tighten, c, err)
           : AR_ERR;
    free_items(items, MAX_CAPACITY);
    if (rc == AR_OK && waves && c->admitted_first * waves >= MAX_CAPACITY)
        fprintf(stderr, "kv_bench: %s: the capacity run hit its cap of %d images\n", r->name,
                MAX_CAPACITY);
    return rc;
}

/* One row: both runs. Returns its JSON (error rows included), or NULL with
 * err set on a failure that is not the row's policy refusing the model. */
static cJSON *bench_row(bench_t *b, row_t *r, const row_t *fallbacks, int n_fallbacks,
                        int *checks_failed, ar_error_t *err) {
    cJSON *o = cJSON_CreateObject();
    cJSON_AddStringToObject(o, "name", r->name);
    cJSON_AddStringToObject(o, "spec", r->spec);
    cJSON_AddStringToObject(o, "policy", kv_policy_name(r->p.kind));
    if (r->p.kind != KV_POLICY_FULL)
        cJSON_AddNumberToObject(o, "budget", r->p.budget);
    ar_error_t why = {{0}};
    if (!row_knobs_fit(b, r, fallbacks, n_fallbacks, o, &why)) {
        cJSON_AddStringToObject(o, "error", why.msg);
        fprintf(stderr, "kv_bench: %s: %s\n", r->name, why.msg);
        return o;
    }
    /* The reference prompt's trajectory: the tokens of one head at its peak. */
    planner_plan_t pl;
    if (planner_plan(&pl, &b->model.cfg, &r->p, b->prompts[b->ref].n_prompt, b->block_tokens, NULL,
                     err) != AR_OK) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddNumberToObject(o, "peak_tokens_per_head", pl.tokens[pl.peak_step]);
    cJSON_AddNumberToObject(o, "peak_step", pl.peak_step);
    planner_plan_free(&pl);
    int exact = 1;
    for (int i = 0; i < b->n_prompts; i++)
        exact &= plan_is_exact(b, &r->p, &b->prompts[i]);
    cJSON_AddStringToObject(o, "peak_check", exact ? "equal" : "at most");
    /* What the pool's use is held to at every iteration (the policy table's
     * words, for the table's footnote): the plans' sum where the plan is
     * exact, at most it where it is a worst case; a layered policy's
     * requests at different steps peak at different layers. */
    kv_geometry_t geo;
    model_geometry(&b->model.cfg, b->prompts[b->ref].n_prompt, &geo);
    cJSON_AddBoolToObject(o, "plan_exact", kv_policy_plan_exact(r->p.kind));
    cJSON_AddBoolToObject(o, "layered", kv_policy_kind_layered(r->p.kind, &geo));
    run_result_t q = {0}, c = {0}, tight = {0}, loose = {0};
    if (row_quality(b, r, exact, o, &q, err) != AR_OK ||
        row_copies(b, r, exact, 0, b->waves, 1, &c, err) != AR_OK) {
        cJSON_Delete(o);
        return NULL;
    }
    /* Sustained concurrency: pool-fills queued at once, with plans that
     * tighten as requests run and without. */
    const int n_sustained =
        c.admitted_first * b->fills < MAX_CAPACITY ? c.admitted_first * b->fills : MAX_CAPACITY;
    if (row_copies(b, r, exact, n_sustained, 0, 1, &tight, err) != AR_OK ||
        row_copies(b, r, exact, n_sustained, 0, 0, &loose, err) != AR_OK) {
        cJSON_Delete(o);
        return NULL;
    }
    cJSON_AddNumberToObject(o, "sustained_images", n_sustained);
    cJSON_AddNumberToObject(o, "sustained_running_tight",
                            tight.iterations ? (double)tight.image_iterations / tight.iterations
                                             : 0);
    cJSON_AddNumberToObject(o, "sustained_running_plan",
                            loose.iterations ? (double)loose.image_iterations / loose.iterations
                                             : 0);
    cJSON_AddNumberToObject(o, "sustained_iterations_tight", tight.iterations);
    cJSON_AddNumberToObject(o, "sustained_iterations_plan", loose.iterations);
    cJSON_AddNumberToObject(o, "planned_peak_bytes", (double)c.max_planned_peak);
    cJSON_AddNumberToObject(o, "measured_peak_bytes", (double)c.max_measured_peak);
    cJSON_AddNumberToObject(o, "admitted", c.admitted_first);
    cJSON_AddNumberToObject(o, "capacity_wall_s", c.wall_s);
    cJSON_AddNumberToObject(o, "images_per_s", c.wall_s > 0 ? c.images / c.wall_s : 0);
    int peak_bad =
        q.peak_mismatches + c.peak_mismatches + tight.peak_mismatches + loose.peak_mismatches;
    int step_bad =
        q.step_mismatches + c.step_mismatches + tight.step_mismatches + loose.step_mismatches;
    cJSON_AddNumberToObject(o, "peak_mismatches", peak_bad);
    cJSON_AddNumberToObject(o, "step_mismatches", step_bad);
    cJSON_AddNumberToObject(o, "iterations", q.iterations + c.iterations);
    *checks_failed += peak_bad + step_bad;
    fprintf(stderr, "kv_bench: %-34s %2d admitted, %6.2f images/s, %4.1f + %4.1f s%s\n", r->name,
            c.admitted_first, c.wall_s > 0 ? c.images / c.wall_s : 0, q.wall_s, c.wall_s,
            peak_bad + step_bad ? ", CHECKS FAILED" : "");
    return o;
}

/* The prompt of median length (ties: the first), so the capacity run's
 * prefix is typical of the set. */
static int median_prompt(const bench_t *b) {
    int *idx = malloc((size_t)b->n_prompts * sizeof *idx), best = 0;
    if (!idx)
        return 0;
    for (int i = 0; i < b->n_prompts; i++)
        idx[i] = i;
    for (int i = 1; i < b->n_prompts; i++) /* insertion sort by (n_prompt, position) */
        for (int j = i; j > 0 && b->prompts[idx[j - 1]].n_prompt > b->prompts[idx[j]].n_prompt;
             j--) {
            int t = idx[j];
            idx[j] = idx[j - 1];
            idx[j - 1] = t;
        }
    best = idx[(b->n_prompts - 1) / 2];
    free(idx);
    return best;
}

/* The rows and fallbacks of the command line (CLI_EACH flags). */
typedef struct specs {
    row_t rows[MAX_ROWS], fallbacks[4];
    int n_rows, n_fallbacks;
} specs_t;

static int add_row(void *dest, const char *spec) {
    specs_t *sp = dest;
    if (sp->n_rows == MAX_ROWS) {
        fprintf(stderr, "kv_bench: more than %d rows\n", MAX_ROWS);
        return 2;
    }
    return parse_row(spec, &sp->rows[sp->n_rows++]) != AR_OK ? 2 : 0;
}

/* POLICY:knobs is a row spec with a placeholder budget. */
static int add_fallback(void *dest, const char *value) {
    specs_t *sp = dest;
    char spec[300];
    const char *colon = strchr(value, ':');
    if (!colon || sp->n_fallbacks == 4) {
        fprintf(stderr, "kv_bench: --fallback %s: POLICY:knob=v,... (at most 4)\n", value);
        return 2;
    }
    snprintf(spec, sizeof spec, "%.*s:1:%s", (int)(colon - value), value, colon + 1);
    return parse_row(spec, &sp->fallbacks[sp->n_fallbacks++]) != AR_OK ? 2 : 0;
}

/* The model, its prompts' rows, the reference prompt and the pool. */
static int bench_load(bench_t *b, const char *model_dir, const char *prompts_path, backend_t *be,
                      double pool_images) {
    ar_error_t err = {{0}};
    if (read_prompts(b, prompts_path) != AR_OK)
        return AR_ERR;
    if (model_load(&b->model, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "kv_bench: cannot load model: %s\n", err.msg);
        return AR_ERR;
    }
    const model_config_t *cfg = &b->model.cfg;
    b->steps = model_steps(cfg);
    b->block_tokens = planner_block_tokens(cfg);
    b->block_bytes = kv_pool_block_bytes(b->block_tokens, cfg->llm.head_dim, DTYPE_F32);
    b->width = model_config_image_width(cfg);
    b->height = model_config_image_height(cfg);
    for (int i = 0; i < b->n_prompts; i++) {
        prompt_t *p = &b->prompts[i];
        p->cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
        p->uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
        /* A class-conditional model without class names takes its class
         * as an index (kv_bench.py writes one for LlamaGen models). */
        char *end = NULL;
        const long label = strtol(p->text, &end, 10);
        const int by_index = model_is_class_conditional(&b->model) &&
                             model_class_find(&b->model, p->text) < 0 && end != p->text && !*end;
        if (!p->cond || !p->uncond ||
            (by_index ? model_prompt_from_class(&b->model, (int)label, p->cond, p->uncond,
                                                &p->n_prompt, &err)
                      : model_prompt_from_text(&b->model, p->text, p->cond, p->uncond, &p->n_prompt,
                                               &err)) != AR_OK) {
            fprintf(stderr, "kv_bench: prompt %d: %s\n", p->id, p->cond ? err.msg : "no memory");
            return AR_ERR;
        }
    }
    b->ref = median_prompt(b);
    /* The pool: pool_images full-cache images of the reference prompt,
     * in whole blocks (a full-cache image's peak is whole blocks). */
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    size_t full_peak = 0, *ft = plan(b, &full, &b->prompts[b->ref], &full_peak, &err);
    if (!ft) {
        fprintf(stderr, "kv_bench: %s\n", err.msg);
        return AR_ERR;
    }
    free(ft);
    size_t n_blocks = (size_t)floor(pool_images * (double)(full_peak / b->block_bytes));
    if (kv_pool_init(&b->pool, be, (int)n_blocks, b->block_tokens, cfg->llm.head_dim, DTYPE_F32,
                     &err) != AR_OK) {
        fprintf(stderr, "kv_bench: %s\n", err.msg);
        return AR_ERR;
    }
    b->pool_bytes = kv_pool_capacity_bytes(&b->pool);
    if (mkdir(b->out_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kv_bench: %s: %s\n", b->out_dir, strerror(errno));
        return AR_ERR;
    }
    return AR_OK;
}

/* Every row, as the JSON document the script reads; NULL on an error. */
static cJSON *bench_rows(bench_t *b, specs_t *sp, double pool_images, int threads,
                         int *checks_failed) {
    const model_config_t *cfg = &b->model.cfg;
    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "model", cfg->name);
    cJSON_AddNumberToObject(doc, "grid_width", cfg->image.grid_width);
    cJSON_AddNumberToObject(doc, "grid_height", cfg->image.grid_height);
    cJSON_AddNumberToObject(doc, "n_scales", cfg->image.n_scales);
    cJSON_AddNumberToObject(doc, "width", b->width);
    cJSON_AddNumberToObject(doc, "block_tokens", b->block_tokens);
    cJSON_AddNumberToObject(doc, "pool_bytes", (double)b->pool_bytes);
    cJSON_AddNumberToObject(doc, "pool_images", pool_images);
    cJSON_AddNumberToObject(doc, "threads", threads);
    cJSON_AddNumberToObject(doc, "waves", b->waves);
    cJSON *refj = cJSON_AddObjectToObject(doc, "reference_prompt");
    cJSON_AddNumberToObject(refj, "id", b->prompts[b->ref].id);
    cJSON_AddStringToObject(refj, "text", b->prompts[b->ref].text);
    cJSON_AddNumberToObject(refj, "n_prompt", b->prompts[b->ref].n_prompt);
    cJSON *rows_json = cJSON_AddArrayToObject(doc, "rows");
    const double t0 = clock_now_s();
    for (int i = 0; i < sp->n_rows; i++) {
        ar_error_t err = {{0}};
        cJSON *r = bench_row(b, &sp->rows[i], sp->fallbacks, sp->n_fallbacks, checks_failed, &err);
        if (!r) {
            fprintf(stderr, "kv_bench: %s: %s\n", sp->rows[i].spec, err.msg);
            cJSON_Delete(doc);
            return NULL;
        }
        cJSON_AddItemToArray(rows_json, r);
    }
    cJSON_AddNumberToObject(doc, "wall_s", clock_now_s() - t0);
    cJSON_AddNumberToObject(doc, "checks_failed", *checks_failed);
    return doc;
}

static void bench_free(bench_t *b) {
    if (b->pool.bad_frees)
        fprintf(stderr, "kv_bench: %lld blocks released twice\n", b->pool.bad_frees);
    kv_pool_free(&b->pool);
    for (int i = 0; i < b->n_prompts; i++) {
        free(b->prompts[i].text);
        free(b->prompts[i].cond);
        free(b->prompts[i].uncond);
    }
    free(b->prompts);
    model_free(&b->model);
}

int main(int argc, char **argv) {
    const char *model_dir = NULL, *prompts_path = NULL;
    static specs_t sp;
    long long threads = 0, waves = 2, fills = 4;
    double pool_images = 2;
    bench_t b = {0};
    const cli_flag_t flags[] = {
        {"model", 0, CLI_STRING, &model_dir, .metavar = "DIR", .help = "the model directory"},
        {"prompts", 0, CLI_STRING, &prompts_path, .metavar = "FILE",
         .help = "one id<TAB>seed<TAB>prompt per line"},
        {"out", 0, CLI_STRING, &b.out_dir, .metavar = "DIR", .help = "where the PNGs go"},
        {"pool-images", 0, CLI_REAL, &pool_images, 0, 4096, 1, .metavar = "N",
         .help = "full-cache images of the reference prompt the pool holds (default 2)"},
        {"threads", 0, CLI_INT, &threads, 0, 1024, .metavar = "N",
         .help = "CPU threads, 0 = every core (default 0)"},
        {"waves", 0, CLI_INT, &waves, 1, 1000, .metavar = "N",
         .help = "fills of the pool timed per row (default 2)"},
        {"fills", 0, CLI_INT, &fills, 1, 64, .metavar = "N",
         .help = "pool-fills queued at once in the sustained runs (default 4)"},
        {"row", 0, CLI_EACH, &sp, .each = add_row, .metavar = "SPEC",
         .help = "full, or POLICY:BUDGET[:knob=v,...]; repeatable"},
        {"fallback", 0, CLI_EACH, &sp, .each = add_fallback, .metavar = "POLICY:KNOBS",
         .help = "the knobs a row of POLICY runs with when its own do not suit the model; "
                 "repeatable"},
        {0}};
    int help = 0, rc = cli_flags_parse("kv_bench", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help) {
        usage(stdout, flags);
        return 0;
    }
    if (!model_dir || !prompts_path || !b.out_dir || sp.n_rows == 0) {
        usage(stderr, flags);
        return 2;
    }
    b.waves = (int)waves;
    b.fills = (int)fills;
    ar_error_t err = {{0}};
    backend_t *be = backend_cpu_create((int)threads, &err);
    if (!be) {
        fprintf(stderr, "kv_bench: %s\n", err.msg);
        return 1;
    }
    int checks_failed = 0;
    cJSON *doc = NULL;
    char *text = NULL;
    rc = 1;
    if (bench_load(&b, model_dir, prompts_path, be, pool_images) == AR_OK &&
        (doc = bench_rows(&b, &sp, pool_images, (int)threads, &checks_failed)) &&
        (text = cJSON_Print(doc))) {
        printf("%s\n", text);
        rc = checks_failed ? 3 : 0;
    } else if (doc) {
        fprintf(stderr, "kv_bench: out of memory\n");
    }
    free(text);
    cJSON_Delete(doc);
    bench_free(&b);
    be->destroy(be);
    return rc;
}
