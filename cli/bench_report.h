/* The report `arserve bench` and `arserve simulate` both print: per-request
 * records in, a JSON summary per run (key names as vLLM's
 * benchmark_serving has them where they apply: duration, completed,
 * request_throughput, output_throughput, request_goodput,
 * mean/median/std/pNN_<metric>_ms), a JSONL line per request and a CSV row
 * per run out. One report for both, so a simulation and a measurement of
 * the same trace compare key by key. */
#ifndef ARSERVE_CLI_BENCH_REPORT_H
#define ARSERVE_CLI_BENCH_REPORT_H

#include <cjson/cJSON.h>
#include <stdio.h>

#include "cli/loadgen.h"

/* One request as it went. Times in seconds from the run's start. */
typedef struct bench_record {
    int entry;        /* its mix entry */
    double scheduled; /* when it was due to be sent: latency counts from here */
    double sent, done;
    int status;    /* the HTTP status; 0 when no response came */
    char code[48]; /* a failure's error.code, or "connection", "timeout" */
    int images, input_tokens, output_tokens;
    /* The daemon's `timings` (negative when the response had none). */
    double queue_s, run_s, decode_png_s;
    int steps;
} bench_record_t;

/* The daemon's KV pool and queue, scraped from /metrics during a run (or
 * the simulator's own), summarised. */
typedef struct bench_pool {
    int samples;
    double capacity_bytes;
    double used_max, used_sum;         /* arserve_kv_pool_used_bytes */
    double reserved_max, reserved_sum; /* arserve_kv_pool_reserved_bytes */
    double running_max, running_sum;   /* arserve_requests_running */
    double waiting_max, waiting_sum;   /* arserve_requests_waiting */
} bench_pool_t;

/* Adds one sample of the gauges. */
void bench_pool_add(bench_pool_t *p, double used, double reserved, double running, double waiting);

/* Service-level objectives for goodput; 0 leaves one out. */
typedef struct bench_slo {
    double e2el_ms, queue_ms;
} bench_slo_t;

typedef struct bench_run {
    const char *label;   /* names the run in files ("rate-2", "sim-rate-2") */
    const char *source;  /* "bench" or "simulate" */
    const char *arrival; /* loadgen_arrival_names[...] or "trace" */
    double request_rate; /* 0 for burst, concurrency and traces */
    double burstiness;
    int concurrency; /* 0 unless closed-loop */
} bench_run_t;

/* The run's summary. duration: from the start to the last answer. NULL
 * on out of memory. */
cJSON *bench_report(const bench_run_t *run, const bench_record_t *r, int n, double duration,
                    const bench_slo_t *slo, const bench_pool_t *pool);

/* The summary for a person: a few lines. */
void bench_report_print(FILE *f, const cJSON *report);

/* Writes the summary (pretty JSON) to path. 0, or -1 with a message. */
int bench_report_write_json(const cJSON *report, const char *path);
/* One JSON line per request: {"t": scheduled, "request": its body, ...}
 * (a trace `arserve simulate --trace` replays). 0, or -1 with a message. */
int bench_report_write_jsonl(const char *path, const bench_record_t *r, int n,
                             const loadgen_mix_t *mix);
/* Appends the summary's CSV row to path, with the header when the file is
 * new or empty. 0, or -1 with a message. */
int bench_report_append_csv(const cJSON *report, const char *path);

/* Percentile q (0..100) of x[0..n) sorted ascending, interpolated linearly
 * between the two nearest ranks (numpy's default); 0 when n is 0. */
double bench_percentile(const double *sorted, int n, double q);

#endif
