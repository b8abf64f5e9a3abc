/* The daemon's settings (`arserve serve`). Each one is a command-line flag, an
 * ARSERVE_* environment variable and a key in a JSON config file, all derived
 * from one table in config.c: --kv-pool-mb <-> ARSERVE_KV_POOL_MB <-> "kv_pool_mb". */
#ifndef ARSERVE_SERVER_CONFIG_H
#define ARSERVE_SERVER_CONFIG_H

#include <stdio.h>

#include "base/status.h"
#include "engine/backend/backend.h"
#include "engine/policy/kv_policy.h"

/* The field names are the JSON keys. */
typedef struct server_config {
    char model[1024];        /* model directory, as given (relative to the working directory);
                                "" = the shipped one (cli_default_model) */
    char host[256];          /* address to bind */
    int port;                /* 0 = the kernel picks a free port */
    char api_key_file[1024]; /* "" = none */
    int max_running;         /* images generating at once */
    int max_waiting;         /* queued requests before 429 */
    int request_timeout_s;   /* per-request deadline */
    int slo_p99_ms;          /* latency objective of requests without deadline_ms; 0: none */
    int drain_timeout_s;     /* grace for running requests after SIGTERM/SIGINT */
    int async_max_jobs;      /* async jobs kept at once, pending or ended */
    int async_retention_s;   /* how long an ended async job is kept */
    int max_body_bytes;      /* request bodies above this get 413 */
    int max_n;               /* most images per request */
    int kv_pool_mb;          /* KV cache pool, MiB; 0: auto (daemon.c's kv_pool_auto) */
    double kv_pool_share;    /* of the free memory, for kv_pool_mb auto */
    int status_interval_s;   /* a status line while busy this often; 0: none */
    char kv_policy[16];      /* KV policy of requests that name none */
    char kv_dtype[8];        /* "auto" (the weights' type), "f32", "bf16", "f16" or "fp8" */
    /* The KV defaults of requests: kv.budget is the key kv_budget (0: each
     * policy's own), every knob of KV_POLICY_KNOBS is a key of its own
     * name; kv.kind is not a setting (server_config_kv_defaults). */
    kv_policy_params_t kv;
    /* The floor of the default policy's budget range (elastic budgets),
     * up to kv.budget; 0: none, its budget is fixed. */
    double kv_budget_min;
    /* Each other policy's default budget range, "POLICY=MIN[:MAX],...",
     * for the requests that run POLICY without kv_budget
     * (server_config_kv_ranges); "": none. */
    char kv_budget_ranges[256];
    int threads;           /* engine CPU threads, 0 = the cores less draw_threads */
    int draw_threads;      /* the image decoder's CPU threads */
    int png_workers;       /* PNG encoder threads */
    char cost_table[1024]; /* the engine's starting cost table (a file), "" = the default */
    char cost_learning[4]; /* "on": the engine fits its cost table from its own iterations */
    char log_level[8];     /* "error", "warn", "info" or "debug" */
    char backend[8];       /* one of backend_names (engine/backend/backend.h) */
    int retry_after_s;     /* Retry-After on 429 */
    /* Connections (server/conn_guard.h) and request checks (server/http.h). */
    int max_connections;        /* 0 = max_waiting + max_running + 64 */
    int max_connections_per_ip; /* 0 = no limit */
    int header_timeout_s;
    int body_timeout_s;
    int linger_s;                /* how long a refused body is read and thrown away */
    double sse_keepalive_s;      /* a stream with nothing to say sends a comment this often */
    char allowed_hosts[1024];    /* "" = loopback names when bound to loopback, else any */
    char served_model_name[512]; /* "" = the model's name; else comma-separated, the first the id */
    char metrics_auth[4];        /* "on": /metrics needs the key */
    char log_prompts[4];         /* "on": the access log shows prompts */
    char check_weights[4];       /* "on": every weight must be finite at load */
    char batch_invariant[4];     /* "on": a GEMM per sequence where rows depend on the batch */
    char gpu_activations[8];     /* backend_activations_names: "bf16" or "split" */
    char cpu_activations[8];     /* backend_cpu_activations_names: "f32" or "bf16" */
    char gpu_graphs[4];          /* backend_graphs_names: "on" or "off" */

    /* Derived, not settings of their own: */
    char config_path[1024]; /* the config file that was read, "" if none */
    char api_key[256];      /* from the key file or ARSERVE_API_KEY; "" = no auth */
} server_config_t;

/* 1 when an on/off setting's value is "on". */
int server_config_on(const char *value);
/* The index in names (NULL-terminated) of a checked choice setting's
 * value: backend_activations_names for gpu_activations, say. */
int server_config_choice(const char *value, const char *const *names);

/* Connections open at once: max_connections, or its derived default. */
int server_config_max_connections(const server_config_t *c);

/* Fills every setting with its built-in default (api_key and config_path empty). */
void server_config_defaults(server_config_t *c);

/* Sets c to the defaults, then applies, each overriding the last:
 *   1. the JSON config file named by --config FILE or else ARSERVE_CONFIG (an
 *      empty name means none); a flat object whose keys are the settings;
 *   2. envp (NULL-terminated "NAME=VALUE" strings, usually main's third
 *      argument; NULL = none): ARSERVE_<SETTING> for each setting;
 *   3. argv[1..argc-1] flags, "--flag value" or "--flag=value"; a repeated flag
 *      keeps its last value.
 * The API key: ARSERVE_API_KEY holds the key itself and stands at the
 * environment's rank: it overrides api_key_file from the config file, and
 * --api-key-file overrides it (both ARSERVE_API_KEY and ARSERVE_API_KEY_FILE
 * set is an error). An api_key_file left non-empty is then read; its
 * contents, without trailing whitespace, become api_key.
 * Errors name their source: "--port: 'abc' is not an integer",
 * "ARSERVE_PORT: 70000 is outside [0, 65535]", "config.json: unknown key
 * 'prot'", "config.json: 'port' must be an integer", "key.txt: API key file
 * is empty". Unknown flags and positional arguments are errors, and so is an
 * unknown ARSERVE_* variable, except ARSERVE_CONFIG, ARSERVE_API_KEY and
 * those read by tests and tools (ENV_NOT_SETTINGS in config.c; --help lists
 * them).
 * --help or -h anywhere sets *want_help (may be NULL) and returns AR_OK at
 * once, reading nothing else. Returns AR_OK, or AR_ERR with err filled and
 * c partly updated (do not use it). */
int server_config_load(server_config_t *c, int argc, char **argv, char **envp, int *want_help,
                       ar_error_t *err);

/* The default budget range of each policy (out[kind]; min 0: none): the
 * entries of kv_budget_ranges, and for the default kv_policy the range
 * kv_budget_min up to kv_budget. AR_ERR naming the key when kv_budget_ranges
 * is not a list of POLICY=MIN[:MAX] with 0 < MIN <= MAX <= 1, names a policy
 * twice or one that takes no budget, or names the default policy while
 * kv_budget_min gives its range too. */
int server_config_kv_ranges(const server_config_t *c, kv_budget_range_t out[KV_POLICY_COUNT],
                            ar_error_t *err);

/* The daemon's KV defaults as the API takes them (api_limits_t.kv_defaults):
 * c->kv with kind from kv_policy. */
void server_config_kv_defaults(const server_config_t *c, kv_policy_params_t *out);

/* Prints every setting: flag, value, help, range or choices, default and
 * environment variable; then the other variables. No "usage:" line. */
void server_config_usage(FILE *f);
/* How many settings --help files under no topic (0 when all have one); the
 * first's name into name. */
int server_config_ungrouped(char *name, size_t cap);

#endif
