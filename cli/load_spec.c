/* The load flags and the sweep `arserve bench` and `arserve simulate`
 * share (cli/load_spec.h). */
#include "cli/load_spec.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void load_spec_defaults(load_spec_t *s) {
    *s = (load_spec_t){.arrival = LOADGEN_POISSON,
                       .rate = 1,
                       .burstiness = 1,
                       .concurrency = 1,
                       .n_requests = 100,
                       .n_images = 1};
}

int load_flags(cli_flag_t *flags, int cap, load_spec_t *s) {
    const cli_flag_t shared[] = {
        {"arrival", 0, CLI_CHOICE, &s->arrival, .choices = loadgen_arrival_names, .metavar = "KIND",
         .help = "poisson (default), gamma (shape --burstiness), burst (all at once) or "
                 "concurrency (a closed loop of --concurrency clients)"},
        {"rate", 0, CLI_REAL, &s->rate, 0, 1e6, 1, .metavar = "R",
         .help = "requests per second for poisson and gamma (default 1)"},
        {"rates", 0, CLI_STRING, &s->rates_s, .metavar = "R1,R2,..",
         .help = "a sweep: one run per rate, in order"},
        {"burstiness", 0, CLI_REAL, &s->burstiness, 0, 1e3, 1, .metavar = "B",
         .help = "gamma's shape: 1 is Poisson, below 1 burstier (default 1)"},
        {"concurrency", 0, CLI_INT, &s->concurrency, 1, 4096, .metavar = "C",
         .help = "clients of --arrival concurrency (default 1)"},
        {"num-requests", 'n', CLI_INT, &s->n_requests, 1, 10000000, .metavar = "N",
         .help = "requests per run (default 100)"},
        {"duration", 0, CLI_REAL, &s->duration, 0, 1e7, .metavar = "S",
         .help = "stop sending after S seconds of a run; answers are still awaited (default 0: "
                 "no limit)"},
        {"mix", 0, CLI_STRING, &s->mix_path, .metavar = "FILE",
         .help = "JSONL: one request body per line, with an optional \"weight\"; requests are "
                 "drawn in proportion"},
        {"prompt", 0, CLI_STRING, &s->prompt, .metavar = "TEXT",
         .help = "without --mix: every request's prompt (default \"a red circle\")"},
        {"images", 0, CLI_INT, &s->n_images, 1, 64, .metavar = "N",
         .help = "without --mix: images per request (\"n\", default 1)"},
        {"kv-policy", 0, CLI_STRING, &s->policy, .metavar = "P",
         .help = "without --mix: the requests' kv_policy (default: the daemon's)"},
        {"kv-budget", 0, CLI_REAL, &s->budget, 0, 1, .metavar = "B",
         .help = "without --mix: the requests' kv_budget (default: the policy's)"},
        {"seed", 0, CLI_INT, &s->seed, 0, 1e15, .metavar = "N",
         .help = "seeds the arrival times and the mix's draws (default 0)"},
        {"goodput-e2el-ms", 0, CLI_REAL, &s->slo.e2el_ms, 0, 1e9, .metavar = "MS",
         .help = "goodput counts requests whose end-to-end latency is at most MS (0: any)"},
        {"goodput-queue-ms", 0, CLI_REAL, &s->slo.queue_ms, 0, 1e9, .metavar = "MS",
         .help = "... and whose queue wait is at most MS (0: any)"},
        {"out", 'o', CLI_STRING, &s->out_dir, .metavar = "DIR",
         .help = "write LABEL.json, LABEL.requests.jsonl and a row of results.csv per run"},
        {"label", 0, CLI_STRING, &s->label, .metavar = "NAME",
         .help = "names the run's files (default rate-R, concurrency-C, burst-N or trace)"},
        {"trace", 0, CLI_STRING, &s->trace_path, .metavar = "FILE",
         .help = "replay a trace instead of generating arrivals: a LABEL.requests.jsonl of "
                 "`arserve bench`, or lines {\"t\": seconds, \"request\": {body}}"},
    };
    _Static_assert(sizeof shared / sizeof *shared == LOAD_N_FLAGS, "LOAD_N_FLAGS is the count");
    int n = 0;
    while (n < cap && flags[n].name)
        n++;
    if (n + LOAD_N_FLAGS + 1 > cap)
        return -1;
    memcpy(flags + n, shared, sizeof shared);
    flags[n + LOAD_N_FLAGS] = (cli_flag_t){0};
    return 0;
}

static int parse_rates(load_spec_t *s, const char *cmd) {
    s->n_rates = 0;
    for (const char *p = s->rates_s; *p;) {
        char *end;
        errno = 0;
        double v = strtod(p, &end);
        if (end == p || errno || !(v > 0) || !isfinite(v) || s->n_rates == LOAD_MAX_RATES ||
            (*end && *end != ',')) {
            fprintf(stderr,
                    "arserve %s: --rates: '%s' must be up to %d request rates above 0, "
                    "comma-separated (e.g. 0.5,1,2)\n",
                    cmd, s->rates_s, LOAD_MAX_RATES);
            return 2;
        }
        s->rates[s->n_rates++] = v;
        p = *end ? end + 1 : end;
    }
    return 0;
}

/* The one-request mix of --prompt, --images, --kv-policy and --kv-budget. */
static int mix_from_flags(load_spec_t *s) {
    cJSON *b = cJSON_CreateObject();
    int ok = b && cJSON_AddStringToObject(b, "prompt", s->prompt ? s->prompt : "a red circle") &&
             cJSON_AddNumberToObject(b, "n", (double)s->n_images) &&
             (!s->policy || cJSON_AddStringToObject(b, "kv_policy", s->policy)) &&
             (!(s->budget > 0) || cJSON_AddNumberToObject(b, "kv_budget", s->budget));
    char *body = ok ? cJSON_PrintUnformatted(b) : NULL;
    cJSON_Delete(b);
    int rc = body ? loadgen_mix_one(&s->mix, body) : -1;
    cJSON_free(body);
    return rc;
}

int load_spec_finish(load_spec_t *s, const char *cmd) {
    const int gen = s->trace_path == NULL;
    if (s->mix_path && (s->prompt || s->policy || s->budget > 0 || s->n_images != 1)) {
        fprintf(stderr,
                "arserve %s: --mix gives the requests; --prompt, --images, --kv-policy "
                "and --kv-budget are for runs without one\n",
                cmd);
        return 2;
    }
    if (!gen && (s->mix_path || s->prompt || s->policy || s->rates_s)) {
        fprintf(stderr,
                "arserve %s: --trace gives the arrivals and the requests; it takes no "
                "--mix, --prompt, --kv-policy or --rates\n",
                cmd);
        return 2;
    }
    if (s->rates_s && (s->arrival == LOADGEN_BURST || s->arrival == LOADGEN_CONCURRENCY)) {
        fprintf(stderr, "arserve %s: --rates needs --arrival poisson or gamma\n", cmd);
        return 2;
    }
    s->rates[0] = s->rate;
    s->n_rates = 1;
    if (s->rates_s && parse_rates(s, cmd))
        return 2;
    if (!gen) {
        int n = 0;
        if (loadgen_trace_read(s->trace_path, &s->trace, &n, &s->mix))
            return 2;
        s->n_requests = n;
        return 0;
    }
    if (s->mix_path ? loadgen_mix_read(&s->mix, s->mix_path) : mix_from_flags(s))
        return 2;
    return 0;
}

void load_spec_free(load_spec_t *s) {
    loadgen_mix_free(&s->mix);
    free(s->trace);
    s->trace = NULL;
}

static void run_label(const load_spec_t *s, double rate, char *out, size_t cap) {
    const char *pre = s->label ? s->label : "", *dash = s->label ? "-" : "";
    if (s->label && s->n_rates == 1)
        snprintf(out, cap, "%s", s->label);
    else if (s->trace)
        snprintf(out, cap, "%s%strace", pre, dash);
    else if (s->arrival == LOADGEN_CONCURRENCY)
        snprintf(out, cap, "%s%sconcurrency-%lld", pre, dash, s->concurrency);
    else if (s->arrival == LOADGEN_BURST)
        snprintf(out, cap, "%s%sburst-%lld", pre, dash, s->n_requests);
    else
        snprintf(out, cap, "%s%srate-%g", pre, dash, rate);
}

static int write_outputs(const load_spec_t *s, const cJSON *report, const char *label,
                         const bench_record_t *rec, int n) {
    if (!s->out_dir)
        return 0;
    if (mkdir(s->out_dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "--out %s: %s\n", s->out_dir, strerror(errno));
        return -1;
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/%s.json", s->out_dir, label);
    int rc = bench_report_write_json(report, path);
    snprintf(path, sizeof path, "%s/%s.requests.jsonl", s->out_dir, label);
    rc |= bench_report_write_jsonl(path, rec, n, &s->mix);
    snprintf(path, sizeof path, "%s/results.csv", s->out_dir);
    rc |= bench_report_append_csv(report, path);
    return rc;
}

int load_sweep(const load_spec_t *s, const char *source, load_run_fn run, void *ctx) {
    const int n = (int)s->n_requests;
    bench_record_t *rec = calloc((size_t)n, sizeof *rec);
    double *sched = calloc((size_t)n, sizeof *sched);
    if (!rec || !sched) {
        fprintf(stderr, "arserve %s: out of memory for %d requests\n", source, n);
        free(rec);
        free(sched);
        return 1;
    }
    const int open_loop = s->arrival == LOADGEN_POISSON || s->arrival == LOADGEN_GAMMA;
    int rc = 0;
    for (int k = 0; rc == 0 && k < s->n_rates; k++) {
        const double rate = s->trace || !open_loop ? 0 : s->rates[k];
        if (!s->trace && s->arrival != LOADGEN_CONCURRENCY)
            loadgen_schedule((loadgen_arrival_t)s->arrival, rate, s->burstiness, (uint64_t)s->seed,
                             sched, n);
        for (int i = 0; i < n; i++)
            rec[i] = (bench_record_t){
                .entry =
                    s->trace ? s->trace[i].entry : loadgen_mix_pick(&s->mix, (uint64_t)s->seed, i),
                .scheduled = s->trace ? s->trace[i].t : sched[i],
                .input_tokens = s->trace ? s->trace[i].input_tokens : 0,
                .queue_s = -1,
                .run_s = -1,
                .decode_png_s = -1};
        char label[128];
        run_label(s, rate, label, sizeof label);
        bench_pool_t pool = {0};
        fprintf(stderr, "arserve %s: %s: %d requests (%s)\n", source, label, n,
                s->trace ? "trace" : loadgen_arrival_names[s->arrival]);
        if (run(ctx, s, label, rate, rec, n, &pool) != 0) {
            rc = 1;
            break;
        }
        /* Requests never sent (--duration) are left out of the report. */
        int sent = 0;
        double duration = 0;
        for (int i = 0; i < n; i++)
            if (rec[i].done > 0) {
                duration = fmax(duration, rec[i].done);
                rec[sent++] = rec[i];
            }
        const bench_run_t info = {.label = label,
                                  .source = source,
                                  .arrival = s->trace ? "trace" : loadgen_arrival_names[s->arrival],
                                  .request_rate = rate,
                                  .burstiness = s->burstiness,
                                  .concurrency = s->arrival == LOADGEN_CONCURRENCY && !s->trace
                                                     ? (int)s->concurrency
                                                     : 0};
        cJSON *report = bench_report(&info, rec, sent, duration, &s->slo, &pool);
        if (!report) {
            fprintf(stderr, "arserve %s: out of memory for the report\n", source);
            rc = 1;
            break;
        }
        bench_report_print(stdout, report);
        fflush(stdout);
        rc = write_outputs(s, report, label, rec, sent) ? 1 : 0;
        cJSON_Delete(report);
    }
    free(rec);
    free(sched);
    return rc;
}
