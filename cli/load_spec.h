/* What `arserve bench` and `arserve simulate` share: the flags that say
 * which load to apply (arrivals, rates, the request mix or a trace, SLOs,
 * outputs), and the sweep that runs it once per rate, reports each run
 * (cli/bench_report.h) and writes the files. Each command brings its own
 * way to run one load: over HTTP, or on a simulated clock. */
#ifndef ARSERVE_CLI_LOAD_SPEC_H
#define ARSERVE_CLI_LOAD_SPEC_H

#include "cli/bench_report.h"
#include "cli/flags.h"
#include "cli/loadgen.h"

#define LOAD_MAX_RATES 32
#define LOAD_N_FLAGS 18 /* entries load_flags adds */

typedef struct load_spec {
    /* flags */
    int arrival; /* loadgen_arrival_t */
    double rate, burstiness, duration, budget;
    const char *rates_s, *mix_path, *trace_path, *prompt, *policy, *out_dir, *label;
    long long concurrency, n_requests, seed, n_images;
    bench_slo_t slo;
    /* load_spec_finish */
    double rates[LOAD_MAX_RATES];
    int n_rates;
    loadgen_mix_t mix;
    loadgen_trace_item_t *trace; /* with --trace: n_requests items */
} load_spec_t;

void load_spec_defaults(load_spec_t *s);
/* Appends the shared flags to the flag table `flags` (cap entries, ended by
 * an entry without a name), keeping the end. 0, or -1 when cap is too
 * small (a bug of the caller's table). */
int load_flags(cli_flag_t *flags, int cap, load_spec_t *s);
/* After parsing: checks the flags together, reads the mix or trace, and
 * parses the rates. 0, or 2 (bad usage) after a message naming cmd. */
int load_spec_finish(load_spec_t *s, const char *cmd);
void load_spec_free(load_spec_t *s);

/* One run, named label, at a rate (0 for burst, concurrency and traces): fills rec[i]
 * for the requests it sent (their entry and scheduled time come set;
 * requests never sent keep done == 0) and pool's samples. Returns 0, or
 * -1 after printing why. */
typedef int (*load_run_fn)(void *ctx, const load_spec_t *s, const char *label, double rate,
                           bench_record_t *rec, int n, bench_pool_t *pool);

/* Runs the load once per rate (or once), reports each run on stdout
 * (source names who ran it: "bench", "simulate") and writes
 * DIR/LABEL.json, DIR/LABEL.requests.jsonl and a row of DIR/results.csv
 * when --out was given. 0, or 1 on a failure. */
int load_sweep(const load_spec_t *s, const char *source, load_run_fn run, void *ctx);

#endif
