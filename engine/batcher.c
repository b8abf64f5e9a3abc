/* The batching core (batcher.h): a FIFO ring of waiting jobs, the running
 * set, the planner that admits by whole KV trajectories, and an event log. */
#include "engine/batcher.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/batcher_test.h"
#include "engine/planner.h"

typedef struct slot {
    uint64_t id;
    batcher_job_t job;
    int steps_done;
    int cancel;   /* 0, or the batcher_end_t + 1 asked for by batcher_cancel */
    int reserved; /* waiting with max_waiting 0: its KV is in the planner already */
    int level;    /* the level it runs at (reserved: chosen at submission) */
    /* Why it has waited at an admission (the pool or max_running; the
     * time objectives), and what decided its admission. */
    int waited_memory, waited_time;
    batcher_regime_t regime;
    double predicted_end;
} slot_t;

struct batcher {
    batcher_options_t opt;
    batcher_ops_t ops;
    void *ctx;
    planner_t planner;
    slot_t *waiting; /* ring of w_cap slots */
    int w_head, w_count, w_cap;
    slot_t *running; /* max_running slots: every job has an image at least */
    int n_running, running_images;
    void **batch; /* the work the next step advances, fixed by batcher_admit */
    int n_batch;
    size_t batch_peak;
    uint64_t next_id;
    int draining;
    batcher_event_t *events;
    int n_events, cap_events;
    long long iterations, overruns, lost_events; /* iterations: stepped so far */
    unsigned long long released;                 /* bytes freed by tighter plans */
    size_t *left;                                /* tighten's buffer, cap_left entries */
    int cap_left;
    int last_jobs, last_images;
    size_t last_reserved, last_peak;
    cost_features_t last_features;
    int last_features_known;
    /* Time objectives (batcher_set_costs): the table, and scratch for the
     * running jobs' future iterations (cap_future of each). */
    int costs_on;
    cost_table_t costs;
    /* The arrival rate (jobs per unit of the driver's clock): a running
     * mean of the gaps between the jobs' submitted times. */
    double last_submitted, mean_gap;
    int n_gaps;
    cost_features_t *load;
    double *t_without, *t_with;
    int cap_future;
};

static const char *const refusal_names[] = {
    "accepted", "draining", "too_large", "too_many_images", "queue_full", "invalid", "no_memory"};
static const char *const end_names[] = {"finished", "cancelled", "expired", "failed", "shutdown"};
static const char *const regime_names[] = {"free", "memory", "time"};

const char *batcher_regime_name(batcher_regime_t r) {
    return (unsigned)r < sizeof regime_names / sizeof *regime_names ? regime_names[r] : "?";
}

const char *batcher_refusal_name(batcher_refusal_t r) {
    return (unsigned)r < sizeof refusal_names / sizeof *refusal_names ? refusal_names[r] : "?";
}

const char *batcher_end_name(batcher_end_t e) {
    return (unsigned)e < sizeof end_names / sizeof *end_names ? end_names[e] : "?";
}

/* ---- events ---- */

static batcher_event_t *push_event(batcher_t *b, batcher_event_type_t type, const slot_t *s) {
    if (b->n_events == b->cap_events) {
        int cap = b->cap_events ? 2 * b->cap_events : 64;
        batcher_event_t *e = realloc(b->events, (size_t)cap * sizeof *e);
        if (!e) {
            b->lost_events++;
            return NULL;
        }
        b->events = e;
        b->cap_events = cap;
    }
    batcher_event_t *e = &b->events[b->n_events++];
    memset(e, 0, sizeof *e);
    e->type = type;
    e->id = s->id;
    e->work = s->job.work;
    e->iteration = b->iterations; /* the one in progress */
    e->steps_done = s->steps_done;
    e->level = s->level;
    e->regime = s->regime;
    e->predicted_end = s->predicted_end;
    return e;
}

static void push_end(batcher_t *b, const slot_t *s, batcher_end_t how, int started,
                     const char *why) {
    batcher_event_t *e = push_event(b, BATCHER_ENDED, s);
    if (!e)
        return;
    e->end = how;
    e->started = started;
    if (why)
        snprintf(e->why, sizeof e->why, "%.*s", (int)sizeof e->why - 1, why);
}

int batcher_take_events(batcher_t *b, batcher_event_t *out, int cap) {
    int n = b->n_events < cap ? b->n_events : cap;
    if (n <= 0)
        return 0;
    memcpy(out, b->events, (size_t)n * sizeof *out);
    memmove(b->events, b->events + n, (size_t)(b->n_events - n) * sizeof *b->events);
    b->n_events -= n;
    return n;
}

/* ---- life cycle ---- */

batcher_t *batcher_create(const batcher_options_t *opt, const batcher_ops_t *ops, void *ctx,
                          ar_error_t *err) {
    if (opt->max_running < 1 || opt->max_waiting < 0 || !ops || !ops->step) {
        ar_errorf(err,
                  "batcher: max_running %d and max_waiting %d (and a step function) are "
                  "needed",
                  opt->max_running, opt->max_waiting);
        return NULL;
    }
    batcher_t *b = calloc(1, sizeof *b);
    if (!b) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    b->opt = *opt;
    b->ops = *ops;
    b->ctx = ctx;
    /* Without a queue, jobs accepted for the next admission wait there: at
     * most one per running image. */
    b->w_cap = opt->max_waiting > 0 ? opt->max_waiting : opt->max_running;
    b->waiting = calloc((size_t)b->w_cap, sizeof *b->waiting);
    b->running = calloc((size_t)opt->max_running, sizeof *b->running);
    b->batch = calloc((size_t)opt->max_running, sizeof *b->batch);
    if (!b->waiting || !b->running || !b->batch) {
        batcher_destroy(b);
        ar_errorf(err, "out of memory for a batcher of %d running and %d waiting jobs",
                  opt->max_running, opt->max_waiting);
        return NULL;
    }
    planner_init(&b->planner, opt->pool_bytes);
    return b;
}

void batcher_destroy(batcher_t *b) {
    if (!b)
        return;
    for (int i = 0; i < b->n_running; i++)
        if (b->ops.stop)
            b->ops.stop(b->ctx, b->running[i].job.work);
    planner_free(&b->planner);
    free(b->waiting);
    free(b->running);
    free(b->batch);
    free(b->events);
    free(b->left);
    free(b->load);
    free(b->t_without);
    free(b->t_with);
    free(b);
}

/* ---- the queue ---- */

static slot_t *waiting_at(batcher_t *b, int i) { return &b->waiting[(b->w_head + i) % b->w_cap]; }

/* Removes the i-th waiting job, keeping the others in order. */
static void waiting_remove(batcher_t *b, int i) {
    for (int k = i; k + 1 < b->w_count; k++)
        *waiting_at(b, k) = *waiting_at(b, k + 1);
    b->w_count--;
}

/* Ends the i-th waiting job as how, giving back the KV reserved for it. */
static void waiting_end(batcher_t *b, int i, batcher_end_t how) {
    slot_t *s = waiting_at(b, i);
    push_end(b, s, how, 0, NULL);
    if (s->reserved)
        planner_remove(&b->planner, s->id);
    waiting_remove(b, i);
}

static size_t peak_of(const size_t *bytes, int n) {
    size_t peak = 0;
    for (int i = 0; i < n; i++)
        peak = bytes[i] > peak ? bytes[i] : peak;
    return peak;
}

/* The plan of a job at one of its levels. */
static const size_t *level_plan(const batcher_job_t *job, int level) {
    return job->n_levels > 0 ? job->level_kv_bytes[level] : job->kv_bytes;
}

/* The first (largest budget) level of job whose trajectory fits beside
 * what the planner holds `delay` iterations from now; -1 when not even the
 * floor does. A job without levels has one: its plan. */
static int fitting_level(const batcher_t *b, const batcher_job_t *job, int delay) {
    const int n = job->n_levels > 0 ? job->n_levels : 1;
    for (int l = 0; l < n; l++)
        if (planner_fits_after(&b->planner, level_plan(job, l), job->steps, delay))
            return l;
    return -1;
}

/* ---- time objectives ---- */

void batcher_set_costs(batcher_t *b, const cost_table_t *t) {
    b->costs_on = t != NULL;
    if (t)
        b->costs = *t;
}

static const cost_features_t *level_features(const batcher_job_t *job, int level) {
    return job->n_levels > 0 && job->level_step_features ? job->level_step_features[level]
                                                         : job->step_features;
}

/* What job waits after its last step: its images decoded and encoded,
 * then its answer written. */
static double finish_seconds(const batcher_t *b, const batcher_job_t *job) {
    return job->n_images * (b->costs.decode_s + b->costs.png_s) + b->costs.http_s;
}

static double alone_seconds(const batcher_t *b, const batcher_job_t *job, int level) {
    const cost_features_t *f = level_features(job, level);
    double t = finish_seconds(b, job);
    for (int k = 0; k < job->steps; k++)
        t += cost_step_seconds(&b->costs, &f[k]);
    return t;
}

double batcher_alone_seconds(const batcher_t *b, const batcher_job_t *job) {
    if (!b->costs_on || !job->step_features)
        return -1;
    return alone_seconds(b, job, job->n_levels > 0 ? job->n_levels - 1 : 0);
}

/* A job's target; none (0) is never missed. */
static double target_of(const batcher_job_t *job) {
    return job->target > 0 ? job->target : INFINITY;
}

/* The latency job would settle at if every job arriving at the measured
 * rate ran at `level` (Little's law over the table's linear step: L = S x
 * (intercept + rate x L x a) + images, a what one such job adds to a step,
 * averaged over its steps); INFINITY when that load outgrows the engine. */
static double settled_latency(const batcher_t *b, const batcher_job_t *job, int level) {
    if (b->n_gaps < BATCHER_RATE_MIN_GAPS || !(b->mean_gap > 0))
        return 0; /* no rate measured yet: nothing to settle */
    const cost_features_t *f = level_features(job, level);
    cost_features_t mean = {0};
    for (int k = 0; k < job->steps; k++)
        cost_features_accumulate(&mean, &f[k], 1.0 / job->steps);
    const double c0 = b->costs.coef[COST_COEF_INTERCEPT],
                 a = cost_step_seconds(&b->costs, &mean) - c0, load = job->steps * a / b->mean_gap;
    return load < 1 ? (job->steps * c0 + finish_seconds(b, job)) / (1 - load) : INFINITY;
}

/* 1 when admission prices job by time: a table, a job with features and
 * running jobs that all have theirs. */
static int timed(const batcher_t *b, const batcher_job_t *job) {
    if (!b->costs_on || !job->step_features)
        return 0;
    for (int i = 0; i < b->n_running; i++)
        if (!b->running[i].job.step_features)
            return 0;
    return 1;
}

/* The scratch for n future iterations; 0 when out of memory. */
static int future_room(batcher_t *b, int n) {
    if (n <= b->cap_future)
        return 1;
    cost_features_t *load = realloc(b->load, (size_t)n * sizeof *load);
    if (load)
        b->load = load;
    double *a = realloc(b->t_without, (size_t)n * sizeof *a);
    if (a)
        b->t_without = a;
    double *c = realloc(b->t_with, (size_t)n * sizeof *c);
    if (c)
        b->t_with = c;
    if (!load || !a || !c)
        return 0;
    b->cap_future = n;
    return 1;
}

/* The running jobs' features summed per future iteration (0: the next
 * step), each at the steps it will be at, and each iteration's seconds
 * alone (t_without), as prefix sums: t_without[k] is when iteration k
 * ends, from now. Returns how many iterations they run, or -1 when out of
 * memory (for at least n). */
static int running_load(batcher_t *b, int n) {
    int left = 0;
    for (int i = 0; i < b->n_running; i++) {
        const slot_t *s = &b->running[i];
        left = s->job.steps - s->steps_done > left ? s->job.steps - s->steps_done : left;
    }
    if (!future_room(b, left > n ? left : n))
        return -1;
    memset(b->load, 0, (size_t)(left > n ? left : n) * sizeof *b->load);
    for (int i = 0; i < b->n_running; i++) {
        const slot_t *s = &b->running[i];
        const cost_features_t *f = level_features(&s->job, s->level);
        for (int k = 0; s->steps_done + k < s->job.steps; k++)
            cost_features_accumulate(&b->load[k], &f[s->steps_done + k], 1);
    }
    for (int k = 0; k < left; k++)
        b->t_without[k] = (k ? b->t_without[k - 1] : 0) + cost_step_seconds(&b->costs, &b->load[k]);
    return left;
}

/* When running job s ends, from now, given each future iteration's end
 * (ends[k]: seconds from now to the end of iteration k). */
static double running_end_at(const batcher_t *b, const slot_t *s, const double *ends) {
    const int left = s->job.steps - s->steps_done;
    return (left > 0 ? ends[left - 1] : 0) + finish_seconds(b, &s->job);
}

/* With the running load (running_load's, `left` iterations): 1 when job
 * at `level`, admitted now, ends by its target (or could not even alone,
 * at its floor) and makes no running job late that would be on time
 * without it, else 0; *end is its predicted end. -1 when out of memory. */
static int time_fits(batcher_t *b, const batcher_job_t *job, int level, int left, double now,
                     double *end) {
    const int n = left > job->steps ? left : job->steps;
    if (!future_room(b, n))
        return -1;
    const cost_features_t *f = level_features(job, level);
    for (int k = 0; k < n; k++) {
        cost_features_t x = k < left ? b->load[k] : (cost_features_t){0};
        if (k < job->steps)
            cost_features_accumulate(&x, &f[k], 1);
        b->t_with[k] = (k ? b->t_with[k - 1] : 0) + cost_step_seconds(&b->costs, &x);
    }
    *end = now + b->t_with[job->steps - 1] + finish_seconds(b, job);
    const int floor = job->n_levels > 0 ? job->n_levels - 1 : 0;
    if (*end > target_of(job) && now + alone_seconds(b, job, floor) <= target_of(job))
        return 0;
    for (int i = 0; i < b->n_running; i++) {
        const slot_t *s = &b->running[i];
        if (now + running_end_at(b, s, b->t_with) > target_of(&s->job) &&
            now + running_end_at(b, s, b->t_without) <= target_of(&s->job))
            return 0;
    }
    return 1;
}

/* The level the head job is admitted at now, or -1 (it waits), and what
 * decided it; *end its predicted end (0 when not priced by time). */
static int admission_level(batcher_t *b, slot_t *head, double now) {
    const batcher_job_t *job = &head->job;
    const int mem = fitting_level(b, job, 0);
    head->predicted_end = 0;
    if (mem < 0) {
        head->waited_memory = 1;
        return -1;
    }
    int level = mem;
    if (timed(b, job)) {
        const int left = running_load(b, job->steps);
        const int n = job->n_levels > 0 ? job->n_levels : 1;
        /* The largest level the measured rate could sustain within the job's
         * objective (the floor when none could). */
        int start = mem;
        const double objective = target_of(job) - job->submitted;
        while (start < n - 1 && job->submitted > 0 &&
               settled_latency(b, job, start) > BATCHER_SETTLED_SHARE * objective)
            start++;
        /* Late even alone at its floor (it waited too long): its objective is
         * lost, and its floor is what takes the least time from the others. */
        if (now + alone_seconds(b, job, n - 1) > target_of(job))
            start = n - 1;
        level = -1;
        for (int l = start; left >= 0 && l < n; l++) {
            double end;
            if (!planner_fits_after(&b->planner, level_plan(job, l), job->steps, 0))
                continue;
            const int fits = time_fits(b, job, l, left, now, &end);
            if (fits < 0)
                break;
            if (fits) {
                level = l;
                head->predicted_end = end;
                break;
            }
        }
        if (left < 0) /* out of memory for the arithmetic: by memory alone */
            level = mem;
        if (level < 0) {
            head->waited_time = 1;
            return -1;
        }
    }
    head->regime = level > mem || head->waited_time   ? BATCHER_REGIME_TIME
                   : level > 0 || head->waited_memory ? BATCHER_REGIME_MEMORY
                                                      : BATCHER_REGIME_FREE;
    return level;
}

/* Iterations until the next batcher_admit: 1 while a step is in flight
 * (batcher_finish will move the plan on first), else 0. */
static int admission_delay(const batcher_t *b) { return b->n_batch > 0; }

/* max_waiting 0: the level at which job starts at the next batcher_admit,
 * or -1 when it does not. Its images must fit beside those of the running
 * jobs still running then and of the jobs accepted for it already, and its
 * KV beside what the planner holds then (theirs included). */
static int starts_next(const batcher_t *b, const batcher_job_t *job) {
    const int delay = admission_delay(b);
    int images = job->n_images;
    for (int i = 0; i < b->n_running; i++) {
        const slot_t *s = &b->running[i];
        if (!(delay && s->steps_done + 1 >= s->job.steps)) /* not done by then */
            images += s->job.n_images;
    }
    for (int i = 0; i < b->w_count; i++)
        images += b->waiting[(b->w_head + i) % b->w_cap].job.n_images;
    return images <= b->opt.max_running ? fitting_level(b, job, delay) : -1;
}

/* The arrival rate's running mean, from a job submitted at t (> 0). */
static void count_arrival(batcher_t *b, double t) {
    if (!(t > 0))
        return;
    if (b->last_submitted > 0 && t >= b->last_submitted) {
        double gap = t - b->last_submitted;
        if (b->n_gaps >= BATCHER_RATE_MIN_GAPS)
            gap = fmin(gap, BATCHER_GAP_CAP * b->mean_gap);
        b->n_gaps++;
        const double w =
            b->n_gaps < BATCHER_RATE_WINDOW ? 1.0 / b->n_gaps : 1.0 / BATCHER_RATE_WINDOW;
        b->mean_gap += w * (gap - b->mean_gap);
    }
    b->last_submitted = t;
}

batcher_refusal_t batcher_submit(batcher_t *b, const batcher_job_t *job, uint64_t *id) {
    if (job->n_images < 1 || job->steps < 1 || !job->kv_bytes || job->n_levels < 0 ||
        (job->n_levels > 0 && !job->level_kv_bytes))
        return BATCHER_REFUSED_INVALID;
    for (int l = 0; l < job->n_levels; l++)
        if (!job->level_kv_bytes[l])
            return BATCHER_REFUSED_INVALID;
    if (b->draining)
        return BATCHER_REFUSED_DRAINING;
    /* The count first: with --kv-pool-mb auto the pool holds max_running
     * full images, so more images than that also overrun it, and the limit
     * the client can act on is n's. */
    if (job->n_images > b->opt.max_running)
        return BATCHER_REFUSED_TOO_MANY_IMAGES;
    if (peak_of(job->kv_bytes, job->steps) > b->opt.pool_bytes)
        return BATCHER_REFUSED_TOO_LARGE;
    const int no_queue = b->opt.max_waiting == 0;
    const int level = no_queue ? starts_next(b, job) : 0;
    if (no_queue ? level < 0 : b->w_count >= b->opt.max_waiting)
        return BATCHER_REFUSED_QUEUE_FULL;
    const uint64_t next = b->next_id + 1;
    if (no_queue && planner_add_after(&b->planner, next, level_plan(job, level), job->steps,
                                      admission_delay(b)) != AR_OK)
        return BATCHER_REFUSED_NO_MEMORY;
    b->next_id = next;
    count_arrival(b, job->submitted);
    slot_t *s = waiting_at(b, b->w_count++);
    *s = (slot_t){.id = next, .job = *job, .reserved = no_queue, .level = level};
    if (id)
        *id = s->id;
    return BATCHER_ACCEPTED;
}

int batcher_cancel(batcher_t *b, uint64_t id, batcher_end_t how) {
    for (int i = 0; i < b->w_count; i++)
        if (waiting_at(b, i)->id == id) {
            waiting_end(b, i, how);
            return 1;
        }
    for (int i = 0; i < b->n_running; i++)
        if (b->running[i].id == id) {
            if (!b->running[i].cancel)
                b->running[i].cancel = (int)how + 1;
            return 1;
        }
    return 0;
}

void batcher_drain(batcher_t *b) { b->draining = 1; }

/* ---- running jobs ---- */

static void running_end(batcher_t *b, int i, batcher_end_t how, const char *why) {
    slot_t *s = &b->running[i];
    push_end(b, s, how, 1, why);
    if (b->ops.stop)
        b->ops.stop(b->ctx, s->job.work);
    planner_remove(&b->planner, s->id);
    b->running_images -= s->job.n_images;
    *s = b->running[--b->n_running];
}

void batcher_shutdown(batcher_t *b) {
    while (b->n_running)
        running_end(b, 0, BATCHER_END_SHUTDOWN, NULL);
    while (b->w_count)
        waiting_end(b, 0, BATCHER_END_SHUTDOWN);
    b->n_batch = 0;
}

int batcher_admit(batcher_t *b, double now) {
    b->n_batch = 0;
    /* Cancelled and expired running jobs leave first: their KV returns now. */
    for (int i = 0; i < b->n_running;) {
        slot_t *s = &b->running[i];
        if (s->cancel)
            running_end(b, i, (batcher_end_t)(s->cancel - 1), NULL);
        else if (now > s->job.deadline)
            running_end(b, i, BATCHER_END_EXPIRED, NULL);
        else
            i++;
    }
    for (int i = 0; i < b->w_count;) {
        if (now > waiting_at(b, i)->job.deadline)
            waiting_end(b, i, BATCHER_END_EXPIRED);
        else
            i++;
    }
    /* FIFO: the head of the queue blocks it, at the largest budget that
     * fits (fitting_level). A reserved job's KV is in the planner already
     * (and fits: batcher_submit checked). */
    while (b->w_count) {
        slot_t *at = waiting_at(b, 0);
        if (b->running_images + at->job.n_images > b->opt.max_running) {
            at->waited_memory = 1;
            break;
        }
        if (!at->reserved && (at->level = admission_level(b, at, now)) < 0)
            break;
        if (at->reserved)
            at->regime = at->level > 0 ? BATCHER_REGIME_MEMORY : BATCHER_REGIME_FREE;
        slot_t head = *at;
        b->w_head = (b->w_head + 1) % b->w_cap;
        b->w_count--;
        ar_error_t err = {{0}};
        if (!head.reserved && planner_add(&b->planner, head.id, level_plan(&head.job, head.level),
                                          head.job.steps) != AR_OK) {
            push_end(b, &head, BATCHER_END_FAILED, 0, "out of memory admitting the job");
            continue;
        }
        if (head.job.n_levels > 0 && b->ops.set_level)
            b->ops.set_level(b->ctx, head.job.work, head.level);
        if (b->ops.start && b->ops.start(b->ctx, head.job.work, &err) != AR_OK) {
            planner_remove(&b->planner, head.id);
            push_end(b, &head, BATCHER_END_FAILED, 0, err.msg);
            continue;
        }
        b->running[b->n_running++] = head;
        b->running_images += head.job.n_images;
        push_event(b, BATCHER_ADMITTED, &head);
    }
    for (int i = 0; i < b->n_running; i++)
        b->batch[i] = b->running[i].job.work;
    b->n_batch = b->n_running;
    return b->n_batch;
}

int batcher_step(batcher_t *b, ar_error_t *err) {
    b->batch_peak = 0;
    if (b->n_batch == 0)
        return AR_OK;
    return b->ops.step(b->ctx, b->batch, b->n_batch, &b->batch_peak, err);
}

/* The running job's plan from its next step on, tighter if it can tell. */
static void tighten(batcher_t *b, const slot_t *s) {
    const int n = s->job.steps - s->steps_done;
    if (!b->ops.remaining)
        return;
    if (n > b->cap_left) {
        size_t *left = realloc(b->left, (size_t)n * sizeof *left);
        if (!left)
            return; /* the plan stays as admitted: safe */
        b->left = left;
        b->cap_left = n;
    }
    if (b->ops.remaining(b->ctx, s->job.work, b->left, n))
        b->released += planner_tighten(&b->planner, s->id, b->left, n);
}

/* The batch's cost features (the running set, each at the step it just did). */
static void step_features(batcher_t *b) {
    b->last_features = (cost_features_t){0};
    b->last_features_known = 1;
    for (int i = 0; i < b->n_running; i++) {
        const slot_t *s = &b->running[i];
        const cost_features_t *f = s->job.n_levels > 0 && s->job.level_step_features
                                       ? s->job.level_step_features[s->level]
                                       : s->job.step_features;
        if (!f) {
            b->last_features_known = 0;
            continue;
        }
        cost_features_accumulate(&b->last_features, &f[s->steps_done], 1);
    }
}

void batcher_finish(batcher_t *b, int step_rc, const ar_error_t *step_err) {
    if (b->n_batch == 0)
        return;
    /* batcher_admit fixed the batch as the running set in order, and
     * nothing but batcher_admit and this changes the running set. */
    b->last_jobs = b->n_batch;
    b->last_images = b->running_images;
    b->last_reserved = planner_reserved_now(&b->planner);
    b->last_peak = b->batch_peak;
    if (b->last_peak > b->last_reserved)
        b->overruns++;
    step_features(b);
    planner_tick(&b->planner);
    if (step_rc != AR_OK) {
        while (b->n_running)
            running_end(b, 0, BATCHER_END_FAILED,
                        step_err && step_err->msg[0] ? step_err->msg : "the step failed");
    } else {
        for (int i = 0; i < b->n_running;) {
            slot_t *s = &b->running[i];
            s->steps_done++;
            push_event(b, BATCHER_STEPPED, s);
            if (s->steps_done >= s->job.steps) {
                running_end(b, i, BATCHER_END_FINISHED, NULL);
                continue;
            }
            tighten(b, s);
            i++;
        }
    }
    b->n_batch = 0;
    b->iterations++;
}

int batcher_iterate(batcher_t *b, double now) {
    if (batcher_admit(b, now) == 0)
        return 0;
    const int n = b->n_batch;
    ar_error_t err = {{0}};
    int rc = batcher_step(b, &err);
    batcher_finish(b, rc, &err);
    return rc == AR_OK ? n : -1;
}

void batcher_stats(const batcher_t *b, batcher_stats_t *out) {
    *out = (batcher_stats_t){
        .waiting = b->w_count,
        .running = b->n_running,
        .running_images = b->running_images,
        .reserved_bytes = planner_reserved_now(&b->planner),
        .iterations = b->iterations,
        .last_jobs = b->last_jobs,
        .last_images = b->last_images,
        .last_reserved_bytes = b->last_reserved,
        .last_kv_peak_bytes = b->last_peak,
        .last_features = b->last_features,
        .last_features_known = b->last_features_known,
        .overruns = b->overruns,
        .lost_events = b->lost_events,
        .released_bytes = b->released,
    };
}

int batcher_waiting_position(const batcher_t *b, uint64_t id) {
    for (int i = 0; i < b->w_count; i++)
        if (b->waiting[(b->w_head + i) % b->w_cap].id == id)
            return i;
    return -1;
}
