/* The engine thread around the batcher, the drawing thread and the PNG
 * workers, the jobs' shared state and the scheduler's metrics
 * (scheduler.h). An image goes from the engine thread (its tokens, copied)
 * to the drawing thread (pixels, on a fork of the model's backend) to a PNG
 * worker, so the engine thread only steps. Lock order: the scheduler's mu,
 * then a job's mu; a task queue's mu is taken alone. The batcher is touched
 * only under the scheduler's mu, except batcher_step, which the engine
 * thread runs without it (batcher.h says why that is safe). */
#include "server/scheduler.h"

#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/clock.h"
#include "engine/batcher.h"
#include "engine/format/png_io.h"
#include "engine/generate.h"
#include "engine/kv/kv_pool.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "server/log.h"
#include "server/scheduler_test.h"

struct sched_job {
    uint64_t id;
    int n_images, partial_images;
    int size, width, height, image_tokens; /* one image's size (an index), at that size */
    int *cond, *uncond, *negative;
    kv_policy_params_t kv_policy;
    size_t *kv_bytes; /* the planned KV of all its images, per step */
    int steps;
    size_t kv_planned_peak_bytes; /* one image's (at the admitted level, once admitted) */
    /* Elastic budgets: the levels of its range (0: none), their budgets,
     * plans (all images) and one image's peaks; kv_bytes is the floor's. */
    int n_levels;
    double level_budgets[PLANNER_MAX_LEVELS];
    size_t *level_kv[PLANNER_MAX_LEVELS];
    size_t level_peak[PLANNER_MAX_LEVELS];
    /* What each step costs the engine (all images), as kv_bytes and
     * level_kv: the batcher sums them into each iteration's features. */
    cost_features_t *step_features;
    cost_features_t *level_features[PLANNER_MAX_LEVELS];
    double kv_budget_min, kv_budget_max;
    double t_submit;
    /* engine thread only */
    gen_job_t gen;
    int first_step_seen;

    pthread_mutex_t mu;
    pthread_cond_t changed; /* broadcast on every change of what follows */
    pthread_cond_t ended;   /* broadcast once outcome is no longer PENDING */
    int refs;
    /* under mu */
    unsigned version;
    sched_outcome_t outcome;
    int started, steps_done;
    int n_partials;                         /* previews complete for every image */
    int preview_images[SCHED_MAX_PARTIALS]; /* images encoded, per preview */
    uint8_t *preview[SCHED_MAX_PARTIALS][SCHED_MAX_IMAGES];
    size_t preview_len[SCHED_MAX_PARTIALS][SCHED_MAX_IMAGES];
    uint8_t **png; /* n_images PNGs once DONE */
    size_t *png_len;
    int png_pending;      /* final PNGs not stored yet */
    int previews_pending; /* previews being encoded: DONE waits for them, so that a stream
                             sends every preview before the image */
    char message[256];
    size_t kv_peak_bytes;
    /* When it was admitted, did its last step, and had every PNG (0: not yet). */
    double t_admitted, t_last_step, t_done;
    const char *admission; /* what decided its admission (batcher_regime_name), once admitted */
    double predicted_end;  /* when admission predicted its end (0: time not priced) */
    double t_ended;        /* when outcome left SCHED_PENDING (0: not yet) */
};

/* One image (or preview) on its way out: tokens to draw, then rgb to
 * encode. */
typedef struct img_task {
    sched_job_t *job; /* a reference, held by the task */
    int image;
    int preview;             /* -1 for the final image, else the preview index */
    int n_done;              /* the steps the tokens are of */
    int *tokens;             /* the image's tokens after n_done steps, until drawn */
    int size, width, height; /* the image's size (an index) and pixels */
    uint8_t *rgb;
    double draw_s; /* the drawing's seconds */
    struct img_task *next;
} img_task_t;

/* A FIFO of tasks for a set of threads. */
typedef struct task_queue {
    pthread_mutex_t mu;
    pthread_cond_t wake;
    img_task_t *head, *tail;
    int stop;
} task_queue_t;

struct scheduler {
    model_t *model;
    sched_options_t opt;
    metrics_t *metrics;

    pthread_mutex_t mu;
    pthread_cond_t wake; /* new job, cancellation or stop */
    batcher_t *batcher;
    int stop, draining, alive, kick, joined;
    long long overruns_seen, lost_events_seen; /* engine thread only */
    unsigned long long released_seen;          /* engine thread only */
    long long bad_frees_seen;
    kv_pool_t pool; /* engine thread only (its geometry is fixed: read anywhere) */
    pthread_t engine;
    int engine_started;

    gen_drawer_t drawer; /* the drawing thread's */
    task_queue_t draw_q, png_q;
    pthread_t drawing;
    int drawing_started;
    pthread_t *workers;
    int n_workers;

    /* Why the backend (the model's, or the drawing thread's fork) can no
     * longer run anything: written once, under mu, by the first thread to
     * see it, then published by unusable; read without a lock. */
    atomic_int unusable;
    char unusable_why[sizeof(ar_error_t) + 64];

    /* The engine's cost, learned from its own iterations and images
     * (cost_model.h); under cost_mu, written by the engine, drawing and PNG
     * threads, read by sched_capacity. */
    pthread_mutex_t cost_mu;
    cost_learner_t costs;
    metric_t *m_cost_coef, *m_cost_samples, *m_cost_rel_rms, *m_cost_refits, *m_cost_image,
        *m_cost_http, *m_admissions;

    metric_t *m_running, *m_waiting, *m_queue_wait, *m_first_step, *m_latency, *m_step_time,
        *m_seqs, *m_tokens, *m_images, *m_refused, *m_cancelled, *m_kv_capacity, *m_kv_reserved,
        *m_kv_used, *m_iterations, *m_kv_overruns, *m_kv_released, *m_policy, *m_backend_healthy,
        *m_kv_budget, *m_kv_below_max;
};

/* Waits on c for at most seconds (mu held). */
static void cond_wait_s(pthread_cond_t *c, pthread_mutex_t *mu, double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    const double whole = floor(seconds);
    ts.tv_sec += (time_t)whole;
    ts.tv_nsec += (long)((seconds - whole) * 1e9);
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_cond_timedwait(c, mu, &ts);
}

/* ---- jobs ---- */

static sched_job_t *job_of_work(void *work) {
    return (sched_job_t *)((char *)work - offsetof(sched_job_t, gen));
}

static void job_free(sched_job_t *j) {
    gen_job_free(&j->gen);
    for (int i = 0; j->png && i < j->n_images; i++)
        free(j->png[i]);
    for (int p = 0; p < SCHED_MAX_PARTIALS; p++)
        for (int i = 0; i < SCHED_MAX_IMAGES; i++)
            free(j->preview[p][i]);
    free(j->png);
    free(j->png_len);
    free(j->cond);
    free(j->uncond);
    free(j->negative);
    free(j->kv_bytes);
    free(j->step_features);
    for (int l = 0; l < j->n_levels; l++) {
        free(j->level_kv[l]);
        free(j->level_features[l]);
    }
    pthread_mutex_destroy(&j->mu);
    pthread_cond_destroy(&j->changed);
    pthread_cond_destroy(&j->ended);
    free(j);
}

void sched_job_release(sched_job_t *j) {
    if (!j)
        return;
    pthread_mutex_lock(&j->mu);
    int left = --j->refs;
    pthread_mutex_unlock(&j->mu);
    if (left == 0)
        job_free(j);
}

void sched_job_retain(sched_job_t *j) {
    pthread_mutex_lock(&j->mu);
    j->refs++;
    pthread_mutex_unlock(&j->mu);
}

double sched_job_ended_at(sched_job_t *j) {
    pthread_mutex_lock(&j->mu);
    const double t = j->t_ended;
    pthread_mutex_unlock(&j->mu);
    return t;
}

/* Publishes a change (the caller holds j->mu). */
static void job_changed(sched_job_t *j) {
    j->version++;
    pthread_cond_broadcast(&j->changed);
    if (j->outcome != SCHED_PENDING) {
        if (!j->t_ended)
            j->t_ended = clock_now_s();
        pthread_cond_broadcast(&j->ended);
    }
}

/* Ends a job (unless it ended already). When it ends it here and images is
 * not NULL, its images are counted there under label first, so that a
 * waiting request thread answers after the count (as maybe_done does). */
static void job_end_counted(sched_job_t *j, sched_outcome_t outcome, const char *message,
                            metric_t *images, const char *label) {
    pthread_mutex_lock(&j->mu);
    if (j->outcome == SCHED_PENDING) {
        if (images)
            metric_add(images, j->n_images, label);
        j->outcome = outcome;
        snprintf(j->message, sizeof j->message, "%s", message ? message : "");
        job_changed(j);
    }
    pthread_mutex_unlock(&j->mu);
}

static void job_end(sched_job_t *j, sched_outcome_t outcome, const char *message) {
    job_end_counted(j, outcome, message, NULL, NULL);
}

uint64_t sched_job_id(const sched_job_t *j) { return j->id; }

static void snapshot_locked(const sched_job_t *j, sched_snapshot_t *out) {
    *out = (sched_snapshot_t){.version = j->version,
                              .outcome = j->outcome,
                              .started = j->started,
                              .steps_done = j->steps_done,
                              .steps_total = j->steps,
                              .n_partials = j->n_partials,
                              .partial_images = j->partial_images,
                              .n_images = j->n_images,
                              .width = j->width,
                              .height = j->height,
                              .image_tokens = j->image_tokens,
                              .kv_policy = j->kv_policy,
                              .kv_budget_min = j->kv_budget_min,
                              .kv_budget_max = j->kv_budget_max,
                              .kv_planned_peak_bytes = j->kv_planned_peak_bytes,
                              .kv_peak_bytes = j->kv_peak_bytes,
                              .admission = j->admission};
    if (j->predicted_end > 0)
        out->predicted_s = j->predicted_end - j->t_submit;
    if (j->t_admitted > 0)
        out->queue_s = j->t_admitted - j->t_submit;
    if (j->t_last_step > 0)
        out->run_s = j->t_last_step - j->t_admitted;
    if (j->t_done > 0)
        out->finish_s = j->t_done - j->t_last_step;
    snprintf(out->message, sizeof out->message, "%s", j->message);
}

void sched_job_snapshot(sched_job_t *j, sched_snapshot_t *out) {
    pthread_mutex_lock(&j->mu);
    snapshot_locked(j, out);
    pthread_mutex_unlock(&j->mu);
}

void sched_job_wait(sched_job_t *j, unsigned seen, double timeout_s, sched_snapshot_t *out) {
    const double until = clock_now_s() + timeout_s;
    pthread_mutex_lock(&j->mu);
    for (double left = timeout_s; j->version == seen && left > 0; left = until - clock_now_s())
        cond_wait_s(&j->changed, &j->mu, left);
    snapshot_locked(j, out);
    pthread_mutex_unlock(&j->mu);
}

void sched_job_wait_end(sched_job_t *j, double timeout_s, sched_snapshot_t *out) {
    const double until = clock_now_s() + timeout_s;
    pthread_mutex_lock(&j->mu);
    for (double left = timeout_s; j->outcome == SCHED_PENDING && left > 0;
         left = until - clock_now_s())
        cond_wait_s(&j->ended, &j->mu, left);
    snapshot_locked(j, out);
    pthread_mutex_unlock(&j->mu);
}

const uint8_t *sched_job_png(sched_job_t *j, int image, size_t *len) {
    pthread_mutex_lock(&j->mu);
    const int ok = j->outcome == SCHED_DONE && image >= 0 && image < j->n_images;
    const uint8_t *png = ok ? j->png[image] : NULL;
    *len = ok ? j->png_len[image] : 0;
    pthread_mutex_unlock(&j->mu);
    return png;
}

const uint8_t *sched_job_preview(sched_job_t *j, int preview, int image, size_t *len) {
    pthread_mutex_lock(&j->mu);
    const int ok = preview >= 0 && preview < j->n_partials && image >= 0 && image < j->n_images;
    const uint8_t *png = ok ? j->preview[preview][image] : NULL;
    *len = ok ? j->preview_len[preview][image] : 0;
    pthread_mutex_unlock(&j->mu);
    return png;
}

/* ---- the image tasks: drawing, then PNG encoding ---- */

static void queue_init(task_queue_t *q) {
    pthread_mutex_init(&q->mu, NULL);
    pthread_cond_init(&q->wake, NULL);
}

static void queue_push(task_queue_t *q, img_task_t *t) {
    pthread_mutex_lock(&q->mu);
    t->next = NULL;
    if (q->tail)
        q->tail->next = t;
    else
        q->head = t;
    q->tail = t;
    pthread_cond_signal(&q->wake);
    pthread_mutex_unlock(&q->mu);
}

/* Waits for tasks and takes the first (all of them when all is set), in
 * order; NULL once the queue is stopped and empty. */
static img_task_t *queue_pop(task_queue_t *q, int all) {
    pthread_mutex_lock(&q->mu);
    while (!q->head && !q->stop)
        pthread_cond_wait(&q->wake, &q->mu);
    img_task_t *t = q->head;
    if (t) {
        q->head = all ? NULL : t->next;
        if (!q->head)
            q->tail = NULL;
        if (!all)
            t->next = NULL;
    }
    pthread_mutex_unlock(&q->mu);
    return t;
}

static void queue_stop(task_queue_t *q) {
    pthread_mutex_lock(&q->mu);
    q->stop = 1;
    pthread_cond_broadcast(&q->wake);
    pthread_mutex_unlock(&q->mu);
}

static void task_free(img_task_t *t) {
    sched_job_release(t->job);
    free(t->tokens);
    free(t->rgb);
    free(t);
}

/* Tasks left by a stop hold job references: drop them. */
static void queue_destroy(task_queue_t *q) {
    for (img_task_t *t = q->head, *next; t; t = next) {
        next = t->next;
        task_free(t);
    }
    pthread_mutex_destroy(&q->mu);
    pthread_cond_destroy(&q->wake);
}

/* Fails a job that has not ended yet, its images counted as errors once. */
static void job_fail(scheduler_t *s, sched_job_t *j, const char *message) {
    job_end_counted(j, SCHED_FAILED, message, s->m_images, "error");
}

/* Hands one image of j to the drawing thread: its tokens after n_done
 * steps, copied. A preview that cannot be queued is skipped; a final image
 * fails the job. */
static void draw_queue(scheduler_t *s, sched_job_t *j, int image, int preview, int n_done) {
    const gen_request_t *r = &j->gen.images[image];
    const size_t n = gen_request_token_values(r);
    img_task_t *t = malloc(sizeof *t);
    int *tokens = malloc(n * sizeof *tokens);
    if (!t || !tokens) {
        free(t);
        free(tokens);
        log_msg(LOG_ERROR, "job %llu: out of memory queueing %s %d", (unsigned long long)j->id,
                preview < 0 ? "image" : "a preview of image", image);
        if (preview < 0)
            job_fail(s, j, "out of memory drawing the image");
        return;
    }
    memcpy(tokens, r->tokens, n * sizeof *tokens);
    *t = (img_task_t){.job = j,
                      .image = image,
                      .preview = preview,
                      .n_done = n_done,
                      .tokens = tokens,
                      .size = r->size};
    model_image_dims(&s->model->cfg, r->size, &t->width, &t->height);
    pthread_mutex_lock(&j->mu);
    j->refs++;
    j->previews_pending += preview >= 0;
    pthread_mutex_unlock(&j->mu);
    queue_push(&s->draw_q, t);
}

/* DONE once the final PNGs and every preview queued before them are in
 * (j->mu held). */
static void maybe_done(scheduler_t *s, sched_job_t *j) {
    if (j->png_pending || j->previews_pending || j->outcome != SCHED_PENDING)
        return;
    /* Counted before the waiting request thread can answer. */
    metric_add(s->m_images, j->n_images, "ok");
    j->t_done = clock_now_s();
    metric_observe(s->m_latency, j->t_done - j->t_submit);
    j->outcome = SCHED_DONE;
}

/* Stores one encoded PNG in its job (png NULL: the preview was skipped, or
 * the image failed and its job with it), and lets waiters see it. */
static void png_store(scheduler_t *s, const img_task_t *t, uint8_t *png, size_t len) {
    sched_job_t *j = t->job;
    pthread_mutex_lock(&j->mu);
    if (t->preview >= 0) {
        j->previews_pending--;
        if (png) {
            j->preview[t->preview][t->image] = png;
            j->preview_len[t->preview][t->image] = len;
            /* A preview is published once every image of it is in, in order. */
            j->preview_images[t->preview]++;
            while (j->n_partials < j->partial_images &&
                   j->preview_images[j->n_partials] == j->n_images)
                j->n_partials++;
        }
    } else if (png) {
        j->png[t->image] = png;
        j->png_len[t->image] = len;
        j->png_pending--;
    }
    maybe_done(s, j);
    job_changed(j);
    pthread_mutex_unlock(&j->mu);
}

/* What became of a task that produced nothing at stage `what`: logged, a
 * preview skipped, a final image failing its job with `message`. */
static void task_failed(scheduler_t *s, img_task_t *t, const char *what, const char *message,
                        const char *why) {
    sched_job_t *j = t->job;
    if (t->preview < 0) {
        log_msg(LOG_ERROR, "job %llu: %s of image %d failed: %s", (unsigned long long)j->id, what,
                t->image, why);
        job_fail(s, j, message);
    } else {
        log_msg(LOG_WARN, "job %llu: preview %d of image %d skipped: %s: %s",
                (unsigned long long)j->id, t->preview, t->image, what, why);
    }
    png_store(s, t, NULL, 0);
    task_free(t);
}

/* After a failure on be (the model's backend or the drawing fork): when be
 * says it can no longer run anything, every later step or draw would fail
 * too, so the scheduler records why (the first such reason), says so once
 * in the log and turns arserve_backend_healthy to 0. Called from the thread
 * driving be. */
static void check_backend(scheduler_t *s, backend_t *be) {
    const char *why = backend_unusable(be);
    if (!why)
        return;
    pthread_mutex_lock(&s->mu);
    const int first = !atomic_load(&s->unusable);
    if (first) {
        snprintf(s->unusable_why, sizeof s->unusable_why, "backend %s unusable after: %s", be->name,
                 why);
        atomic_store(&s->unusable, 1);
    }
    pthread_mutex_unlock(&s->mu);
    if (!first)
        return;
    metric_set(s->m_backend_healthy, 0);
    log_msg(LOG_ERROR,
            "%s; every request will fail from now on, and /health and /ready answer 503: restart "
            "the daemon",
            s->unusable_why);
}

/* The drawing thread: takes every queued image at once and draws them in
 * turn on its own backend with buffers made once, then hands the pixels to
 * the PNG workers. An image whose job has failed already is not drawn. */
/* The learned table's figures as metrics (cost_mu held). */
static void publish_costs(scheduler_t *s) {
    static const char *const terms[COST_N_COEF] = {"intercept", "per_sequence", "per_kv_attended",
                                                   "per_new_token", "per_kv_scored"};
    const cost_table_t *t = &s->costs.table;
    for (int k = 0; k < COST_N_COEF; k++)
        metric_set(s->m_cost_coef, t->coef[k], terms[k]);
    metric_set(s->m_cost_samples, (double)t->fit_samples);
    metric_set(s->m_cost_rel_rms, t->fit_rel_rms);
    metric_set(s->m_cost_image, t->decode_s, "decode");
    metric_set(s->m_cost_image, t->png_s, "png");
    metric_set(s->m_cost_http, t->http_s);
}

/* One timed iteration into the learned cost table. */
static void learn_iteration(scheduler_t *s, const cost_features_t *f, double seconds) {
    pthread_mutex_lock(&s->cost_mu);
    const int refitted = cost_learner_add(&s->costs, f, seconds);
    const cost_table_t t = s->costs.table;
    if (refitted) {
        metric_add(s->m_cost_refits, 1);
        publish_costs(s);
    }
    pthread_mutex_unlock(&s->cost_mu);
    if (refitted) { /* admission prices time by the new table from now on */
        pthread_mutex_lock(&s->mu);
        batcher_set_costs(s->batcher, &t);
        pthread_mutex_unlock(&s->mu);
    }
}

/* Draws t's pixels (t->rgb), timing it in t->draw_s; AR_ERR in err. */
static int draw_one(scheduler_t *s, img_task_t *t, ar_error_t *err) {
    if (!(t->rgb = malloc((size_t)t->width * t->height * 3)))
        return ar_errorf(err, "out of memory");
    const double t0 = clock_now_s();
    const int rc = gen_drawer_draw(&s->drawer, t->tokens, t->size, t->n_done, t->rgb, err);
    t->draw_s = clock_now_s() - t0;
    return rc;
}

static void *draw_main(void *arg) {
    scheduler_t *s = arg;
    for (img_task_t *batch; (batch = queue_pop(&s->draw_q, 1));) {
        for (img_task_t *t = batch, *next; t; t = next) {
            next = t->next;
            pthread_mutex_lock(&t->job->mu);
            const int failed = t->job->outcome != SCHED_PENDING;
            pthread_mutex_unlock(&t->job->mu);
            ar_error_t err = {{0}};
            if (failed) { /* logged once, by the draw that failed it */
                png_store(s, t, NULL, 0);
                task_free(t);
            } else if (draw_one(s, t, &err) != AR_OK) {
                task_failed(s, t, "drawing", "image decoding failed", err.msg);
                check_backend(s, s->drawer.be);
            } else {
                free(t->tokens);
                t->tokens = NULL;
                queue_push(&s->png_q, t);
            }
        }
    }
    return NULL;
}

static void *png_worker(void *arg) {
    scheduler_t *s = arg;
    for (img_task_t *t; (t = queue_pop(&s->png_q, 0));) {
        uint8_t *png = NULL;
        size_t len = 0;
        ar_error_t err = {{0}};
        const double t0 = clock_now_s();
        if (png_encode(t->rgb, t->width, t->height, &png, &len, &err) != AR_OK) {
            task_failed(s, t, "PNG encoding", "PNG encoding failed", err.msg);
            continue;
        }
        if (t->preview < 0 && s->opt.learn_costs) { /* a final image: the per-image costs */
            pthread_mutex_lock(&s->cost_mu);
            cost_learner_add_image(&s->costs, t->draw_s, clock_now_s() - t0);
            publish_costs(s);
            pthread_mutex_unlock(&s->cost_mu);
        }
        png_store(s, t, png, len);
        task_free(t);
    }
    return NULL;
}

void sched_note_http(scheduler_t *s, double seconds) {
    if (!s->opt.learn_costs)
        return;
    pthread_mutex_lock(&s->cost_mu);
    cost_learner_add_request(&s->costs, seconds);
    publish_costs(s);
    pthread_mutex_unlock(&s->cost_mu);
}

/* ---- what the engine thread does with the batcher's events ---- */

int sched_preview_step(int steps, int n_previews, int p) {
    return steps * (p + 1) / (n_previews + 1);
}

int sched_reportable_steps(const sched_snapshot_t *snap, int previews_said) {
    int steps = snap->steps_done;
    if (snap->outcome == SCHED_PENDING && previews_said < snap->partial_images) {
        const int next = sched_preview_step(snap->steps_total, snap->partial_images, previews_said);
        if (steps > next)
            steps = next;
    }
    return steps;
}

/* Previews at their steps (sched_preview_step), from the tokens so far. */
static void publish_previews(scheduler_t *s, sched_job_t *j, int steps_done) {
    for (int p = 0; p < j->partial_images; p++) {
        if (steps_done != sched_preview_step(j->steps, j->partial_images, p))
            continue;
        for (int i = 0; i < j->n_images; i++)
            draw_queue(s, j, i, p, steps_done);
    }
}

/* A job whose images are all done: its KV peak, and its images to the
 * drawing thread. */
static void job_finished(scheduler_t *s, sched_job_t *j) {
    const size_t block = kv_pool_bytes_per_block(&s->pool);
    int peak_blocks = 0;
    for (int i = 0; i < j->n_images; i++)
        if (j->gen.images[i].kv_peak_blocks > peak_blocks)
            peak_blocks = j->gen.images[i].kv_peak_blocks;
    pthread_mutex_lock(&j->mu);
    j->kv_peak_bytes = (size_t)peak_blocks * block;
    job_changed(j);
    pthread_mutex_unlock(&j->mu);
    for (int i = 0; i < j->n_images; i++)
        draw_queue(s, j, i, -1, j->steps);
}

/* ev happened at time now: its iteration's admission or its step's end
 * (not when it is handled: decoding an earlier job's images comes between). */
static void handle_event(scheduler_t *s, const batcher_event_t *ev, double now) {
    sched_job_t *j = job_of_work(ev->work);
    switch (ev->type) {
    case BATCHER_ADMITTED: {
        metric_observe(s->m_queue_wait, now - j->t_submit);
        pthread_mutex_lock(&j->mu);
        j->started = 1;
        j->t_admitted = now;
        j->admission = batcher_regime_name(ev->regime);
        j->predicted_end = ev->predicted_end;
        if (j->n_levels > 0) { /* the budget the batcher found room for */
            j->kv_policy.budget = j->level_budgets[ev->level];
            j->kv_planned_peak_bytes = j->level_peak[ev->level];
        }
        const kv_policy_params_t p = j->kv_policy;
        job_changed(j);
        pthread_mutex_unlock(&j->mu);
        const char *name = kv_policy_name(p.kind);
        metric_observe(s->m_kv_budget, p.kind == KV_POLICY_FULL ? 1.0 : p.budget, name);
        metric_add(s->m_admissions, 1, batcher_regime_name(ev->regime));
        if (j->n_levels > 0 && ev->level > 0)
            metric_add(s->m_kv_below_max, 1, name);
        return;
    }
    case BATCHER_STEPPED:
        /* What the step sampled, as the model's family says: a token per
         * image on a raster model, a whole scale per image on a next-scale
         * one. */
        metric_add(s->m_tokens,
                   (double)j->n_images *
                       model_step_tokens_sized(&s->model->cfg, j->size, ev->steps_done - 1));
        if (!j->first_step_seen) {
            j->first_step_seen = 1;
            metric_observe(s->m_first_step, now - j->t_submit);
        }
        pthread_mutex_lock(&j->mu);
        j->steps_done = ev->steps_done;
        if (ev->steps_done == j->steps)
            j->t_last_step = now;
        job_changed(j);
        pthread_mutex_unlock(&j->mu);
        publish_previews(s, j, ev->steps_done);
        return;
    case BATCHER_ENDED:
        break;
    }
    switch (ev->end) {
    case BATCHER_END_FINISHED:
        job_finished(s, j);
        break;
    case BATCHER_END_CANCELLED:
        metric_add(s->m_cancelled, 1);
        metric_add(s->m_images, j->n_images, "cancelled");
        job_end(j, SCHED_CANCELLED, NULL);
        break;
    case BATCHER_END_EXPIRED:
        metric_add(s->m_images, j->n_images, "timeout");
        job_end(j, SCHED_EXPIRED, NULL);
        break;
    case BATCHER_END_FAILED:
        log_msg(LOG_ERROR, "job %llu failed: %s", (unsigned long long)j->id, ev->why);
        metric_add(s->m_images, j->n_images, "error");
        job_end(j, SCHED_FAILED,
                ev->started ? "the engine step failed" : "the job could not start");
        break;
    case BATCHER_END_SHUTDOWN:
        job_end(j, SCHED_SHUTDOWN, NULL);
        break;
    }
    gen_job_free(&j->gen);
    sched_job_release(j); /* the scheduler's reference */
}

/* Takes the batcher's events (mu held) into *buf, growing it. */
static int take_events(scheduler_t *s, batcher_event_t **buf, int *cap) {
    int n = 0;
    for (;;) {
        if (n == *cap) {
            int grown = *cap ? 2 * *cap : 64;
            batcher_event_t *b = realloc(*buf, (size_t)grown * sizeof *b);
            if (!b)
                break; /* the rest waits for the next call */
            *buf = b;
            *cap = grown;
        }
        int got = batcher_take_events(s->batcher, *buf + n, *cap - n);
        n += got;
        if (n < *cap)
            break;
    }
    return n;
}

/* Gauges of the queue and the reservation (mu held). */
static void set_gauges(scheduler_t *s) {
    batcher_stats_t st;
    batcher_stats(s->batcher, &st);
    metric_set(s->m_waiting, st.waiting);
    metric_set(s->m_running, st.running);
    metric_set(s->m_kv_reserved, (double)st.reserved_bytes);
}

/* After a step: the pool's peak during it (after every append, before any
 * compaction) must be within what the planner reserved. Anything else is a
 * bug in a trajectory or the pool accounting; a daemon logs and counts it,
 * a DEBUG=1 build stops on it. */
static void check_iteration(scheduler_t *s, const batcher_stats_t *st, double seconds) {
    metric_observe(s->m_step_time, seconds);
    metric_observe(s->m_seqs, 2.0 * st->last_images);
    metric_add(s->m_iterations, 1);
    metric_set(s->m_kv_used, (double)kv_pool_used_bytes(&s->pool));
    metric_add(s->m_kv_released, (double)(st->released_bytes - s->released_seen));
    s->released_seen = st->released_bytes;
    if (st->overruns != s->overruns_seen) {
        s->overruns_seen = st->overruns;
        log_msg(LOG_ERROR, "KV pool: %zu bytes in use during the step, more than the %zu planned",
                st->last_kv_peak_bytes, st->last_reserved_bytes);
        metric_add(s->m_kv_overruns, 1);
#ifdef ARSERVE_DEBUG
        abort();
#endif
    }
    if (s->pool.bad_frees != s->bad_frees_seen) {
        log_msg(LOG_ERROR,
                "KV pool: %lld blocks released twice (a bug; the blocks were left alone)",
                s->pool.bad_frees - s->bad_frees_seen);
        s->bad_frees_seen = s->pool.bad_frees;
    }
    if (st->lost_events != s->lost_events_seen) {
        log_msg(LOG_ERROR, "batcher: %lld events lost (out of memory)",
                st->lost_events - s->lost_events_seen);
        s->lost_events_seen = st->lost_events;
    }
}

static void handle_events(scheduler_t *s, const batcher_event_t *ev, int n, double at) {
    for (int i = 0; i < n; i++)
        handle_event(s, &ev[i], at);
}

static void *engine_main(void *arg) {
    scheduler_t *s = arg;
    batcher_event_t *ev = NULL;
    int cap = 0;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        for (;;) {
            batcher_stats_t st;
            batcher_stats(s->batcher, &st);
            if (s->stop || s->kick || st.waiting || st.running)
                break;
            metric_set(s->m_kv_used, 0);
            cond_wait_s(&s->wake, &s->mu, 0.1);
        }
        if (s->stop) {
            pthread_mutex_unlock(&s->mu);
            break;
        }
        s->kick = 0;
        const double t_admit = clock_now_s();
        const int n = batcher_admit(s->batcher, t_admit);
        int n_ev = take_events(s, &ev, &cap);
        set_gauges(s);
        batcher_stats_t st;
        batcher_stats(s->batcher, &st);
        pthread_mutex_unlock(&s->mu);
        handle_events(s, ev, n_ev, t_admit);
        if (n == 0) {
            /* Waiting jobs that cannot start yet: nap until something changes. */
            if (st.waiting) {
                pthread_mutex_lock(&s->mu);
                if (!s->stop && !s->kick)
                    cond_wait_s(&s->wake, &s->mu, 0.01);
                pthread_mutex_unlock(&s->mu);
            }
            continue;
        }
        ar_error_t err = {{0}};
        const double t0 = clock_now_s();
        const int rc = batcher_step(s->batcher, &err);
        const double t1 = clock_now_s();
        if (rc != AR_OK) {
            log_msg(LOG_ERROR, "engine step failed: %s", err.msg);
            check_backend(s, s->model->be);
        }
        pthread_mutex_lock(&s->mu);
        batcher_finish(s->batcher, rc, &err);
        n_ev = take_events(s, &ev, &cap);
        set_gauges(s);
        batcher_stats(s->batcher, &st);
        pthread_mutex_unlock(&s->mu);
        if (rc == AR_OK)
            check_iteration(s, &st, t1 - t0);
        handle_events(s, ev, n_ev, t1);
        /* The table prices the whole turn of this loop, admission and events
         * included (what a request waits per step, and what the simulator's
         * clock advances by), not the step alone. */
        if (rc == AR_OK && st.last_features_known && s->opt.learn_costs)
            learn_iteration(s, &st.last_features, clock_now_s() - t_admit);
    }
    /* Shutting down: end whatever is left. */
    pthread_mutex_lock(&s->mu);
    batcher_shutdown(s->batcher);
    int n_ev = take_events(s, &ev, &cap);
    set_gauges(s);
    pthread_mutex_unlock(&s->mu);
    handle_events(s, ev, n_ev, clock_now_s());
    free(ev);
    pthread_mutex_lock(&s->mu);
    s->alive = 0;
    pthread_mutex_unlock(&s->mu);
    return NULL;
}

/* ---- submission and control ---- */

static sched_job_t *refuse(scheduler_t *s, sched_refusal_info_t *why, sched_refusal_t reason,
                           const char *label) {
    why->reason = reason;
    if (label)
        metric_add(s->m_refused, 1, label);
    return NULL;
}

static sched_job_t *job_new(const sched_request_t *req, const planner_plan_t *plan,
                            const kv_geometry_t *g) {
    sched_job_t *j = calloc(1, sizeof *j);
    if (!j)
        return NULL;
    j->cond = malloc((size_t)req->n_prompt * sizeof(int));
    j->uncond = malloc((size_t)req->n_prompt * sizeof(int));
    j->png = calloc((size_t)req->n_images, sizeof *j->png);
    j->png_len = calloc((size_t)req->n_images, sizeof *j->png_len);
    j->kv_bytes = malloc((size_t)plan->steps * sizeof *j->kv_bytes);
    j->step_features = cost_plan_features(g, plan, req->n_images);
    if (req->n_negative > 0 && (j->negative = malloc((size_t)req->n_negative * sizeof(int))))
        memcpy(j->negative, req->negative, (size_t)req->n_negative * sizeof(int));
    pthread_mutex_init(&j->mu, NULL);
    pthread_cond_init(&j->changed, NULL);
    pthread_cond_init(&j->ended, NULL);
    if (!j->cond || !j->uncond || !j->png || !j->png_len || !j->kv_bytes || !j->step_features ||
        (req->n_negative > 0 && !j->negative)) {
        job_free(j);
        return NULL;
    }
    memcpy(j->cond, req->cond, (size_t)req->n_prompt * sizeof(int));
    memcpy(j->uncond, req->uncond, (size_t)req->n_prompt * sizeof(int));
    for (int t = 0; t < plan->steps; t++)
        j->kv_bytes[t] = plan->bytes[t] * (size_t)req->n_images;
    j->steps = plan->steps;
    j->n_images = req->n_images;
    j->png_pending = req->n_images; /* every image ends as a PNG */
    j->partial_images = req->partial_images;
    j->kv_policy = req->kv_policy;
    j->kv_planned_peak_bytes = plan->peak_bytes;
    j->t_submit = clock_now_s();
    j->refs = 2; /* the caller's and the scheduler's */
    return j;
}

/* A range's levels into j (its kv_bytes and peak become the floor's). */
static int job_set_levels(sched_job_t *j, const planner_levels_t *lv, const kv_geometry_t *g,
                          double lo, double hi) {
    for (int l = 0; l < lv->n; l++) {
        j->level_kv[l] = malloc((size_t)j->steps * sizeof *j->level_kv[l]);
        j->level_features[l] = cost_plan_features(g, &lv->plans[l], j->n_images);
        j->n_levels = l + 1;
        if (!j->level_kv[l] || !j->level_features[l])
            return AR_ERR;
        for (int t = 0; t < j->steps; t++)
            j->level_kv[l][t] = lv->plans[l].bytes[t] * (size_t)j->n_images;
        j->level_budgets[l] = lv->budgets[l];
        j->level_peak[l] = lv->plans[l].peak_bytes;
    }
    j->kv_budget_min = lo;
    j->kv_budget_max = hi;
    return AR_OK;
}

int sched_plan_range(const model_config_t *cfg, const kv_policy_params_t *p, double budget_min,
                     int n_prompt, int size, int block_tokens, planner_kv_dtype_t dt,
                     planner_levels_t *lv, double *lo, sched_refusal_info_t *why) {
    kv_geometry_t g;
    model_geometry_sized(cfg, n_prompt, size, &g);
    const double hi = p->budget, least = kv_policy_min_budget(p, &g);
    if (!kv_policy_uses_budget(p->kind, &g)) {
        why->field = "budget_min";
        snprintf(why->message, sizeof why->message,
                 "kv_budget_min: %s takes no budget on this model, so it has no range",
                 kv_policy_name(p->kind));
        return AR_ERR;
    }
    /* A policy that fails at every budget fails at the top, with its reason. */
    *lo = budget_min > 0 ? budget_min : least > 0 ? least : hi;
    /* least is on a 1e-4 grid (rounded up): the policy's own check says
     * whether a budget just below it (1/6 < 0.1667) still holds its knobs. */
    kv_policy_params_t q = *p;
    if (least > 0 && kv_policy_check(p, &g, NULL, NULL) != AR_OK) {
        why->field = "budget";
        snprintf(why->message, sizeof why->message,
                 "kv_budget %.4g is below the least budget %s takes on this request, %.4g (its "
                 "knobs and prompt)",
                 hi, kv_policy_name(p->kind), least);
        return AR_ERR;
    }
    q.budget = *lo;
    if (least > 0 && kv_policy_check(&q, &g, NULL, NULL) != AR_OK) {
        why->field = "budget_min";
        snprintf(why->message, sizeof why->message,
                 "kv_budget_min %.4g is below the least budget %s takes on this request, %.4g "
                 "(its knobs and prompt)",
                 *lo, kv_policy_name(p->kind), least);
        return AR_ERR;
    }
    if (*lo > hi) {
        why->field = "budget_min";
        snprintf(why->message, sizeof why->message,
                 "kv_budget_min %.4g is above the range's top, kv_budget %.4g", *lo, hi);
        return AR_ERR;
    }
    ar_error_t err = {{0}};
    if (planner_plan_levels(lv, cfg, p, *lo, hi, n_prompt, size, block_tokens, dt, &why->field,
                            &err) != AR_OK) {
        snprintf(why->message, sizeof why->message, "%.*s", (int)sizeof why->message - 1, err.msg);
        return AR_ERR;
    }
    return AR_OK;
}

sched_job_t *sched_submit(scheduler_t *s, const sched_request_t *req, sched_refusal_info_t *why) {
    memset(why, 0, sizeof *why);
    why->pool_bytes = kv_pool_capacity_bytes(&s->pool);
    why->max_running = s->opt.max_running;
    why->max_waiting = s->opt.max_waiting;
    const int n_sizes = s->model->cfg.image.n_sizes > 0 ? s->model->cfg.image.n_sizes : 1;
    if (req->n_images < 1 || req->n_images > SCHED_MAX_IMAGES || req->n_prompt < 1 ||
        req->partial_images < 0 || req->partial_images > SCHED_MAX_PARTIALS || req->size < 0 ||
        req->size >= n_sizes) {
        snprintf(why->message, sizeof why->message,
                 "a request of %d images, %d previews and size %d", req->n_images,
                 req->partial_images, req->size);
        return refuse(s, why, SCHED_REFUSED_NO_MEMORY, NULL);
    }
    /* The plan is pure host arithmetic on read-only geometry: no lock. A
     * range is planned at each of its levels; the job's own plan is the
     * floor's, the one that decides whether it can ever run. */
    planner_plan_t plan;
    planner_levels_t lv = {0};
    double lo = 0;
    ar_error_t perr = {{0}};
    if (req->kv_budget_min != 0) {
        if (sched_plan_range(&s->model->cfg, &req->kv_policy, req->kv_budget_min, req->n_prompt,
                             req->size, s->pool.blocks.block_tokens,
                             planner_kv_same(s->pool.blocks.dtype), &lv, &lo, why) != AR_OK)
            return refuse(s, why, SCHED_REFUSED_INVALID_POLICY, "invalid_policy");
    } else if (planner_plan_sized(&plan, &s->model->cfg, &req->kv_policy, req->n_prompt, req->size,
                                  s->pool.blocks.block_tokens,
                                  planner_kv_same(s->pool.blocks.dtype), &why->field,
                                  &perr) != AR_OK) {
        snprintf(why->message, sizeof why->message, "%.*s", (int)sizeof why->message - 1, perr.msg);
        return refuse(s, why, SCHED_REFUSED_INVALID_POLICY, "invalid_policy");
    }
    const planner_plan_t *own = lv.n > 0 ? &lv.plans[lv.n - 1] : &plan;
    why->need_bytes = own->peak_bytes * (size_t)req->n_images;
    kv_geometry_t g;
    model_geometry_sized(&s->model->cfg, req->n_prompt, req->size, &g);
    sched_job_t *j = job_new(req, own, &g);
    if (j) {
        j->image_tokens = kv_geometry_image_tokens(&g);
        j->size = req->size;
        model_image_dims(&s->model->cfg, req->size, &j->width, &j->height);
    }
    if (j && lv.n > 0) {
        j->kv_policy.budget = lv.budgets[lv.n - 1]; /* until admitted */
        if (job_set_levels(j, &lv, &g, lo, req->kv_policy.budget) != AR_OK) {
            job_free(j);
            j = NULL;
        }
    }
    if (lv.n > 0)
        planner_levels_free(&lv);
    else
        planner_plan_free(&plan);
    if (!j) {
        snprintf(why->message, sizeof why->message, "out of memory");
        return refuse(s, why, SCHED_REFUSED_NO_MEMORY, NULL);
    }
    j->gen = (gen_job_t){
        .model = s->model,
        .cond = j->cond,
        .uncond = j->uncond,
        .n_prompt = req->n_prompt,
        .opts = {.size = req->size, .negative = j->negative, .n_negative = req->n_negative},
        .n_images = req->n_images,
        .params = req->params,
        .seed = req->seed,
        .policy = j->kv_policy,
        .level_budgets = j->n_levels > 0 ? j->level_budgets : NULL};
    batcher_job_t bj = {.n_images = j->n_images,
                        .steps = j->steps,
                        .kv_bytes = j->kv_bytes,
                        .n_levels = j->n_levels,
                        .level_kv_bytes = (const size_t *const *)j->level_kv,
                        .step_features = j->step_features,
                        .level_step_features = (const cost_features_t *const *)j->level_features,
                        .deadline = j->t_submit + req->timeout_s,
                        .target = req->objective_s > 0 ? j->t_submit + req->objective_s : 0,
                        .submitted = j->t_submit,
                        .work = &j->gen};
    pthread_mutex_lock(&s->mu);
    /* A request that could not keep its objective even alone is refused
     * now (once admission prices time: a table learned or given). */
    const double alone = req->objective_s > 0 ? batcher_alone_seconds(s->batcher, &bj) : -1;
    if (alone > req->objective_s) {
        pthread_mutex_unlock(&s->mu);
        job_free(j);
        why->predicted_s = alone;
        why->objective_s = req->objective_s;
        return refuse(s, why, SCHED_REFUSED_OBJECTIVE, "objective");
    }
    batcher_refusal_t r =
        s->stop ? BATCHER_REFUSED_DRAINING : batcher_submit(s->batcher, &bj, &j->id);
    if (r == BATCHER_ACCEPTED) {
        set_gauges(s);
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->mu);
    if (r == BATCHER_ACCEPTED) {
        metric_add(s->m_policy, req->n_images, kv_policy_name(req->kv_policy.kind));
        return j;
    }
    job_free(j);
    const sched_refusal_t reason = sched_refusal_of(r);
    switch (reason) {
    case SCHED_REFUSED_DRAINING:
        return refuse(s, why, reason, "draining");
    case SCHED_REFUSED_TOO_LARGE:
    case SCHED_REFUSED_TOO_MANY_IMAGES:
        return refuse(s, why, reason, "too_large");
    case SCHED_REFUSED_QUEUE_FULL:
        return refuse(s, why, reason, "queue_full");
    default:
        snprintf(why->message, sizeof why->message, "the batcher refused the job: %s",
                 batcher_refusal_name(r));
        return refuse(s, why, reason, NULL);
    }
}

sched_refusal_t sched_refusal_of(batcher_refusal_t r) {
    switch (r) {
    case BATCHER_REFUSED_DRAINING:
        return SCHED_REFUSED_DRAINING;
    case BATCHER_REFUSED_TOO_LARGE:
        return SCHED_REFUSED_TOO_LARGE;
    case BATCHER_REFUSED_TOO_MANY_IMAGES:
        return SCHED_REFUSED_TOO_MANY_IMAGES;
    case BATCHER_REFUSED_QUEUE_FULL:
        return SCHED_REFUSED_QUEUE_FULL;
    default:
        return SCHED_REFUSED_NO_MEMORY;
    }
}

void sched_job_cancel(scheduler_t *s, sched_job_t *j) {
    pthread_mutex_lock(&s->mu);
    if (batcher_cancel(s->batcher, j->id, BATCHER_END_CANCELLED)) {
        s->kick = 1; /* a waiting job's end is an event to handle now */
        pthread_cond_signal(&s->wake);
    }
    pthread_mutex_unlock(&s->mu);
}

int sched_job_queue_position(scheduler_t *s, sched_job_t *j) {
    pthread_mutex_lock(&s->mu);
    const int at = batcher_waiting_position(s->batcher, j->id);
    pthread_mutex_unlock(&s->mu);
    return at + 1;
}

void sched_drain(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    s->draining = 1;
    batcher_drain(s->batcher);
    pthread_mutex_unlock(&s->mu);
}

int sched_draining(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    int d = s->draining;
    pthread_mutex_unlock(&s->mu);
    return d;
}

int sched_active_jobs(scheduler_t *s) {
    batcher_stats_t st;
    pthread_mutex_lock(&s->mu);
    batcher_stats(s->batcher, &st);
    pthread_mutex_unlock(&s->mu);
    return st.waiting + st.running;
}

const char *sched_backend_unusable(scheduler_t *s) {
    return atomic_load(&s->unusable) ? s->unusable_why : NULL;
}

int sched_alive(scheduler_t *s) {
    pthread_mutex_lock(&s->mu);
    int a = s->alive;
    pthread_mutex_unlock(&s->mu);
    return a;
}

size_t sched_image_peak_bytes(const scheduler_t *s, const kv_policy_params_t *p, int n_prompt) {
    planner_plan_t plan;
    if (planner_plan_dtype(&plan, &s->model->cfg, p, n_prompt, s->pool.blocks.block_tokens,
                           planner_kv_same(s->pool.blocks.dtype), NULL, NULL) != AR_OK)
        return 0;
    const size_t peak = plan.peak_bytes;
    planner_plan_free(&plan);
    return peak;
}

int sched_kv_block_tokens(const scheduler_t *s) { return s->pool.blocks.block_tokens; }

dtype_t sched_kv_dtype(const scheduler_t *s) { return s->pool.blocks.dtype; }

size_t sched_kv_capacity_bytes(const scheduler_t *s) { return kv_pool_capacity_bytes(&s->pool); }

long long sched_kv_overruns(scheduler_t *s) {
    batcher_stats_t st;
    pthread_mutex_lock(&s->mu);
    batcher_stats(s->batcher, &st);
    pthread_mutex_unlock(&s->mu);
    return st.overruns;
}

/* ---- life cycle ---- */

static const double LATENCY_BUCKETS[] = {0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                         2.5,  5,     10,   25,  60,   120, 300};
static const double STEP_BUCKETS[] = {0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01,
                                      0.025,  0.05,    0.1,    0.25,  0.5,    1};
static const double SEQ_BUCKETS[] = {1, 2, 4, 8, 16, 32, 64, 128, 256, 512};
static const double BUDGET_BUCKETS[] = {0.05, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3,
                                        0.4,  0.5, 0.6,   0.7,  0.8, 0.9,  1};
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
    s->m_tokens = metrics_counter(
        m, "arserve_image_tokens_generated_total",
        "Image tokens generated, per image: one per step on a raster model, a whole scale per "
        "step on a next-scale one (CFG's unconditional sequence not counted).",
        0, NULL);
    s->m_iterations =
        metrics_counter(m, "arserve_iterations_total", "Engine iterations run.", 0, NULL);
    s->m_images =
        metrics_counter(m, "arserve_images_total", "Images finished, by outcome.", 1, status);
    s->m_refused = metrics_counter(m, "arserve_admissions_refused_total",
                                   "Requests refused at submission, by reason.", 1, reason);
    static const char *const policy[] = {"policy"};
    s->m_policy = metrics_counter(m, "arserve_images_admitted_total",
                                  "Images accepted into the queue, by KV policy (the policy mix).",
                                  1, policy);
    s->m_kv_budget = metrics_histogram(
        m, "arserve_kv_admitted_budget_ratio",
        "KV budget requests were admitted at, by KV policy (1 for full): with a budget range "
        "(kv_budget_min), the largest of it that fitted the pool at admission.",
        1, policy, BUDGET_BUCKETS, NB(BUDGET_BUCKETS));
    s->m_kv_below_max = metrics_counter(
        m, "arserve_kv_budget_below_max_total",
        "Requests with a budget range admitted below its top (kv_budget) because the pool was "
        "busy, by KV policy.",
        1, policy);
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
    s->m_kv_released = metrics_counter(
        m, "arserve_kv_plan_released_bytes_total",
        "How far running requests' reserved KV peaks went down when their plans tightened "
        "(HeadKV after grouping, AMS-KV once a layer has decided).",
        0, NULL);
    static const char *const term[] = {"term"}, *const part[] = {"part"};
    s->m_cost_coef = metrics_gauge(
        m, "arserve_cost_step_seconds",
        "The learned cost table (GET /v1/capacity): an engine iteration's seconds per unit of "
        "each term (intercept, per_sequence, per_kv_attended, per_new_token, per_kv_scored: a "
        "pair attended while the policy collects key mass), fitted from the "
        "engine's own timed iterations.",
        1, term);
    s->m_cost_samples = metrics_gauge(m, "arserve_cost_fit_samples",
                                      "Iterations the learned cost table was last fitted from "
                                      "(0: the seed table, nothing fitted yet).",
                                      0, NULL);
    s->m_cost_rel_rms = metrics_gauge(
        m, "arserve_cost_fit_relative_error",
        "Relative RMS error of the learned cost table's step times against the iterations it "
        "was fitted from.",
        0, NULL);
    s->m_cost_refits = metrics_counter(m, "arserve_cost_refits_total",
                                       "Times the cost table was fitted again from the engine's "
                                       "last iterations.",
                                       0, NULL);
    s->m_cost_image = metrics_gauge(
        m, "arserve_cost_image_seconds",
        "Seconds an image's drawing (decode) and PNG encoding (png) take, a mean over the last "
        "images.",
        1, part);
    s->m_cost_http = metrics_gauge(
        m, "arserve_cost_http_seconds",
        "Seconds a request spends on its HTTP thread outside the engine (parsing and tokenizing "
        "before its submission, the answer's base64 and JSON after its end), a mean over the last "
        "requests.",
        0, NULL);
    static const char *const regime[] = {"regime"};
    s->m_admissions = metrics_counter(
        m, "arserve_admissions_total",
        "Requests admitted, by what decided it: free (the largest budget at once), memory (a "
        "lower budget, or a wait, for the KV pool), time (for the latency objectives).",
        1, regime);
    s->m_backend_healthy =
        metrics_gauge(m, "arserve_backend_healthy",
                      "1 while the backend can run steps; 0 once it cannot (a CUDA fault: every "
                      "later step fails until the daemon restarts).",
                      0, NULL);
    metric_set(s->m_kv_capacity, (double)kv_pool_capacity_bytes(&s->pool));
    metric_set(s->m_kv_reserved, 0);
    metric_set(s->m_kv_used, 0);
    metric_set(s->m_running, 0);
    metric_set(s->m_waiting, 0);
    metric_set(s->m_backend_healthy, 1);
}

/* Stops and joins whatever threads run (idempotent). */
static void stop_threads(scheduler_t *s) {
    if (s->joined)
        return;
    pthread_mutex_lock(&s->mu);
    s->stop = 1;
    pthread_cond_signal(&s->wake);
    pthread_mutex_unlock(&s->mu);
    if (s->engine_started)
        pthread_join(s->engine, NULL);
    /* Each stage finishes what the one before left it, then stops. */
    queue_stop(&s->draw_q);
    if (s->drawing_started)
        pthread_join(s->drawing, NULL);
    queue_stop(&s->png_q);
    for (int i = 0; i < s->n_workers; i++)
        pthread_join(s->workers[i], NULL);
    s->joined = 1;
}

scheduler_t *scheduler_create(model_t *model, const sched_options_t *opt, metrics_t *metrics,
                              ar_error_t *err) {
    if (opt->max_running < 1 || opt->png_workers < 1) {
        ar_errorf(err, "the scheduler needs max_running >= 1 and png_workers >= 1; got %d, %d",
                  opt->max_running, opt->png_workers);
        return NULL;
    }
    scheduler_t *s = calloc(1, sizeof *s);
    if (!s) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    s->model = model;
    s->opt = *opt;
    s->metrics = metrics;
    pthread_mutex_init(&s->mu, NULL);
    pthread_mutex_init(&s->cost_mu, NULL);
    pthread_cond_init(&s->wake, NULL);
    queue_init(&s->draw_q);
    queue_init(&s->png_q);
    s->workers = calloc((size_t)opt->png_workers, sizeof *s->workers);
    const model_config_t *c = &model->cfg;
    const int bt = opt->kv_block_tokens > 0 ? opt->kv_block_tokens : planner_block_tokens(c);
    const size_t block = kv_pool_block_bytes(bt, c->llm.head_dim, opt->kv_dtype);
    size_t n_blocks = opt->kv_pool_bytes / block;
    if (n_blocks > INT32_MAX)
        n_blocks = INT32_MAX;
    cost_table_t seed;
    if (opt->costs)
        seed = *opt->costs;
    else /* every stored byte counted as a weight: more than there are */
        cost_table_default(&seed, c, (double)model->weight_bytes);
    if (!s->workers ||
        cost_learner_init(&s->costs, &seed, SCHED_COST_WINDOW, SCHED_COST_REFIT_EVERY) != AR_OK) {
        ar_errorf(err, "out of memory");
        goto fail;
    }
    if (gen_drawer_open(&s->drawer, model, opt->draw_threads, err) != AR_OK)
        goto fail;
    if (kv_pool_init(&s->pool, model->be, (int)n_blocks, bt, c->llm.head_dim, opt->kv_dtype, err) !=
        AR_OK) {
        ar_error_prefix(err, "--kv-pool-mb (%zu bytes, blocks of %zu)", opt->kv_pool_bytes, block);
        goto fail;
    }
    s->opt.kv_pool_bytes = kv_pool_capacity_bytes(&s->pool);
    s->opt.kv_block_tokens = bt;
    batcher_options_t bo = {.pool_bytes = s->opt.kv_pool_bytes,
                            .max_running = opt->max_running,
                            .max_waiting = opt->max_waiting};
    if (!(s->batcher = batcher_create(&bo, &gen_batcher_ops, &s->pool, err)))
        goto fail;
    if (opt->costs) /* a table given prices time from the start; the default waits for a fit */
        batcher_set_costs(s->batcher, opt->costs);
    register_metrics(s, metrics);
    publish_costs(s);
    s->alive = 1;
    int rc = pthread_create(&s->engine, NULL, engine_main, s);
    if (rc != 0) {
        ar_errorf(err, "cannot start the engine thread: %s", strerror(rc));
        goto fail;
    }
    s->engine_started = 1;
    if ((rc = pthread_create(&s->drawing, NULL, draw_main, s)) != 0) {
        ar_errorf(err, "cannot start the image drawing thread: %s", strerror(rc));
        goto fail;
    }
    s->drawing_started = 1;
    for (int i = 0; i < opt->png_workers; i++) {
        if ((rc = pthread_create(&s->workers[i], NULL, png_worker, s)) != 0) {
            ar_errorf(err, "cannot start PNG worker %d of %d: %s", i + 1, opt->png_workers,
                      strerror(rc));
            goto fail;
        }
        s->n_workers++;
    }
    return s;
fail:
    scheduler_destroy(s);
    return NULL;
}

void sched_status(scheduler_t *s, sched_status_t *out) {
    *out = (sched_status_t){.running = (int)metric_value(s->m_running),
                            .waiting = (int)metric_value(s->m_waiting),
                            .images_done = metric_value(s->m_images, "ok"),
                            .iterations = metric_value(s->m_iterations),
                            .kv_used_bytes = metric_value(s->m_kv_used),
                            .kv_reserved_bytes = metric_value(s->m_kv_reserved)};
}

void sched_capacity(scheduler_t *s, sched_capacity_t *out) {
    pthread_mutex_lock(&s->cost_mu);
    *out = (sched_capacity_t){.costs = s->costs.table,
                              .timed_iterations = s->costs.samples,
                              .refits = s->costs.refits,
                              .window = s->costs.cap,
                              .refit_every = s->costs.refit_every,
                              .outliers = s->costs.last_outliers};
    pthread_mutex_unlock(&s->cost_mu);
    out->kv_pool_bytes = kv_pool_capacity_bytes(&s->pool);
    out->kv_reserved_bytes = (size_t)metric_value(s->m_kv_reserved);
}

void scheduler_stop(scheduler_t *s) {
    if (s)
        stop_threads(s);
}

void scheduler_destroy(scheduler_t *s) {
    if (!s)
        return;
    stop_threads(s);
    queue_destroy(&s->draw_q);
    queue_destroy(&s->png_q);
    gen_drawer_close(&s->drawer);
    batcher_destroy(s->batcher);
    kv_pool_free(&s->pool);
    free(s->workers);
    cost_learner_free(&s->costs);
    pthread_mutex_destroy(&s->cost_mu);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->wake);
    free(s);
}
