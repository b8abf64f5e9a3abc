/* The daemon's life: start-up in order, a loop that waits for a signal,
 * the drain, and a shutdown that releases everything whatever happened. */
#include "server/daemon.h"

#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef ARSERVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "base/clock.h"
#include "base/memory.h"
#include "engine/backend/backend.h"
#include "engine/model.h"
#include "engine/model_family.h"
#include "engine/planner.h"
#include "engine/policy/kv_policy.h"
#include "kernels/cpu/gemm_amx.h"
#include "kernels/cpu/vec_isa.h"
#include "server/http.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/scheduler.h"

/* The prompt start-up checks and logs capacities for: 16 text tokens + BOS
 * + image-start, a typical request. */
#define TYPICAL_PROMPT_TOKENS (16 + 2)

#ifdef ARSERVE_JEMALLOC
/* Hand freed memory back to the OS while idle. */
const char *malloc_conf = "background_thread:true";

static double jemalloc_stat(void *arg) {
    uint64_t epoch = 1;
    size_t sz = sizeof epoch, v = 0, vsz = sizeof v;
    mallctl("epoch", &epoch, &sz, &epoch, sz);
    if (mallctl((const char *)arg, &v, &vsz, NULL, 0) != 0)
        return 0;
    return (double)v;
}
#endif

/* One stop can arrive as two signals a moment apart (`timeout` signals its
 * child and then its process group; a supervisor its child and its group):
 * a signal within SIGNAL_REPEAT_MS of the first counts with it, so only a
 * second signal sent on purpose cuts the drain short. */
#define SIGNAL_REPEAT_MS 250
static volatile sig_atomic_t signals_seen;
static volatile sig_atomic_t first_signal_ms; /* since install_signals, mod 2^32 */
static struct timespec signals_installed;

/* Milliseconds since install_signals, modulo 2^32 (differences of two are
 * right for 49 days, whenever they fall). */
static unsigned ms_since_install(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now); /* async-signal-safe */
    return (unsigned)((long long)(now.tv_sec - signals_installed.tv_sec) * 1000 +
                      (now.tv_nsec - signals_installed.tv_nsec) / 1000000);
}

static void on_signal(int sig) {
    (void)sig;
    const unsigned at = ms_since_install();
    if (signals_seen == 0) {
        first_signal_ms = (sig_atomic_t)at;
        signals_seen = 1;
    } else if (at - (unsigned)first_signal_ms >= SIGNAL_REPEAT_MS) {
        signals_seen = 2;
    }
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static void install_signals(void) {
    clock_gettime(CLOCK_MONOTONIC, &signals_installed);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGTERM);
    sigaddset(&sa.sa_mask, SIGINT);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

/* Everything the daemon holds; daemon_release frees what was made. */
typedef struct daemon {
    metrics_t *metrics;
    backend_t *be;
    model_t model;
    int model_loaded;
    scheduler_t *sched;
    http_server_t *http;
    kv_policy_params_t kv_defaults; /* the config's, for requests */
} daemon_t;

static void daemon_release(daemon_t *d) {
    if (d->sched)
        scheduler_stop(d->sched);
    http_stop(d->http);
    scheduler_destroy(d->sched);
    if (d->model_loaded)
        model_free(&d->model);
    if (d->be)
        d->be->destroy(d->be);
    metrics_destroy(d->metrics);
}

/* --cost-table FILE into *t: a table of the model's family (a raster
 * model's costs do not price a next-scale one's steps); AR_ERR said on
 * stderr, naming the file. */
static int load_cost_table(const daemon_t *d, const char *path, cost_table_t *t) {
    char why[512];
    if (cost_table_load(t, path, why, sizeof why) != 0) {
        fprintf(stderr, "arserve serve: --cost-table: %s\n", why);
        return AR_ERR;
    }
    const char *family = model_family_of(&d->model.cfg)->name;
    if (strcmp(t->family, family) != 0) {
        fprintf(stderr,
                "arserve serve: --cost-table: %s: a table of the %s family, and the model is "
                "of the %s family (profile this model: arserve bench --profile)\n",
                path, t->family, family);
        return AR_ERR;
    }
    return AR_OK;
}

/* The default policy must suit the model: a config that cannot serve its
 * own defaults stops here, naming the key, rather than failing every
 * request. */
static int check_default_policy(const daemon_t *d, kv_policy_params_t *run) {
    ar_error_t err = {{0}};
    const char *field = NULL;
    kv_geometry_t g;
    model_geometry(&d->model.cfg, TYPICAL_PROMPT_TOKENS, &g);
    if (kv_policy_resolve(&d->kv_defaults, NULL, run, NULL, &err) == AR_OK &&
        kv_policy_check(run, &g, &field, &err) == AR_OK)
        return AR_OK;
    fprintf(stderr, "arserve serve: kv_policy %s (kv_budget %g%s) does not suit model %s: %s: %s\n",
            kv_policy_name(run->kind), run->budget,
            d->kv_defaults.budget > 0 ? "" : ", the policy's own", d->model.cfg.name,
            field && strcmp(field, "budget") ? field : "kv_budget", err.msg);
    return AR_ERR;
}

/* Each default budget range (config kv_budget_ranges, and kv_budget_min
 * for the default policy) must be one its policy runs at on this model for
 * a typical prompt, both ends. Fills ranges. */
static int check_default_ranges(const daemon_t *d, const server_config_t *cfg,
                                kv_budget_range_t ranges[KV_POLICY_COUNT]) {
    ar_error_t err = {{0}};
    if (server_config_kv_ranges(cfg, ranges, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return AR_ERR;
    }
    kv_geometry_t g;
    model_geometry(&d->model.cfg, TYPICAL_PROMPT_TOKENS, &g);
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        const kv_budget_range_t *r = &ranges[k];
        if (r->min <= 0)
            continue;
        const kv_policy_overrides_t only_kind = {.has_kind = 1, .kind = (kv_policy_kind_t)k};
        kv_policy_params_t lo, hi = {0};
        if (kv_policy_resolve(&d->kv_defaults, &only_kind, &hi, NULL, &err) != AR_OK)
            goto bad;
        if (r->max > 0)
            hi.budget = r->max;
        lo = hi;
        lo.budget = r->min;
        if (!kv_policy_uses_budget(lo.kind, &g))
            ar_errorf(&err, "kv_policy %s takes no budget on this model", kv_policy_name(lo.kind));
        else if (r->min > hi.budget)
            ar_errorf(&err, "above %g, the range's top", hi.budget);
        else if (kv_policy_check(&lo, &g, NULL, &err) == AR_OK &&
                 kv_policy_check(&hi, &g, NULL, &err) == AR_OK)
            continue;
    bad:
        if (k == (int)d->kv_defaults.kind && cfg->kv_budget_min > 0)
            fprintf(stderr, "arserve serve: kv_budget_min %g does not suit model %s: %s\n", r->min,
                    d->model.cfg.name, err.msg);
        else
            fprintf(
                stderr, "arserve serve: kv_budget_ranges: %s=%g:%g does not suit model %s: %s\n",
                kv_policy_name((kv_policy_kind_t)k), r->min, hi.budget, d->model.cfg.name, err.msg);
        return AR_ERR;
    }
    return AR_OK;
}

/* --kv-pool-mb auto: the pool's bytes from the memory free now that the
 * model is loaded, and why, in words for the start-up log. On a device
 * backend, kv_pool_share of its reservation left after the weights (the
 * step's activations and the image decoder take theirs from the rest). On
 * the CPU, kv_pool_share of the RAM available within the cgroup's room, at
 * most what --max-running full-cache images of the default size need (a
 * larger pool would sit idle). At least 1 MiB. */
static size_t kv_pool_auto(const daemon_t *d, const server_config_t *cfg, dtype_t kv_dtype,
                           char *why, size_t cap) {
    const double mib = 1048576.0, share = cfg->kv_pool_share;
    backend_stats_t st = {0};
    if (d->be->stats)
        d->be->stats(d->be, &st);
    size_t bytes;
    if (st.device_reserved_bytes > 0) {
        const size_t left = st.device_reserved_bytes > st.device_peak_bytes
                                ? st.device_reserved_bytes - st.device_peak_bytes
                                : 0;
        bytes = (size_t)(share * (double)left);
        snprintf(why, cap, "%.3g%% of the %.0f MiB of device memory left after the weights",
                 100 * share, left / mib);
    } else {
        host_memory_t hm;
        const int read = host_memory_read(&hm) == 0;
        const size_t usable = read ? host_memory_usable(&hm) : 0;
        kv_policy_params_t full;
        kv_policy_defaults(&full, KV_POLICY_FULL);
        planner_plan_t plan = {0};
        ar_error_t err;
        const size_t image = planner_plan_dtype(&plan, &d->model.cfg, &full, TYPICAL_PROMPT_TOKENS,
                                                planner_block_tokens(&d->model.cfg),
                                                planner_kv_same(kv_dtype), NULL, &err) == AR_OK
                                 ? plan.peak_bytes
                                 : 0;
        planner_plan_free(&plan);
        const size_t need = image * (size_t)cfg->max_running;
        bytes = (size_t)(share * (double)usable);
        const char *whose = hm.cgroup_room < hm.available ? "the cgroup's room" : "available RAM";
        if (!read)
            snprintf(why, cap, "/proc/meminfo has no MemAvailable: the least pool");
        else if (need > 0 && need < bytes) {
            bytes = need;
            snprintf(why, cap,
                     "what --max-running %d full-cache images need (%.1f MiB each), under %.3g%% "
                     "of the %.0f MiB of %s",
                     cfg->max_running, image / mib, 100 * share, usable / mib, whose);
        } else {
            snprintf(why, cap, "%.3g%% of the %.0f MiB of %s", 100 * share, usable / mib, whose);
        }
    }
    return bytes > (1u << 20) ? bytes : (size_t)1 << 20;
}

/* --threads 0: the cores this process may run on, less the drawing
 * thread's, so that the engine's team and the image decoder never take
 * turns on one core (measured on 2 cores: 1 engine thread beside the
 * drawing one beat 2 at every concurrency). At least 1. */
/* The cores this process may run on. */
static int usable_cores(void) {
    cpu_set_t set;
    return sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set)
                                                       : (int)sysconf(_SC_NPROCESSORS_ONLN);
}

static int engine_threads(const server_config_t *cfg) {
    if (cfg->threads > 0)
        return cfg->threads;
    const int cores = usable_cores();
    return cores - cfg->draw_threads > 1 ? cores - cfg->draw_threads : 1;
}

/* A --threads that, with the drawing threads, asks for more cores than
 * there are: the engine's team then waits on the drawing thread's core
 * (measured on 2 cores, --threads 2: 0.69 images/s against 0.85 with 1 on the
 * mid-size model at one client). Said once at start. */
static void warn_oversubscribed(const server_config_t *cfg) {
    const int cores = usable_cores();
    if (cfg->threads > 0 && cfg->threads + cfg->draw_threads > cores)
        log_msg(LOG_WARN,
                "--threads %d and --draw-threads %d ask for more than the %d core(s) this process "
                "may use: the engine's threads will wait for the drawing ones' cores; --threads 0 "
                "takes the cores the drawing threads leave",
                cfg->threads, cfg->draw_threads, cores);
}

/* What the pool admits per policy at the config's budget and knobs, for a
 * typical prompt: n/a for a policy that does not run on the model's family
 * at all (HeatKV on a raster model, LineAR on a next-scale one), or whose
 * budget cannot hold what it must keep on this grid. */
static void log_capacity(const daemon_t *d, const server_config_t *cfg) {
    const size_t capacity = sched_kv_capacity_bytes(d->sched);
    kv_geometry_t g;
    model_geometry(&d->model.cfg, TYPICAL_PROMPT_TOKENS, &g);
    char per_policy[768] = "";
    for (int k = 0; k < KV_POLICY_COUNT; k++) {
        kv_policy_params_t p;
        kv_policy_overrides_t ask = {.has_kind = 1, .kind = (kv_policy_kind_t)k};
        if (kv_policy_resolve(&d->kv_defaults, &ask, &p, NULL, NULL) != AR_OK)
            continue;
        const size_t len = strlen(per_policy);
        if (!kv_policy_suits(p.kind, &g)) {
            snprintf(per_policy + len, sizeof per_policy - len,
                     ", %s n/a (does not apply to %s models)", kv_policy_name(p.kind),
                     model_family_of(&d->model.cfg)->models_name);
            continue;
        }
        const size_t peak = sched_image_peak_bytes(d->sched, &p, TYPICAL_PROMPT_TOKENS);
        if (k == KV_POLICY_FULL)
            snprintf(per_policy + len, sizeof per_policy - len, "full %zu images",
                     peak ? capacity / peak : 0);
        else if (peak && !kv_policy_uses_budget(p.kind, &g))
            snprintf(per_policy + len, sizeof per_policy - len, ", %s %zu", kv_policy_name(p.kind),
                     capacity / peak);
        else if (peak)
            snprintf(per_policy + len, sizeof per_policy - len, ", %s@%.3g %zu",
                     kv_policy_name(p.kind), p.budget, capacity / peak);
        else
            snprintf(per_policy + len, sizeof per_policy - len,
                     ", %s@%.3g n/a (budget too small for this grid)", kv_policy_name(p.kind),
                     p.budget);
    }
    log_msg(LOG_INFO,
            "backend %s (%s CPU kernels, %d engine CPU threads, %d drawing); KV pool %.1f MiB of "
            "%s K and V in blocks of %d tokens: %s",
            d->be->name, vec_isa_name(vec_isa()), engine_threads(cfg), cfg->draw_threads,
            capacity / 1048576.0, planner_kv_dtype_name(sched_kv_dtype(d->sched)),
            sched_kv_block_tokens(d->sched), per_policy);
    if (sched_kv_dtype(d->sched) == DTYPE_F8_E4M3)
        log_msg(LOG_INFO, "fp8 K and V scales: %s",
                d->model.fp8_scales.k_amax ? "per layer and head, from the model's " FP8_SCALES_FILE
                                           : "1 (the model has no " FP8_SCALES_FILE
                                             "; `arserve calibrate --kv-scales` measures them)");
}

static void register_info_metrics(daemon_t *d, const char *version, kv_policy_kind_t policy) {
    static const char *const labels[] = {"version", "backend", "model", "policy"};
    metric_t *build = metrics_gauge(d->metrics, "arserve_build_info",
                                    "Build and serving information (value 1).", 4, labels);
    metric_set(build, 1, version, d->be->name, d->model.cfg.name, kv_policy_name(policy));
#ifdef ARSERVE_JEMALLOC
    metrics_gauge_fn(d->metrics, "arserve_jemalloc_allocated_bytes",
                     "Bytes allocated by the application (jemalloc stats.allocated).",
                     jemalloc_stat, (void *)"stats.allocated");
    metrics_gauge_fn(d->metrics, "arserve_jemalloc_resident_bytes",
                     "Bytes in physically resident data pages mapped by jemalloc (stats.resident).",
                     jemalloc_stat, (void *)"stats.resident");
#endif
}

/* Loads the model and starts everything; 0, or the exit status. */
static int daemon_start(daemon_t *d, const server_config_t *cfg, const char *version) {
    ar_error_t err = {{0}};
    d->metrics = metrics_create();
    if (!d->metrics) {
        fprintf(stderr, "arserve serve: out of memory\n");
        return 1;
    }
    if (!(d->be = backend_open(cfg->backend, engine_threads(cfg), &err))) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 1;
    }
    d->be->batch_invariant = server_config_on(cfg->batch_invariant);
    d->be->activations = (backend_activations_t)server_config_choice(cfg->gpu_activations,
                                                                     backend_activations_names);
    d->be->cpu_activations = (backend_cpu_activations_t)server_config_choice(
        cfg->cpu_activations, backend_cpu_activations_names);
    d->be->graphs = (backend_graphs_t)server_config_choice(cfg->gpu_graphs, backend_graphs_names);
    const double t0 = clock_now_s();
    const unsigned load_flags = server_config_on(cfg->check_weights) ? 0 : MODEL_LOAD_UNCHECKED;
    if (model_load_with(&d->model, cfg->model, d->be, load_flags, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: cannot load model: %s\n", err.msg);
        return 1;
    }
    d->model_loaded = 1;
    log_msg(LOG_INFO,
            "model %s from %s: %dx%d images, %d image tokens, %.1f MB of weights, loaded in "
            "%.2f s",
            d->model.cfg.name, cfg->model, model_config_image_width(&d->model.cfg),
            model_config_image_height(&d->model.cfg), model_image_tokens(&d->model.cfg),
            d->model.weight_bytes / 1e6, clock_now_s() - t0);
    if (d->be->cpu_activations == CPU_ACTIVATIONS_BF16 && !strcmp(d->be->name, "cpu")) {
        if (d->model.weight_dtype != DTYPE_BF16)
            log_msg(LOG_WARN,
                    "cpu_activations bf16 changes nothing here: the model's weights are "
                    "%s, and bf16 arithmetic takes bf16 weights",
                    dtype_name(d->model.weight_dtype));
        else
            log_msg(LOG_INFO, "cpu_activations bf16: activations rounded to bf16, %s",
                    gemm_amx_usable() ? "the products on this CPU's AMX tiles"
                                      : "but this CPU has no AMX: the fp32 kernels multiply them");
    }
    server_config_kv_defaults(cfg, &d->kv_defaults);
    model_config_kv_card(&d->model.cfg, &d->kv_defaults);
    kv_policy_params_t run;
    kv_budget_range_t ranges[KV_POLICY_COUNT];
    if (check_default_policy(d, &run) != AR_OK || check_default_ranges(d, cfg, ranges) != AR_OK)
        return 2;
    register_info_metrics(d, version, run.kind);
    dtype_t kv_dtype;
    if (planner_kv_dtype_choose(cfg->kv_dtype, d->model.weight_dtype, &kv_dtype, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: --kv-dtype: %s\n", err.msg);
        return 2;
    }
    char pool_why[256] = "";
    const size_t pool_bytes = cfg->kv_pool_mb
                                  ? (size_t)cfg->kv_pool_mb << 20
                                  : kv_pool_auto(d, cfg, kv_dtype, pool_why, sizeof pool_why);
    cost_table_t costs;
    if (cfg->cost_table[0] && load_cost_table(d, cfg->cost_table, &costs) != AR_OK)
        return 2;
    sched_options_t so = {.max_running = cfg->max_running,
                          .max_waiting = cfg->max_waiting,
                          .kv_pool_bytes = pool_bytes,
                          .kv_dtype = kv_dtype,
                          .png_workers = cfg->png_workers,
                          .draw_threads = cfg->draw_threads,
                          .costs = cfg->cost_table[0] ? &costs : NULL,
                          .learn_costs = !strcmp(cfg->cost_learning, "on")};
    if (!(d->sched = scheduler_create(&d->model, &so, d->metrics, &err))) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 1;
    }
    if (pool_why[0])
        log_msg(LOG_INFO, "KV pool %.1f MiB (--kv-pool-mb auto): %s", pool_bytes / 1048576.0,
                pool_why);
    log_capacity(d, cfg);
    warn_oversubscribed(cfg);
    log_msg(LOG_INFO, "requests without kv_policy run %s", kv_policy_name(run.kind));
    http_options_t ho = {.host = cfg->host,
                         .port = cfg->port,
                         .api_key = cfg->api_key,
                         .max_body_bytes = (size_t)cfg->max_body_bytes,
                         .max_n = cfg->max_n,
                         .max_connections = server_config_max_connections(cfg),
                         .max_connections_per_ip = cfg->max_connections_per_ip,
                         .header_timeout_s = cfg->header_timeout_s,
                         .body_timeout_s = cfg->body_timeout_s,
                         .linger_s = cfg->linger_s,
                         .sse_keepalive_s = cfg->sse_keepalive_s,
                         .allowed_hosts = cfg->allowed_hosts,
                         .served_model_name = cfg->served_model_name,
                         .metrics_auth = server_config_on(cfg->metrics_auth),
                         .log_prompts = server_config_on(cfg->log_prompts),
                         .retry_after_s = cfg->retry_after_s,
                         .request_timeout_s = cfg->request_timeout_s,
                         .slo_s = cfg->slo_p99_ms / 1000.0,
                         .async_max_jobs = cfg->async_max_jobs,
                         .async_retention_s = cfg->async_retention_s,
                         .kv_defaults = d->kv_defaults};
    memcpy(ho.kv_ranges, ranges, sizeof ho.kv_ranges);
    if (!(d->http = http_start(&ho, &d->model, d->sched, d->metrics, &err))) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 1;
    }
    http_set_ready(d->http, 1);
    log_msg(LOG_INFO, "listening on http://%s:%d%s", cfg->host, http_port(d->http),
            cfg->api_key[0] ? " (API key required)" : "");
    if (!cfg->api_key[0] && strncmp(cfg->host, "127.", 4))
        log_msg(LOG_WARN,
                "listening on %s, beyond this machine, with no API key: anyone who can reach "
                "port %d can use it; set ARSERVE_API_KEY or --api-key-file",
                cfg->host, http_port(d->http));
    /* A line tests and scripts can wait for, with the playground's address
     * (a wildcard host's as this machine's loopback). */
    const int any = !strcmp(cfg->host, "0.0.0.0") || !strcmp(cfg->host, "::");
    const int v6 = !any && strchr(cfg->host, ':') != NULL;
    fprintf(stdout, "arserve: ready on %s:%d; the playground: http://%s%s%s:%d/\n", cfg->host,
            http_port(d->http), v6 ? "[" : "", any ? "localhost" : cfg->host, v6 ? "]" : "",
            http_port(d->http));
    fflush(stdout);
    return 0;
}

/* The status line, every cfg->status_interval_s while requests run or wait
 * (and once more after the last finishes): what the engine did since the
 * last line and the pool's use, as vLLM's periodic stats line says. */
typedef struct status_clock {
    double at;           /* when the last line (or the start) was */
    sched_status_t then; /* the counts then */
} status_clock_t;

static void status_tick(daemon_t *d, const server_config_t *cfg, status_clock_t *c) {
    const double now = clock_now_s(), dt = now - c->at;
    if (cfg->status_interval_s <= 0 || dt < cfg->status_interval_s)
        return;
    sched_status_t st;
    sched_status(d->sched, &st);
    const double images = st.images_done - c->then.images_done;
    const double steps = st.iterations - c->then.iterations;
    const double cap = (double)sched_kv_capacity_bytes(d->sched), mib = 1048576.0;
    if (st.running > 0 || st.waiting > 0 || steps > 0 || images > 0)
        log_msg(LOG_INFO,
                "status: %d running, %d waiting; %.0f images in %.0f s (%.2f/s), %.1f "
                "iterations/s; KV pool %.1f of %.1f MiB in use (%.1f%%), %.1f MiB planned",
                st.running, st.waiting, images, dt, images / dt, steps / dt, st.kv_used_bytes / mib,
                cap / mib, cap > 0 ? 100 * st.kv_used_bytes / cap : 0.0,
                st.kv_reserved_bytes / mib);
    c->at = now;
    c->then = st;
}

/* Waits for a signal, then drains; the exit status. */
static int daemon_serve(daemon_t *d, const server_config_t *cfg) {
    status_clock_t status = {.at = clock_now_s()};
    sched_status(d->sched, &status.then);
    while (!signals_seen && sched_alive(d->sched)) {
        sleep_ms(100);
        status_tick(d, cfg, &status);
    }
    if (!sched_alive(d->sched)) {
        log_msg(LOG_ERROR, "the engine loop stopped; exiting");
        return 1;
    }
    log_msg(LOG_INFO, "draining: finishing %d request(s) within %d s", http_inflight(d->http),
            cfg->drain_timeout_s);
    http_set_ready(d->http, 0);
    sched_drain(d->sched);
    const double deadline = clock_now_s() + cfg->drain_timeout_s;
    while (signals_seen < 2 && clock_now_s() < deadline &&
           (sched_active_jobs(d->sched) > 0 || http_inflight(d->http) > 0))
        sleep_ms(50);
    if (signals_seen >= 2) {
        log_msg(LOG_WARN, "second signal: exiting now");
        _exit(1);
    }
    if (sched_active_jobs(d->sched) > 0 || http_inflight(d->http) > 0)
        log_msg(LOG_WARN, "drain timeout: %d request(s) cut off", http_inflight(d->http));
    return 0;
}

int daemon_run(const server_config_t *cfg, const char *version) {
    int lvl = log_level_parse(cfg->log_level);
    log_threshold = lvl < 0 ? LOG_INFO : (log_level_t)lvl;
    install_signals();
    /* SIGTERM and SIGINT blocked while the threads start, which inherit the
     * mask: only this thread takes them, so the handler never runs beside
     * the loop that reads what it wrote. One that comes meanwhile waits. */
    sigset_t stops;
    sigemptyset(&stops);
    sigaddset(&stops, SIGTERM);
    sigaddset(&stops, SIGINT);
    pthread_sigmask(SIG_BLOCK, &stops, NULL);
    daemon_t d = {0};
    int rc = daemon_start(&d, cfg, version);
    pthread_sigmask(SIG_UNBLOCK, &stops, NULL);
    if (rc == 0)
        rc = daemon_serve(&d, cfg);
    daemon_release(&d);
    if (rc == 0)
        log_msg(LOG_INFO, "stopped");
    return rc;
}
