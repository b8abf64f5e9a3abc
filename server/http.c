/* Routes and request handling on libmicrohttpd. */
#include "http.h"

#include <arpa/inet.h>
#include <errno.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "engine/clock.h"
#include "server/api.h"
#include "server/log.h"

#define WAIT_SLICE_S 0.1
#define SSE_KEEPALIVE_S 2.0

struct http_server {
    struct MHD_Daemon *d;
    http_options_t opt;
    char api_key[256];
    model_t *model;
    scheduler_t *sched;
    metrics_t *metrics;
    api_limits_t limits;
    int width, height;
    long created;
    atomic_int ready, inflight;
    metric_t *m_requests;
};

/* Per-connection state, from the first call of the access handler to the
 * completion notice. */
typedef struct conn {
    const char *route; /* metric label */
    char *body;
    size_t len, cap;
    int responded;
    int too_large; /* the body passed the limit: discarded, 413 at the end */
    int counted;   /* counted in inflight */
} conn_t;

/* What a streaming response's reader needs. */
typedef struct sse {
    http_server_t *h;
    struct MHD_Connection *c;
    sched_job_t *job;
    int prompt_tokens;
    unsigned seen; /* the job's version last collected */
    int sent_steps, sent_partials, finished;
    double last_write;
    char *pending;
    size_t pending_len, pending_off;
} sse_t;

static const char *const KNOWN_ROUTES[] = {
    "/health", "/ready", "/metrics", "/v1/models", "/v1/images/generations", NULL};

static void count(http_server_t *h, conn_t *cx, int code) {
    char c[8];
    snprintf(c, sizeof c, "%d", code);
    metric_add(h->m_requests, 1, cx->route, c);
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
        snprintf(ra, sizeof ra, "%d", h->opt.retry_after_s);
        MHD_add_response_header(r, MHD_HTTP_HEADER_RETRY_AFTER, ra);
    }
    if (code == 405) {
        const char *allow = strcmp(cx->route, "/v1/images/generations") ? "GET" : "POST";
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, allow);
    }
    if (code == 401)
        MHD_add_response_header(r, MHD_HTTP_HEADER_WWW_AUTHENTICATE, "Bearer");
    enum MHD_Result ret = MHD_queue_response(c, (unsigned)code, r);
    MHD_destroy_response(r);
    cx->responded = 1;
    count(h, cx, code);
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

/* ---- the scheduler's reasons as HTTP ---- */

/* The request field behind a setting kv_policy_check names. */
static const char *policy_param(const char *field) {
    if (!field)
        return "kv_policy";
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
        api_errorf(e, 400, "n", "kv_pool_too_small",
                   "this request needs %zu bytes of KV cache, more than the pool's %zu: ask for "
                   "fewer images (n) or a shorter prompt",
                   why->need_bytes, why->pool_bytes);
        return;
    case SCHED_REFUSED_TOO_MANY_IMAGES:
        api_errorf(e, 400, "n", "too_many_images",
                   "n = %d is more than the %d images this server runs at once", n_images,
                   why->max_running);
        return;
    case SCHED_REFUSED_QUEUE_FULL:
        api_errorf(e, 429, NULL, "queue_full",
                   "the waiting queue is full (%d requests); retry after %d s", why->max_waiting,
                   retry_after_s);
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

/* Turns what changed in the job since the last call into frames. Returns 1
 * when the stream has said everything, 0 when more is to come, -1 when a
 * frame could not be made (out of memory): the stream then ends broken
 * rather than silently missing an event. */
static int sse_collect(sse_t *s, const sched_snapshot_t *snap) {
    sched_job_t *j = s->job;
    const long now = (long)time(NULL);
    const int W = s->h->width, H = s->h->height;
    if (snap->steps_done > s->sent_steps) {
        for (int i = 0; i < snap->n_images; i++)
            if (sse_append(s, API_SSE_PROGRESS,
                           api_sse_progress(snap->steps_done, snap->steps_total, i)))
                return -1;
        s->sent_steps = snap->steps_done;
    }
    for (; s->sent_partials < snap->n_partials; s->sent_partials++)
        for (int i = 0; i < snap->n_images; i++) {
            char *b64 = png_b64(j, s->sent_partials, i);
            int rc = b64 ? sse_append(s, API_SSE_PARTIAL_IMAGE,
                                      api_sse_partial_image(b64, s->sent_partials, i, now, W, H))
                         : -1;
            free(b64);
            if (rc)
                return -1;
        }
    if (snap->outcome == SCHED_PENDING)
        return 0;
    if (snap->outcome == SCHED_DONE) {
        for (int i = 0; i < snap->n_images; i++) {
            char *b64 = png_b64(j, -1, i);
            int rc = b64 ? sse_append(s, API_SSE_COMPLETED,
                                      api_sse_completed(b64, i, now, W, H,
                                                        model_image_tokens(&s->h->model->cfg),
                                                        s->prompt_tokens))
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
            if (clock_now_s() - s->last_write > SSE_KEEPALIVE_S) {
                static const char ka[] = ": keep-alive\n\n";
                size_t n = sizeof ka - 1 < max ? sizeof ka - 1 : max;
                memcpy(buf, ka, n);
                s->last_write = clock_now_s();
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
    free(s->pending);
    free(s);
}

static enum MHD_Result respond_stream(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                      sched_job_t *j, int prompt_tokens) {
    sse_t *s = calloc(1, sizeof *s);
    if (!s) {
        sched_job_cancel(h->sched, j);
        sched_job_release(j);
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory");
    }
    *s = (sse_t){
        .h = h, .c = c, .job = j, .prompt_tokens = prompt_tokens, .last_write = clock_now_s()};
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
                                      int prompt_tokens) {
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
    api_kv_report_t kv = {.policy = snap->kv_policy,
                          .planned_peak_bytes = snap->kv_planned_peak_bytes,
                          .peak_bytes = snap->kv_peak_bytes};
    api_timings_t timings = {.queue_s = snap->queue_s,
                             .run_s = snap->run_s,
                             .steps = snap->steps_total,
                             .decode_png_s = snap->finish_s};
    char *json = ok ? api_images_response_json((long)time(NULL), snap->n_images,
                                               (const char *const *)b64, h->width, h->height,
                                               model_image_tokens(&h->model->cfg) * snap->n_images,
                                               prompt_tokens, &kv, &timings)
                    : NULL;
    for (int i = 0; b64 && i < snap->n_images; i++)
        free(b64[i]);
    free(b64);
    if (!json)
        return fail(h, c, cx, 500, NULL, "out_of_memory", "out of memory building the response");
    return send_json(h, c, cx, 200, json);
}

/* Waits for a job while its client is there. The snapshot of its end, or
 * 0 when the client went away (the job is then cancelled). */
static int wait_job(http_server_t *h, struct MHD_Connection *c, sched_job_t *j,
                    sched_snapshot_t *snap) {
    sched_job_snapshot(j, snap);
    while (snap->outcome == SCHED_PENDING) {
        sched_job_wait(j, snap->version, WAIT_SLICE_S, snap);
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

/* An answer to a client that went away: nobody reads it, and queueing it
 * (rather than failing the request) keeps libmicrohttpd from logging an
 * internal error. 499 is what the access logs of nginx call it. */
static enum MHD_Result client_gone(http_server_t *h, struct MHD_Connection *c, conn_t *cx) {
    return send_buf(h, c, cx, 499, "text/plain", (void *)"", 0, 0);
}

static enum MHD_Result handle_generate(http_server_t *h, struct MHD_Connection *c, conn_t *cx) {
    api_image_request_t req;
    api_error_t e;
    if (api_parse_image_request(cx->body ? cx->body : "", cx->len, &h->limits, &req, &e) != AR_OK)
        return send_error(h, c, cx, &e);
    int *cond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int *uncond = malloc(MODEL_MAX_PROMPT_TOKENS * sizeof(int));
    int n_prompt = 0;
    ar_error_t err = {{0}};
    enum MHD_Result ret;
    if (!cond || !uncond) {
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
    sched_request_t rq = {.cond = cond,
                          .uncond = uncond,
                          .n_prompt = n_prompt,
                          .n_images = req.n,
                          .seed = req.has_seed ? req.seed : random_seed(),
                          .kv_policy = req.kv_policy,
                          .partial_images = req.stream ? req.partial_images : 0,
                          .timeout_s = h->opt.request_timeout_s};
    api_image_request_sampler_params(&req, &h->model->cfg.sampling, &rq.params);
    sched_refusal_info_t why;
    sched_job_t *j = sched_submit(h->sched, &rq, &why);
    if (!j) {
        http_refusal_error(&why, req.n, h->opt.retry_after_s, &e);
        ret = send_error(h, c, cx, &e);
        goto out;
    }
    if (req.stream) {
        ret = respond_stream(h, c, cx, j, n_prompt);
        goto out;
    }
    sched_snapshot_t snap;
    if (!wait_job(h, c, j, &snap)) {
        ret = client_gone(h, c, cx);
    } else if (snap.outcome == SCHED_DONE) {
        ret = respond_images(h, c, cx, j, &snap, n_prompt);
    } else {
        outcome_error(&snap, &e);
        ret = send_error(h, c, cx, &e);
    }
    sched_job_release(j);
out:
    free(cond);
    free(uncond);
    api_image_request_free(&req);
    return ret;
}

/* ---- dispatch ---- */

/* 404, 405, 401 and 413 (by Content-Length), decided from the headers alone. */
static enum MHD_Result early_errors(http_server_t *h, struct MHD_Connection *c, conn_t *cx,
                                    const char *url, const char *method) {
    int is_get = !strcmp(method, "GET") || !strcmp(method, "HEAD");
    int is_post = !strcmp(method, "POST");
    if (!strcmp(cx->route, "other"))
        return fail(h, c, cx, 404, NULL, "not_found", "no route for %s %s", method, url);
    int want_post = !strcmp(cx->route, "/v1/images/generations");
    if (want_post ? !is_post : !is_get)
        return fail(h, c, cx, 405, NULL, "method_not_allowed", "%s is not allowed on %s; use %s",
                    method, url, want_post ? "POST" : "GET");
    if (!strcmp(cx->route, "/health") || !strcmp(cx->route, "/metrics"))
        return MHD_YES;
    if (!auth_ok(h, c))
        return fail(h, c, cx, 401, NULL, "invalid_api_key",
                    "missing or wrong API key: send 'Authorization: Bearer <key>'");
    const char *cl =
        MHD_lookup_connection_value(c, MHD_HEADER_KIND, MHD_HTTP_HEADER_CONTENT_LENGTH);
    if (want_post && cl && strtoull(cl, NULL, 10) > h->opt.max_body_bytes)
        return fail(h, c, cx, 413, NULL, "request_too_large",
                    "the request body is larger than %zu bytes", h->opt.max_body_bytes);
    return MHD_YES;
}

static enum MHD_Result handle(void *cls, struct MHD_Connection *c, const char *url,
                              const char *method, const char *version, const char *upload_data,
                              size_t *upload_data_size, void **con_cls) {
    http_server_t *h = cls;
    conn_t *cx = *con_cls;
    if (!cx) {
        cx = calloc(1, sizeof *cx);
        if (!cx)
            return MHD_NO;
        cx->route = "other";
        for (const char *const *r = KNOWN_ROUTES; *r; r++)
            if (!strcmp(url, *r))
                cx->route = *r;
        *con_cls = cx;
        atomic_fetch_add(&h->inflight, 1);
        cx->counted = 1;
        /* libmicrohttpd queues a response only now (headers read) or once
         * the whole body is in, so every error that does not need the body
         * is answered now, before any of it is read. */
        return early_errors(h, c, cx, url, method);
    }
    if (cx->responded || (cx->too_large && *upload_data_size)) { /* discard the rest */
        *upload_data_size = 0;
        return MHD_YES;
    }
    /* Route, method and key were checked by early_errors on the first call. */
    const char *route = cx->route;
    if (!strcmp(route, "/health")) {
        int alive = sched_alive(h->sched);
        return send_json(h, c, cx, alive ? 200 : 503,
                         strdup(alive ? "{\"status\":\"ok\"}" : "{\"status\":\"engine stopped\"}"));
    }
    if (!strcmp(route, "/metrics")) {
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
        return send_json(h, c, cx, 200,
                         api_models_json(h->model->cfg.name, h->created,
                                         h->model->cfg.condition.num_classes,
                                         (const char *const *)h->model->class_names));

    /* POST /v1/images/generations: gather the body within the limit. */
    if (*upload_data_size) {
        if (cx->len + *upload_data_size > h->opt.max_body_bytes) {
            *upload_data_size = 0; /* answered once the body is in */
            cx->too_large = 1;
            return MHD_YES;
        }
        if (cx->len + *upload_data_size > cx->cap) {
            size_t cap = cx->cap ? cx->cap : 4096;
            while (cap < cx->len + *upload_data_size)
                cap *= 2;
            char *b = realloc(cx->body, cap);
            if (!b)
                return MHD_NO;
            cx->body = b;
            cx->cap = cap;
        }
        memcpy(cx->body + cx->len, upload_data, *upload_data_size);
        cx->len += *upload_data_size;
        *upload_data_size = 0;
        return MHD_YES;
    }
    if (cx->too_large)
        return fail(h, c, cx, 413, NULL, "request_too_large",
                    "the request body is larger than %zu bytes", h->opt.max_body_bytes);
    if (!atomic_load(&h->ready) || sched_draining(h->sched))
        return fail(h, c, cx, 503, NULL, "not_ready",
                    "the server is not accepting work (loading or shutting down)");
    return handle_generate(h, c, cx);
}

static void completed(void *cls, struct MHD_Connection *c, void **con_cls,
                      enum MHD_RequestTerminationCode toe) {
    http_server_t *h = cls;
    conn_t *cx = *con_cls;
    (void)c;
    (void)toe;
    if (!cx)
        return;
    if (cx->counted)
        atomic_fetch_sub(&h->inflight, 1);
    free(cx->body);
    free(cx);
    *con_cls = NULL;
}

static void mhd_log(void *cls, const char *fmt, va_list ap) {
    (void)cls;
    char msg[512];
    vsnprintf(msg, sizeof msg, fmt, ap);
    size_t n = strlen(msg);
    while (n && (msg[n - 1] == '\n' || msg[n - 1] == '\r'))
        msg[--n] = 0;
    log_msg(LOG_WARN, "http: %s", msg);
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
    h->width = model_config_image_width(&model->cfg);
    h->height = model_config_image_height(&model->cfg);
    h->created = (long)time(NULL);
    h->limits = (api_limits_t){.model_name = model->cfg.name,
                               .max_n = opt->max_n,
                               .n_sizes = 1,
                               .widths = &h->width,
                               .heights = &h->height,
                               .max_prompt_bytes = 4096,
                               .codebook_size = model->cfg.image.codebook_size,
                               .num_classes = model->cfg.condition.num_classes,
                               .class_names = (const char *const *)model->class_names,
                               .kv_defaults = &h->opt.kv_defaults};
    static const char *const labels[] = {"route", "code"};
    h->m_requests = metrics_counter(metrics, "arserve_http_requests_total",
                                    "HTTP requests answered, by route and status code.", 2, labels);

    struct sockaddr_in addr = {.sin_family = AF_INET, .sin_port = htons((uint16_t)opt->port)};
    if (inet_pton(AF_INET, opt->host, &addr.sin_addr) != 1) {
        free(h);
        ar_errorf(err, "--host: '%s' is not an IPv4 address", opt->host);
        return NULL;
    }
    h->d = MHD_start_daemon(
        MHD_USE_THREAD_PER_CONNECTION | MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG |
            MHD_USE_POLL,
        (uint16_t)opt->port, NULL, NULL, handle, h, MHD_OPTION_EXTERNAL_LOGGER, mhd_log, NULL,
        MHD_OPTION_SOCK_ADDR, &addr, MHD_OPTION_NOTIFY_COMPLETED, completed, h,
        MHD_OPTION_CONNECTION_LIMIT, (unsigned)opt->max_connections, MHD_OPTION_CONNECTION_TIMEOUT,
        (unsigned)120, MHD_OPTION_THREAD_STACK_SIZE, (size_t)(512 * 1024), MHD_OPTION_END);
    if (!h->d) {
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
    free(h);
}
