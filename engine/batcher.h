/* The batching core: a waiting queue, admission through the KV planner, one
 * iteration's batch, retiring, cancellation by id, all counted in
 * iterations, and reported as events. Single-threaded and clock-free: the
 * daemon's threaded scheduler (server/scheduler.c), the KV benchmark, the
 * planner's property test and the capacity simulator drive this one core,
 * each with its own step function (the engine's is gen_batcher_ops in
 * engine/generate.h) and its own idea of time (deadlines are in the
 * driver's units).
 *
 * Admission is FIFO: the head of the queue waits until its whole KV
 * trajectory fits beside every running job at every future iteration
 * (planner_fits) and its images fit max_running, so a large job is not
 * starved by small ones, and an admitted job never runs out of KV. Jobs
 * that could never be admitted are refused at submission.
 *
 * Elastic budgets: a job may come with several plans (levels: the budgets
 * of its range its policy can tell apart, the largest first). The head of
 * the queue is admitted at the first level whose trajectory fits, and
 * waits only when even its last (the floor) does not; a running job keeps
 * the level it was admitted at.
 *
 * Time objectives (batcher_set_costs): with a cost table, a job with a
 * target (the time its images should be done by) and every job's step
 * features, admission also predicts time: the running jobs' and the
 * head's remaining iterations priced by the table, each at the steps it
 * will be at, no later admission assumed (each is checked in turn). The
 * largest level considered is the largest whose latency, were every job
 * arriving at the measured rate (the jobs' submitted times) to run at it,
 * would settle within BATCHER_SETTLED_SHARE of the head's objective
 * (Little's law over the table's linear step; the floor when none would):
 * what keeps the objectives of the jobs still to come. The head is then
 * admitted at the largest level from there that fits the pool and at which
 * it ends by its target and makes no running job late that would end by
 * its target without it; a head that could not end by its target even
 * alone (it is late already) needs only the second. Otherwise it waits,
 * and the queue behind it. A lower level chosen for time is compression
 * that buys time (BATCHER_REGIME_TIME); for the pool, BATCHER_REGIME_MEMORY.
 * Without a table, or for jobs without features, admission is by memory
 * only.
 *
 * max_waiting 0 means no queue: a job is accepted only when it starts at
 * the next batcher_admit, i.e. its images fit max_running and its whole KV
 * trajectory fits beside the running jobs (those that will still run then)
 * and the jobs accepted before it for that admission; its KV is reserved
 * at submission, so nothing can take it before then. Otherwise it is
 * refused (BATCHER_REFUSED_QUEUE_FULL): run now or retry. A job cancelled
 * or past its deadline still counts until the admission that ends it. */
#ifndef ARSERVE_BATCHER_H
#define ARSERVE_BATCHER_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "engine/cost_model.h"

typedef struct batcher batcher_t;

/* The arrival rate's memory (submissions) and the least it needs, the most
 * one gap between submissions counts for against the mean so far (an idle
 * spell, a night or the pause between two load tests, would otherwise hide
 * the rate that follows it for tens of requests; a Poisson gap passes 4x
 * its mean once in 55), and the share of a job's objective the latency the
 * rate would settle at may take (the rest is room for the rate's swings:
 * the objective is a p99). */
#define BATCHER_RATE_WINDOW 32
#define BATCHER_RATE_MIN_GAPS 8
#define BATCHER_GAP_CAP 4.0
#define BATCHER_SETTLED_SHARE 0.5

typedef struct batcher_options {
    size_t pool_bytes; /* KV the planner may reserve: the pool's capacity */
    int max_running;   /* images stepping at once (>= 1) */
    int max_waiting;   /* jobs queued before submissions are refused (>= 0; 0: no queue, see
                          above) */
} batcher_options_t;

/* How jobs' work is run. ctx is batcher_create's; work is each job's. The
 * batcher calls these from whichever thread calls batcher_admit,
 * batcher_step and batcher_finish (the engine thread), never elsewhere. */
typedef struct batcher_ops {
    /* Takes what the job needs to run (its KV state); AR_ERR fails it. */
    int (*start)(void *ctx, void *work, ar_error_t *err);
    /* Advances every job of work[0..n) by one step, in one batch, and
     * reports the most KV bytes in use during the step (after its appends,
     * before any compaction), or 0 when it cannot tell. */
    int (*step)(void *ctx, void *const *work, int n, size_t *kv_peak_bytes, ar_error_t *err);
    /* Gives back what start took, at the job's end (its KV: the work itself
     * stays the driver's, e.g. to decode a finished image). */
    void (*stop)(void *ctx, void *work);
    /* Optional: after a step, the job's KV at each of its next n steps, all
     * images together, when it knows them better than its plan (1), else
     * 0. The batcher hands them to the planner (planner_tighten). */
    int (*remaining)(void *ctx, void *work, size_t *kv_bytes, int n);
    /* Optional: a job with levels is told the one it runs at (an index into
     * its level_kv_bytes) just before start. */
    void (*set_level)(void *ctx, void *work, int level);
} batcher_ops_t;

typedef struct batcher_job {
    int n_images;           /* >= 1 */
    int steps;              /* iterations it runs once admitted (>= 1) */
    const size_t *kv_bytes; /* the job's planned KV at each of its steps (steps entries), all
                               images together; the driver keeps it alive until the job ends.
                               With levels: the floor's, level_kv_bytes[n_levels - 1] */
    /* Elastic budgets (0 and NULL: none): n_levels plans (steps entries
     * each, all images together, kept alive like kv_bytes), the largest
     * budget first. */
    int n_levels;
    const size_t *const *level_kv_bytes;
    /* What each of its steps costs the engine (engine/cost_model.h), all
     * images together, steps entries, kept alive like kv_bytes; with levels
     * one array per level (level_step_features; step_features is then the
     * floor's). NULL: unknown (the iteration's features are then too). */
    const cost_features_t *step_features;
    const cost_features_t *const *level_step_features;
    double deadline;  /* in the driver's clock (batcher_admit's now); INFINITY: none */
    double target;    /* when its images should be done, in the same clock (> 0); 0: none (a
                         time objective: admission keeps it where it can, see above) */
    double submitted; /* when it arrived, in the same clock (> 0; 0: unknown): the arrival
                         rate admission measures */
    void *work;       /* handed to the ops */
} batcher_job_t;

/* Why batcher_submit refused a job. */
typedef enum batcher_refusal {
    BATCHER_ACCEPTED = 0,
    BATCHER_REFUSED_DRAINING,        /* batcher_drain was called */
    BATCHER_REFUSED_TOO_LARGE,       /* its KV plan peaks above the whole pool */
    BATCHER_REFUSED_TOO_MANY_IMAGES, /* more images than max_running */
    BATCHER_REFUSED_QUEUE_FULL,      /* max_waiting jobs are waiting (max_waiting 0: it
                                        cannot start at the next admission) */
    BATCHER_REFUSED_INVALID,         /* a job the batcher cannot run (no steps, no images) */
    BATCHER_REFUSED_NO_MEMORY,       /* out of memory reserving its KV (max_waiting 0) */
} batcher_refusal_t;

/* How a job left. */
typedef enum batcher_end {
    BATCHER_END_FINISHED,  /* its last step is done */
    BATCHER_END_CANCELLED, /* batcher_cancel(..., BATCHER_END_CANCELLED) */
    BATCHER_END_EXPIRED,   /* its deadline passed, or batcher_cancel(..., EXPIRED) */
    BATCHER_END_FAILED,    /* its start or a step failed (the event says why) */
    BATCHER_END_SHUTDOWN,  /* batcher_shutdown */
} batcher_end_t;

typedef enum batcher_event_type {
    BATCHER_ADMITTED, /* left the queue and started: its first step is in this iteration */
    BATCHER_STEPPED,  /* did one step (steps_done of steps) */
    BATCHER_ENDED,    /* left the batcher (end says how); its KV is given back */
} batcher_event_type_t;

/* What decided a job's admission (ADMITTED events). */
typedef enum batcher_regime {
    BATCHER_REGIME_FREE,   /* its largest level, at the first admission that tried */
    BATCHER_REGIME_MEMORY, /* the pool: a lower level, or it waited for room */
    BATCHER_REGIME_TIME,   /* the time objectives: a lower level than the pool allowed, or it
                              waited although the pool had room */
} batcher_regime_t;

typedef struct batcher_event {
    batcher_event_type_t type;
    uint64_t id;
    void *work;
    long long iteration;     /* the iteration it happened in */
    int steps_done;          /* steps the job has done */
    batcher_end_t end;       /* ENDED */
    int started;             /* ENDED: it had been admitted */
    int level;               /* ADMITTED and after: the level it runs at (0 without levels) */
    batcher_regime_t regime; /* ADMITTED: what decided it */
    double predicted_end;    /* ADMITTED with a cost table: when its images are predicted done
                                (batcher_admit's clock); 0 without one */
    char why[200];           /* ENDED with FAILED: what failed */
} batcher_event_t;

/* NULL (err says why) on a bad option or out of memory. */
batcher_t *batcher_create(const batcher_options_t *opt, const batcher_ops_t *ops, void *ctx,
                          ar_error_t *err);
/* Stops every job still held (without events) and frees the batcher. */
void batcher_destroy(batcher_t *b);

/* Prices admission by time from now on (a copy of *t; NULL: memory only),
 * the decoding and PNG encoding of a job's images added to its last step. */
void batcher_set_costs(batcher_t *b, const cost_table_t *t);

/* With a cost table: the seconds job would take at its floor level if it
 * ran alone from now (its steps, decoding and encoding); -1 without a
 * table or step features. A job whose target is nearer than that cannot
 * be kept: the driver may refuse it. */
double batcher_alone_seconds(const batcher_t *b, const batcher_job_t *job);

/* Queues job and sets *id (may be NULL), or refuses it (nothing queued). */
batcher_refusal_t batcher_submit(batcher_t *b, const batcher_job_t *job, uint64_t *id);

/* Ends job id as `how` (CANCELLED or EXPIRED): a waiting job leaves at
 * once, a running one at the next batcher_admit (its KV is given back
 * then). Returns 0 when no job has that id (it ended already). */
int batcher_cancel(batcher_t *b, uint64_t id, batcher_end_t how);

/* Refuses every later submission with BATCHER_REFUSED_DRAINING; waiting
 * and running jobs go on. */
void batcher_drain(batcher_t *b);

/* Ends every job (waiting and running) with BATCHER_END_SHUTDOWN; not
 * between batcher_admit and batcher_finish. */
void batcher_shutdown(batcher_t *b);

/* ---- one iteration ---- */

/* First part: ends the jobs cancelled or past their deadline (now, in the
 * driver's clock), then admits from the head of the queue what fits, and
 * fixes the batch: returns how many jobs the step will advance. */
int batcher_admit(batcher_t *b, double now);

/* Second part: one step of the batch (ops->step). It reads nothing but the
 * batch fixed by batcher_admit, so a threaded driver may run it without the
 * lock under which it calls every other function here. */
int batcher_step(batcher_t *b, ar_error_t *err);

/* Third part: step_rc is batcher_step's result (step_err its message).
 * Checks the step's KV peak against the plan, moves the plan on by an
 * iteration, and ends the jobs that did their last step (all of the batch,
 * FAILED, when the step failed). */
void batcher_finish(batcher_t *b, int step_rc, const ar_error_t *step_err);

/* Moves up to cap events, oldest first, into out; returns how many. Events
 * pile up until taken. */
int batcher_take_events(batcher_t *b, batcher_event_t *out, int cap);

/* ---- counts ---- */

typedef struct batcher_stats {
    int waiting, running;  /* jobs (waiting with max_waiting 0: accepted, starting at the
                              next admission) */
    int running_images;    /* images of the running jobs */
    size_t reserved_bytes; /* the planner's reservation for the current iteration */
    long long iterations;  /* iterations that stepped something */
    /* The last iteration that stepped: */
    int last_jobs, last_images;
    size_t last_reserved_bytes;    /* what the plan reserved for it */
    size_t last_kv_peak_bytes;     /* what the step reported using at its peak */
    cost_features_t last_features; /* its cost features, summed over its jobs' steps */
    int last_features_known;       /* 1 when every job of it had step_features */
    long long overruns;            /* iterations whose peak passed the reservation (a bug) */
    long long lost_events;         /* events dropped because memory ran out */
    /* How much tighter plans lowered running jobs' reserved peaks
     * (planner_tighten), summed. */
    unsigned long long released_bytes;
} batcher_stats_t;

void batcher_stats(const batcher_t *b, batcher_stats_t *out);

/* Where job id stands in the waiting queue: 0 at its head (the next to be
 * admitted), -1 when it is not waiting (running, or ended). O(waiting). */
int batcher_waiting_position(const batcher_t *b, uint64_t id);

/* A refusal or an end as words ("queue_full", "expired"), for logs and labels. */
const char *batcher_refusal_name(batcher_refusal_t r);
const char *batcher_end_name(batcher_end_t e);
const char *batcher_regime_name(batcher_regime_t r); /* "free", "memory", "time" */

#endif
