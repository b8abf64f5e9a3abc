/* The HTTP front: libmicrohttpd routes, OpenAI error shapes, auth, body
 * limits, strict request checks (framing, Host allow-list, Content-Type),
 * connection deadlines and limits (server/conn_guard.h), an access log, SSE
 * streaming and disconnect detection. Each connection has its
 * own thread (MHD's thread-per-connection mode): a request thread waits on
 * its job and checks its socket while waiting, so a client that goes away
 * cancels its job. */
#ifndef ARSERVE_HTTP_H
#define ARSERVE_HTTP_H

#include <stddef.h>

#include "engine/model.h"
#include "engine/policy/kv_policy.h"
#include "server/api.h"
#include "server/metrics.h"
#include "server/scheduler.h"

typedef struct http_options {
    const char *host;
    int port;            /* 0: any free port */
    const char *api_key; /* "" or NULL: no auth */
    size_t max_body_bytes;
    int max_n;
    int max_connections;        /* open at once; the slowest are shed first */
    int max_connections_per_ip; /* 0: no limit */
    double header_timeout_s;    /* a request's headers, whole (and idle keep-alive) */
    double body_timeout_s;      /* a request's body, whole */
    /* How long a body that will be refused (413, or 400 on a route that
     * takes none) is read and thrown away before the answer; a client still
     * sending then is answered on the socket and cut. */
    double linger_s;
    /* A stream with nothing to say (queued, or between steps) sends an SSE
     * comment this often, so proxies and clients do not take it for dead. */
    double sse_keepalive_s;
    /* Host header names accepted (comma-separated, "*" any); NULL or "":
     * the loopback names when host is a loopback address, any otherwise. */
    const char *allowed_hosts;
    /* The names `model` may give, comma-separated, the first the id GET
     * /v1/models answers with; NULL or "": the model's own name. */
    const char *served_model_name;
    int metrics_auth; /* /metrics needs the API key too */
    int log_prompts;  /* the access log shows prompts */
    int retry_after_s;
    double request_timeout_s;
    double slo_s;             /* the latency objective of requests without deadline_ms; 0: none */
    int async_max_jobs;       /* the async job store's slots (server/job_store.h) */
    double async_retention_s; /* how long an ended async job is kept */
    /* KV policy of requests that name none, and the budget (0: each
     * policy's own) and knobs of those that do not give them. */
    kv_policy_params_t kv_defaults;
    /* Each policy's default budget range (server_config_kv_ranges); min 0: none. */
    kv_budget_range_t kv_ranges[KV_POLICY_COUNT];
} http_options_t;

typedef struct http_server http_server_t;

http_server_t *http_start(const http_options_t *opt, model_t *model, scheduler_t *sched,
                          metrics_t *metrics, ar_error_t *err);
/* The port actually bound (useful with port 0). */
int http_port(const http_server_t *h);
/* /ready answers 200 only when set (model loaded and not draining) and the
 * backend can run (sched_backend_unusable); /health, only while the engine
 * loop lives and the backend can run. */
void http_set_ready(http_server_t *h, int ready);
/* Requests being answered now (bodies read, responses not yet sent). */
int http_inflight(http_server_t *h);
void http_stop(http_server_t *h);

/* The API error a refused submission answers with: its status, code, the
 * field at fault and a message from why (a 429 tells to retry after
 * retry_after_s). The simulator answers its refusals with it too. */
void http_refusal_error(const sched_refusal_info_t *why, int n_images, int retry_after_s,
                        api_error_t *e);

#endif
