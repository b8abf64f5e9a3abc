/* `arserve bench`: a load client for a running daemon. Requests leave at
 * the times an arrival process scheduled (cli/loadgen.h), each on its own
 * connection and thread, and latency counts from the scheduled time, not
 * the send: a daemon that falls behind makes later requests wait in the
 * client too, and that wait is latency (no coordinated omission, as wrk2).
 * A gauge scraper samples the daemon's KV pool and queue from /metrics
 * while the run lasts. Reports: cli/bench_report.h. `--profile` measures
 * the engine in-process instead (cli/bench_profile.c), for the simulator's
 * cost table. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "cli/bench_report.h"
#include "cli/cli.h"
#include "cli/flags.h"
#include "cli/http_client.h"
#include "cli/load_spec.h"
#include "cli/loadgen.h"

#define IMAGES_PATH "/v1/images/generations"

/* What the HTTP side needs besides the load spec. */
typedef struct bench_opts {
    http_target_t target;
    double timeout, scrape_interval;
    long long max_inflight;
    char auth[600]; /* an Authorization header line, or "" */
    int progress;
} bench_opts_t;

/* One run's shared state. */
typedef struct run {
    const bench_opts_t *o;
    const load_spec_t *s;
    bench_record_t *rec;
    int n;     /* requests this run may send */
    double t0; /* clock_now_s() at the start */
    pthread_mutex_t mu;
    pthread_cond_t changed;
    int issued, finished, failed; /* in flight: issued - finished */
    int next;                     /* closed loop: the next request to take */
    int clients;                  /* closed loop: clients still taking requests */
    int scraping;
    bench_pool_t *pool;
} run_t;

static double since(const run_t *r) { return clock_now_s() - r->t0; }

/* Reads what a response says into its record. */
static void read_response(bench_record_t *rec, const http_response_t *resp) {
    rec->status = resp->status;
    cJSON *o = resp->body ? cJSON_ParseWithLength(resp->body, resp->len) : NULL;
    if (resp->status != 200) {
        const cJSON *code =
            cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(o, "error"), "code");
        snprintf(rec->code, sizeof rec->code, "%s", cJSON_IsString(code) ? code->valuestring : "");
        cJSON_Delete(o);
        return;
    }
    const cJSON *usage = cJSON_GetObjectItemCaseSensitive(o, "usage");
    const cJSON *t = cJSON_GetObjectItemCaseSensitive(o, "timings");
    const cJSON *in = cJSON_GetObjectItemCaseSensitive(usage, "input_tokens");
    const cJSON *out = cJSON_GetObjectItemCaseSensitive(usage, "output_tokens");
    rec->images = cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(o, "data"));
    rec->input_tokens = cJSON_IsNumber(in) ? in->valueint : 0;
    rec->output_tokens = cJSON_IsNumber(out) ? out->valueint : 0;
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(t, "queue_s");
    const cJSON *run = cJSON_GetObjectItemCaseSensitive(t, "run_s");
    const cJSON *d = cJSON_GetObjectItemCaseSensitive(t, "decode_png_s");
    const cJSON *steps = cJSON_GetObjectItemCaseSensitive(t, "steps");
    rec->queue_s = cJSON_IsNumber(q) ? q->valuedouble : -1;
    rec->run_s = cJSON_IsNumber(run) ? run->valuedouble : -1;
    rec->decode_png_s = cJSON_IsNumber(d) ? d->valuedouble : -1;
    rec->steps = cJSON_IsNumber(steps) ? steps->valueint : 0;
    if (!o) { /* a 200 that is not the API's JSON */
        rec->status = 0;
        snprintf(rec->code, sizeof rec->code, "bad_response");
    }
    cJSON_Delete(o);
}

/* Sends request i (its record's scheduled time set) and records the answer. */
static void send_one(run_t *r, int i) {
    bench_record_t *rec = &r->rec[i];
    const char *body = r->s->mix.e[rec->entry].body;
    rec->sent = since(r);
    http_response_t resp;
    int rc = http_request(&r->o->target, "POST", IMAGES_PATH, r->o->auth, "application/json", body,
                          strlen(body), r->o->timeout, &resp);
    rec->done = since(r);
    if (rc == 0) {
        read_response(rec, &resp);
    } else {
        rec->status = 0;
        snprintf(rec->code, sizeof rec->code, "%s",
                 strstr(resp.why, "timed out") ? "timeout" : "connection");
    }
    http_response_free(&resp);
    pthread_mutex_lock(&r->mu);
    r->finished++;
    r->failed += rec->status != 200;
    pthread_cond_broadcast(&r->changed);
    pthread_mutex_unlock(&r->mu);
}

typedef struct one_arg {
    run_t *r;
    int i;
} one_arg_t;

static void *open_loop_request(void *p) {
    one_arg_t a = *(one_arg_t *)p;
    free(p);
    send_one(a.r, a.i);
    return NULL;
}

/* Closed loop: each client takes the next request when its last one ends,
 * until none is left or --duration has passed. */
static void *closed_loop_client(void *p) {
    run_t *r = p;
    pthread_mutex_lock(&r->mu);
    for (;;) {
        const double now = since(r);
        if (r->next == r->n || (r->s->duration > 0 && now >= r->s->duration))
            break;
        const int i = r->next++;
        r->issued++;
        r->rec[i].scheduled = now;
        pthread_mutex_unlock(&r->mu);
        send_one(r, i);
        pthread_mutex_lock(&r->mu);
    }
    r->clients--;
    pthread_cond_broadcast(&r->changed);
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

/* The CLOCK_REALTIME time `seconds` from now, for pthread_cond_timedwait. */
static struct timespec realtime_after(double seconds) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    double s = (double)ts.tv_nsec * 1e-9 + seconds;
    ts.tv_sec += (time_t)s;
    ts.tv_nsec = (long)((s - floor(s)) * 1e9);
    return ts;
}

/* The value of an unlabelled sample `name value` in a Prometheus text page. */
static double metric_value(const char *page, const char *name) {
    size_t n = strlen(name);
    for (const char *p = page; p && *p; p = strchr(p, '\n') ? strchr(p, '\n') + 1 : NULL)
        if (!strncmp(p, name, n) && p[n] == ' ')
            return strtod(p + n + 1, NULL);
    return 0;
}

static void *scraper(void *p) {
    run_t *r = p;
    pthread_mutex_lock(&r->mu);
    while (r->scraping) {
        pthread_mutex_unlock(&r->mu);
        http_response_t resp;
        if (http_request(&r->o->target, "GET", "/metrics", NULL, NULL, NULL, 0, 5.0, &resp) == 0 &&
            resp.status == 200) {
            const char *page = resp.body;
            r->pool->capacity_bytes = metric_value(page, "arserve_kv_pool_capacity_bytes");
            bench_pool_add(r->pool, metric_value(page, "arserve_kv_pool_used_bytes"),
                           metric_value(page, "arserve_kv_pool_reserved_bytes"),
                           metric_value(page, "arserve_requests_running"),
                           metric_value(page, "arserve_requests_waiting"));
        }
        http_response_free(&resp);
        pthread_mutex_lock(&r->mu);
        const struct timespec until = realtime_after(r->o->scrape_interval);
        /* r->changed also signals every answer: wait out the interval. */
        while (r->scraping && pthread_cond_timedwait(&r->changed, &r->mu, &until) != ETIMEDOUT) {
        }
    }
    pthread_mutex_unlock(&r->mu);
    return NULL;
}

static void draw_progress(const run_t *r, int final) {
    const int width = 30, total = r->n ? r->n : 1, filled = r->finished * width / total;
    fprintf(stderr, "\r[%.*s%*s] %d/%d done, %d failed, %d in flight, %.1f s ", filled,
            "##############################", width - filled, "", r->finished, r->n, r->failed,
            r->issued - r->finished, since(r));
    if (final)
        fputc('\n', stderr);
    fflush(stderr);
}

/* Waits for a change or 0.25 s, whichever comes first (mu held). */
static void wait_a_little(run_t *r) {
    const struct timespec until = realtime_after(0.25);
    pthread_cond_timedwait(&r->changed, &r->mu, &until);
}

/* Sleeps until the run's clock reads t (s). */
static void sleep_until(const run_t *r, double t) {
    for (double left; (left = t - since(r)) > 0;) {
        struct timespec ts = {(time_t)left, (long)((left - floor(left)) * 1e9)};
        nanosleep(&ts, NULL);
    }
}

/* One run (load_run_fn): open loop at the records' scheduled times, or a
 * closed loop of the spec's concurrency. */
static int bench_run(void *ctx, const load_spec_t *s, const char *label, double rate,
                     bench_record_t *rec, int n, bench_pool_t *pool) {
    run_t *r = ctx;
    const bench_opts_t *o = r->o;
    (void)rate, (void)label;
    r->s = s;
    r->rec = rec;
    r->n = n;
    r->pool = pool;
    r->issued = r->finished = r->failed = r->next = r->clients = 0;
    pthread_t scrape_thread;
    r->t0 = clock_now_s();
    r->scraping = o->scrape_interval > 0;
    const int scraping = r->scraping && pthread_create(&scrape_thread, NULL, scraper, r) == 0;
    int rc = 0;
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    pthread_attr_setstacksize(&attr, 256 * 1024);
    const int closed = s->arrival == LOADGEN_CONCURRENCY && !s->trace;
    if (closed) {
        for (int c = 0; c < s->concurrency; c++) {
            pthread_t t;
            pthread_mutex_lock(&r->mu);
            r->clients++;
            if (pthread_create(&t, &attr, closed_loop_client, r) != 0) {
                r->clients--;
                rc = -1;
            }
            pthread_mutex_unlock(&r->mu);
            if (rc)
                break;
        }
    } else {
        for (int i = 0; i < n; i++) {
            if (s->duration > 0 && rec[i].scheduled >= s->duration)
                break;
            sleep_until(r, rec[i].scheduled);
            pthread_mutex_lock(&r->mu);
            while (r->issued - r->finished >=
                   o->max_inflight) /* the wait counts: latency is from sched */
                wait_a_little(r);
            r->issued++;
            pthread_mutex_unlock(&r->mu);
            one_arg_t *a = malloc(sizeof *a);
            pthread_t t;
            if (!a || (*a = (one_arg_t){r, i}, pthread_create(&t, &attr, open_loop_request, a))) {
                free(a);
                pthread_mutex_lock(&r->mu);
                r->issued--;
                pthread_mutex_unlock(&r->mu);
                rc = -1;
                break;
            }
            if (o->progress && i % 8 == 0) {
                pthread_mutex_lock(&r->mu);
                draw_progress(r, 0);
                pthread_mutex_unlock(&r->mu);
            }
        }
    }
    pthread_attr_destroy(&attr);
    pthread_mutex_lock(&r->mu);
    /* Every answer in, and every client stopped taking requests. */
    while (r->finished < r->issued || r->clients > 0) {
        if (o->progress)
            draw_progress(r, 0);
        wait_a_little(r);
    }
    if (o->progress)
        draw_progress(r, 1);
    r->scraping = 0;
    pthread_cond_broadcast(&r->changed);
    pthread_mutex_unlock(&r->mu);
    if (scraping)
        pthread_join(scrape_thread, NULL);
    if (rc)
        fprintf(stderr, "arserve bench: cannot start a thread: %s\n", strerror(errno));
    return rc;
}

static void bench_usage(FILE *f, const cli_flag_t *flags) {
    fprintf(f,
            "usage: arserve bench [--url URL] [--arrival KIND] [--rate R | --rates R1,R2,..]\n"
            "                     [--num-requests N] [--duration S] [--mix FILE | --prompt TEXT]\n"
            "                     [--out DIR] ...\n"
            "       arserve bench --profile --model DIR [--out FILE] ...\n\n"
            "Sends image requests to a running daemon at the times an arrival process sets and\n"
            "reports throughput, goodput and latency (from each request's scheduled time) per\n"
            "run; with --rates, one run per rate (a sweep). With --profile, times the engine\n"
            "in-process instead, at several batch sizes, and writes the cost table\n"
            "`arserve simulate` reads.\n\n");
    cli_flags_usage(f, flags);
}

int cmd_bench(int argc, char **argv, char **envp) {
    const char *url = "http://127.0.0.1:8080", *api_key = NULL;
    int profile = 0, no_progress = 0, help = 0;
    bench_opts_t o = {.timeout = 600, .scrape_interval = 0.5, .max_inflight = 256};
    load_spec_t spec;
    load_spec_defaults(&spec);
    bench_profile_opts_t prof = bench_profile_defaults();
    cli_flag_t flags[LOAD_N_FLAGS + 16] = {
        {"url", 0, CLI_STRING, &url, .metavar = "URL",
         .help = "the daemon (default http://127.0.0.1:8080)"},
        {"timeout", 0, CLI_REAL, &o.timeout, 0, 1e6, 1, .metavar = "S",
         .help = "per request, connecting to the last byte (default 600)"},
        {"max-inflight", 0, CLI_INT, &o.max_inflight, 1, 100000, .metavar = "N",
         .help = "requests open at once; a request due while N are open waits, and the wait "
                 "counts in its latency (default 256)"},
        {"scrape-interval", 0, CLI_REAL, &o.scrape_interval, 0, 3600, .metavar = "S",
         .help = "sample the daemon's KV and queue gauges from /metrics every S seconds "
                 "(default 0.5; 0: off)"},
        {"api-key", 0, CLI_STRING, &api_key, .metavar = "KEY",
         .help = "sent as a Bearer token (default: $OPENAI_API_KEY when set)"},
        {"no-progress", 0, CLI_BOOL, &no_progress,
         .help = "no progress bar (there is none unless stderr is a terminal)"},
        {"profile", 0, CLI_BOOL, &profile,
         .help = "time the engine in-process (no daemon) and write the simulator's cost table "
                 "to --out (default costs.json)"},
        {"model", 0, CLI_STRING, &prof.model_dir, .metavar = "DIR",
         .help = "--profile: the model (default: the shipped demo model)"},
        {"max-batch", 0, CLI_INT, &prof.max_batch, 1, 256, .metavar = "N",
         .help = "--profile: the largest batch in images, timed at 1, 2, 4, .. N (default 8)"},
        {"policies", 0, CLI_STRING, &prof.policies, .metavar = "P1,P2,..",
         .help = "--profile: the KV policies timed, to vary the tokens attended (default: full "
                 "and linear, or full and streaming on a next-scale model)"},
        {"threads", 0, CLI_INT, &prof.threads, 0, 1024, .metavar = "N",
         .help = "--profile: CPU threads, 0 = all cores (default 0, as the daemon)"},
    };
    if (load_flags(flags, (int)(sizeof flags / sizeof *flags), &spec) != 0) {
        fprintf(stderr, "arserve bench: its flag table is too small (a bug)\n");
        return 1;
    }
    int rc = cli_flags_parse("bench", flags, argc, argv, &help);
    if (rc)
        return rc;
    if (help) {
        bench_usage(stdout, flags);
        return 0;
    }
    if (profile) {
        prof.out = spec.out_dir ? spec.out_dir : "costs.json";
        return bench_profile_run(&prof);
    }
    char why[512];
    if (http_target_parse(&o.target, url, why, sizeof why)) {
        fprintf(stderr, "arserve bench: --url: %s\n", why);
        return 2;
    }
    o.progress = !no_progress && isatty(STDERR_FILENO);
    if (!api_key)
        api_key = getenv("OPENAI_API_KEY");
    if (api_key && *api_key)
        snprintf(o.auth, sizeof o.auth, "Authorization: Bearer %.500s\r\n", api_key);
    if ((rc = load_spec_finish(&spec, "bench")) != 0)
        return rc;
    run_t r = {.o = &o};
    pthread_mutex_init(&r.mu, NULL);
    pthread_cond_init(&r.changed, NULL);
    rc = load_sweep(&spec, "bench", bench_run, &r);
    pthread_mutex_destroy(&r.mu);
    pthread_cond_destroy(&r.changed);
    load_spec_free(&spec);
    (void)envp;
    return rc;
}
