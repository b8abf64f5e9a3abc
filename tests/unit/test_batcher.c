/* The batching core alone (engine/batcher.h), with a fake step function and
 * no backend: jobs are plain counters with a planned KV trajectory, the
 * "pool" is the planner's byte budget, and the fake step reports the bytes
 * the plan says the batch holds (or more, to provoke an overrun). Checked:
 * FIFO admission through the planner with the head blocking the queue,
 * max_running counted in images, each refusal reason, cancellation and
 * deadlines of waiting and running jobs, start and step failures, the
 * event sequence of a job, the plan check, shutdown and draining, and
 * max_waiting 0 (no queue: start at the next admission or be refused),
 * and elastic budgets (a job with levels runs at the largest that fits). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/batcher_test.h"
#include "tests/test.h"

/* ---- fake jobs ---------------------------------------------------------- */

#define MAX_STEPS 16

typedef struct fake {
    int n_images, steps;
    size_t bytes[MAX_STEPS]; /* the job's planned KV per step (all images) */
    int started, stopped, stepped;
    int fail_start;
} fake_t;

typedef struct world {
    int fail_step_at; /* the iteration whose step fails; -1: none */
    size_t extra;     /* bytes the step reports over the plan */
    int step_calls;
} world_t;

static int fake_start(void *ctx, void *work, ar_error_t *err) {
    fake_t *f = work;
    if (f->fail_start)
        return ar_errorf(err, "no room for this fake job");
    f->started++;
    return AR_OK;
}

static int fake_step(void *ctx, void *const *work, int n, size_t *kv_peak_bytes, ar_error_t *err) {
    world_t *w = ctx;
    size_t held = 0;
    for (int i = 0; i < n; i++) {
        fake_t *f = work[i];
        held += f->bytes[f->stepped];
        f->stepped++;
    }
    *kv_peak_bytes = held + w->extra;
    if (w->step_calls++ == w->fail_step_at)
        return ar_errorf(err, "the fake step failed");
    return AR_OK;
}

static void fake_stop(void *ctx, void *work) { ((fake_t *)work)->stopped++; }

/* Elastic fakes: three levels of constant KV, the largest first; set_level
 * makes the job hold its admitted level's bytes. */
#define N_LEVELS 3
typedef struct elastic {
    fake_t f; /* first: the work is the fake */
    size_t levels[N_LEVELS][MAX_STEPS];
    const size_t *level_ptrs[N_LEVELS];
    int level; /* set_level's, -1 before */
} elastic_t;

static void fake_set_level(void *ctx, void *work, int level) {
    elastic_t *e = work;
    e->level = level;
    memcpy(e->f.bytes, e->levels[level], sizeof e->f.bytes);
}

static const batcher_ops_t fake_ops = {
    .start = fake_start, .step = fake_step, .stop = fake_stop, .set_level = fake_set_level};

/* A job of n images, steps steps, holding per_step * (t + 1) bytes at step t. */
static fake_t fake(int n_images, int steps, size_t per_step) {
    fake_t f = {.n_images = n_images, .steps = steps};
    for (int t = 0; t < steps; t++)
        f.bytes[t] = per_step * (size_t)(t + 1);
    return f;
}

static batcher_job_t job_of(fake_t *f) {
    return (batcher_job_t){.n_images = f->n_images,
                           .steps = f->steps,
                           .kv_bytes = f->bytes,
                           .deadline = INFINITY,
                           .work = f};
}

static batcher_t *make(world_t *w, size_t pool, int max_running, int max_waiting) {
    batcher_options_t o = {
        .pool_bytes = pool, .max_running = max_running, .max_waiting = max_waiting};
    ar_error_t err = {{0}};
    *w = (world_t){.fail_step_at = -1};
    batcher_t *b = batcher_create(&o, &fake_ops, w, &err);
    CHECK_MSG(b != NULL, "%s", err.msg);
    return b;
}

static uint64_t submit(batcher_t *b, fake_t *f) {
    batcher_job_t j = job_of(f);
    uint64_t id = 0;
    batcher_refusal_t r = batcher_submit(b, &j, &id);
    CHECK_MSG(r == BATCHER_ACCEPTED, "refused: %s", batcher_refusal_name(r));
    return id;
}

/* Events of the last calls, as "A1 S1 E1:finished ..." (type, id, end). */
static void events_text(batcher_t *b, char *buf, size_t cap) {
    batcher_event_t ev[64];
    int n = batcher_take_events(b, ev, 64);
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < n && used < cap; i++) {
        const batcher_event_t *e = &ev[i];
        int k = snprintf(buf + used, cap - used, "%s%c%llu%s%s", i ? " " : "",
                         e->type == BATCHER_ADMITTED  ? 'A'
                         : e->type == BATCHER_STEPPED ? 'S'
                                                      : 'E',
                         (unsigned long long)e->id, e->type == BATCHER_ENDED ? ":" : "",
                         e->type == BATCHER_ENDED ? batcher_end_name(e->end) : "");
        used += k > 0 ? (size_t)k : 0;
    }
}

#define CHECK_EVENTS(b, want)                                                                      \
    do {                                                                                           \
        char got_[512];                                                                            \
        events_text((b), got_, sizeof got_);                                                       \
        CHECK_MSG(strcmp(got_, (want)) == 0, "events \"%s\", expected \"%s\"", got_, (want));      \
    } while (0)

/* ---- tests --------------------------------------------------------------- */

/* One job: admitted, a STEPPED event per step, then ENDED finished, its KV
 * given back exactly once, the planner empty again. */
static void test_job_life_cycle_events(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    fake_t a = fake(1, 3, 10);
    submit(b, &a);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK_EVENTS(b, "A1 S1");
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK_EVENTS(b, "S1 S1 E1:finished");
    CHECK(a.started == 1 && a.stopped == 1 && a.stepped == 3);
    CHECK(batcher_iterate(b, 0) == 0); /* nothing left */
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.running == 0 && st.waiting == 0 && st.reserved_bytes == 0 && st.iterations == 3);
    CHECK(st.overruns == 0);
    batcher_destroy(b);
}

/* FIFO through the planner: job 2 does not fit beside job 1 until job 1
 * is far enough on, and job 3 (small, would fit at once) waits behind it. */
static void test_fifo_admission_head_blocks(void) {
    world_t w;
    /* A holds 10, 20, 30, 40; B holds 20, 40: B fits once A's remaining
     * trajectory plus B's stays within 50 at every step, which is only
     * after A is gone (at 2, 30 + 20 fits, but 40 + 40 does not). */
    batcher_t *b = make(&w, 50, 8, 8);
    fake_t a = fake(1, 4, 10), big = fake(1, 2, 20), small = fake(1, 1, 1);
    submit(b, &a);
    submit(b, &big);
    submit(b, &small);
    int admitted_at[4] = {-1, -1, -1, -1};
    for (int it = 0; it < 12; it++) {
        batcher_iterate(b, 0);
        batcher_event_t ev[16];
        int n = batcher_take_events(b, ev, 16);
        for (int i = 0; i < n; i++)
            if (ev[i].type == BATCHER_ADMITTED)
                admitted_at[ev[i].id] = it;
    }
    CHECK_MSG(admitted_at[1] == 0 && admitted_at[2] == 4 && admitted_at[3] == 4,
              "admitted at %d, %d, %d", admitted_at[1], admitted_at[2], admitted_at[3]);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.overruns == 0 && st.running == 0);
    batcher_destroy(b);
}

/* max_running counts images, not jobs. */
static void test_max_running_counts_images(void) {
    world_t w;
    batcher_t *b = make(&w, 1 << 20, 3, 8);
    fake_t two = fake(2, 2, 1), two_more = fake(2, 2, 1), one = fake(1, 2, 1);
    submit(b, &two);
    submit(b, &two_more);
    submit(b, &one);
    batcher_admit(b, 0);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK_MSG(st.running == 1 && st.running_images == 2 && st.waiting == 2, "%d jobs, %d images",
              st.running, st.running_images);
    batcher_destroy(b);
}

static void test_refusal_reasons(void) {
    world_t w;
    batcher_t *b = make(&w, 100, 2, 1);
    fake_t too_big = fake(1, 2, 60), many = fake(3, 1, 1), ok = fake(1, 1, 1), more = fake(1, 1, 1);
    batcher_job_t j = job_of(&too_big);
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_REFUSED_TOO_LARGE); /* peaks at 120 > 100 */
    j = job_of(&many);
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_REFUSED_TOO_MANY_IMAGES);
    j = job_of(&ok);
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_ACCEPTED);
    j = job_of(&more);
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_REFUSED_QUEUE_FULL); /* max_waiting 1 */
    j.steps = 0;
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_REFUSED_INVALID);
    batcher_drain(b);
    j = job_of(&more);
    CHECK(batcher_submit(b, &j, NULL) == BATCHER_REFUSED_DRAINING);
    /* Draining refuses new work only: the queued job still runs. */
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK_EVENTS(b, "A1 S1 E1:finished");
    CHECK(!strcmp(batcher_refusal_name(BATCHER_REFUSED_QUEUE_FULL), "queue_full"));
    batcher_destroy(b);
}

/* A waiting job cancelled leaves at once; a running one at the next
 * admit, its KV given back, and the space it held admits the next job in
 * the same admit. */
static void test_cancel_waiting_and_running(void) {
    world_t w;
    batcher_t *b = make(&w, 40, 8, 8);
    fake_t a = fake(1, 4, 10), c = fake(1, 4, 10), d = fake(1, 2, 5);
    uint64_t ia = submit(b, &a), ic = submit(b, &c), id = submit(b, &d);
    CHECK(batcher_iterate(b, 0) == 1); /* only A fits (it peaks at 40) */
    CHECK_EVENTS(b, "A1 S1");
    CHECK(batcher_cancel(b, ic, BATCHER_END_CANCELLED) == 1);
    CHECK_EVENTS(b, "E2:cancelled");
    CHECK(batcher_cancel(b, ic, BATCHER_END_CANCELLED) == 0); /* gone */
    CHECK(batcher_cancel(b, ia, BATCHER_END_CANCELLED) == 1);
    CHECK(a.stopped == 0); /* a running job leaves at the next admit */
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK_EVENTS(b, "E1:cancelled A3 S3");
    CHECK(a.stopped == 1 && c.started == 0 && d.started == 1);
    (void)id;
    batcher_destroy(b);
    CHECK(d.stopped == 1); /* destroy stops what still runs */
}

/* Deadlines are in the driver's clock: a waiting and a running job past
 * theirs end EXPIRED at the next admit; batcher_cancel(EXPIRED) too. */
static void test_deadlines(void) {
    world_t w;
    batcher_t *b = make(&w, 20, 8, 8);
    fake_t a = fake(1, 5, 4), c = fake(1, 5, 4), d = fake(1, 5, 4);
    batcher_job_t ja = job_of(&a), jc = job_of(&c), jd = job_of(&d);
    ja.deadline = 2.5;
    jc.deadline = 1.5;
    batcher_submit(b, &ja, NULL);
    batcher_submit(b, &jc, NULL);
    uint64_t idd = 0;
    batcher_submit(b, &jd, &idd);
    batcher_iterate(b, 0); /* A runs (peaks at 20); C and D wait */
    CHECK_EVENTS(b, "A1 S1");
    batcher_iterate(b, 2.0); /* C expired while waiting */
    CHECK_EVENTS(b, "E2:expired S1");
    batcher_iterate(b, 3.0); /* A expired while running; D admitted */
    CHECK_EVENTS(b, "E1:expired A3 S3");
    CHECK(a.stopped == 1);
    CHECK(batcher_cancel(b, idd, BATCHER_END_EXPIRED) == 1);
    batcher_iterate(b, 3.0);
    CHECK_EVENTS(b, "E3:expired");
    batcher_destroy(b);
}

/* A start that fails ends that job FAILED (never started) and gives back
 * its reservation: the next job is admitted in the same admit. A step that
 * fails ends every job of the batch FAILED with the step's message. */
static void test_start_and_step_failures(void) {
    world_t w;
    batcher_t *b = make(&w, 40, 8, 8);
    fake_t a = fake(1, 4, 10), c = fake(1, 2, 10), d = fake(1, 2, 10);
    a.fail_start = 1;
    submit(b, &a);
    submit(b, &c);
    submit(b, &d);
    w.fail_step_at = 1;
    CHECK(batcher_iterate(b, 0) == 2);
    batcher_event_t ev[8];
    int n = batcher_take_events(b, ev, 8);
    CHECK(n == 5 && ev[0].type == BATCHER_ENDED && ev[0].end == BATCHER_END_FAILED &&
          !ev[0].started);
    CHECK_STR_CONTAINS(ev[0].why, "no room for this fake job");
    CHECK(batcher_iterate(b, 0) == -1);
    n = batcher_take_events(b, ev, 8);
    CHECK(n == 2 && ev[0].end == BATCHER_END_FAILED && ev[1].end == BATCHER_END_FAILED &&
          ev[0].started && ev[1].started);
    CHECK_STR_CONTAINS(ev[1].why, "the fake step failed");
    CHECK(c.stopped == 1 && d.stopped == 1 && a.stopped == 0);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.running == 0 && st.reserved_bytes == 0);
    batcher_destroy(b);
}

/* The step's reported KV peak is held against the planner's reservation. */
static void test_overrun_is_counted(void) {
    world_t w;
    batcher_t *b = make(&w, 100, 8, 8);
    fake_t a = fake(2, 3, 10), c = fake(1, 3, 5);
    submit(b, &a);
    submit(b, &c);
    batcher_iterate(b, 0);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.last_reserved_bytes == 15 && st.last_kv_peak_bytes == 15 && st.overruns == 0);
    CHECK(st.last_jobs == 2 && st.last_images == 3);
    w.extra = 1;
    batcher_iterate(b, 0);
    batcher_stats(b, &st);
    CHECK(st.last_reserved_bytes == 30 && st.last_kv_peak_bytes == 31 && st.overruns == 1);
    batcher_destroy(b);
}

static void test_shutdown_ends_everything(void) {
    world_t w;
    batcher_t *b = make(&w, 40, 8, 8);
    fake_t a = fake(1, 4, 5), c = fake(1, 4, 5), d = fake(1, 1, 40);
    submit(b, &a);
    submit(b, &c);
    batcher_iterate(b, 0); /* both fit: 40 at most together; D waits */
    CHECK_EVENTS(b, "A1 A2 S1 S2");
    submit(b, &d);
    batcher_shutdown(b);
    CHECK_EVENTS(b, "E1:shutdown E2:shutdown E3:shutdown");
    CHECK(a.stopped == 1 && c.stopped == 1 && d.started == 0);
    batcher_destroy(b);
}

static batcher_refusal_t try_submit(batcher_t *b, fake_t *f) {
    batcher_job_t j = job_of(f);
    return batcher_submit(b, &j, NULL);
}

/* max_waiting 0 is no queue: a job is accepted only when it starts at the
 * next admission (its images within max_running, its KV beside what is
 * running and what was accepted before it), else refused queue_full; the
 * accepted ones all start at the next admission. */
static void test_no_queue_starts_now_or_refuses(void) {
    world_t w;
    batcher_t *b = make(&w, 50, 3, 0);
    fake_t a = fake(1, 4, 10), c = fake(1, 2, 10), d = fake(1, 1, 20), e = fake(1, 1, 1),
           two = fake(2, 1, 1), big = fake(1, 1, 31);
    CHECK(try_submit(b, &a) == BATCHER_ACCEPTED);
    CHECK(try_submit(b, &c) == BATCHER_ACCEPTED);             /* 10 + 10, then 20 + 20 */
    CHECK(try_submit(b, &big) == BATCHER_REFUSED_QUEUE_FULL); /* 10 + 10 + 31 > 50 */
    CHECK(try_submit(b, &two) == BATCHER_REFUSED_QUEUE_FULL); /* 4 images > 3 */
    CHECK(try_submit(b, &d) == BATCHER_ACCEPTED);             /* 10 + 10 + 20 */
    CHECK(try_submit(b, &e) == BATCHER_REFUSED_QUEUE_FULL);   /* a 4th image */
    CHECK(batcher_iterate(b, 0) == 3);
    CHECK_EVENTS(b, "A1 A2 A3 S1 S2 S3 E3:finished");
    /* A holds 20, 30, 40 from now, C 20: 10, 20, 30 more would pass 50 at
     * the third step; one step of 10 fits. */
    fake_t f = fake(1, 3, 10), g = fake(1, 1, 10);
    CHECK(try_submit(b, &f) == BATCHER_REFUSED_QUEUE_FULL);
    CHECK(try_submit(b, &g) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 3);
    CHECK_EVENTS(b, "A4 S1 S2 E2:finished S4 E4:finished");
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.overruns == 0 && st.waiting == 0);
    batcher_destroy(b);
}

/* Without a queue, a job submitted while a step is in flight starts after
 * that step: it is checked against the running jobs' next iteration (their
 * KV then; the jobs whose last step is in flight gone, their images too),
 * so what it reserves is exact and the step after never passes the pool. */
static void test_no_queue_submitted_during_a_step(void) {
    world_t w;
    batcher_t *b = make(&w, 40, 4, 0);
    fake_t a = fake(1, 4, 10), last = fake(1, 1, 5);
    CHECK(try_submit(b, &a) == BATCHER_ACCEPTED);
    CHECK(try_submit(b, &last) == BATCHER_ACCEPTED);
    CHECK(batcher_admit(b, 0) == 2); /* A holds 10 in this step, 20 in the next */
    fake_t x = fake(1, 1, 25), y = fake(1, 1, 20);
    CHECK(try_submit(b, &x) == BATCHER_REFUSED_QUEUE_FULL); /* 10 + 5 + 25 now, 20 + 25 next */
    CHECK(try_submit(b, &y) == BATCHER_ACCEPTED);           /* 20 + 20 */
    ar_error_t err = {{0}};
    CHECK(batcher_step(b, &err) == AR_OK);
    batcher_finish(b, AR_OK, &err);
    CHECK_EVENTS(b, "A1 A2 S1 S2 E2:finished");
    CHECK(batcher_iterate(b, 0) == 2);
    CHECK_EVENTS(b, "A3 S1 S3 E3:finished");
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK_MSG(st.overruns == 0 && st.last_reserved_bytes == 40 && st.last_kv_peak_bytes == 40,
              "%zu reserved, %zu used, %lld overruns", st.last_reserved_bytes,
              st.last_kv_peak_bytes, st.overruns);
    batcher_destroy(b);

    b = make(&w, 1000, 2, 0);
    fake_t p = fake(1, 3, 1), q = fake(1, 1, 1), r = fake(1, 1, 1), t = fake(1, 1, 1);
    CHECK(try_submit(b, &p) == BATCHER_ACCEPTED);
    CHECK(try_submit(b, &q) == BATCHER_ACCEPTED);
    CHECK(batcher_admit(b, 0) == 2);
    CHECK(try_submit(b, &r) == BATCHER_ACCEPTED);           /* q's slot: its last step */
    CHECK(try_submit(b, &t) == BATCHER_REFUSED_QUEUE_FULL); /* p's goes on */
    CHECK(batcher_step(b, &err) == AR_OK);
    batcher_finish(b, AR_OK, &err);
    CHECK(batcher_iterate(b, 0) == 2);
    CHECK_EVENTS(b, "A1 A2 S1 S2 E2:finished A3 S1 S3 E3:finished");
    batcher_destroy(b);
}

/* Without a queue, a job accepted but cancelled or expired before it
 * starts gives back the KV reserved for it. */
static void test_no_queue_gives_back_reservations(void) {
    world_t w;
    batcher_t *b = make(&w, 40, 4, 0);
    fake_t a = fake(1, 1, 40), c = fake(1, 1, 40), d = fake(1, 1, 40);
    batcher_job_t ja = job_of(&a), jc = job_of(&c);
    uint64_t ia = 0;
    CHECK(batcher_submit(b, &ja, &ia) == BATCHER_ACCEPTED);
    CHECK(batcher_submit(b, &jc, NULL) == BATCHER_REFUSED_QUEUE_FULL);
    CHECK(batcher_cancel(b, ia, BATCHER_END_CANCELLED) == 1);
    CHECK_EVENTS(b, "E1:cancelled");
    jc.deadline = 1;
    CHECK(batcher_submit(b, &jc, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 2) == 0);
    CHECK_EVENTS(b, "E2:expired");
    CHECK(try_submit(b, &d) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 2) == 1);
    CHECK_EVENTS(b, "A3 S3 E3:finished");
    CHECK(a.started == 0 && c.started == 0 && d.stopped == 1);
    batcher_destroy(b);
}

/* A job of `steps` steps whose levels hold a, b and c bytes at every step. */
static void elastic_make(elastic_t *e, int steps, size_t a, size_t b, size_t c) {
    const size_t each[N_LEVELS] = {a, b, c};
    memset(e, 0, sizeof *e);
    e->f = fake(1, steps, 0);
    e->level = -1;
    for (int l = 0; l < N_LEVELS; l++) {
        for (int t = 0; t < steps; t++)
            e->levels[l][t] = each[l];
        e->level_ptrs[l] = e->levels[l];
    }
    memcpy(e->f.bytes, e->levels[N_LEVELS - 1], sizeof e->f.bytes);
}

static uint64_t submit_elastic(batcher_t *b, elastic_t *e) {
    batcher_job_t j = job_of(&e->f);
    j.n_levels = N_LEVELS;
    j.level_kv_bytes = e->level_ptrs;
    uint64_t id = 0;
    batcher_refusal_t r = batcher_submit(b, &j, &id);
    CHECK_MSG(r == BATCHER_ACCEPTED, "refused: %s", batcher_refusal_name(r));
    return id;
}

/* The level of the last ADMITTED event taken, or -1. */
/* The last admission among the events waiting (its type BATCHER_ADMITTED),
 * or an event of type -1 when there was none. */
static batcher_event_t last_admission(batcher_t *b) {
    batcher_event_t ev[64], last = {.type = -1};
    const int n = batcher_take_events(b, ev, 64);
    for (int i = 0; i < n; i++)
        if (ev[i].type == BATCHER_ADMITTED)
            last = ev[i];
    return last;
}

static int admitted_level(batcher_t *b) {
    const batcher_event_t e = last_admission(b);
    return e.type == BATCHER_ADMITTED ? e.level : -1;
}

/* An idle pool admits an elastic job at its largest level; a busy one at
 * the largest that fits beside the running job's whole plan; when not
 * even the floor fits it waits, and the next admission after the pool
 * frees gives it the largest again. The step holds what the level says,
 * so the reservation is never passed. */
static void test_elastic_admits_largest_level_that_fits(void) {
    world_t w;
    batcher_t *b = make(&w, 100, 4, 4);
    elastic_t idle;
    elastic_make(&idle, 2, 80, 40, 20);
    submit_elastic(b, &idle);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK(admitted_level(b) == 0 && idle.level == 0 && idle.f.bytes[0] == 80);
    CHECK(batcher_iterate(b, 0) == 1 && batcher_iterate(b, 0) == 0);

    fake_t big = fake(1, 4, 0);
    for (int t = 0; t < 4; t++)
        big.bytes[t] = 60;
    submit(b, &big);
    CHECK(batcher_iterate(b, 0) == 1);
    elastic_t busy;
    elastic_make(&busy, 2, 80, 40, 20);
    submit_elastic(b, &busy);
    CHECK(batcher_iterate(b, 0) == 2);
    CHECK(admitted_level(b) == 1 && busy.level == 1);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.overruns == 0 && st.last_reserved_bytes == 100);
    while (batcher_iterate(b, 0) > 0)
        ;
    admitted_level(b);

    /* 90 held for three steps: not even the floor (20) fits beside it. */
    for (int t = 0; t < 4; t++)
        big.bytes[t] = 90;
    big.stepped = 0;
    submit(b, &big);
    CHECK(batcher_iterate(b, 0) == 1);
    elastic_t wait;
    elastic_make(&wait, 2, 80, 40, 20);
    submit_elastic(b, &wait);
    CHECK(batcher_iterate(b, 0) == 1 && batcher_iterate(b, 0) == 1 && batcher_iterate(b, 0) == 1);
    CHECK(wait.level == -1);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK(wait.level == 0 && admitted_level(b) == 0);
    batcher_stats(b, &st);
    CHECK(st.overruns == 0);
    batcher_destroy(b);
}

/* Without a queue the level is chosen (and reserved) at submission. */
static void test_elastic_no_queue_reserves_the_level_that_fits(void) {
    world_t w;
    batcher_t *b = make(&w, 100, 4, 0);
    fake_t big = fake(1, 4, 0);
    for (int t = 0; t < 4; t++)
        big.bytes[t] = 70;
    submit(b, &big);
    elastic_t e;
    elastic_make(&e, 2, 80, 40, 20);
    submit_elastic(b, &e);
    CHECK(batcher_iterate(b, 0) == 2);
    CHECK(e.level == 2);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.overruns == 0 && st.last_reserved_bytes == 90);
    batcher_destroy(b);
}

/* An iteration's cost features are its jobs' features at the steps they
 * just did (a job with levels: its admitted level's), summed; a job
 * without features makes the iteration's unknown. */
static void test_iteration_features_sum_the_batch(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    fake_t a = fake(1, 3, 1), c = fake(1, 2, 1);
    cost_features_t fa[3], fc[2];
    for (int t = 0; t < 3; t++)
        fa[t] = (cost_features_t){.sequences = 2, .kv_attended = 10.0 * (t + 1), .new_tokens = 2};
    for (int t = 0; t < 2; t++)
        fc[t] = (cost_features_t){.sequences = 4, .kv_attended = 100.0 * (t + 1), .new_tokens = 8};
    batcher_job_t ja = job_of(&a), jc = job_of(&c);
    ja.step_features = fa;
    jc.step_features = fc;
    CHECK(batcher_submit(b, &ja, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 1);
    batcher_stats_t st;
    batcher_stats(b, &st);
    CHECK(st.last_features_known && st.last_features.kv_attended == 10 &&
          st.last_features.sequences == 2);
    CHECK(batcher_submit(b, &jc, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 2); /* a's step 1, c's step 0 */
    batcher_stats(b, &st);
    CHECK(st.last_features_known && st.last_features.kv_attended == 20 + 100 &&
          st.last_features.sequences == 6 && st.last_features.new_tokens == 10);
    CHECK(batcher_iterate(b, 0) == 2); /* a's last step, c's last */
    batcher_stats(b, &st);
    CHECK(st.last_features.kv_attended == 30 + 200);

    fake_t u = fake(1, 1, 1);
    submit(b, &u); /* no features */
    elastic_t e;
    elastic_make(&e, 2, 80, 40, 20);
    cost_features_t lf[N_LEVELS][2];
    const cost_features_t *lp[N_LEVELS];
    for (int l = 0; l < N_LEVELS; l++) {
        for (int t = 0; t < 2; t++)
            lf[l][t] = (cost_features_t){.sequences = 2, .kv_attended = 1000.0 * (l + 1)};
        lp[l] = lf[l];
    }
    batcher_job_t je = job_of(&e.f);
    je.n_levels = N_LEVELS;
    je.level_kv_bytes = e.level_ptrs;
    je.step_features = lf[N_LEVELS - 1];
    je.level_step_features = lp;
    CHECK(batcher_submit(b, &je, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 2);
    batcher_stats(b, &st);
    CHECK(!st.last_features_known && st.last_features.kv_attended == 1000);
    CHECK(batcher_iterate(b, 0) == 1 && e.level == 0);
    batcher_stats(b, &st);
    CHECK(st.last_features_known && st.last_features.kv_attended == 1000);
    batcher_destroy(b);
}

/* Time objectives: a table where an iteration costs 1 s per KV token
 * attended, nothing else. A running job of 4 steps attending 1 each
 * (target 10 s). */
static cost_table_t one_per_kv(void) {
    cost_table_t t = {.family = "raster"};
    t.coef[2] = 1;
    return t;
}

static void constant_features(cost_features_t *f, int steps, double kv) {
    for (int t = 0; t < steps; t++)
        f[t] = (cost_features_t){.sequences = 2, .kv_attended = kv};
}

/* An elastic job of 4 steps whose levels attend 8, 4 and 1 a step. */
typedef struct timed_elastic {
    elastic_t e;
    cost_features_t f[N_LEVELS][4];
    const cost_features_t *levels[N_LEVELS];
} timed_elastic_t;

static batcher_job_t timed_elastic(timed_elastic_t *t) {
    static const double kv[N_LEVELS] = {8, 4, 1};
    elastic_make(&t->e, 4, 80, 40, 20);
    for (int l = 0; l < N_LEVELS; l++) {
        constant_features(t->f[l], 4, kv[l]);
        t->levels[l] = t->f[l];
    }
    batcher_job_t j = job_of(&t->e.f);
    j.n_levels = N_LEVELS;
    j.level_kv_bytes = t->e.level_ptrs;
    j.step_features = t->f[N_LEVELS - 1];
    j.level_step_features = t->levels;
    return j;
}

/* An elastic job whose top level would make it late is admitted at the
 * largest level that keeps its target, though the pool has room for the
 * top: compression that buys time. */
static void test_time_objective_picks_the_level_that_keeps_it(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    const cost_table_t t = one_per_kv();
    batcher_set_costs(b, &t);
    fake_t r = fake(1, 4, 1);
    cost_features_t fr[4];
    constant_features(fr, 4, 1);
    batcher_job_t jr = job_of(&r);
    jr.step_features = fr;
    jr.target = 100; /* far: only the elastic job's own target decides */
    CHECK(batcher_submit(b, &jr, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0.5) == 1);
    admitted_level(b);

    timed_elastic_t te;
    batcher_job_t je = timed_elastic(&te);
    je.target = 1 + 8; /* at level 2: 3 steps of 2 s beside r, then one of 1 s: ends at 8 */
    CHECK(batcher_alone_seconds(b, &je) == 4);
    CHECK(batcher_submit(b, &je, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 1) == 2);
    batcher_event_t ev[8];
    int n = batcher_take_events(b, ev, 8), seen = 0;
    for (int i = 0; i < n; i++)
        if (ev[i].type == BATCHER_ADMITTED) {
            seen = 1;
            CHECK(ev[i].level == 2 && ev[i].regime == BATCHER_REGIME_TIME);
            CHECK_NEAR(ev[i].predicted_end, 1 + 3 * 2 + 1, 1e-12, 0);
        }
    CHECK(seen && te.e.level == 2);
    batcher_destroy(b);
}

/* A job late even alone at its floor (it waited past its objective) runs
 * at its floor, though nothing else runs and the pool has room for its
 * top: its objective is lost, and the floor takes the least time from the
 * jobs after it. */
static void test_a_late_head_runs_at_its_floor(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    const cost_table_t t = one_per_kv();
    batcher_set_costs(b, &t);
    timed_elastic_t te;
    batcher_job_t je = timed_elastic(&te);
    je.submitted = 1;
    je.target = 9; /* alone at its floor it takes 4: late once it starts after 5 */
    CHECK(batcher_submit(b, &je, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 6) == 1);
    const batcher_event_t e = last_admission(b);
    CHECK_MSG(e.type == BATCHER_ADMITTED && e.level == N_LEVELS - 1 &&
                  e.regime == BATCHER_REGIME_TIME,
              "admitted at level %d (%s)", e.level, batcher_regime_name(e.regime));
    batcher_destroy(b);
}

/* A job that would make a running job late waits (though the pool has
 * room), and is admitted once that job is done; a job that could not keep
 * its target even alone is admitted when it breaks no one else's. */
static void test_time_objective_waits_then_admits(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    const cost_table_t t = one_per_kv();
    batcher_set_costs(b, &t);
    fake_t r = fake(1, 4, 1), c = fake(1, 2, 1), late = fake(1, 2, 1);
    cost_features_t fr[4], fc[2], fl[2];
    constant_features(fr, 4, 1);
    constant_features(fc, 2, 8);
    constant_features(fl, 2, 8);
    batcher_job_t jr = job_of(&r), jc = job_of(&c), jl = job_of(&late);
    jr.step_features = fr;
    jr.target = 5; /* alone it ends at 4 */
    jc.step_features = fc;
    jc.target = 100;
    jl.step_features = fl;
    jl.target = 1; /* alone it needs 16 s: it cannot keep it */
    CHECK(batcher_submit(b, &jr, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK(batcher_submit(b, &jc, NULL) == BATCHER_ACCEPTED);
    /* Beside c, r's three steps left would take 9 s each. */
    for (int i = 1; i < 4; i++)
        CHECK(batcher_iterate(b, i) == 1);
    CHECK(c.started == 0);
    CHECK(batcher_iterate(b, 4) == 1 && c.started == 1);
    batcher_event_t ev[16];
    int n = batcher_take_events(b, ev, 16);
    for (int i = 0; i < n; i++)
        if (ev[i].type == BATCHER_ADMITTED && ev[i].work == &c)
            CHECK(ev[i].regime == BATCHER_REGIME_TIME);
    while (batcher_iterate(b, 20) > 0)
        ;
    batcher_take_events(b, ev, 16);
    CHECK(batcher_submit(b, &jl, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 30) == 1 && late.started == 1);
    n = batcher_take_events(b, ev, 16);
    for (int i = 0; i < n; i++)
        if (ev[i].type == BATCHER_ADMITTED)
            CHECK(ev[i].regime == BATCHER_REGIME_FREE && ev[i].predicted_end == 30 + 16);
    batcher_destroy(b);
}

/* The measured arrival rate caps the budget: at the rate jobs arrive, a
 * level whose load would settle above half the objective (Little's law
 * over the table) is passed over though nothing runs; at a slow rate the
 * top is kept. An idle spell of `idle` comes halfway through the jobs. */
static void rate_case(double gap, double idle, int want_level, batcher_regime_t want_regime) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 16);
    cost_table_t t = one_per_kv();
    t.coef[0] = 1;
    batcher_set_costs(b, &t);
    enum { QUICK = 2 * (BATCHER_RATE_MIN_GAPS + 1) };
    fake_t quick[QUICK];
    double at = 0;
    for (int i = 0; i < QUICK; i++) { /* jobs of one step, no features */
        quick[i] = fake(1, 1, 1);
        batcher_job_t j = job_of(&quick[i]);
        j.submitted = at += gap + (i == QUICK / 2 ? idle : 0);
        CHECK(batcher_submit(b, &j, NULL) == BATCHER_ACCEPTED);
        CHECK(batcher_iterate(b, at) == 1);
    }
    admitted_level(b);
    timed_elastic_t te;
    batcher_job_t je = timed_elastic(&te);
    je.submitted = at += gap;
    je.target = at + 40; /* alone at the top it ends at +36 */
    CHECK(batcher_submit(b, &je, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, at) == 1);
    const batcher_event_t e = last_admission(b);
    CHECK_MSG(e.type == BATCHER_ADMITTED && e.level == want_level && e.regime == want_regime,
              "gap %g: admitted at level %d (%s)", gap, e.level, batcher_regime_name(e.regime));
    batcher_destroy(b);
}

static void test_the_arrival_rate_caps_the_budget(void) {
    /* One job every 25: the top (8 a step) would load the engine 4 x 8 / 25
     * > 1; the middle (4) settles at 4 / (1 - 0.64) = 11 <= 20. */
    rate_case(25, 0, 1, BATCHER_REGIME_TIME);
    rate_case(1000, 0, 0, BATCHER_REGIME_FREE);
    /* A spell without requests (a night, the gap between two load tests)
     * does not hide the rate that follows it: one gap weighs at most
     * BATCHER_GAP_CAP of the mean. */
    rate_case(25, 1e5, 1, BATCHER_REGIME_TIME);
}

/* Without a table, or for a job without step features, admission is by
 * memory alone. */
static void test_no_table_no_time(void) {
    world_t w;
    batcher_t *b = make(&w, 1000, 4, 4);
    fake_t r = fake(1, 4, 1), c = fake(1, 2, 1);
    cost_features_t fr[4], fc[2];
    constant_features(fr, 4, 1);
    constant_features(fc, 2, 8);
    batcher_job_t jr = job_of(&r), jc = job_of(&c);
    jr.step_features = fr;
    jr.target = 5;
    jc.step_features = fc;
    CHECK(batcher_alone_seconds(b, &jc) == -1);
    CHECK(batcher_submit(b, &jr, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 0) == 1);
    CHECK(batcher_submit(b, &jc, NULL) == BATCHER_ACCEPTED);
    CHECK(batcher_iterate(b, 1) == 2);
    const cost_table_t t = one_per_kv();
    batcher_set_costs(b, &t);
    fake_t d = fake(1, 2, 1);
    submit(b, &d); /* no features: not priced */
    CHECK(batcher_iterate(b, 2) == 3);
    batcher_destroy(b);
}

int main(void) {
    TEST_RUN(test_job_life_cycle_events);
    TEST_RUN(test_fifo_admission_head_blocks);
    TEST_RUN(test_max_running_counts_images);
    TEST_RUN(test_refusal_reasons);
    TEST_RUN(test_cancel_waiting_and_running);
    TEST_RUN(test_deadlines);
    TEST_RUN(test_start_and_step_failures);
    TEST_RUN(test_overrun_is_counted);
    TEST_RUN(test_shutdown_ends_everything);
    TEST_RUN(test_no_queue_starts_now_or_refuses);
    TEST_RUN(test_no_queue_submitted_during_a_step);
    TEST_RUN(test_no_queue_gives_back_reservations);
    TEST_RUN(test_elastic_admits_largest_level_that_fits);
    TEST_RUN(test_elastic_no_queue_reserves_the_level_that_fits);
    TEST_RUN(test_iteration_features_sum_the_batch);
    TEST_RUN(test_time_objective_picks_the_level_that_keeps_it);
    TEST_RUN(test_time_objective_waits_then_admits);
    TEST_RUN(test_a_late_head_runs_at_its_floor);
    TEST_RUN(test_no_table_no_time);
    TEST_RUN(test_the_arrival_rate_caps_the_budget);
    return TEST_SUMMARY();
}
