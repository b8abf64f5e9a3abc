/* Continuous batching: one engine thread advances every running image one
 * step per iteration; new jobs join at the next iteration (their prefill
 * rides in the same forward pass) and finished ones leave without waiting
 * for the batch to drain. Admission asks the KV planner whether the job's
 * whole trajectory fits the pool at every future iteration, so an admitted
 * job never runs out of KV and is never preempted. PNG encoding runs on
 * worker threads. */
#ifndef ARSERVE_SCHEDULER_H
#define ARSERVE_SCHEDULER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "engine/kv_policy.h"
#include "engine/model.h"
#include "engine/sampler.h"
#include "server/api.h"
#include "server/metrics.h"

#define SCHED_MAX_PARTIALS 3

typedef enum job_state {
    JOB_WAITING,
    JOB_RUNNING,
    JOB_ENCODING, /* tokens done, PNGs being encoded */
    JOB_DONE,
    JOB_FAILED,
} job_state_t;

/* One HTTP request: n images from one prompt. Shared between the HTTP
 * thread that owns the connection and the scheduler; reference-counted.
 * Fields below "shared" are read and written under mu. */
typedef struct sched_job {
    uint64_t id;
    int n_images, n_prompt;
    int *cond, *uncond;
    sampler_params_t params;
    kv_policy_params_t kv_policy; /* policy, budget and knobs; full until the API sets them */
    size_t kv_planned_peak_bytes; /* one image's peak as planned (set by sched_submit) */
    uint64_t seed;
    int partial_images; /* previews wanted per image (streaming) */
    double t_submit, deadline;

    pthread_mutex_t mu;
    pthread_cond_t changed; /* signalled on every state or progress change */
    int refs;
    int cancelled;
    /* shared */
    job_state_t state;
    int steps_done, steps_total;
    int n_partials;                             /* previews published so far, per image */
    char *partial_b64[SCHED_MAX_PARTIALS * 64]; /* [partial * n_images + image] */
    uint8_t **png;                              /* n_images PNGs once DONE */
    size_t *png_len;
    int png_pending;
    api_error_t error;    /* when FAILED */
    size_t kv_peak_bytes; /* measured: the most KV one of its images held (set at ENCODING) */

    /* engine thread only */
    struct gen_request *gens;
    double t_admit;
    int first_step_seen;
} sched_job_t;

typedef struct sched_options {
    int max_running; /* images stepping at once */
    int max_waiting; /* jobs waiting for admission before 429 */
    double request_timeout_s;
    size_t kv_pool_bytes; /* rounded down to whole blocks */
    int kv_block_tokens;  /* tokens per pool block; 0: planner_block_tokens(model) */
    int png_workers;
    int retry_after_s;
} sched_options_t;

typedef struct scheduler scheduler_t;

scheduler_t *scheduler_create(model_t *model, const sched_options_t *opt, metrics_t *metrics,
                              ar_error_t *err);
/* Stops the engine and the PNG workers (idempotent); jobs not finished fail
 * with "shutting down", so threads waiting on them wake up. */
void scheduler_stop(scheduler_t *s);
/* Stops (if needed) and frees. */
void scheduler_destroy(scheduler_t *s);

/* Makes a job from a validated request and its prompt rows (refs = 1), with
 * the full-cache policy (set j->kv_policy before sched_submit for another). */
sched_job_t *sched_job_create(const int *cond, const int *uncond, int n_prompt, int n_images,
                              const sampler_params_t *params, uint64_t seed, int partial_images,
                              double timeout_s);
void sched_job_release(sched_job_t *j);

/* Queues a job (the scheduler takes its own reference). Fails with 429
 * when the waiting queue is full, 503 while draining, 400 when the job could
 * never fit the KV pool or its policy does not suit the request (param: the
 * request field at fault, kv_budget or a knob, kv_policy when neither). */
int sched_submit(scheduler_t *s, sched_job_t *j, api_error_t *err);

/* Asks the scheduler to drop the job at its next iteration (client gone). */
void sched_job_cancel(scheduler_t *s, sched_job_t *j);

/* Stops admitting new jobs (SIGTERM); running and waiting jobs go on. */
void sched_drain(scheduler_t *s);
int sched_draining(scheduler_t *s);
/* Jobs waiting plus jobs stepping (not those being encoded). */
int sched_active_jobs(scheduler_t *s);
/* 1 while the engine thread is alive (for /health). */
int sched_alive(scheduler_t *s);

/* Peak KV bytes of one image (its CFG pair) under policy p with a prompt of
 * n_prompt tokens; 0 when p does not suit the model. */
size_t sched_image_peak_bytes(const scheduler_t *s, const kv_policy_params_t *p, int n_prompt);
/* The pool's block size in tokens and its capacity in bytes. */
int sched_kv_block_tokens(const scheduler_t *s);
size_t sched_kv_capacity_bytes(const scheduler_t *s);
/* Iterations whose measured KV peak passed the planner's reservation (a
 * planner or policy bug, logged; DEBUG=1 builds abort on the first). */
long long sched_kv_overruns(scheduler_t *s);

#endif
