/* A small thread-safe Prometheus metrics registry: counters, gauges and
 * histograms with up to four labels, rendered in the text exposition format
 * 0.0.4 for GET /metrics. Updates are cheap enough for the engine loop. */
#ifndef ARSERVE_METRICS_H
#define ARSERVE_METRICS_H

#include <stddef.h>

/* The Content-Type to answer GET /metrics with. */
#define METRICS_CONTENT_TYPE "text/plain; version=0.0.4; charset=utf-8"

/* Label names per family. */
#define METRICS_MAX_LABELS 4

/* Label-value tuples per family. Once a family holds this many series, an
 * update for a new tuple goes to one extra series whose every label value is
 * "overflow", so a client that varies a label (a route it made up) cannot
 * grow memory or the scrape without bound. The same happens, before the
 * limit, to a label value that is longer than METRICS_MAX_LABEL_VALUE bytes or
 * is not valid UTF-8. */
#define METRICS_MAX_SERIES 64
#define METRICS_MAX_LABEL_VALUE 256
#define METRICS_OVERFLOW_LABEL "overflow"

typedef struct metrics metrics_t;
typedef struct metric metric_t;

/* Returns an empty registry, or NULL when out of memory. */
metrics_t *metrics_create(void);

/* Frees the registry and every metric_t it returned. NULL is a no-op. */
void metrics_destroy(metrics_t *reg);

/* Registration. Each returns the family, or NULL when out of memory; updates
 * on a NULL family do nothing, so a caller may skip the check. These are
 * called at start-up: a bad definition is a programmer error and aborts with
 * a message naming the metric:
 *   - name matches [a-zA-Z_][a-zA-Z0-9_]* (no colons: those are for
 *     recording rules), and neither it nor, for a histogram, its _bucket,
 *     _sum and _count series clash with a family already registered;
 *   - a counter's name ends in "_total" (it is written that way in both the
 *     TYPE line and the samples);
 *   - help is non-empty;
 *   - 0 <= n_labels <= METRICS_MAX_LABELS, label names match the name rule,
 *     do not start with "__", are distinct, and a histogram has no "le";
 *   - histogram bounds are finite and strictly increasing (0..n of them;
 *     the +Inf bucket is implicit). They are copied.
 * A family without labels has its one series from the start, so it renders
 * as 0 before its first update; a family with labels renders its HELP and
 * TYPE lines and no samples until a series is used. */
metric_t *metrics_counter(metrics_t *reg, const char *name, const char *help, int n_labels,
                          const char *const *label_names);
metric_t *metrics_gauge(metrics_t *reg, const char *name, const char *help, int n_labels,
                        const char *const *label_names);
metric_t *metrics_histogram(metrics_t *reg, const char *name, const char *help, int n_labels,
                            const char *const *label_names, const double *bounds, int n_bounds);

/* A gauge without labels whose value is fn(arg), called at each render (and
 * by metric_value) with no registry lock held, so fn may take its own locks.
 * fn must be safe to call from the thread that renders. */
metric_t *metrics_gauge_fn(metrics_t *reg, const char *name, const char *help,
                           double (*fn)(void *arg), void *arg);

/* Updates take exactly as many label values (const char *, in the order of
 * the label names) as the family has label names; a wrong count, a NULL
 * value, or an update that does not fit the type (set on a counter, observe
 * on a gauge, anything on a gauge_fn) aborts with a message, as does a
 * negative or NaN increment to a counter. An update to an existing series
 * takes the family's mutex and does not allocate; the first update to a new
 * tuple allocates its series (when that fails the update is dropped).
 *
 *   metric_add(requests, 1, "/v1/images/generations", "200");
 *   metric_set(running, 3);
 *   metric_observe(step_seconds, 0.012);
 *
 * metric_add: counters and gauges; counters need v >= 0.
 * metric_set: gauges.
 * metric_observe: histograms; v goes in the first bucket whose bound is
 *   >= v (le is inclusive), else only +Inf. NaN counts in +Inf, and the sum
 *   becomes NaN, as in the Go client.
 * metric_value: for tests; the counter or gauge value, or a histogram's
 *   count, of the series with those labels (0 when it does not exist; it is
 *   not created). A gauge_fn returns fn(arg).
 * metric_histogram_sum: for tests; a histogram series' sum (0 when absent).
 *
 * These are macros that pass the values as an array of const char *, so a
 * value of another type (an int status code) does not compile, and the count
 * is checked at run time. */
#define metric_add(m, v, ...) metric_add_n_((m), (v), METRICS_LABELS_(__VA_ARGS__))
#define metric_set(m, v, ...) metric_set_n_((m), (v), METRICS_LABELS_(__VA_ARGS__))
#define metric_observe(m, v, ...) metric_observe_n_((m), (v), METRICS_LABELS_(__VA_ARGS__))
#define metric_value(m, ...) metric_value_n_((m), METRICS_LABELS_(__VA_ARGS__))
#define metric_histogram_sum(m, ...) metric_histogram_sum_n_((m), METRICS_LABELS_(__VA_ARGS__))

/* Renders every family, sorted by name: HELP and TYPE once each, series
 * sorted by their label values (byte order, first label first), histogram
 * buckets cumulative in increasing le then +Inf, then _sum and _count.
 * Returns a NUL-terminated malloc'd string the caller frees ("" for an empty
 * registry), or NULL when out of memory. */
char *metrics_render(metrics_t *reg);

/* Fill out[0..n) with bucket bounds for metrics_histogram: start * factor^i
 * (start > 0, factor > 1), or start + width * i (width > 0). Return out. */
double *metrics_buckets_exponential(double *out, int n, double start, double factor);
double *metrics_buckets_linear(double *out, int n, double start, double width);

/* Implementation details of the macros above: the values array (after a
 * leading NULL, so that no values is still a valid array) and its length.
 * With no values, ", ##__VA_ARGS__" (GNU C, like the attributes in
 * base/status.h) either drops the comma or, under -std=c11, leaves
 * "{NULL,}", which C accepts too: the count is 0 either way. */
#define METRICS_LABELS_(...)                                                                       \
    (const char *const[]){NULL, ##__VA_ARGS__} + 1,                                                \
        (int)(sizeof((const char *const[]){NULL, ##__VA_ARGS__}) / sizeof(const char *)) - 1
void metric_add_n_(metric_t *m, double v, const char *const *values, int n);
void metric_set_n_(metric_t *m, double v, const char *const *values, int n);
void metric_observe_n_(metric_t *m, double v, const char *const *values, int n);
double metric_value_n_(metric_t *m, const char *const *values, int n);
double metric_histogram_sum_n_(metric_t *m, const char *const *values, int n);

#endif
