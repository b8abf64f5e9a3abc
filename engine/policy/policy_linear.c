/* LineAR (Qin et al., "Autoregressive Image Generation Needs Only a Few
 * Lines of Cached Tokens"): the cache is managed in lines, the raster
 * family's segments. Each head keeps the prefix, anchor lines, the most
 * recent complete lines and, in between, the mid tokens the line's queries
 * found most salient, within B = floor(budget x lines) lines (§3.3). */
#include "engine/policy/kv_policy_impl.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct linear {
    int n_prompt, w, h, steps;
    int budget_lines, B; /* B = budget_lines * w image tokens (eq. 1) */
    int anchors, recent; /* tokens */
} linear_t;

static int linear_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                        ar_error_t *err) {
    int w, h;
    if (!kv_geometry_lines(g, "linear", &w, &h, err))
        return AR_ERR;
    const int lines = kv_budget_share(p->budget, h);
    const long long need = (long long)p->anchor_lines + p->recent_lines + 1;
    /* With B >= h lines no line end ever compresses: any knobs do. */
    if (lines >= h || lines >= need)
        return AR_OK;
    ar_errorf(err,
              "budget %g keeps %d of %d lines; linear needs anchor_lines (%d) + recent_lines (%d) "
              "+ the line being generated = %lld lines (budget >= %lld/%d = %.4g)",
              p->budget, lines, h, p->anchor_lines, p->recent_lines, need, need, h,
              (double)need / h);
    if (field)
        *field = "budget";
    return AR_ERR;
}

static int min_int(int a, int b) { return a < b ? a : b; }

static void *linear_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    linear_t *s = malloc(sizeof *s);
    if (!s)
        return NULL;
    kv_geometry_lines(g, "linear", &s->w, &s->h, NULL);
    s->n_prompt = g->n_prompt;
    s->steps = s->w * s->h;
    s->budget_lines = kv_budget_share(p->budget, s->h);
    s->B = s->budget_lines * s->w;
    /* More lines than the image has only matter when nothing is ever
     * compressed (linear_check); clamped, the products stay in int. */
    s->anchors = min_int(p->anchor_lines, s->h) * s->w;
    s->recent = min_int(p->recent_lines, s->h) * s->w;
    return s;
}

/* The last line whose end comes before the last step (the sequence is
 * released after it, and compressing then would be wasted). */
static int last_line(const linear_t *s) {
    int last = (s->steps - 2) / s->w;
    return s->steps < 2 ? 0 : (last < s->h - 1 ? last : s->h - 1);
}

/* LineAR compresses at the end of 1-based line l (step l*w) for
 * budget_lines <= l <= last: from the line that fills B (§3.3, l/n >= rho)
 * to the last line that completes in the cache before the last step. */
static int compresses(const linear_t *s, int t) {
    if (t <= 0 || t % s->w)
        return 0;
    int l = t / s->w;
    return l >= s->budget_lines && l <= last_line(s);
}

/* Mass restarts at the start of each line whose end compresses: step
 * (l-1)*w for the first such line, then at every compressing line end. */
static int resets(const linear_t *s, int t) {
    if (s->budget_lines > last_line(s))
        return 0;
    return t == (s->budget_lines - 1) * s->w || compresses(s, t);
}

/* The guide queue (LineAR eq. 8) of a compressing line l is the queries
 * of its w tokens, fed at steps (l-1)*w+1 .. l*w. */
static int linear_collect(const void *state, int t) {
    const linear_t *s = state;
    int last = last_line(s);
    if (s->budget_lines > last)
        return 0;
    return t >= (s->budget_lines - 1) * s->w + 1 && t <= last * s->w;
}

/* Tokens LineAR evicts from the mid region of a head holding v image
 * tokens at a compressing line end: down to B - w (eq. 6), i.e. w in the
 * steady state, never more than the mid region holds. */
static int n_evict(const linear_t *s, int v) {
    int n = v - (s->B - s->w), mid = v - s->anchors - s->recent;
    if (mid < 0)
        mid = 0;
    if (n < 0)
        n = 0;
    return n < mid ? n : mid;
}

static int linear_kept_after(const void *state, int t, int v) {
    const linear_t *s = state;
    return compresses(s, t) ? v - n_evict(s, v) : v;
}

/* prefix + anchors | mid | recent lines (LineAR §3.3, eq. 5-6) */
static int linear_step_end(void *state, int t, int layer, int head, int len, const float *mass,
                           int *keep, int *n_keep) {
    const linear_t *s = state;
    const int flags = resets(s, t) ? KV_RESET_MASS : 0;
    if (!compresses(s, t))
        return flags;
    const int evict = n_evict(s, len - s->n_prompt);
    if (evict == 0)
        return flags;
    const int mid_first = s->n_prompt + s->anchors, mid = len - s->recent - mid_first;
    int k = 0;
    kv_keep_range(keep, &k, 0, mid_first);
    kv_keep_top(keep + k, mid_first, mid, mid - evict, mass);
    k += mid - evict;
    kv_keep_range(keep, &k, len - s->recent, s->recent);
    *n_keep = k;
    return flags | KV_COMPACT;
}

static void linear_describe(const void *state, const kv_policy_params_t *p, char *buf, size_t cap) {
    const linear_t *s = state;
    snprintf(buf, cap,
             "B = %d of %d lines = %d image tokens + the prefix; %d anchor line(s), %d recent; "
             "compacts at each line end once full",
             s->budget_lines, s->h, s->B, p->anchor_lines, p->recent_lines);
}

const kv_policy_ops_t kv_policy_linear = {
    .name = "linear",
    .default_budget = 1.0 / 6, /* LineAR's headline ratio (abstract, Tab. 1-6) */
    .takes_budget = 1,
    .step_units = 1u << KV_STEP_TOKEN,
    .stats = KV_STATS_KEY_MASS,
    .check = linear_check,
    .begin = linear_begin,
    .end = free,
    .kept_after = linear_kept_after,
    .collect = linear_collect,
    .step_end = linear_step_end,
    .describe = linear_describe,
};
