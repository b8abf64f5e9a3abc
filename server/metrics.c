/* The Prometheus registry behind GET /metrics: families hold their series in
 * an array kept sorted by label values, so an update is a mutex and a binary
 * search, and a render walks them in order. Format: text exposition 0.0.4. */
#include "server/metrics.h"
#include "server/metrics_test.h"

#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef enum { KIND_COUNTER, KIND_GAUGE, KIND_HISTOGRAM, KIND_GAUGE_FN } metric_kind_t;

/* One label-value tuple of a family; allocated in one block with its bucket
 * counts and label strings behind it. */
typedef struct series {
    const char *values[METRICS_MAX_LABELS];
    double value;      /* counter, gauge */
    double sum;        /* histogram */
    uint64_t count;    /* histogram */
    uint64_t *buckets; /* histogram: n_bounds + 1 counts, not cumulative */
} series_t;

struct metric {
    pthread_mutex_t mu; /* guards series, n_series and every series_t */
    metric_kind_t kind;
    char *name, *help;
    int n_labels;
    char *label_names[METRICS_MAX_LABELS];
    double *bounds;
    int n_bounds;
    double (*fn)(void *);
    void *fn_arg;
    /* Sorted by values. Regular tuples stop at METRICS_MAX_SERIES; the last
     * slot is for the "overflow" tuple. */
    series_t *series[METRICS_MAX_SERIES + 1];
    int n_series;
};

struct metrics {
    pthread_mutex_t mu; /* guards the family list, not the families */
    metric_t **families;
    int n_families, cap_families;
};

static const char *kind_name(metric_kind_t kind) {
    switch (kind) {
    case KIND_COUNTER:
        return "counter";
    case KIND_HISTOGRAM:
        return "histogram";
    default:
        return "gauge";
    }
}

/* Programmer errors: say what is wrong with which metric, then abort. These
 * stay on in release builds; they are checks on a few integers. */
__attribute__((noreturn, format(printf, 1, 2))) static void die(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fputs("metrics: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    abort();
}

static bool is_valid_name(const char *s) {
    if (!s || !*s)
        return false;
    for (const char *p = s; *p; p++) {
        char c = *p;
        bool alpha = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_';
        if (!alpha && (p == s || c < '0' || c > '9'))
            return false;
    }
    return true;
}

/* Strict UTF-8: no overlong forms, no surrogates, nothing above U+10FFFF. */
static bool is_valid_utf8(const char *str) {
    const unsigned char *s = (const unsigned char *)str;
    while (*s) {
        unsigned c = *s;
        int extra;
        unsigned min, cp;
        if (c < 0x80) {
            s++;
            continue;
        } else if ((c & 0xe0) == 0xc0) {
            extra = 1, min = 0x80, cp = c & 0x1f;
        } else if ((c & 0xf0) == 0xe0) {
            extra = 2, min = 0x800, cp = c & 0x0f;
        } else if ((c & 0xf8) == 0xf0) {
            extra = 3, min = 0x10000, cp = c & 0x07;
        } else {
            return false;
        }
        for (int i = 1; i <= extra; i++) {
            if ((s[i] & 0xc0) != 0x80)
                return false; /* also stops at the NUL */
            cp = (cp << 6) | (s[i] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff))
            return false;
        s += extra + 1;
    }
    return true;
}

/* ---- registration ---- */

static const char *const hist_suffixes[] = {"", "_bucket", "_sum", "_count"};
static const char *const plain_suffixes[] = {""};

/* a + sa == b + sb, without building either. */
static bool concat_equal(const char *a, const char *sa, const char *b, const char *sb) {
    size_t la = strlen(a), lsa = strlen(sa), lb = strlen(b), lsb = strlen(sb);
    if (la + lsa != lb + lsb)
        return false;
    size_t common = la < lb ? la : lb;
    if (memcmp(a, b, common) != 0)
        return false;
    if (la < lb)
        return memcmp(sa, b + la, lb - la) == 0 && strcmp(sa + (lb - la), sb) == 0;
    return memcmp(a + lb, sb, la - lb) == 0 && strcmp(sa, sb + (la - lb)) == 0;
}

/* Whether two families would write a sample (or TYPE line) of the same name. */
static bool families_clash(const char *a, metric_kind_t ka, const char *b, metric_kind_t kb) {
    const char *const *sa = ka == KIND_HISTOGRAM ? hist_suffixes : plain_suffixes;
    const char *const *sb = kb == KIND_HISTOGRAM ? hist_suffixes : plain_suffixes;
    int na = ka == KIND_HISTOGRAM ? 4 : 1, nb = kb == KIND_HISTOGRAM ? 4 : 1;
    for (int i = 0; i < na; i++)
        for (int j = 0; j < nb; j++)
            if (concat_equal(a, sa[i], b, sb[j]))
                return true;
    return false;
}

static void validate_definition(metric_kind_t kind, const char *name, const char *help,
                                int n_labels, const char *const *label_names, const double *bounds,
                                int n_bounds) {
    const char *kn = kind_name(kind);
    if (!is_valid_name(name))
        die("%s \"%s\": a metric name must match [a-zA-Z_][a-zA-Z0-9_]* (no colons)", kn,
            name ? name : "(null)");
    size_t len = strlen(name);
    if (kind == KIND_COUNTER && (len < 6 || strcmp(name + len - 6, "_total") != 0))
        die("counter \"%s\": a counter's name must end in _total", name);
    if (!help || !*help)
        die("%s \"%s\": help text is required", kn, name);
    if (n_labels < 0 || n_labels > METRICS_MAX_LABELS)
        die("%s \"%s\": %d labels; between 0 and %d are allowed", kn, name, n_labels,
            METRICS_MAX_LABELS);
    if (n_labels > 0 && !label_names)
        die("%s \"%s\": label_names is NULL", kn, name);
    for (int i = 0; i < n_labels; i++) {
        const char *ln = label_names[i];
        if (!is_valid_name(ln))
            die("%s \"%s\": label name \"%s\" must match [a-zA-Z_][a-zA-Z0-9_]*", kn, name,
                ln ? ln : "(null)");
        if (ln[0] == '_' && ln[1] == '_')
            die("%s \"%s\": label name \"%s\": names starting with __ are reserved", kn, name, ln);
        if (kind == KIND_HISTOGRAM && strcmp(ln, "le") == 0)
            die("histogram \"%s\": label name \"le\" is reserved for buckets", name);
        for (int j = 0; j < i; j++)
            if (strcmp(ln, label_names[j]) == 0)
                die("%s \"%s\": label name \"%s\" is repeated", kn, name, ln);
    }
    if (kind != KIND_HISTOGRAM)
        return;
    if (n_bounds < 0 || (n_bounds > 0 && !bounds))
        die("histogram \"%s\": %d bucket bounds at %p", name, n_bounds, (const void *)bounds);
    for (int i = 0; i < n_bounds; i++) {
        if (!isfinite(bounds[i]))
            die("histogram \"%s\": bucket bound %d is not finite (+Inf is implicit)", name, i);
        if (i > 0 && !(bounds[i] > bounds[i - 1]))
            die("histogram \"%s\": bucket bounds must increase strictly (bound %d is %g after "
                "%g)",
                name, i, bounds[i], bounds[i - 1]);
    }
}

/* Allocates a series holding copies of values, zeroed. NULL when out of memory. */
static series_t *series_new(const metric_t *m, const char *const *values) {
    size_t n_buckets = m->kind == KIND_HISTOGRAM ? (size_t)m->n_bounds + 1 : 0;
    size_t size = sizeof(series_t) + n_buckets * sizeof(uint64_t);
    size_t lens[METRICS_MAX_LABELS];
    for (int i = 0; i < m->n_labels; i++) {
        lens[i] = strlen(values[i]) + 1;
        size += lens[i];
    }
    series_t *s = calloc(1, size);
    if (!s)
        return NULL;
    char *p = (char *)(s + 1);
    if (n_buckets) {
        s->buckets = (uint64_t *)p;
        p += n_buckets * sizeof(uint64_t);
    }
    for (int i = 0; i < m->n_labels; i++) {
        memcpy(p, values[i], lens[i]);
        s->values[i] = p;
        p += lens[i];
    }
    return s;
}

static void family_free(metric_t *m) {
    if (!m)
        return;
    for (int i = 0; i < m->n_series; i++)
        free(m->series[i]);
    for (int i = 0; i < m->n_labels; i++)
        free(m->label_names[i]);
    free(m->name);
    free(m->help);
    free(m->bounds);
    pthread_mutex_destroy(&m->mu);
    free(m);
}

static char *dup_str(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = malloc(n);
    if (d)
        memcpy(d, s, n);
    return d;
}

static metric_t *family_register(metrics_t *reg, metric_kind_t kind, const char *name,
                                 const char *help, int n_labels, const char *const *label_names,
                                 const double *bounds, int n_bounds, double (*fn)(void *),
                                 void *fn_arg) {
    if (!reg)
        die("registering \"%s\" in a NULL registry", name ? name : "(null)");
    validate_definition(kind, name, help, n_labels, label_names, bounds, n_bounds);

    metric_t *m = calloc(1, sizeof *m);
    if (!m)
        return NULL;
    if (pthread_mutex_init(&m->mu, NULL) != 0) {
        free(m);
        return NULL;
    }
    m->kind = kind;
    m->fn = fn;
    m->fn_arg = fn_arg;
    m->n_labels = n_labels;
    m->n_bounds = kind == KIND_HISTOGRAM ? n_bounds : 0;
    m->name = dup_str(name);
    m->help = dup_str(help);
    bool ok = m->name && m->help;
    for (int i = 0; i < n_labels; i++)
        ok = (m->label_names[i] = dup_str(label_names[i])) != NULL && ok;
    if (ok && m->n_bounds > 0) {
        m->bounds = malloc((size_t)n_bounds * sizeof(double));
        if (m->bounds)
            memcpy(m->bounds, bounds, (size_t)n_bounds * sizeof(double));
        ok = m->bounds != NULL;
    }
    if (ok && n_labels == 0 && kind != KIND_GAUGE_FN) {
        m->series[0] = series_new(m, NULL);
        m->n_series = m->series[0] ? 1 : 0;
        ok = m->series[0] != NULL;
    }
    if (!ok) {
        family_free(m);
        return NULL;
    }

    pthread_mutex_lock(&reg->mu);
    for (int i = 0; i < reg->n_families; i++) {
        const metric_t *o = reg->families[i];
        if (families_clash(name, kind, o->name, o->kind)) {
            pthread_mutex_unlock(&reg->mu);
            die("%s \"%s\" clashes with %s \"%s\" already registered", kind_name(kind), name,
                kind_name(o->kind), o->name);
        }
    }
    if (reg->n_families == reg->cap_families) {
        int cap = reg->cap_families ? reg->cap_families * 2 : 16;
        metric_t **f = realloc(reg->families, (size_t)cap * sizeof *f);
        if (!f) {
            pthread_mutex_unlock(&reg->mu);
            family_free(m);
            return NULL;
        }
        reg->families = f;
        reg->cap_families = cap;
    }
    reg->families[reg->n_families++] = m;
    pthread_mutex_unlock(&reg->mu);
    return m;
}

metrics_t *metrics_create(void) {
    metrics_t *reg = calloc(1, sizeof *reg);
    if (!reg)
        return NULL;
    if (pthread_mutex_init(&reg->mu, NULL) != 0) {
        free(reg);
        return NULL;
    }
    return reg;
}

void metrics_destroy(metrics_t *reg) {
    if (!reg)
        return;
    for (int i = 0; i < reg->n_families; i++)
        family_free(reg->families[i]);
    free(reg->families);
    pthread_mutex_destroy(&reg->mu);
    free(reg);
}

metric_t *metrics_counter(metrics_t *reg, const char *name, const char *help, int n_labels,
                          const char *const *label_names) {
    return family_register(reg, KIND_COUNTER, name, help, n_labels, label_names, NULL, 0, NULL,
                           NULL);
}

metric_t *metrics_gauge(metrics_t *reg, const char *name, const char *help, int n_labels,
                        const char *const *label_names) {
    return family_register(reg, KIND_GAUGE, name, help, n_labels, label_names, NULL, 0, NULL, NULL);
}

metric_t *metrics_histogram(metrics_t *reg, const char *name, const char *help, int n_labels,
                            const char *const *label_names, const double *bounds, int n_bounds) {
    return family_register(reg, KIND_HISTOGRAM, name, help, n_labels, label_names, bounds, n_bounds,
                           NULL, NULL);
}

metric_t *metrics_gauge_fn(metrics_t *reg, const char *name, const char *help,
                           double (*fn)(void *arg), void *arg) {
    if (!fn)
        die("gauge \"%s\": fn is NULL", name ? name : "(null)");
    return family_register(reg, KIND_GAUGE_FN, name, help, 0, NULL, NULL, 0, fn, arg);
}

double *metrics_buckets_exponential(double *out, int n, double start, double factor) {
    if (!out || n < 0 || !(start > 0) || !(factor > 1) || !isfinite(start) || !isfinite(factor))
        die("metrics_buckets_exponential: need n >= 0, start > 0, factor > 1 (n %d, start %g, "
            "factor %g)",
            n, start, factor);
    double b = start;
    for (int i = 0; i < n; i++, b *= factor)
        out[i] = b;
    return out;
}

double *metrics_buckets_linear(double *out, int n, double start, double width) {
    if (!out || n < 0 || !(width > 0) || !isfinite(start) || !isfinite(width))
        die("metrics_buckets_linear: need n >= 0, finite start, width > 0 (n %d, start %g, "
            "width %g)",
            n, start, width);
    for (int i = 0; i < n; i++)
        out[i] = start + width * i;
    return out;
}

/* ---- updates ---- */

static int compare_values(const char *const *a, const char *const *b, int n) {
    for (int i = 0; i < n; i++) {
        int c = strcmp(a[i], b[i]);
        if (c)
            return c;
    }
    return 0;
}

/* Index of the first series whose values are >= values; *found when equal. */
static int series_lower_bound(const metric_t *m, const char *const *values, bool *found) {
    int lo = 0, hi = m->n_series;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (compare_values(m->series[mid]->values, values, m->n_labels) < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    *found = lo < m->n_series && compare_values(m->series[lo]->values, values, m->n_labels) == 0;
    return lo;
}

/* The series for values, created if new (or the overflow series, see
 * metrics.h). NULL only when out of memory. Called with m->mu held. */
static series_t *series_get(metric_t *m, const char *const *values) {
    if (m->n_labels == 0)
        return m->series[0];
    bool found;
    int at = series_lower_bound(m, values, &found);
    if (found)
        return m->series[at];

    bool acceptable = m->n_series < METRICS_MAX_SERIES;
    for (int i = 0; i < m->n_labels && acceptable; i++)
        acceptable = strlen(values[i]) <= METRICS_MAX_LABEL_VALUE && is_valid_utf8(values[i]);
    const char *overflow[METRICS_MAX_LABELS];
    if (!acceptable) {
        for (int i = 0; i < m->n_labels; i++)
            overflow[i] = METRICS_OVERFLOW_LABEL;
        values = overflow;
        at = series_lower_bound(m, values, &found);
        if (found)
            return m->series[at];
        /* Regular tuples stop at METRICS_MAX_SERIES, so the spare slot is free. */
    }
    series_t *s = series_new(m, values);
    if (!s)
        return NULL;
    memmove(&m->series[at + 1], &m->series[at], (size_t)(m->n_series - at) * sizeof s);
    m->series[at] = s;
    m->n_series++;
    return s;
}

/* Checks the label count and values that reached an update. */
static void check_labels(const metric_t *m, int n, const char *const *values, const char *op) {
    if (n != m->n_labels)
        die("%s on \"%s\": %d label values given, it takes %d", op, m->name, n, m->n_labels);
    for (int i = 0; i < n; i++)
        if (!values[i])
            die("%s on \"%s\": label value %d (%s) is NULL", op, m->name, i, m->label_names[i]);
}

static void require_kind(const metric_t *m, const char *op, bool ok) {
    if (!ok)
        die("%s on \"%s\", a %s%s", op, m->name, kind_name(m->kind),
            m->kind == KIND_GAUGE_FN ? " read from a function" : "");
}

static void do_add(metric_t *m, double v, const char *const *values) {
    require_kind(m, "metric_add", m->kind == KIND_COUNTER || m->kind == KIND_GAUGE);
    if (m->kind == KIND_COUNTER && !(v >= 0))
        die("metric_add on counter \"%s\": increment %g; counters only go up", m->name, v);
    pthread_mutex_lock(&m->mu);
    series_t *s = series_get(m, values);
    if (s)
        s->value += v;
    pthread_mutex_unlock(&m->mu);
}

static void do_set(metric_t *m, double v, const char *const *values) {
    require_kind(m, "metric_set", m->kind == KIND_GAUGE);
    pthread_mutex_lock(&m->mu);
    series_t *s = series_get(m, values);
    if (s)
        s->value = v;
    pthread_mutex_unlock(&m->mu);
}

static void do_observe(metric_t *m, double v, const char *const *values) {
    require_kind(m, "metric_observe", m->kind == KIND_HISTOGRAM);
    /* First bound >= v; NaN compares false everywhere and lands in +Inf. */
    int lo = 0, hi = m->n_bounds;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        if (v <= m->bounds[mid])
            hi = mid;
        else
            lo = mid + 1;
    }
    pthread_mutex_lock(&m->mu);
    series_t *s = series_get(m, values);
    if (s) {
        s->buckets[lo]++;
        s->count++;
        s->sum += v;
    }
    pthread_mutex_unlock(&m->mu);
}

/* Looks up without creating; want_sum picks a histogram's sum over its count. */
static double do_value(metric_t *m, const char *const *values, bool want_sum) {
    if (m->kind == KIND_GAUGE_FN)
        return want_sum ? 0 : m->fn(m->fn_arg);
    if (want_sum)
        require_kind(m, "metric_histogram_sum", m->kind == KIND_HISTOGRAM);
    double out = 0;
    pthread_mutex_lock(&m->mu);
    bool found;
    int at = series_lower_bound(m, values, &found);
    if (found) {
        const series_t *s = m->series[at];
        if (m->kind == KIND_HISTOGRAM)
            out = want_sum ? s->sum : (double)s->count;
        else
            out = s->value;
    }
    pthread_mutex_unlock(&m->mu);
    return out;
}

/* The macro entry points, which know how many values the caller wrote. */
void metric_add_n_(metric_t *m, double v, const char *const *values, int n) {
    if (!m)
        return;
    check_labels(m, n, values, "metric_add");
    do_add(m, v, values);
}

void metric_set_n_(metric_t *m, double v, const char *const *values, int n) {
    if (!m)
        return;
    check_labels(m, n, values, "metric_set");
    do_set(m, v, values);
}

void metric_observe_n_(metric_t *m, double v, const char *const *values, int n) {
    if (!m)
        return;
    check_labels(m, n, values, "metric_observe");
    do_observe(m, v, values);
}

double metric_value_n_(metric_t *m, const char *const *values, int n) {
    if (!m)
        return 0;
    check_labels(m, n, values, "metric_value");
    return do_value(m, values, false);
}

double metric_histogram_sum_n_(metric_t *m, const char *const *values, int n) {
    if (!m)
        return 0;
    check_labels(m, n, values, "metric_histogram_sum");
    return do_value(m, values, true);
}

/* The _v forms: the macro entry points, with the family's own count. */
void metric_add_v(metric_t *m, double v, const char *const *values) {
    if (m)
        metric_add_n_(m, v, values, m->n_labels);
}

void metric_set_v(metric_t *m, double v, const char *const *values) {
    if (m)
        metric_set_n_(m, v, values, m->n_labels);
}

double metric_value_v(metric_t *m, const char *const *values) {
    return m ? metric_value_n_(m, values, m->n_labels) : 0;
}

/* ---- rendering ---- */

typedef struct {
    char *p;
    size_t len, cap;
    bool oom;
} buf_t;

static void buf_put(buf_t *b, const char *s, size_t n) {
    if (b->oom)
        return;
    if (b->len + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (b->len + n + 1 > cap)
            cap *= 2;
        char *p = realloc(b->p, cap);
        if (!p) {
            b->oom = true;
            return;
        }
        b->p = p;
        b->cap = cap;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = 0;
}

static void buf_puts(buf_t *b, const char *s) { buf_put(b, s, strlen(s)); }

/* Backslash and newline always; the double quote too inside label values. */
static void buf_put_escaped(buf_t *b, const char *s, bool quote) {
    const char *run = s;
    for (; *s; s++) {
        const char *esc = *s == '\\' ? "\\\\" : *s == '\n' ? "\\n" : NULL;
        if (!esc && quote && *s == '"')
            esc = "\\\"";
        if (!esc)
            continue;
        buf_put(b, run, (size_t)(s - run));
        buf_put(b, esc, 2);
        run = s + 1;
    }
    buf_put(b, run, (size_t)(s - run));
}

/* A sample value or le bound as Prometheus' parser reads it: integers below
 * 1e15 in plain digits, others in the shortest %g that reads back exactly,
 * and NaN, +Inf, -Inf spelled out. */
static void format_number(char out[32], double v) {
    if (isnan(v)) {
        strcpy(out, "NaN");
    } else if (isinf(v)) {
        strcpy(out, v > 0 ? "+Inf" : "-Inf");
    } else if (v == 0) {
        strcpy(out, "0");
    } else if (fabs(v) < 1e15 && v == floor(v)) {
        snprintf(out, 32, "%.0f", v);
    } else {
        for (int prec = 15; prec <= 17; prec++) {
            snprintf(out, 32, "%.*g", prec, v);
            if (strtod(out, NULL) == v)
                break;
        }
    }
}

static void buf_put_number(buf_t *b, double v) {
    char s[32];
    format_number(s, v);
    buf_puts(b, s);
}

/* name{labels[,le="bound"]} value\n; le is NULL outside buckets. */
static void put_sample(buf_t *b, const metric_t *m, const char *suffix, const series_t *s,
                       const char *le, double value) {
    buf_puts(b, m->name);
    buf_puts(b, suffix);
    if (m->n_labels > 0 || le) {
        buf_put(b, "{", 1);
        for (int i = 0; i < m->n_labels; i++) {
            if (i)
                buf_put(b, ",", 1);
            buf_puts(b, m->label_names[i]);
            buf_put(b, "=\"", 2);
            buf_put_escaped(b, s->values[i], true);
            buf_put(b, "\"", 1);
        }
        if (le) {
            buf_puts(b, m->n_labels ? ",le=\"" : "le=\"");
            buf_puts(b, le);
            buf_put(b, "\"", 1);
        }
        buf_put(b, "}", 1);
    }
    buf_put(b, " ", 1);
    buf_put_number(b, value);
    buf_put(b, "\n", 1);
}

static void render_family(buf_t *b, metric_t *m) {
    buf_puts(b, "# HELP ");
    buf_puts(b, m->name);
    buf_put(b, " ", 1);
    buf_put_escaped(b, m->help, false);
    buf_puts(b, "\n# TYPE ");
    buf_puts(b, m->name);
    buf_put(b, " ", 1);
    buf_puts(b, kind_name(m->kind));
    buf_put(b, "\n", 1);

    if (m->kind == KIND_GAUGE_FN) {
        /* No lock: fn may take its own, and the family has no series. */
        put_sample(b, m, "", NULL, NULL, m->fn(m->fn_arg));
        return;
    }
    pthread_mutex_lock(&m->mu);
    for (int i = 0; i < m->n_series; i++) {
        const series_t *s = m->series[i];
        if (m->kind != KIND_HISTOGRAM) {
            put_sample(b, m, "", s, NULL, s->value);
            continue;
        }
        uint64_t cumulative = 0;
        char le[32];
        for (int j = 0; j <= m->n_bounds; j++) {
            cumulative += s->buckets[j];
            if (j < m->n_bounds)
                format_number(le, m->bounds[j]);
            else
                strcpy(le, "+Inf");
            put_sample(b, m, "_bucket", s, le, (double)cumulative);
        }
        put_sample(b, m, "_sum", s, NULL, s->sum);
        put_sample(b, m, "_count", s, NULL, (double)s->count);
    }
    pthread_mutex_unlock(&m->mu);
}

static int compare_family_names(const void *a, const void *b) {
    return strcmp((*(metric_t *const *)a)->name, (*(metric_t *const *)b)->name);
}

char *metrics_render(metrics_t *reg) {
    if (!reg)
        return NULL;
    /* Snapshot the list so registration never waits on a render; families
     * live until metrics_destroy. */
    pthread_mutex_lock(&reg->mu);
    int n = reg->n_families;
    metric_t **families = malloc((size_t)(n ? n : 1) * sizeof *families);
    if (families && n)
        memcpy(families, reg->families, (size_t)n * sizeof *families);
    pthread_mutex_unlock(&reg->mu);
    if (!families)
        return NULL;
    qsort(families, (size_t)n, sizeof *families, compare_family_names);

    buf_t b = {0};
    buf_put(&b, "", 0);
    for (int i = 0; i < n; i++)
        render_family(&b, families[i]);
    free(families);
    if (b.oom) {
        free(b.p);
        return NULL;
    }
    return b.p;
}
