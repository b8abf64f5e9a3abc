/* Tests for server/metrics.c: exact text for a small registry, each type with
 * and without labels, escaping, number spelling, bucket placement, gauge_fn,
 * the overflow series, ordering, concurrent updates, and that programmer
 * errors abort with a message (checked in a forked child).
 * Run: gcc -std=c11 -D_GNU_SOURCE -I. tests/unit/test_metrics.c server/metrics.c
 *      base/status.c -lpthread -lm && ./a.out */
#include "server/metrics_test.h"
#include "tests/test.h"

#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

/* Checks that got equals want, printing both when not. */
#define CHECK_TEXT(got, want)                                                                      \
    CHECK_MSG((got) && strcmp((got), (want)) == 0, "got:\n%s\nwant:\n%s", (got) ? (got) : "NULL",  \
              (want))

static const char *const route_code[] = {"route", "code"};

static void test_exact_text_small_registry(void) {
    metrics_t *r = metrics_create();
    metric_t *req = metrics_counter(r, "arserve_http_requests_total",
                                    "HTTP requests by route and code.", 2, route_code);
    metric_t *run = metrics_gauge(r, "arserve_requests_running", "Requests running now.", 0, NULL);
    const double bounds[] = {0.1, 1};
    metric_t *lat = metrics_histogram(r, "arserve_request_duration_seconds", "End-to-end latency.",
                                      0, NULL, bounds, 2);
    metric_add(req, 1, "/v1/images/generations", "200");
    metric_add(req, 2, "/health", "200");
    metric_set(run, 3);
    metric_observe(lat, 0.25);
    metric_observe(lat, 1);
    metric_observe(lat, 7.5);
    char *text = metrics_render(r);
    CHECK_TEXT(text,
               "# HELP arserve_http_requests_total HTTP requests by route and code.\n"
               "# TYPE arserve_http_requests_total counter\n"
               "arserve_http_requests_total{route=\"/health\",code=\"200\"} 2\n"
               "arserve_http_requests_total{route=\"/v1/images/generations\",code=\"200\"} 1\n"
               "# HELP arserve_request_duration_seconds End-to-end latency.\n"
               "# TYPE arserve_request_duration_seconds histogram\n"
               "arserve_request_duration_seconds_bucket{le=\"0.1\"} 0\n"
               "arserve_request_duration_seconds_bucket{le=\"1\"} 2\n"
               "arserve_request_duration_seconds_bucket{le=\"+Inf\"} 3\n"
               "arserve_request_duration_seconds_sum 8.75\n"
               "arserve_request_duration_seconds_count 3\n"
               "# HELP arserve_requests_running Requests running now.\n"
               "# TYPE arserve_requests_running gauge\n"
               "arserve_requests_running 3\n");
    free(text);
    metrics_destroy(r);
}

static void test_empty_registry_renders_empty_string(void) {
    metrics_t *r = metrics_create();
    char *text = metrics_render(r);
    CHECK_TEXT(text, "");
    free(text);
    metrics_destroy(r);
}

/* Without labels a family shows 0 before any update; with labels it shows
 * only HELP and TYPE until a series is used. */
static void test_unlabelled_zero_and_labelled_empty(void) {
    metrics_t *r = metrics_create();
    const char *const status[] = {"status"};
    metrics_counter(r, "a_total", "A.", 0, NULL);
    metrics_gauge(r, "b", "B.", 1, status);
    metrics_histogram(r, "c_seconds", "C.", 0, NULL, NULL, 0);
    char *text = metrics_render(r);
    CHECK_TEXT(text, "# HELP a_total A.\n# TYPE a_total counter\na_total 0\n"
                     "# HELP b B.\n# TYPE b gauge\n"
                     "# HELP c_seconds C.\n# TYPE c_seconds histogram\n"
                     "c_seconds_bucket{le=\"+Inf\"} 0\nc_seconds_sum 0\nc_seconds_count 0\n");
    free(text);
    metrics_destroy(r);
}

static void test_counter_and_gauge_values(void) {
    metrics_t *r = metrics_create();
    const char *const status[] = {"status"};
    metric_t *c = metrics_counter(r, "images_total", "Images.", 1, status);
    metric_t *g = metrics_gauge(r, "kv_bytes", "KV bytes.", 1, status);
    metric_add(c, 1, "ok");
    metric_add(c, 2.5, "ok");
    metric_add(c, 0, "error");
    metric_add(g, 10, "used");
    metric_add(g, -4, "used");
    metric_set(g, 7, "reserved");
    CHECK(metric_value(c, "ok") == 3.5);
    CHECK(metric_value(c, "error") == 0);
    CHECK(metric_value(c, "never") == 0);
    CHECK(metric_value(g, "used") == 6);
    CHECK(metric_value(g, "reserved") == 7);
    const char *const used[] = {"used"};
    metric_set_v(g, 1, used);
    metric_add_v(g, 1, used);
    CHECK(metric_value_v(g, used) == 2);
    char *text = metrics_render(r);
    CHECK_STR_CONTAINS(text, "images_total{status=\"error\"} 0\nimages_total{status=\"ok\"} 3.5\n");
    CHECK_STR_CONTAINS(text, "kv_bytes{status=\"reserved\"} 7\nkv_bytes{status=\"used\"} 2\n");
    /* metric_value does not create series. */
    CHECK(strstr(text, "never") == NULL);
    free(text);
    metrics_destroy(r);
}

static void test_histogram_with_labels(void) {
    metrics_t *r = metrics_create();
    const char *const model[] = {"model"};
    const double bounds[] = {1, 2, 4};
    metric_t *h = metrics_histogram(r, "seqs", "Sequences per iteration.", 1, model, bounds, 3);
    metric_observe(h, 3, "tiny");
    metric_observe(h, 1, "big");
    metric_observe(h, 9, "tiny");
    CHECK(metric_value(h, "tiny") == 2);
    CHECK(metric_histogram_sum(h, "tiny") == 12);
    char *text = metrics_render(r);
    CHECK_TEXT(text, "# HELP seqs Sequences per iteration.\n# TYPE seqs histogram\n"
                     "seqs_bucket{model=\"big\",le=\"1\"} 1\n"
                     "seqs_bucket{model=\"big\",le=\"2\"} 1\n"
                     "seqs_bucket{model=\"big\",le=\"4\"} 1\n"
                     "seqs_bucket{model=\"big\",le=\"+Inf\"} 1\n"
                     "seqs_sum{model=\"big\"} 1\n"
                     "seqs_count{model=\"big\"} 1\n"
                     "seqs_bucket{model=\"tiny\",le=\"1\"} 0\n"
                     "seqs_bucket{model=\"tiny\",le=\"2\"} 0\n"
                     "seqs_bucket{model=\"tiny\",le=\"4\"} 1\n"
                     "seqs_bucket{model=\"tiny\",le=\"+Inf\"} 2\n"
                     "seqs_sum{model=\"tiny\"} 12\n"
                     "seqs_count{model=\"tiny\"} 2\n");
    free(text);
    metrics_destroy(r);
}

/* le is inclusive: a value equal to a bound counts in that bucket; one just
 * above goes to the next; below the first and above the last, and NaN. */
static void test_bucket_placement(void) {
    metrics_t *r = metrics_create();
    const double bounds[] = {0.5, 1, 2};
    metric_t *h = metrics_histogram(r, "h_seconds", "H.", 0, NULL, bounds, 3);
    metric_observe(h, 0.5);
    metric_observe(h, 1);
    metric_observe(h, nextafter(1, 2));
    metric_observe(h, 2);
    metric_observe(h, -3);
    metric_observe(h, 1e9);
    char *text = metrics_render(r);
    CHECK_STR_CONTAINS(text, "h_seconds_bucket{le=\"0.5\"} 2\n"
                             "h_seconds_bucket{le=\"1\"} 3\n"
                             "h_seconds_bucket{le=\"2\"} 5\n"
                             "h_seconds_bucket{le=\"+Inf\"} 6\n");
    CHECK_STR_CONTAINS(text, "h_seconds_count 6\n");
    free(text);
    metric_observe(h, NAN);
    text = metrics_render(r);
    CHECK_STR_CONTAINS(text, "h_seconds_bucket{le=\"2\"} 5\nh_seconds_bucket{le=\"+Inf\"} 7\n"
                             "h_seconds_sum NaN\nh_seconds_count 7\n");
    free(text);
    metrics_destroy(r);
}

static void test_bucket_helpers(void) {
    double e[4], l[3];
    metrics_buckets_exponential(e, 4, 0.001, 10);
    CHECK(e[0] == 0.001 && fabs(e[3] - 1) < 1e-12 && e[1] < e[2]);
    metrics_buckets_linear(l, 3, 1, 2);
    CHECK(l[0] == 1 && l[1] == 3 && l[2] == 5);
    metrics_t *r = metrics_create();
    CHECK(metrics_histogram(r, "x_seconds", "X.", 0, NULL, e, 4) != NULL);
    metrics_destroy(r);
}

/* Label values escape \, " and newline; HELP escapes \ and newline only. */
static void test_escaping(void) {
    metrics_t *r = metrics_create();
    const char *const path[] = {"path"};
    metric_t *g =
        metrics_gauge(r, "g", "Help with \\ backslash,\nnewline and \"quotes\".", 1, path);
    metric_set(g, 1, "a\\b\"c\nd");
    char *text = metrics_render(r);
    CHECK_TEXT(text, "# HELP g Help with \\\\ backslash,\\nnewline and \"quotes\".\n"
                     "# TYPE g gauge\n"
                     "g{path=\"a\\\\b\\\"c\\nd\"} 1\n");
    free(text);
    metrics_destroy(r);
}

static void test_number_spelling(void) {
    struct {
        double v;
        const char *want;
    } cases[] = {
        {0, "0"},
        {-0.0, "0"},
        {42, "42"},
        {-7, "-7"},
        {123456789012, "123456789012"},
        {0.1, "0.1"},
        {-2.5, "-2.5"},
        {1e20, "1e+20"},
        {1.5e-7, "1.5e-07"},
        {NAN, "NaN"},
        {INFINITY, "+Inf"},
        {-INFINITY, "-Inf"},
        {4294967296.0, "4294967296"},
    };
    metrics_t *r = metrics_create();
    metric_t *g = metrics_gauge(r, "n", "N.", 0, NULL);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        metric_set(g, cases[i].v);
        char *text = metrics_render(r), want[64];
        snprintf(want, sizeof want, "\nn %s\n", cases[i].want);
        CHECK_STR_CONTAINS(text, want);
        free(text);
    }
    /* Values that need many digits read back exactly. */
    const double exact[] = {1.0 / 3, 0.1 + 0.2, 1e300, 5e-324, 1234567.891};
    for (size_t i = 0; i < sizeof exact / sizeof exact[0]; i++) {
        metric_set(g, exact[i]);
        char *text = metrics_render(r);
        const char *at = text ? strstr(text, "\nn ") : NULL;
        CHECK_MSG(at && strtod(at + 3, NULL) == exact[i], "%.17g rendered as %s", exact[i],
                  at ? at + 3 : "nothing");
        free(text);
    }
    metrics_destroy(r);
}

static double read_counter(void *arg) { return (double)*(int *)arg * 1.5; }

static void test_gauge_fn(void) {
    metrics_t *r = metrics_create();
    int x = 2;
    metric_t *g =
        metrics_gauge_fn(r, "jemalloc_allocated_bytes", "Bytes allocated.", read_counter, &x);
    CHECK(metric_value(g) == 3);
    char *text = metrics_render(r);
    CHECK_TEXT(text, "# HELP jemalloc_allocated_bytes Bytes allocated.\n"
                     "# TYPE jemalloc_allocated_bytes gauge\n"
                     "jemalloc_allocated_bytes 3\n");
    free(text);
    x = 10;
    text = metrics_render(r);
    CHECK_STR_CONTAINS(text, "jemalloc_allocated_bytes 15\n");
    free(text);
    metrics_destroy(r);
}

/* Past METRICS_MAX_SERIES tuples, new ones land in the all-"overflow" series;
 * tuples already there keep counting on their own; values too long or not
 * UTF-8 go to overflow from the start. */
static void test_overflow_series(void) {
    metrics_t *r = metrics_create();
    metric_t *c = metrics_counter(r, "req_total", "Requests.", 2, route_code);
    char route[32];
    for (int i = 0; i < METRICS_MAX_SERIES + 10; i++) {
        snprintf(route, sizeof route, "/r%03d", i);
        metric_add(c, 1, route, "200");
    }
    metric_add(c, 1, "/r000", "200");
    CHECK(metric_value(c, "/r000", "200") == 2);
    snprintf(route, sizeof route, "/r%03d", METRICS_MAX_SERIES - 1);
    CHECK(metric_value(c, route, "200") == 1);
    snprintf(route, sizeof route, "/r%03d", METRICS_MAX_SERIES);
    CHECK(metric_value(c, route, "200") == 0);
    CHECK(metric_value(c, "overflow", "overflow") == 10);
    char *text = metrics_render(r);
    int lines = 0;
    for (const char *p = text; p && *p; p++)
        lines += *p == '\n';
    CHECK(lines == 2 + METRICS_MAX_SERIES + 1);
    CHECK_STR_CONTAINS(text, "req_total{route=\"overflow\",code=\"overflow\"} 10\n");
    free(text);
    metrics_destroy(r);

    r = metrics_create();
    c = metrics_counter(r, "req_total", "Requests.", 2, route_code);
    char long_value[METRICS_MAX_LABEL_VALUE + 2];
    memset(long_value, 'x', sizeof long_value - 1);
    long_value[sizeof long_value - 1] = 0;
    metric_add(c, 1, long_value, "200");
    metric_add(c, 1, "/bad\xff", "200");
    metric_add(c, 1, "/overlong\xc0\xaf", "200");
    metric_add(c, 1, "/cut\xe2\x82", "200");
    metric_add(c, 1, "/euro\xe2\x82\xac", "200");
    long_value[METRICS_MAX_LABEL_VALUE] = 0;
    metric_add(c, 1, long_value, "200");
    CHECK(metric_value(c, "overflow", "overflow") == 4);
    CHECK(metric_value(c, "/euro\xe2\x82\xac", "200") == 1);
    CHECK(metric_value(c, long_value, "200") == 1);
    metrics_destroy(r);
}

/* Families sort by name and series by label values, whatever the order of
 * registration and first use. */
static void test_deterministic_order(void) {
    const char *names[] = {"zeta_total", "alpha_total", "mid_total"};
    const char *routes[] = {"/b", "/a", "/c", "/a"};
    const char *codes[] = {"500", "200", "200", "404"};
    char *texts[2];
    for (int round = 0; round < 2; round++) {
        metrics_t *r = metrics_create();
        for (int k = 0; k < 3; k++) {
            int i = round ? 2 - k : k;
            metric_t *c = metrics_counter(r, names[i], "Help.", 2, route_code);
            for (int j = 0; j < 4; j++) {
                int jj = round ? 3 - j : j;
                metric_add(c, 1, routes[jj], codes[jj]);
            }
        }
        texts[round] = metrics_render(r);
        metrics_destroy(r);
    }
    CHECK_TEXT(texts[1], texts[0]);
    const char *a = strstr(texts[0], "# HELP alpha_total"), *m = strstr(texts[0], "# HELP mid"),
               *z = strstr(texts[0], "# HELP zeta");
    CHECK(a && m && z && a < m && m < z);
    CHECK_STR_CONTAINS(texts[0], "alpha_total{route=\"/a\",code=\"200\"} 1\n"
                                 "alpha_total{route=\"/a\",code=\"404\"} 1\n"
                                 "alpha_total{route=\"/b\",code=\"500\"} 1\n"
                                 "alpha_total{route=\"/c\",code=\"200\"} 1\n");
    free(texts[0]);
    free(texts[1]);
}

typedef struct {
    metric_t *counter, *plain, *hist;
    int id;
} worker_arg_t;

static void *worker(void *p) {
    worker_arg_t *w = p;
    const char *routes[] = {"/a", "/b"};
    for (int i = 0; i < 10000; i++) {
        metric_add(w->counter, 1, routes[i & 1]);
        metric_add(w->plain, 1);
        metric_observe(w->hist, (double)(i % 4));
    }
    return NULL;
}

static void *renderer(void *p) {
    metrics_t *r = p;
    for (int i = 0; i < 50; i++)
        free(metrics_render(r));
    return NULL;
}

/* 4 threads x 10000 updates each, with a render running beside them, give
 * exact totals. */
static void test_concurrent_updates(void) {
    metrics_t *r = metrics_create();
    const char *const route[] = {"route"};
    const double bounds[] = {0, 1, 2};
    worker_arg_t args[4];
    metric_t *counter = metrics_counter(r, "c_total", "C.", 1, route);
    metric_t *plain = metrics_counter(r, "p_total", "P.", 0, NULL);
    metric_t *hist = metrics_histogram(r, "h", "H.", 0, NULL, bounds, 3);
    pthread_t threads[5];
    for (int i = 0; i < 4; i++) {
        args[i] = (worker_arg_t){counter, plain, hist, i};
        pthread_create(&threads[i], NULL, worker, &args[i]);
    }
    pthread_create(&threads[4], NULL, renderer, r);
    for (int i = 0; i < 5; i++)
        pthread_join(threads[i], NULL);
    CHECK(metric_value(plain) == 40000);
    CHECK(metric_value(counter, "/a") == 20000);
    CHECK(metric_value(counter, "/b") == 20000);
    CHECK(metric_value(hist) == 40000);
    CHECK(metric_histogram_sum(hist) == 60000);
    char *text = metrics_render(r);
    CHECK_STR_CONTAINS(text, "h_bucket{le=\"0\"} 10000\nh_bucket{le=\"1\"} 20000\n"
                             "h_bucket{le=\"2\"} 30000\nh_bucket{le=\"+Inf\"} 40000\n");
    free(text);
    metrics_destroy(r);
}

/* Runs fn in a child and checks that it aborts with a message containing want. */
static void expect_abort(void (*fn)(void), const char *what, const char *want) {
    int fds[2];
    if (pipe(fds) != 0) {
        CHECK(!"pipe");
        return;
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        dup2(fds[1], 2);
        close(fds[0]);
        fn();
        _exit(0);
    }
    close(fds[1]);
    char msg[1024];
    size_t len = 0;
    ssize_t n;
    while ((n = read(fds[0], msg + len, sizeof msg - 1 - len)) > 0)
        len += (size_t)n;
    msg[len] = 0;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK_MSG(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT, "%s did not abort", what);
    CHECK_MSG(strstr(msg, want) != NULL, "%s: message \"%s\" lacks \"%s\"", what, msg, want);
}

static metrics_t *reg(void) { return metrics_create(); }
static void bad_colon(void) { metrics_gauge(reg(), "a:b", "H.", 0, NULL); }
static void bad_first_char(void) { metrics_gauge(reg(), "1abc", "H.", 0, NULL); }
static void bad_counter_suffix(void) { metrics_counter(reg(), "requests", "H.", 0, NULL); }
static void bad_help(void) { metrics_gauge(reg(), "g", "", 0, NULL); }
static void bad_label_reserved(void) {
    const char *const l[] = {"__name"};
    metrics_gauge(reg(), "g", "H.", 1, l);
}
static void bad_label_le(void) {
    const char *const l[] = {"le"};
    metrics_histogram(reg(), "h", "H.", 1, l, NULL, 0);
}
static void bad_label_repeated(void) {
    const char *const l[] = {"a", "a"};
    metrics_gauge(reg(), "g", "H.", 2, l);
}
static void bad_label_count(void) {
    const char *const l[] = {"a", "b", "c", "d", "e"};
    metrics_gauge(reg(), "g", "H.", 5, l);
}
static void bad_bounds_order(void) {
    const double b[] = {1, 1};
    metrics_histogram(reg(), "h", "H.", 0, NULL, b, 2);
}
static void bad_bounds_inf(void) {
    const double b[] = {1, INFINITY};
    metrics_histogram(reg(), "h", "H.", 0, NULL, b, 2);
}
static void bad_duplicate(void) {
    metrics_t *r = reg();
    metrics_gauge(r, "g", "H.", 0, NULL);
    metrics_gauge(r, "g", "H.", 0, NULL);
}
static void bad_histogram_clash(void) {
    metrics_t *r = reg();
    metrics_gauge(r, "lat_count", "H.", 0, NULL);
    metrics_histogram(r, "lat", "H.", 0, NULL, NULL, 0);
}
static void bad_too_few_values(void) {
    metric_add(metrics_counter(reg(), "c_total", "H.", 2, route_code), 1, "/a");
}
static void bad_too_many_values(void) {
    metric_add(metrics_counter(reg(), "c_total", "H.", 0, NULL), 1, "/a");
}
static void bad_null_value(void) {
    metric_add(metrics_counter(reg(), "c_total", "H.", 2, route_code), 1, "/a", (char *)NULL);
}
static void bad_negative_increment(void) {
    metric_add(metrics_counter(reg(), "c_total", "H.", 0, NULL), -1);
}
static void bad_set_on_counter(void) {
    metric_set(metrics_counter(reg(), "c_total", "H.", 0, NULL), 1);
}
static void bad_observe_on_gauge(void) {
    metric_observe(metrics_gauge(reg(), "g", "H.", 0, NULL), 1);
}
static void bad_set_on_gauge_fn(void) {
    int x = 0;
    metric_set(metrics_gauge_fn(reg(), "g", "H.", read_counter, &x), 1);
}
static void good_registration(void) {
    metrics_t *r = reg();
    const char *const l[] = {"_x", "code"};
    const double b[] = {1};
    metrics_counter(r, "_total", "H.", 2, l);
    metrics_histogram(r, "lat_seconds", "H.", 2, l, b, 1);
    metrics_gauge(r, "lat", "H.", 0, NULL); /* no clash with lat_seconds */
    metrics_destroy(r);
    abort();
}

static void test_programmer_errors_abort(void) {
    expect_abort(bad_colon, "colon in name", "a:b");
    expect_abort(bad_first_char, "digit first", "[a-zA-Z_]");
    expect_abort(bad_counter_suffix, "counter without _total", "_total");
    expect_abort(bad_help, "empty help", "help");
    expect_abort(bad_label_reserved, "__ label", "__name");
    expect_abort(bad_label_le, "le on histogram", "\"le\"");
    expect_abort(bad_label_repeated, "repeated label", "repeated");
    expect_abort(bad_label_count, "five labels", "5 labels");
    expect_abort(bad_bounds_order, "equal bounds", "strictly");
    expect_abort(bad_bounds_inf, "+Inf bound", "not finite");
    expect_abort(bad_duplicate, "duplicate name", "clashes");
    expect_abort(bad_histogram_clash, "histogram _count clash", "lat_count");
    expect_abort(bad_too_few_values, "one of two labels", "1 label values given, it takes 2");
    expect_abort(bad_too_many_values, "a label on a plain counter", "1 label values given");
    expect_abort(bad_null_value, "NULL label value", "NULL");
    expect_abort(bad_negative_increment, "negative increment", "only go up");
    expect_abort(bad_set_on_counter, "set on counter", "metric_set on \"c_total\"");
    expect_abort(bad_observe_on_gauge, "observe on gauge", "metric_observe");
    expect_abort(bad_set_on_gauge_fn, "set on gauge_fn", "function");
    /* The control: valid definitions reach the abort() at the end silently. */
    expect_abort(good_registration, "valid definitions", "");
}

static void test_null_family_is_a_no_op(void) {
    metric_add(NULL, 1, "x");
    metric_set(NULL, 1);
    metric_observe(NULL, 1, "a", "b");
    CHECK(metric_value(NULL) == 0);
    metrics_destroy(NULL);
    CHECK(metrics_render(NULL) == NULL);
}

int main(void) {
    TEST_RUN(test_exact_text_small_registry);
    TEST_RUN(test_empty_registry_renders_empty_string);
    TEST_RUN(test_unlabelled_zero_and_labelled_empty);
    TEST_RUN(test_counter_and_gauge_values);
    TEST_RUN(test_histogram_with_labels);
    TEST_RUN(test_bucket_placement);
    TEST_RUN(test_bucket_helpers);
    TEST_RUN(test_escaping);
    TEST_RUN(test_number_spelling);
    TEST_RUN(test_gauge_fn);
    TEST_RUN(test_overflow_series);
    TEST_RUN(test_deterministic_order);
    TEST_RUN(test_concurrent_updates);
    TEST_RUN(test_programmer_errors_abort);
    TEST_RUN(test_null_family_is_a_no_op);
    return TEST_SUMMARY();
}
