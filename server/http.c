/* Routes and request handling on libmicrohttpd. */
#include "server/http.h"

#include <arpa/inet.h>
#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "server/api.h"
#include "server/conn_guard.h"
#include "server/job_store.h"
#include "server/log.h"
#include "server/playground.h"

#define WAIT_SLICE_S 0.1
#define MAX_ALLOWED_HOSTS 16
/* The longest request target read, and the most query parameters: no route
 * takes any. libmicrohttpd 0.9.75 stores every query parameter as a record
 * in the connection's 32 KiB memory pool before any callback but the URI
 * log sees the request; a few hundred exhaust it, and the 431 it then
 * queues is lost (parse_initial_message_line's caller overwrites the state
 * it set) and the connection closes without a word. uri_logged answers 414
 * first. 8192 covers RFC 9112 3's recommended 8000-octet request line. */
#define MAX_TARGET_BYTES 8192
#define MAX_QUERY_PARAMS 64
/* Bytes of a path or method quoted in messages and the access log. */
#define QUOTE_BYTES 96
#define LOGGED_PROMPT_BYTES 200
#define GENERATE_ROUTE "/v1/images/generations"
/* GET (or DELETE) /v1/images/jobs/ID: the route's label is the pattern, so
 * that ids never become metric labels. */
#define JOBS_PREFIX "/v1/images/jobs/"
#define JOBS_ROUTE "/v1/images/jobs/{id}"
/* How long DELETE on a job that has not ended waits for it to end, so that
 * its answer usually says "cancelled" (the engine ends it at its next
 * iteration). */
#define CANCEL_WAIT_S 1.0
/* Defaults where http_options_t leaves the store's settings 0. */
#define DEFAULT_ASYNC_MAX_JOBS 256
#define DEFAULT_ASYNC_RETENTION_S 300.0

_Static_assert(API_MAX_PARTIAL_IMAGES <= SCHED_MAX_PARTIALS,
               "the scheduler keeps every preview a request may ask for");

struct http_server {
    struct MHD_Daemon *d;
    http_options_t opt;
    char api_key[256];
    char model_id[128]; /* the first served name */
    model_t *model;
    scheduler_t *sched;
    metrics_t *metrics;
    api_limits_t limits;
    api_model_card_t card; /* GET /v1/models */
    const char **words;    /* card.words, owned (the strings are the tokenizer's) */
    kv_geometry_t geom;    /* the card's */
    kv_geometry_t size_geoms[MODEL_MAX_SIZES]; /* the card's, one per size */
    int n_sizes;                               /* the model's image sizes, its default first */
    int widths[MODEL_MAX_SIZES], heights[MODEL_MAX_SIZES];
    atomic_int ready, inflight;
    metric_t *m_requests;
    metric_t *m_jobs; /* arserve_async_jobs{state}, counted at each scrape */
    job_store_t *jobs;
    conn_guard_t *guard;
    int any_host; /* no Host allow-list */
    int n_hosts;
    char hosts[MAX_ALLOWED_HOSTS][256]; /* lower case, without port */
};

/* Follows a body's top-level JSON array or object through its bytes as
 * they come (strings, escapes and brackets only), to find bytes after it. */
typedef struct value_tracker {
    int depth, in_string, escaped;
    int done; /* the value has closed */
} value_tracker_t;

/* Per-request state, from the request line to the later of the completion
 * notice and the end of its event stream; the last of them writes the
 * access log line and frees it. */
typedef struct conn {
    atomic_int refs;            /* the request, and its event stream while one runs */
    const char *route;          /* metric label */
    char path[QUOTE_BYTES + 4]; /* the path as sent, printable (quote_printable) */
    char method[24];            /* printable */
    char client[INET_ADDRSTRLEN];
    int nul_in_path; /* the path encodes a NUL (%00) */
    /* The request line as libmicrohttpd split it: the target as sent (in
     * its buffer, until it decodes it in place) and its length then. */
    const char *raw_target;
    size_t raw_target_len;
    const char *bad_line; /* what is malformed in the request line, or NULL */
    int started;          /* the access handler has seen it */
    double t0;
    char *body;
    size_t len, cap;
    size_t discarded;     /* body bytes read and thrown away */
    double linger_since;  /* when the first was, 0 before */
    int chunked;          /* the body comes in chunks (Transfer-Encoding: chunked) */
    value_tracker_t json; /* a chunked body's, through the bytes kept */
    int responded;
    int status;          /* answered with, 0 before */
    int close;           /* answer with Connection: close */
    int too_large;       /* the body passed the limit: discarded, 413 at the end */
    int unexpected_body; /* a body on a GET route: discarded, 400 at the end */
    int counted;         /* counted in inflight */
    int closed;          /* answered and shut by answer_and_close: end the connection */
    atomic_size_t bytes; /* response bytes written */
    char *prompt;        /* the prompt as logged (--log-prompts), or NULL */
    char job_id[JOB_STORE_ID_LEN + 1]; /* JOBS_ROUTE: the id in the path, "" if malformed */
    char location[64];                 /* a Location header to answer with, "" for none */
    int retry_after_s;                 /* a 429's Retry-After; 0: --retry-after-s */
} conn_t;

/* What a streaming response's reader needs. */
typedef struct sse {
    http_server_t *h;
    struct MHD_Connection *c;
    conn_t *cx;
    sched_job_t *job;
    int prompt_tokens;
    char warnings[JOB_STORE_WARNINGS_BYTES]; /* the request's, for its completed events */
    unsigned seen;                           /* the job's version last collected */
    int sent_steps, sent_partials, finished;
    int said_admitted; /* the progress event with the admitted budget went out */
    double last_write;
    char *pending;
    size_t pending_len, pending_off;
} sse_t;

#define PAGE_ROUTE "/"
#define CAPACITY_ROUTE "/v1/capacity"
static const char *const KNOWN_ROUTES[] = {PAGE_ROUTE,   "/health",      "/ready",       "/metrics",
                                           "/v1/models", CAPACITY_ROUTE, GENERATE_ROUTE, NULL};

static void count(http_server_t *h, conn_t *cx, int code) {
    char c[8];
    snprintf(c, sizeof c, "%d", code);
    metric_add(h->m_requests, 1, cx->route, c);
    cx->status = code;
}

/* in, up to a '?' when stop_at_query, as printable ASCII for messages and
 * logs: other bytes as %XX, cut to QUOTE_BYTES with "...". Error bodies
 * quote what a client sent only through this, so they stay valid UTF-8. */
static void quote_printable(char *out, size_t n, const char *in, int stop_at_query) {
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)in; *p; p++) {
        if (stop_at_query && *p == '?')
            break;
        if (o + 4 > n || o >= QUOTE_BYTES) {
            snprintf(out + (o + 4 > n ? n - 4 : o), 4, "...");
            return;
        }
        if (*p > 0x20 && *p < 0x7f) {
            out[o++] = (char)*p;
        } else {
            out[o++] = '%';
            out[o++] = hex[*p >> 4];
            out[o++] = hex[*p & 15];
        }
    }
    out[o] = 0;
}

/* The client's address, for the access log. */
static void note_client(conn_t *cx, struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CLIENT_ADDRESS);
    if (ci && ci->client_addr && ci->client_addr->sa_family == AF_INET)
        inet_ntop(AF_INET, &((const struct sockaddr_in *)ci->client_addr)->sin_addr, cx->client,
                  sizeof cx->client);
}

static conn_t *conn_new(void) {
    conn_t *cx = calloc(1, sizeof *cx);
    if (!cx)
        return NULL;
    atomic_init(&cx->refs, 1);
    cx->route = "other";
    cx->t0 = clock_now_s();
    return cx;
}

/* Drops one reference; the last writes the access log line and frees. The
 * polls of monitors and of an open playground tab (/metrics, /health and
 * /ready answered 2xx) are logged at debug, so that info shows requests. */
static void conn_release(conn_t *cx) {
    if (atomic_fetch_sub(&cx->refs, 1) != 1)
        return;
    char status[8] = "-";
    if (cx->status)
        snprintf(status, sizeof status, "%d", cx->status);
    const int poll = (!strcmp(cx->route, "/metrics") || !strcmp(cx->route, "/health") ||
                      !strcmp(cx->route, "/ready")) &&
                     cx->status >= 200 && cx->status < 300;
    log_msg(poll ? LOG_DEBUG : LOG_INFO, "access: %s %s %s %s %zu bytes %.3f s%s%s",
            cx->client[0] ? cx->client : "-", cx->method[0] ? cx->method : "-", cx->path, status,
            atomic_load(&cx->bytes), clock_now_s() - cx->t0, cx->prompt ? " prompt=" : "",
            cx->prompt ? cx->prompt : "");
    free(cx->prompt);
    free(cx->body);
    free(cx);
}

/* The playground page (GET /) may talk to this server's API and nothing
 * else. It is public (the API calls it makes carry the key); the Host
 * allow-list applies to it as to every route. */
static void add_page_headers(struct MHD_Response *r) {
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'none'; script-src 'unsafe-inline'; "
                            "style-src 'unsafe-inline'; img-src data:; connect-src 'self'; "
                            "base-uri 'none'; form-action 'none'; frame-ancestors 'none'");
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    MHD_add_response_header(r, "Referrer-Policy", "no-referrer");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
}

static enum MHD_Result send_buf(http_server_t *h, struct MHD_Connection *c, conn_t *cx, int code,
                                const char *type, void *buf, size_t len, int free_buf) {
    struct MHD_Response *r = MHD_create_response_from_buffer(
        len, buf, free_buf ? MHD_RESPMEM_MUST_FREE : MHD_RESPMEM_MUST_COPY);
    if (!r) {
        if (free_buf)
            free(buf);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    if (code == 429) {
        char ra[16];
        snprintf(ra, sizeof ra, "%d",
                 cx->retry_after_s > 0 ? cx->retry_after_s : h->opt.retry_after_s);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (cx->location[0])
        MHD_add_response_header(r, MHD_HTTP_HEADER_LOCATION, cx->location);
    if (code == 405) {
        const char *allow = !strcmp(cx->route, GENERATE_ROUTE) ? "POST"
                            : !strcmp(cx->route, JOBS_ROUTE)   ? "GET, HEAD, DELETE"
                                                               : "GET";
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    }
    if (code == 401)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    if (code == 200 && !strcmp(cx->route, PAGE_ROUTE))
        add_page_headers(r);
    if (cx->close)
        MHD_add_response_header(r, MHD_HTTP_HEADER_CONNECTION, "close");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)code, r);
    MHD_destroy_response(r);
    cx->responded = 1;
    count(h, cx, code);
    atomic_store(&cx->bytes, len);
    return ret;
}

static enum MHD_Result send_json(http_server_t *h, struct MHD_Connection *c, conn_t *cx, int code,
                                 char *json) {
    if (!json)
        return MHD_NO;
    return send_buf(h, c, cx, code, "application/json", json, strlen(json), 1);
}

static enum MHD_Result send_error(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                  const api_error_t *e) {
    return send_json(h, c, cx, e->status, api_error_json(e));
}

static enum MHD_Result fail(http_server_t *h, struct MHD_Connection *c, conn_t *cx, int status,
                            const char *param, const char *code, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));
static enum MHD_Result fail(http_server_t *h, struct MHD_Connection *c, conn_t *cx, int status,
                            const char *param, const char *code, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    api_error_t e;
    api_errorf(&e, status, param, code, "%s", msg);
    return send_error(h, c, cx, &e);
}

/* Set on a connection's thread (each connection has its own) once
 * answer_and_close has answered and shut it: libmicrohttpd's messages about
 * ending it ("Application reported internal error, closing connection.",
 * or the pool running out under a query arserve already refused) describe
 * no error, and mhd_log leaves them out. */
static _Thread_local int closed_by_us;

/* The connection this thread serves and its request's state, from the
 * request line on (uri_logged) until the request completes: for mhd_log,
 * which libmicrohttpd calls on the connection's own thread just before it
 * answers a request it refuses itself. */
static _Thread_local struct MHD_Connection *this_conn;
static _Thread_local conn_t *this_cx;

/* The body bytes a lingering close reads and throws away, per read. */
#define LINGER_READ_BYTES 65536

/* After an answer on the socket: what the client still sends is read and
 * thrown away until it stops (EOF), fails, or linger_s pass, so that a
 * client still sending reads the answer rather than a reset (nginx's
 * lingering close); the bytes are added to cx->discarded. */
static void linger_close(conn_t *cx, int fd, double linger_s) {
    char buf[LINGER_READ_BYTES];
    const double deadline = clock_now_s() + linger_s;
    for (double left; (left = deadline - clock_now_s()) > 0;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        const int r = poll(&p, 1, (int)(left * 1000) + 1);
        if (r < 0 && errno == EINTR)
            continue;
        if (r <= 0)
            break;
        const ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
        if (n < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
            continue;
        if (n <= 0)
            break;
        cx->discarded += (size_t)n;
    }
}

/* Shuts a connection's socket down once arserve has answered on it (sent
 * bytes) or decided to say nothing; the caller returns MHD_NO, which this
 * returns, so libmicrohttpd ends it. */
static enum MHD_Result shut_connection(const union MHD_ConnectionInfo *ci, conn_t *cx,
                                       size_t sent) {
    if (ci)
        shutdown(ci->connect_fd, SHUT_RDWR);
    cx->responded = 1;
    cx->closed = 1;
    atomic_store(&cx->bytes, sent);
    closed_by_us = 1;
    return MHD_NO;
}

/* Writes e as a whole HTTP response to c's socket and shuts the socket down,
 * for an answer libmicrohttpd cannot queue: it queues a response only once
 * the headers are in or the whole body is, and some requests must be
 * answered before (an over-long target, in the URI callback), in the
 * middle of a body whose end will not come, at once for a body declared too
 * large, or instead of libmicrohttpd's own HTML answer (mhd_log). As
 * conn_guard's cuts do. linger_s > 0: what the client still sends is read
 * and thrown away for up to that long first (linger_close). The caller ends
 * the connection: MHD_NO, which this returns, or for the URI callback
 * handle's check of cx->closed. */
static enum MHD_Result answer_and_close(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                        const api_error_t *e, double linger_s) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    char *body = api_error_json(e);
    const char *reason = MHD_get_reason_phrase_for((unsigned)e->status);
    size_t sent = 0;
    count(h, cx, e->status); /* before the client can read the answer and ask /metrics */
    if (ci && body) {
        size_t cap = strlen(body) + strlen(reason) + 128;
        char *resp = malloc(cap);
        int n = resp ? snprintf(resp, cap,
                                "HTTP/1.1 %d %s\r\nConnection: close\r\n"
                                "Content-Type: application/json\r\nContent-Length: %zu\r\n\r\n%s",
                                e->status, reason, strlen(body), body)
                     : -1;
        /* The socket's send buffer is empty (nothing else is being
         * answered on it), so a short answer goes at once. */
        ssize_t k = n > 0 ? send(ci->connect_fd, resp, (size_t)n, MSG_NOSIGNAL | MSG_DONTWAIT) : -1;
        sent = k > 0 ? (size_t)k : 0;
        free(resp);
    }
    if (ci && linger_s > 0) {
        shutdown(ci->connect_fd, SHUT_WR);
        linger_close(cx, ci->connect_fd, linger_s);
    }
    free(body);
    return shut_connection(ci, cx, sent);
}

/* ---- the scheduler's reasons as HTTP ---- */

/* The request field behind a setting kv_policy_check names. */
static const char *policy_param(const char *field) {
    if (!field)
        return "kv_policy";
    if (strcmp(field, "budget_min") == 0)
        return "kv_budget_min";
    return strcmp(field, "budget") == 0 ? "kv_budget" : field;
}

void http_refusal_error(const sched_refusal_info_t *why, int n_images, int retry_after_s,
                        api_error_t *e) {
    switch (why->reason) {
    case SCHED_REFUSED_INVALID_POLICY:
        api_errorf(e, 400, policy_param(why->field), "invalid_value", "%s", why->message);
        return;
    case SCHED_REFUSED_DRAINING:
        api_errorf(e, 503, NULL, "server_draining", "the server is shutting down");
        return;
    case SCHED_REFUSED_TOO_LARGE:
        /* One image too large for the whole pool: what makes it fit is a
         * compressed cache (or a larger pool), not fewer images. */
        if (n_images > 1)
            api_errorf(e, 400, "n", "kv_pool_too_small",
                       "this request needs %zu bytes of KV cache, more than the pool's %zu: ask "
                       "for fewer images (n), a shorter prompt or a compressed kv_policy",
                       why->need_bytes, why->pool_bytes);
        else
            api_errorf(e, 400, "kv_policy", "kv_pool_too_small",
                       "this image needs %zu bytes of KV cache, more than the pool's %zu: ask for "
                       "a compressed kv_policy with a kv_budget (GET /v1/models lists the "
                       "model's), or run the server with a larger kv_pool_mb",
                       why->need_bytes, why->pool_bytes);
        return;
    case SCHED_REFUSED_TOO_MANY_IMAGES:
        api_errorf(e, 400, "n", "too_many_images",
                   "n = %d is more than the %d images this server runs at once", n_images,
                   why->max_running);
        return;
    case SCHED_REFUSED_QUEUE_FULL:
        if (why->max_waiting == 0)
            api_errorf(e, 429, NULL, "queue_full",
                       "the request cannot start now (its images or its KV cache do not fit beside "
                       "the running ones) and this server keeps no waiting queue (max_waiting "
                       "0); retry after %d s",
                       retry_after_s);
        else
            api_errorf(e, 429, NULL, "queue_full",
                       "the waiting queue is full (%d requests); retry after %d s",
                       why->max_waiting, retry_after_s);
        snprintf(e->type, sizeof e->type, "rate_limit_error");
        return;
    case SCHED_REFUSED_OBJECTIVE:
        api_errorf(e, 429, NULL, "objective_unreachable",
                   "this request needs about %.0f ms even alone (the engine's learned cost "
                   "table), more than its latency objective of %.0f ms (deadline_ms, or the "
                   "server's slo_p99_ms): ask for a longer deadline_ms, a compressed kv_policy "
                   "or fewer images",
                   why->predicted_s * 1000, why->objective_s * 1000);
        snprintf(e->type, sizeof e->type, "rate_limit_error");
        return;
    case SCHED_REFUSED_NO_MEMORY:
        break;
    }
    api_errorf(e, 500, NULL, "internal_error", "the request could not be queued: %s", why->message);
}

/* A job that ended without its images. */
static void outcome_error(const sched_snapshot_t *snap, api_error_t *e) {
    switch (snap->outcome) {
    case SCHED_EXPIRED:
        api_errorf(e, 504, NULL, "timeout", "the request's deadline passed%s",
                   snap->started ? "" : " before it could start");
        return;
    case SCHED_CANCELLED:
        /* Only its own client cancels a job: nobody reads this answer. */
        api_errorf(e, 499, NULL, "cancelled", "the request was cancelled");
        return;
    case SCHED_SHUTDOWN:
        api_errorf(e, 503, NULL, "server_shutdown", "the server is shutting down");
        return;
    default:
        api_errorf(e, 500, NULL, "internal_error", "%s",
                   snap->message[0] ? snap->message : "internal error");
        return;
    }
}

/* Constant-time comparison of the presented bearer token with the key. */
static int auth_ok(const http_server_t *h, struct MHD_Connection *c) {
    if (!h->api_key[0])
        return 1;
    const char *hdr =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_AUTHORIZATION);
    if (!hdr || strncmp(hdr, "Bearer ", 7) != 0)
        return 0;
    const char *tok = hdr + 7;
    size_t a = strlen(tok), b = strlen(h->api_key);
    unsigned diff = (unsigned)(a ^ b);
    for (size_t i = 0; i < b; i++)
        diff |= (unsigned char)h->api_key[i] ^ (unsigned char)(i < a ? tok[i] : 0);
    return diff == 0;
}

/* 1 while the client's socket is open (a peek sees data or would block). */
static int client_alive(struct MHD_Connection *c) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    if (!ci)
        return 0;
    char b;
    ssize_t n = recv(ci->connect_fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
    if (n > 0)
        return 1;
    if (n == 0)
        return 0;
    return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
}

/* ---- streaming ---- */

/* Appends one frame of event with json (taken); -1 when memory runs out. */
static int sse_append(sse_t *s, const char *event, char *json) {
    if (!json)
        return -1;
    char *frame = api_sse_frame(event, json);
    free(json);
    if (!frame)
        return -1;
    size_t n = strlen(frame);
    char *p = realloc(s->pending, s->pending_len + n);
    if (!p) {
        free(frame);
        return -1;
    }
    memcpy(p + s->pending_len, frame, n);
    s->pending = p;
    s->pending_len += n;
    free(frame);
    return 0;
}

/* base64 of image i's PNG (preview p, or the final image when p < 0), or NULL. */
static char *png_b64(sched_job_t *j, int p, int i) {
    size_t len = 0;
    const uint8_t *png = p < 0 ? sched_job_png(j, i, &len) : sched_job_preview(j, p, i, &len);
    return png ? api_base64(png, len) : NULL;
}

/* What a finished job reports of its KV cache and timings. */
static void job_report(const sched_snapshot_t *snap, api_kv_report_t *kv, api_timings_t *t) {
    *kv = (api_kv_report_t){.policy = snap->kv_policy,
                            .planned_peak_bytes = snap->kv_planned_peak_bytes,
                            .peak_bytes = snap->kv_peak_bytes,
                            .budget_min = snap->kv_budget_min,
                            .budget_max = snap->kv_budget_max,
                            .admission = snap->admission,
                            .predicted_s = snap->predicted_s};
    *t = (api_timings_t){.queue_s = snap->queue_s,
                         .run_s = snap->run_s,
                         .steps = snap->steps_total,
                         .decode_png_s = snap->finish_s};
}

/* A progress event per image for the steps up to `steps`, unless they were
 * said already; -1 when it could not be made. */
static int sse_progress(sse_t *s, const sched_snapshot_t *snap, int steps) {
    if (steps <= s->sent_steps)
        return 0;
    for (int i = 0; i < snap->n_images; i++)
        if (sse_append(s, API_SSE_PROGRESS, api_sse_progress(steps, snap->steps_total, i)))
            return -1;
    s->sent_steps = steps;
    return 0;
}

/* Turns what changed in the job since the last call into frames. Returns 1
 * when the stream has said everything, 0 when more is to come, -1 when a
 * frame could not be made (out of memory): the stream then ends broken
 * rather than silently missing an event. */
static int sse_collect(sse_t *s, const sched_snapshot_t *snap) {
    sched_job_t *j = s->job;
    const long now = (long)time(NULL);
    const int W = snap->width, H = snap->height;
    /* Once admitted, before any step's progress: the budget it runs at. */
    for (int i = 0; snap->started && !s->said_admitted && i < snap->n_images; i++)
        if (sse_append(s, API_SSE_PROGRESS,
                       api_sse_progress_kv(s->sent_steps, snap->steps_total, i, &snap->kv_policy)))
            return -1;
    s->said_admitted |= snap->started;
    /* In step order, however many steps passed since the last call: each
     * preview after the progress up to its step, then the progress since. */
    for (; s->sent_partials < snap->n_partials; s->sent_partials++) {
        if (sse_progress(
                s, snap,
                sched_preview_step(snap->steps_total, snap->partial_images, s->sent_partials)))
            return -1;
        for (int i = 0; i < snap->n_images; i++) {
            char *b64 = png_b64(j, s->sent_partials, i);
            int rc = b64 ? sse_append(s, API_SSE_PARTIAL_IMAGE,
                                      api_sse_partial_image(b64, s->sent_partials, i, now, W, H))
                         : -1;
            free(b64);
            if (rc)
                return -1;
        }
    }
    if (sse_progress(s, snap, sched_reportable_steps(snap, s->sent_partials)))
        return -1;
    if (snap->outcome == SCHED_PENDING)
        return 0;
    if (snap->outcome == SCHED_DONE) {
        api_kv_report_t kv;
        api_timings_t timings;
        job_report(snap, &kv, &timings);
        for (int i = 0; i < snap->n_images; i++) {
            char *b64 = png_b64(j, -1, i);
            int rc =
                b64 ? sse_append(s, API_SSE_COMPLETED,
                                 api_sse_completed(b64, i, now, W, H, snap->image_tokens,
                                                   s->prompt_tokens, &kv, &timings, s->warnings))
                    : -1;
            free(b64);
            if (rc)
                return -1;
        }
        return 1;
    }
    api_error_t e;
    outcome_error(snap, &e);
    return sse_append(s, API_SSE_ERROR, api_error_json(&e)) ? -1 : 1;
}

static ssize_t sse_read(void *cls, uint64_t pos, char *buf, size_t max) {
    sse_t *s = cls;
    (void)pos;
    for (;;) {
        if (s->pending_off < s->pending_len) {
            size_t n = s->pending_len - s->pending_off;
            if (n > max)
                n = max;
            memcpy(buf, s->pending + s->pending_off, n);
            s->pending_off += n;
            if (s->pending_off == s->pending_len)
                s->pending_off = s->pending_len = 0;
            s->last_write = clock_now_s();
            atomic_fetch_add(&s->cx->bytes, n);
            return (ssize_t)n;
        }
        if (s->finished)
            return MHD_CONTENT_READER_END_OF_STREAM;
        sched_snapshot_t snap;
        sched_job_wait(s->job, s->seen, WAIT_SLICE_S, &snap);
        s->seen = snap.version;
        const int rc = sse_collect(s, &snap);
        if (rc < 0) {
            log_msg(LOG_ERROR, "job %llu: out of memory writing its event stream; ending it",
                    (unsigned long long)sched_job_id(s->job));
            return MHD_CONTENT_READER_END_WITH_ERROR;
        }
        s->finished = rc;
        if (s->pending_len == 0 && !s->finished) {
            if (!client_alive(s->c))
                return MHD_CONTENT_READER_END_WITH_ERROR;
            if (clock_now_s() - s->last_write > s->h->opt.sse_keepalive_s) {
                static const char ka[] = ": keep-alive\n\n";
                size_t n = sizeof ka - 1 < max ? sizeof ka - 1 : max;
                memcpy(buf, ka, n);
                s->last_write = clock_now_s();
                atomic_fetch_add(&s->cx->bytes, n);
                return (ssize_t)n;
            }
        }
    }
}

static void sse_free(void *cls) {
    sse_t *s = cls;
    sched_snapshot_t snap;
    sched_job_snapshot(s->job, &snap);
    if (snap.outcome == SCHED_PENDING) {
        log_msg(LOG_INFO, "job %llu: stream closed before the end; cancelling",
                (unsigned long long)sched_job_id(s->job));
        sched_job_cancel(s->h->sched, s->job);
    }
    sched_job_release(s->job);
    conn_release(s->cx);
    free(s->pending);
    free(s);
}

static enum MHD_Result respond_stream(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                      sched_job_t *j, int prompt_tokens, const char *warnings) {
    sse_t *s = calloc(1, sizeof *s);
    if (!s) {
        sched_job_cancel(h->sched, j);
        sched_job_release(j);
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory");
    }
    atomic_fetch_add(&cx->refs, 1);
    *s = (sse_t){.h = h,
                 .c = c,
                 .cx = cx,
                 .job = j,
                 .prompt_tokens = prompt_tokens,
                 .last_write = clock_now_s()};
    snprintf(s->warnings, sizeof s->warnings, "%s", warnings);
    struct MHD_Response *r =
        MHD_create_response_from_callback(MHD_SIZE_UNKNOWN, 64 * 1024, sse_read, s, sse_free);
    if (!r) {
        sse_free(s);
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory");
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, "text/event-stream");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-cache");
    enum MHD_Result ret = MHD_queue_response(c, 200, r);
    MHD_destroy_response(r);
    cx->responded = 1;
    count(h, cx, 200);
    return ret;
}

/* ---- image generations ---- */

static enum MHD_Result respond_images(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                      sched_job_t *j, const sched_snapshot_t *snap,
                                      int prompt_tokens, const char *warnings) {
    const char *accept = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_ACCEPT);
    size_t len;
    if (snap->n_images == 1 && accept && strstr(accept, "image/png") &&
        !strstr(accept, "application/json")) {
        const uint8_t *png = sched_job_png(j, 0, &len);
        return send_buf(h, c, cx, 200, "image/png", (void *)png, len, 0);
    }
    char **b64 = calloc((size_t)snap->n_images, sizeof *b64);
    int ok = b64 != NULL;
    for (int i = 0; ok && i < snap->n_images; i++)
        ok = (b64[i] = png_b64(j, -1, i)) != NULL;
    api_kv_report_t kv;
    api_timings_t timings;
    job_report(snap, &kv, &timings);
    char *json = ok ? api_images_response_json((long)time(NULL), snap->n_images,
                                               (const char *const *)b64, snap->width, snap->height,
                                               snap->image_tokens * snap->n_images, prompt_tokens,
                                               &kv, &timings, warnings)
                    : NULL;
    for (int i = 0; b64 && i < snap->n_images; i++)
        free(b64[i]);
    free(b64);
    if (!json)
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory building the response");
    return send_json(h, c, cx, 200, json);
}

/* Waits for a job while its client is there, waking for its end or every
 * WAIT_SLICE_S to look at the client, not at every step. The snapshot of
 * its end, or 0 when the client went away (the job is then cancelled). */
static int wait_job(http_server_t *h, struct MHD_Connection *c, sched_job_t *j,
                    sched_snapshot_t *snap) {
    sched_job_snapshot(j, snap);
    while (snap->outcome == SCHED_PENDING) {
        sched_job_wait_end(j, WAIT_SLICE_S, snap);
        if (snap->outcome == SCHED_PENDING && !client_alive(c)) {
            log_msg(LOG_INFO, "job %llu: client went away; cancelling",
                    (unsigned long long)sched_job_id(j));
            sched_job_cancel(h->sched, j);
            return 0;
        }
    }
    return 1;
}

static uint64_t random_seed(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t x = (uint64_t)ts.tv_nsec * 0x9E3779B97F4A7C15ull ^ (uint64_t)ts.tv_sec ^
                 ((uint64_t)(uintptr_t)&ts << 17);
    x ^= x >> 31;
    return x & ((1ull << 53) - 1);
}

/* A client that went away (closed, or shut its sending side): nothing is
 * written, and the connection is closed. 499, what nginx's access logs call
 * it, is the code the metrics and the access log give it, never a status
 * line (HTTP has no 499). libmicrohttpd's note that the application ended
 * the connection is left out of the log, as for answer_and_close. */
static enum MHD_Result client_gone(http_server_t *h, struct MHD_Connection *c, conn_t *cx) {
    const union MHD_ConnectionInfo *ci =
        MHD_get_connection_info(c, MHD_CONNECTION_INFO_CONNECTION_FD);
    count(h, cx, 499);
    return shut_connection(ci, cx, 0);
}

/* A prompt for the access log: a JSON string of at most LOGGED_PROMPT_BYTES
 * of it (cut at a character's start), or NULL. */
static char *quoted_prompt(const char *prompt) {
    char cut[LOGGED_PROMPT_BYTES + 1];
    size_t n = strlen(prompt);
    if (n > LOGGED_PROMPT_BYTES) {
        n = LOGGED_PROMPT_BYTES;
        while (n && ((unsigned char)prompt[n] & 0xC0) == 0x80)
            n--;
    }
    memcpy(cut, prompt, n);
    cut[n] = 0;
    cJSON *str = cJSON_CreateString(cut);
    char *out = str ? cJSON_PrintUnformatted(str) : NULL;
    cJSON_Delete(str);
    return out;
}

static enum MHD_Result submit_async(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                    const sched_request_t *rq, const char *warnings);

/* The model's size index of a validated request's width and height. */
static int http_size_index(const http_server_t *h, int width, int height) {
    for (int i = 0; i < h->n_sizes; i++)
        if (h->widths[i] == width && h->heights[i] == height)
            return i;
    return 0; /* api_parse_image_request accepts only the model's sizes */
}

static enum MHD_Result handle_generate(http_server_t *h, struct MHD_Connection *c, conn_t *cx) {
    api_image_request_t req;
    api_error_t e;
    if (api_parse_image_request(cx->body ? cx->body : "", cx->len, &h->limits, &req, &e) != AR_OK)
        return send_error(h, c, cx, &e);
    if (h->opt.log_prompts && req.prompt)
        cx->prompt = quoted_prompt(req.prompt);
    int *cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *negative = malloc(2 * MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int n_prompt = 0, n_negative = 0;
    ar_error_t err = {{0}};
    enum MHD_Result ret;
    if (!cond || !uncond || !negative) {
        ret = fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory");
        goto out;
    }
    if (req.has_class
            ? model_prompt_from_class(h->model, req.class_label, cond, uncond, &n_prompt, &err)
            : model_prompt_from_text(h->model, req.prompt, cond, uncond, &n_prompt, &err)) {
        const char *field = req.has_class ? "class_label" : "prompt";
        ret = fail(h, c, cx, 400, field, "invalid_value", "%s: %s", field, err.msg);
        goto out;
    }
    /* A negative prompt's rows: its ids are the conditional rows it would
     * give as a prompt (the unconditional ones are not needed). */
    if (req.negative_prompt &&
        model_prompt_from_text(h->model, req.negative_prompt, negative,
                               negative + MODEL_MAX_PROMPT_TOKENS, &n_negative, &err)) {
        ret =
            fail(h, c, cx, 400, "negative_prompt", "invalid_value", "negative_prompt: %s", err.msg);
        goto out;
    }
    /* Words the model does not know are read as unknown: the image is drawn,
     * and the answer says which. */
    char warnings[JOB_STORE_WARNINGS_BYTES] = "", line[JOB_STORE_WARNINGS_BYTES / 2];
    if (!req.has_class && model_prompt_warning(h->model, "prompt", req.prompt, line, sizeof line))
        snprintf(warnings, sizeof warnings, "%s", line);
    if (req.negative_prompt &&
        model_prompt_warning(h->model, "negative_prompt", req.negative_prompt, line, sizeof line))
        snprintf(warnings + strlen(warnings), sizeof warnings - strlen(warnings), "%s%s",
                 warnings[0] ? "\n" : "", line);
    sched_request_t rq = {
        .cond = cond,
        .uncond = uncond,
        .n_prompt = n_prompt,
        .size = http_size_index(h, req.width, req.height),
        .negative = n_negative ? negative : NULL,
        .n_negative = n_negative,
        .n_images = req.n,
        .seed = req.has_seed ? req.seed : random_seed(),
        .kv_policy = req.kv_policy,
        .kv_budget_min = req.kv_budget_min < 0 ? SCHED_BUDGET_LEAST : req.kv_budget_min,
        .partial_images = req.stream ? req.partial_images : 0,
        .timeout_s = h->opt.request_timeout_s,
        .objective_s = req.deadline_ms > 0 ? req.deadline_ms / 1000.0 : h->opt.slo_s};
    api_image_request_sampler_params(&req, &h->model->cfg.sampling, &rq.params);
    if (req.async) {
        ret = submit_async(h, c, cx, &rq, warnings);
        goto out;
    }
    sched_refusal_info_t why;
    sched_job_t *j = sched_submit(h->sched, &rq, &why);
    if (!j) {
        http_refusal_error(&why, req.n, h->opt.retry_after_s, &e);
        ret = send_error(h, c, cx, &e);
        goto out;
    }
    const double t_submitted = clock_now_s();
    if (req.stream) {
        ret = respond_stream(h, c, cx, j, n_prompt, warnings);
        goto out;
    }
    sched_snapshot_t snap;
    if (!wait_job(h, c, j, &snap)) {
        ret = client_gone(h, c, cx);
    } else if (snap.outcome == SCHED_DONE) {
        ret = respond_images(h, c, cx, j, &snap, n_prompt, warnings);
        /* What this thread added to the request's latency, for the cost table. */
        sched_note_http(h->sched, (t_submitted - cx->t0) + (clock_now_s() - sched_job_ended_at(j)));
    } else {
        outcome_error(&snap, &e);
        ret = send_error(h, c, cx, &e);
    }
    sched_job_release(j);
out:
    free(cond);
    free(uncond);
    free(negative);
    api_image_request_free(&req);
    return ret;
}

/* ---- async jobs ---- */

/* The store's view of a scheduler job. */
static double store_ended_at(void *job) { return sched_job_ended_at(job); }
static void store_retain(void *job) { sched_job_retain(job); }
static void store_release(void *job) { sched_job_release(job); }
static const job_store_ops_t STORE_OPS = {
    .ended_at = store_ended_at, .retain = store_retain, .release = store_release};

/* A job's status as GET /v1/images/jobs/ID says it (api_job_report_t). */
static const char *job_status(const sched_snapshot_t *snap) {
    switch (snap->outcome) {
    case SCHED_PENDING:
        return snap->started ? "running" : "queued";
    case SCHED_DONE:
        return "done";
    case SCHED_CANCELLED:
        return "cancelled";
    case SCHED_EXPIRED:
        return "expired";
    default: /* failed, or the server stopped first */
        return "failed";
    }
}

/* Answers with the job's object (api_job_json): status code (200, or 202
 * when it was just made), its images when it is done. */
static enum MHD_Result respond_job(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                   const job_store_entry_t *e, int code) {
    sched_job_t *j = e->job;
    /* The queue position first: a job admitted in between then reads as
     * running, never as queued at 0. */
    const int position = sched_job_queue_position(h->sched, j);
    sched_snapshot_t snap;
    sched_job_snapshot(j, &snap);
    const double ended = sched_job_ended_at(j);
    char poll_url[sizeof JOBS_PREFIX + JOB_STORE_ID_LEN];
    snprintf(poll_url, sizeof poll_url, JOBS_PREFIX "%s", e->id);
    api_job_report_t r = {.id = e->id,
                          .status = job_status(&snap),
                          .poll_url = poll_url,
                          .created = e->created,
                          .steps_done = snap.steps_done,
                          .steps_total = snap.steps_total};
    if (snap.started)
        r.started = e->created + lround(snap.queue_s);
    if (ended > 0)
        r.completed = e->created + lround(ended - e->created_at);
    if (!strcmp(r.status, "queued"))
        r.queue_position = position > 0 ? position : 1; /* 0: being admitted now */
    api_error_t err;
    if (snap.outcome != SCHED_PENDING && snap.outcome != SCHED_DONE) {
        outcome_error(&snap, &err);
        r.error = &err;
    }
    char **b64 = NULL;
    api_kv_report_t kv;
    api_timings_t timings;
    int ok = 1;
    if (snap.outcome == SCHED_DONE) {
        ok = (b64 = calloc((size_t)snap.n_images, sizeof *b64)) != NULL;
        for (int i = 0; ok && i < snap.n_images; i++)
            ok = (b64[i] = png_b64(j, -1, i)) != NULL;
        job_report(&snap, &kv, &timings);
        r.n = snap.n_images;
        r.b64_pngs = (const char *const *)b64;
        r.width = snap.width;
        r.height = snap.height;
        r.image_tokens = snap.image_tokens * snap.n_images;
        r.prompt_tokens = e->prompt_tokens;
        r.kv = &kv;
        r.timings = &timings;
        r.warnings = e->warnings;
    }
    char *json = ok ? api_job_json(&r) : NULL;
    for (int i = 0; b64 && i < snap.n_images; i++)
        free(b64[i]);
    free(b64);
    if (!json)
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory building the job");
    if (code == 202)
        snprintf(cx->location, sizeof cx->location, "%s", poll_url);
    return send_json(h, c, cx, code, json);
}

/* 429 for a full store, saying what fills it and when room comes: a slot
 * frees only when an ended job is forgotten (its retention after it ended,
 * or a DELETE), so Retry-After is the time until the oldest ended one is,
 * or with none ended the whole retention (a job that ends now is kept that
 * long); at least a second. */
static enum MHD_Result store_full(http_server_t *h, struct MHD_Connection *c, conn_t *cx) {
    job_store_counts_t n;
    job_store_counts(h->jobs, &n);
    char when[128] = "";
    double wait = h->opt.async_retention_s;
    if (n.oldest_ended > 0)
        wait = h->opt.async_retention_s - (clock_now_s() - n.oldest_ended);
    cx->retry_after_s = (int)fmin(fmax(1, ceil(wait)), 86400);
    if (n.oldest_ended > 0)
        snprintf(when, sizeof when, "; the oldest ended one is forgotten in %d s",
                 cx->retry_after_s);
    api_error_t e;
    api_errorf(&e, 429, "async", "job_store_full",
               "the async job store is full: it keeps at most %d jobs (async_max_jobs), and holds "
               "%d waiting or running and %d ended, each ended one kept %.0f s "
               "(async_retention_s)%s; retry after %d s, or DELETE ended jobs once collected",
               n.max_jobs, n.pending + n.reserved, n.ended, h->opt.async_retention_s, when,
               cx->retry_after_s);
    snprintf(e.type, sizeof e.type, "rate_limit_error");
    return send_error(h, c, cx, &e);
}

/* Queues rq as an async job and answers 202 with it at once. */
static enum MHD_Result submit_async(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                    const sched_request_t *rq, const char *warnings) {
    char id[JOB_STORE_ID_LEN + 1];
    job_store_refusal_t jr;
    if (job_store_reserve(h->jobs, id, &jr) != AR_OK) {
        if (jr == JOB_STORE_FULL)
            return store_full(h, c, cx);
        log_msg(LOG_ERROR, "async job: getrandom gave no id; refusing the job");
        return fail(h, c, cx, 500, NULL, "internal_error",
                    "no job id could be drawn from the kernel's random source");
    }
    sched_refusal_info_t why;
    sched_job_t *j = sched_submit(h->sched, rq, &why);
    if (!j) {
        job_store_unreserve(h->jobs, id);
        api_error_t e;
        http_refusal_error(&why, rq->n_images, h->opt.retry_after_s, &e);
        return send_error(h, c, cx, &e);
    }
    sched_job_retain(j); /* ours, for the answer; the submission's goes to the store */
    job_store_fill(h->jobs, id, j, (long)time(NULL), rq->n_prompt, warnings);
    job_store_entry_t e;
    enum MHD_Result ret;
    if (job_store_get(h->jobs, id, &e) == AR_OK) {
        ret = respond_job(h, c, cx, &e, 202);
        sched_job_release(e.job);
    } else { /* forgotten already: it ended and its retention passed */
        ret = fail(h, c, cx, 500, NULL, "internal_error", "the job was forgotten at once");
    }
    log_msg(LOG_DEBUG, "job %llu: async as %s", (unsigned long long)sched_job_id(j), id);
    sched_job_release(j);
    return ret;
}

/* GET and DELETE /v1/images/jobs/ID. */
static enum MHD_Result handle_job(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                  const char *method) {
    job_store_entry_t e;
    if (!cx->job_id[0] || job_store_get(h->jobs, cx->job_id, &e) != AR_OK)
        return fail(h, c, cx, 404, "id", "job_not_found",
                    "no job at %s: an id is 'job_' and 32 hex digits, as the 202 that accepted "
                    "the job gave it; a job is forgotten %.0f s after it ends "
                    "(async_retention_s), or when DELETE is sent once it has ended",
                    cx->path, h->opt.async_retention_s);
    enum MHD_Result ret;
    if (strcmp(method, "DELETE")) {
        ret = respond_job(h, c, cx, &e, 200);
    } else if (sched_job_ended_at(e.job) > 0) {
        sched_snapshot_t snap;
        sched_job_snapshot(e.job, &snap);
        const int gone = job_store_forget(h->jobs, e.id);
        ret = send_json(h, c, cx, 200, api_job_deleted_json(e.id, job_status(&snap), gone));
    } else {
        /* Cancelled: a waiting job leaves the queue at once, a running one
         * frees its KV at the engine's next iteration; it stays readable
         * as cancelled until its retention passes. */
        log_msg(LOG_INFO, "job %llu (%s): cancelled by DELETE",
                (unsigned long long)sched_job_id(e.job), e.id);
        sched_job_cancel(h->sched, e.job);
        sched_snapshot_t snap;
        sched_job_wait_end(e.job, CANCEL_WAIT_S, &snap);
        ret = respond_job(h, c, cx, &e, 200);
    }
    sched_job_release(e.job);
    return ret;
}

/* arserve_async_jobs{state}: the kept jobs by status, at each scrape. */
typedef struct job_census {
    int n[6];
} job_census_t;
static const char *const JOB_STATES[6] = {"queued",    "running", "done",
                                          "cancelled", "expired", "failed"};

static void census_add(void *job, void *arg) {
    job_census_t *census = arg;
    sched_snapshot_t snap;
    sched_job_snapshot(job, &snap);
    const char *status = job_status(&snap);
    for (int i = 0; i < 6; i++)
        if (!strcmp(status, JOB_STATES[i]))
            census->n[i]++;
}

static void count_jobs(http_server_t *h) {
    job_census_t census = {{0}};
    job_store_each(h->jobs, census_add, &census);
    for (int i = 0; i < 6; i++)
        metric_set(h->m_jobs, census.n[i], JOB_STATES[i]);
}

/* ---- dispatch ---- */

/* What uri_logged gives libmicrohttpd for a request it has answered and
 * closed itself (414): libmicrohttpd may then end the connection without
 * calling the access handler or the completion callback (it calls them
 * only once the handler has run), so no state of the request is left with
 * it to free. */
static char answered_by_uri_log;

/* MHD_OPTION_URI_LOG_CALLBACK: the request line's target as sent, before
 * libmicrohttpd decodes it (a %00 would end the decoded path early, so
 * "/health%00" would route to /health). Starts the request's state. */
static void *uri_logged(void *cls, const char *uri, struct MHD_Connection *c) {
    http_server_t *h = cls;
    conn_t *cx = conn_new();
    if (!cx)
        return NULL;
    quote_printable(cx->path, sizeof cx->path, uri, 1);
    note_client(cx, c);
    cx->raw_target = uri;
    cx->raw_target_len = strlen(uri);
    for (const char *p = uri; *p && *p != '?'; p++)
        if (p[0] == '%' && p[1] == '0' && p[2] == '0')
            cx->nul_in_path = 1;
    const size_t target = strlen(uri);
    const char *query = strchr(uri, '?');
    int params = query && query[1];
    for (const char *p = query; params && *p; p++)
        params += *p == '&';
    if (target > MAX_TARGET_BYTES || params > MAX_QUERY_PARAMS) {
        api_error_t e;
        if (target > MAX_TARGET_BYTES)
            api_errorf(&e, 414, NULL, "uri_too_long",
                       "the request target is %zu bytes long; at most %d are read", target,
                       MAX_TARGET_BYTES);
        else
            api_errorf(&e, 414, NULL, "uri_too_long",
                       "the query string has %d parameters; at most %d are read, and no route "
                       "takes any",
                       params, MAX_QUERY_PARAMS);
        answer_and_close(h, c, cx, &e, 0);
        conn_release(cx); /* its access log line */
        return &answered_by_uri_log;
    }
    /* Until the request completes (completed), for mhd_log: never a state
     * released above. */
    this_conn = c;
    this_cx = cx;
    return cx;
}

/* What the headers say about the body's framing. */
typedef struct framing {
    int n_length;                 /* Content-Length headers */
    int lengths_differ;           /* two of them disagree */
    char length[32];              /* the first one's value */
    int transfer_encoding;        /* Transfer-Encoding headers */
    int only_chunked;             /* one of them, and its value is "chunked" (any case) */
    char coding[QUOTE_BYTES + 4]; /* the first coding named that is not chunked, printable */
} framing_t;

/* Notes in f the first coding of a Transfer-Encoding list (RFC 9110 5.6.1:
 * comma-separated, optional whitespace) that is not chunked. */
static void scan_codings(framing_t *f, const char *list) {
    for (const char *p = list; *p && !f->coding[0];) {
        p += strspn(p, " \t,");
        size_t n = strcspn(p, ",");
        while (n && (p[n - 1] == ' ' || p[n - 1] == '\t'))
            n--;
        char coding[QUOTE_BYTES + 4];
        snprintf(coding, sizeof coding, "%.*s", (int)(n < QUOTE_BYTES ? n : QUOTE_BYTES), p);
        if (n && strcasecmp(coding, "chunked"))
            quote_printable(f->coding, sizeof f->coding, coding, 0);
        p += strcspn(p, ",");
    }
}

static enum MHD_Result scan_framing(void *cls, enum MHD_ValueKind kind, const char *key,
                                    const char *value) {
    framing_t *f = cls;
    (void)kind;
    if (!strcasecmp(key, MHD_HTTP_HEADER_CONTENT_LENGTH)) {
        if (f->n_length++ == 0)
            snprintf(f->length, sizeof f->length, "%s", value ? value : "");
        else if (!value || strcmp(f->length, value))
            f->lengths_differ = 1;
    } else if (!strcasecmp(key, MHD_HTTP_HEADER_TRANSFER_ENCODING)) {
        /* libmicrohttpd decodes the body as chunked when the first such
         * header is "chunked" and reads it to the end of the connection
         * otherwise: anything but that one header is refused. */
        f->only_chunked = f->transfer_encoding++ == 0 && value && !strcasecmp(value, "chunked");
        scan_codings(f, value ? value : "");
    }
    return MHD_YES;
}

/* 1 when the Host header names an allowed host (any port), or there is none
 * (HTTP/1.0; early_errors refuses HTTP/1.1 without one). */
static int host_allowed(const http_server_t *h, const char *host) {
    if (h->any_host || !host)
        return 1;
    size_t n = host[0] == '[' ? strcspn(host, "]") + 1 : strcspn(host, ":");
    if (n > strlen(host))
        return 0;
    for (int i = 0; i < h->n_hosts; i++)
        if (strlen(h->hosts[i]) == n && !strncasecmp(h->hosts[i], host, n))
            return 1;
    return 0;
}

/* Content-Type application/json, parameters (charset) allowed. */
static int is_json_type(const char *type) {
    if (!type)
        return 0;
    while (*type == ' ')
        type++;
    size_t n = strlen("application/json");
    return !strncasecmp(type, "application/json", n) &&
           (type[n] == 0 || type[n] == ';' || type[n] == ' ');
}

/* Feeds the next n bytes of a body to t. Returns the offset among them of
 * the first byte other than JSON whitespace after the top-level array or
 * object has closed, or n when there is none: a body with such a byte can
 * never be a JSON text. */
static size_t value_tracker_feed(value_tracker_t *t, const char *p, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const char ch = p[i];
        if (t->done) {
            if (ch != ' ' && ch != '\t' && ch != '\r' && ch != '\n')
                return i;
        } else if (t->in_string) {
            if (t->escaped)
                t->escaped = 0;
            else if (ch == '\\')
                t->escaped = 1;
            else if (ch == '"')
                t->in_string = 0;
        } else if (ch == '"') {
            t->in_string = 1;
        } else if (ch == '{' || ch == '[') {
            t->depth++;
        } else if ((ch == '}' || ch == ']') && t->depth > 0) {
            t->done = --t->depth == 0;
        }
    }
    return n;
}

/* A chunked body that goes on after its JSON value (at byte at of it). The
 * usual cause: a chunk size larger than the chunk sent. libmicrohttpd reads
 * chunk sizes itself and takes any that fits 64 bits (ffffffffffffffff, or
 * 17 digits with a leading zero), then hands on everything after the size
 * line as that chunk's data: the JSON, and after it the CRLF, the last
 * chunk's "0" line and the final CRLF, and waits for the rest of a chunk
 * that never comes (a size past 64 bits it answers 413 itself). The body's
 * end will not come, and libmicrohttpd queues no answer before it, so this
 * one is written on the socket (answer_and_close). */
static void trailing_data_error(const conn_t *cx, size_t at, api_error_t *e) {
    const char *b = cx->body;
    const int chunk_line = isxdigit((unsigned char)b[at]) && at > 0 && b[at - 1] == '\n';
    if (chunk_line)
        api_errorf(e, 400, NULL, "invalid_framing",
                   "the chunked body goes on after its JSON value with what reads as a chunk "
                   "size line at byte %zu: a chunk size larger than the chunk sent",
                   at);
    else
        api_errorf(e, 400, NULL, "invalid_json",
                   "malformed JSON: unexpected data after the JSON value at byte %zu", at);
}

/* The answer to a body read and thrown away: 413 over the limit, or 400 on
 * a route that takes none. */
static void discarded_body_error(const http_server_t *h, const conn_t *cx, api_error_t *e) {
    if (cx->too_large)
        api_errorf(e, 413, NULL, "request_too_large", "the request body is larger than %zu bytes",
                   h->opt.max_body_bytes);
    else
        api_errorf(e, 400, NULL, "unexpected_body", "%s %s takes no request body", cx->method,
                   cx->path);
}

/* Everything decided from the request line and headers, answered before any
 * of the body is read: 400 for an encoded NUL in the path or ambiguous
 * framing, 501 for a transfer coding other than chunked, 403 for a Host not
 * allowed, 404, 405, 401, 415, and 413 by Content-Length when the client
 * waits for "100 Continue" before sending the body. Any other body over the
 * limit is read and thrown away first (cx->too_large, take_body), so that a
 * client still sending sees the 413 rather than a reset. */
static enum MHD_Result early_errors(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                    const char *method, const char *version) {
    framing_t f = {0};
    MHD_get_connection_values(c, MHD_HEADER_KIND, scan_framing, &f);
    if (cx->bad_line) {
        cx->close = 1;
        return fail(h, c, cx, 400, NULL, "invalid_request_line",
                    "the request line (method %s, target %s) is malformed: %s", cx->method,
                    cx->path, cx->bad_line);
    }
    if (cx->nul_in_path) {
        cx->close = 1;
        return fail(h, c, cx, 400, NULL, "invalid_path", "the path %s encodes a NUL byte",
                    cx->path);
    }
    if (f.lengths_differ || (f.n_length && f.transfer_encoding)) {
        cx->close = 1;
        return fail(h, c, cx, 400, NULL, "invalid_framing",
                    f.lengths_differ ? "the request has Content-Length headers that disagree"
                                     : "the request has both Content-Length and "
                                       "Transfer-Encoding; send one");
    }
    if (f.transfer_encoding && !f.only_chunked) {
        /* RFC 9112 6.1: a coding the server does not understand is a 501;
         * 6.3: a body whose last coding is not chunked has no length to
         * find, so the connection cannot be read past it either way. */
        cx->close = 1;
        if (f.coding[0]) {
            api_error_t e;
            api_errorf(&e, 501, NULL, "unsupported_transfer_encoding",
                       "Transfer-Encoding '%s' is not implemented: send the body with "
                       "Content-Length, or with 'Transfer-Encoding: chunked' alone",
                       f.coding);
            snprintf(e.type, sizeof e.type, "invalid_request_error");
            return send_error(h, c, cx, &e);
        }
        return fail(h, c, cx, 400, NULL, "invalid_framing",
                    "Transfer-Encoding must be 'chunked', once (RFC 9112 6.1)");
    }
    const char *host = MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST);
    if (!host && !strcmp(version, MHD_HTTP_VERSION_1_1)) {
        cx->close = 1;
        return fail(h, c, cx, 400, NULL, "missing_host",
                    "an HTTP/1.1 request must have a Host header");
    }
    if (!host_allowed(h, host)) {
        char quoted[QUOTE_BYTES + 4];
        quote_printable(quoted, sizeof quoted, host, 0);
        return fail(h, c, cx, 403, NULL, "host_not_allowed",
                    "Host '%s' is not served here; start arserve with --allowed-hosts to add "
                    "it",
                    quoted);
    }
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    int is_post = !strcmp(method, "POST");
    if (!strcmp(cx->route, "other"))
        return fail(h, c, cx, 404, NULL, "not_found", "no route for %s %s", cx->method, cx->path);
    int want_post = !strcmp(cx->route, GENERATE_ROUTE);
    int is_jobs = !strcmp(cx->route, JOBS_ROUTE);
    if (want_post ? !is_post : !(is_get || (is_jobs && !strcmp(method, "DELETE"))))
        return fail(h, c, cx, 405, NULL, "method_not_allowed", "%s is not allowed on %s; use %s",
                    cx->method, cx->path,
                    want_post ? "POST"
                    : is_jobs ? "GET or DELETE"
                              : "GET");
    /* Probes (an orchestrator's readiness check as much as its liveness
     * one) carry no key. */
    if (!strcmp(cx->route, PAGE_ROUTE) || !strcmp(cx->route, "/health") ||
        !strcmp(cx->route, "/ready") || (!strcmp(cx->route, "/metrics") && !h->opt.metrics_auth))
        return MHD_YES;
    if (!auth_ok(h, c))
        return fail(h, c, cx, 401, NULL, "invalid_api_key",
                    "missing or wrong API key: send 'Authorization: Bearer <key>'");
    if (!want_post)
        return MHD_YES;
    const char *type =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_TYPE);
    if (!is_json_type(type))
        return fail(h, c, cx, 415, NULL, "unsupported_media_type",
                    "the body must be sent as Content-Type: application/json");
    /* A body declared too large is answered at once, before a byte of it
     * (with "Expect: 100-continue" or without, as nginx does); what the
     * client sends meanwhile is thrown away for up to linger_s. */
    unsigned long long length = f.n_length ? strtoull(f.length, NULL, 10) : 0;
    if (length > h->opt.max_body_bytes) {
        api_error_t e;
        cx->too_large = 1;
        discarded_body_error(h, cx, &e);
        return answer_and_close(h, c, cx, &e, h->opt.linger_s);
    }
    return MHD_YES;
}

/* The first call for a request: its state, phase, and the early answers. */
/* RFC 9110 5.6.2's tchar: the bytes a method (a token) may have. */
static int is_tchar(unsigned char b) {
    return (b >= '0' && b <= '9') || ((b | 0x20) >= 'a' && (b | 0x20) <= 'z') ||
           (b && strchr("!#$%&'*+-.^_`|~", b));
}

/* Whether a NUL the client sent ends the part of the request line that
 * starts at `part` (n bytes as a string) early. libmicrohttpd splits the
 * line in its own buffer, writing one NUL over the space after each part
 * and skipping any more spaces (which it allows) to the next, which starts
 * at `next`; so between a part's end and the next there is exactly one NUL
 * and otherwise blanks, unless the client sent a NUL. Those bytes are read
 * only when the two pointers are that close. */
static int nul_after(const char *part, size_t n, const char *next) {
    int nuls = 0;
    if (next > part + n + 1 && next <= part + n + 64)
        for (const char *p = part + n; p < next; p++)
            if (*p == 0 ? ++nuls > 1 : *p != ' ' && *p != '\t')
                return 1;
    return 0;
}

/* What is malformed in the request line, or NULL: a method that is not a
 * token, or a NUL byte in the method or the target (which would end the
 * string libmicrohttpd gives early: "G\0T" read as "G"). */
static const char *line_malformed(const conn_t *cx, const char *method, const char *url,
                                  const char *version) {
    const size_t n = strlen(method);
    for (size_t i = 0; i < n; i++)
        if (!is_tchar((unsigned char)method[i]))
            return "its method is not an HTTP token (RFC 9110 5.6.2)";
    if (n == 0 || nul_after(method, n, cx->raw_target ? cx->raw_target : url))
        return "its method holds a NUL byte";
    if (cx->raw_target && nul_after(cx->raw_target, cx->raw_target_len, version))
        return "its target holds a NUL byte";
    return NULL;
}

static enum MHD_Result start_request(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                     const char *url, const char *method, const char *version) {
    cx->started = 1;
    cx->bad_line = line_malformed(cx, method, url, version);
    quote_printable(cx->method, sizeof cx->method, method, 0);
    for (const char *const *r = KNOWN_ROUTES; *r; r++)
        if (!strcmp(url, *r))
            cx->route = *r;
    if (!strncmp(url, JOBS_PREFIX, strlen(JOBS_PREFIX))) {
        cx->route = JOBS_ROUTE;
        if (job_store_id_valid(url + strlen(JOBS_PREFIX)))
            memcpy(cx->job_id, url + strlen(JOBS_PREFIX), sizeof cx->job_id);
    }
    if (!cx->client[0])
        note_client(cx, c);
    atomic_fetch_add(&h->inflight, 1);
    cx->counted = 1;
    const char *length =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    /* early_errors refuses any Transfer-Encoding but "chunked". */
    cx->chunked =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_TRANSFER_ENCODING) != NULL;
    const int has_body = (length && strtoull(length, NULL, 10) > 0) || cx->chunked;
    conn_guard_phase(h->guard, c, has_body ? CONN_BODY : CONN_ACTIVE);
    /* libmicrohttpd queues a response only now (headers read) or once the
     * whole body is in. */
    return early_errors(h, c, cx, method, version);
}

/* A piece of body: kept (POST within the limit) or thrown away, nothing of
 * it stored, for up to linger_s (nginx's lingering close is bounded by time
 * too): a client that finishes sending by then reads the queued answer, one
 * still sending is answered on the socket and cut. MHD_NO closes the
 * connection (out of memory, or that answer). */
static enum MHD_Result take_body(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                 const char *data, size_t n) {
    const int keep = !cx->responded && !cx->too_large && !strcmp(cx->route, GENERATE_ROUTE);
    if (keep && cx->len + n > h->opt.max_body_bytes) { /* over the limit once in */
        cx->too_large = 1;
        cx->discarded = cx->len;
        free(cx->body);
        cx->body = NULL;
        cx->len = cx->cap = 0;
    } else if (keep) {
        if (cx->len + n > cx->cap) {
            size_t cap = cx->cap ? cx->cap : 4096;
            while (cap < cx->len + n)
                cap *= 2;
            char *b = realloc(cx->body, cap);
            if (!b)
                return MHD_NO;
            cx->body = b;
            cx->cap = cap;
        }
        memcpy(cx->body + cx->len, data, n);
        cx->len += n;
        size_t after = cx->chunked ? value_tracker_feed(&cx->json, data, n) : n;
        if (after == n)
            return MHD_YES;
        api_error_t e;
        trailing_data_error(cx, cx->len - n + after, &e);
        return answer_and_close(h, c, cx, &e, 0);
    }
    if (!cx->responded && !cx->too_large)
        cx->unexpected_body = 1;
    cx->discarded += n;
    const double now = clock_now_s();
    if (!cx->linger_since)
        cx->linger_since = now;
    if (now - cx->linger_since <= h->opt.linger_s)
        return MHD_YES;
    api_error_t e;
    discarded_body_error(h, cx, &e);
    log_msg(LOG_DEBUG, "http: %zu body bytes thrown away in %.1f s and more coming; answering %d",
            cx->discarded, now - cx->linger_since, e.status);
    return answer_and_close(h, c, cx, &e, 0);
}

/* /health's and /ready's answer once the backend cannot run anything:
 * {"status":"unhealthy","reason":...}, so an orchestrator restarts the
 * daemon and whoever looks sees why. NULL when out of memory. */
static char *unhealthy_json(const char *reason) {
    cJSON *o = cJSON_CreateObject();
    char *out = NULL;
    if (o && cJSON_AddStringToObject(o, "status", "unhealthy") &&
        cJSON_AddStringToObject(o, "reason", reason))
        out = cJSON_PrintUnformatted(o);
    cJSON_Delete(o);
    return out;
}

/* GET /v1/capacity: the cost table the engine has learned (in the form
 * `arserve bench --profile` writes and `arserve simulate --costs` reads),
 * how it was learned, and the KV pool. */
static char *capacity_json(http_server_t *h) {
    sched_capacity_t cap;
    sched_capacity(h->sched, &cap);
    cJSON *o = cJSON_CreateObject(), *table = cost_table_json(&cap.costs),
          *learn = cJSON_CreateObject(), *pool = cJSON_CreateObject();
    char *out = NULL;
    if (o && table && learn && pool && cJSON_AddStringToObject(o, "object", "capacity") &&
        cJSON_AddNumberToObject(learn, "timed_iterations", (double)cap.timed_iterations) &&
        cJSON_AddNumberToObject(learn, "refits", (double)cap.refits) &&
        cJSON_AddNumberToObject(learn, "window_iterations", cap.window) &&
        cJSON_AddNumberToObject(learn, "refit_every", cap.refit_every) &&
        cJSON_AddNumberToObject(learn, "outliers_left_out", cap.outliers) &&
        cJSON_AddNumberToObject(pool, "capacity_bytes", (double)cap.kv_pool_bytes) &&
        cJSON_AddNumberToObject(pool, "reserved_bytes", (double)cap.kv_reserved_bytes)) {
        cJSON_AddItemToObject(o, "cost_table", table);
        cJSON_AddItemToObject(o, "learning", learn);
        cJSON_AddItemToObject(o, "kv_pool", pool);
        table = learn = pool = NULL;
        out = cJSON_PrintUnformatted(o);
    }
    cJSON_Delete(o);
    cJSON_Delete(table);
    cJSON_Delete(learn);
    cJSON_Delete(pool);
    return out;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **con_cls) {
    http_server_t *h = cls;
    if (*con_cls == &answered_by_uri_log) {
        *upload_data_size = 0;
        return MHD_NO;
    }
    conn_t *cx = *con_cls;
    if (!cx && !(cx = *con_cls = conn_new())) /* the URI callback ran out of memory */
        return MHD_NO;
    if (cx->closed) { /* answered already, on the socket */
        *upload_data_size = 0;
        return MHD_NO;
    }
    if (!cx->started)
        return start_request(h, c, cx, url, method, version);
    if (*upload_data_size) {
        enum MHD_Result r = take_body(h, c, cx, upload_data, *upload_data_size);
        *upload_data_size = 0;
        return r;
    }
    if (cx->responded)
        return MHD_YES;
    /* The whole request is in. Route, method and key were checked by
     * early_errors on the first call. */
    conn_guard_phase(h->guard, c, CONN_ACTIVE);
    const char *route = cx->route;
    if (cx->unexpected_body || cx->too_large) {
        api_error_t e;
        discarded_body_error(h, cx, &e);
        cx->close = 1;
        return send_error(h, c, cx, &e);
    }
    if (!strcmp(route, PAGE_ROUTE))
        return send_buf(h, c, cx, 200, "text/html; charset=utf-8", (void *)playground_html,
                        playground_html_len, 0);
    if (!strcmp(route, "/health") || !strcmp(route, "/ready")) {
        const char *unusable = sched_backend_unusable(h->sched);
        if (unusable)
            return send_json(h, c, cx, 503, unhealthy_json(unusable));
    }
    if (!strcmp(route, "/health")) {
        int alive = sched_alive(h->sched);
        return send_json(h, c, cx, alive ? 200 : 503,
                         strdup(alive ? "{\"status\":\"ok\"}" : "{\"status\":\"engine stopped\"}"));
    }
    if (!strcmp(route, "/metrics")) {
        count_jobs(h);
        char *text = metrics_render(h->metrics);
        if (!text)
            return MHD_NO;
        return send_buf(h, c, cx, 200, METRICS_CONTENT_TYPE, text, strlen(text), 1);
    }
    if (!strcmp(route, "/ready")) {
        int ready = atomic_load(&h->ready) && !sched_draining(h->sched);
        return send_json(h, c, cx, ready ? 200 : 503,
                         strdup(ready ? "{\"status\":\"ready\"}" : "{\"status\":\"not ready\"}"));
    }
    if (!strcmp(route, "/v1/models"))
        return send_json(h, c, cx, 200, api_models_json(&h->limits, &h->card));
    if (!strcmp(route, CAPACITY_ROUTE))
        return send_json(h, c, cx, 200, capacity_json(h));
    if (!strcmp(route, JOBS_ROUTE))
        return handle_job(h, c, cx, method);
    /* POST /v1/images/generations */
    if (!atomic_load(&h->ready) || sched_draining(h->sched))
        return fail(h, c, cx, 503, NULL, "not_ready",
                    "the server is not accepting work (loading or shutting down)");
    /* A dead backend would fail the request at its first step: refuse it
     * now, as /health and /ready say. */
    const char *unusable = sched_backend_unusable(h->sched);
    if (unusable)
        return fail(h, c, cx, 503, NULL, "backend_unusable",
                    "the server cannot generate until it is restarted: %s", unusable);
    return handle_generate(h, c, cx);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    http_server_t *h = cls;
    conn_t *cx = *con_cls;
    (void)toe;
    conn_guard_phase(h->guard, c, CONN_HEADERS);
    if (cx == this_cx)
        this_cx = NULL;
    if (!cx || *con_cls == &answered_by_uri_log)
        return;
    if (cx->counted)
        atomic_fetch_sub(&h->inflight, 1);
    *con_cls = NULL;
    conn_release(cx);
}

/* The start of the message libmicrohttpd logs (with the status and its own
 * HTML body as arguments) just before it answers a request it refuses
 * itself: bad framing, a header line without a colon, headers or a target
 * past its buffer. */
#define MHD_REFUSAL_LOG "Error processing request (HTTP response code is %u ('%s'))"

/* libmicrohttpd's own refusal of the request this thread serves, as the
 * API's error: its status, and what its HTML body says as a message. */
static void mhd_refusal_error(unsigned status, const char *html, size_t max_body, api_error_t *e) {
    if (strstr(html, "wrong value for <b>Content-Length"))
        api_errorf(e, 400, NULL, "invalid_framing",
                   "the Content-Length header is not a number of bytes");
    else if (strstr(html, "too large value for <b>Content-Length"))
        api_errorf(e, 413, NULL, "request_too_large",
                   "the Content-Length header is past what can be read; a body may have at most "
                   "%zu bytes",
                   max_body);
    else if (strstr(html, "chunk size used in your HTTP chunked encoded request is too large"))
        api_errorf(e, 413, NULL, "request_too_large",
                   "a chunk's size is past what can be read; a body may have at most %zu bytes",
                   max_body);
    else if (strstr(html, "chunked encoding was syntactically incorrect"))
        api_errorf(e, 400, NULL, "invalid_framing",
                   "the chunked body is malformed (a chunk size that is not hexadecimal, or a "
                   "chunk not ended by CRLF)");
    else if (status == 414)
        api_errorf(e, 414, NULL, "uri_too_long", "the request line is longer than is read");
    else if (status == 431)
        api_errorf(e, 431, NULL, "headers_too_large",
                   "the request's headers are larger than is read (their total, or one line)");
    else if (status == 505)
        api_errorf(e, 505, NULL, "http_version_not_supported",
                   "the HTTP version is not supported: send HTTP/1.1 or HTTP/1.0");
    else if (status >= 500)
        api_errorf(e, status, NULL, "internal_error", "the request could not be processed");
    else
        api_errorf(e, status, NULL, "malformed_request",
                   "the request is not well-formed HTTP/1.1 (for example a header line without "
                   "a colon)");
}

/* libmicrohttpd's messages, mostly about clients that misbehave (closed
 * early, sent a bad header): at most MHD_LOG_PER_S a second, so that an
 * attack cannot flood the log; the next message says how many were left
 * out. */
#define MHD_LOG_PER_S 5
static void mhd_log(void *cls, const char *fmt, va_list ap) {
    static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
    static long second;
    static int logged, dropped;
    http_server_t *h = cls;
    /* A request libmicrohttpd is about to refuse with its own HTML: answered
     * first, once, as the API's JSON on the socket, which is then shut, so
     * its answer goes nowhere (its send fails, logged by nobody). Before the
     * request line was read (an unsupported HTTP version) there is no
     * request state to answer with, and its answer goes out. */
    if (this_cx && this_conn && !this_cx->responded &&
        !strncmp(fmt, MHD_REFUSAL_LOG, strlen(MHD_REFUSAL_LOG))) {
        va_list args;
        va_copy(args, ap);
        const unsigned status = va_arg(args, unsigned);
        const char *html = va_arg(args, const char *);
        va_end(args);
        api_error_t e;
        mhd_refusal_error(status, html ? html : "", h->opt.max_body_bytes, &e);
        this_cx->close = 1;
        /* A client may still be sending (past a header limit, say): it reads
         * the answer, not a reset. */
        answer_and_close(h, this_conn, this_cx, &e, h->opt.linger_s);
        return;
    }
    if (closed_by_us)
        return;
    const long now = (long)clock_now_s();
    pthread_mutex_lock(&lock);
    if (now != second) {
        second = now;
        logged = 0;
    }
    int drop = logged >= MHD_LOG_PER_S, skipped = dropped;
    if (drop) {
        dropped++;
    } else {
        logged++;
        dropped = 0;
    }
    pthread_mutex_unlock(&lock);
    if (drop)
        return;
    if (skipped)
        log_msg(LOG_WARN, "http: (%d messages like the following left out)", skipped);
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = 0;
    log_msg(LOG_WARN, "http: %s", msg);
}

/* The Host allow-list from list (comma-separated names, "*" for any); an
 * empty list allows the loopback names when addr is a loopback address, and
 * any name otherwise. */
static int set_allowed_hosts(http_server_t *h, const char *list, const struct sockaddr_in *addr,
                             ar_error_t *err) {
    if (!list || !list[0]) {
        if ((ntohl(addr->sin_addr.s_addr) >> 24) != 127) {
            h->any_host = 1;
            return AR_OK;
        }
        list = "localhost,127.0.0.1,[::1]";
    }
    for (const char *p = list; *p;) {
        size_t n = strcspn(p, ",");
        while (n && p[n - 1] == ' ')
            n--;
        if (n == 1 && *p == '*')
            h->any_host = 1;
        else if (n == 0 || n >= sizeof h->hosts[0])
            return ar_errorf(err, "--allowed-hosts: an empty or over-long name in '%s'", list);
        else if (h->n_hosts == MAX_ALLOWED_HOSTS)
            return ar_errorf(err, "--allowed-hosts: more than %d names", MAX_ALLOWED_HOSTS);
        else {
            memcpy(h->hosts[h->n_hosts], p, n);
            h->hosts[h->n_hosts++][n] = 0;
        }
        p += strcspn(p, ",");
        while (*p == ',' || *p == ' ')
            p++;
    }
    return AR_OK;
}

/* Condition prefix tokens of the shortest request: a class label, or a
 * prompt of one token. The least budgets GET /v1/models lists are for it;
 * a longer prompt may need more, and its refusal says how much. */
static int shortest_prefix(const model_t *m) {
    int cond[MODEL_MAX_PROMPT_TOKENS], uncond[MODEL_MAX_PROMPT_TOKENS], n = 1;
    ar_error_t err;
    if (model_is_class_conditional(m) ||
        model_prompt_from_text(m, "a", cond, uncond, &n, &err) != AR_OK)
        return 1;
    return n;
}

http_server_t *http_start(const http_options_t *opt, model_t *model, scheduler_t *sched,
                          metrics_t *metrics, ar_error_t *err) {
    http_server_t *h = calloc(1, sizeof *h);
    if (!h) {
        ar_errorf(err, "out of memory");
        return NULL;
    }
    h->opt = *opt;
    snprintf(h->api_key, sizeof h->api_key, "%s", opt->api_key ? opt->api_key : "");
    h->model = model;
    h->sched = sched;
    h->metrics = metrics;
    h->n_sizes = model->cfg.image.n_sizes > 0 ? model->cfg.image.n_sizes : 1;
    for (int i = 0; i < h->n_sizes; i++)
        model_image_dims(&model->cfg, i, &h->widths[i], &h->heights[i]);
    const char *names = opt->served_model_name && *opt->served_model_name ? opt->served_model_name
                                                                          : model->cfg.name;
    snprintf(h->model_id, sizeof h->model_id, "%.*s", (int)strcspn(names, ","), names);
    h->limits = (api_limits_t){
        .model_name = h->model_id,
        .model_names = names,
        .max_n = opt->max_n,
        .n_sizes = h->n_sizes,
        .widths = h->widths,
        .heights = h->heights,
        .max_prompt_bytes = 4096,
        /* Infinity samples each bit from two values. */
        .codebook_size = model->cfg.image.codebook_size > 0 ? model->cfg.image.codebook_size : 2,
        .negative_prompt = model_config_has_text_encoder(&model->cfg),
        .num_classes = model->cfg.condition.num_classes,
        .class_names = (const char *const *)model->class_names,
        .kv_defaults = &h->opt.kv_defaults,
        .kv_ranges = h->opt.kv_ranges};
    model_geometry(&model->cfg, shortest_prefix(model), &h->geom);
    h->limits.kv_auto = kv_policy_auto(&h->opt.kv_defaults, &h->geom);
    h->card = (api_model_card_t){.created = (long)time(NULL),
                                 .family = model->family->name,
                                 .segment_name = model->family->segment_name,
                                 .geom = &h->geom,
                                 .sampling = model->cfg.sampling};
    for (int i = 0; i < h->n_sizes; i++)
        model_geometry_sized(&model->cfg, shortest_prefix(model), i, &h->size_geoms[i]);
    if (h->n_sizes > 1)
        h->card.size_geoms = h->size_geoms;
    const int n_words = model->tok ? tokenizer_words(model->tok, NULL, 0) : 0;
    if (n_words > 0 && (h->words = malloc((size_t)n_words * sizeof *h->words))) {
        tokenizer_words(model->tok, h->words, n_words);
        h->card.words = h->words;
        h->card.n_words = n_words;
    }
    static const char *const labels[] = {"route", "code"};
    h->m_requests = metrics_counter(metrics, "arserve_http_requests_total",
                                    "HTTP requests answered, by route and status code.", 2, labels);
    static const char *const state[] = {"state"};
    h->m_jobs = metrics_gauge(metrics, "arserve_async_jobs",
                              "Async jobs kept (for GET /v1/images/jobs/ID), by status.", 1, state);
    if (h->opt.async_max_jobs <= 0)
        h->opt.async_max_jobs = DEFAULT_ASYNC_MAX_JOBS;
    if (!(h->opt.async_retention_s > 0))
        h->opt.async_retention_s = DEFAULT_ASYNC_RETENTION_S;

    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt->port)};
    if (inet_pton(AF_INET, opt->host, &addr.sin_addr) != 1) {
        free(h->words);
        free(h);
        ar_errorf(err, "--host: '%s' is not an IPv4 address", opt->host);
        return NULL;
    }
    if (set_allowed_hosts(h, opt->allowed_hosts, &addr, err)) {
        free(h->words);
        free(h);
        return NULL;
    }
    conn_guard_options_t go = {.max_connections = opt->max_connections,
                               .max_per_ip = opt->max_connections_per_ip,
                               .header_timeout_s = opt->header_timeout_s,
                               .body_timeout_s = opt->body_timeout_s};
    if (!(h->guard = conn_guard_create(&go, metrics, err))) {
        free(h->words);
        free(h);
        return NULL;
    }
    job_store_options_t jo = {
        .max_jobs = h->opt.async_max_jobs, .retention_s = h->opt.async_retention_s, .sweeper = 1};
    if (!(h->jobs = job_store_create(&jo, &STORE_OPS, metrics, err))) {
        conn_guard_destroy(h->guard);
        free(h->words);
        free(h);
        return NULL;
    }
    count_jobs(h);
    /* libmicrohttpd's strict mode stays off: its answer to HTTP/1.1 without
     * Host (0.9.75) sends the status line and headers twice, so early_errors
     * makes that check with a JSON answer. The framing checks are ours too;
     * libmicrohttpd refuses spaces in the target and bad header lines
     * itself. */
    h->d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG |
            MHD_USE_POLL,
        (uint16_t)opt->port, NULL, NULL, handle, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, h,
        MHD_OPTION_SOCK_ADDR, &addr, MHD_OPTION_NOTIFY_COMPLETED, completed, h,
        MHD_OPTION_URI_LOG_CALLBACK, uri_logged, h, MHD_OPTION_NOTIFY_CONNECTION, conn_guard_notify,
        h->guard, MHD_OPTION_STRICT_FOR_CLIENT, (int)0, MHD_OPTION_CONNECTION_LIMIT,
        conn_guard_hard_limit(h->guard), MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)120,
        MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 * 1024), MHD_OPTION_END);
    if (!h->d) {
        job_store_destroy(h->jobs);
        conn_guard_destroy(h->guard);
        free(h->words);
        free(h);
        ar_errorf(err, "cannot listen on %s:%d (in use, or not permitted)", opt->host, opt->port);
        return NULL;
    }
    return h;
}

int http_port(const http_server_t *h) {
    const union MHD_DaemonInfo *di = MHD_get_daemon_info(h->d, MHD_DAEMON_INFO_BIND_PORT);
    return di ? di->port : -1;
}

void http_set_ready(http_server_t *h, int ready) { atomic_store(&h->ready, ready); }

int http_inflight(http_server_t *h) { return atomic_load(&h->inflight); }

void http_stop(http_server_t *h) {
    if (!h)
        return;
    MHD_stop_daemon(h->d);
    job_store_destroy(h->jobs); /* no request thread is left to read it */
    conn_guard_destroy(h->guard);
    free(h->words);
    free(h);
}
