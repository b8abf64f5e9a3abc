/* The KV planner's property test (issue 5), on the tiny model with the
 * real policies (engine/policy/kv_policy.c), the real pool and the real planner.
 * Random arrival traces mix policies and budgets that suit the 8 x 8 grid
 * (full, streaming, linear at budget >= 1/2, headkv with a small buffer and
 * window), prompt lengths, n = 1..2 images and cancellations, against a
 * pool of two to three and a half full-cache images. Then the same on the
 * tiny next-scale model (VAR, scales 1, 2, 3, 4: one step per scale, the
 * last never cached), with random classes, full and streaming (random
 * sink_scales), the only policies next-scale models take.
 *
 * 1. Replayed deterministically, iteration by iteration, through the
 *    batcher the scheduler drives (engine/batcher.h with the engine's step
 *    function: drop cancelled, admit FIFO through the planner, one batched
 *    gen_step, retire): the pool's measured peak in every step stays within
 *    the pool and within what the planner reserved; each request's own use
 *    during every step (its heads' blocks after the append, before any
 *    compaction) stays within its planned trajectory, equals it for every
 *    policy the policy table calls exact (kv_policy_plan_exact), and falls
 *    below it somewhere for every other (a worst case that is never
 *    undercut should be called exact); and admission is exact: at every
 *    iteration the batcher admits exactly the jobs a brute force admits,
 *    taking the queue's head while it fits, where "fits" sums every running
 *    request's whole trajectory from the iteration it started, at every
 *    future iteration. So the batcher never refuses a request (the head of
 *    the queue) that would have fitted, and never admits one that would not.
 *    Half the requests whose policy takes a budget bring a budget range
 *    (elastic budgets: planner_plan_levels' levels from a random floor at or
 *    above the policy's least budget up to a random top): the brute force
 *    takes the first level whose whole trajectory fits, the batcher must
 *    admit the same job at the same level, and the job then runs (and is
 *    checked) at that level's budget. Half the traces carry time objectives
 *    (two jobs in three a target, a cost table in the replay's units): the
 *    brute force prices every future iteration over every job running then
 *    and takes the first level that also ends the head by its target and
 *    makes no running job late that would be on time without it (a head
 *    that could not end by its target even alone, at its floor, is tried at
 *    its floor only); the batcher must admit the same at the same level and
 *    predict the same end; heads must have waited for time and gone below
 *    the pool's budget for it.
 * 2. The same kind of traces through the real scheduler (threads, batching,
 *    cancellation): arrivals and cancellations are keyed to its iteration
 *    counter; every job that was not cancelled finishes, the pool gauges
 *    never pass the capacity, and arserve_kv_plan_overruns_total (the
 *    scheduler's check of the measured peak against the reservation at
 *    every iteration) stays 0. */
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/batcher.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "engine/policy/kv_calibration.h"
#include "server/metrics.h"
#include "server/scheduler_test.h"
#include "tests/test.h"

static const char *tiny, *var_tiny;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}
static backend_t *be;
static model_t model;

/* ---- random traces ---------------------------------------------------------------- */

static uint64_t rng_state;
static uint32_t rnd(void) {
    rng_state = rng_state * 6364136223846793005ULL + 1442695040888963407ULL;
    return (uint32_t)(rng_state >> 33);
}
static int rnd_in(int lo, int hi) { return lo + (int)(rnd() % (uint32_t)(hi - lo + 1)); }
static double rnd_unit(void) { return (double)rnd() / 4294967296.0; }

enum { MAX_JOBS = 16, MAX_IDS = 12 };

typedef struct tjob {
    int arrive;    /* iteration it joins the queue */
    int cancel_at; /* iteration its cancellation is seen; -1: never */
    int n_images;
    int n_prompt;
    int cond[MAX_IDS + 2], uncond[MAX_IDS + 2];
    kv_policy_params_t pol;
    double lo, hi;    /* a budget range (elastic), or 0, 0 */
    double objective; /* its time objective (the replay's clock: iterations), or 0: none */
} tjob_t;

typedef struct trace {
    int n;
    tjob_t jobs[MAX_JOBS];
    size_t pool_bytes;
    int block_tokens;
    int timed; /* admission prices time by TIME_TABLE */
} trace_t;

/* The time objectives' table, in the replay's units: an iteration of one
 * image attending 100 tokens costs about 2.5 (an iteration takes 1 of the
 * replay's clock, so targets are met only where the table's load allows). */
static const cost_table_t TIME_TABLE = {.family = "test",
                                        .coef = {1.0, 0.1, 0.01, 0.02, 0.005},
                                        .decode_s = 0.5,
                                        .png_s = 0.25,
                                        .http_s = 0.125};

/* The policies each family takes, in the counts' order. */
static const kv_policy_kind_t raster_kinds[] = {KV_POLICY_FULL, KV_POLICY_STREAMING,
                                                KV_POLICY_LINEAR, KV_POLICY_HEADKV};
static const kv_policy_kind_t scale_kinds[] = {
    KV_POLICY_FULL, KV_POLICY_STREAMING, KV_POLICY_HEATKV, KV_POLICY_AMSKV, KV_POLICY_SCALEKV};
enum { N_KINDS = 5 };
static long long policy_count[N_KINDS];

/* How many policies the loaded model's family takes. */
static int n_kinds(void);

/* 1 when the loaded model generates a scale per step (VAR). */
static int by_scale(void) {
    kv_geometry_t g;
    model_geometry(&model.cfg, 1, &g);
    return g.step_unit == KV_STEP_SEGMENT;
}

static int n_kinds(void) { return by_scale() ? 5 : 4; }

/* "full 140, streaming 104, ...": the policies drawn so far, into buf. */
static const char *policy_counts(char *buf, size_t cap) {
    const kv_policy_kind_t *kinds = by_scale() ? scale_kinds : raster_kinds;
    int used = 0;
    for (int k = 0; k < n_kinds() && used >= 0 && (size_t)used < cap; k++)
        used += snprintf(buf + used, cap - (size_t)used, "%s%s %lld", k ? ", " : "",
                         kv_policy_name(kinds[k]), policy_count[k]);
    return buf;
}

/* A policy with random knobs that validate on this request's geometry. */
static kv_policy_params_t random_policy(int n_prompt) {
    kv_geometry_t g;
    model_geometry(&model.cfg, n_prompt, &g);
    for (;;) {
        kv_policy_params_t p;
        const int pick = rnd_in(0, n_kinds() - 1);
        const kv_policy_kind_t kind = by_scale() ? scale_kinds[pick] : raster_kinds[pick];
        kv_policy_defaults(&p, kind);
        switch (kind) {
        case KV_POLICY_STREAMING:
            p.budget = 0.3 + 0.7 * rnd_unit();
            if (by_scale())
                p.sink_scales = rnd_in(0, 3); /* 3: as many as the cached scales */
            else
                p.sink_tokens = rnd_in(0, 4);
            break;
        case KV_POLICY_LINEAR:
            p.budget = rnd() % 2 ? rnd_in(4, 8) / 8.0 : 0.5 + 0.5 * rnd_unit();
            p.anchor_lines = rnd_in(0, 1);
            p.recent_lines = rnd_in(1, 2);
            break;
        case KV_POLICY_HEADKV:
            p.budget = 0.25 + 0.75 * rnd_unit();
            p.headkv_buffer = rnd_in(1, 4);
            p.headkv_recent_lines = rnd_in(0, 2);
            p.headkv_local_window = rnd_in(0, 8);
            p.headkv_group_tokens = rnd_in(2, 40);
            p.headkv_threshold = 0.5 + 0.45 * rnd_unit();
            p.headkv_alpha = rnd_unit();
            break;
        case KV_POLICY_HEATKV:
            p.budget = 0.1 + 0.9 * rnd_unit();
            p.sink_scales = rnd_in(0, 2);
            break;
        case KV_POLICY_SCALEKV:
            p.budget = 0.3 + 0.7 * rnd_unit();
            p.scalekv_drafters = rnd_unit();
            break;
        case KV_POLICY_AMSKV:
            /* The tiny pyramid (1, 4, 9, 16 tokens) rolls only with small
             * capacities; thresholds around its keys' distances. */
            p.amskv_condensed_scales = rnd_in(0, 1);
            p.amskv_min_scales = rnd_in(0, 1);
            p.amskv_max_scales = rnd_in(0, 2);
            p.amskv_threshold = rnd() % 2 ? -1e6 : -0.2 * rnd_unit();
            break;
        default:
            break;
        }
        if (kv_policy_check(&p, &g, NULL, NULL) == AR_OK) {
            policy_count[pick]++;
            return p;
        }
    }
}

/* One request's trajectory (per image) in bytes; caller frees. */
static size_t *image_plan(const tjob_t *j, int bt) {
    const int S = model_steps(&model.cfg);
    size_t *b = calloc((size_t)S, sizeof *b);
    planner_plan_t plan;
    ar_error_t err = {{0}};
    if (planner_plan(&plan, &model.cfg, &j->pol, j->n_prompt, bt, NULL, &err) != AR_OK) {
        CHECK_MSG(0, "planner_plan: %s", err.msg);
        return b;
    }
    memcpy(b, plan.bytes, (size_t)S * sizeof *b);
    planner_plan_free(&plan);
    return b;
}

static size_t peak_of(const size_t *b, int n) {
    size_t m = 0;
    for (int i = 0; i < n; i++)
        m = b[i] > m ? b[i] : m;
    return m;
}

static void make_trace(trace_t *tr, int max_jobs, const int *block_sizes, int n_sizes) {
    memset(tr, 0, sizeof *tr);
    tr->n = rnd_in(max_jobs / 2, max_jobs);
    tr->block_tokens = block_sizes[rnd_in(0, n_sizes - 1)];
    /* The pool: 2 to 3.5 full-cache images at the longest prompt, whole blocks. */
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    tjob_t probe = {.n_prompt = MAX_IDS + 2, .pol = full};
    size_t *b = image_plan(&probe, tr->block_tokens);
    const size_t one = peak_of(b, model_steps(&model.cfg));
    free(b);
    const size_t block = kv_pool_block_bytes(tr->block_tokens, model.cfg.llm.head_dim, DTYPE_F32);
    tr->pool_bytes = (size_t)((2.0 + 1.5 * rnd_unit()) * (double)one) / block * block;
    /* Gaps and cancellation times in iterations: the raster model's 64
     * steps take the values these traces were tuned with; a model of a few
     * steps (one per scale) gets them in proportion. */
    const int S = model_steps(&model.cfg), gap = S >= 24 ? 24 : S, late = S >= 24 ? 90 : 4 * S;
    int t = 0;
    for (int k = 0; k < tr->n; k++) {
        tjob_t *j = &tr->jobs[k];
        t += rnd() % 5 < 2 ? 0 : rnd_in(1, gap); /* bursts and gaps */
        j->arrive = t;
        j->n_images = rnd_in(1, 2);
        ar_error_t err = {{0}};
        if (model_is_class_conditional(&model)) {
            const int label = rnd_in(0, model.cfg.condition.num_classes - 1);
            CHECK_MSG(model_prompt_from_class(&model, label, j->cond, j->uncond, &j->n_prompt,
                                              &err) == AR_OK,
                      "%s", err.msg);
        } else {
            int ids[MAX_IDS], n_ids = rnd_in(1, MAX_IDS);
            for (int i = 0; i < n_ids; i++)
                ids[i] = rnd_in(4, model.cfg.llm.vocab_size - 1);
            CHECK_MSG(model_prompt_from_ids(&model, ids, n_ids, j->cond, j->uncond, &j->n_prompt,
                                            &err) == AR_OK,
                      "%s", err.msg);
        }
        j->pol = random_policy(j->n_prompt);
        kv_geometry_t g;
        model_geometry(&model.cfg, j->n_prompt, &g);
        const double least = kv_policy_min_budget(&j->pol, &g);
        if (kv_policy_uses_budget(j->pol.kind, &g) && least > 0 && rnd() % 2) {
            j->hi = j->pol.budget + (1 - j->pol.budget) * rnd_unit();
            j->lo = ceil((least + (j->hi - least) * 0.6 * rnd_unit()) * 1e4) / 1e4;
            if (j->lo > j->hi)
                j->lo = j->hi;
        }
        j->cancel_at = rnd() % 5 == 0 ? j->arrive + rnd_in(0, late) : -1;
    }
    /* Drawn last, so that the traces before time objectives stay as they were. */
    tr->timed = rnd() % 2;
    for (int k = 0; tr->timed && k < tr->n; k++)
        if (rnd() % 3)
            tr->jobs[k].objective = (0.3 + 2.0 * rnd_unit()) * 2.5 * S;
}

/* ---- 1: deterministic replay ---------------------------------------------------------- */

/* A job of the trace as the replay drives it. */
typedef struct rjob {
    gen_job_t gen; /* the batcher's work */
    /* Its levels (one without a range), the largest budget first: */
    int n_levels, level;
    double budgets[PLANNER_MAX_LEVELS];
    size_t *lv_plan1[PLANNER_MAX_LEVELS]; /* per image */
    size_t *lv_kv[PLANNER_MAX_LEVELS];    /* all its images */
    size_t *plan1;                        /* per image, at its level (the floor's until admitted) */
    size_t *kv;                           /* all its images: the batcher's plan at its level */
    size_t *tight; /* the same, tightened after each step as the batcher does */
    cost_features_t *lv_feat[PLANNER_MAX_LEVELS]; /* each level's step features (all images) */
    double end;                                   /* the brute force's predicted end */
    uint64_t id;
    int state; /* 0 not arrived, 1 waiting, 2 running, 3 ended */
    int start; /* iteration of its step 0 */
    int cancelled;
} rjob_t;

typedef struct totals {
    long long traces, iterations, admissions, refusals, fits_checked, steps_checked;
    long long cancelled_running, cancelled_waiting, contention_iters;
    long long tightened;                  /* request-steps whose plan a tightening lowered */
    long long elastic_top, elastic_below; /* ranged admissions at their top, below it */
    long long time_waits, time_lower;     /* heads that waited, or went lower, for time */
    long long late_floor;                 /* late heads tried at their floor only */
    /* Per policy: request-steps that used less than a worst-case plan. */
    long long under_bound[KV_POLICY_COUNT];
} totals_t;

static totals_t tot;

/* Does cand fit at iteration now beside the running jobs (start >= 0),
 * each with its whole trajectory laid from the iteration it started? */
static int brute_fits(const rjob_t *jobs, const trace_t *tr, int now, const size_t *cand, int S,
                      size_t capacity) {
    for (int u = now; u < now + S; u++) {
        size_t total = cand[u - now];
        for (int r = 0; r < tr->n; r++) {
            const int k = u - jobs[r].start;
            if (jobs[r].state == 2 && k >= 0 && k < S)
                total += jobs[r].tight ? jobs[r].tight[k]
                                       : jobs[r].plan1[k] * (size_t)tr->jobs[r].n_images;
        }
        if (total > capacity)
            return 0;
    }
    return 1;
}

/* A job's submitted time and target in the replay's clock (submissions
 * count from 1: 0 is "unknown" to the batcher). */
static double submitted_at(const tjob_t *j) { return j->arrive + 1.0; }
static double target_at(const tjob_t *j) {
    return j->objective > 0 ? submitted_at(j) + j->objective : INFINITY;
}

/* The arrival rate as the batcher should measure it: a running mean of the
 * gaps between submissions, over the last BATCHER_RATE_WINDOW, a gap counted
 * at most BATCHER_GAP_CAP times the mean once BATCHER_RATE_MIN_GAPS are in. */
typedef struct rate {
    double last, mean_gap;
    int n;
} rate_t;

static void rate_add(rate_t *r, double t) {
    if (r->last > 0) {
        const double gap =
            r->n >= BATCHER_RATE_MIN_GAPS && t - r->last > BATCHER_GAP_CAP * r->mean_gap
                ? BATCHER_GAP_CAP * r->mean_gap
                : t - r->last;
        r->n++;
        const double w = r->n < BATCHER_RATE_WINDOW ? 1.0 / r->n : 1.0 / BATCHER_RATE_WINDOW;
        r->mean_gap += w * (gap - r->mean_gap);
    }
    r->last = t;
}

/* The first level of job c (from `from`) whose settled latency at the
 * measured rate (every arrival running at that level: Little's law over
 * TIME_TABLE's linear step) is within BATCHER_SETTLED_SHARE of c's
 * objective; the floor when none is. */
static int brute_rate_level(const rjob_t *jobs, const trace_t *tr, const rate_t *r, int c, int from,
                            int S) {
    const tjob_t *j = &tr->jobs[c];
    int l = from;
    for (; l < jobs[c].n_levels - 1 && j->objective > 0 && r->n >= BATCHER_RATE_MIN_GAPS &&
           r->mean_gap > 0;
         l++) {
        cost_features_t mean = {0};
        for (int k = 0; k < S; k++)
            cost_features_accumulate(&mean, &jobs[c].lv_feat[l][k], 1.0 / S);
        const double a = cost_step_seconds(&TIME_TABLE, &mean) - TIME_TABLE.coef[0],
                     load = S * a / r->mean_gap,
                     images =
                         j->n_images * (TIME_TABLE.decode_s + TIME_TABLE.png_s) + TIME_TABLE.http_s;
        const double settled = load < 1 ? (S * TIME_TABLE.coef[0] + images) / (1 - load) : INFINITY;
        if (settled <= BATCHER_SETTLED_SHARE * j->objective)
            break;
    }
    return l;
}

/* When job c would end, started at iteration now at its floor with
 * nothing else running. */
static double brute_alone(const rjob_t *jobs, const trace_t *tr, int now, int c, int S) {
    double alone = now;
    for (int k = 0; k < S; k++)
        alone += cost_step_seconds(&TIME_TABLE, &jobs[c].lv_feat[jobs[c].n_levels - 1][k]);
    return alone + tr->jobs[c].n_images * (TIME_TABLE.decode_s + TIME_TABLE.png_s) +
           TIME_TABLE.http_s;
}

/* The time objectives as the batcher should keep them, by brute force:
 * admitting cand (job c at `level`) at iteration now, each future
 * iteration priced by TIME_TABLE over every job running then (each laid
 * from the iteration it started, at its level) and cand; 1 when cand ends
 * by its target (or could not even alone at its floor) and no running job
 * with a target is made late that would end by it without cand. *end:
 * cand's predicted end. */
static int brute_time_fits(const rjob_t *jobs, const trace_t *tr, int now, int c, int level, int S,
                           double *end) {
    double with = now, without = now;
    double end_with[MAX_JOBS], end_without[MAX_JOBS];
    const double per_image = TIME_TABLE.decode_s + TIME_TABLE.png_s;
    for (int r = 0; r < tr->n; r++)
        end_with[r] = end_without[r] = -1;
    for (int u = now; u < now + 2 * S; u++) {
        cost_features_t x = {0}, y;
        int any = 0;
        for (int r = 0; r < tr->n; r++) {
            const int k = u - jobs[r].start;
            if (jobs[r].state != 2 || r == c || k < 0 || k >= S)
                continue;
            cost_features_accumulate(&x, &jobs[r].lv_feat[jobs[r].level][k], 1);
            any = 1;
        }
        y = x;
        if (u - now < S)
            cost_features_accumulate(&y, &jobs[c].lv_feat[level][u - now], 1);
        if (any)
            without += cost_step_seconds(&TIME_TABLE, &x);
        if (any || u - now < S)
            with += cost_step_seconds(&TIME_TABLE, &y);
        for (int r = 0; r < tr->n; r++)
            if (jobs[r].state == 2 && r != c && u - jobs[r].start == S - 1) {
                end_with[r] = with + tr->jobs[r].n_images * per_image + TIME_TABLE.http_s;
                end_without[r] = without + tr->jobs[r].n_images * per_image + TIME_TABLE.http_s;
            }
        if (u - now == S - 1)
            *end = with + tr->jobs[c].n_images * per_image + TIME_TABLE.http_s;
    }
    const double mine = target_at(&tr->jobs[c]);
    if (*end > mine && brute_alone(jobs, tr, now, c, S) <= mine)
        return 0;
    for (int r = 0; r < tr->n; r++) {
        const double t = target_at(&tr->jobs[r]);
        if (end_with[r] >= 0 && end_with[r] > t && end_without[r] <= t)
            return 0;
    }
    return 1;
}

/* Blocks a request's heads need during its next step: each head's length
 * plus the rows the step feeds into the cache, as the family's geometry
 * says (raster: the prompt at step 0, else one token; next-scale: the
 * scale, none for the last). */
static int request_blocks_during_next_step(const gen_request_t *g, int bt) {
    const int H = model.cfg.llm.num_layers * model.cfg.llm.num_kv_heads;
    kv_geometry_t geo;
    model_geometry(&model.cfg, g->n_prompt, &geo);
    const int fed = (g->step == 0 ? geo.n_prompt : 0) + kv_geometry_fed(&geo, g->step);
    int n = 0;
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < H; h++)
            n += (g->seq[s].heads[h].len + fed + bt - 1) / bt;
    return n;
}

static int job_index(const rjob_t *jobs, int n, const void *work) {
    for (int k = 0; k < n; k++)
        if (&jobs[k].gen == work)
            return k;
    return -1;
}

/* Handles the batcher's events; returns the jobs admitted (in order) into
 * admitted[] and how many. */
static int replay_events(batcher_t *b, rjob_t *jobs, const trace_t *tr, int it, int *finished,
                         int *admitted) {
    batcher_event_t ev[4 * MAX_JOBS];
    int n_adm = 0, n;
    while ((n = batcher_take_events(b, ev, 4 * MAX_JOBS)) > 0)
        for (int i = 0; i < n; i++) {
            const int k = job_index(jobs, tr->n, ev[i].work);
            if (ev[i].type == BATCHER_ADMITTED) {
                CHECK_MSG(ev[i].level == jobs[k].level,
                          "job %d admitted at level %d, the brute "
                          "force's %d",
                          k, ev[i].level, jobs[k].level);
                if (tr->timed)
                    CHECK_MSG(fabs(ev[i].predicted_end - jobs[k].end) <= 1e-9 * (1 + jobs[k].end),
                              "job %d predicted to end at %.9g, the brute force's %.9g", k,
                              ev[i].predicted_end, jobs[k].end);
                if (jobs[k].n_levels > 1) {
                    if (ev[i].level == 0)
                        tot.elastic_top++;
                    else
                        tot.elastic_below++;
                }
                jobs[k].plan1 = jobs[k].lv_plan1[jobs[k].level];
                jobs[k].kv = jobs[k].lv_kv[jobs[k].level];
                memcpy(jobs[k].tight, jobs[k].kv, (size_t)model_steps(&model.cfg) * sizeof(size_t));
                jobs[k].state = 2;
                jobs[k].start = it;
                admitted[n_adm++] = k;
                tot.admissions++;
            } else if (ev[i].type == BATCHER_ENDED) {
                CHECK_MSG(ev[i].end == BATCHER_END_FINISHED || ev[i].end == BATCHER_END_CANCELLED,
                          "job %d ended %s: %s", k, batcher_end_name(ev[i].end), ev[i].why);
                if (ev[i].end == BATCHER_END_CANCELLED && ev[i].started)
                    tot.cancelled_running++;
                else if (ev[i].end == BATCHER_END_CANCELLED)
                    tot.cancelled_waiting++;
                jobs[k].state = 3;
                gen_job_free(&jobs[k].gen);
                (*finished)++;
            }
        }
    return n_adm;
}

static void replay(const trace_t *tr) {
    const model_config_t *c = &model.cfg;
    const int S = model_steps(c), bt = tr->block_tokens;
    const size_t block = kv_pool_block_bytes(bt, c->llm.head_dim, DTYPE_F32);
    kv_pool_t pool;
    ar_error_t err = {{0}};
    if (kv_pool_init(&pool, be, (int)(tr->pool_bytes / block), bt, c->llm.head_dim, DTYPE_F32,
                     &err) != AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const size_t capacity = kv_pool_capacity_bytes(&pool);
    batcher_options_t bo = {
        .pool_bytes = capacity, .max_running = 4 * MAX_JOBS, .max_waiting = MAX_JOBS};
    batcher_t *b = batcher_create(&bo, &gen_batcher_ops, &pool, &err);
    if (b && tr->timed)
        batcher_set_costs(b, &TIME_TABLE);
    rjob_t jobs[MAX_JOBS];
    memset(jobs, 0, sizeof jobs);
    int next = 0, finished = 0, queue[MAX_JOBS], q_len = 0;
    rate_t rate = {0};
    int over_pool = 0, over_reserved = 0, over_plan = 0, not_exact = 0, sum_mismatch = 0;
    int fits_mismatch = 0, over_tight = 0;
    tot.traces++;
    for (int k = 0; k < tr->n; k++) {
        const tjob_t *j = &tr->jobs[k];
        if (j->lo > 0) {
            planner_levels_t lv;
            CHECK_MSG(planner_plan_levels(&lv, c, &j->pol, j->lo, j->hi, j->n_prompt, 0, bt,
                                          planner_kv_f32, NULL, &err) == AR_OK,
                      "levels of [%g, %g]: %s", j->lo, j->hi, err.msg);
            kv_geometry_t g;
            model_geometry(c, j->n_prompt, &g);
            for (int l = 0; l < lv.n; l++) {
                jobs[k].budgets[l] = lv.budgets[l];
                jobs[k].lv_plan1[l] = malloc((size_t)S * sizeof(size_t));
                memcpy(jobs[k].lv_plan1[l], lv.plans[l].bytes, (size_t)S * sizeof(size_t));
                jobs[k].lv_feat[l] = cost_plan_features(&g, &lv.plans[l], j->n_images);
            }
            jobs[k].n_levels = lv.n;
            planner_levels_free(&lv);
        } else {
            jobs[k].n_levels = 1;
            jobs[k].budgets[0] = j->pol.budget;
            jobs[k].lv_plan1[0] = image_plan(j, bt);
            kv_geometry_t g;
            model_geometry(c, j->n_prompt, &g);
            planner_plan_t plan;
            CHECK(planner_plan(&plan, c, &j->pol, j->n_prompt, bt, NULL, &err) == AR_OK);
            jobs[k].lv_feat[0] = cost_plan_features(&g, &plan, j->n_images);
            planner_plan_free(&plan);
        }
        for (int l = 0; l < jobs[k].n_levels; l++) {
            jobs[k].lv_kv[l] = malloc((size_t)S * sizeof(size_t));
            for (int t = 0; t < S; t++)
                jobs[k].lv_kv[l][t] = jobs[k].lv_plan1[l][t] * (size_t)j->n_images;
        }
        jobs[k].level = jobs[k].n_levels - 1;
        jobs[k].plan1 = jobs[k].lv_plan1[jobs[k].level];
        jobs[k].kv = jobs[k].lv_kv[jobs[k].level];
        jobs[k].tight = malloc((size_t)S * sizeof *jobs[k].tight);
        memcpy(jobs[k].tight, jobs[k].kv, (size_t)S * sizeof *jobs[k].tight);
        jobs[k].gen = (gen_job_t){.model = &model,
                                  .cond = j->cond,
                                  .uncond = j->uncond,
                                  .n_prompt = j->n_prompt,
                                  .n_images = j->n_images,
                                  .params = c->sampling,
                                  .seed = 1000 + (uint64_t)k,
                                  .policy = j->pol,
                                  .level_budgets = jobs[k].budgets};
        jobs[k].start = -1;
    }
    for (int it = 0; b && finished < tr->n && it < 100000; it++) {
        /* Nothing queued or running: skip to the next arrival. */
        batcher_stats_t st;
        batcher_stats(b, &st);
        if (st.running == 0 && st.waiting == 0 && next < tr->n && tr->jobs[next].arrive > it)
            it = tr->jobs[next].arrive;
        for (; next < tr->n && tr->jobs[next].arrive <= it; next++) {
            /* A job with a range brings its levels; one without none. */
            batcher_job_t bj = {.n_images = tr->jobs[next].n_images,
                                .steps = S,
                                .kv_bytes = jobs[next].kv,
                                .deadline = INFINITY,
                                .target =
                                    tr->jobs[next].objective > 0 ? target_at(&tr->jobs[next]) : 0,
                                .submitted = submitted_at(&tr->jobs[next]),
                                .step_features = jobs[next].lv_feat[jobs[next].n_levels - 1],
                                .work = &jobs[next].gen};
            if (tr->jobs[next].lo > 0) {
                bj.n_levels = jobs[next].n_levels;
                bj.level_kv_bytes = (const size_t *const *)jobs[next].lv_kv;
                bj.level_step_features = (const cost_features_t *const *)jobs[next].lv_feat;
            }
            CHECK(batcher_submit(b, &bj, &jobs[next].id) == BATCHER_ACCEPTED);
            rate_add(&rate, submitted_at(&tr->jobs[next]));
            jobs[next].state = 1;
            queue[q_len++] = next;
        }
        /* Cancellations seen at this iteration: a running job's blocks
         * return before anything is admitted, a waiting one leaves. */
        for (int k = 0; k < next; k++)
            if (jobs[k].state < 3 && !jobs[k].cancelled && tr->jobs[k].cancel_at >= 0 &&
                tr->jobs[k].cancel_at <= it) {
                jobs[k].cancelled = 1;
                CHECK(batcher_cancel(b, jobs[k].id, BATCHER_END_CANCELLED));
                for (int q = 0; q < q_len; q++)
                    if (queue[q] == k) {
                        memmove(queue + q, queue + q + 1, (size_t)(q_len - q - 1) * sizeof *queue);
                        q_len--;
                        break;
                    }
                if (jobs[k].state == 2)
                    jobs[k].state = 4; /* leaving: not in the brute force's running set */
            }
        /* What a brute force admits: the queue's head while it fits, at
         * the first (largest budget) level that fits. */
        int expect[MAX_JOBS], n_expect = 0;
        for (int q = 0; q < q_len; q++) {
            const int k = queue[q];
            int level = -1, room = -1;
            for (int l = 0; level < 0 && l < jobs[k].n_levels; l++) {
                tot.fits_checked++;
                if (!brute_fits(jobs, tr, it, jobs[k].lv_kv[l], S, capacity))
                    continue;
                if (room < 0) { /* the pool's level: time starts at the rate's, if lower */
                    room = l;
                    if (tr->timed && (l = brute_rate_level(jobs, tr, &rate, k, l, S)) > room &&
                        !brute_fits(jobs, tr, it, jobs[k].lv_kv[l], S, capacity))
                        continue;
                    /* late even alone at its floor: its floor, or it waits */
                    if (tr->timed && jobs[k].n_levels > 1 &&
                        brute_alone(jobs, tr, it, k, S) > target_at(&tr->jobs[k])) {
                        tot.late_floor++;
                        if ((l = jobs[k].n_levels - 1) > room &&
                            !brute_fits(jobs, tr, it, jobs[k].lv_kv[l], S, capacity))
                            continue;
                    }
                }
                if (!tr->timed || brute_time_fits(jobs, tr, it, k, l, S, &jobs[k].end))
                    level = l;
            }
            if (level < 0) {
                tot.refusals++;
                tot.time_waits += room >= 0;
                break;
            }
            tot.time_lower += level > room;
            expect[n_expect++] = k;
            jobs[k].level = level;
            jobs[k].tight = memcpy(jobs[k].tight, jobs[k].lv_kv[level], (size_t)S * sizeof(size_t));
            jobs[k].state = 2; /* counted as running for the next head */
            jobs[k].start = it;
        }
        for (int e = 0; e < n_expect; e++)
            jobs[expect[e]].state = 1;
        const int n_batch = batcher_admit(b, it);
        int admitted[MAX_JOBS];
        const int n_adm = replay_events(b, jobs, tr, it, &finished, admitted);
        int same = n_adm == n_expect;
        for (int e = 0; same && e < n_adm; e++)
            same = admitted[e] == expect[e];
        fits_mismatch += !same;
        if (!same)
            fprintf(stderr, "  iteration %d: the batcher admitted %d jobs, the brute force %d\n",
                    it, n_adm, n_expect);
        q_len -= n_adm;
        memmove(queue, queue + n_adm, (size_t)q_len * sizeof *queue);
        if (n_batch == 0) {
            if (q_len) {
                CHECK_MSG(0, "job %d waits on an empty pool", queue[0]);
                break;
            }
            continue;
        }
        tot.contention_iters += q_len > 0;
        /* During the step each request must stay within its own plan, and
         * each job within its tightened plan: a request's peak during the
         * step is what it holds now or later in the step (the engine tracks
         * it after every append, and for a layered policy after every layer). */
        int expect_blocks = kv_pool_blocks_in_use(&pool), any_layered = 0, step_of[MAX_JOBS];
        int held_now = 0;
        for (int k = 0; k < tr->n; k++) {
            step_of[k] = -1;
            if (jobs[k].state != 2)
                continue;
            step_of[k] = jobs[k].gen.images[0].step;
            for (int i = 0; i < tr->jobs[k].n_images; i++) {
                gen_request_t *g = &jobs[k].gen.images[i];
                const int now = kv_seq_blocks(&g->seq[0]) + kv_seq_blocks(&g->seq[1]);
                g->kv_peak_blocks = now;
                held_now += now;
                if (kv_policy_layered(g->policy_state[0]))
                    any_layered = 1;
                else
                    expect_blocks += request_blocks_during_next_step(g, bt) - now;
            }
        }
        const int in_use_before = kv_pool_blocks_in_use(&pool);
        const int rc = batcher_step(b, &err);
        CHECK_MSG(rc == AR_OK, "iteration %d: step: %s", it, err.msg);
        int sum_of_peaks = in_use_before - held_now;
        for (int k = 0; k < tr->n; k++) {
            if (step_of[k] < 0)
                continue;
            const tjob_t *j = &tr->jobs[k];
            const int step = step_of[k];
            size_t job_used = 0;
            for (int i = 0; i < j->n_images; i++) {
                const gen_request_t *g = &jobs[k].gen.images[i];
                const size_t used = (size_t)g->kv_peak_blocks * block,
                             planned = jobs[k].plan1[step];
                job_used += used;
                sum_of_peaks += g->kv_peak_blocks;
                tot.steps_checked++;
                if (used > planned) {
                    if (!over_plan++)
                        fprintf(stderr, "  job %d (%s) step %d: %zu bytes, planned %zu\n", k,
                                kv_policy_name(j->pol.kind), step, used, planned);
                } else if (used != planned && kv_policy_plan_exact(j->pol.kind)) {
                    if (!not_exact++)
                        fprintf(stderr, "  job %d (%s) step %d: %zu bytes, planned exactly %zu\n",
                                k, kv_policy_name(j->pol.kind), step, used, planned);
                } else if (used != planned) {
                    tot.under_bound[j->pol.kind]++;
                }
            }
            if (job_used > jobs[k].tight[step] && !over_tight++)
                fprintf(stderr, "  job %d (%s) step %d: %zu bytes, tightened plan %zu\n", k,
                        kv_policy_name(j->pol.kind), step, job_used, jobs[k].tight[step]);
        }
        batcher_finish(b, rc, &err);
        batcher_stats(b, &st);
        tot.iterations++;
        over_pool += st.last_kv_peak_bytes > capacity;
        over_reserved += st.last_kv_peak_bytes > st.last_reserved_bytes;
        /* Requests peak together unless a layered one peaks mid-step. */
        sum_mismatch +=
            any_layered ? pool.peak_in_use > sum_of_peaks : pool.peak_in_use != expect_blocks;
        /* The plans that tighten, from each running job's state now. */
        for (int k = 0; k < tr->n; k++) {
            const gen_request_t *g0 = &jobs[k].gen.images[0];
            if (jobs[k].state != 2 || g0->step >= S)
                continue;
            size_t left[KV_MAX_SEGMENTS * 64], one[KV_MAX_SEGMENTS * 64];
            const int n_left = S - g0->step;
            int told = 1;
            for (int t = 0; t < n_left; t++)
                left[t] = 0;
            for (int i = 0; told && i < tr->jobs[k].n_images; i++) {
                told = gen_request_remaining_bytes(&jobs[k].gen.images[i], one, n_left, &err) == 1;
                for (int t = 0; told && t < n_left; t++)
                    left[t] += one[t];
            }
            for (int t = 0; told && t < n_left; t++)
                if (left[t] < jobs[k].tight[g0->step + t]) {
                    jobs[k].tight[g0->step + t] = left[t];
                    tot.tightened++;
                }
        }
        replay_events(b, jobs, tr, it, &finished, admitted);
        if (rc != AR_OK)
            break;
    }
    CHECK_MSG(finished == tr->n, "%d of %d jobs ended", finished, tr->n);
    CHECK_MSG(fits_mismatch == 0, "%d admission decisions differ from the brute force",
              fits_mismatch);
    CHECK_MSG(over_plan == 0, "%d request-steps used more KV than planned", over_plan);
    CHECK_MSG(over_tight == 0, "%d job-steps used more KV than their tightened plan", over_tight);
    CHECK_MSG(not_exact == 0, "%d request-steps off their exact plan", not_exact);
    CHECK_MSG(over_pool == 0 && over_reserved == 0,
              "%d steps peaked over the pool, %d over the reservation", over_pool, over_reserved);
    CHECK_MSG(sum_mismatch == 0, "%d steps: pool peak differs from the heads' blocks",
              sum_mismatch);
    batcher_stats_t st = {0};
    if (b)
        batcher_stats(b, &st);
    CHECK(st.running == 0 && st.waiting == 0 && st.reserved_bytes == 0);
    batcher_destroy(b);
    for (int k = 0; k < tr->n; k++) {
        gen_job_free(&jobs[k].gen);
        for (int l = 0; l < jobs[k].n_levels; l++) {
            free(jobs[k].lv_plan1[l]);
            free(jobs[k].lv_kv[l]);
            free(jobs[k].lv_feat[l]);
        }
        free(jobs[k].tight);
    }
    CHECK(kv_pool_blocks_in_use(&pool) == 0 && pool.bad_frees == 0);
    kv_pool_free(&pool);
}

/* The replay over 40 traces; min_refusals: how often the head of the
 * queue must have waited for the traces to count as exercising admission. */
static void replay_traces(int min_refusals) {
    static const int sizes[] = {1, 2, 3, 4};
    char words[160];
    memset(&tot, 0, sizeof tot);
    memset(policy_count, 0, sizeof policy_count);
    rng_state = 20250501;
    const double t0 = now_s();
    const int failures_before = test_failures_in_current;
    for (int k = 0; k < 40 && test_failures_in_current == failures_before; k++) {
        trace_t tr;
        make_trace(&tr, MAX_JOBS, sizes, 4);
        replay(&tr);
    }
    fprintf(stderr,
            "  %lld traces in %.1f s, %lld iterations, %lld request-steps checked; %lld "
            "admissions, %lld "
            "refusals (the head of the queue waited), %lld iterations with a job waiting; "
            "cancelled %lld running, %lld waiting; %lld request-steps' plans tightened; "
            "budget ranges admitted %lld at their top, %lld below; for time objectives %lld "
            "heads waited, %lld went below the pool's budget and %lld late ones were tried at "
            "their floor; "
            "policies %s\n",
            tot.traces, now_s() - t0, tot.iterations, tot.steps_checked, tot.admissions,
            tot.refusals, tot.contention_iters, tot.cancelled_running, tot.cancelled_waiting,
            tot.tightened, tot.elastic_top, tot.elastic_below, tot.time_waits, tot.time_lower,
            tot.late_floor, policy_counts(words, sizeof words));
    /* The traces must exercise what they claim to (when none stopped early). */
    if (test_failures_in_current == failures_before) {
        CHECK(tot.refusals > min_refusals && tot.cancelled_running > 0 &&
              tot.cancelled_waiting > 0);
        const kv_policy_kind_t *kinds = by_scale() ? scale_kinds : raster_kinds;
        for (int k = 0; k < n_kinds(); k++) {
            CHECK(policy_count[k] > 20);
            /* The policy table calls this plan a worst case: some run
             * held less (else the table should call it exact). */
            CHECK_MSG(kv_policy_plan_exact(kinds[k]) || tot.under_bound[kinds[k]] > 0,
                      "%s: planned as a worst case, yet every request-step used its plan",
                      kv_policy_name(kinds[k]));
        }
        CHECK_MSG(tot.tightened > 0, "no plan ever tightened");
        CHECK_MSG(tot.time_waits > 0 && tot.time_lower > 0 && tot.late_floor > 0,
                  "time objectives: %lld heads waited, %lld went lower, %lld late ones at their "
                  "floor: all must happen",
                  tot.time_waits, tot.time_lower, tot.late_floor);
        CHECK_MSG(tot.elastic_top > 0 && tot.elastic_below > 0,
                  "budget ranges admitted %lld times at their top, %lld below: both must happen",
                  tot.elastic_top, tot.elastic_below);
    }
}

static void test_replayed_traces_within_plan_and_admission_exact(void) { replay_traces(50); }

static void test_multiscale_replayed_traces_within_plan_and_admission_exact(void) {
    replay_traces(50);
}

/* The brute force is not vacuous: an admission that passes the pool at a
 * future iteration is caught by it (and by planner_fits). */
static void test_brute_force_catches_a_late_overflow(void) {
    const int S = model_steps(&model.cfg);
    trace_t tr = {.n = 1};
    kv_policy_defaults(&tr.jobs[0].pol, KV_POLICY_FULL);
    tr.jobs[0].n_images = 1;
    tr.jobs[0].n_prompt = 4;
    size_t *a = image_plan(&tr.jobs[0], 1);
    /* A pool that holds a's peak plus a's step-0 bytes, but not two peaks. */
    const size_t capacity = a[S - 1] + a[0];
    rjob_t run[1] = {{.plan1 = a, .state = 2, .start = 0}};
    planner_t pl;
    planner_init(&pl, capacity);
    CHECK(planner_add(&pl, 0, a, S) == AR_OK);
    /* At iteration 0 the same request again peaks together with a: no. */
    CHECK(!brute_fits(run, &tr, 0, a, S, capacity) && !planner_fits(&pl, a, S));
    /* At iteration S - 1 only a's last step overlaps the newcomer's first. */
    for (int t = 0; t < S - 1; t++)
        planner_tick(&pl);
    CHECK(brute_fits(run, &tr, S - 1, a, S, capacity) && planner_fits(&pl, a, S));
    planner_free(&pl);
    free(a);
}

/* ---- 2: the real scheduler ---------------------------------------------------------- */

static double metric_in(const char *text, const char *name) {
    const char *p = text;
    const size_t n = strlen(name);
    while ((p = strstr(p, name))) {
        if ((p == text || p[-1] == '\n') && p[n] == ' ')
            return atof(p + n + 1);
        p += n;
    }
    return -1;
}

static sched_outcome_t wait_job(sched_job_t *j, double timeout_s, sched_snapshot_t *snap) {
    const double until = now_s() + timeout_s;
    sched_job_snapshot(j, snap);
    while (snap->outcome == SCHED_PENDING && now_s() < until)
        sched_job_wait(j, snap->version, 1.0, snap);
    return snap->outcome;
}

static void run_scheduler_trace(const trace_t *tr, long long *iterations, long long *peak_waiting) {
    metrics_t *metrics = metrics_create();
    ar_error_t err = {{0}};
    sched_options_t so = {.max_running = 64,
                          .max_waiting = 64,
                          .kv_pool_bytes = tr->pool_bytes,
                          .kv_block_tokens = tr->block_tokens,
                          .png_workers = 1};
    scheduler_t *s = scheduler_create(&model, &so, metrics, &err);
    if (!s) {
        CHECK_MSG(0, "%s", err.msg);
        metrics_destroy(metrics);
        return;
    }
    const size_t capacity = sched_kv_capacity_bytes(s);
    CHECK(sched_kv_block_tokens(s) == tr->block_tokens && capacity <= tr->pool_bytes);
    sched_job_t *jobs[MAX_JOBS] = {0};
    int submitted = 0, cancelled[MAX_JOBS] = {0}, over_gauge = 0;
    const struct timespec nap = {0, 200 * 1000};
    for (int spins = 0; spins < 2000000; spins++) {
        char *text = metrics_render(metrics);
        const double iters = text ? metric_in(text, "arserve_iterations_total") : 0;
        if (text) {
            over_gauge += metric_in(text, "arserve_kv_pool_used_bytes") > (double)capacity;
            over_gauge += metric_in(text, "arserve_kv_pool_reserved_bytes") > (double)capacity;
            const double w = metric_in(text, "arserve_requests_waiting");
            if (w > *peak_waiting)
                *peak_waiting = (long long)w;
        }
        free(text);
        /* Arrivals at their iteration, or at once when the server is idle
         * (iterations only advance while something runs). */
        while (submitted < tr->n &&
               (tr->jobs[submitted].arrive <= iters || sched_active_jobs(s) == 0)) {
            const tjob_t *j = &tr->jobs[submitted];
            sched_request_t rq = {.cond = j->cond,
                                  .uncond = j->uncond,
                                  .n_prompt = j->n_prompt,
                                  .n_images = j->n_images,
                                  .params = model.cfg.sampling,
                                  .seed = 77 + (uint64_t)submitted,
                                  .kv_policy = j->pol,
                                  .kv_budget_min = j->lo,
                                  .timeout_s = 120};
            if (j->lo > 0)
                rq.kv_policy.budget = j->hi;
            sched_refusal_info_t why;
            jobs[submitted] = sched_submit(s, &rq, &why);
            CHECK_MSG(jobs[submitted] != NULL, "job %d: %s", submitted, why.message);
            if (!jobs[submitted])
                break;
            submitted++;
        }
        for (int k = 0; k < submitted; k++)
            if (!cancelled[k] && tr->jobs[k].cancel_at >= 0 && tr->jobs[k].cancel_at <= iters) {
                sched_job_cancel(s, jobs[k]);
                cancelled[k] = 1;
            }
        if (submitted == tr->n && sched_active_jobs(s) == 0)
            break;
        nanosleep(&nap, NULL);
    }
    for (int k = 0; k < submitted; k++) {
        sched_snapshot_t snap;
        const sched_outcome_t o = wait_job(jobs[k], 60, &snap);
        /* A cancelled job ends cancelled (or done, if it finished first). */
        if (cancelled[k])
            CHECK_MSG(o == SCHED_DONE || o == SCHED_CANCELLED, "cancelled job %d ended as %d: %s",
                      k, (int)o, snap.message);
        else
            CHECK_MSG(o == SCHED_DONE, "job %d (%s, n=%d) ended as %d: %s", k,
                      kv_policy_name(tr->jobs[k].pol.kind), tr->jobs[k].n_images, (int)o,
                      snap.message);
        /* A range ran at a budget of its range. */
        if (o == SCHED_DONE && tr->jobs[k].lo > 0)
            CHECK_MSG(snap.kv_policy.budget >= tr->jobs[k].lo &&
                          snap.kv_policy.budget <= tr->jobs[k].hi,
                      "job %d ran at budget %g, outside [%g, %g]", k, snap.kv_policy.budget,
                      tr->jobs[k].lo, tr->jobs[k].hi);
        sched_job_release(jobs[k]);
    }
    CHECK_MSG(submitted == tr->n, "%d of %d jobs submitted", submitted, tr->n);
    scheduler_stop(s);
    char *text = metrics_render(metrics);
    CHECK_MSG(sched_kv_overruns(s) == 0, "%lld iterations used more KV than planned",
              sched_kv_overruns(s));
    CHECK(text && metric_in(text, "arserve_kv_plan_overruns_total") == 0);
    CHECK_MSG(over_gauge == 0, "the pool gauges passed the capacity %d times", over_gauge);
    if (text)
        *iterations += (long long)metric_in(text, "arserve_iterations_total");
    free(text);
    scheduler_destroy(s);
    metrics_destroy(metrics);
}

static void scheduler_traces(void) {
    static const int sizes[] = {1, 3};
    rng_state = 777;
    memset(policy_count, 0, sizeof policy_count);
    long long iterations = 0, peak_waiting = 0;
    const double t0 = now_s();
    const int failures_before = test_failures_in_current;
    int k;
    for (k = 0; k < 6 && test_failures_in_current == failures_before; k++) {
        trace_t tr;
        make_trace(&tr, 12, sizes, 2);
        run_scheduler_trace(&tr, &iterations, &peak_waiting);
    }
    char words[160];
    fprintf(
        stderr,
        "  %d traces through the scheduler in %.1f s, %lld iterations, up to %lld jobs waiting; "
        "policies %s\n",
        k, now_s() - t0, iterations, peak_waiting, policy_counts(words, sizeof words));
    CHECK(iterations > 0);
}

static void test_scheduler_traces_never_overrun(void) { scheduler_traces(); }
static void test_multiscale_scheduler_traces_never_overrun(void) { scheduler_traces(); }

int main(void) {
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-unit sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    be = backend_cpu_create(1, &err);
    if (!be || model_load(&model, tiny, be, &err) != AR_OK) {
        fprintf(stderr, "%s\n0 passed, 1 failed\n", err.msg);
        return 1;
    }
    TEST_RUN(test_brute_force_catches_a_late_overflow);
    TEST_RUN(test_replayed_traces_within_plan_and_admission_exact);
    TEST_RUN(test_scheduler_traces_never_overrun);
    model_free(&model);
    /* The same on the tiny next-scale model. */
    var_tiny = getenv("ARSERVE_VAR_TINY_MODEL");
    if (!var_tiny || model_load(&model, var_tiny, be, &err) != AR_OK) {
        fprintf(stderr, "not ok  the tiny next-scale model: %s\n",
                var_tiny ? err.msg : "ARSERVE_VAR_TINY_MODEL is not set (make test-unit sets it)");
        test_failed++;
    } else {
        /* heatkv runs on an ordering by head number (its bytes do not
         * depend on which heads go first). */
        kv_geometry_t g;
        kv_calibration_t calib;
        model_geometry(&model.cfg, 1, &g);
        if (kv_calibration_synthetic(&calib, &g, 1, &err) != AR_OK) {
            fprintf(stderr, "not ok  a calibration for the tiny next-scale model: %s\n", err.msg);
            test_failed++;
        } else {
            /* Attention statistics for scalekv's classification. */
            const size_t T = (size_t)g.n_layers * g.n_heads, K = (size_t)g.n_segments;
            for (size_t i = 0; calib.beta && i < T * K * K; i++)
                calib.beta[i] = (float)rnd_unit();
            for (size_t i = 0; calib.htr && i < T * K; i++)
                calib.htr[i] = (float)rnd_unit();
            kv_calibration_set_t one = {.n = 1, .c = {calib}};
            model.cfg.kv_calibrations = &one;
            TEST_RUN(test_multiscale_replayed_traces_within_plan_and_admission_exact);
            TEST_RUN(test_multiscale_scheduler_traces_never_overrun);
            model.cfg.kv_calibrations = NULL;
            kv_calibration_free(&calib);
        }
        model_free(&model);
    }
    be->destroy(be);
    return TEST_SUMMARY();
}
