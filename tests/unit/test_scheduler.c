/* The scheduler's job API (server/scheduler.h) on the tiny model, without
 * HTTP: what each refusal reports, how jobs end (done, cancelled while
 * waiting or running, expired: different outcomes), that a job is done only
 * once every preview it asked for is in (two PNG workers could otherwise
 * finish the final image first, and a stream would skip the previews), and
 * that waiting on a job returns when it changes, and what a failing draw does.
 *
 * This file defines png_encode (engine/format/png_io.h) itself, so the linker
 * takes no PNG encoder from the engine library: its "PNGs" are the PNG
 * signature and the first bytes of the pixels, and the first call can be
 * made slow, to hold one worker on a preview. */
#include <pthread.h>
#include <stdlib.h>
#include <sys/resource.h>
#include <time.h>

#include "base/clock.h"
#include "engine/batcher.h"
#include "engine/format/png_io.h"
#include "engine/generate.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "server/scheduler.h"
#include "tests/test.h"

static int slow_first_encode; /* milliseconds the next first call sleeps */
static int encodes, fail_encodes;

int png_encode(const uint8_t *rgb, int width, int height, uint8_t **out, size_t *out_len,
               ar_error_t *err) {
    if (__atomic_load_n(&fail_encodes, __ATOMIC_SEQ_CST))
        return ar_errorf(err, "a planted failure");
    if (__atomic_fetch_add(&encodes, 1, __ATOMIC_SEQ_CST) == 0 && slow_first_encode) {
        struct timespec ts = {0, slow_first_encode * 1000000L};
        nanosleep(&ts, NULL);
    }
    *out_len = 16;
    if (!(*out = malloc(*out_len)))
        return ar_errorf(err, "out of memory");
    memcpy(*out, "\x89PNG\r\n\x1a\n", 8);
    memcpy(*out + 8, rgb, 8);
    return AR_OK;
}

/* The drawing thread's failures, planted: this test is linked with
 * --wrap=gen_draw (Makefile), so the scheduler's draws come here first. */
static int fail_previews, fail_finals;

int __real_gen_draw(const model_t *m, struct vq_work *w, const int *tokens, int size, int n_done,
                    uint8_t *rgb, ar_error_t *err);
int __wrap_gen_draw(const model_t *m, struct vq_work *w, const int *tokens, int size, int n_done,
                    uint8_t *rgb, ar_error_t *err) {
    const int final = n_done >= model_steps(&m->cfg);
    if (final ? __atomic_load_n(&fail_finals, __ATOMIC_SEQ_CST)
              : __atomic_load_n(&fail_previews, __ATOMIC_SEQ_CST))
        return ar_errorf(err, "a planted failure");
    return __real_gen_draw(m, w, tokens, size, n_done, rgb, err);
}

/* Engine iterations made slower on demand (microseconds each), through a
 * wrap of batcher_step (Makefile), so that a job's steps take long enough
 * to be waited through. */
static int step_sleep_us;

/* A gate on engine steps: while closed, each step waits for a ticket
 * (step_gate_open lets n more through), so a test sees a job mid-way however
 * the threads are scheduled. */
static pthread_mutex_t gate_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t gate_cv = PTHREAD_COND_INITIALIZER;
static int gate_closed, gate_tickets;

static void step_gate_close(void) {
    pthread_mutex_lock(&gate_mu);
    gate_closed = 1;
    gate_tickets = 0;
    pthread_mutex_unlock(&gate_mu);
}

/* n more steps through (n < 0: the gate opens for good). */
static void step_gate_open(int n) {
    pthread_mutex_lock(&gate_mu);
    if (n < 0)
        gate_closed = 0;
    else
        gate_tickets += n;
    pthread_cond_broadcast(&gate_cv);
    pthread_mutex_unlock(&gate_mu);
}

int __real_batcher_step(batcher_t *b, ar_error_t *err);
int __wrap_batcher_step(batcher_t *b, ar_error_t *err) {
    pthread_mutex_lock(&gate_mu);
    while (gate_closed && gate_tickets == 0)
        pthread_cond_wait(&gate_cv, &gate_mu);
    if (gate_closed)
        gate_tickets--;
    pthread_mutex_unlock(&gate_mu);
    const int us = __atomic_load_n(&step_sleep_us, __ATOMIC_SEQ_CST);
    if (us) {
        struct timespec ts = {0, us * 1000L};
        nanosleep(&ts, NULL);
    }
    return __real_batcher_step(b, err);
}

static backend_t *be;
static model_t model;
static int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n_prompt;

static scheduler_t *start(metrics_t **metrics, int max_running, int max_waiting, size_t pool,
                          int png_workers) {
    ar_error_t err = {{0}};
    *metrics = metrics_create();
    sched_options_t so = {.max_running = max_running,
                          .max_waiting = max_waiting,
                          .kv_pool_bytes = pool,
                          .png_workers = png_workers};
    scheduler_t *s = scheduler_create(&model, &so, *metrics, &err);
    CHECK_MSG(s != NULL, "%s", err.msg);
    return s;
}

static void stop(scheduler_t *s, metrics_t *metrics) {
    scheduler_destroy(s);
    metrics_destroy(metrics);
}

static sched_request_t request(int n_images, int partial_images, double timeout_s) {
    sched_request_t rq = {.cond = cond,
                          .uncond = uncond,
                          .n_prompt = n_prompt,
                          .n_images = n_images,
                          .params = model.cfg.sampling,
                          .seed = 5,
                          .partial_images = partial_images,
                          .timeout_s = timeout_s};
    kv_policy_defaults(&rq.kv_policy, KV_POLICY_FULL);
    return rq;
}

static sched_outcome_t wait_end(sched_job_t *j, sched_snapshot_t *snap) {
    const double until = clock_now_s() + 60;
    sched_job_snapshot(j, snap);
    while (snap->outcome == SCHED_PENDING && clock_now_s() < until)
        sched_job_wait(j, snap->version, 1.0, snap);
    return snap->outcome;
}

/* One full-cache image's KV at its peak, in the daemon's blocks. */
static size_t one_image_bytes(void) {
    kv_policy_params_t full;
    kv_policy_defaults(&full, KV_POLICY_FULL);
    planner_plan_t plan;
    if (planner_plan(&plan, &model.cfg, &full, n_prompt, planner_block_tokens(&model.cfg), NULL,
                     NULL) != AR_OK)
        return 0;
    size_t peak = plan.peak_bytes;
    planner_plan_free(&plan);
    return peak;
}

static void test_refusals_say_why(void) {
    metrics_t *m;
    const size_t one = one_image_bytes();
    scheduler_t *s = start(&m, 2, 1, one, 1);
    if (!s)
        return;
    sched_refusal_info_t why;
    sched_request_t rq = request(2, 0, 60);
    CHECK(sched_submit(s, &rq, &why) == NULL); /* two images never fit one image's pool */
    CHECK(why.reason == SCHED_REFUSED_TOO_LARGE && why.need_bytes == 2 * one &&
          why.pool_bytes == one);
    rq = request(1, 0, 60);
    rq.kv_policy.kind = KV_POLICY_LINEAR;
    rq.kv_policy.budget = 1.0 / 8; /* one of 8 lines: too few */
    CHECK(sched_submit(s, &rq, &why) == NULL);
    CHECK(why.reason == SCHED_REFUSED_INVALID_POLICY && why.field && !strcmp(why.field, "budget"));
    CHECK_STR_CONTAINS(why.message, "budget");
    sched_drain(s);
    rq = request(1, 0, 60);
    CHECK(sched_submit(s, &rq, &why) == NULL && why.reason == SCHED_REFUSED_DRAINING);
    stop(s, m);

    /* More images than run at once, in a pool that would hold them. */
    s = start(&m, 1, 4, 64 * one, 1);
    if (!s)
        return;
    rq = request(2, 0, 60);
    CHECK(sched_submit(s, &rq, &why) == NULL && why.reason == SCHED_REFUSED_TOO_MANY_IMAGES &&
          why.max_running == 1);
    stop(s, m);

    /* No queue (max_waiting 0): a request that can start now runs; one
     * that cannot (the 4-image job, tens of milliseconds, holds every slot
     * microseconds after its submission) is refused, not queued; once the
     * slots are free again, a request runs. */
    s = start(&m, 4, 0, 64 * one, 1);
    if (!s)
        return;
    rq = request(4, 0, 60);
    sched_job_t *now = sched_submit(s, &rq, &why);
    CHECK_MSG(now != NULL, "%s", why.message);
    rq = request(1, 0, 60);
    CHECK(sched_submit(s, &rq, &why) == NULL && why.reason == SCHED_REFUSED_QUEUE_FULL &&
          why.max_waiting == 0);
    sched_snapshot_t snap;
    if (now) {
        CHECK(wait_end(now, &snap) == SCHED_DONE);
        sched_job_release(now);
    }
    sched_job_t *later = sched_submit(s, &rq, &why);
    CHECK_MSG(later != NULL, "%s", why.message);
    if (later) {
        CHECK(wait_end(later, &snap) == SCHED_DONE);
        sched_job_release(later);
    }
    stop(s, m);
}

/* Done, cancelled while waiting, cancelled while running and expired are
 * four outcomes, and the scheduler ends each job exactly once. */
static void test_outcomes(void) {
    metrics_t *m;
    /* Four running images fill max_running: the jobs behind them wait. */
    scheduler_t *s = start(&m, 4, 8, 64 * one_image_bytes(), 1);
    if (!s)
        return;
    sched_refusal_info_t why;
    sched_request_t rq = request(4, 0, 60);
    sched_job_t *running = sched_submit(s, &rq, &why);
    rq = request(1, 0, 60);
    sched_job_t *waiting = sched_submit(s, &rq, &why);
    rq = request(1, 0, 0); /* its deadline is now */
    sched_job_t *late = sched_submit(s, &rq, &why);
    rq = request(1, 0, 60);
    sched_job_t *done = sched_submit(s, &rq, &why);
    CHECK(running && waiting && late && done);
    if (!running || !waiting || !late || !done)
        return;
    /* Both at once, microseconds after submission: the 4-image job (tens of
     * milliseconds) is still on, and the other still waits behind it. */
    sched_job_cancel(s, waiting);
    sched_job_cancel(s, running);
    sched_snapshot_t snap;
    CHECK(wait_end(waiting, &snap) == SCHED_CANCELLED && !snap.started);
    CHECK(wait_end(running, &snap) == SCHED_CANCELLED);
    CHECK(wait_end(late, &snap) == SCHED_EXPIRED && !snap.started);
    CHECK(wait_end(done, &snap) == SCHED_DONE && snap.started &&
          snap.steps_done == snap.steps_total && snap.steps_total == model_steps(&model.cfg));
    size_t len = 0;
    const uint8_t *png = sched_job_png(done, 0, &len);
    CHECK(png && len > 8 && !memcmp(png, "\x89PNG\r\n\x1a\n", 8));
    CHECK(sched_job_png(waiting, 0, &len) == NULL && len == 0);
    sched_job_release(running);
    sched_job_release(waiting);
    sched_job_release(late);
    sched_job_release(done);
    CHECK(sched_active_jobs(s) == 0);
    stop(s, m);
}

/* With two PNG workers the final image can be encoded before a preview:
 * here the first encode (the preview, queued 32 steps before the image)
 * takes 300 ms, the image a few. The job is done only once its preview is
 * in, so a stream sends the preview before the image. */
static void test_done_only_after_its_previews(void) {
    metrics_t *m;
    scheduler_t *s = start(&m, 4, 4, 64 * one_image_bytes(), 2);
    if (!s)
        return;
    encodes = 0;
    slow_first_encode = 300;
    sched_refusal_info_t why;
    sched_request_t rq = request(1, 1, 60);
    sched_job_t *j = sched_submit(s, &rq, &why);
    CHECK_MSG(j != NULL, "%s", why.message);
    if (j) {
        sched_snapshot_t snap;
        CHECK(wait_end(j, &snap) == SCHED_DONE);
        CHECK_MSG(snap.n_partials == 1, "done with %d previews", snap.n_partials);
        size_t len = 0;
        CHECK(sched_job_preview(j, 0, 0, &len) && len == 16);
        CHECK(encodes == 2);
        sched_job_release(j);
    }
    slow_first_encode = 0;
    stop(s, m);
}

/* A stream's progress waits at a preview's step until that preview is said:
 * a job of 12 steps with 2 previews draws them after steps 4 and 8. The CI
 * failure this guards: on a slow machine the last steps were done before
 * preview 1 was drawn, and the stream said step 12 before preview 1. */
static void test_progress_waits_for_previews(void) {
    sched_snapshot_t snap = {.outcome = SCHED_PENDING, .steps_total = 12, .partial_images = 2};
    snap.steps_done = 3;
    CHECK(sched_reportable_steps(&snap, 0) == 3);
    snap.steps_done = 6;
    CHECK(sched_reportable_steps(&snap, 0) == 4);
    CHECK(sched_reportable_steps(&snap, 1) == 6);
    snap.steps_done = 12;
    CHECK(sched_reportable_steps(&snap, 1) == 8);
    CHECK(sched_reportable_steps(&snap, 2) == 12);
    /* An ended job says all it did: a skipped preview holds nothing back. */
    snap.outcome = SCHED_DONE;
    CHECK(sched_reportable_steps(&snap, 1) == 12);
    snap.outcome = SCHED_FAILED;
    snap.steps_done = 7;
    CHECK(sched_reportable_steps(&snap, 0) == 7);
    snap = (sched_snapshot_t){.outcome = SCHED_PENDING, .steps_total = 12, .steps_done = 9};
    CHECK(sched_reportable_steps(&snap, 0) == 9);
}

typedef struct waiter {
    sched_job_t *job;
    int end_only;
    long switches; /* voluntary context switches while waiting */
    int changes;
    sched_snapshot_t snap;
} waiter_t;

static long voluntary_switches(void) {
    struct rusage ru;
    getrusage(RUSAGE_THREAD, &ru);
    return ru.ru_nvcsw;
}

static void *wait_on_job(void *arg) {
    waiter_t *w = arg;
    const long before = voluntary_switches();
    sched_job_snapshot(w->job, &w->snap);
    while (w->snap.outcome == SCHED_PENDING) {
        const unsigned seen = w->snap.version;
        if (w->end_only)
            sched_job_wait_end(w->job, 30, &w->snap);
        else
            sched_job_wait(w->job, seen, 30, &w->snap);
        w->changes += w->snap.version != seen;
    }
    w->switches = voluntary_switches() - before;
    return NULL;
}

/* A thread waiting for a job's end sleeps through its steps (2 ms each
 * here): one waiting for every change wakes at each of the job's steps, one
 * waiting for the end a few times (locks taken), at most an eighth as
 * often. */
static void test_wait_end_sleeps_through_steps(void) {
    metrics_t *m;
    scheduler_t *s = start(&m, 4, 4, 64 * one_image_bytes(), 1);
    if (!s)
        return;
    sched_refusal_info_t why;
    __atomic_store_n(&step_sleep_us, 2000, __ATOMIC_SEQ_CST);
    sched_request_t rq = request(1, 0, 60);
    sched_job_t *j = sched_submit(s, &rq, &why);
    CHECK_MSG(j != NULL, "%s", why.message);
    if (j) {
        waiter_t every = {.job = j}, end = {.job = j, .end_only = 1};
        pthread_t a, b;
        CHECK(pthread_create(&a, NULL, wait_on_job, &every) == 0);
        CHECK(pthread_create(&b, NULL, wait_on_job, &end) == 0);
        pthread_join(a, NULL);
        pthread_join(b, NULL);
        CHECK(every.snap.outcome == SCHED_DONE && end.snap.outcome == SCHED_DONE);
        CHECK_MSG(every.changes >= model_steps(&model.cfg) / 2, "%d changes seen", every.changes);
        CHECK_MSG(end.switches * 8 < every.switches,
                  "the end-only waiter switched %ld times, the every-change one %ld", end.switches,
                  every.switches);
        sched_job_release(j);
    }
    __atomic_store_n(&step_sleep_us, 0, __ATOMIC_SEQ_CST);
    stop(s, m);
}

/* arserve_images_total{status="error"} as /metrics shows it. */
static double images_failed(metrics_t *m) {
    char *text = metrics_render(m);
    const char *key = "arserve_images_total{status=\"error\"} ", *at = strstr(text, key);
    const double v = at ? atof(at + strlen(key)) : 0;
    free(text);
    return v;
}

/* A final image that cannot be drawn or encoded fails its job, whose
 * images count as errors before the end shows, and once however many of
 * them fail (three encodes fail here, on two workers); a preview that
 * cannot be drawn is skipped, and its job still ends with its image. */
static void test_drawing_failures(void) {
    metrics_t *m;
    scheduler_t *s = start(&m, 4, 4, 64 * one_image_bytes(), 2);
    if (!s)
        return;
    sched_refusal_info_t why;
    sched_snapshot_t snap;
    __atomic_store_n(&fail_finals, 1, __ATOMIC_SEQ_CST);
    sched_request_t rq = request(3, 1, 60);
    sched_job_t *j = sched_submit(s, &rq, &why);
    CHECK_MSG(j != NULL, "%s", why.message);
    if (j) {
        CHECK(wait_end(j, &snap) == SCHED_FAILED);
        CHECK_STR_CONTAINS(snap.message, "image decoding failed");
        size_t len = 1;
        CHECK(sched_job_png(j, 0, &len) == NULL && len == 0);
        sched_job_release(j);
    }
    CHECK_MSG(images_failed(m) == 3, "%g images counted as errors", images_failed(m));
    __atomic_store_n(&fail_finals, 0, __ATOMIC_SEQ_CST);
    __atomic_store_n(&fail_previews, 1, __ATOMIC_SEQ_CST);
    rq = request(1, 2, 60);
    j = sched_submit(s, &rq, &why);
    CHECK_MSG(j != NULL, "%s", why.message);
    if (j) {
        CHECK(wait_end(j, &snap) == SCHED_DONE && snap.n_partials == 0);
        size_t len = 0;
        CHECK(sched_job_png(j, 0, &len) != NULL && len == 16);
        sched_job_release(j);
    }
    __atomic_store_n(&fail_previews, 0, __ATOMIC_SEQ_CST);
    CHECK(images_failed(m) == 3);
    __atomic_store_n(&fail_encodes, 1, __ATOMIC_SEQ_CST);
    rq = request(3, 0, 60);
    j = sched_submit(s, &rq, &why);
    CHECK_MSG(j != NULL, "%s", why.message);
    if (j) {
        CHECK(wait_end(j, &snap) == SCHED_FAILED);
        CHECK_STR_CONTAINS(snap.message, "PNG encoding failed");
        sched_job_release(j);
    }
    scheduler_destroy(s); /* every encode has been tried */
    __atomic_store_n(&fail_encodes, 0, __ATOMIC_SEQ_CST);
    CHECK_MSG(images_failed(m) == 6, "%g images counted as errors", images_failed(m));
    metrics_destroy(m);
}

/* sched_job_wait returns as soon as the job changes, not at its timeout:
 * with the engine let through one step at a time, each wait on a running
 * job returns with that step (well before its 30 s timeout). Gated, so a
 * loaded machine that runs the whole job before the waiter looks cannot
 * make it pass or fail by chance (it did: CI saw a single change). */
static void test_wait_returns_on_change(void) {
    metrics_t *m;
    scheduler_t *s = start(&m, 4, 4, 64 * one_image_bytes(), 1);
    if (!s)
        return;
    step_gate_close();
    sched_refusal_info_t why;
    sched_request_t rq = request(1, 0, 60);
    sched_job_t *j = sched_submit(s, &rq, &why);
    if (!j) {
        CHECK(0);
        step_gate_open(-1);
        stop(s, m);
        return;
    }
    sched_snapshot_t snap;
    sched_job_snapshot(j, &snap);
    for (int step = 1; step <= 3; step++) {
        step_gate_open(1);
        const double t0 = clock_now_s();
        /* Admission may change the job first; the step comes after. */
        while (snap.steps_done < step && snap.outcome == SCHED_PENDING && clock_now_s() - t0 < 20) {
            const unsigned seen = snap.version;
            sched_job_wait(j, seen, 30.0, &snap);
            CHECK_MSG(snap.version != seen, "step %d: the wait returned with nothing changed",
                      step);
        }
        CHECK_MSG(snap.steps_done == step && snap.outcome == SCHED_PENDING,
                  "step %d: %d steps done, outcome %d", step, snap.steps_done, snap.outcome);
        CHECK_MSG(clock_now_s() - t0 < 20, "step %d: %.1f s", step, clock_now_s() - t0);
    }
    step_gate_open(-1);
    CHECK(wait_end(j, &snap) == SCHED_DONE);
    sched_job_release(j);
    stop(s, m);
}

int main(void) {
    const char *tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-unit sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    be = backend_cpu_create(1, &err);
    if (!be || model_load(&model, tiny, be, &err) != AR_OK ||
        model_prompt_from_text(&model, "a red circle", cond, uncond, &n_prompt, &err) != AR_OK) {
        fprintf(stderr, "%s\n0 passed, 1 failed\n", err.msg);
        return 1;
    }
    TEST_RUN(test_refusals_say_why);
    TEST_RUN(test_outcomes);
    TEST_RUN(test_done_only_after_its_previews);
    TEST_RUN(test_progress_waits_for_previews);
    TEST_RUN(test_wait_returns_on_change);
    TEST_RUN(test_drawing_failures);
    TEST_RUN(test_wait_end_sleeps_through_steps);
    model_free(&model);
    be->destroy(be);
    return TEST_SUMMARY();
}
