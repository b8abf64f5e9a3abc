/* The async jobs' store (POST /v1/images/generations with "async": true):
 * jobs kept past their request under unguessable ids drawn from the
 * kernel's CSPRNG, in a table of a fixed number of slots, pending and ended
 * alike, so that the memory it holds is bounded; an ended job is forgotten
 * retention_s after it ended, by a sweeping thread. Generic over the job:
 * ops say when one ended and hold or drop a reference (the daemon's are
 * sched_job_t's; the unit test's are its own). Thread-safe. */
#ifndef ARSERVE_JOB_STORE_H
#define ARSERVE_JOB_STORE_H

#include "base/status.h"
#include "server/metrics.h"

/* An id is "job_" and 32 lowercase hex digits: 128 random bits. */
#define JOB_STORE_ID_PREFIX "job_"
#define JOB_STORE_ID_BYTES 16
#define JOB_STORE_ID_LEN (4 + 2 * JOB_STORE_ID_BYTES)

typedef struct job_store job_store_t;

typedef struct job_store_ops {
    double (*ended_at)(void *job); /* when it ended (clock_now_s); 0 while it runs */
    void (*retain)(void *job);
    void (*release)(void *job);
} job_store_ops_t;

typedef struct job_store_options {
    int max_jobs;       /* slots, >= 1: jobs kept at once, pending or ended */
    double retention_s; /* > 0: how long an ended job is kept */
    int sweeper;        /* 1: a thread sweeps (job_store_sweep) a few times per retention_s,
                           at least every second; 0: the caller sweeps (tests) */
} job_store_options_t;

/* Room for a job's warnings (api_images_response_json's), NUL included. */
#define JOB_STORE_WARNINGS_BYTES 1024

/* A kept job as job_store_get copies it out. */
typedef struct job_store_entry {
    char id[JOB_STORE_ID_LEN + 1];
    void *job;                               /* a reference the caller drops (ops->release) */
    long created;                            /* wall-clock seconds (time()) at job_store_fill */
    double created_at;                       /* clock_now_s() then */
    int prompt_tokens;                       /* what job_store_fill was given */
    char warnings[JOB_STORE_WARNINGS_BYTES]; /* the request's warnings, one a line */
} job_store_entry_t;

/* What the store holds now and has done. */
typedef struct job_store_counts {
    int max_jobs;
    int reserved;        /* slots taken by job_store_reserve, not filled yet */
    int pending, ended;  /* filled slots, by ops->ended_at */
    double oldest_ended; /* clock_now_s() when the earliest-ended kept job ended; 0: none */
    long long forgotten; /* forgotten after retention_s */
    long long deleted;   /* forgotten by job_store_forget */
} job_store_counts_t;

/* Why job_store_reserve refused. */
typedef enum job_store_refusal {
    JOB_STORE_FULL,      /* max_jobs slots are taken */
    JOB_STORE_NO_RANDOM, /* getrandom failed: no id can be drawn */
} job_store_refusal_t;

/* NULL (err says why) on a bad option, out of memory or a thread that
 * cannot start. metrics (may be NULL) gets the store's counters:
 * arserve_async_jobs_created_total, arserve_async_jobs_forgotten_total
 * {reason="expired"|"deleted"}, arserve_async_jobs_refused_total{reason}
 * and the gauge arserve_async_jobs_max. */
job_store_t *job_store_create(const job_store_options_t *opt, const job_store_ops_t *ops,
                              metrics_t *metrics, ar_error_t *err);
/* Stops the sweeper and drops every job's reference. NULL is a no-op. */
void job_store_destroy(job_store_t *st);

/* Takes a slot for a job about to be submitted and draws its id into id:
 * AR_OK, or AR_ERR with *why (a full store is swept first, so a job past
 * its retention never holds a slot a new one needs). A reserved slot counts
 * towards max_jobs and is found by no lookup until filled. */
int job_store_reserve(job_store_t *st, char id[JOB_STORE_ID_LEN + 1], job_store_refusal_t *why);
/* Puts job (the caller's reference, now the store's) in the slot reserved
 * under id, with its prompt's tokens and warnings (NULL: none; cut to
 * JOB_STORE_WARNINGS_BYTES - 1). */
void job_store_fill(job_store_t *st, const char *id, void *job, long created, int prompt_tokens,
                    const char *warnings);
/* Gives back a slot reserved under id (its job was refused). */
void job_store_unreserve(job_store_t *st, const char *id);

/* AR_OK with *out filled (out->job retained for the caller) when id names a
 * kept job, AR_ERR when it names none (never was, or forgotten). */
int job_store_get(job_store_t *st, const char *id, job_store_entry_t *out);
/* Forgets the job under id now, dropping the store's reference: 1, or 0
 * when there was none. */
int job_store_forget(job_store_t *st, const char *id);
/* Forgets every job that ended more than retention_s before now (a
 * clock_now_s() time); returns how many. */
int job_store_sweep(job_store_t *st, double now);

void job_store_counts(job_store_t *st, job_store_counts_t *out);
/* Calls fn(job, arg) on every kept job (not reserved slots) with the
 * store's lock held: fn must not call into the store. */
void job_store_each(job_store_t *st, void (*fn)(void *job, void *arg), void *arg);

/* Draws an id from getrandom(2): AR_OK, or AR_ERR when the kernel gives no
 * random bytes (never a weaker source instead). */
int job_store_new_id(char id[JOB_STORE_ID_LEN + 1]);
/* 1 when s has an id's form ("job_" and 32 lowercase hex digits, nothing
 * after). */
int job_store_id_valid(const char *s);

#endif
