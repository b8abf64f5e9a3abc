/* Settings of `arserve serve` from defaults, a JSON file, the environment and
 * flags. SETTINGS below is the only place a setting is described; parsing,
 * validation, --help and the example config file are all driven by it. */
#include "server/config.h"

#include <assert.h>
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "base/text.h"
#include "engine/backend/backend.h"
#include "engine/format/json_strict.h"
#include "engine/planner.h"
#include "kernels/cpu/vec_isa.h"
#include "server/config_test.h"

typedef enum setting_kind { KIND_INT, KIND_REAL, KIND_STRING, KIND_ENUM } setting_kind_t;

/* One setting. name is the struct field and the JSON key; the flag (--name
 * with '-' for '_') and the variable (ARSERVE_NAME upper-cased) derive from it. */
typedef struct setting {
    const char *name;
    size_t offset, size; /* of the field in server_config_t */
    setting_kind_t kind;
    long long lo, hi, def; /* KIND_INT */
    int has_auto;          /* KIND_INT: "auto" is a value too, stored as 0 (lo > 0) */
    double rlo, rhi, rdef; /* KIND_REAL: [rlo, rhi], or (rlo, rhi] when lo_open */
    int lo_open;
    const char *def_str;        /* KIND_STRING, KIND_ENUM */
    const char *def_text;       /* KIND_STRING: what --help says an empty default means */
    const char *const *choices; /* KIND_ENUM, NULL-terminated */
    int may_be_empty;           /* KIND_STRING */
    const char *metavar, *help;
    /* What --help adds to help in parentheses, from the table that knows
     * it (kv_budget: each policy's own budget); NULL: nothing. */
    const char *(*help_list)(char *buf, size_t cap);
    /* KIND_STRING: what the value must also be (AR_ERR with a message that
     * the caller prefixes with where the value came from); NULL: any text. */
    int (*check)(const char *value, ar_error_t *err);
} setting_t;

#define FIELD(f)                                                                                   \
    .name = #f, .offset = offsetof(server_config_t, f), .size = sizeof(((server_config_t *)0)->f)
#define INT_SETTING(f, lo_, hi_, def_, mv, h)                                                      \
    {                                                                                              \
        FIELD(f), .kind = KIND_INT, .lo = (lo_), .hi = (hi_), .def = (def_), .metavar = (mv),      \
                  .help = (h)                                                                      \
    }
/* An integer setting that also takes "auto" (stored as 0, the default when
 * def_ is 0): the daemon works the value out (server_config.h says how). */
#define INT_AUTO_SETTING(f, lo_, hi_, def_, mv, h)                                                 \
    {                                                                                              \
        FIELD(f), .kind = KIND_INT, .lo = (lo_), .hi = (hi_), .def = (def_), .has_auto = 1,        \
                  .metavar = (mv), .help = (h)                                                     \
    }
/* A setting stored in a member of a member (kv.budget) under its own name. */
#define FIELD_AT(name_, member)                                                                    \
    .name = #name_, .offset = offsetof(server_config_t, member),                                   \
    .size = sizeof(((server_config_t *)0)->member)
/* The KV policy knobs, straight from KV_POLICY_KNOBS (engine/policy/kv_policy.h). */
#define KNOB_SETTING_INT(f, lo_, lo_open_, hi_, def_, h)                                           \
    {FIELD_AT(f, kv.f),                                                                            \
     .kind = KIND_INT,                                                                             \
     .lo = (long long)(lo_),                                                                       \
     .hi = (long long)(hi_),                                                                       \
     .def = (long long)(def_),                                                                     \
     .metavar = "N",                                                                               \
     .help = (h)},
#define KNOB_SETTING_REAL(f, lo_, lo_open_, hi_, def_, h)                                          \
    {FIELD_AT(f, kv.f), .kind = KIND_REAL,     .rlo = (lo_),   .rhi = (hi_),                       \
     .rdef = (def_),    .lo_open = (lo_open_), .metavar = "X", .help = (h)},
#define KNOB_SETTING(f, policy, type, ...) KNOB_SETTING_##type(f, __VA_ARGS__)
#define STRING_SETTING(f, def_, empty_ok, mv, h)                                                   \
    {                                                                                              \
        FIELD(f), .kind = KIND_STRING, .def_str = (def_), .may_be_empty = (empty_ok),              \
                  .metavar = (mv), .help = (h)                                                     \
    }
#define ENUM_SETTING(f, def_, choices_, mv, h)                                                     \
    {                                                                                              \
        FIELD(f), .kind = KIND_ENUM, .def_str = (def_), .choices = (choices_), .metavar = (mv),    \
                  .help = (h)                                                                      \
    }

/* "auto: cuda when built in and a GPU is present, else cpu" */
static const char *backend_auto_help(char *buf, size_t cap) {
    char rule[256];
    snprintf(buf, cap, "%s: %s", BACKEND_AUTO, backend_auto_rule(rule, sizeof rule));
    return buf;
}

static const char *const LOG_LEVELS[] = {"error", "warn", "info", "debug", NULL};
static const char *const ON_OFF[] = {"off", "on", NULL};

/* Reads kv_budget_ranges' text into out[kind] (zeroed first): entries
 * POLICY=MIN[:MAX] joined by commas, spaces allowed around them. */
static int parse_kv_ranges(const char *text, kv_budget_range_t out[KV_POLICY_COUNT],
                           ar_error_t *err) {
    memset(out, 0, KV_POLICY_COUNT * sizeof *out);
    for (const char *p = text; *p;) {
        while (*p == ' ' || *p == ',')
            p++;
        if (!*p)
            break;
        const size_t n = strcspn(p, ",");
        char entry[64], names[160];
        if (n >= sizeof entry)
            return ar_errorf(err, "entry '%.*s...' is too long", 20, p);
        memcpy(entry, p, n);
        entry[n] = 0;
        p += n;
        for (size_t e = n; e > 0 && entry[e - 1] == ' '; e--)
            entry[e - 1] = 0;
        char *eq = strchr(entry, '=');
        if (!eq)
            return ar_errorf(err, "entry '%s' is not POLICY=MIN[:MAX]", entry);
        *eq = 0;
        const int kind = kv_policy_parse(entry);
        if (kind < 0)
            return ar_errorf(err, "'%s' is not a KV policy (%s)", entry,
                             kv_policy_list(names, sizeof names));
        if (kind == KV_POLICY_FULL)
            return ar_errorf(err, "full takes no budget, so it has no range");
        if (out[kind].min > 0)
            return ar_errorf(err, "%s is given twice", entry);
        char *colon = strchr(eq + 1, ':');
        if (colon)
            *colon = 0;
        double lo, hi = 0;
        if (text_parse_real(eq + 1, &lo) != NUMBER_OK ||
            (colon && text_parse_real(colon + 1, &hi) != NUMBER_OK))
            return ar_errorf(err, "%s's range is not MIN or MIN:MAX, numbers", entry);
        if (!(lo > 0 && lo <= 1) || (colon && !(hi > 0 && hi <= 1)))
            return ar_errorf(err, "%s's budgets must be in (0, 1]", entry);
        if (colon && lo > hi)
            return ar_errorf(err, "%s's MIN %g is above its MAX %g", entry, lo, hi);
        out[kind] = (kv_budget_range_t){lo, hi};
    }
    return AR_OK;
}

static int check_kv_ranges(const char *value, ar_error_t *err) {
    kv_budget_range_t ranges[KV_POLICY_COUNT];
    return parse_kv_ranges(value, ranges, err);
}

/* served_model_name: names of 1 to 127 printable bytes, no spaces, joined
 * by commas. */
static int check_served_names(const char *value, ar_error_t *err) {
    for (const char *p = value; *p;) {
        const size_t n = strcspn(p, ",");
        if (n == 0 || n > 127)
            return ar_errorf(err, "'%s': each name has 1 to 127 bytes, the names joined by commas",
                             value);
        for (size_t i = 0; i < n; i++)
            if (p[i] <= ' ' || p[i] > '~')
                return ar_errorf(err, "'%s': a name has printable characters and no spaces", value);
        p += n + (p[n] == ',');
        if (p[-1] == ',' && !*p)
            return ar_errorf(err, "'%s' ends with a comma", value);
    }
    return AR_OK;
}

static const setting_t SETTINGS[] = {
    {FIELD(model), .kind = KIND_STRING, .def_str = "", .may_be_empty = 1, .metavar = "DIR",
     .def_text = "the shipped demo model",
     .help = "Model directory (arserve.json, weights, tokenizer.json); empty: the shipped demo "
             "model, ../models/shapes or models/shapes from arserve's folder"},
    STRING_SETTING(host, "127.0.0.1", 0, "HOST",
                   "Address to listen on; 0.0.0.0 listens on every interface"),
    INT_SETTING(port, 0, 65535, 8080, "PORT", "TCP port to listen on; 0 picks a free one"),
    STRING_SETTING(api_key_file, "", 0, "FILE",
                   "File holding the API key clients must send as 'Authorization: Bearer KEY', "
                   "trailing whitespace trimmed; left out: no key unless ARSERVE_API_KEY is set "
                   "(an empty value is an error, not 'no key')"),
    INT_SETTING(max_running, 1, 4096, 64, "N", "Images generating at once"),
    INT_SETTING(slo_p99_ms, 0, 86400000, 0, "MS",
                "Latency objective: each request's images done within this many ms of its "
                "arrival (a request's 'deadline_ms' overrides it); admission then also prices "
                "time by the engine's learned cost table, admitting a request at the largest KV "
                "budget of its range that keeps its objective and every running request's, "
                "waiting otherwise, and refusing (429) one that could not keep it even alone "
                "(docs/capacity.md); 0: none, admission by memory only"),
    INT_SETTING(max_waiting, 0, 100000, 256, "N",
                "Requests waiting for a slot; beyond this new requests get 429; 0: no queue, a "
                "request starts at the next engine iteration (a slot and its whole KV free "
                "now) or gets 429"),
    INT_SETTING(request_timeout_s, 1, 86400, 600, "SECONDS",
                "Deadline for one request, waiting included"),
    INT_SETTING(drain_timeout_s, 0, 3600, 30, "SECONDS",
                "After SIGTERM or SIGINT, how long running requests may take to finish"),
    INT_SETTING(async_max_jobs, 1, 65536, 256, "N",
                "Async jobs (\"async\": true) kept at once, waiting, running or ended and not yet "
                "forgotten; past it a new async job gets 429"),
    INT_SETTING(async_retention_s, 1, 86400, 300, "SECONDS",
                "How long an ended async job (its images or its error) is kept for GET "
                "/v1/images/jobs/ID; then it is forgotten (404)"),
    INT_SETTING(max_body_bytes, 1024, 64 << 20, 1 << 20, "BYTES",
                "Largest request body accepted; larger ones get 413"),
    INT_SETTING(max_n, 1, 64, 4, "N", "Most images one request may ask for ('n')"),
    INT_AUTO_SETTING(kv_pool_mb, 1, 1048576, 0, "MIB|auto",
                     "KV cache pool size in MiB; auto: --kv-pool-share of the memory free once "
                     "the model is loaded (on the CPU, available RAM within the process's "
                     "cgroup limit; on a GPU, device memory), on the CPU at most what "
                     "--max-running full-cache images of the default size need; the start-up "
                     "log says what it chose and why"),
    {FIELD(kv_pool_share), .kind = KIND_REAL, .rlo = 0, .rhi = 1, .rdef = 0.9, .lo_open = 1,
     .metavar = "S",
     .help = "Share of the free memory --kv-pool-mb auto gives the KV pool (as vLLM's "
             "--gpu-memory-utilization, but of what is free after the weights); the rest is "
             "left to activations, the image decoder and other processes"},
    ENUM_SETTING(kv_dtype, "auto", planner_kv_dtype_settings, "TYPE",
                 "Type the KV cache stores K and V in (attention computes in f32): auto, the "
                 "weights' type (bf16 for real checkpoints, f32 for f32 weights); fp8 is e4m3, "
                 "scaled per layer and head by the model's kv_scales.json when it has one "
                 "(docs/kv-cache.md)"),
    ENUM_SETTING(kv_policy, "full", kv_policy_names, "NAME",
                 "KV cache policy of requests without 'kv_policy' (docs/kv-policies.md)"),
    {FIELD_AT(kv_budget, kv.budget), .kind = KIND_REAL, .rlo = 0, .rhi = 1, .rdef = 0,
     .metavar = "B",
     .help = "KV budget of requests without 'kv_budget', as a fraction of the full cache "
             "(0.25 or 1/4); 0: each policy's own",
     .help_list = kv_policy_budget_list},
    {FIELD(kv_budget_min), .kind = KIND_REAL, .rlo = 0, .rhi = 1, .rdef = 0, .metavar = "B",
     .help = "Elastic budgets: requests that run kv_policy (named or by default) without "
             "'kv_budget' or 'kv_budget_min' run it with a budget range from this up to "
             "kv_budget (or the policy's own), admitted at the largest budget of it that fits "
             "the KV pool; 0: none (docs/kv-policies.md)"},
    {FIELD(kv_budget_ranges), .kind = KIND_STRING, .def_str = "", .may_be_empty = 1,
     .metavar = "LIST", .check = check_kv_ranges,
     .help = "Elastic budgets per policy: POLICY=MIN[:MAX] entries joined by commas "
             "(heatkv=0.25,scalekv=0.1:0.5); a request that runs POLICY without 'kv_budget' "
             "runs it with that range, or from its own 'kv_budget_min' up to MAX (left out: "
             "kv_budget or the policy's own budget); the default kv_policy's range is "
             "kv_budget_min's; \"\": none"},
    /* Each knob's default for requests of its policy that do not give it. */
    KV_POLICY_KNOBS(KNOB_SETTING)
        INT_SETTING(threads, 0, 1024, 0, "N",
                    "Engine CPU threads; 0: the cores this process may use less --draw-threads "
                    "(at least 1)"),
    INT_SETTING(draw_threads, 1, 1024, 1, "N",
                "CPU threads of the image decoder, which draws finished images and previews "
                "beside the engine"),
    INT_SETTING(png_workers, 1, 64, 2, "N", "Threads encoding PNGs"),
    STRING_SETTING(cost_table, "", 0, "FILE",
                   "Cost table the engine starts from (`arserve bench --profile` writes one): "
                   "what an iteration costs, until the engine has fitted its own from its timed "
                   "iterations (GET /v1/capacity shows it); left out: a conservative default"),
    ENUM_SETTING(cost_learning, "on", ON_OFF, "on|off",
                 "The engine fits its cost table from its own timed iterations and images; off: "
                 "it keeps --cost-table's (without one, admission does not price time)"),
    ENUM_SETTING(log_level, "info", LOG_LEVELS, "LEVEL", "Log verbosity"),
    INT_SETTING(status_interval_s, 0, 86400, 10, "SECONDS",
                "While requests run or wait, one status line this often (at info): requests "
                "running and waiting, images and iterations per second, the KV pool's use; 0: "
                "none"),
    {FIELD(backend), .kind = KIND_ENUM, .def_str = BACKEND_AUTO, .choices = backend_names,
     .metavar = "NAME", .help = "Compute backend", .help_list = backend_auto_help},
    ENUM_SETTING(gpu_activations, "bf16", backend_activations_names, "MODE",
                 "GPU backends with 16-bit weights: bf16, activations rounded to the weights' "
                 "type for their GEMMs (fp32 accumulation, as GPU servers and transformers in "
                 "bf16 multiply); split, each activation as two 16-bit halves, within rounding of "
                 "the CPU at twice the GEMM work. The CPU computes in fp32 either way"),
    ENUM_SETTING(cpu_activations, "f32", backend_cpu_activations_names, "f32|bf16",
                 "The CPU backend with bf16 weights: f32, activations multiplied in fp32 (the "
                 "reference); bf16, rounded to bf16 for the Linear GEMMs as PyTorch's bf16 "
                 "autocast does, on AMX tiles where the CPU has them (several times the GEMM "
                 "speed there; docs/cpu-kernels.md gives the logit error)"),
    ENUM_SETTING(gpu_graphs, "on", backend_graphs_names, "on|off",
                 "GPU backends: each step (what is queued between two waits for the device) "
                 "captured into a CUDA graph and launched as one, with the step's host arrays in "
                 "one upload; off: every op's kernels launched as the op is called. The bytes "
                 "are the same either way"),
    ENUM_SETTING(batch_invariant, "off", ON_OFF, "on|off",
                 "Next-scale models: each image's Linears as GEMMs of their own, so its bytes do "
                 "not depend on what else runs in its step, at the cost of reading the weights "
                 "once per image (on CUDA); off: one GEMM over every image's rows. The CPU "
                 "backend is batch invariant either way"),
    INT_SETTING(retry_after_s, 1, 3600, 1, "SECONDS",
                "Retry-After header value sent with 429 responses"),
    INT_SETTING(max_connections, 0, 100000, 0, "N",
                "Connections open at once; past it the connection slowest at sending its "
                "request is cut (503) to make room; 0: max_waiting + max_running + 64"),
    INT_SETTING(max_connections_per_ip, 0, 100000, 128, "N",
                "Connections open at once from one client address, the slowest cut first; 0: "
                "no limit (behind a proxy every client has the proxy's address)"),
    INT_SETTING(header_timeout_s, 1, 3600, 10, "SECONDS",
                "Time a client has to send a request's headers, however slowly they trickle "
                "(also how long an idle keep-alive connection stays open)"),
    INT_SETTING(body_timeout_s, 1, 3600, 30, "SECONDS",
                "Time a client has to send a request's body"),
    INT_SETTING(linger_s, 1, 3600, 5, "SECONDS",
                "How long a body that will be refused (over --max-body-bytes, or on a route that "
                "takes none) is read and thrown away, so that a client still sending reads the "
                "answer rather than a reset; past it the answer is sent and the connection "
                "closed"),
    {FIELD(sse_keepalive_s), .kind = KIND_REAL, .rlo = 0.1, .rhi = 3600, .rdef = 2,
     .metavar = "SECONDS",
     .help = "A stream with nothing to say (queued behind other work, or between steps) sends "
             "an SSE comment this often, so that proxies and clients with an idle timeout "
             "keep it; the engine is looked at every 0.1 s"},
    {FIELD(served_model_name), .kind = KIND_STRING, .def_str = "", .may_be_empty = 1,
     .metavar = "NAMES", .check = check_served_names, .def_text = "the model's own name",
     .help = "The names a request's 'model' may give, comma-separated (clients that send "
             "'dall-e-3', say); the first is the id GET /v1/models answers with; \"\": the "
             "model's own name from its arserve.json"},
    {FIELD(allowed_hosts), .kind = KIND_STRING, .def_str = "", .may_be_empty = 1,
     .metavar = "NAMES", .def_text = "by --host, as said",
     .help = "Host header names served (comma-separated, port ignored, '*' any), against DNS "
             "rebinding; empty: localhost, 127.0.0.1 and [::1] when --host is a loopback "
             "address, any otherwise"},
    ENUM_SETTING(metrics_auth, "off", ON_OFF, "on|off", "/metrics needs the API key too"),
    ENUM_SETTING(log_prompts, "off", ON_OFF, "on|off",
                 "The access log (one line per request, at info) shows each prompt"),
    ENUM_SETTING(check_weights, "on", ON_OFF, "on|off",
                 "Check at load that every weight is finite, naming the first tensor that is "
                 "not; off saves a pass over the weights of a huge model"),
};
#define N_SETTINGS (sizeof SETTINGS / sizeof SETTINGS[0])

/* serve --help's topics, each setting under one (a KV knob under "KV
 * cache"), in the table's order within each; test_config checks that every
 * setting has one. */
static const char *const GROUP_MODEL[] = {"model",
                                          "backend",
                                          "threads",
                                          "draw_threads",
                                          "png_workers",
                                          "cost_table",
                                          "cost_learning",
                                          "gpu_activations",
                                          "cpu_activations",
                                          "gpu_graphs",
                                          "batch_invariant",
                                          "check_weights",
                                          NULL};
static const char *const GROUP_NETWORK[] = {"host",
                                            "port",
                                            "api_key_file",
                                            "allowed_hosts",
                                            "metrics_auth",
                                            "served_model_name",
                                            "max_connections",
                                            "max_connections_per_ip",
                                            "header_timeout_s",
                                            "body_timeout_s",
                                            "linger_s",
                                            "max_body_bytes",
                                            "sse_keepalive_s",
                                            NULL};
static const char *const GROUP_REQUESTS[] = {"max_running",    "max_waiting",
                                             "max_n",          "request_timeout_s",
                                             "slo_p99_ms",     "drain_timeout_s",
                                             "async_max_jobs", "async_retention_s",
                                             "retry_after_s",  NULL};
static const char *const GROUP_KV[] = {
    "kv_pool_mb", "kv_pool_share", "kv_dtype",         "kv_policy",
    "kv_budget",  "kv_budget_min", "kv_budget_ranges", NULL};
static const char *const GROUP_LOG[] = {"log_level", "log_prompts", "status_interval_s", NULL};
static const struct {
    const char *title;
    const char *const *names; /* NULL: the KV policy knobs */
} GROUPS[] = {
    {"The model and the compute", GROUP_MODEL},
    {"Listening, keys and connection limits", GROUP_NETWORK},
    {"Requests, queueing and draining", GROUP_REQUESTS},
    {"The KV cache", GROUP_KV},
    {"The KV policies' knobs (a request's own override them)", NULL},
    {"Logs", GROUP_LOG},
};
#define N_GROUPS (sizeof GROUPS / sizeof GROUPS[0])

static int is_knob(const setting_t *s) {
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        if (!strcmp(kv_policy_knobs[i].name, s->name))
            return 1;
    return 0;
}

/* The group of s: an index into GROUPS, or -1 (a table left behind). */
static int group_of(const setting_t *s) {
    for (size_t g = 0; g < N_GROUPS; g++) {
        if (!GROUPS[g].names) {
            if (is_knob(s))
                return (int)g;
            continue;
        }
        for (const char *const *n = GROUPS[g].names; *n; n++)
            if (!strcmp(*n, s->name))
                return (int)g;
    }
    return -1;
}

int server_config_ungrouped(char *name, size_t cap) {
    int n = 0;
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (group_of(&SETTINGS[i]) < 0 && n++ == 0)
            snprintf(name, cap, "%s", SETTINGS[i].name);
    return n;
}

/* ARSERVE_* variables that are not settings: read by tests and tools, so the
 * daemon must not reject an environment that carries them. */
static const char *const ENV_NOT_SETTINGS[] = {"ARSERVE_TINY_MODEL",
                                               "ARSERVE_SLOW_MODEL",
                                               "ARSERVE_VAR_MODEL",
                                               "ARSERVE_VAR_TINY_MODEL",
                                               "ARSERVE_GOLDEN_DIR",
                                               "ARSERVE_BIN",
                                               "ARSERVE_LEAKY_BIN",
                                               "ARSERVE_TEST_SPEED",
                                               "ARSERVE_SLOWLORIS_LIMIT",
                                               "ARSERVE_SLOWLORIS_ATTACKERS",
                                               "ARSERVE_SCREENSHOT",
                                               VEC_ISA_ENV,
                                               NULL};

#define ENV_PREFIX "ARSERVE_"
#define ENV_CONFIG "ARSERVE_CONFIG"
#define ENV_API_KEY "ARSERVE_API_KEY"
#define MAX_FILE_BYTES (1 << 20)

/* ---- names ------------------------------------------------------------ */

static const char *flag_name(const setting_t *s, char *buf, size_t n) {
    size_t i = 0;
    buf[i++] = '-';
    buf[i++] = '-';
    for (const char *p = s->name; *p && i + 1 < n; p++)
        buf[i++] = *p == '_' ? '-' : *p;
    buf[i] = 0;
    return buf;
}

static const char *env_name(const setting_t *s, char *buf, size_t n) {
    size_t i = strlen(ENV_PREFIX);
    memcpy(buf, ENV_PREFIX, i);
    for (const char *p = s->name; *p && i + 1 < n; p++)
        buf[i++] = (char)toupper((unsigned char)*p);
    buf[i] = 0;
    return buf;
}

static int *int_field(server_config_t *c, const setting_t *s) {
    return (int *)((char *)c + s->offset);
}
static const int *int_field_const(const server_config_t *c, const setting_t *s) {
    return (const int *)((const char *)c + s->offset);
}
static double *real_field(server_config_t *c, const setting_t *s) {
    return (double *)((char *)c + s->offset);
}
static const double *real_field_const(const server_config_t *c, const setting_t *s) {
    return (const double *)((const char *)c + s->offset);
}
static char *str_field(server_config_t *c, const setting_t *s) { return (char *)c + s->offset; }
static const char *str_field_const(const server_config_t *c, const setting_t *s) {
    return (const char *)c + s->offset;
}

/* Levenshtein distance, for "did you mean"; names are short. */
static int edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63)
        return 99;
    int row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = (int)j;
    for (size_t i = 1; i <= la; i++) {
        int diag = row[0];
        row[0] = (int)i;
        for (size_t j = 1; j <= lb; j++) {
            int up = row[j];
            int best = diag + (a[i - 1] != b[j - 1]);
            if (up + 1 < best)
                best = up + 1;
            if (row[j - 1] + 1 < best)
                best = row[j - 1] + 1;
            row[j] = best;
            diag = up;
        }
    }
    return row[lb];
}

typedef const char *(*name_fn)(const setting_t *, char *, size_t);

/* Appends " (did you mean 'X'?)" to err when a setting's name is close to got. */
static int suggest(ar_error_t *err, const char *got, name_fn name) {
    const char *best = NULL;
    char buf[128], best_buf[128];
    int best_d = 3; /* at most 2 edits */
    for (size_t i = 0; i < N_SETTINGS; i++) {
        int d = edit_distance(got, name(&SETTINGS[i], buf, sizeof buf));
        if (d < best_d) {
            best_d = d;
            best = strcpy(best_buf, buf);
        }
    }
    size_t len = strlen(err->msg);
    if (best)
        snprintf(err->msg + len, sizeof err->msg - len, " (did you mean '%s'?)", best);
    return AR_ERR;
}

static const char *json_name(const setting_t *s, char *buf, size_t n) {
    snprintf(buf, n, "%s", s->name);
    return buf;
}

static const setting_t *find_by(const char *got, name_fn name) {
    char buf[128];
    for (size_t i = 0; i < N_SETTINGS; i++)
        if (!strcmp(got, name(&SETTINGS[i], buf, sizeof buf)))
            return &SETTINGS[i];
    return NULL;
}

/* ---- values ----------------------------------------------------------- */

/* Where a value came from, for messages: a flag or variable name is its own
 * label ("--port: ..."); a file value reads "config.json: 'port' ...". */
typedef struct source {
    const char *file; /* NULL for a flag or a variable */
    const char *name; /* the flag, variable or key */
} source_t;

static int range_error(const source_t *src, const setting_t *s, const char *value,
                       ar_error_t *err) {
    const char *or_auto = s->has_auto ? " (or auto)" : "";
    if (src->file)
        return ar_errorf(err, "%s: '%s' is %s, outside [%lld, %lld]%s", src->file, src->name, value,
                         s->lo, s->hi, or_auto);
    return ar_errorf(err, "%s: %s is outside [%lld, %lld]%s", src->name, value, s->lo, s->hi,
                     or_auto);
}

static int set_int(server_config_t *c, const setting_t *s, const source_t *src, long long v,
                   ar_error_t *err) {
    if (v < s->lo || v > s->hi) {
        char text[32];
        snprintf(text, sizeof text, "%lld", v);
        return range_error(src, s, text, err);
    }
    *int_field(c, s) = (int)v;
    return AR_OK;
}

/* "[0, 1]" or "(0, 1]" */
static void real_range(const setting_t *s, char *buf, size_t n) {
    snprintf(buf, n, "%c%g, %g]", s->lo_open ? '(' : '[', s->rlo, s->rhi);
}

static int set_real(server_config_t *c, const setting_t *s, const source_t *src, double v,
                    ar_error_t *err) {
    int below = s->lo_open ? !(v > s->rlo) : !(v >= s->rlo);
    if (!isfinite(v) || below || v > s->rhi) {
        char range[64];
        real_range(s, range, sizeof range);
        if (src->file)
            return ar_errorf(err, "%s: '%s' is %g, outside %s", src->file, src->name, v, range);
        return ar_errorf(err, "%s: %g is outside %s", src->name, v, range);
    }
    *real_field(c, s) = v;
    return AR_OK;
}

static int set_string(server_config_t *c, const setting_t *s, const source_t *src, const char *v,
                      ar_error_t *err) {
    char where[160];
    if (src->file)
        snprintf(where, sizeof where, "%s: '%s'", src->file, src->name);
    else
        snprintf(where, sizeof where, "%s:", src->name);
    if (s->kind == KIND_ENUM) {
        for (const char *const *ch = s->choices; *ch; ch++)
            if (!strcmp(*ch, v)) {
                strcpy(str_field(c, s), v); /* fits: asserted in server_config_defaults */
                return AR_OK;
            }
        char list[128] = "";
        for (const char *const *ch = s->choices; *ch; ch++)
            snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s",
                     ch == s->choices ? "" : ", ", *ch);
        if (src->file)
            return ar_errorf(err, "%s is '%s', not one of %s", where, v, list);
        return ar_errorf(err, "%s '%s' is not one of %s", where, v, list);
    }
    if (!v[0] && !s->may_be_empty)
        return ar_errorf(err, "%s %s empty%s", where, src->file ? "is" : "value is",
                         !strcmp(s->name, "api_key_file")
                             ? " (leave it out to run without a key: an empty value does not "
                               "turn authentication off)"
                             : "");
    if (strlen(v) >= s->size)
        return ar_errorf(err, "%s %s longer than %zu bytes", where, src->file ? "is" : "value is",
                         s->size - 1);
    ar_error_t why;
    if (s->check && s->check(v, &why) != AR_OK)
        return ar_errorf(err, "%s %s", where, why.msg);
    strcpy(str_field(c, s), v);
    /* A key file named at a higher rank replaces a key from ARSERVE_API_KEY. */
    if (!strcmp(s->name, "api_key_file"))
        c->api_key[0] = 0;
    return AR_OK;
}

/* A value given as text: a flag or an environment variable. */
static int set_from_text(server_config_t *c, const setting_t *s, const source_t *src, const char *v,
                         ar_error_t *err) {
    if (s->kind == KIND_REAL) {
        double d;
        if (text_parse_real(v, &d) != NUMBER_OK)
            return ar_errorf(err, "%s: '%s' is not a number", src->name, v);
        return set_real(c, s, src, d, err);
    }
    if (s->kind != KIND_INT)
        return set_string(c, s, src, v, err);
    long long n = 0;
    if (s->has_auto && !strcmp(v, "auto")) {
        *int_field(c, s) = 0;
        return AR_OK;
    }
    switch (text_parse_int(v, &n)) {
    case NUMBER_OK:
        return set_int(c, s, src, n, err);
    case NUMBER_OVERFLOW:
        return range_error(src, s, v, err);
    default:
        return ar_errorf(err, "%s: '%s' is not an integer%s", src->name, v,
                         s->has_auto ? " or auto" : "");
    }
}

static int set_from_json(server_config_t *c, const setting_t *s, const source_t *src,
                         const cJSON *it, ar_error_t *err) {
    if (s->kind == KIND_INT) {
        double d = it->valuedouble;
        if (s->has_auto && cJSON_IsString(it) && !strcmp(it->valuestring, "auto")) {
            *int_field(c, s) = 0;
            return AR_OK;
        }
        if (!cJSON_IsNumber(it) || !isfinite(d) || floor(d) != d)
            return ar_errorf(err, "%s: '%s' must be an integer%s", src->file, src->name,
                             s->has_auto ? " or \"auto\"" : "");
        if (d < (double)s->lo || d > (double)s->hi) {
            char text[64];
            snprintf(text, sizeof text, fabs(d) < 1e15 ? "%.0f" : "%g", d);
            return range_error(src, s, text, err);
        }
        return set_int(c, s, src, (long long)d, err);
    }
    if (s->kind == KIND_REAL) {
        if (!cJSON_IsNumber(it))
            return ar_errorf(err, "%s: '%s' must be a number", src->file, src->name);
        return set_real(c, s, src, it->valuedouble, err);
    }
    if (!cJSON_IsString(it) || !it->valuestring)
        return ar_errorf(err, "%s: '%s' must be a string", src->file, src->name);
    return set_string(c, s, src, it->valuestring, err);
}

/* ---- sources ---------------------------------------------------------- */

/* 1-based line of the byte at `at` in text. */
static int line_of(const char *text, const char *at) {
    int line = 1;
    for (const char *p = text; p < at && *p; p++)
        line += *p == '\n';
    return line;
}

static int load_file(server_config_t *c, const char *path, ar_error_t *err) {
    size_t len;
    char *text = file_read_all(path, "config file", MAX_FILE_BYTES, &len, err);
    if (!text)
        return AR_ERR;
    int rc = AR_ERR;
    json_strict_fault_t fault;
    cJSON *root = json_parse_strict(text, len, JSON_STRICT_DEFAULT_DEPTH, &fault, NULL);
    if (!root) {
        ar_errorf(err, "%s: not valid JSON (line %d): %s", path, line_of(text, text + fault.offset),
                  fault.why);
        goto out;
    }
    if (!cJSON_IsObject(root)) {
        ar_errorf(err, "%s: the top level must be a JSON object", path);
        goto out;
    }
    for (const cJSON *it = root->child; it; it = it->next) {
        for (const cJSON *jt = it->next; jt; jt = jt->next)
            if (!strcmp(jt->string, it->string)) {
                ar_errorf(err, "%s: duplicate key '%s'", path, it->string);
                goto out;
            }
        const setting_t *s = find_by(it->string, json_name);
        if (!s) {
            ar_errorf(err, "%s: unknown key '%s'", path, it->string);
            if (!strcmp(it->string, "api_key"))
                snprintf(err->msg + strlen(err->msg), sizeof err->msg - strlen(err->msg),
                         " (keys do not go in config files: name a file with 'api_key_file')");
            else
                suggest(err, it->string, json_name);
            goto out;
        }
        source_t src = {path, it->string};
        if (set_from_json(c, s, &src, it, err))
            goto out;
    }
    rc = AR_OK;
out:
    cJSON_Delete(root);
    free(text);
    return rc;
}

/* Value of NAME in envp, or NULL. */
static const char *env_get(char **envp, const char *name) {
    size_t n = strlen(name);
    const char *found = NULL;
    for (char **e = envp; e && *e; e++)
        if (!strncmp(*e, name, n) && (*e)[n] == '=')
            found = *e + n + 1;
    return found;
}

static int load_env(server_config_t *c, char **envp, ar_error_t *err) {
    const char *key = env_get(envp, ENV_API_KEY);
    char fenv[128];
    if (key && env_get(envp, env_name(find_by("api_key_file", json_name), fenv, sizeof fenv)))
        return ar_errorf(err, "%s and %s are both set; use one", ENV_API_KEY, fenv);
    for (char **e = envp; e && *e; e++) {
        if (strncmp(*e, ENV_PREFIX, strlen(ENV_PREFIX)) != 0)
            continue;
        const char *eq = strchr(*e, '=');
        if (!eq)
            continue;
        char name[128];
        snprintf(name, sizeof name, "%.*s", (int)(eq - *e), *e);
        const char *value = eq + 1;
        int skip = !strcmp(name, ENV_CONFIG) || !strcmp(name, ENV_API_KEY);
        for (const char *const *a = ENV_NOT_SETTINGS; *a; a++)
            skip |= !strcmp(name, *a);
        if (skip)
            continue;
        const setting_t *s = find_by(name, env_name);
        if (!s) {
            ar_errorf(err, "unknown environment variable %s", name);
            return suggest(err, name, env_name);
        }
        source_t src = {NULL, name};
        if (set_from_text(c, s, &src, value, err))
            return AR_ERR;
    }
    if (key) {
        if (!key[0])
            return ar_errorf(err, "%s is set but empty", ENV_API_KEY);
        if (strlen(key) >= sizeof c->api_key)
            return ar_errorf(err, "%s is longer than %zu bytes", ENV_API_KEY,
                             sizeof c->api_key - 1);
        strcpy(c->api_key, key);
        c->api_key_file[0] = 0;
    }
    return AR_OK;
}

/* One parsed command-line item. */
enum { FLAG_HELP = -1, FLAG_CONFIG = -2 };
typedef struct flag {
    int index; /* into SETTINGS, or FLAG_HELP / FLAG_CONFIG */
    char name[128];
    const char *value;
} flag_t;

/* Parses argv[*i] (and its value, advancing *i). */
static int next_flag(int argc, char **argv, int *i, flag_t *f, ar_error_t *err) {
    const char *arg = argv[*i];
    f->value = NULL;
    if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
        f->index = FLAG_HELP;
        return AR_OK;
    }
    if (strncmp(arg, "--", 2) != 0 || !arg[2])
        return ar_errorf(err, "unexpected argument '%s' (options start with --)", arg);
    const char *eq = strchr(arg, '=');
    snprintf(f->name, sizeof f->name, "%.*s", (int)(eq ? eq - arg : (ptrdiff_t)strlen(arg)), arg);
    if (!strcmp(f->name, "--config")) {
        f->index = FLAG_CONFIG;
    } else {
        const setting_t *s = find_by(f->name, flag_name);
        if (!s) {
            ar_errorf(err, "unknown flag '%s'", f->name);
            return suggest(err, f->name, flag_name);
        }
        f->index = (int)(s - SETTINGS);
    }
    if (eq) {
        f->value = eq + 1;
    } else {
        /* "--host --port 80" is a forgotten value, not a host named "--port". */
        if (*i + 1 >= argc || !strncmp(argv[*i + 1], "--", 2))
            return ar_errorf(err, "%s: needs a value", f->name);
        f->value = argv[++*i];
    }
    return AR_OK;
}

static int load_key_file(server_config_t *c, ar_error_t *err) {
    const char *path = c->api_key_file;
    size_t len;
    char *text = file_read_all(path, "API key file", MAX_FILE_BYTES, &len, err);
    if (!text)
        return AR_ERR;
    while (len && isspace((unsigned char)text[len - 1]))
        text[--len] = 0;
    int rc = AR_ERR;
    if (!len)
        ar_errorf(err, "%s: API key file is empty", path);
    else if (strlen(text) != len)
        ar_errorf(err, "%s: API key file contains a NUL byte", path);
    else if (len >= sizeof c->api_key)
        ar_errorf(err, "%s: API key is longer than %zu bytes", path, sizeof c->api_key - 1);
    else {
        rc = AR_OK;
        for (size_t i = 0; i < len; i++)
            if (iscntrl((unsigned char)text[i]))
                rc = ar_errorf(err, "%s: API key contains a control character (several lines?)",
                               path);
        if (rc == AR_OK)
            strcpy(c->api_key, text);
    }
    free(text);
    return rc;
}

/* ---- public ----------------------------------------------------------- */

void server_config_defaults(server_config_t *c) {
    memset(c, 0, sizeof *c);
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const setting_t *s = &SETTINGS[i];
        if (s->kind == KIND_INT) {
            assert(s->size == sizeof(int));
            *int_field(c, s) = (int)s->def;
        } else if (s->kind == KIND_REAL) {
            assert(s->size == sizeof(double));
            *real_field(c, s) = s->rdef;
        } else {
            assert(strlen(s->def_str) < s->size);
            for (const char *const *ch = s->choices; ch && *ch; ch++)
                assert(strlen(*ch) < s->size);
            strcpy(str_field(c, s), s->def_str);
        }
    }
}

int server_config_load(server_config_t *c, int argc, char **argv, char **envp, int *want_help,
                       ar_error_t *err) {
    server_config_defaults(c);
    if (want_help)
        *want_help = 0;

    /* First pass over argv: --help wins over any mistake; find --config. */
    const char *config = env_get(envp, ENV_CONFIG);
    int bad = AR_OK;
    ar_error_t first = {{0}};
    for (int i = 1; i < argc; i++) {
        flag_t f;
        ar_error_t this_err;
        if (next_flag(argc, argv, &i, &f, &this_err)) {
            if (!bad)
                first = this_err;
            bad = AR_ERR;
            continue;
        }
        if (f.index == FLAG_HELP) {
            if (want_help)
                *want_help = 1;
            return AR_OK;
        }
        if (f.index == FLAG_CONFIG)
            config = f.value;
    }
    if (bad) {
        if (err)
            *err = first;
        return AR_ERR;
    }

    if (config && config[0]) {
        if (strlen(config) >= sizeof c->config_path)
            return ar_errorf(err, "config file name is longer than %zu bytes",
                             sizeof c->config_path - 1);
        strcpy(c->config_path, config);
        if (load_file(c, config, err))
            return AR_ERR;
    }
    if (load_env(c, envp, err))
        return AR_ERR;
    for (int i = 1; i < argc; i++) {
        flag_t f;
        if (next_flag(argc, argv, &i, &f, err))
            return AR_ERR;
        if (f.index < 0)
            continue;
        source_t src = {NULL, f.name};
        if (set_from_text(c, &SETTINGS[f.index], &src, f.value, err))
            return AR_ERR;
    }
    if (c->api_key_file[0] && load_key_file(c, err))
        return AR_ERR;
    kv_budget_range_t ranges[KV_POLICY_COUNT];
    return server_config_kv_ranges(c, ranges, err);
}

/* One setting's lines of --help. */
static void usage_setting(FILE *f, const setting_t *s) {
    char flag[128], env[128], left[160], text[1024], list[512];
    snprintf(left, sizeof left, "%s %s", flag_name(s, flag, sizeof flag), s->metavar);
    fprintf(f, "  %-29s env %s\n", left, env_name(s, env, sizeof env));
    int n = s->help_list
                ? snprintf(text, sizeof text, "%s (%s). ", s->help, s->help_list(list, sizeof list))
                : snprintf(text, sizeof text, "%s. ", s->help);
    if (s->kind == KIND_INT && s->has_auto && s->def == 0) {
        snprintf(text + n, sizeof text - n, "%lld..%lld or auto, default auto.", s->lo, s->hi);
    } else if (s->kind == KIND_INT) {
        snprintf(text + n, sizeof text - n, "%lld..%lld, default %lld.", s->lo, s->hi, s->def);
    } else if (s->kind == KIND_REAL) {
        char range[64];
        real_range(s, range, sizeof range);
        snprintf(text + n, sizeof text - n, "In %s, default %g.", range, s->rdef);
    } else if (s->kind == KIND_ENUM) {
        n += snprintf(text + n, sizeof text - n, "One of ");
        for (const char *const *ch = s->choices; *ch; ch++)
            n += snprintf(text + n, sizeof text - n, "%s%s", ch == s->choices ? "" : "|", *ch);
        snprintf(text + n, sizeof text - n, ", default %s.", s->def_str);
    } else {
        const char *def = s->def_str[0] ? s->def_str : s->def_text ? s->def_text : "none";
        snprintf(text + n, sizeof text - n, "Default%s %s.", def == s->def_text ? ":" : "", def);
    }
    text_print_wrapped(f, 6, 6, text);
}

void server_config_usage(FILE *f) {
    fprintf(f, "Every option is also an environment variable and a key of the JSON config\n"
               "file; a flag beats the environment, which beats the file.\n\n");
    fprintf(f, "  %-29s env %s\n", "--config FILE", ENV_CONFIG);
    text_print_wrapped(f, 6, 6,
                       "JSON config file, keys as in config/arserve.example.json; empty: none.");
    fprintf(f, "  -h, --help\n");
    text_print_wrapped(f, 6, 6, "Show this help.");
    for (size_t g = 0; g < N_GROUPS; g++) {
        fprintf(f, "\n%s:\n", GROUPS[g].title);
        for (size_t i = 0; i < N_SETTINGS; i++)
            if (group_of(&SETTINGS[i]) == (int)g)
                usage_setting(f, &SETTINGS[i]);
    }
    fprintf(f,
            "\nThe API key may also come from %s, the key itself, instead of a key\n"
            "file. Any other %s* variable that is not a setting above is an error.\n",
            ENV_API_KEY, ENV_PREFIX);
}

/* Appends to a growing buffer; on failure frees it and leaves NULL. */
static void append(char **buf, size_t *len, size_t *cap, const char *s) {
    if (!*buf)
        return;
    size_t n = strlen(s);
    if (*len + n + 1 > *cap) {
        size_t want = (*len + n + 1) * 2;
        char *grown = realloc(*buf, want);
        if (!grown) {
            free(*buf);
            *buf = NULL;
            return;
        }
        *buf = grown;
        *cap = want;
    }
    memcpy(*buf + *len, s, n + 1);
    *len += n;
}

/* Appends s as a JSON string literal. */
static void append_json_string(char **buf, size_t *len, size_t *cap, const char *s) {
    cJSON *item = cJSON_CreateString(s);
    char *lit = item ? cJSON_PrintUnformatted(item) : NULL;
    if (lit)
        append(buf, len, cap, lit);
    else {
        free(*buf);
        *buf = NULL;
    }
    cJSON_free(lit);
    cJSON_Delete(item);
}

char *server_config_to_json(const server_config_t *c, int redact) {
    size_t len = 0, cap = 1024;
    char *buf = malloc(cap), piece[192];
    if (buf)
        buf[0] = 0;
    append(&buf, &len, &cap, "{\n");
    for (size_t i = 0; i < N_SETTINGS; i++) {
        const setting_t *s = &SETTINGS[i];
        /* A setting that may not be empty and is (no key file) is left
         * out, so that the text loads back. */
        if (s->kind == KIND_STRING && !s->may_be_empty && !str_field_const(c, s)[0])
            continue;
        snprintf(piece, sizeof piece, "  \"%s\": ", s->name);
        append(&buf, &len, &cap, piece);
        if (s->kind == KIND_INT && s->has_auto && *int_field_const(c, s) == 0) {
            append(&buf, &len, &cap, "\"auto\"");
        } else if (s->kind == KIND_INT) {
            snprintf(piece, sizeof piece, "%d", *int_field_const(c, s));
            append(&buf, &len, &cap, piece);
        } else if (s->kind == KIND_REAL) {
            /* The shortest text that reads back as the same double. */
            double v = *real_field_const(c, s);
            for (int prec = 1; prec <= 17; prec++) {
                snprintf(piece, sizeof piece, "%.*g", prec, v);
                if (strtod(piece, NULL) == v)
                    break;
            }
            append(&buf, &len, &cap, piece);
        } else {
            append_json_string(&buf, &len, &cap, str_field_const(c, s));
        }
        append(&buf, &len, &cap, i + 1 < N_SETTINGS || redact ? ",\n" : "\n");
    }
    if (redact)
        append(&buf, &len, &cap,
               c->api_key[0] ? "  \"api_key\": \"<redacted>\"\n" : "  \"api_key\": \"\"\n");
    append(&buf, &len, &cap, "}\n");
    return buf;
}

int server_config_on(const char *value) { return !strcmp(value, "on"); }

int server_config_choice(const char *value, const char *const *names) {
    for (int i = 0; names[i]; i++)
        if (!strcmp(value, names[i]))
            return i;
    return 0;
}

int server_config_max_connections(const server_config_t *c) {
    return c->max_connections ? c->max_connections : c->max_waiting + c->max_running + 64;
}

void server_config_kv_defaults(const server_config_t *c, kv_policy_params_t *out) {
    *out = c->kv;
    int kind = kv_policy_parse(c->kv_policy);
    out->kind = kind < 0 ? KV_POLICY_FULL : (kv_policy_kind_t)kind;
}

int server_config_kv_ranges(const server_config_t *c, kv_budget_range_t out[KV_POLICY_COUNT],
                            ar_error_t *err) {
    ar_error_t why;
    if (parse_kv_ranges(c->kv_budget_ranges, out, &why) != AR_OK)
        return ar_errorf(err, "kv_budget_ranges: %s", why.msg);
    if (c->kv_budget_min <= 0)
        return AR_OK;
    const int def = kv_policy_parse(c->kv_policy);
    if (def < 0)
        return ar_errorf(err, "kv_policy '%s' is not a KV policy", c->kv_policy);
    if (out[def].min > 0)
        return ar_errorf(err,
                         "kv_budget_ranges names %s, the default kv_policy, whose range "
                         "kv_budget_min gives: give it in one of the two",
                         c->kv_policy);
    out[def] = (kv_budget_range_t){c->kv_budget_min, c->kv.budget};
    return AR_OK;
}
