/* The engine loop (continuous batching over the KV planner) and the PNG
 * worker pool. Lock order: scheduler mu, then a job's mu. */
#include "scheduler.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "engine/clock.h"
#include "engine/generate.h"
#include "engine/kv_pool.h"
#include "engine/planner.h"
#include "engine/png_io.h"
#include "server/log.h"

typedef struct png_task {
    sched_job_t *job;
    int image;
    int partial; /* -1 for the final image, else the preview index */
    uint8_t *rgb;
    struct png_task *next;
} png_task_t;

struct scheduler {
    model_t *model;
    sched_options_t opt;
    metrics_t *metrics;
    int width, height;

    pthread_mutex_t mu;
    pthread_cond_t wake; /* new job, cancellation or stop */
    int stop, draining, alive, joined;
    uint64_t next_id;
    sched_job_t **waiting; /* FIFO ring of ring_cap slots */
    int w_head, w_count, ring_cap;
    sched_job_t **running; /* engine thread only, but counted under mu */
    int n_running, running_images;
    planner_t planner;        /* engine thread only */
    kv_pool_t pool;           /* engine thread only (its geometry is fixed: read anywhere) */
    long long kv_overruns;    /* under mu */
    long long bad_frees_seen; /* engine thread only */
    pthread_t engine;

    pthread_mutex_t png_mu;
    pthread_cond_t png_wake;
    png_task_t *png_head, *png_tail;
    int png_stop;
    pthread_t *workers;
    int n_workers;

    /* metrics */
    metric_t *m_running, *m_waiting, *m_queue_wait, *m_first_step, *m_latency, *m_step_time,
        *m_seqs, *m_tokens, *m_images, *m_refused, *m_cancelled, *m_kv_capacity, *m_kv_reserved,
        *m_kv_used, *m_iterations, *m_kv_overruns;
};

/* ---- jobs ---- */

sched_job_t *sched_job_create(const int *cond, const int *uncond, int n_prompt, int n_images,
                              const sampler_params_t *params, uint64_t seed, int partial_images,
                              double timeout_s) {
    if (n_images < 1 || n_images > 64 || partial_images < 0 || partial_images > SCHED_MAX_PARTIALS)
        return NULL;
    sched_job_t *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->cond = malloc((size_t)n_prompt * sizeof(int));
    j->uncond = malloc((size_t)n_prompt * sizeof(int));
    j->png = calloc((size_t)n_images, sizeof *j->png);
    j->png_len = calloc((size_t)n_images, sizeof *j->png_len);
    if (!j->cond || !j->uncond || !j->png || !j->png_len) {
        free(j->cond);
        free(j->uncond);
        free(j->png);
        free(j->png_len);
        free(j);
        return NULL;
    }
    memcpy(j->cond, cond, (size_t)n_prompt * sizeof(int));
    memcpy(j->uncond, uncond, (size_t)n_prompt * sizeof(int));
    j->n_prompt = n_prompt;
    j->n_images = n_images;
    j->params = *params;
    kv_policy_defaults(&j->kv_policy, KV_POLICY_FULL);
    j->seed = seed;
    j->partial_images = partial_images;
    j->t_submit = clock_now_s();
    j->deadline = j->t_submit + timeout_s;
    j->refs = 1;
    j->state = JOB_WAITING;
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->changed, NULL);
    return j;
}

void sched_job_release(sched_job_t *j) {
    if (!j)
        return;
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left > 0)
        return;
    for (int i = 0; i < j->n_images; i++)
        free(j->png[i]);
    for (int i = 0; i < SCHED_MAX_PARTIALS * 64; i++)
        free(j->partial_b64[i]);
    free(j->png);
    free(j->png_len);
    free(j->cond);
    free(j->uncond);
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->changed);
    free(j);
}

static void job_retain(sched_job_t *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
}

/* Moves a job to FAILED with an error (unless it already ended). */
static void job_fail(sched_job_t *j, int status, const char *code, const char *msg) {
    pthread_mutex_lock(&j->mu);
    if (j->state != JOB_DONE && j->state != JOB_FAILED) {
        j->state = JOB_FAILED;
        j->error.status = status;
        snprintf(j->error.type, sizeof j->error.type, "%s",
                 status >= 500 ? "server_error" : "invalid_request_error");
        snprintf(j->error.code, sizeof j->error.code, "%s", code);
        snprintf(j->error.message, sizeof j->error.message, "%s", msg);
        j->error.param[0] = 0;
    }
    pthread_cond_broadcast(&j->changed);
    pthread_mutex_unlock(&j->mu);
}

static int job_cancelled(sched_job_t *j) {
    pthread_mutex_lock(&j->mu);
    int c = j->cancelled;
    pthread_mutex_unlock(&j->mu);
    return c;
}

/* ---- PNG workers ---- */

static void png_push(scheduler_t *s, png_task_t *t) {
    pthread_mutex_lock(&s->png_mu);
    t->next = NULL;
    if (s->png_tail)
        s->png_tail->next = t;
    else
        s->png_head = t;
    s->png_tail = t;
    pthread_cond_signal(&s->png_wake);
    pthread_mutex_unlock(&s->png_mu);
}

static void *png_worker(void *arg) {
    scheduler_t *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->png_mu);
        while (!s->png_head && !s->png_stop)
            pthread_cond_wait(&s->png_wake, &s->png_mu);
        png_task_t *t = s->png_head;
        if (!t) {
            pthread_mutex_unlock(&s->png_mu);
            return NULL;
        }
        s->png_head = t->next;
        if (!s->png_head)
            s->png_tail = NULL;
        pthread_mutex_unlock(&s->png_mu);

        sched_job_t *j = t->job;
        uint8_t *png = NULL;
        size_t len = 0;
        ar_error_t err = {{0}};
        int rc = png_encode(t->rgb, s->width, s->height, &png, &len, &err);
        pthread_mutex_lock(&j->mu);
        if (rc != AR_OK) {
            pthread_mutex_unlock(&j->mu);
            log_msg(LOG_ERROR, "job %llu: PNG encoding failed: %s", (unsigned long long)j->id,
                    err.msg);
            job_fail(j, 500, "internal_error", "PNG encoding failed");
            pthread_mutex_lock(&j->mu);
        } else if (t->partial >= 0) {
            char *b64 = api_base64(png, len);
            free(png);
            int slot = t->partial * j->n_images + t->image;
            free(j->partial_b64[slot]);
            j->partial_b64[slot] = b64;
            if (t->image == j->n_images - 1 && t->partial + 1 > j->n_partials)
                j->n_partials = t->partial + 1;
        } else {
            j->png[t->image] = png;
            j->png_len[t->image] = len;
            if (--j->png_pending == 0 && j->state == JOB_ENCODING) {
                /* Count before the waiting request thread can answer. */
                metric_add(s->m_images, j->n_images, "ok");
                metric_observe(s->m_latency, clock_now_s() - j->t_submit);
                j->state = JOB_DONE;
            }
        }
        pthread_cond_broadcast(&j->changed);
        pthread_mutex_unlock(&j->mu);
        free(t->rgb);
        sched_job_release(j);
        free(t);
    }
}

/* ---- admission ---- */

/* The job's KV trajectory: n images x the per-image bytes its policy holds
 * at each step, counted in whole pool blocks. NULL (err says why) when the
 * policy does not suit the request or on out of memory. */
static size_t *job_trajectory(const scheduler_t *s, const sched_job_t *j, int *n_steps,
                              ar_error_t *err) {
    *n_steps = planner_steps(&s->model->cfg);
    size_t *t = malloc((size_t)*n_steps * sizeof *t);
    if (!t) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    if (planner_trajectory_bytes(&s->model->cfg, &j->kv_policy, j->n_prompt,
                                 s->pool.blocks.block_tokens, t, err) != AR_OK) {
        free(t);
        return NULL;
    }
    for (int i = 0; i < *n_steps; i++)
        t[i] *= (size_t)j->n_images;
    return t;
}

static size_t peak_of(const size_t *t, int n) {
    size_t peak = 0;
    for (int i = 0; i < n; i++)
        peak = t[i] > peak ? t[i] : peak;
    return peak;
}

size_t sched_image_peak_bytes(const scheduler_t *s, const kv_policy_params_t *p, int n_prompt) {
    int n = planner_steps(&s->model->cfg);
    size_t *t = malloc((size_t)n * sizeof *t), peak = 0;
    if (t && planner_trajectory_bytes(&s->model->cfg, p, n_prompt, s->pool.blocks.block_tokens, t,
                                      NULL) == AR_OK)
        peak = peak_of(t, n);
    free(t);
    return peak;
}

int sched_kv_block_tokens(const scheduler_t *s) { return s->pool.blocks.block_tokens; }

size_t sched_kv_capacity_bytes(const scheduler_t *s) { return kv_pool_capacity_bytes(&s->pool); }

long long sched_kv_overruns(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    long long n = s->kv_overruns;
    pthread_mutex_unlock(&s->mu);
    return n;
}

/* The request field behind a setting kv_policy_check names. */
static const char *policy_param(const char *field) {
    if (!field)
        return "kv_policy";
    return strcmp(field, "budget") == 0 ? "kv_budget" : field;
}

int sched_submit(scheduler_t *s, sched_job_t *j, api_error_t *err) {
    /* The trajectory is pure host arithmetic on read-only geometry. */
    int n_steps = 0;
    ar_error_t perr = {{0}};
    const char *field = NULL;
    kv_geometry_t g = planner_geometry(&s->model->cfg, j->n_prompt);
    size_t *traj = kv_policy_check(&j->kv_policy, &g, &field, &perr) == AR_OK
                       ? job_trajectory(s, j, &n_steps, &perr)
                       : NULL;
    const int planned = traj != NULL;
    size_t need = planned ? peak_of(traj, n_steps) : 0, capacity = kv_pool_capacity_bytes(&s->pool);
    j->kv_planned_peak_bytes = need / (size_t)j->n_images;
    free(traj);
    pthread_mutex_lock(&s->mu);
    const char *reason = NULL;
    if (!planned) {
        reason = "invalid_policy";
        *err = (api_error_t){.status = 400};
        snprintf(err->message, sizeof err->message, "%.*s", (int)sizeof err->message - 1, perr.msg);
        snprintf(err->param, sizeof err->param, "%s", policy_param(field));
        snprintf(err->code, sizeof err->code, "invalid_value");
    } else if (s->draining || s->stop) {
        reason = "draining";
        *err = (api_error_t){.status = 503};
        snprintf(err->message, sizeof err->message, "the server is shutting down");
        snprintf(err->code, sizeof err->code, "server_draining");
    } else if (need > capacity) {
        reason = "too_large";
        *err = (api_error_t){.status = 400};
        snprintf(err->message, sizeof err->message,
                 "this request needs %zu bytes of KV cache, more than the pool's %zu: ask for "
                 "fewer images (n) or a shorter prompt",
                 need, capacity);
        snprintf(err->param, sizeof err->param, "n");
        snprintf(err->code, sizeof err->code, "kv_pool_too_small");
    } else if (j->n_images > s->opt.max_running) {
        reason = "too_large";
        *err = (api_error_t){.status = 400};
        snprintf(err->message, sizeof err->message,
                 "n = %d is more than the %d images this server runs at once", j->n_images,
                 s->opt.max_running);
        snprintf(err->param, sizeof err->param, "n");
        snprintf(err->code, sizeof err->code, "too_many_images");
    } else if (s->w_count >= s->opt.max_waiting) {
        reason = "queue_full";
        *err = (api_error_t){.status = 429};
        snprintf(err->message, sizeof err->message,
                 "the waiting queue is full (%d requests); retry after %d s", s->opt.max_waiting,
                 s->opt.retry_after_s);
        snprintf(err->code, sizeof err->code, "queue_full");
    }
    if (reason) {
        pthread_mutex_unlock(&s->mu);
        snprintf(err->type, sizeof err->type, "%s",
                 err->status == 429 ? "rate_limit_error" : "invalid_request_error");
        metric_add(s->m_refused, 1, reason);
        return AR_ERR;
    }
    j->id = ++s->next_id;
    job_retain(j);
    s->waiting[(s->w_head + s->w_count) % s->ring_cap] = j;
    s->w_count++;
    metric_set(s->m_waiting, s->w_count);
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    return AR_OK;
}

void sched_job_cancel(scheduler_t *s, sched_job_t *j) {
    pthread_mutex_lock(&j->mu);
    int already = j->cancelled;
    j->cancelled = 1;
    pthread_mutex_unlock(&j->mu);
    if (already)
        return;
    pthread_mutex_lock(&s->mu);
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
}

void sched_drain(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = 1;
    pthread_mutex_unlock(&s->mu);
}

int sched_draining(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    int d = s->draining;
    pthread_mutex_unlock(&s->mu);
    return d;
}

int sched_active_jobs(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    int n = s->w_count + s->n_running;
    pthread_mutex_unlock(&s->mu);
    return n;
}

int sched_alive(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    int a = s->alive;
    pthread_mutex_unlock(&s->mu);
    return a;
}

/* ---- the engine loop ---- */

/* Frees a running job's KV and removes it from the running set. */
static void retire(scheduler_t *s, int idx) {
    sched_job_t *j = s->running[idx];
    for (int i = 0; i < j->n_images; i++)
        gen_request_free(&j->gens[i]);
    free(j->gens);
    j->gens = NULL;
    planner_remove(&s->planner, j->id);
    pthread_mutex_lock(&s->mu);
    s->running_images -= j->n_images;
    s->running[idx] = s->running[--s->n_running];
    metric_set(s->m_running, s->n_running);
    pthread_mutex_unlock(&s->mu);
}

/* Starts a job's generation requests; on failure the job fails. */
static int start_job(scheduler_t *s, sched_job_t *j) {
    ar_error_t err = {{0}};
    j->gens = calloc((size_t)j->n_images, sizeof *j->gens);
    if (!j->gens) {
        job_fail(j, 500, "internal_error", "out of memory");
        return AR_ERR;
    }
    for (int i = 0; i < j->n_images; i++)
        if (gen_request_init(&j->gens[i], s->model, &s->pool, &j->kv_policy, j->cond, j->uncond,
                             j->n_prompt, &j->params, j->seed, (uint64_t)i, &err) != AR_OK) {
            log_msg(LOG_ERROR, "job %llu: %s", (unsigned long long)j->id, err.msg);
            for (int k = 0; k < i; k++)
                gen_request_free(&j->gens[k]);
            free(j->gens);
            j->gens = NULL;
            job_fail(j, 500, "internal_error", "could not allocate the KV cache");
            return AR_ERR;
        }
    j->t_admit = clock_now_s();
    pthread_mutex_lock(&j->mu);
    j->state = JOB_RUNNING;
    j->steps_total = j->gens[0].n_steps;
    pthread_cond_broadcast(&j->changed);
    pthread_mutex_unlock(&j->mu);
    metric_observe(s->m_queue_wait, j->t_admit - j->t_submit);
    return AR_OK;
}

/* Moves waiting jobs that fit into the running set (FIFO: the head blocks
 * the queue, so a large job is not starved by small ones). Cancelled or
 * expired waiting jobs are dropped on the way. */
static void admit(scheduler_t *s) {
    double now = clock_now_s();
    for (;;) {
        pthread_mutex_lock(&s->mu);
        if (s->w_count == 0) {
            pthread_mutex_unlock(&s->mu);
            return;
        }
        sched_job_t *j = s->waiting[s->w_head];
        int dead = job_cancelled(j) || now > j->deadline;
        int fits = 0, n_steps = 0;
        size_t *traj = NULL;
        if (!dead && s->running_images + j->n_images <= s->opt.max_running) {
            /* sched_submit checked the policy: NULL here is out of memory,
             * and the job waits for the next iteration. */
            traj = job_trajectory(s, j, &n_steps, NULL);
            fits = traj && planner_fits(&s->planner, traj, n_steps);
        }
        if (dead || fits) {
            s->w_head = (s->w_head + 1) % s->ring_cap;
            s->w_count--;
            metric_set(s->m_waiting, s->w_count);
        }
        if (fits) {
            s->running[s->n_running++] = j;
            s->running_images += j->n_images;
            metric_set(s->m_running, s->n_running);
        }
        pthread_mutex_unlock(&s->mu);
        if (dead) {
            int cancelled = job_cancelled(j);
            if (cancelled)
                metric_add(s->m_cancelled, 1);
            metric_add(s->m_images, j->n_images, cancelled ? "cancelled" : "timeout");
            job_fail(j, 504, "timeout",
                     cancelled ? "the request was cancelled before it could start"
                               : "the request's deadline passed before it could start");
            sched_job_release(j);
            free(traj);
            continue;
        }
        if (!fits) {
            free(traj);
            return;
        }
        planner_add(&s->planner, j->id, traj, n_steps);
        free(traj);
        if (start_job(s, j) != AR_OK) {
            pthread_mutex_lock(&s->mu);
            for (int i = 0; i < s->n_running; i++)
                if (s->running[i] == j) {
                    j->gens = NULL;
                    s->running_images -= j->n_images;
                    s->running[i] = s->running[--s->n_running];
                    break;
                }
            pthread_mutex_unlock(&s->mu);
            planner_remove(&s->planner, j->id);
            metric_add(s->m_images, j->n_images, "error");
            sched_job_release(j);
        }
    }
}

/* Decodes the current tokens of every image of j into previews (tokens not
 * generated yet are drawn as token 0) and hands them to the PNG workers. */
static void publish_preview(scheduler_t *s, sched_job_t *j, int index) {
    size_t npx = (size_t)s->width * s->height * 3;
    for (int i = 0; i < j->n_images; i++) {
        gen_request_t *g = &j->gens[i];
        png_task_t *t = calloc(1, sizeof *t);
        uint8_t *rgb = malloc(npx);
        int *tokens = calloc((size_t)g->n_steps, sizeof(int));
        ar_error_t err = {{0}};
        if (t && rgb && tokens) {
            memcpy(tokens, g->tokens, (size_t)g->step * sizeof(int));
            if (vq_decode(&s->model->dec, tokens, rgb, NULL, &err) == AR_OK) {
                *t = (png_task_t){.job = j, .image = i, .partial = index, .rgb = rgb};
                job_retain(j);
                png_push(s, t);
                t = NULL;
                rgb = NULL;
            }
        }
        free(t);
        free(rgb);
        free(tokens);
    }
}

/* A job whose images have all finished: decode on the engine thread (the
 * backend is single-threaded), encode on the workers. */
static void finish_job(scheduler_t *s, int idx) {
    sched_job_t *j = s->running[idx];
    size_t npx = (size_t)s->width * s->height * 3;
    const size_t block = kv_pool_block_bytes(s->pool.blocks.block_tokens, s->pool.blocks.head_dim);
    int peak_blocks = 0;
    for (int i = 0; i < j->n_images; i++)
        if (j->gens[i].kv_peak_blocks > peak_blocks)
            peak_blocks = j->gens[i].kv_peak_blocks;
    pthread_mutex_lock(&j->mu);
    j->kv_peak_bytes = (size_t)peak_blocks * block;
    j->state = JOB_ENCODING;
    j->png_pending = j->n_images;
    pthread_cond_broadcast(&j->changed);
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < j->n_images; i++) {
        ar_error_t err = {{0}};
        uint8_t *rgb = malloc(npx);
        png_task_t *t = calloc(1, sizeof *t);
        if (!rgb || !t || gen_decode(&j->gens[i], rgb, &err) != AR_OK) {
            log_msg(LOG_ERROR, "job %llu: decode failed: %s", (unsigned long long)j->id, err.msg);
            free(rgb);
            free(t);
            job_fail(j, 500, "internal_error", "image decoding failed");
            metric_add(s->m_images, j->n_images, "error");
            break;
        }
        *t = (png_task_t){.job = j, .image = i, .partial = -1, .rgb = rgb};
        job_retain(j);
        png_push(s, t);
    }
    retire(s, idx);
    sched_job_release(j);
}

/* Right after a step, before the planner moves on: the pool's peak during
 * the step (after every append, before any compaction) must be within what
 * the planner reserved for this iteration. Anything else is a bug in a
 * trajectory or the pool accounting; a daemon logs it and counts it, a
 * DEBUG=1 build stops on it. */
static void check_kv_plan(scheduler_t *s) {
    const size_t block = kv_pool_block_bytes(s->pool.blocks.block_tokens, s->pool.blocks.head_dim);
    const size_t peak = (size_t)s->pool.peak_in_use * block;
    const size_t planned = planner_reserved_now(&s->planner);
    if (peak <= planned)
        return;
    log_msg(LOG_ERROR, "KV pool: %zu bytes in use during the step, more than the %zu planned", peak,
            planned);
    pthread_mutex_lock(&s->mu);
    s->kv_overruns++;
    pthread_mutex_unlock(&s->mu);
    metric_add(s->m_kv_overruns, 1);
#ifdef ARSERVE_DEBUG
    abort();
#endif
}

static void engine_iteration(scheduler_t *s) {
    double now = clock_now_s();
    /* Drop cancelled and expired running jobs first: their blocks return now. */
    for (int i = 0; i < s->n_running;) {
        sched_job_t *j = s->running[i];
        int cancelled = job_cancelled(j), expired = now > j->deadline;
        if (!cancelled && !expired) {
            i++;
            continue;
        }
        if (cancelled)
            metric_add(s->m_cancelled, 1);
        metric_add(s->m_images, j->n_images, cancelled ? "cancelled" : "timeout");
        job_fail(j, 504, "timeout",
                 cancelled ? "the request was cancelled" : "the request's deadline passed");
        retire(s, i);
        sched_job_release(j);
    }
    admit(s);
    if (s->n_running == 0)
        return;

    int n_gens = 0;
    for (int i = 0; i < s->n_running; i++)
        n_gens += s->running[i]->n_images;
    gen_request_t **batch = malloc((size_t)n_gens * sizeof *batch);
    if (!batch)
        return;
    int k = 0;
    for (int i = 0; i < s->n_running; i++)
        for (int g = 0; g < s->running[i]->n_images; g++)
            batch[k++] = &s->running[i]->gens[g];
    double t0 = clock_now_s();
    ar_error_t err = {{0}};
    kv_pool_reset_peak(&s->pool);
    int rc = gen_step(batch, n_gens, &err);
    double t1 = clock_now_s();
    free(batch);
    check_kv_plan(s);
    planner_tick(&s->planner);
    if (rc != AR_OK) {
        log_msg(LOG_ERROR, "engine step failed: %s", err.msg);
        while (s->n_running) {
            sched_job_t *j = s->running[0];
            job_fail(j, 500, "internal_error", "the engine step failed");
            metric_add(s->m_images, j->n_images, "error");
            retire(s, 0);
            sched_job_release(j);
        }
        return;
    }
    metric_observe(s->m_step_time, t1 - t0);
    metric_observe(s->m_seqs, 2.0 * n_gens);
    metric_add(s->m_tokens, n_gens);
    metric_add(s->m_iterations, 1);

    for (int i = 0; i < s->n_running;) {
        sched_job_t *j = s->running[i];
        gen_request_t *g0 = &j->gens[0];
        if (!j->first_step_seen) {
            j->first_step_seen = 1;
            metric_observe(s->m_first_step, t1 - j->t_submit);
        }
        pthread_mutex_lock(&j->mu);
        j->steps_done = g0->step;
        pthread_cond_broadcast(&j->changed);
        pthread_mutex_unlock(&j->mu);
        /* Previews at steps total*(p+1)/(P+1), p < P. */
        for (int p = 0; p < j->partial_images; p++)
            if (g0->step == g0->n_steps * (p + 1) / (j->partial_images + 1))
                publish_preview(s, j, p);
        if (gen_request_done(g0)) {
            finish_job(s, i);
            continue;
        }
        i++;
    }
    metric_set(s->m_kv_used, (double)kv_pool_used_bytes(&s->pool));
    metric_set(s->m_kv_reserved, (double)planner_reserved_now(&s->planner));
    if (s->pool.bad_frees != s->bad_frees_seen) {
        log_msg(LOG_ERROR,
                "KV pool: %lld blocks released twice (a bug; the blocks were left alone)",
                s->pool.bad_frees - s->bad_frees_seen);
        s->bad_frees_seen = s->pool.bad_frees;
    }
}

static void *engine_main(void *arg) {
    scheduler_t *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->stop && s->n_running == 0 && s->w_count == 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_nsec += 100 * 1000 * 1000;
            if (ts.tv_nsec >= 1000000000)
                ts.tv_sec++, ts.tv_nsec -= 1000000000;
            pthread_cond_timedwait(&s->wake, &s->mu, &ts);
        }
        int stop = s->stop;
        pthread_mutex_unlock(&s->mu);
        if (stop)
            break;
        engine_iteration(s);
        if (s->n_running == 0) {
            metric_set(s->m_kv_used, 0);
            metric_set(s->m_kv_reserved, (double)planner_reserved_now(&s->planner));
            /* Waiting jobs that do not fit yet: nap until something changes. */
            pthread_mutex_lock(&s->mu);
            if (!s->stop && s->w_count) {
                struct timespec ts;
                clock_gettime(CLOCK_REALTIME, &ts);
                ts.tv_nsec += 10 * 1000 * 1000;
                if (ts.tv_nsec >= 1000000000)
                    ts.tv_sec++, ts.tv_nsec -= 1000000000;
                pthread_cond_timedwait(&s->wake, &s->mu, &ts);
            }
            pthread_mutex_unlock(&s->mu);
        }
    }
    /* Shutting down: fail whatever is left. */
    while (s->n_running) {
        sched_job_t *j = s->running[0];
        job_fail(j, 503, "server_shutdown", "the server is shutting down");
        retire(s, 0);
        sched_job_release(j);
    }
    pthread_mutex_lock(&s->mu);
    while (s->w_count) {
        sched_job_t *j = s->waiting[s->w_head];
        s->w_head = (s->w_head + 1) % s->ring_cap;
        s->w_count--;
        pthread_mutex_unlock(&s->mu);
        job_fail(j, 503, "server_shutdown", "the server is shutting down");
        sched_job_release(j);
        pthread_mutex_lock(&s->mu);
    }
    s->alive = 0;
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- life cycle ---- */

static const double LATENCY_BUCKETS[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                         2.5,  5,     10,   25,  60,   120, 300};
static const double STEP_BUCKETS[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                      0.025,  0.05,    0.1,    0.25,  0.5,    1};
static const double SEQ_BUCKETS[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
#define NB(a) ((int)(sizeof(a) / sizeof((a)[0])))

static void register_metrics(scheduler_t *s, metrics_t *m) {
    static const char *const status[] = {"status"}, *const reason[] = {"reason"};
    s->m_running = metrics_gauge(m, "arserve_requests_running",
                                 "Requests whose images are being generated.", 0, NULL);
    s->m_waiting =
        metrics_gauge(m, "arserve_requests_waiting", "Requests waiting for admission.", 0, NULL);
    s->m_queue_wait =
        metrics_histogram(m, "arserve_queue_wait_seconds", "Time from arrival to admission.", 0,
                          NULL, LATENCY_BUCKETS, NB(LATENCY_BUCKETS));
    s->m_first_step = metrics_histogram(m, "arserve_time_to_first_step_seconds",
                                        "Time from arrival to the first generated image token.", 0,
                                        NULL, LATENCY_BUCKETS, NB(LATENCY_BUCKETS));
    s->m_latency =
        metrics_histogram(m, "arserve_request_duration_seconds",
                          "Time from arrival to encoded images, for successful requests.", 0, NULL,
                          LATENCY_BUCKETS, NB(LATENCY_BUCKETS));
    s->m_step_time =
        metrics_histogram(m, "arserve_iteration_duration_seconds",
                          "Wall time of one engine iteration (forward pass and sampling).", 0, NULL,
                          STEP_BUCKETS, NB(STEP_BUCKETS));
    s->m_seqs =
        metrics_histogram(m, "arserve_iteration_sequences",
                          "Sequences (two per image with CFG) advanced per engine iteration.", 0,
                          NULL, SEQ_BUCKETS, NB(SEQ_BUCKETS));
    s->m_tokens = metrics_counter(m, "arserve_image_tokens_generated_total",
                                  "Image tokens sampled.", 0, NULL);
    s->m_iterations =
        metrics_counter(m, "arserve_iterations_total", "Engine iterations run.", 0, NULL);
    s->m_images =
        metrics_counter(m, "arserve_images_total", "Images finished, by outcome.", 1, status);
    s->m_refused = metrics_counter(m, "arserve_admissions_refused_total",
                                   "Requests refused at submission, by reason.", 1, reason);
    s->m_cancelled = metrics_counter(m, "arserve_requests_cancelled_total",
                                     "Requests cancelled because the client went away.", 0, NULL);
    s->m_kv_capacity = metrics_gauge(m, "arserve_kv_pool_capacity_bytes", "KV pool size.", 0, NULL);
    s->m_kv_reserved =
        metrics_gauge(m, "arserve_kv_pool_reserved_bytes",
                      "KV bytes the planner has reserved for running requests.", 0, NULL);
    s->m_kv_used = metrics_gauge(m, "arserve_kv_pool_used_bytes",
                                 "KV bytes in pool blocks in use now (cached tokens and the rest "
                                 "of each head's last block).",
                                 0, NULL);
    s->m_kv_overruns = metrics_counter(
        m, "arserve_kv_plan_overruns_total",
        "Engine iterations whose KV pool use passed the planner's reservation (a bug).", 0, NULL);
    metric_set(s->m_kv_capacity, (double)kv_pool_capacity_bytes(&s->pool));
    metric_set(s->m_kv_reserved, 0);
    metric_set(s->m_kv_used, 0);
    metric_set(s->m_running, 0);
    metric_set(s->m_waiting, 0);
}

scheduler_t *scheduler_create(model_t *model, const sched_options_t *opt, metrics_t *metrics,
                              ar_error_t *err) {
    scheduler_t *s = calloc(1, sizeof *s);
    if (!s) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    s->model = model;
    s->opt = *opt;
    s->ring_cap = opt->max_waiting < 1 ? 1 : opt->max_waiting;
    s->width = model_config_image_width(&model->cfg);
    s->height = model_config_image_height(&model->cfg);
    s->waiting = calloc((size_t)s->ring_cap, sizeof *s->waiting);
    s->running = calloc((size_t)opt->max_running, sizeof *s->running);
    s->workers = calloc((size_t)opt->png_workers, sizeof *s->workers);
    if (!s->waiting || !s->running || !s->workers) {
        free(s->waiting);
        free(s->running);
        free(s->workers);
        free(s);
        ar_errorf(err, "out of memory");
        return NULL;
    }
    const model_config_t *c = &model->cfg;
    int bt = opt->kv_block_tokens > 0 ? opt->kv_block_tokens : planner_block_tokens(c);
    size_t block = kv_pool_block_bytes(bt, c->llm.head_dim);
    size_t n_blocks = opt->kv_pool_bytes / block;
    if (n_blocks > INT32_MAX)
        n_blocks = INT32_MAX;
    if (kv_pool_init(&s->pool, model->be, (int)n_blocks, bt, c->llm.head_dim, err) != AR_OK) {
        ar_error_prefix(err, "--kv-pool-mb (%zu bytes, blocks of %zu)", opt->kv_pool_bytes, block);
        free(s->waiting);
        free(s->running);
        free(s->workers);
        free(s);
        return NULL;
    }
    s->opt.kv_pool_bytes = kv_pool_capacity_bytes(&s->pool);
    s->opt.kv_block_tokens = bt;
    planner_init(&s->planner, s->opt.kv_pool_bytes);
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    pthread_mutex_init(&s->png_mu, NULL);
    pthread_cond_init(&s->png_wake, NULL);
    s->metrics = metrics;
    register_metrics(s, metrics);
    s->alive = 1;
    if (pthread_create(&s->engine, NULL, engine_main, s) != 0) {
        ar_errorf(err, "cannot start the engine thread: %s", strerror(errno));
        return NULL;
    }
    for (int i = 0; i < opt->png_workers; i++) {
        if (pthread_create(&s->workers[i], NULL, png_worker, s) != 0) {
            ar_errorf(err, "cannot start PNG worker %d: %s", i, strerror(errno));
            return NULL;
        }
        s->n_workers++;
    }
    return s;
}

void scheduler_stop(scheduler_t *s) {
    if (!s || s->joined)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    pthread_join(s->engine, NULL);
    pthread_mutex_lock(&s->png_mu);
    s->png_stop = 1;
    pthread_cond_broadcast(&s->png_wake);
    pthread_mutex_unlock(&s->png_mu);
    for (int i = 0; i < s->n_workers; i++)
        pthread_join(s->workers[i], NULL);
    s->joined = 1;
}

void scheduler_destroy(scheduler_t *s) {
    if (!s)
        return;
    scheduler_stop(s);
    planner_free(&s->planner);
    kv_pool_free(&s->pool);
    free(s->waiting);
    free(s->running);
    free(s->workers);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->wake);
    pthread_mutex_destroy(&s->png_mu);
    pthread_cond_destroy(&s->png_wake);
    free(s);
}
