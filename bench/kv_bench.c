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
 * reservation. Both are exact for full, streaming and linear. HeadKV plans
 * every head as global: an image's peak is exact when it comes before heads
 * are grouped (the table's rows), else a bound (`<=`); the pool's use per
 * iteration is always a bound once heads are grouped, since local heads
 * hold less than the global plan.
 * Exit status: 0; 1 on an error; 3 when a check failed (the JSON says where). */
#include <cjson/cJSON.h>
#include <errno.h>
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "engine/clock.h"
#include "engine/generate.h"
#include "engine/kv_policy.h"
#include "engine/kv_pool.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/png_io.h"

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
    unsigned knobs_set; /* bit i: kv_policy_knobs[i] given in the spec */
} row_t;

typedef struct bench {
    model_t model;
    kv_pool_t pool;
    int steps, block_tokens, width, height;
    size_t block_bytes, pool_bytes;
    prompt_t *prompts;
    int n_prompts, ref; /* ref: index of the reference prompt */
    int waves;          /* capacity run: times the pool is filled and run to the end */
    const char *out_dir;
} bench_t;

/* One image of a run. */
typedef struct item {
    const prompt_t *prompt;
    uint64_t seed;
    size_t *traj; /* planned bytes per step */
    size_t planned_peak;
    gen_request_t g;
    int running;
} item_t;

/* What a run measured. */
typedef struct run_result {
    int images, admitted_first; /* images run; admitted at the first iteration */
    int peak_mismatches, step_mismatches, iterations;
    size_t max_measured_peak, max_planned_peak;
    double wall_s;
    cJSON *images_json; /* quality run: per image */
} run_result_t;

static void usage(FILE *f) {
    fprintf(f, "usage: kv_bench --model DIR --prompts FILE --out DIR [--pool-images N] "
               "[--threads N] [--waves N]\n"
               "                [--fallback POLICY:knob=v,...]... --row SPEC...\n"
               "SPEC: full | POLICY:BUDGET[:knob=v,...]   (budget 0.25 or 1/4)\n");
}

/* ---- parsing ---- */

static int parse_budget(const char *s, double *out) {
    char *end;
    const char *slash = strchr(s, '/');
    if (slash) {
        long num = strtol(s, &end, 10);
        if (end != slash)
            return 0;
        long den = strtol(slash + 1, &end, 10);
        if (*end || den <= 0)
            return 0;
        *out = (double)num / (double)den;
    } else {
        *out = strtod(s, &end);
        if (end == s || *end)
            return 0;
    }
    return *out > 0 && *out <= 1;
}

/* "knob=v,knob=v" onto p; returns the bits of the knobs set, or -1. */
static long long parse_knobs(const char *s, kv_policy_kind_t kind, kv_policy_params_t *p,
                             const char *what) {
    unsigned bits = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *save = NULL, *tok = strtok_r(buf, ",", &save); tok;
         tok = strtok_r(NULL, ",", &save)) {
        char *eq = strchr(tok, '=');
        if (!eq) {
            fprintf(stderr, "kv_bench: %s: '%s' is not knob=value\n", what, tok);
            return -1;
        }
        *eq = 0;
        const kv_policy_knob_t *k = kv_policy_knob_find(tok);
        char *end;
        double v = strtod(eq + 1, &end);
        if (!k || k->policy != kind) {
            fprintf(stderr, "kv_bench: %s: '%s' is not a knob of %s\n", what, tok,
                    kv_policy_name(kind));
            return -1;
        }
        if (end == eq + 1 || *end || !kv_policy_knob_ok(k, v)) {
            fprintf(stderr, "kv_bench: %s: bad value for %s\n", what, tok);
            return -1;
        }
        kv_policy_knob_set(p, k, v);
        bits |= 1u << (k - kv_policy_knobs);
    }
    return bits;
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
    long long bits = knobs ? parse_knobs(knobs, (kv_policy_kind_t)kind, &r->p, spec) : 0;
    if (bits < 0)
        return AR_ERR;
    r->knobs_set = (unsigned)bits;
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

/* Planned bytes per step for one image of prompt p under row r's policy;
 * NULL (err says why, field the setting at fault) when it does not fit. */
static size_t *plan(const bench_t *b, const kv_policy_params_t *pol, const prompt_t *p,
                    ar_error_t *err) {
    size_t *t = malloc((size_t)b->steps * sizeof *t);
    if (!t) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    if (planner_trajectory_bytes(&b->model.cfg, pol, p->n_prompt, b->block_tokens, t, err) !=
        AR_OK) {
        free(t);
        return NULL;
    }
    return t;
}

static size_t peak_of(const size_t *t, int n) {
    size_t m = 0;
    for (int i = 0; i < n; i++)
        m = t[i] > m ? t[i] : m;
    return m;
}

/* Is the plan of pol exact for prompt p (see the top of the file)? */
static int plan_is_exact(const bench_t *b, const kv_policy_params_t *pol, const prompt_t *p) {
    if (pol->kind != KV_POLICY_HEADKV)
        return 1;
    kv_geometry_t g = planner_geometry(&b->model.cfg, p->n_prompt);
    int *tok = malloc((size_t)b->steps * sizeof *tok), first_peak = 0;
    if (!tok || kv_policy_trajectory(pol, &g, tok) != AR_OK) {
        free(tok);
        return 0;
    }
    for (int t = 1; t < b->steps; t++)
        if (tok[t] > tok[first_peak])
            first_peak = t;
    free(tok);
    return first_peak <= pol->headkv_group_tokens;
}

/* ---- runs ---- */

static int start_item(bench_t *b, const kv_policy_params_t *pol, item_t *it, ar_error_t *err) {
    const prompt_t *p = it->prompt;
    if (gen_request_init(&it->g, &b->model, &b->pool, pol, p->cond, p->uncond, p->n_prompt,
                         &b->model.cfg.sampling, it->seed, 0, err) != AR_OK)
        return AR_ERR;
    it->running = 1;
    return AR_OK;
}

/* Runs items[0..n) through the planner and the pool. exact: the plans are
 * exact (else bounds). waves > 0 (the capacity run): admit only into an
 * empty pool, as many as fit (the concurrency), waves times over; 0:
 * continuous FIFO admission of every item. png_dir: write each image there. */
static int run(bench_t *b, const kv_policy_params_t *pol, int exact, item_t *items, int n,
               int waves, const char *png_dir, run_result_t *res, ar_error_t *err) {
    memset(res, 0, sizeof *res);
    planner_t pl;
    planner_init(&pl, b->pool_bytes);
    gen_request_t **batch = malloc((size_t)n * sizeof *batch);
    uint8_t *rgb = malloc((size_t)b->width * b->height * 3);
    int *live = malloc((size_t)n * sizeof *live);
    int next = 0, n_live = 0, rc = AR_OK;
    if (png_dir)
        res->images_json = cJSON_CreateArray();
    if (!batch || !rgb || !live) {
        rc = ar_errorf(err, "out of memory");
        goto out;
    }
    double t0 = clock_now_s();
    int waves_started = 0;
    for (int iter = 0;; iter++) {
        /* FIFO admission, as the scheduler's: the head of the queue waits
         * until its whole trajectory fits beside the running ones. */
        int admit = !waves || (n_live == 0 && waves_started < waves);
        waves_started += waves && admit;
        while (admit && next < n && planner_fits(&pl, items[next].traj, b->steps)) {
            if (planner_add(&pl, (uint64_t)next, items[next].traj, b->steps) != AR_OK ||
                start_item(b, pol, &items[next], err) != AR_OK) {
                rc = AR_ERR;
                goto out;
            }
            live[n_live++] = next++;
        }
        if (iter == 0)
            res->admitted_first = n_live;
        if (n_live == 0) {
            if (next < n && !waves)
                rc = ar_errorf(err, "an image of prompt %d does not fit the empty pool",
                               items[next].prompt->id);
            break;
        }
        for (int i = 0; i < n_live; i++)
            batch[i] = &items[live[i]].g;
        kv_pool_reset_peak(&b->pool);
        if (gen_step(batch, n_live, err) != AR_OK) {
            rc = AR_ERR;
            goto out;
        }
        res->iterations++;
        const size_t measured = (size_t)b->pool.peak_in_use * b->block_bytes;
        const size_t planned = planner_reserved_now(&pl);
        const int step_exact = exact && pol->kind != KV_POLICY_HEADKV;
        if (step_exact ? measured != planned : measured > planned) {
            if (res->step_mismatches++ == 0)
                fprintf(stderr, "kv_bench: iteration %d: pool peak %zu bytes, planned %zu\n", iter,
                        measured, planned);
        }
        planner_tick(&pl);
        for (int i = 0; i < n_live;) {
            item_t *it = &items[live[i]];
            if (!gen_request_done(&it->g)) {
                i++;
                continue;
            }
            const size_t peak = (size_t)it->g.kv_peak_blocks * b->block_bytes;
            if (exact ? peak != it->planned_peak : peak > it->planned_peak) {
                if (res->peak_mismatches++ == 0)
                    fprintf(stderr, "kv_bench: prompt %d: measured peak %zu bytes, planned %zu\n",
                            it->prompt->id, peak, it->planned_peak);
            }
            res->max_measured_peak = peak > res->max_measured_peak ? peak : res->max_measured_peak;
            res->max_planned_peak =
                it->planned_peak > res->max_planned_peak ? it->planned_peak : res->max_planned_peak;
            if (gen_decode(&it->g, rgb, err) != AR_OK) {
                rc = AR_ERR;
                goto out;
            }
            if (png_dir) {
                char path[2048];
                snprintf(path, sizeof path, "%s/%05d.png", png_dir, it->prompt->id);
                if (png_write_file(path, rgb, b->width, b->height, err) != AR_OK) {
                    rc = AR_ERR;
                    goto out;
                }
                cJSON *o = cJSON_CreateObject();
                cJSON_AddNumberToObject(o, "id", it->prompt->id);
                cJSON_AddNumberToObject(o, "n_prompt", it->prompt->n_prompt);
                cJSON_AddNumberToObject(o, "planned_peak_bytes", (double)it->planned_peak);
                cJSON_AddNumberToObject(o, "peak_bytes", (double)peak);
                cJSON_AddItemToArray(res->images_json, o);
            }
            gen_request_free(&it->g);
            it->running = 0;
            planner_remove(&pl, (uint64_t)live[i]);
            live[i] = live[--n_live];
            res->images++;
        }
    }
    res->wall_s = clock_now_s() - t0;
out:
    for (int i = 0; i < n; i++)
        if (items[i].running) {
            gen_request_free(&items[i].g);
            items[i].running = 0;
        }
    planner_free(&pl);
    free(batch);
    free(rgb);
    free(live);
    return rc;
}

static void free_items(item_t *items, int n) {
    for (int i = 0; items && i < n; i++)
        free(items[i].traj);
    free(items);
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

    /* The row's knobs, else its policy's fallback knobs, must suit every prompt. */
    ar_error_t perr = {{0}};
    const char *field = NULL;
    int fits = 1, scaled = 0;
    for (int attempt = 0; attempt < 2; attempt++) {
        fits = 1;
        for (int i = 0; i < b->n_prompts && fits; i++) {
            kv_geometry_t g = planner_geometry(&b->model.cfg, b->prompts[i].n_prompt);
            fits = kv_policy_check(&r->p, &g, &field, &perr) == AR_OK;
        }
        if (fits || attempt == 1)
            break;
        const row_t *fb = NULL;
        for (int i = 0; i < n_fallbacks; i++)
            if (fallbacks[i].p.kind == r->p.kind)
                fb = &fallbacks[i];
        if (!fb)
            break;
        cJSON_AddStringToObject(o, "defaults_refused", perr.msg);
        for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
            if (fb->knobs_set & (1u << i) && !(r->knobs_set & (1u << i)))
                kv_policy_knob_set(&r->p, &kv_policy_knobs[i],
                                   kv_policy_knob_get(&fb->p, &kv_policy_knobs[i]));
        scaled = 1;
    }
    cJSON_AddBoolToObject(o, "scaled", scaled);
    cJSON *knobs = cJSON_AddObjectToObject(o, "knobs");
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        if (kv_policy_knobs[i].policy == r->p.kind)
            cJSON_AddNumberToObject(knobs, kv_policy_knobs[i].name,
                                    kv_policy_knob_get(&r->p, &kv_policy_knobs[i]));
    if (!fits) {
        cJSON_AddStringToObject(o, "error", perr.msg);
        fprintf(stderr, "kv_bench: %s: %s\n", r->name, perr.msg);
        return o;
    }

    /* The reference prompt's trajectory: the tokens of one head at its peak. */
    const prompt_t *ref = &b->prompts[b->ref];
    kv_geometry_t g = planner_geometry(&b->model.cfg, ref->n_prompt);
    int *tok = malloc((size_t)b->steps * sizeof *tok), peak_step = 0;
    if (!tok || kv_policy_trajectory(&r->p, &g, tok) != AR_OK) {
        free(tok);
        cJSON_Delete(o);
        ar_errorf(err, "%s: no trajectory", r->name);
        return NULL;
    }
    for (int t = 1; t < b->steps; t++)
        if (tok[t] > tok[peak_step])
            peak_step = t;
    cJSON_AddNumberToObject(o, "peak_tokens_per_head", tok[peak_step]);
    cJSON_AddNumberToObject(o, "peak_step", peak_step);
    free(tok);
    int exact = 1;
    for (int i = 0; i < b->n_prompts; i++)
        exact &= plan_is_exact(b, &r->p, &b->prompts[i]);
    cJSON_AddStringToObject(o, "peak_check", exact ? "equal" : "at most");

    /* Quality run: every prompt. */
    char dir[2048];
    snprintf(dir, sizeof dir, "%s/%s", b->out_dir, r->name);
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        cJSON_Delete(o);
        ar_errorf(err, "%s: %s", dir, strerror(errno));
        return NULL;
    }
    cJSON_AddStringToObject(o, "dir", dir);
    item_t *items = calloc((size_t)b->n_prompts, sizeof *items);
    int ok = items != NULL;
    for (int i = 0; ok && i < b->n_prompts; i++) {
        items[i].prompt = &b->prompts[i];
        items[i].seed = b->prompts[i].seed;
        ok = (items[i].traj = plan(b, &r->p, &b->prompts[i], err)) != NULL;
        if (ok)
            items[i].planned_peak = peak_of(items[i].traj, b->steps);
    }
    run_result_t q = {0}, c = {0};
    if (!ok || run(b, &r->p, exact, items, b->n_prompts, 0, dir, &q, err) != AR_OK) {
        free_items(items, b->n_prompts);
        cJSON_Delete(q.images_json);
        cJSON_Delete(o);
        return NULL;
    }
    free_items(items, b->n_prompts);
    cJSON_AddItemToObject(o, "images", q.images_json);
    cJSON_AddNumberToObject(o, "quality_wall_s", q.wall_s);

    /* Capacity run: copies of the reference prompt. */
    items = calloc(MAX_CAPACITY, sizeof *items);
    size_t *traj = plan(b, &r->p, ref, err);
    ok = items && traj;
    for (int i = 0; ok && i < MAX_CAPACITY; i++) {
        items[i].prompt = ref;
        items[i].seed = 1000003u * (uint64_t)(i + 1);
        ok = (items[i].traj = malloc((size_t)b->steps * sizeof *traj)) != NULL;
        if (ok) {
            memcpy(items[i].traj, traj, (size_t)b->steps * sizeof *traj);
            items[i].planned_peak = peak_of(traj, b->steps);
        }
    }
    free(traj);
    if (!ok || run(b, &r->p, exact, items, MAX_CAPACITY, b->waves, NULL, &c, err) != AR_OK) {
        free_items(items, MAX_CAPACITY);
        cJSON_Delete(o);
        return NULL;
    }
    free_items(items, MAX_CAPACITY);
    if (c.admitted_first * b->waves >= MAX_CAPACITY)
        fprintf(stderr, "kv_bench: %s: the capacity run hit its cap of %d images\n", r->name,
                MAX_CAPACITY);

    cJSON_AddNumberToObject(o, "planned_peak_bytes", (double)c.max_planned_peak);
    cJSON_AddNumberToObject(o, "measured_peak_bytes", (double)c.max_measured_peak);
    cJSON_AddNumberToObject(o, "admitted", c.admitted_first);
    cJSON_AddNumberToObject(o, "capacity_wall_s", c.wall_s);
    cJSON_AddNumberToObject(o, "images_per_s", c.wall_s > 0 ? c.images / c.wall_s : 0);
    int peak_bad = q.peak_mismatches + c.peak_mismatches;
    int step_bad = q.step_mismatches + c.step_mismatches;
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

int main(int argc, char **argv) {
    static const struct option opts[] = {
        {"model", required_argument, 0, 'm'},   {"prompts", required_argument, 0, 'p'},
        {"out", required_argument, 0, 'o'},     {"pool-images", required_argument, 0, 'n'},
        {"threads", required_argument, 0, 't'}, {"waves", required_argument, 0, 'w'},
        {"row", required_argument, 0, 'r'},     {"fallback", required_argument, 0, 'f'},
        {"help", no_argument, 0, 'h'},          {0, 0, 0, 0}};
    const char *model_dir = NULL, *prompts_path = NULL;
    static row_t rows[MAX_ROWS], fallbacks[4];
    int n_rows = 0, n_fallbacks = 0, threads = 0, c;
    double pool_images = 2;
    bench_t b = {.waves = 2};
    while ((c = getopt_long(argc, argv, "h", opts, NULL)) != -1) {
        switch (c) {
        case 'm':
            model_dir = optarg;
            break;
        case 'p':
            prompts_path = optarg;
            break;
        case 'o':
            b.out_dir = optarg;
            break;
        case 'n':
            pool_images = atof(optarg);
            break;
        case 't':
            threads = atoi(optarg);
            break;
        case 'w':
            b.waves = atoi(optarg);
            break;
        case 'r':
            if (n_rows == MAX_ROWS || parse_row(optarg, &rows[n_rows]) != AR_OK)
                return 2;
            n_rows++;
            break;
        case 'f': {
            char spec[300];
            const char *colon = strchr(optarg, ':');
            /* POLICY:knobs is a row spec with a placeholder budget. */
            snprintf(spec, sizeof spec, "%.*s:1:%s", colon ? (int)(colon - optarg) : 0, optarg,
                     colon ? colon + 1 : "");
            if (!colon || n_fallbacks == 4 || parse_row(spec, &fallbacks[n_fallbacks]) != AR_OK)
                return 2;
            n_fallbacks++;
            break;
        }
        case 'h':
            usage(stdout);
            return 0;
        default:
            usage(stderr);
            return 2;
        }
    }
    if (!model_dir || !prompts_path || !b.out_dir || n_rows == 0 || !(pool_images > 0) ||
        b.waves < 1) {
        usage(stderr);
        return 2;
    }

    ar_error_t err = {{0}};
    backend_t *be = backend_cpu_create(threads, &err);
    if (!be || read_prompts(&b, prompts_path) != AR_OK) {
        if (!be)
            fprintf(stderr, "kv_bench: %s\n", err.msg);
        return 1;
    }
    if (model_load(&b.model, model_dir, be, &err) != AR_OK) {
        fprintf(stderr, "kv_bench: cannot load model: %s\n", err.msg);
        return 1;
    }
    const model_config_t *cfg = &b.model.cfg;
    b.steps = planner_steps(cfg);
    b.block_tokens = planner_block_tokens(cfg);
    b.block_bytes = kv_pool_block_bytes(b.block_tokens, cfg->llm.head_dim);
    b.width = model_config_image_width(cfg);
    b.height = model_config_image_height(cfg);
    for (int i = 0; i < b.n_prompts; i++) {
        prompt_t *p = &b.prompts[i];
        p->cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
        p->uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
        if (!p->cond || !p->uncond ||
            model_prompt_from_text(&b.model, p->text, p->cond, p->uncond, &p->n_prompt, &err) !=
                AR_OK) {
            fprintf(stderr, "kv_bench: prompt %d: %s\n", p->id, p->cond ? err.msg : "no memory");
            return 1;
        }
    }
    b.ref = median_prompt(&b);

    /* The pool: pool_images full-cache images of the reference prompt,
     * in whole blocks (a full-cache image's peak is whole blocks). */
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    size_t *ft = plan(&b, &full, &b.prompts[b.ref], &err);
    if (!ft) {
        fprintf(stderr, "kv_bench: %s\n", err.msg);
        return 1;
    }
    size_t n_blocks = (size_t)floor(pool_images * (double)(peak_of(ft, b.steps) / b.block_bytes));
    free(ft);
    if (kv_pool_init(&b.pool, be, (int)n_blocks, b.block_tokens, cfg->llm.head_dim, &err) !=
        AR_OK) {
        fprintf(stderr, "kv_bench: %s\n", err.msg);
        return 1;
    }
    b.pool_bytes = kv_pool_capacity_bytes(&b.pool);
    if (mkdir(b.out_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "kv_bench: %s: %s\n", b.out_dir, strerror(errno));
        return 1;
    }

    cJSON *doc = cJSON_CreateObject();
    cJSON_AddStringToObject(doc, "model", cfg->name);
    cJSON_AddNumberToObject(doc, "grid_width", cfg->image.grid_width);
    cJSON_AddNumberToObject(doc, "grid_height", cfg->image.grid_height);
    cJSON_AddNumberToObject(doc, "block_tokens", b.block_tokens);
    cJSON_AddNumberToObject(doc, "pool_bytes", (double)b.pool_bytes);
    cJSON_AddNumberToObject(doc, "pool_images", pool_images);
    cJSON_AddNumberToObject(doc, "threads", threads);
    cJSON_AddNumberToObject(doc, "waves", b.waves);
    cJSON *refj = cJSON_AddObjectToObject(doc, "reference_prompt");
    cJSON_AddNumberToObject(refj, "id", b.prompts[b.ref].id);
    cJSON_AddStringToObject(refj, "text", b.prompts[b.ref].text);
    cJSON_AddNumberToObject(refj, "n_prompt", b.prompts[b.ref].n_prompt);
    cJSON *rows_json = cJSON_AddArrayToObject(doc, "rows");
    int checks_failed = 0;
    double t0 = clock_now_s();
    for (int i = 0; i < n_rows; i++) {
        cJSON *r = bench_row(&b, &rows[i], fallbacks, n_fallbacks, &checks_failed, &err);
        if (!r) {
            fprintf(stderr, "kv_bench: %s: %s\n", rows[i].spec, err.msg);
            return 1;
        }
        cJSON_AddItemToArray(rows_json, r);
    }
    cJSON_AddNumberToObject(doc, "wall_s", clock_now_s() - t0);
    cJSON_AddNumberToObject(doc, "checks_failed", checks_failed);
    char *text = cJSON_Print(doc);
    if (!text) {
        fprintf(stderr, "kv_bench: out of memory\n");
        return 1;
    }
    printf("%s\n", text);
    free(text);
    cJSON_Delete(doc);
    if (b.pool.bad_frees)
        fprintf(stderr, "kv_bench: %lld blocks released twice\n", b.pool.bad_frees);
    kv_pool_free(&b.pool);
    for (int i = 0; i < b.n_prompts; i++) {
        free(b.prompts[i].text);
        free(b.prompts[i].cond);
        free(b.prompts[i].uncond);
    }
    free(b.prompts);
    model_free(&b.model);
    be->destroy(be);
    return checks_failed ? 3 : 0;
}
