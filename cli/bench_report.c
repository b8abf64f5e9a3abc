/* Summaries of a load run, measured or simulated (cli/bench_report.h). */
#include "cli/bench_report.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

void bench_pool_add(bench_pool_t *p, double used, double reserved, double running, double waiting) {
    p->samples++;
    p->used_sum += used;
    p->reserved_sum += reserved;
    p->running_sum += running;
    p->waiting_sum += waiting;
    p->used_max = fmax(p->used_max, used);
    p->reserved_max = fmax(p->reserved_max, reserved);
    p->running_max = fmax(p->running_max, running);
    p->waiting_max = fmax(p->waiting_max, waiting);
}

double bench_percentile(const double *sorted, int n, double q) {
    if (n <= 0)
        return 0;
    double pos = q / 100.0 * (n - 1);
    int lo = (int)floor(pos), hi = lo + 1 < n ? lo + 1 : lo;
    return sorted[lo] + (pos - lo) * (sorted[hi] - sorted[lo]);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static const int PERCENTILES[] = {50, 90, 95, 99};

/* mean_<name>_ms, median_<name>_ms, std_<name>_ms, p50.._<name>_ms of x
 * (seconds; sorted in place). */
static int add_stats(cJSON *o, const char *name, double *x, int n) {
    double sum = 0, sq = 0;
    for (int i = 0; i < n; i++)
        sum += x[i];
    const double mean = n ? sum / n : 0;
    for (int i = 0; i < n; i++)
        sq += (x[i] - mean) * (x[i] - mean);
    qsort(x, (size_t)n, sizeof *x, cmp_double);
    char key[64];
    int ok = 1;
#define ADD(fmt, v)                                                                                \
    do {                                                                                           \
        snprintf(key, sizeof key, fmt, name);                                                      \
        ok &= cJSON_AddNumberToObject(o, key, (v)*1e3) != NULL;                                    \
    } while (0)
    ADD("mean_%s_ms", mean);
    ADD("median_%s_ms", bench_percentile(x, n, 50));
    ADD("std_%s_ms", n ? sqrt(sq / n) : 0);
    for (size_t k = 0; k < sizeof PERCENTILES / sizeof *PERCENTILES; k++) {
        char fmt[32];
        snprintf(fmt, sizeof fmt, "p%d_%%s_ms", PERCENTILES[k]);
        ADD(fmt, bench_percentile(x, n, PERCENTILES[k]));
    }
#undef ADD
    return ok;
}

static int ok_record(const bench_record_t *r) { return r->status == 200; }

/* The per-request figures the report summarises, in seconds. */
typedef enum metric {
    METRIC_E2EL,
    METRIC_QUEUE,
    METRIC_STEP,
    METRIC_DECODE_PNG,
    N_METRICS
} metric_t;
static const char *const METRIC_NAMES[N_METRICS] = {"e2el", "queue", "step", "decode_png"};

/* Request r's figure m into *v; 0 when the response did not say. Latency
 * counts from the scheduled send time (no coordinated omission). */
static int metric_of(const bench_record_t *r, metric_t m, double *v) {
    switch (m) {
    case METRIC_E2EL:
        *v = r->done - r->scheduled;
        return 1;
    case METRIC_QUEUE:
        *v = r->queue_s;
        return r->queue_s >= 0;
    case METRIC_STEP:
        *v = r->steps > 0 ? r->run_s / r->steps : 0;
        return r->run_s >= 0 && r->steps > 0;
    case METRIC_DECODE_PNG:
        *v = r->decode_png_s;
        return r->decode_png_s >= 0;
    default:
        return 0;
    }
}

cJSON *bench_report(const bench_run_t *run, const bench_record_t *r, int n, double duration,
                    const bench_slo_t *slo, const bench_pool_t *pool) {
    cJSON *o = cJSON_CreateObject();
    double *x = malloc((size_t)(n > 0 ? n : 1) * sizeof *x);
    cJSON *failed = cJSON_CreateObject();
    if (!o || !x || !failed) {
        cJSON_Delete(o);
        cJSON_Delete(failed);
        free(x);
        return NULL;
    }
    int completed = 0, good = 0, images = 0, n_failed = 0;
    double in_tokens = 0, out_tokens = 0;
    for (int i = 0; i < n; i++) {
        if (!ok_record(&r[i])) {
            char status[16];
            snprintf(status, sizeof status, "%d", r[i].status);
            const char *key = r[i].status ? status : r[i].code[0] ? r[i].code : "connection";
            cJSON *c = cJSON_GetObjectItemCaseSensitive(failed, key);
            if (c)
                cJSON_SetNumberValue(c, c->valuedouble + 1);
            else
                cJSON_AddNumberToObject(failed, key, 1);
            n_failed++;
            continue;
        }
        completed++;
        images += r[i].images;
        in_tokens += r[i].input_tokens;
        out_tokens += r[i].output_tokens;
        const double e2el_ms = (r[i].done - r[i].scheduled) * 1e3, queue_ms = r[i].queue_s * 1e3;
        good += (!slo->e2el_ms || e2el_ms <= slo->e2el_ms) &&
                (!slo->queue_ms || (r[i].queue_s >= 0 && queue_ms <= slo->queue_ms));
    }
    const double dur = duration > 0 ? duration : 1e-9;
    int ok = 1;
    ok &= cJSON_AddStringToObject(o, "label", run->label) != NULL;
    ok &= cJSON_AddStringToObject(o, "source", run->source) != NULL;
    ok &= cJSON_AddStringToObject(o, "arrival", run->arrival) != NULL;
    ok &= cJSON_AddNumberToObject(o, "request_rate", run->request_rate) != NULL;
    ok &= cJSON_AddNumberToObject(o, "burstiness", run->burstiness) != NULL;
    ok &= cJSON_AddNumberToObject(o, "max_concurrency", run->concurrency) != NULL;
    ok &= cJSON_AddNumberToObject(o, "num_requests", n) != NULL;
    ok &= cJSON_AddNumberToObject(o, "duration", duration) != NULL;
    ok &= cJSON_AddNumberToObject(o, "completed", completed) != NULL;
    ok &= cJSON_AddNumberToObject(o, "num_failed", n_failed) != NULL;
    ok &= cJSON_AddItemToObject(o, "failed", failed);
    ok &= cJSON_AddNumberToObject(o, "total_input_tokens", in_tokens) != NULL;
    ok &= cJSON_AddNumberToObject(o, "total_output_tokens", out_tokens) != NULL;
    ok &= cJSON_AddNumberToObject(o, "request_throughput", completed / dur) != NULL;
    ok &= cJSON_AddNumberToObject(o, "images_per_s", images / dur) != NULL;
    ok &= cJSON_AddNumberToObject(o, "output_throughput", out_tokens / dur) != NULL;
    ok &= cJSON_AddNumberToObject(o, "request_goodput", good / dur) != NULL;
    cJSON *s = cJSON_AddObjectToObject(o, "goodput_slo_ms");
    ok &= s && cJSON_AddNumberToObject(s, "e2el", slo->e2el_ms) &&
          cJSON_AddNumberToObject(s, "queue", slo->queue_ms);
    for (int m = 0; m < N_METRICS; m++) {
        int k = 0;
        for (int i = 0; i < n; i++)
            if (ok_record(&r[i]) && metric_of(&r[i], (metric_t)m, &x[k]))
                k++;
        ok &= add_stats(o, METRIC_NAMES[m], x, k);
    }
    free(x);
    cJSON *p = cJSON_AddObjectToObject(o, "kv_pool");
    const double m = pool->samples ? 1.0 / pool->samples : 0;
    ok &= p && cJSON_AddNumberToObject(p, "samples", pool->samples) &&
          cJSON_AddNumberToObject(p, "capacity_bytes", pool->capacity_bytes) &&
          cJSON_AddNumberToObject(p, "max_used_bytes", pool->used_max) &&
          cJSON_AddNumberToObject(p, "mean_used_bytes", pool->used_sum * m) &&
          cJSON_AddNumberToObject(p, "max_reserved_bytes", pool->reserved_max) &&
          cJSON_AddNumberToObject(p, "mean_reserved_bytes", pool->reserved_sum * m) &&
          cJSON_AddNumberToObject(p, "max_running", pool->running_max) &&
          cJSON_AddNumberToObject(p, "mean_running", pool->running_sum * m) &&
          cJSON_AddNumberToObject(p, "max_waiting", pool->waiting_max) &&
          cJSON_AddNumberToObject(p, "mean_waiting", pool->waiting_sum * m);
    if (!ok) {
        cJSON_Delete(o);
        return NULL;
    }
    return o;
}

static double num(const cJSON *o, const char *key) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
    return cJSON_IsNumber(v) ? v->valuedouble : 0;
}

void bench_report_print(FILE *f, const cJSON *o) {
    const cJSON *pool = cJSON_GetObjectItemCaseSensitive(o, "kv_pool");
    char *failed = cJSON_PrintUnformatted(cJSON_GetObjectItemCaseSensitive(o, "failed"));
    const cJSON *label = cJSON_GetObjectItemCaseSensitive(o, "label");
    fprintf(f, "== %s: %g requests in %.2f s: %g completed, failed %s\n",
            cJSON_IsString(label) ? label->valuestring : "run", num(o, "num_requests"),
            num(o, "duration"), num(o, "completed"), failed ? failed : "?");
    cJSON_free(failed);
    fprintf(f, "   throughput %.3f req/s, %.3f images/s, %.1f image tokens/s; goodput %.3f req/s\n",
            num(o, "request_throughput"), num(o, "images_per_s"), num(o, "output_throughput"),
            num(o, "request_goodput"));
    const char *const *metric = METRIC_NAMES;
    for (int i = 0; i < N_METRICS; i++) {
        char k[6][40];
        static const char *const stat[] = {"mean", "median", "std", "p90", "p99"};
        for (int s = 0; s < 5; s++)
            snprintf(k[s], sizeof k[s], "%s_%s_ms", stat[s], metric[i]);
        fprintf(f, "   %-10s ms: mean %9.1f  median %9.1f  std %9.1f  p90 %9.1f  p99 %9.1f\n",
                metric[i], num(o, k[0]), num(o, k[1]), num(o, k[2]), num(o, k[3]), num(o, k[4]));
    }
    if (num(pool, "samples") > 0)
        fprintf(f,
                "   KV pool: capacity %.1f MiB, used max %.1f MiB (mean %.1f), reserved max %.1f "
                "MiB (mean %.1f); running max %g, waiting max %g\n",
                num(pool, "capacity_bytes") / 1048576, num(pool, "max_used_bytes") / 1048576,
                num(pool, "mean_used_bytes") / 1048576, num(pool, "max_reserved_bytes") / 1048576,
                num(pool, "mean_reserved_bytes") / 1048576, num(pool, "max_running"),
                num(pool, "max_waiting"));
}

int bench_report_write_json(const cJSON *report, const char *path) {
    char *text = cJSON_Print(report);
    FILE *f = text ? fopen(path, "w") : NULL;
    int ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f)
        ok &= fclose(f) == 0;
    cJSON_free(text);
    if (!ok)
        fprintf(stderr, "%s: cannot write: %s\n", path, strerror(errno));
    return ok ? 0 : -1;
}

int bench_report_write_jsonl(const char *path, const bench_record_t *r, int n,
                             const loadgen_mix_t *mix) {
    FILE *f = fopen(path, "w");
    int ok = f != NULL;
    for (int i = 0; ok && i < n; i++) {
        const bench_record_t *q = &r[i];
        fprintf(f,
                "{\"t\":%.6f,\"request\":%s,\"sent\":%.6f,\"done\":%.6f,\"e2el_ms\":%.3f,"
                "\"status\":%d,\"code\":\"%s\",\"images\":%d,\"input_tokens\":%d,"
                "\"output_tokens\":%d,\"queue_ms\":%.3f,\"run_ms\":%.3f,\"steps\":%d,"
                "\"decode_png_ms\":%.3f}\n",
                q->scheduled, mix->e[q->entry].body, q->sent, q->done,
                (q->done - q->scheduled) * 1e3, q->status, q->code, q->images, q->input_tokens,
                q->output_tokens, q->queue_s * 1e3, q->run_s * 1e3, q->steps,
                q->decode_png_s * 1e3);
    }
    if (f)
        ok &= !ferror(f) && fclose(f) == 0;
    if (!ok)
        fprintf(stderr, "%s: cannot write: %s\n", path, strerror(errno));
    return ok ? 0 : -1;
}

/* The CSV's columns: summary keys, or "kv_pool.<key>". */
static const char *const CSV_COLUMNS[] = {
    "label",
    "source",
    "arrival",
    "request_rate",
    "max_concurrency",
    "num_requests",
    "duration",
    "completed",
    "num_failed",
    "request_throughput",
    "images_per_s",
    "output_throughput",
    "request_goodput",
    "mean_e2el_ms",
    "median_e2el_ms",
    "p90_e2el_ms",
    "p99_e2el_ms",
    "mean_queue_ms",
    "p99_queue_ms",
    "mean_step_ms",
    "mean_decode_png_ms",
    "kv_pool.max_used_bytes",
    "kv_pool.mean_reserved_bytes",
    "kv_pool.max_running",
};
#define N_CSV (int)(sizeof CSV_COLUMNS / sizeof *CSV_COLUMNS)

int bench_report_append_csv(const cJSON *report, const char *path) {
    FILE *f = fopen(path, "a");
    if (!f) {
        fprintf(stderr, "%s: cannot write: %s\n", path, strerror(errno));
        return -1;
    }
    const int header = ftell(f) == 0;
    for (int i = 0; header && i < N_CSV; i++)
        fprintf(f, "%s%s", CSV_COLUMNS[i], i + 1 < N_CSV ? "," : "\n");
    for (int i = 0; i < N_CSV; i++) {
        const char *key = CSV_COLUMNS[i];
        const cJSON *o = report;
        if (!strncmp(key, "kv_pool.", 8)) {
            o = cJSON_GetObjectItemCaseSensitive(report, "kv_pool");
            key += 8;
        }
        const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, key);
        if (cJSON_IsString(v))
            fprintf(f, "%s", v->valuestring);
        else
            fprintf(f, "%.6g", cJSON_IsNumber(v) ? v->valuedouble : 0.0);
        fputc(i + 1 < N_CSV ? ',' : '\n', f);
    }
    int ok = !ferror(f);
    ok &= fclose(f) == 0;
    if (!ok)
        fprintf(stderr, "%s: cannot write: %s\n", path, strerror(errno));
    return ok ? 0 : -1;
}
