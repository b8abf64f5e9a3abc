/* The daemon's scheduler: an engine thread drives the engine's batcher
 * (engine/batcher.h: continuous batching, FIFO admission through the KV
 * planner) with the engine's step function, worker threads encode PNGs,
 * and metrics follow along. Requests are jobs behind an opaque handle:
 * callers submit, wait for changes, read a snapshot, cancel and release.
 * The scheduler reports the engine's reasons (why a job was refused, how
 * it ended); turning them into HTTP statuses is server/http.c's business. */
#ifndef ARSERVE_SCHEDULER_H
#define ARSERVE_SCHEDULER_H

#include <stddef.h>
#include <stdint.h>

#include "engine/batcher.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "engine/policy/kv_policy.h"
#include "engine/sampler.h"
#include "server/metrics.h"

/* Previews per image a request may ask for. */
#define SCHED_MAX_PARTIALS 3
/* Images per request the scheduler takes (the API's max_n is at most this). */
#define SCHED_MAX_IMAGES 64

typedef struct sched_options {
    int max_running;      /* images stepping at once */
    int max_waiting;      /* jobs waiting for admission before submissions are refused */
    size_t kv_pool_bytes; /* rounded down to whole blocks */
    int kv_block_tokens;  /* tokens per pool block; 0: planner_block_tokens(model) */
    dtype_t kv_dtype;     /* what the pool stores K and V as (kv_dtype_ok) */
    int png_workers;
    int draw_threads; /* the image decoder's threads, beside the engine's (0: as many) */
    /* The cost table the engine starts from until its own iterations are
     * fitted (bench --profile's; NULL: cost_table_default's). */
    const cost_table_t *costs;
    int learn_costs; /* fit the table from the engine's own iterations and images */
} sched_options_t;

/* The learned cost table: fitted from the last SCHED_COST_WINDOW timed
 * iterations, every SCHED_COST_REFIT_EVERY. */
#define SCHED_COST_WINDOW 4096
#define SCHED_COST_REFIT_EVERY 64

typedef struct scheduler scheduler_t;
typedef struct sched_job sched_job_t;

/* What one request asks for: n_images images of one prompt. */
typedef struct sched_request {
    const int *cond, *uncond; /* the prompt rows (copied) */
    int n_prompt;
    int size;            /* image size: an index into the model's image.sizes (0: the default) */
    const int *negative; /* Infinity: a negative prompt's text ids (copied), or NULL */
    int n_negative;
    int n_images; /* 1..SCHED_MAX_IMAGES */
    sampler_params_t params;
    uint64_t seed;
    kv_policy_params_t kv_policy; /* resolved (kv_policy_resolve); checked at submission */
    /* Elastic budgets: 0 runs at kv_policy.budget; > 0 is the least budget
     * of a range up to kv_policy.budget, SCHED_BUDGET_LEAST the least the
     * policy takes on this request. The job is admitted at the largest
     * budget of its range whose whole plan fits the pool now (batcher.h). */
    double kv_budget_min;
    int partial_images; /* previews per image, 0..SCHED_MAX_PARTIALS */
    double timeout_s;   /* the deadline, from submission */
    double objective_s; /* the latency objective, from submission (batcher.h's target); 0: none */
} sched_request_t;

/* kv_budget_min: from the least budget the policy takes on the request. */
#define SCHED_BUDGET_LEAST (-1.0)

/* Why sched_submit refused a request. */
typedef enum sched_refusal {
    SCHED_REFUSED_INVALID_POLICY, /* its KV policy does not suit the request (field: the setting) */
    SCHED_REFUSED_DRAINING,       /* the scheduler is draining or stopping */
    SCHED_REFUSED_TOO_LARGE,      /* its KV plan peaks above the whole pool */
    SCHED_REFUSED_TOO_MANY_IMAGES, /* more images than max_running */
    SCHED_REFUSED_QUEUE_FULL,      /* max_waiting jobs wait already */
    SCHED_REFUSED_OBJECTIVE, /* it could not keep its latency objective even alone (predicted_s) */
    SCHED_REFUSED_NO_MEMORY, /* out of memory, or a request the scheduler cannot take */
} sched_refusal_t;

/* The scheduler's reason for a refusal of the engine's batcher (a driver
 * of the batcher without a scheduler, the simulator, answers alike). */
sched_refusal_t sched_refusal_of(batcher_refusal_t r);

typedef struct sched_refusal_info {
    sched_refusal_t reason;
    const char *field; /* INVALID_POLICY: "budget", "budget_min" (the range's least), a knob's
                          name, or NULL (the policy) */
    char message[512]; /* INVALID_POLICY: the policy's words */
    size_t need_bytes, pool_bytes;   /* TOO_LARGE: the job's peak and the pool */
    double predicted_s, objective_s; /* OBJECTIVE: its time alone, and its objective */
    int max_running, max_waiting;
} sched_refusal_info_t;

/* How a job ended. */
typedef enum sched_outcome {
    SCHED_PENDING,   /* not ended: waiting, running or encoding */
    SCHED_DONE,      /* every PNG is ready */
    SCHED_CANCELLED, /* sched_job_cancel (its client went away) */
    SCHED_EXPIRED,   /* its deadline passed */
    SCHED_FAILED,    /* an internal fault (the message says which) */
    SCHED_SHUTDOWN,  /* the scheduler stopped first */
} sched_outcome_t;

/* The step after which preview p (of n_previews) of a job of `steps` steps is
 * drawn: steps * (p + 1) / (n_previews + 1). */
int sched_preview_step(int steps, int n_previews, int p);

/* A job as its caller may read it. */
typedef struct sched_snapshot {
    unsigned version; /* changes whenever anything below does */
    sched_outcome_t outcome;
    int started; /* admitted (it left the queue) */
    int steps_done, steps_total;
    int n_partials;     /* previews ready for every image */
    int partial_images; /* previews asked for */
    int n_images;
    int width, height, image_tokens; /* each image's pixels and tokens (its size's) */
    char message[256];               /* SCHED_FAILED: what failed */
    kv_policy_params_t kv_policy;    /* its budget: the admitted one once started */
    /* A budget range (kv_budget_min > 0; 0 without): its least and most. */
    double kv_budget_min, kv_budget_max;
    size_t kv_planned_peak_bytes; /* one image's planned KV peak (at the admitted budget) */
    size_t kv_peak_bytes;         /* the most KV one of its images held (when done) */
    /* Seconds from submission to admission, from admission to its last
     * step, and from its last step to its last PNG (decoding and encoding);
     * 0 until each is known. */
    double queue_s, run_s, finish_s;
    /* What decided its admission (batcher_regime_name; NULL until admitted)
     * and, when admission priced time, its predicted seconds from
     * submission to its last PNG (0 otherwise). */
    const char *admission;
    double predicted_s;
} sched_snapshot_t;

/* The steps a stream that has said `previews_said` previews may report now:
 * the steps done, but while the job runs no further than the step of the
 * next preview not yet said, so that however far decoding runs ahead of the
 * drawing threads, a stream says its progress and previews in step order. */
int sched_reportable_steps(const sched_snapshot_t *snap, int previews_said);

/* Starts the engine thread and the PNG workers. NULL (err says why, with
 * nothing left running) on a bad option, out of memory or a thread that
 * cannot start. */
scheduler_t *scheduler_create(model_t *model, const sched_options_t *opt, metrics_t *metrics,
                              ar_error_t *err);
/* Stops the engine and the PNG workers (idempotent); jobs not finished end
 * SCHED_SHUTDOWN, so threads waiting on them wake up. */
void scheduler_stop(scheduler_t *s);
/* Stops (if needed) and frees. */
void scheduler_destroy(scheduler_t *s);

/* Plans the request (its policy checked here, once) and queues it: returns
 * the job (one reference, the caller's), or NULL with *why filled. */
sched_job_t *sched_submit(scheduler_t *s, const sched_request_t *req, sched_refusal_info_t *why);

/* What GET /v1/capacity says: the cost table the engine has learned, how
 * it was learned, and the pool. */
typedef struct sched_capacity {
    cost_table_t costs;
    long long timed_iterations, refits;
    int window, refit_every, outliers;
    size_t kv_pool_bytes, kv_reserved_bytes;
} sched_capacity_t;
void sched_capacity(scheduler_t *s, sched_capacity_t *out);

/* One answered request's seconds on its HTTP thread (arrival to submission,
 * end to answer queued), for the learned table's http_s. */
void sched_note_http(scheduler_t *s, double seconds);

uint64_t sched_job_id(const sched_job_t *j);
void sched_job_snapshot(sched_job_t *j, sched_snapshot_t *out);
/* Waits until the job's version differs from seen or timeout_s passes,
 * then takes a snapshot. */
void sched_job_wait(sched_job_t *j, unsigned seen, double timeout_s, sched_snapshot_t *out);
/* Waits until the job has ended or timeout_s passes, then takes a
 * snapshot: the steps in between do not wake the caller (a non-streaming
 * request's thread, which needs only the end). */
void sched_job_wait_end(sched_job_t *j, double timeout_s, sched_snapshot_t *out);
/* Image i's PNG once the job is SCHED_DONE; preview p of image i once
 * n_partials > p. The bytes stay valid while the caller holds its
 * reference. NULL otherwise. */
const uint8_t *sched_job_png(sched_job_t *j, int image, size_t *len);
const uint8_t *sched_job_preview(sched_job_t *j, int preview, int image, size_t *len);
/* Asks the scheduler to drop the job (its client went away): a waiting
 * job at once, a running one at the next iteration, which frees its KV. */
void sched_job_cancel(scheduler_t *s, sched_job_t *j);
/* Drops the caller's reference. */
void sched_job_release(sched_job_t *j);
/* Takes another reference (a job kept past its request: server/job_store.h). */
void sched_job_retain(sched_job_t *j);
/* When the job ended (clock_now_s), or 0 while it is SCHED_PENDING. */
double sched_job_ended_at(sched_job_t *j);
/* Where the job waits for admission: 1 for the head of the queue, 0 once
 * it is not waiting (admitted, or ended). */
int sched_job_queue_position(scheduler_t *s, sched_job_t *j);

/* Stops admitting new jobs (SIGTERM); running and waiting jobs go on. */
void sched_drain(scheduler_t *s);
int sched_draining(scheduler_t *s);
/* Jobs waiting plus jobs stepping (not those being encoded). */
int sched_active_jobs(scheduler_t *s);
/* 1 while the engine thread is alive (for /health). */
int sched_alive(scheduler_t *s);
/* NULL while the backend can run steps; once it cannot (backend_unusable
 * said so after a step or a draw failed), why: "backend NAME unusable
 * after: ...", for /health and /ready. Cheap and safe from any thread; the
 * string lives as long as the scheduler. */
const char *sched_backend_unusable(scheduler_t *s);

/* A budget range's plans, as sched_submit makes them (the simulator too):
 * checks the range [budget_min (SCHED_BUDGET_LEAST: the policy's least on
 * this request), p->budget] against what p takes on a request of n_prompt
 * tokens, then plans its levels (planner_plan_levels) into *lv, the floor
 * into *lo. AR_ERR with why's field ("budget_min", "budget" or the
 * policy's) and message filled. */
int sched_plan_range(const model_config_t *cfg, const kv_policy_params_t *p, double budget_min,
                     int n_prompt, int size, int block_tokens, planner_kv_dtype_t dt,
                     planner_levels_t *lv, double *lo, sched_refusal_info_t *why);

/* Peak KV bytes of one image (its CFG pair) under policy p with a prompt of
 * n_prompt tokens; 0 when p does not suit the model. */
size_t sched_image_peak_bytes(const scheduler_t *s, const kv_policy_params_t *p, int n_prompt);
/* The pool's block size in tokens and its capacity in bytes. */
int sched_kv_block_tokens(const scheduler_t *s);
/* The type the pool stores K and V in. */
dtype_t sched_kv_dtype(const scheduler_t *s);
size_t sched_kv_capacity_bytes(const scheduler_t *s);

/* What the scheduler is doing, as its metrics say it (the daemon's status
 * line): requests running and waiting, images finished well and iterations
 * since start, KV pool bytes in use and reserved by the planner. */
typedef struct sched_status {
    int running, waiting;
    double images_done, iterations;
    double kv_used_bytes, kv_reserved_bytes;
} sched_status_t;
void sched_status(scheduler_t *s, sched_status_t *out);

#endif
