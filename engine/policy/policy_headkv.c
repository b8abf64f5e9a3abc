/* HeadKV (head-aware KV compression for raster image models): heads are
 * grouped once the cache reaches headkv_group_tokens image tokens. A local
 * head (its attention mass reaches the threshold within the local window)
 * keeps the condition and a sliding recent window; a global head keeps the
 * condition, the recent lines and, by Stratified Token Eviction, the most
 * attended of its history, within G = floor(budget x image tokens), updated
 * every headkv_buffer steps (§4). The plan counts every head as global until
 * the grouping; from then on a copy of the state tells the rest (clone). */
#include "engine/policy/kv_policy_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct headkv {
    int n_prompt, w, h, steps;
    int G;            /* global budget, image tokens */
    int R;            /* recent window of a global head, tokens */
    int buf;          /* steps between updates */
    int local_window; /* tokens a local head keeps */
    int t_group;      /* the grouping step */
    double threshold, alpha;
    int n_layers, n_heads;
    unsigned char *local; /* 1 for a head classified local, per (layer, head) */
} headkv_t;

static int headkv_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                        ar_error_t *err) {
    int w, h;
    if (!kv_geometry_lines(g, "headkv", &w, &h, err))
        return AR_ERR;
    const int S = w * h, G = kv_budget_share(p->budget, S);
    const long long R = (long long)p->headkv_recent_lines * w;
    /* A global head never evicts when G - buffer covers the whole image. */
    if ((long long)G - p->headkv_buffer >= S - 1)
        return AR_OK;
    const long long need = R + p->headkv_buffer;
    if (G < need) {
        ar_errorf(err,
                  "budget %g holds %d of %d image tokens; headkv needs headkv_recent_lines (%d) "
                  "x %d + headkv_buffer (%d) = %lld (budget >= %lld/%d = %.4g)",
                  p->budget, G, S, p->headkv_recent_lines, w, p->headkv_buffer, need, need, S,
                  (double)need / S);
        if (field)
            *field = "budget";
        return AR_ERR;
    }
    if (p->headkv_local_window > G - p->headkv_buffer) {
        ar_errorf(err,
                  "headkv_local_window %d must be at most budget x %d - headkv_buffer = %d: a "
                  "local head holds less than a global one",
                  p->headkv_local_window, S, G - p->headkv_buffer);
        if (field)
            *field = "headkv_local_window";
        return AR_ERR;
    }
    return AR_OK;
}

static int min_int(int a, int b) { return a < b ? a : b; }

static void headkv_end(void *state) {
    headkv_t *s = state;
    if (s)
        free(s->local);
    free(s);
}

static void *headkv_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    headkv_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    kv_geometry_lines(g, "headkv", &s->w, &s->h, NULL);
    s->n_prompt = g->n_prompt;
    s->steps = s->w * s->h;
    s->G = kv_budget_share(p->budget, s->steps);
    s->R = min_int(p->headkv_recent_lines, s->h) * s->w;
    s->buf = p->headkv_buffer;
    s->local_window = p->headkv_local_window;
    s->t_group = p->headkv_group_tokens;
    s->threshold = p->headkv_threshold;
    s->alpha = p->headkv_alpha;
    s->n_layers = g->n_layers;
    s->n_heads = g->n_heads;
    s->local = calloc((size_t)g->n_layers * (size_t)g->n_heads, 1);
    if (!s->local) {
        headkv_end(s);
        return NULL;
    }
    return s;
}

static void *headkv_clone(const void *state) {
    const headkv_t *from = state;
    headkv_t *s = malloc(sizeof *s);
    const size_t n = (size_t)from->n_layers * from->n_heads;
    if (!s || !(s->local = malloc(n))) {
        free(s);
        return NULL;
    }
    unsigned char *local = s->local;
    *s = *from;
    s->local = memcpy(local, from->local, n);
    return s;
}

/* No update at the last step: the sequence is released after it. */
static int before_last(const headkv_t *s, int t) { return t < s->steps - 1; }

static int groups(const headkv_t *s, int t) { return t == s->t_group && before_last(s, t); }

/* Periodic updates every buffer steps after grouping (HeadKV §4 step 3). */
static int updates(const headkv_t *s, int t) {
    return t > s->t_group && (t - s->t_group) % s->buf == 0 && before_last(s, t);
}

/* A global head holds t image tokens until its first eviction and G - buf
 * after each one, so an update evicts exactly when t > G - buf. The key mass
 * is collected at the grouping step (one query row, for classification)
 * and over the buf steps before every evicting update (the query buffer). */
static int headkv_collect(const void *state, int t) {
    const headkv_t *s = state;
    if (t <= 0 || t < s->t_group || !before_last(s, t))
        return 0;
    if (t == s->t_group)
        return 1;
    int next = s->t_group + (t - s->t_group + s->buf - 1) / s->buf * s->buf;
    return before_last(s, next) && next > s->G - s->buf;
}

/* The grouping classifies every head: the rest of the plan is known. */
static int headkv_settled(const void *state, int t) { return groups(state, t); }

/* Until the grouping step's compaction every head holds every token, as
 * the plan (every head global) says. */
static int headkv_exact_through(const kv_policy_params_t *p) { return p->headkv_group_tokens; }

static int headkv_kept_after(const void *state, int t, int v) {
    const headkv_t *s = state;
    if ((groups(s, t) || updates(s, t)) && v > s->G - s->buf)
        return s->G - s->buf;
    return v;
}

/* Accumulates the current query's attention backward from the newest key
 * until it reaches the threshold; fewer tokens than the local window makes
 * a local head (§4 step 2). No statistics: global, the safe side. */
static int is_local(const headkv_t *s, const float *row, int len) {
    if (!row)
        return 0;
    double total = 0;
    for (int i = 0; i < len; i++)
        total += row[i];
    if (!(total > 0) || !isfinite(total))
        return 0;
    double acc = 0;
    for (int k = 1; k <= len; k++) {
        acc += row[len - k];
        if (acc >= s->threshold * total)
            return k < s->local_window;
    }
    return 0;
}

/* Stratified Token Eviction (HeadKV §4, eq. 5-6): the L historical tokens
 * [first, first+L) split into the older long range and the newer near range
 * (round(alpha*L) tokens, half up); each keeps its share of the H survivors
 * (round(alpha*H) near) by score, so near-range tokens cannot crowd out
 * long-range ones. */
static int ste(const headkv_t *s, int *out, int first, int L, int H, const float *mass) {
    int L_near = (int)floor(s->alpha * L + 0.5), L_long = L - L_near;
    int H_near = (int)floor(s->alpha * H + 0.5);
    if (H_near > L_near)
        H_near = L_near;
    if (H_near < H - L_long)
        H_near = H - L_long;
    int H_long = H - H_near;
    kv_keep_top(out, first, L_long, H_long, mass);
    kv_keep_top(out + H_long, first + L_long, L_near, H_near, mass);
    return H;
}

static int headkv_step_end(void *state, int t, int layer, int head, int len, const float *mass,
                           int *keep, int *n_keep) {
    headkv_t *s = state;
    const int P = s->n_prompt, V = len - P;
    unsigned char *local = &s->local[(size_t)layer * s->n_heads + head];
    if (groups(s, t))
        *local = (unsigned char)is_local(s, mass, len);
    else if (!updates(s, t))
        return 0;
    int k = 0;
    if (*local) {
        /* condition + a sliding recent window (§4, eq. 3) */
        if (V <= s->local_window)
            return KV_RESET_MASS;
        kv_keep_range(keep, &k, 0, P);
        kv_keep_range(keep, &k, len - s->local_window, s->local_window);
    } else {
        /* condition + STE-chosen history + recent window (§4, eq. 4) */
        if (V <= s->G - s->buf)
            return KV_RESET_MASS;
        int L = V - s->R, H = s->G - s->buf - s->R;
        kv_keep_range(keep, &k, 0, P);
        k += ste(s, keep + k, P, L, H, mass);
        kv_keep_range(keep, &k, len - s->R, s->R);
    }
    *n_keep = k;
    return KV_COMPACT | KV_RESET_MASS;
}

static void headkv_describe(const void *state, const kv_policy_params_t *p, char *buf, size_t cap) {
    const headkv_t *s = state;
    snprintf(buf, cap,
             "G = %d image tokens per global head + the prefix (every head planned global); "
             "groups at %d, updates every %d, %d recent lines",
             s->G, s->t_group, s->buf, p->headkv_recent_lines);
}

const kv_policy_ops_t kv_policy_headkv = {
    .name = "headkv",
    .default_budget = 1.0 / 8, /* the ratio HeadKV evaluates most (Tab. 1-4) */
    .takes_budget = 1,
    .step_units = 1u << KV_STEP_TOKEN,
    .stats = KV_STATS_KEY_MASS,
    .plan_bound = 1, /* every head planned global */
    .plan_exact_through = headkv_exact_through,
    .check = headkv_check,
    .begin = headkv_begin,
    .end = headkv_end,
    .clone = headkv_clone,
    .settled = headkv_settled,
    .kept_after = headkv_kept_after,
    .collect = headkv_collect,
    .step_end = headkv_step_end,
    .describe = headkv_describe,
};
