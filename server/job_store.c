/* The async jobs' store (job_store.h): a fixed array of slots, scanned
 * linearly (max_jobs is small: a lookup is a few thousand byte compares at
 * most), and a sweeping thread that forgets ended jobs past their
 * retention. Lock order: the store's mu, then whatever ops take (a job's
 * own lock). */
#include "server/job_store.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "base/clock.h"

typedef enum slot_state { SLOT_FREE, SLOT_RESERVED, SLOT_KEPT } slot_state_t;

typedef struct slot {
    slot_state_t state;
    job_store_entry_t e;
} slot_t;

struct job_store {
    job_store_options_t opt;
    job_store_ops_t ops;
    pthread_mutex_t mu;
    pthread_cond_t wake; /* the sweeper's: stop */
    slot_t *slots;
    long long forgotten, deleted;
    int stop;
    pthread_t sweeper;
    int sweeper_started;
    metric_t *m_created, *m_forgotten, *m_refused, *m_max;
};

int job_store_new_id(char id[JOB_STORE_ID_LEN + 1]) {
    unsigned char b[JOB_STORE_ID_BYTES];
    size_t got = 0;
    while (got < sizeof b) {
        const ssize_t n = getrandom(b + got, sizeof b - got, 0);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return AR_ERR;
        got += (size_t)n;
    }
    static const char hex[] = "0123456789abcdef";
    memcpy(id, JOB_STORE_ID_PREFIX, 4);
    for (size_t i = 0; i < sizeof b; i++) {
        id[4 + 2 * i] = hex[b[i] >> 4];
        id[5 + 2 * i] = hex[b[i] & 15];
    }
    id[JOB_STORE_ID_LEN] = 0;
    return AR_OK;
}

int job_store_id_valid(const char *s) {
    if (strncmp(s, JOB_STORE_ID_PREFIX, 4) != 0)
        return 0;
    for (int i = 4; i < JOB_STORE_ID_LEN; i++)
        if (!((s[i] >= '0' && s[i] <= '9') || (s[i] >= 'a' && s[i] <= 'f')))
            return 0;
    return s[JOB_STORE_ID_LEN] == 0;
}

/* The slot in state `state` under id, or NULL (mu held). */
static slot_t *find(job_store_t *st, const char *id, slot_state_t state) {
    if (!job_store_id_valid(id))
        return NULL;
    for (int i = 0; i < st->opt.max_jobs; i++)
        if (st->slots[i].state == state && !memcmp(st->slots[i].e.id, id, JOB_STORE_ID_LEN))
            return &st->slots[i];
    return NULL;
}

/* Empties a kept slot, dropping the store's reference (mu held). */
static void slot_clear(job_store_t *st, slot_t *sl) {
    if (sl->state == SLOT_KEPT)
        st->ops.release(sl->e.job);
    memset(sl, 0, sizeof *sl);
}

static int sweep_locked(job_store_t *st, double now) {
    int n = 0;
    for (int i = 0; i < st->opt.max_jobs; i++) {
        slot_t *sl = &st->slots[i];
        if (sl->state != SLOT_KEPT)
            continue;
        const double ended = st->ops.ended_at(sl->e.job);
        if (ended > 0 && now - ended > st->opt.retention_s) {
            slot_clear(st, sl);
            n++;
        }
    }
    st->forgotten += n;
    if (n)
        metric_add(st->m_forgotten, n, "expired");
    return n;
}

int job_store_sweep(job_store_t *st, double now) {
    pthread_mutex_lock(&st->mu);
    const int n = sweep_locked(st, now);
    pthread_mutex_unlock(&st->mu);
    return n;
}

/* How often the sweeper looks: a quarter of the retention, within
 * [0.05, 1] s, so that a job is forgotten at most that late. */
static double sweep_interval(const job_store_t *st) {
    return fmin(1.0, fmax(0.05, st->opt.retention_s / 4));
}

static void *sweeper_main(void *arg) {
    job_store_t *st = arg;
    pthread_mutex_lock(&st->mu);
    while (!st->stop) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        const double dt = sweep_interval(st);
        ts.tv_sec += (time_t)dt;
        ts.tv_nsec += (long)((dt - floor(dt)) * 1e9);
        if (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&st->wake, &st->mu, &ts);
        if (!st->stop)
            sweep_locked(st, clock_now_s());
    }
    pthread_mutex_unlock(&st->mu);
    return NULL;
}

job_store_t *job_store_create(const job_store_options_t *opt, const job_store_ops_t *ops,
                              metrics_t *metrics, ar_error_t *err) {
    if (opt->max_jobs < 1 || !(opt->retention_s > 0) || !ops->ended_at || !ops->retain ||
        !ops->release) {
        ar_errorf(err, "job store: max_jobs %d and retention_s %g must be positive", opt->max_jobs,
                  opt->retention_s);
        return NULL;
    }
    job_store_t *st = calloc(1, sizeof *st);
    if (!st || !(st->slots = calloc((size_t)opt->max_jobs, sizeof *st->slots))) {
        free(st);
        ar_errorf(err, "out of memory for a job store of %d jobs", opt->max_jobs);
        return NULL;
    }
    st->opt = *opt;
    st->ops = *ops;
    pthread_mutex_init(&st->mu, NULL);
    pthread_cond_init(&st->wake, NULL);
    if (metrics) {
        static const char *const reason[] = {"reason"};
        st->m_created = metrics_counter(metrics, "arserve_async_jobs_created_total",
                                        "Async jobs accepted (202).", 0, NULL);
        st->m_forgotten = metrics_counter(
            metrics, "arserve_async_jobs_forgotten_total",
            "Async jobs forgotten: expired (ended longer ago than the retention) or deleted "
            "(DELETE on an ended job).",
            1, reason);
        st->m_refused =
            metrics_counter(metrics, "arserve_async_jobs_refused_total",
                            "Async jobs refused by the job store, by reason.", 1, reason);
        st->m_max = metrics_gauge(metrics, "arserve_async_jobs_max",
                                  "Async jobs the store keeps at most (async_max_jobs).", 0, NULL);
        metric_set(st->m_max, opt->max_jobs);
    }
    if (opt->sweeper) {
        const int rc = pthread_create(&st->sweeper, NULL, sweeper_main, st);
        if (rc != 0) {
            ar_errorf(err, "cannot start the job store's sweeping thread: %s", strerror(rc));
            job_store_destroy(st);
            return NULL;
        }
        st->sweeper_started = 1;
    }
    return st;
}

void job_store_destroy(job_store_t *st) {
    if (!st)
        return;
    pthread_mutex_lock(&st->mu);
    st->stop = 1;
    pthread_cond_signal(&st->wake);
    pthread_mutex_unlock(&st->mu);
    if (st->sweeper_started)
        pthread_join(st->sweeper, NULL);
    for (int i = 0; i < st->opt.max_jobs; i++)
        slot_clear(st, &st->slots[i]);
    free(st->slots);
    pthread_mutex_destroy(&st->mu);
    pthread_cond_destroy(&st->wake);
    free(st);
}

/* A free slot, or NULL (mu held). */
static slot_t *free_slot(job_store_t *st) {
    for (int i = 0; i < st->opt.max_jobs; i++)
        if (st->slots[i].state == SLOT_FREE)
            return &st->slots[i];
    return NULL;
}

int job_store_reserve(job_store_t *st, char id[JOB_STORE_ID_LEN + 1], job_store_refusal_t *why) {
    char fresh[JOB_STORE_ID_LEN + 1];
    if (job_store_new_id(fresh) != AR_OK) {
        *why = JOB_STORE_NO_RANDOM;
        metric_add(st->m_refused, 1, "no_random");
        return AR_ERR;
    }
    pthread_mutex_lock(&st->mu);
    slot_t *sl = free_slot(st);
    if (!sl && sweep_locked(st, clock_now_s()) > 0)
        sl = free_slot(st);
    /* 128 random bits do not collide, but an id must name one job: a
     * collision would be a broken random source, and is refused as one. */
    const int taken = find(st, fresh, SLOT_KEPT) || find(st, fresh, SLOT_RESERVED);
    if (sl && !taken) {
        sl->state = SLOT_RESERVED;
        memcpy(sl->e.id, fresh, sizeof fresh);
    }
    pthread_mutex_unlock(&st->mu);
    if (!sl || taken) {
        *why = sl ? JOB_STORE_NO_RANDOM : JOB_STORE_FULL;
        metric_add(st->m_refused, 1, sl ? "no_random" : "store_full");
        return AR_ERR;
    }
    memcpy(id, fresh, sizeof fresh);
    return AR_OK;
}

void job_store_fill(job_store_t *st, const char *id, void *job, long created, int prompt_tokens,
                    const char *warnings) {
    pthread_mutex_lock(&st->mu);
    slot_t *sl = find(st, id, SLOT_RESERVED);
    if (sl) {
        sl->state = SLOT_KEPT;
        sl->e.job = job;
        sl->e.created = created;
        sl->e.created_at = clock_now_s();
        sl->e.prompt_tokens = prompt_tokens;
        snprintf(sl->e.warnings, sizeof sl->e.warnings, "%s", warnings ? warnings : "");
    }
    pthread_mutex_unlock(&st->mu);
    if (sl)
        metric_add(st->m_created, 1);
    else
        st->ops.release(job); /* no such reservation: a caller's bug; keep nothing */
}

void job_store_unreserve(job_store_t *st, const char *id) {
    pthread_mutex_lock(&st->mu);
    slot_t *sl = find(st, id, SLOT_RESERVED);
    if (sl)
        slot_clear(st, sl);
    pthread_mutex_unlock(&st->mu);
}

int job_store_get(job_store_t *st, const char *id, job_store_entry_t *out) {
    pthread_mutex_lock(&st->mu);
    slot_t *sl = find(st, id, SLOT_KEPT);
    if (sl) {
        *out = sl->e;
        st->ops.retain(sl->e.job);
    }
    pthread_mutex_unlock(&st->mu);
    return sl ? AR_OK : AR_ERR;
}

int job_store_forget(job_store_t *st, const char *id) {
    pthread_mutex_lock(&st->mu);
    slot_t *sl = find(st, id, SLOT_KEPT);
    if (sl) {
        slot_clear(st, sl);
        st->deleted++;
    }
    pthread_mutex_unlock(&st->mu);
    if (sl)
        metric_add(st->m_forgotten, 1, "deleted");
    return sl != NULL;
}

void job_store_counts(job_store_t *st, job_store_counts_t *out) {
    memset(out, 0, sizeof *out);
    pthread_mutex_lock(&st->mu);
    out->max_jobs = st->opt.max_jobs;
    for (int i = 0; i < st->opt.max_jobs; i++) {
        const slot_t *sl = &st->slots[i];
        if (sl->state == SLOT_RESERVED) {
            out->reserved++;
        } else if (sl->state == SLOT_KEPT) {
            const double ended = st->ops.ended_at(sl->e.job);
            if (ended > 0) {
                out->ended++;
                if (!out->oldest_ended || ended < out->oldest_ended)
                    out->oldest_ended = ended;
            } else {
                out->pending++;
            }
        }
    }
    out->forgotten = st->forgotten;
    out->deleted = st->deleted;
    pthread_mutex_unlock(&st->mu);
}

void job_store_each(job_store_t *st, void (*fn)(void *job, void *arg), void *arg) {
    pthread_mutex_lock(&st->mu);
    for (int i = 0; i < st->opt.max_jobs; i++)
        if (st->slots[i].state == SLOT_KEPT)
            fn(st->slots[i].e.job, arg);
    pthread_mutex_unlock(&st->mu);
}
