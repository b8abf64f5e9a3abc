/* `arserve serve`: the daemon. Loads the model, starts the scheduler and the
 * HTTP front, logs what the KV pool admits, and drains on SIGTERM/SIGINT:
 * /ready turns 503, new requests get 503, running ones finish within the
 * drain timeout, then exit 0. A second signal exits at once. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#ifdef ARSERVE_JEMALLOC
#include <jemalloc/jemalloc.h>
#endif

#include "cli.h"
#include "engine/backend.h"
#include "engine/clock.h"
#include "engine/kv_policy.h"
#include "engine/model.h"
#include "engine/planner.h"
#include "server/api.h"
#include "server/backend_open.h"
#include "server/config.h"
#include "server/http.h"
#include "server/log.h"
#include "server/metrics.h"
#include "server/scheduler.h"

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

static volatile sig_atomic_t signals_seen;

static void on_signal(int sig) {
    (void)sig;
    signals_seen++;
}

static void sleep_ms(int ms) {
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

int cmd_serve(int argc, char **argv, char **envp) {
    server_config_t cfg;
    ar_error_t err = {{0}};
    int want_help = 0;
    if (server_config_load(&cfg, argc, argv, envp, &want_help, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 2;
    }
    if (want_help) {
        printf("usage: arserve serve [options]\n\n");
        server_config_usage(stdout);
        return 0;
    }
    if (!cfg.model[0] && cli_default_model(cfg.model, sizeof cfg.model))
        return 1;
    int lvl = log_level_parse(cfg.log_level);
    log_threshold = lvl < 0 ? LOG_INFO : (log_level_t)lvl;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    metrics_t *metrics = metrics_create();
    backend_t *be = backend_open(cfg.backend, cfg.threads, &err);
    if (!metrics || !be) {
        fprintf(stderr, "arserve serve: %s\n", be ? "out of memory" : err.msg);
        return 1;
    }
    double t0 = clock_now_s();
    model_t model;
    if (model_load(&model, cfg.model, be, &err) != AR_OK) {
        fprintf(stderr, "arserve serve: cannot load model: %s\n", err.msg);
        be->destroy(be);
        metrics_destroy(metrics);
        return 1;
    }
    log_msg(LOG_INFO,
            "model %s from %s: %dx%d images, %d image tokens, %.1f MB of weights, loaded in %.2f s",
            model.cfg.name, cfg.model, model_config_image_width(&model.cfg),
            model_config_image_height(&model.cfg),
            model.cfg.image.grid_height * model.cfg.image.grid_width, model.weight_bytes / 1e6,
            clock_now_s() - t0);

    size_t pool = (size_t)cfg.kv_pool_mb << 20;
    /* The default policy must suit the model: a config that cannot serve
     * its own defaults stops here, naming the keys, rather than failing
     * every request. Checked for a typical prompt (16 text tokens + BOS +
     * image-start), as the capacities logged below. */
    kv_policy_params_t kv_defaults, kv_default_run;
    server_config_kv_defaults(&cfg, &kv_defaults);
    {
        api_image_request_t none = {0};
        api_image_request_kv_params(&none, &kv_defaults, &kv_default_run);
        kv_geometry_t g = planner_geometry(&model.cfg, 16 + 2);
        const char *field = NULL;
        if (kv_policy_check(&kv_default_run, &g, &field, &err) != AR_OK) {
            fprintf(stderr,
                    "arserve serve: kv_policy %s (kv_budget %g%s) does not suit model %s: %s: %s\n",
                    kv_policy_name(kv_default_run.kind), kv_default_run.budget,
                    kv_defaults.budget > 0 ? "" : ", the policy's own", model.cfg.name,
                    field && strcmp(field, "budget") ? field : "kv_budget", err.msg);
            model_free(&model);
            be->destroy(be);
            metrics_destroy(metrics);
            return 2;
        }
    }

    static const char *const build_labels[] = {"version", "backend", "model", "policy"};
    metric_t *build = metrics_gauge(metrics, "arserve_build_info",
                                    "Build and serving information (value 1).", 4, build_labels);
    metric_set(build, 1, ARSERVE_VERSION, be->name, model.cfg.name,
               kv_policy_name(kv_default_run.kind));
#ifdef ARSERVE_JEMALLOC
    metrics_gauge_fn(metrics, "arserve_jemalloc_allocated_bytes",
                     "Bytes allocated by the application (jemalloc stats.allocated).",
                     jemalloc_stat, (void *)"stats.allocated");
    metrics_gauge_fn(metrics, "arserve_jemalloc_resident_bytes",
                     "Bytes in physically resident data pages mapped by jemalloc (stats.resident).",
                     jemalloc_stat, (void *)"stats.resident");
#endif

    sched_options_t so = {.max_running = cfg.max_running,
                          .max_waiting = cfg.max_waiting,
                          .request_timeout_s = cfg.request_timeout_s,
                          .kv_pool_bytes = pool,
                          .png_workers = cfg.png_workers,
                          .retry_after_s = cfg.retry_after_s};
    scheduler_t *sched = scheduler_create(&model, &so, metrics, &err);
    if (!sched) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        return 1;
    }
    /* What the pool admits per policy at its default budget and knobs (the
     * config's), for a typical prompt (16 text tokens + BOS + image-start). */
    size_t capacity = sched_kv_capacity_bytes(sched);
    char per_policy[512] = "";
    for (int k = KV_POLICY_FULL; k <= KV_POLICY_HEADKV; k++) {
        kv_policy_params_t p;
        api_image_request_t ask = {.has_kv_policy = 1};
        snprintf(ask.kv_policy, sizeof ask.kv_policy, "%s", kv_policy_name((kv_policy_kind_t)k));
        api_image_request_kv_params(&ask, &kv_defaults, &p);
        size_t peak = sched_image_peak_bytes(sched, &p, 16 + 2);
        size_t len = strlen(per_policy);
        if (k == KV_POLICY_FULL)
            snprintf(per_policy + len, sizeof per_policy - len, "full %zu images",
                     peak ? capacity / peak : 0);
        else if (peak)
            snprintf(per_policy + len, sizeof per_policy - len, ", %s@%.3g %zu",
                     kv_policy_name(p.kind), p.budget, capacity / peak);
        else
            snprintf(per_policy + len, sizeof per_policy - len,
                     ", %s@%.3g n/a (budget too small for this grid)", kv_policy_name(p.kind),
                     p.budget);
    }
    log_msg(
        LOG_INFO,
        "backend %s (%d CPU threads, 0 = all cores); KV pool %.1f MiB in blocks of %d tokens: %s",
        be->name, cfg.threads, capacity / 1048576.0, sched_kv_block_tokens(sched), per_policy);
    log_msg(LOG_INFO, "requests without kv_policy run %s", kv_policy_name(kv_default_run.kind));
    http_options_t ho = {.host = cfg.host,
                         .port = cfg.port,
                         .api_key = cfg.api_key,
                         .max_body_bytes = (size_t)cfg.max_body_bytes,
                         .max_n = cfg.max_n,
                         .max_connections = cfg.max_waiting + cfg.max_running + 64,
                         .retry_after_s = cfg.retry_after_s,
                         .request_timeout_s = cfg.request_timeout_s,
                         .kv_defaults = kv_defaults};
    http_server_t *http = http_start(&ho, &model, sched, metrics, &err);
    if (!http) {
        fprintf(stderr, "arserve serve: %s\n", err.msg);
        scheduler_destroy(sched);
        return 1;
    }
    http_set_ready(http, 1);
    log_msg(LOG_INFO, "listening on http://%s:%d%s", cfg.host, http_port(http),
            cfg.api_key[0] ? " (API key required)" : "");
    /* A line tests and scripts can wait for. */
    fprintf(stdout, "arserve: ready on %s:%d\n", cfg.host, http_port(http));
    fflush(stdout);

    while (!signals_seen && sched_alive(sched))
        sleep_ms(100);
    int rc = 0;
    if (!sched_alive(sched)) {
        log_msg(LOG_ERROR, "the engine loop stopped; exiting");
        rc = 1;
    } else {
        log_msg(LOG_INFO, "draining: finishing %d request(s) within %d s", http_inflight(http),
                cfg.drain_timeout_s);
        http_set_ready(http, 0);
        sched_drain(sched);
        double deadline = clock_now_s() + cfg.drain_timeout_s;
        while (signals_seen < 2 && clock_now_s() < deadline &&
               (sched_active_jobs(sched) > 0 || http_inflight(http) > 0))
            sleep_ms(50);
        if (signals_seen >= 2) {
            log_msg(LOG_WARN, "second signal: exiting now");
            _exit(1);
        }
        if (sched_active_jobs(sched) > 0 || http_inflight(http) > 0) {
            log_msg(LOG_WARN, "drain timeout: %d request(s) cut off", http_inflight(http));
            rc = 0;
        }
    }
    scheduler_stop(sched);
    http_stop(http);
    scheduler_destroy(sched);
    model_free(&model);
    be->destroy(be);
    metrics_destroy(metrics);
    log_msg(LOG_INFO, "stopped");
    return rc;
}
