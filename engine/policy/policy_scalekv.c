/* ScaleKV (scale-aware KV compression for next-scale models, Li et al.
 * 2025; HeatKV's strongest baseline), as its public code runs it: offline,
 * every (layer, scale) whose cache passes the budget is classified by its
 * Attention Selectivity Index (ASI = the scale's attention on itself x its
 * top-K attention on history, from the model's calibration); the least
 * selective, per scale by Z-score and ranked together, are drafters and
 * keep nearly everything, the refiners share what is left, so every
 * compacted scale holds budget x layers in all. After a layer attends,
 * each of its heads keeps an observation window (the centres of a 4 x 4
 * grid of the scale's cells; the newest 16 tokens when the scale is
 * smaller) and the keys the window's raw queries scored highest (their
 * summed logits, max-pooled over 5 neighbours). The budgets are fixed
 * before the request, so its trajectory is exact. docs/kv-policies.md. */
#include "engine/policy/kv_calibration.h"
#include "engine/policy/kv_policy_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum {
    WINDOW_SIDE = 4,                    /* the observation window: a 4 x 4 grid */
    WINDOW = WINDOW_SIDE * WINDOW_SIDE, /* its tokens (the public code's 16) */
    POOL_KERNEL = 5,                    /* max pooling of the scores over key order */
};
_Static_assert(WINDOW <= KV_MAX_WINDOW_QUERIES, "the window's queries fit the engine's list");

typedef struct scalekv {
    int n_layers, steps, first; /* first: the first compacted step (-1: none) */
    int cap;                    /* B: tokens per head the budget gives, on average over layers */
    int n_drafters;             /* (layer, scale) pairs classified drafter */
    int seg[KV_MAX_SEGMENTS];   /* tokens of each scale */
    int *budget;            /* [step * n_layers + layer]: tokens kept after compacting, -1 none */
    unsigned char *drafter; /* same indexing */
    float *score;           /* scratch: one head's scores */
    int window[WINDOW];     /* scratch: one head's window, ascending cache indices */
} scalekv_t;

/* The tokens a full-cache head holds at the end. */
static int full_tokens(const kv_geometry_t *g) {
    return kv_geometry_held(g, kv_geometry_steps(g) - 1);
}

static int scalekv_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                         ar_error_t *err) {
    if (g->step_unit != KV_STEP_SEGMENT)
        return ar_errorf(err, "scalekv works on next-scale models; this model's steps are tokens");
    if (!g->calibration || !g->calibration->beta || !g->calibration->htr)
        return ar_errorf(err,
                         "scalekv needs the model's KV calibration at this image size, with "
                         "attention statistics (%s in the model directory, written by this "
                         "version): run `arserve calibrate --model DIR --prompts FILE --size "
                         "WxH` with this size",
                         KV_CALIBRATION_FILE);
    if (kv_calibration_check(g->calibration, g, err) != AR_OK)
        return AR_ERR;
    const int N = full_tokens(g), B = kv_budget_share(p->budget, N);
    if (B >= 1)
        return AR_OK;
    if (field)
        *field = "budget";
    return ar_errorf(err,
                     "budget %g holds none of the %d tokens of a full cache (budget >= 1/%d = "
                     "%.4g)",
                     p->budget, N, N, 1.0 / N);
}

static void scalekv_end(void *state) {
    scalekv_t *s = state;
    if (!s)
        return;
    free(s->budget);
    free(s->drafter);
    free(s->score);
    free(s);
}

typedef struct ranked {
    double z;
    int step, layer;
} ranked_t;

static int by_z(const void *a, const void *b) {
    const ranked_t *x = a, *y = b;
    if (x->z != y->z)
        return x->z < y->z ? -1 : 1;
    return x->step != y->step ? x->step - y->step : x->layer - y->layer;
}

/* ASI(l, t) from the calibration: the mean over the layer's heads of the
 * scale's mass on itself, times that of its history top-K ratio. */
static double asi(const kv_calibration_t *c, int l, int t) {
    const int H = c->n_heads, K = c->n_scales;
    double car = 0, htr = 0;
    for (int h = l * H; h < (l + 1) * H; h++) {
        car += c->beta[((size_t)h * K + t) * K + t];
        htr += c->htr[(size_t)h * K + t];
    }
    return (car / H) * (htr / H);
}

/* The drafters: per compacted scale the layers' ASI as Z-scores, every
 * pair ranked together, the lowest share of them (at least one). */
static int classify(scalekv_t *s, const kv_calibration_t *c, double share) {
    const int L = s->n_layers, last = s->steps - 1;
    ranked_t *r = malloc((size_t)L * s->steps * sizeof *r);
    int n = 0;
    for (int t = s->first; r && t >= 0 && t < last; t++) {
        double mean = 0, var = 0;
        for (int l = 0; l < L; l++)
            mean += asi(c, l, t) / L;
        for (int l = 0; l < L; l++)
            var += (asi(c, l, t) - mean) * (asi(c, l, t) - mean) / L;
        for (int l = 0; l < L; l++)
            r[n++] = (ranked_t){(asi(c, l, t) - mean) / (sqrt(var) + 1e-12), t, l};
    }
    if (!r)
        return -1;
    qsort(r, (size_t)n, sizeof *r, by_z);
    s->n_drafters = n ? (int)ceil(share * n - 1e-9) : 0;
    s->n_drafters = n && s->n_drafters < 1 ? 1 : s->n_drafters;
    for (int i = 0; i < s->n_drafters; i++)
        s->drafter[r[i].step * L + r[i].layer] = 1;
    free(r);
    return 0;
}

/* Budgets per (layer, compacted scale), by the rule the public code's
 * budget files follow: the drafters' budget is the largest count that is
 * at most their limit (the full cache at the first compacted scale, then
 * their previous budget plus the new scale) and at most what leaves every
 * refiner its window, and leaves the refiners an equal whole share of the
 * rest, so the layers' budgets add up to B x L. (Infinity-2B at 650 tokens:
 * 920/632, 1490/594, 2510/526, 4100/420, 6385/465, the shipped file's.) A
 * scale with no drafter, or only drafters, gives each layer B. */
static void allot(scalekv_t *s) {
    const int L = s->n_layers, last = s->steps - 1, B = s->cap;
    const long long total = (long long)B * L, floor_r = B < WINDOW ? B : WINDOW;
    long long limit = 0; /* what a drafter may hold after this scale */
    for (int t = 0; t < last; t++) {
        limit += s->seg[t];
        if (s->first < 0 || t < s->first)
            continue;
        int *bud = s->budget + (size_t)t * L, n_d = 0;
        for (int l = 0; l < L; l++)
            n_d += s->drafter[t * L + l];
        if (n_d == 0 || n_d == L) {
            for (int l = 0; l < L; l++)
                bud[l] = B;
            limit = B;
            continue;
        }
        /* B itself leaves a whole share (B x (L - n_d)), so this stops. */
        long long max_d = (total - (L - n_d) * floor_r) / n_d;
        max_d = limit < max_d ? limit : max_d;
        while ((total - n_d * max_d) % (L - n_d) != 0)
            max_d--;
        const int min_r = (int)((total - n_d * max_d) / (L - n_d));
        for (int l = 0; l < L; l++)
            bud[l] = s->drafter[t * L + l] ? (int)max_d : min_r;
        limit = max_d;
    }
}

static void *scalekv_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    scalekv_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    const int L = g->n_layers, S = kv_geometry_steps(g);
    s->n_layers = L;
    s->steps = S;
    s->cap = kv_budget_share(p->budget, full_tokens(g));
    s->first = -1;
    for (int t = 0; t < S; t++)
        s->seg[t] = kv_geometry_fed(g, t) + (t == 0 ? g->n_prompt : 0);
    for (int t = 0; t < S - 1 && s->first < 0; t++)
        if (kv_geometry_held(g, t) > s->cap)
            s->first = t;
    s->budget = malloc((size_t)S * L * sizeof *s->budget);
    s->drafter = calloc((size_t)S * L, 1);
    s->score = malloc((size_t)2 * (full_tokens(g) + 1) * sizeof *s->score);
    if (!s->budget || !s->drafter || !s->score) {
        scalekv_end(s);
        return NULL;
    }
    for (int i = 0; i < S * L; i++)
        s->budget[i] = -1;
    if (classify(s, g->calibration, p->scalekv_drafters) != 0) {
        scalekv_end(s);
        return NULL;
    }
    allot(s);
    return s;
}

static int scalekv_layer_end(void *state, int t, int l, int head, int len, int *keep, int *n_keep,
                             int *cache) {
    (void)state, (void)t, (void)l, (void)head, (void)len, (void)keep, (void)n_keep, (void)cache;
    return 0; /* it caches the whole scale, then compacts (scalekv_layer_stored) */
}

/* The budget head cuts (layer, scale t) to when it holds len tokens, or
 * -1 when it is not cut. */
static int cut_to(const scalekv_t *s, int t, int l, int len) {
    if (t >= s->steps - 1 || s->budget[t * s->n_layers + l] < 0)
        return -1;
    const int budget = s->budget[t * s->n_layers + l];
    return len > budget ? budget : -1;
}

/* The observation window of a head holding len tokens after scale t (the
 * public code's _select_window_indices): the centres of a 4 x 4 grid of
 * the scale's cells, i x cell + (cell - 1) / 2 down and across, when the
 * scale is a square of side 4 or more; else the cache's newest 16 tokens
 * (which may reach back before the scale). Ascending cache indices into
 * w; returns how many. */
static int window_of(const scalekv_t *s, int t, int len, int *w) {
    const int n = s->seg[t] < len ? s->seg[t] : len, side = (int)lround(sqrt((double)n));
    if (side < WINDOW_SIDE || side * side != n) {
        const int k = len < WINDOW ? len : WINDOW;
        for (int i = 0; i < k; i++)
            w[i] = len - k + i;
        return k;
    }
    const int cell = side / WINDOW_SIDE, first = len - n;
    for (int i = 0; i < WINDOW_SIDE; i++)
        for (int j = 0; j < WINDOW_SIDE; j++)
            w[i * WINDOW_SIDE + j] =
                first + (i * cell + (cell - 1) / 2) * side + j * cell + (cell - 1) / 2;
    return WINDOW;
}

/* The window's queries: each window token's row in the step, a token from
 * before the step counted as the step's first row (the public code clamps
 * its index). */
static int scalekv_window_queries(const void *state, int t, int l, int head, int len, int *rows) {
    (void)head;
    const scalekv_t *s = state;
    if (cut_to(s, t, l, len) < 0)
        return 0;
    int w[WINDOW];
    const int k = window_of(s, t, len, w), n = s->seg[t], first = len - n;
    for (int i = 0; i < k; i++)
        rows[i] = w[i] < first ? 0 : w[i] - first;
    return k;
}

/* Once the scale is appended: the window, and the budget's rest by the
 * window queries' summed logits (score; NULL: none, as when planning),
 * max-pooled over 5 neighbours with the window's own scores left out, so
 * that they do not lift their neighbours (the public code masks them to
 * -inf before it pools); ties keep the newer key. A budget smaller than
 * the window keeps the window (the public code's rule). */
static int scalekv_layer_stored(void *state, int t, int l, int head, int len, const float *score,
                                int *keep, int *n_keep) {
    (void)head;
    scalekv_t *s = state;
    const int budget = cut_to(s, t, l, len);
    if (budget < 0)
        return 0;
    const int k = window_of(s, t, len, s->window);
    float *raw = s->score + len; /* the scores with the window's at -inf */
    for (int j = 0; j < len; j++)
        raw[j] = score ? score[j] : 0.0f;
    for (int i = 0; i < k; i++)
        raw[s->window[i]] = -INFINITY;
    for (int j = 0; j < len; j++) {
        float m = -INFINITY;
        for (int d = -POOL_KERNEL / 2; d <= POOL_KERNEL / 2; d++)
            if (j + d >= 0 && j + d < len && raw[j + d] > m)
                m = raw[j + d];
        s->score[j] = m;
    }
    for (int i = 0; i < k; i++)
        s->score[s->window[i]] = INFINITY;
    *n_keep = budget > k ? budget : k;
    kv_keep_top(keep, 0, len, *n_keep, s->score);
    return KV_COMPACT;
}

static void scalekv_describe(const void *state, const kv_policy_params_t *p, char *buf,
                             size_t cap) {
    const scalekv_t *s = state;
    int used = snprintf(buf, cap,
                        "B = %d tokens per head on average over the layers; %d drafter "
                        "layer-scale%s of the compacted ones (from step %d); budgets per step "
                        "(drafter max / refiner min):",
                        s->cap, s->n_drafters, s->n_drafters == 1 ? "" : "s", s->first);
    for (int t = s->first; t >= 0 && t < s->steps - 1 && used > 0 && (size_t)used < cap; t++) {
        int hi = 0, lo = 1 << 30;
        for (int l = 0; l < s->n_layers; l++) {
            const int b = s->budget[t * s->n_layers + l];
            hi = b > hi ? b : hi;
            lo = b < lo ? b : lo;
        }
        used += snprintf(buf + used, cap - (size_t)used, " %d/%d", hi, lo);
    }
    if (s->cap < WINDOW && used > 0 && (size_t)used < cap)
        used += snprintf(buf + used, cap - (size_t)used,
                         "; a cut keeps at least its %d-token window, more than B", WINDOW);
    /* Which layers draft, as step:layer (what the public code's budget
     * files list as their "Block" entries of 1). */
    const char *sep = "; drafters (step:layer):";
    for (int t = s->first; t >= 0 && t < s->steps - 1; t++)
        for (int l = 0; l < s->n_layers && used > 0 && (size_t)used < cap; l++)
            if (s->drafter[t * s->n_layers + l]) {
                used += snprintf(buf + used, cap - (size_t)used, "%s %d:%d", sep, t, l);
                sep = "";
            }
    (void)p;
}

const kv_policy_ops_t kv_policy_scalekv = {
    .name = "scalekv",
    .default_budget = 0.1, /* its 650 of Infinity's 6425 tokens */
    .takes_budget = 1,
    .stats = KV_STATS_WINDOW_LOGITS,
    .step_units = 1u << KV_STEP_SEGMENT,
    .check = scalekv_check,
    .begin = scalekv_begin,
    .end = scalekv_end,
    .layer_end = scalekv_layer_end,
    .layer_stored = scalekv_layer_stored,
    .window_queries = scalekv_window_queries,
    .describe = scalekv_describe,
};
