/* The KV planner's property test (issue 5), on the tiny model with the
 * real policies (engine/kv_policy.c), the real pool and the real planner.
 * Random arrival traces mix policies and budgets that suit the 8 x 8 grid
 * (full, streaming, linear at budget >= 1/2, headkv with a small buffer and
 * window), prompt lengths, n = 1..2 images and cancellations, against a
 * pool of two to three and a half full-cache images.
 *
 * 1. Replayed deterministically, iteration by iteration, the way the
 *    scheduler's engine loop does it (drop cancelled, admit FIFO through
 *    planner_fits, one batched gen_step, planner_tick, retire): the pool's
 *    measured peak in every step stays within the pool and within what the
 *    planner reserved; each request's own use during every step (its heads'
 *    blocks after the append, before any compaction) stays within its
 *    planned trajectory, and equals it for full, streaming and linear; and
 *    admission is exact: every planner_fits answer equals a brute-force
 *    check that sums every admitted request's whole trajectory from the
 *    iteration it started, at every future iteration. So the planner never
 *    refuses a request (the head of the queue) that would have fitted, and
 *    never admits one that would not.
 * 2. The same kind of traces through the real scheduler (threads, batching,
 *    cancellation): arrivals and cancellations are keyed to its iteration
 *    counter; every job that was not cancelled finishes, the pool gauges
 *    never pass the capacity, and arserve_kv_plan_overruns_total (the
 *    scheduler's check of the measured peak against the reservation at
 *    every iteration) stays 0. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/generate.h"
#include "engine/kv_pool.h"
#include "engine/planner.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "tests/test.h"

static const char *tiny;

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
} tjob_t;

typedef struct trace {
    int n;
    tjob_t jobs[MAX_JOBS];
    size_t pool_bytes;
    int block_tokens;
} trace_t;

static long long policy_count[4];

/* A policy with random knobs that validate on this request's geometry. */
static kv_policy_params_t random_policy(int n_prompt) {
    const kv_geometry_t g = planner_geometry(&model.cfg, n_prompt);
    for (;;) {
        kv_policy_params_t p;
        const int kind = rnd_in(0, 3);
        kv_policy_defaults(&p, (kv_policy_kind_t)kind);
        switch (kind) {
        case KV_POLICY_STREAMING:
            p.budget = 0.3 + 0.7 * rnd_unit();
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
        default:
            break;
        }
        if (kv_policy_validate(&p, &g, NULL) == AR_OK) {
            policy_count[kind]++;
            return p;
        }
    }
}

/* One request's trajectory (per image) in bytes; caller frees. */
static size_t *image_plan(const tjob_t *j, int bt) {
    const int S = planner_steps(&model.cfg);
    size_t *b = malloc((size_t)S * sizeof *b);
    ar_error_t err = {{0}};
    if (planner_trajectory_bytes(&model.cfg, &j->pol, j->n_prompt, bt, b, &err) != AR_OK) {
        CHECK_MSG(0, "planner_trajectory_bytes: %s", err.msg);
        memset(b, 0, (size_t)S * sizeof *b);
    }
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
    const size_t one = peak_of(b, planner_steps(&model.cfg));
    free(b);
    const size_t block = kv_pool_block_bytes(tr->block_tokens, model.cfg.llm.head_dim);
    tr->pool_bytes = (size_t)((2.0 + 1.5 * rnd_unit()) * (double)one) / block * block;
    int t = 0;
    for (int k = 0; k < tr->n; k++) {
        tjob_t *j = &tr->jobs[k];
        t += rnd() % 5 < 2 ? 0 : rnd_in(1, 24); /* bursts and gaps */
        j->arrive = t;
        j->n_images = rnd_in(1, 2);
        int ids[MAX_IDS], n_ids = rnd_in(1, MAX_IDS);
        for (int i = 0; i < n_ids; i++)
            ids[i] = rnd_in(4, model.cfg.llm.vocab_size - 1);
        ar_error_t err = {{0}};
        CHECK_MSG(model_prompt_from_ids(&model, ids, n_ids, j->cond, j->uncond, &j->n_prompt,
                                        &err) == AR_OK,
                  "%s", err.msg);
        j->pol = random_policy(j->n_prompt);
        j->cancel_at = rnd() % 5 == 0 ? j->arrive + rnd_in(0, 90) : -1;
    }
}

/* ---- 1: deterministic replay ---------------------------------------------------------- */

typedef struct live {
    int job;
    int start; /* iteration of its step 0 */
    gen_request_t gens[2];
    size_t *plan1; /* per image */
} live_t;

typedef struct totals {
    long long traces, iterations, admissions, refusals, fits_checked, steps_checked;
    long long cancelled_running, cancelled_waiting, contention_iters;
} totals_t;

static totals_t tot;

/* Bytes the brute force sees at absolute iteration u: every running
 * request's whole trajectory laid from the iteration it started. */
static int brute_fits(const live_t *run, int n_run, const trace_t *tr, int now, const size_t *cand,
                      int S, size_t capacity) {
    for (int u = now; u < now + S; u++) {
        size_t total = cand[u - now];
        for (int r = 0; r < n_run; r++) {
            const int k = u - run[r].start;
            if (k >= 0 && k < S)
                total += run[r].plan1[k] * (size_t)tr->jobs[run[r].job].n_images;
        }
        if (total > capacity)
            return 0;
    }
    return 1;
}

/* Blocks a request's heads hold now (both sequences, every layer and head). */
static int request_blocks(const gen_request_t *g) {
    const int H = model.cfg.llm.num_layers * model.cfg.llm.num_kv_heads;
    int n = 0;
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < H; h++)
            n += g->seq[s].heads[h].n_blocks;
    return n;
}

/* Blocks a request's heads need during its next step: each head's length
 * plus the rows the step feeds (the prompt at step 0, else one token). */
static int request_blocks_during_next_step(const gen_request_t *g, int bt) {
    const int H = model.cfg.llm.num_layers * model.cfg.llm.num_kv_heads;
    const int fed = g->step == 0 ? g->n_prompt : 1;
    int n = 0;
    for (int s = 0; s < 2; s++)
        for (int h = 0; h < H; h++)
            n += (g->seq[s].heads[h].len + fed + bt - 1) / bt;
    return n;
}

static void replay(const trace_t *tr) {
    const model_config_t *c = &model.cfg;
    const int S = planner_steps(c), bt = tr->block_tokens;
    const size_t block = kv_pool_block_bytes(bt, c->llm.head_dim);
    kv_pool_t pool;
    ar_error_t err = {{0}};
    if (kv_pool_init(&pool, be, (int)(tr->pool_bytes / block), bt, c->llm.head_dim, &err) !=
        AR_OK) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    const size_t capacity = kv_pool_capacity_bytes(&pool);
    planner_t pl;
    planner_init(&pl, capacity);
    live_t run[2 * MAX_JOBS];
    int n_run = 0, queue[MAX_JOBS], q_head = 0, q_len = 0, next = 0, finished = 0;
    int over_pool = 0, over_reserved = 0, over_plan = 0, not_exact = 0, sum_mismatch = 0;
    int fits_mismatch = 0;
    tot.traces++;
    for (int it = 0; finished < tr->n && it < 100000; it++) {
        /* Nothing queued or running: skip to the next arrival. */
        if (n_run == 0 && q_len == 0 && next < tr->n && tr->jobs[next].arrive > it)
            it = tr->jobs[next].arrive;
        while (next < tr->n && tr->jobs[next].arrive <= it)
            queue[(q_head + q_len++) % MAX_JOBS] = next++;
        /* Cancelled running requests leave first; their blocks return now. */
        for (int r = 0; r < n_run;) {
            const tjob_t *j = &tr->jobs[run[r].job];
            if (j->cancel_at < 0 || j->cancel_at > it) {
                r++;
                continue;
            }
            for (int i = 0; i < j->n_images; i++)
                gen_request_free(&run[r].gens[i]);
            planner_remove(&pl, (uint64_t)run[r].job);
            free(run[r].plan1);
            finished++;
            tot.cancelled_running++;
            run[r] = run[--n_run];
        }
        /* Admission: FIFO, the head blocks the queue. */
        while (q_len) {
            const int k = queue[q_head];
            const tjob_t *j = &tr->jobs[k];
            if (j->cancel_at >= 0 && j->cancel_at <= it) {
                q_head = (q_head + 1) % MAX_JOBS;
                q_len--;
                finished++;
                tot.cancelled_waiting++;
                continue;
            }
            size_t *p1 = image_plan(j, bt), *pn = malloc((size_t)S * sizeof *pn);
            for (int t = 0; t < S; t++)
                pn[t] = p1[t] * (size_t)j->n_images;
            const int fits = planner_fits(&pl, pn, S);
            const int brute = brute_fits(run, n_run, tr, it, pn, S, capacity);
            tot.fits_checked++;
            fits_mismatch += fits != brute;
            if (fits != brute)
                fprintf(stderr, "  iteration %d, job %d: planner_fits %d, brute force %d\n", it, k,
                        fits, brute);
            if (!fits) {
                tot.refusals++;
                free(p1);
                free(pn);
                if (n_run == 0) {
                    CHECK_MSG(0, "job %d waits on an empty pool", k);
                    goto done;
                }
                break;
            }
            CHECK(planner_add(&pl, (uint64_t)k, pn, S) == AR_OK);
            free(pn);
            live_t *l = &run[n_run++];
            l->job = k;
            l->start = it;
            l->plan1 = p1;
            sampler_params_t sp = c->sampling;
            for (int i = 0; i < j->n_images; i++)
                CHECK_MSG(gen_request_init(&l->gens[i], &model, &pool, &j->pol, j->cond, j->uncond,
                                           j->n_prompt, &sp, 1000 + (uint64_t)k, (uint64_t)i,
                                           &err) == AR_OK,
                          "%s", err.msg);
            tot.admissions++;
            q_head = (q_head + 1) % MAX_JOBS;
            q_len--;
        }
        if (n_run == 0)
            continue;
        if (q_len)
            tot.contention_iters++;
        /* One batched step: during it, each request must stay within its
         * own plan, and the pool within the reservation and the pool. */
        gen_request_t *batch[2 * MAX_JOBS];
        int nb = 0, expect_blocks = kv_pool_blocks_in_use(&pool);
        for (int r = 0; r < n_run; r++) {
            const tjob_t *j = &tr->jobs[run[r].job];
            const int step = run[r].gens[0].step;
            for (int i = 0; i < j->n_images; i++) {
                gen_request_t *g = &run[r].gens[i];
                const int now = request_blocks(g), during = request_blocks_during_next_step(g, bt);
                expect_blocks += during - now;
                const size_t used = (size_t)during * block, planned = run[r].plan1[step];
                tot.steps_checked++;
                if (used > planned) {
                    if (!over_plan++)
                        fprintf(stderr, "  job %d (%s) step %d: %zu bytes, planned %zu\n",
                                run[r].job, kv_policy_name(j->pol.kind), step, used, planned);
                } else if (used != planned && j->pol.kind != KV_POLICY_HEADKV) {
                    if (!not_exact++)
                        fprintf(stderr, "  job %d (%s) step %d: %zu bytes, planned exactly %zu\n",
                                run[r].job, kv_policy_name(j->pol.kind), step, used, planned);
                }
                batch[nb++] = g;
            }
        }
        kv_pool_reset_peak(&pool);
        if (gen_step(batch, nb, &err) != AR_OK) {
            CHECK_MSG(0, "iteration %d: gen_step: %s", it, err.msg);
            goto done;
        }
        tot.iterations++;
        const size_t peak = (size_t)pool.peak_in_use * block;
        over_pool += peak > capacity;
        over_reserved += peak > planner_reserved_now(&pl);
        sum_mismatch += pool.peak_in_use != expect_blocks;
        planner_tick(&pl);
        for (int r = 0; r < n_run;) {
            if (!gen_request_done(&run[r].gens[0])) {
                r++;
                continue;
            }
            const tjob_t *j = &tr->jobs[run[r].job];
            for (int i = 0; i < j->n_images; i++)
                gen_request_free(&run[r].gens[i]);
            planner_remove(&pl, (uint64_t)run[r].job);
            free(run[r].plan1);
            finished++;
            run[r] = run[--n_run];
        }
    }
done:
    CHECK_MSG(finished == tr->n, "%d of %d jobs ended", finished, tr->n);
    CHECK_MSG(fits_mismatch == 0, "%d admission decisions differ from the brute force",
              fits_mismatch);
    CHECK_MSG(over_plan == 0, "%d request-steps used more KV than planned", over_plan);
    CHECK_MSG(not_exact == 0, "%d request-steps of full/streaming/linear off their exact plan",
              not_exact);
    CHECK_MSG(over_pool == 0 && over_reserved == 0,
              "%d steps peaked over the pool, %d over the reservation", over_pool, over_reserved);
    CHECK_MSG(sum_mismatch == 0, "%d steps: pool peak differs from the heads' blocks",
              sum_mismatch);
    for (int r = 0; r < n_run; r++) {
        for (int i = 0; i < tr->jobs[run[r].job].n_images; i++)
            gen_request_free(&run[r].gens[i]);
        free(run[r].plan1);
    }
    CHECK(kv_pool_blocks_in_use(&pool) == 0 && pool.bad_frees == 0);
    CHECK(pl.n == 0 || n_run > 0);
    planner_free(&pl);
    kv_pool_free(&pool);
}

static void test_replayed_traces_within_plan_and_admission_exact(void) {
    static const int sizes[] = {1, 2, 3, 4};
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
            "cancelled %lld running, %lld waiting; policies full %lld, streaming %lld, linear "
            "%lld, headkv %lld\n",
            tot.traces, now_s() - t0, tot.iterations, tot.steps_checked, tot.admissions,
            tot.refusals, tot.contention_iters, tot.cancelled_running, tot.cancelled_waiting,
            policy_count[0], policy_count[1], policy_count[2], policy_count[3]);
    /* The traces must exercise what they claim to (when none stopped early). */
    if (test_failures_in_current == failures_before) {
        CHECK(tot.refusals > 50 && tot.cancelled_running > 0 && tot.cancelled_waiting > 0);
        for (int k = 0; k < 4; k++)
            CHECK(policy_count[k] > 20);
    }
}

/* The brute force is not vacuous: an admission that passes the pool at a
 * future iteration is caught by it (and by planner_fits). */
static void test_brute_force_catches_a_late_overflow(void) {
    const int S = planner_steps(&model.cfg);
    trace_t tr = {.n = 2};
    kv_policy_defaults(&tr.jobs[0].pol, KV_POLICY_FULL);
    tr.jobs[0].n_images = 1;
    tr.jobs[0].n_prompt = 4;
    size_t *a = image_plan(&tr.jobs[0], 1);
    /* A pool that holds a's peak plus a's step-0 bytes, but not two peaks. */
    const size_t capacity = a[S - 1] + a[0];
    live_t run[1] = {{.job = 0, .start = 0, .plan1 = a}};
    planner_t pl;
    planner_init(&pl, capacity);
    CHECK(planner_add(&pl, 0, a, S) == AR_OK);
    /* At iteration 0 the same request again peaks together with a: no. */
    CHECK(!brute_fits(run, 1, &tr, 0, a, S, capacity) && !planner_fits(&pl, a, S));
    /* At iteration S - 1 only a's last step overlaps the newcomer's first. */
    for (int t = 0; t < S - 1; t++)
        planner_tick(&pl);
    CHECK(brute_fits(run, 1, &tr, S - 1, a, S, capacity) && planner_fits(&pl, a, S));
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

static job_state_t wait_job(sched_job_t *j, double timeout_s) {
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += (time_t)timeout_s;
    pthread_mutex_lock(&j->mu);
    while (j->state != JOB_DONE && j->state != JOB_FAILED)
        if (pthread_cond_timedwait(&j->changed, &j->mu, &until) != 0)
            break;
    job_state_t st = j->state;
    pthread_mutex_unlock(&j->mu);
    return st;
}

static void run_scheduler_trace(const trace_t *tr, long long *iterations, long long *peak_waiting) {
    metrics_t *metrics = metrics_create();
    ar_error_t err = {{0}};
    sched_options_t so = {.max_running = 64,
                          .max_waiting = 64,
                          .request_timeout_s = 120,
                          .kv_pool_bytes = tr->pool_bytes,
                          .kv_block_tokens = tr->block_tokens,
                          .png_workers = 1,
                          .retry_after_s = 1};
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
            sampler_params_t sp = model.cfg.sampling;
            sched_job_t *sj = sched_job_create(j->cond, j->uncond, j->n_prompt, j->n_images, &sp,
                                               77 + (uint64_t)submitted, 0, 120);
            sj->kv_policy = j->pol;
            api_error_t ae = {0};
            CHECK_MSG(sched_submit(s, sj, &ae) == AR_OK, "job %d: %s", submitted, ae.message);
            jobs[submitted++] = sj;
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
        const job_state_t st = wait_job(jobs[k], 60);
        /* A cancelled job ends with a 504 (or done, if it finished first);
         * one still waiting is told its deadline passed. */
        if (cancelled[k])
            CHECK_MSG(st == JOB_DONE || (st == JOB_FAILED && jobs[k]->error.status == 504),
                      "cancelled job %d ended in state %d: %s", k, (int)st, jobs[k]->error.message);
        else
            CHECK_MSG(st == JOB_DONE, "job %d (%s, n=%d) ended in state %d: %s", k,
                      kv_policy_name(tr->jobs[k].pol.kind), tr->jobs[k].n_images, (int)st,
                      jobs[k]->error.message);
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

static void test_scheduler_traces_never_overrun(void) {
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
    fprintf(
        stderr,
        "  %d traces through the scheduler in %.1f s, %lld iterations, up to %lld jobs waiting; "
        "policies full %lld, streaming %lld, linear %lld, headkv %lld\n",
        k, now_s() - t0, iterations, peak_waiting, policy_count[0], policy_count[1],
        policy_count[2], policy_count[3]);
    CHECK(iterations > 0);
}

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
    be->destroy(be);
    return TEST_SUMMARY();
}
