/* ScaleKV (scale-aware KV compression for next-scale models, Li et al.
 * 2025; HeatKV's strongest baseline): offline, every (layer, scale) whose
 * cache passes the budget is classified by its Attention Selectivity Index
 * (ASI = the scale's attention on itself x its top-K attention on history,
 * from the model's calibration); the least selective, per scale by
 * Z-score and ranked together, are drafters and keep nearly everything,
 * the refiners share what is left, so every compacted scale holds
 * budget x layers in all. After a layer attends, each of its heads keeps a
 * 4 x 4 grid of the scale's tokens (the observation window; the newest
 * of them when the budget is smaller) and the keys that attention weighted
 * most (max-pooled over 5 neighbours). The budgets
 * are fixed before the request, so its trajectory is exact.
 * docs/kv-policies.md. */
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

typedef struct scalekv {
    int n_layers, steps, first; /* first: the first compacted step (-1: none) */
    int cap;                    /* B: tokens per head the budget gives, on average over layers */
    int n_drafters;             /* (layer, scale) pairs classified drafter */
    int seg[KV_MAX_SEGMENTS];   /* tokens of each scale */
    int *budget;            /* [step * n_layers + layer]: tokens kept after compacting, -1 none */
    unsigned char *drafter; /* same indexing */
    float *score;           /* scratch: one head's scores */
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
                         "scalekv needs the model's KV calibration with attention statistics "
                         "(%s in the model directory, written by this version): run `arserve "
                         "calibrate --model DIR --prompts FILE`",
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

/* Budgets per (layer, compacted scale): drafters keep what they hold
 * (their previous budget and the new scale), up to what leaves every
 * refiner its window; refiners share the rest, so the layers hold B x L
 * in all. A scale with no drafter, or only drafters, gives each B. */
static int allot(scalekv_t *s) {
    const int L = s->n_layers, last = s->steps - 1, B = s->cap;
    int *held = calloc((size_t)L, sizeof *held); /* what each layer's heads hold */
    int before = 0;                              /* a full head's tokens through step t */
    if (!held)
        return -1;
    for (int t = 0; t < last; t++) {
        int *bud = s->budget + (size_t)t * L;
        if (s->first < 0 || t < s->first) {
            before += s->seg[t];
            for (int l = 0; l < L; l++)
                held[l] = before;
            continue;
        }
        int n_d = 0;
        for (int l = 0; l < L; l++)
            n_d += s->drafter[t * L + l];
        if (n_d == 0 || n_d == L) {
            for (int l = 0; l < L; l++)
                bud[l] = B;
        } else {
            /* A refiner keeps at least its window (all of B when B is less). */
            const long long total = (long long)B * L, floor_r = B < WINDOW ? B : WINDOW;
            const long long max_d = (total - (long long)(L - n_d) * floor_r) / n_d;
            long long sum_d = 0;
            for (int l = 0; l < L; l++)
                if (s->drafter[t * L + l]) {
                    const long long limit = (long long)held[l] + s->seg[t];
                    bud[l] = (int)(limit < max_d ? limit : max_d);
                    sum_d += bud[l];
                }
            const int min_r = (int)((total - sum_d) / (L - n_d));
            for (int l = 0; l < L; l++)
                if (!s->drafter[t * L + l])
                    bud[l] = min_r;
        }
        for (int l = 0; l < L; l++) {
            const int limit = held[l] + s->seg[t];
            held[l] = limit < bud[l] ? limit : bud[l];
        }
    }
    free(held);
    return 0;
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
    s->score = malloc((size_t)(full_tokens(g) + 1) * sizeof *s->score);
    if (!s->budget || !s->drafter || !s->score) {
        scalekv_end(s);
        return NULL;
    }
    for (int i = 0; i < S * L; i++)
        s->budget[i] = -1;
    if (classify(s, g->calibration, p->scalekv_drafters) != 0 || allot(s) != 0) {
        scalekv_end(s);
        return NULL;
    }
    return s;
}

static int scalekv_collect(const void *state, int t) {
    const scalekv_t *s = state;
    return s->first >= 0 && t >= s->first && t < s->steps - 1;
}

static int scalekv_layer_end(void *state, int t, int l, int head, int len, int *keep, int *n_keep,
                             int *cache) {
    (void)state, (void)t, (void)l, (void)head, (void)len, (void)keep, (void)n_keep, (void)cache;
    return 0; /* it caches the whole scale, then compacts (scalekv_layer_stored) */
}

/* Whether token j of a cache of len whose last n tokens are the scale just
 * appended (side: the scale's side when square) is in the window: the
 * centres of a 4 x 4 grid of the scale's cells, or its newest tokens when
 * it is smaller than the grid or not square. */
static int in_window(int j, int len, int n, int side) {
    const int first = len - n;
    if (j < first)
        return 0;
    if (side < WINDOW_SIDE || side * side != n)
        return j >= len - (n < WINDOW ? n : WINDOW);
    const int cell = side / WINDOW_SIDE, r = (j - first) / side, c = (j - first) % side;
    return r % cell == (cell - 1) / 2 && r / cell < WINDOW_SIDE && c % cell == (cell - 1) / 2 &&
           c / cell < WINDOW_SIDE;
}

/* Once the scale is appended: the window, and the budget's rest by key
 * mass max-pooled over the keys outside the window (ScaleKV's code masks
 * the window before pooling, so its mass does not lift its neighbours;
 * ties and no mass: the newest). */
static int scalekv_layer_stored(void *state, int t, int l, int head, int len, const float *mass,
                                int *keep, int *n_keep) {
    (void)head;
    scalekv_t *s = state;
    if (t >= s->steps - 1 || s->budget[t * s->n_layers + l] < 0)
        return 0;
    const int budget = s->budget[t * s->n_layers + l], n = s->seg[t];
    if (len <= budget || len - n < 0)
        return 0;
    const int side = (int)lround(sqrt((double)n));
    for (int j = 0; j < len; j++) {
        float m = 0;
        for (int d = -POOL_KERNEL / 2; mass && d <= POOL_KERNEL / 2; d++)
            if (j + d >= 0 && j + d < len && mass[j + d] > m && !in_window(j + d, len, n, side))
                m = mass[j + d];
        s->score[j] = in_window(j, len, n, side) ? INFINITY : m;
    }
    kv_keep_top(keep, 0, len, budget, s->score);
    *n_keep = budget;
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
    (void)p;
}

const kv_policy_ops_t kv_policy_scalekv = {
    .name = "scalekv",
    .default_budget = 0.1, /* its 650 of Infinity's 6425 tokens */
    .takes_budget = 1,
    .stats = KV_STATS_KEY_MASS,
    .step_units = 1u << KV_STEP_SEGMENT,
    .check = scalekv_check,
    .begin = scalekv_begin,
    .end = scalekv_end,
    .collect = scalekv_collect,
    .layer_end = scalekv_layer_end,
    .layer_stored = scalekv_layer_stored,
    .describe = scalekv_describe,
};
