/* A dead device is not hidden: the tiny model (ARSERVE_TINY_MODEL) served by
 * the daemon's scheduler and HTTP front on a loopback port, on the CUDA
 * backend built against the emulator (tests/cuda_emu). A device fault
 * planted in the next kernel launch fails a generation; from then on
 * /health and /ready answer 503 naming the CUDA error,
 * arserve_backend_healthy is 0, and the log said so once.
 *
 * daemon.c itself is not linked: it opens backends by name, and a daemon
 * binary has no emulator in it. start() makes what daemon_start makes (a
 * CUDA backend reserving the free memory, the model, metrics, the scheduler
 * with its drawing fork, the HTTP server, ready), and requests go through
 * cli/http_client with deadlines, so a hang fails instead of stalling. */
#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/http_client.h"
#include "engine/backend/backend.h"
#include "engine/model.h"
#include "engine/policy/kv_policy.h"
#include "server/http.h"
#include "server/metrics.h"
#include "server/scheduler.h"
#include "tests/cuda_emu/cuda_emu.h"
#include "tests/test.h"

/* Safety net for the whole binary (seconds): SIGALRM ends it, and
 * run_unit.sh reports a binary that printed no summary. */
#define DEADLINE_S 600
/* Per request: a generation of the tiny model under the emulator takes
 * about a second here. */
#define REQUEST_TIMEOUT_S 120.0

static const char *tiny;
static backend_t *be;
static model_t model;
static int model_loaded;
static metrics_t *metrics;
static scheduler_t *sched;
static http_server_t *http;
static http_target_t target;

static int start(ar_error_t *err) {
    if (!(be = backend_cuda_create(0, 0, err)) || model_load(&model, tiny, be, err) != AR_OK)
        return AR_ERR;
    model_loaded = 1;
    if (!(metrics = metrics_create()))
        return ar_errorf(err, "out of memory");
    sched_options_t so = {.max_running = 2,
                          .max_waiting = 4,
                          .kv_pool_bytes = (size_t)16 << 20,
                          .kv_dtype = DTYPE_F32,
                          .png_workers = 1,
                          .draw_threads = 1};
    if (!(sched = scheduler_create(&model, &so, metrics, err)))
        return AR_ERR;
    http_options_t ho = {.host = "127.0.0.1",
                         .port = 0,
                         .api_key = "",
                         .max_body_bytes = 1 << 20,
                         .max_n = 2,
                         .max_connections = 16,
                         .header_timeout_s = 10,
                         .body_timeout_s = 10,
                         .linger_s = 1,
                         .sse_keepalive_s = 2,
                         .retry_after_s = 1,
                         .request_timeout_s = REQUEST_TIMEOUT_S};
    kv_policy_defaults(&ho.kv_defaults, KV_POLICY_FULL);
    if (!(http = http_start(&ho, &model, sched, metrics, err)))
        return AR_ERR;
    http_set_ready(http, 1);
    char url[64], why[160];
    snprintf(url, sizeof url, "http://127.0.0.1:%d", http_port(http));
    if (http_target_parse(&target, url, why, sizeof why) != 0)
        return ar_errorf(err, "%s: %s", url, why);
    return AR_OK;
}

/* Torn down as the daemon does, after the fault too (a faulted device's
 * teardown complains but must not hang or crash). */
static void stop(void) {
    if (sched)
        scheduler_stop(sched);
    http_stop(http);
    scheduler_destroy(sched);
    if (model_loaded)
        model_free(&model);
    if (be)
        be->destroy(be);
    metrics_destroy(metrics);
}

/* The status of method path; the body in *body (freed by the caller). */
static int request(const char *method, const char *path, const char *json, char **body) {
    http_response_t r;
    http_request(&target, method, path, NULL, json ? "application/json" : NULL, json,
                 json ? strlen(json) : 0, REQUEST_TIMEOUT_S, &r);
    CHECK_MSG(r.status != 0, "%s %s: no answer: %s", method, path, r.why);
    *body = r.body;
    r.body = NULL;
    const int status = r.status;
    http_response_free(&r);
    return status;
}

static int get(const char *path, char **body) { return request("GET", path, NULL, body); }

/* POST a generation; its body into *body when body is given (free it). */
static int generate_body(char **body) {
    char *text = NULL;
    const int status =
        request("POST", "/v1/images/generations",
                "{\"prompt\":\"a red circle\",\"response_format\":\"b64_json\"}", &text);
    if (body)
        *body = text;
    else
        free(text);
    return status;
}

static int generate(void) { return generate_body(NULL); }

/* The value of the sample line "name value" in a /metrics text; NAN when absent. */
static double sample(const char *text, const char *name) {
    const size_t n = strlen(name);
    for (const char *line = text; *line;) {
        if (!strncmp(line, name, n) && line[n] == ' ')
            return strtod(line + n + 1, NULL);
        const char *end = strchr(line, '\n');
        if (!end)
            break;
        line = end + 1;
    }
    return NAN;
}

static double backend_healthy(void) {
    char *text = NULL;
    CHECK(get("/metrics", &text) == 200);
    const double v = text ? sample(text, "arserve_backend_healthy") : NAN;
    free(text);
    return v;
}

/* route answers 503 with {"status":"unhealthy","reason":"backend cuda unusable after: ..."}
 * naming the planted CUDA error. */
static void check_unhealthy(const char *route) {
    char *body = NULL;
    CHECK_MSG(get(route, &body) == 503, "%s: %s", route, body ? body : "");
    cJSON *o = body ? cJSON_Parse(body) : NULL;
    CHECK_MSG(o != NULL, "%s: not JSON: %s", route, body ? body : "");
    const char *status = cJSON_GetStringValue(cJSON_GetObjectItem(o, "status"));
    const char *reason = cJSON_GetStringValue(cJSON_GetObjectItem(o, "reason"));
    CHECK_MSG(status && !strcmp(status, "unhealthy"), "%s: %s", route, body ? body : "");
    CHECK_MSG(reason && !strncmp(reason, "backend cuda unusable after: ", 29), "%s: %s", route,
              body ? body : "");
    if (reason) {
        CHECK_STR_CONTAINS(reason, "an illegal memory access was encountered");
        CHECK_STR_CONTAINS(reason, "cudaErrorIllegalAddress");
    }
    cJSON_Delete(o);
    free(body);
}

/* Before any fault the CUDA daemon serves, and says it is healthy. */
static void test_healthy_backend_answers_200(void) {
    char *body = NULL;
    CHECK(get("/health", &body) == 200);
    CHECK_MSG(body && !strcmp(body, "{\"status\":\"ok\"}"), "%s", body ? body : "");
    free(body);
    CHECK(get("/ready", &body) == 200);
    free(body);
    CHECK(sched_backend_unusable(sched) == NULL);
    CHECK(backend_healthy() == 1);
    CHECK(generate() == 200);
    CHECK(get("/health", &body) == 200);
    free(body);
    CHECK(backend_healthy() == 1);
}

/* The stderr of fn(), in a malloc'd string (then written to stderr too). */
static char *capture_stderr(void (*fn)(void)) {
    fflush(stderr);
    FILE *f = tmpfile();
    const int saved = dup(STDERR_FILENO);
    CHECK(f && saved >= 0);
    if (!f || saved < 0) {
        fn();
        return NULL;
    }
    dup2(fileno(f), STDERR_FILENO);
    fn();
    fflush(stderr);
    dup2(saved, STDERR_FILENO);
    close(saved);
    const long len = ftell(f);
    char *text = len >= 0 ? calloc((size_t)len + 1, 1) : NULL;
    rewind(f);
    if (text && fread(text, 1, (size_t)len, f) != (size_t)len)
        text[0] = 0;
    fclose(f);
    if (text)
        fputs(text, stderr);
    return text;
}

static int count(const char *text, const char *needle) {
    int n = 0;
    for (const char *p = text; (p = strstr(p, needle)); p += strlen(needle))
        n++;
    return n;
}

static void fail_twice(void) {
    cuda_emu_fault_launch(0, cudaErrorIllegalAddress);
    CHECK(generate() == 500); /* the fault fails the step, and the request with it */
    check_unhealthy("/health");
    check_unhealthy("/ready");
    CHECK(backend_healthy() == 0);
    /* a later request is refused before it queues: no step runs on a dead device */
    char *body = NULL;
    CHECK(generate_body(&body) == 503);
    CHECK_STR_CONTAINS(body ? body : "", "\"backend_unusable\"");
    CHECK_STR_CONTAINS(body ? body : "", "backend cuda unusable after: ");
    free(body);
}

/* After a device fault: 503 from /health and /ready with the reason, the
 * gauge at 0, later generations refused with 503, and one log line. */
static void test_device_fault_turns_health_and_ready_503(void) {
    char *log = capture_stderr(fail_twice);
    CHECK(log != NULL);
    if (log) {
        CHECK_STR_CONTAINS(log, "planted fault");
        /* the log line, at level error (the words alone would match this file's own FAILs) */
        const char *line = " error backend cuda unusable after: ";
        CHECK_MSG(count(log, line) == 1, "the log says the backend is unusable %d times, not once",
                  count(log, line));
    }
    free(log);
    check_unhealthy("/health"); /* and it stays so */
    CHECK(backend_healthy() == 0);
}

int main(void) {
    alarm(DEADLINE_S);
    tiny = getenv("ARSERVE_TINY_MODEL");
    if (!tiny) {
        printf("ARSERVE_TINY_MODEL is not set (make test-backend sets it)\n0 passed, 1 failed\n");
        return 1;
    }
    ar_error_t err = {{0}};
    if (start(&err) != AR_OK) {
        fprintf(stderr, "%s\n", err.msg);
        stop();
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_healthy_backend_answers_200);
    TEST_RUN(test_device_fault_turns_health_and_ready_503);
    stop();
    return TEST_SUMMARY();
}
