/* Tests for server/job_store.c with jobs of its own (a reference count and
 * an end time): ids (form, distinct, uniform hex digits, far apart), the
 * slot bound (reserved slots count, a full store sweeps before refusing),
 * retention (kept until retention_s after the end, then forgotten and
 * released), DELETE's forget, references held by lookups, the sweeping
 * thread, a thousand jobs through a small store leaving nothing behind,
 * and the store's metrics. */
#include <stdatomic.h>
#include <stdlib.h>
#include <time.h>

#include "base/clock.h"
#include "server/job_store.h"
#include "tests/test.h"

typedef struct fake_job {
    _Atomic double ended; /* the sweeper reads it */
    atomic_int refs;
} fake_job_t;

static double fake_ended_at(void *job) { return atomic_load(&((fake_job_t *)job)->ended); }
static void fake_retain(void *job) { atomic_fetch_add(&((fake_job_t *)job)->refs, 1); }
static void fake_release(void *job) { atomic_fetch_sub(&((fake_job_t *)job)->refs, 1); }
static const job_store_ops_t OPS = {
    .ended_at = fake_ended_at, .retain = fake_retain, .release = fake_release};

static int refs(fake_job_t *j) { return atomic_load(&j->refs); }
static void end_at(fake_job_t *j, double t) { atomic_store(&j->ended, t); }

static job_store_t *store(int max_jobs, double retention_s, int sweeper, metrics_t *m) {
    job_store_options_t o = {.max_jobs = max_jobs, .retention_s = retention_s, .sweeper = sweeper};
    ar_error_t err = {{0}};
    job_store_t *st = job_store_create(&o, &OPS, m, &err);
    CHECK_MSG(st != NULL, "%s", err.msg);
    return st;
}

/* Reserves and fills a slot with j (whose reference the store takes). */
static int put(job_store_t *st, fake_job_t *j, char id[JOB_STORE_ID_LEN + 1]) {
    job_store_refusal_t why;
    if (job_store_reserve(st, id, &why) != AR_OK)
        return AR_ERR;
    atomic_store(&j->refs, 1);
    job_store_fill(st, id, j, 1000, 7, NULL);
    return AR_OK;
}

static int hex_value(char c) { return c <= '9' ? c - '0' : c - 'a' + 10; }

static void test_ids_are_random_and_distinct(void) {
    enum { N = 1000 };
    static char ids[N][JOB_STORE_ID_LEN + 1];
    int digits[16] = {0};
    for (int i = 0; i < N; i++) {
        CHECK(job_store_new_id(ids[i]) == AR_OK);
        CHECK(strlen(ids[i]) == JOB_STORE_ID_LEN);
        CHECK(job_store_id_valid(ids[i]));
        for (int k = 4; k < JOB_STORE_ID_LEN; k++)
            digits[hex_value(ids[i][k])]++;
    }
    int dup = 0;
    for (int i = 0; i < N; i++)
        for (int k = i + 1; k < N; k++)
            dup += !strcmp(ids[i], ids[k]);
    CHECK(dup == 0);
    /* 32000 digits: each value about 2000 times (sd 43); a counter or a
     * clock would pile on a few values. */
    for (int d = 0; d < 16; d++)
        CHECK_MSG(digits[d] > 1700 && digits[d] < 2300, "digit %x seen %d times", d, digits[d]);
    /* Successive ids differ in about half of their 128 bits, not in the
     * last few as a sequence would. */
    long bits = 0;
    for (int i = 1; i < N; i++)
        for (int k = 4; k < JOB_STORE_ID_LEN; k++)
            bits += __builtin_popcount(hex_value(ids[i][k]) ^ hex_value(ids[i - 1][k]));
    const double mean = (double)bits / (N - 1);
    CHECK_MSG(mean > 58 && mean < 70, "successive ids differ in %.1f bits on average", mean);
    /* Each byte's two digits are independent: equal in about 1 pair of 16
     * (16,000 pairs: 1,000, sd 31), not always, as when one byte's digits
     * both came from its high half (64 random bits where 128 are promised,
     * which the counts above cannot see). */
    int same = 0;
    for (int i = 0; i < N; i++)
        for (int k = 4; k < JOB_STORE_ID_LEN; k += 2)
            same += ids[i][k] == ids[i][k + 1];
    CHECK_MSG(same > 800 && same < 1200, "a byte's two digits agree %d times in %d", same,
              N * (JOB_STORE_ID_LEN - 4) / 2);
}

static void test_id_form(void) {
    CHECK(job_store_id_valid("job_0123456789abcdef0123456789abcdef"));
    CHECK(!job_store_id_valid("job_0123456789ABCDEF0123456789abcdef"));
    CHECK(!job_store_id_valid("job_0123456789abcdef0123456789abcde"));
    CHECK(!job_store_id_valid("job_0123456789abcdef0123456789abcdef0"));
    CHECK(!job_store_id_valid("jab_0123456789abcdef0123456789abcdef"));
    CHECK(!job_store_id_valid("job_0123456789abcdef0123456789abcdeg"));
    CHECK(!job_store_id_valid(""));
}

static void test_reserve_fill_get_forget(void) {
    job_store_t *st = store(4, 10, 0, NULL);
    char id[JOB_STORE_ID_LEN + 1];
    job_store_refusal_t why;
    job_store_entry_t e;
    CHECK(job_store_reserve(st, id, &why) == AR_OK);
    CHECK(job_store_get(st, id, &e) == AR_ERR); /* reserved: nobody sees it yet */
    fake_job_t j = {.refs = 1};
    job_store_fill(st, id, &j, 1234, 9, "prompt: a warning");
    CHECK(job_store_get(st, id, &e) == AR_OK);
    CHECK(e.job == &j && e.created == 1234 && e.prompt_tokens == 9 && !strcmp(e.id, id));
    CHECK(!strcmp(e.warnings, "prompt: a warning"));
    CHECK(refs(&j) == 2); /* the lookup's reference */
    fake_release(&j);
    char other[JOB_STORE_ID_LEN + 1];
    CHECK(job_store_new_id(other) == AR_OK);
    CHECK(job_store_get(st, other, &e) == AR_ERR);
    CHECK(job_store_get(st, "job_", &e) == AR_ERR);
    CHECK(job_store_forget(st, id) == 1);
    CHECK(refs(&j) == 0);
    CHECK(job_store_forget(st, id) == 0);
    CHECK(job_store_get(st, id, &e) == AR_ERR);
    job_store_counts_t n;
    job_store_counts(st, &n);
    CHECK(n.pending == 0 && n.ended == 0 && n.reserved == 0 && n.deleted == 1);
    job_store_destroy(st);
}

static void test_slot_bound(void) {
    job_store_t *st = store(3, 10, 0, NULL);
    fake_job_t j[3] = {{0}};
    char id[4][JOB_STORE_ID_LEN + 1];
    CHECK(put(st, &j[0], id[0]) == AR_OK);
    CHECK(put(st, &j[1], id[1]) == AR_OK);
    job_store_refusal_t why;
    CHECK(job_store_reserve(st, id[2], &why) == AR_OK); /* a reserved slot counts */
    CHECK(job_store_reserve(st, id[3], &why) == AR_ERR && why == JOB_STORE_FULL);
    job_store_unreserve(st, id[2]);
    CHECK(put(st, &j[2], id[2]) == AR_OK);
    CHECK(job_store_reserve(st, id[3], &why) == AR_ERR && why == JOB_STORE_FULL);
    /* An ended job within its retention still holds its slot... */
    end_at(&j[0], clock_now_s());
    CHECK(job_store_reserve(st, id[3], &why) == AR_ERR && why == JOB_STORE_FULL);
    job_store_counts_t n;
    job_store_counts(st, &n);
    CHECK(n.max_jobs == 3 && n.pending == 2 && n.ended == 1 && n.oldest_ended > 0);
    /* ...one past it is swept by the reservation that needs the room. */
    end_at(&j[1], clock_now_s() - 11);
    CHECK(job_store_reserve(st, id[3], &why) == AR_OK);
    CHECK(refs(&j[1]) == 0);
    job_store_destroy(st);
    CHECK(refs(&j[0]) == 0 && refs(&j[2]) == 0); /* destroy drops the rest */
}

static void test_retention(void) {
    job_store_t *st = store(4, 10, 0, NULL);
    fake_job_t a = {0}, b = {0};
    char ia[JOB_STORE_ID_LEN + 1], ib[JOB_STORE_ID_LEN + 1];
    CHECK(put(st, &a, ia) == AR_OK);
    CHECK(put(st, &b, ib) == AR_OK);
    end_at(&a, 100);
    CHECK(job_store_sweep(st, 1e9) == 1); /* b runs: never forgotten */
    CHECK(refs(&a) == 0 && refs(&b) == 1);
    end_at(&b, 100);
    CHECK(job_store_sweep(st, 109.9) == 0);
    job_store_entry_t e;
    CHECK(job_store_get(st, ib, &e) == AR_OK);
    fake_release(&b);
    CHECK(job_store_sweep(st, 110.1) == 1);
    CHECK(job_store_get(st, ib, &e) == AR_ERR);
    job_store_counts_t n;
    job_store_counts(st, &n);
    CHECK(n.forgotten == 2 && n.pending == 0 && n.ended == 0);
    job_store_destroy(st);
}

/* A thousand jobs through a store of 8 slots: each forgotten after its
 * retention, every reference given back, the store empty at the end. */
static void test_thousand_jobs_leave_nothing(void) {
    enum { N = 1000 };
    metrics_t *m = metrics_create();
    job_store_t *st = store(8, 1, 0, m);
    static fake_job_t jobs[N];
    char id[JOB_STORE_ID_LEN + 1];
    int refused = 0;
    for (int i = 0; i < N; i++) {
        if (put(st, &jobs[i], id) != AR_OK)
            refused++;
        end_at(&jobs[i], clock_now_s() - 2); /* ended past its retention */
    }
    CHECK(refused == 0); /* each reservation swept the ones before */
    job_store_sweep(st, clock_now_s());
    int held = 0;
    for (int i = 0; i < N; i++)
        held += refs(&jobs[i]);
    CHECK(held == 0);
    job_store_counts_t n;
    job_store_counts(st, &n);
    CHECK(n.pending == 0 && n.ended == 0 && n.reserved == 0 && n.forgotten == N);
    char *text = metrics_render(m);
    CHECK(text != NULL);
    if (text) {
        CHECK_STR_CONTAINS(text, "arserve_async_jobs_created_total 1000\n");
        CHECK_STR_CONTAINS(text, "arserve_async_jobs_forgotten_total{reason=\"expired\"} 1000\n");
        CHECK_STR_CONTAINS(text, "arserve_async_jobs_max 8\n");
    }
    free(text);
    job_store_destroy(st);
    metrics_destroy(m);
}

/* The sweeping thread forgets an ended job soon after its retention, with
 * nobody calling the store. */
static void test_sweeper_thread(void) {
    job_store_t *st = store(4, 0.1, 1, NULL);
    fake_job_t j = {0};
    char id[JOB_STORE_ID_LEN + 1];
    CHECK(put(st, &j, id) == AR_OK);
    end_at(&j, clock_now_s());
    const double deadline = clock_now_s() + 10;
    while (refs(&j) > 0 && clock_now_s() < deadline) {
        struct timespec ts = {0, 10 * 1000000L};
        nanosleep(&ts, NULL);
    }
    CHECK(refs(&j) == 0);
    job_store_counts_t n;
    job_store_counts(st, &n);
    CHECK(n.ended == 0 && n.forgotten == 1);
    job_store_destroy(st);
}

static void test_bad_options(void) {
    ar_error_t err = {{0}};
    job_store_options_t o = {.max_jobs = 0, .retention_s = 1};
    CHECK(job_store_create(&o, &OPS, NULL, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "max_jobs");
    o = (job_store_options_t){.max_jobs = 1, .retention_s = 0};
    CHECK(job_store_create(&o, &OPS, NULL, &err) == NULL);
}

int main(void) {
    TEST_RUN(test_ids_are_random_and_distinct);
    TEST_RUN(test_id_form);
    TEST_RUN(test_reserve_fill_get_forget);
    TEST_RUN(test_slot_bound);
    TEST_RUN(test_retention);
    TEST_RUN(test_thousand_jobs_leave_nothing);
    TEST_RUN(test_sweeper_thread);
    TEST_RUN(test_bad_options);
    return TEST_SUMMARY();
}
