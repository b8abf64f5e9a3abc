/* What `arserve bench` sends and `arserve simulate` replays: when requests
 * arrive (the arrival processes) and what each asks for (a mix of request
 * bodies), or both from a trace. One place, so the simulator sees the
 * arrivals the load client would send. */
#ifndef ARSERVE_CLI_LOADGEN_H
#define ARSERVE_CLI_LOADGEN_H

#include <stdint.h>

typedef enum loadgen_arrival {
    LOADGEN_POISSON,     /* exponential gaps at the rate */
    LOADGEN_GAMMA,       /* gamma gaps of mean 1/rate and shape `burstiness` */
    LOADGEN_BURST,       /* every request at time 0 */
    LOADGEN_CONCURRENCY, /* a closed loop: each of C clients sends when its last answer came */
} loadgen_arrival_t;

/* "poisson", "gamma", "burst", "concurrency" (NULL-terminated, in enum order). */
extern const char *const loadgen_arrival_names[];

/* Send times of n open-loop requests, seconds from the start, ascending:
 * POISSON and GAMMA at rate per second (GAMMA's shape burstiness: 1 is
 * Poisson, below 1 burstier, above 1 steadier; the definition vLLM's
 * benchmark uses), BURST all 0. The same seed gives the same times. Not
 * for LOADGEN_CONCURRENCY (no schedule: answers pace it). */
void loadgen_schedule(loadgen_arrival_t a, double rate, double burstiness, uint64_t seed, double *t,
                      int n);

/* One kind of request in the mix: a JSON body of the Images API. */
typedef struct loadgen_entry {
    char *body;     /* compact JSON, without the mix's own "weight" */
    double weight;  /* > 0; picks are in proportion */
    char label[64]; /* kv_policy and kv_budget when given ("linear@0.25"), else "default" */
} loadgen_entry_t;

typedef struct loadgen_mix {
    int n;
    loadgen_entry_t *e;
    double total_weight;
} loadgen_mix_t;

/* Reads a JSONL mix: one JSON object per line, a request body, with an
 * optional "weight" (default 1); blank lines and lines starting with '#'
 * are skipped. 0, or -1 after printing "PATH:LINE: problem" on stderr. */
int loadgen_mix_read(loadgen_mix_t *m, const char *path);
/* A mix of one request body (a JSON object). 0, or -1 with a message. */
int loadgen_mix_one(loadgen_mix_t *m, const char *body);
void loadgen_mix_free(loadgen_mix_t *m);
/* The entry of request i (0, 1, ...): a draw in proportion to the weights,
 * the same for the same seed and i. */
int loadgen_mix_pick(const loadgen_mix_t *m, uint64_t seed, int i);

/* A trace: when each request came and what it asked for (the JSONL bench
 * writes per request, or lines {"t": seconds, "request": {body}}), with
 * the prefix tokens the daemon reported ("input_tokens", 0 when unknown). */
typedef struct loadgen_trace_item {
    double t;
    int entry; /* index into the mix read alongside */
    int input_tokens;
    int line; /* its line in the file: equal times keep the file's order */
} loadgen_trace_item_t;

/* Reads a trace into items (malloc'd, sorted by t) and its request bodies
 * into mix (one entry per distinct body). 0, or -1 after printing
 * "PATH:LINE: problem". */
int loadgen_trace_read(const char *path, loadgen_trace_item_t **items, int *n, loadgen_mix_t *mix);

#endif
