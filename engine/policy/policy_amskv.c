/* AMS-KV (adaptive multi-scale KV caching for next-scale models): every
 * layer keeps the condensed scales (the first ones) and rolls the most
 * recent tokens behind them (CLRU, Algorithm 2) within its capacity. A
 * layer starts at C_min; the first time a scale does not fit, the engine
 * measures how far the layer's keys moved from the previous scale's (eq. 3)
 * and a layer whose similarity is below the threshold expands, once, to
 * C_max (Algorithm 1). All heads of a layer share its capacity. The
 * eviction comes before the layer attends, so a scale attends to its
 * layer's cache after rolling; a scale too large for the capacity beside
 * the condensed scales is attended, not cached. The planner assumes every
 * layer expands at its first chance, the most any layer can hold.
 * docs/kv-policies.md. */
#include "engine/policy/kv_policy_impl.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct amskv {
    int steps;
    int seg[KV_MAX_SEGMENTS]; /* tokens attended at step t: scale t (step 0: + the prefix) */
    int cds;                  /* tokens: the prefix and the condensed scales */
    int cmin, cmax;           /* tokens a layer may hold, the scale it attends included */
    double theta;
    int n_layers;
    /* per layer */
    int *cap;       /* its capacity now: cmin, or cmax once expanded */
    int *held;      /* tokens each of its heads holds */
    int *was;       /* held before the step's decision (what the heads' len must be) */
    int *tail;      /* tokens kept after the condensed ones this step; -1: no eviction */
    int *cache_now; /* 1 when this step's scale is cached */
    int *newest;    /* the step whose scale is the newest whole one in the cache, or -1 */
    int *mem;       /* the arrays above */
    int decided;    /* the last step at which a layer took its expansion decision, or -1 */
} amskv_t;

/* The tokens a layer may hold: the condensed scales and n scales ending
 * with scale `last` (fewer when the pyramid has fewer after the condensed). */
static long long capacity(const kv_geometry_t *g, int condensed, int n, int last) {
    long long c = g->n_prompt;
    for (int i = 0; i < condensed && i < g->n_segments; i++)
        c += g->segment_tokens[i];
    for (int i = last; i > last - n && i >= condensed; i--)
        c += g->segment_tokens[i];
    return c;
}

static int amskv_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                       ar_error_t *err) {
    const char *at = NULL;
    if (g->step_unit != KV_STEP_SEGMENT)
        return ar_errorf(err, "amskv works on next-scale models; this model's steps are tokens");
    const int S = g->n_segments;
    if (p->amskv_condensed_scales >= S - 1) {
        at = "amskv_condensed_scales";
        ar_errorf(err,
                  "amskv_condensed_scales %d leaves no scale to roll: this model caches %d "
                  "scales (at most %d)",
                  p->amskv_condensed_scales, S - 1, S - 2);
    } else if (capacity(g, p->amskv_condensed_scales, p->amskv_min_scales, S - 2) >
               capacity(g, p->amskv_condensed_scales, p->amskv_max_scales, S - 1)) {
        at = "amskv_min_scales";
        ar_errorf(err,
                  "amskv_min_scales %d gives C_min = %lld tokens, more than C_max = %lld "
                  "(amskv_max_scales %d)",
                  p->amskv_min_scales,
                  capacity(g, p->amskv_condensed_scales, p->amskv_min_scales, S - 2),
                  capacity(g, p->amskv_condensed_scales, p->amskv_max_scales, S - 1),
                  p->amskv_max_scales);
    }
    if (at && field)
        *field = at;
    return at ? AR_ERR : AR_OK;
}

enum { AMSKV_ARRAYS = 6 }; /* the per-layer arrays, in one allocation */

static void place_arrays(amskv_t *s) {
    int **arrays[AMSKV_ARRAYS] = {&s->cap, &s->held, &s->was, &s->tail, &s->cache_now, &s->newest};
    for (int i = 0; i < AMSKV_ARRAYS; i++)
        *arrays[i] = s->mem + (size_t)i * s->n_layers;
}

static void amskv_end(void *state) {
    amskv_t *s = state;
    if (s)
        free(s->mem);
    free(s);
}

static void *amskv_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    amskv_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    const int L = g->n_layers, S = g->n_segments;
    s->steps = kv_geometry_steps(g);
    for (int t = 0; t < S; t++)
        s->seg[t] = g->segment_tokens[t] + (t == 0 ? g->n_prompt : 0);
    s->cds = (int)capacity(g, p->amskv_condensed_scales, 0, 0);
    s->cmin = (int)capacity(g, p->amskv_condensed_scales, p->amskv_min_scales, S - 2);
    s->cmax = (int)capacity(g, p->amskv_condensed_scales, p->amskv_max_scales, S - 1);
    s->theta = p->amskv_threshold;
    s->n_layers = L;
    if (!(s->mem = calloc(AMSKV_ARRAYS * (size_t)L, sizeof *s->mem))) {
        amskv_end(s);
        return NULL;
    }
    place_arrays(s);
    for (int l = 0; l < L; l++) {
        s->cap[l] = s->cmin;
        s->newest[l] = -1;
    }
    s->decided = -1;
    return s;
}

static int amskv_settled(const void *state, int t) {
    return ((const amskv_t *)state)->decided == t;
}

static void *amskv_clone(const void *state) {
    const amskv_t *from = state;
    amskv_t *s = malloc(sizeof *s);
    if (!s || !(s->mem = malloc(AMSKV_ARRAYS * (size_t)from->n_layers * sizeof *s->mem))) {
        free(s);
        return NULL;
    }
    int *mem = s->mem;
    *s = *from;
    s->mem = mem;
    memcpy(s->mem, from->mem, AMSKV_ARRAYS * (size_t)from->n_layers * sizeof *s->mem);
    place_arrays(s);
    return s;
}

/* Whether scale t would pass layer l's capacity (Algorithm 1, line 9),
 * with the layer still at C_min and able to grow (line 10), a scale not
 * skipped for its size (line 5). */
static int must_decide(const amskv_t *s, int t, int l) {
    const int r = s->seg[t];
    return r <= s->cmax && s->held[l] + r > s->cap[l] && s->cap[l] == s->cmin && s->cmax > s->cmin;
}

static int amskv_layer_similarity(const void *state, int t, int l) {
    const amskv_t *s = state;
    /* Measurable when the previous scale is the cache's newest, whole. */
    return must_decide(s, t, l) && t > 0 && s->newest[l] == t - 1;
}

/* Layer l's decision for step t (Algorithm 1, lines 5-16): its capacity,
 * whether the scale is cached, how much history stays. NaN similarity (not
 * measured) counts as cache-demanding. */
static void decide(amskv_t *s, int t, int l, double similarity) {
    const int r = s->seg[t];
    s->was[l] = s->held[l];
    s->tail[l] = -1;
    s->cache_now[l] = 0;
    if (r > s->cmax)
        return; /* line 5: never cached */
    if (s->held[l] + r > s->cap[l]) {
        if (must_decide(s, t, l)) {
            s->decided = t;
            if (!(similarity >= s->theta))
                s->cap[l] = s->cmax; /* line 11 */
        }
        if (s->held[l] + r > s->cap[l]) {
            if (r > s->cap[l] - s->cds)
                return; /* line 13 (beside the condensed scales, which stay) */
            s->tail[l] = s->cap[l] - s->cds - r; /* line 16: CLRU */
            s->held[l] = s->cds + s->tail[l];
        }
    }
    s->cache_now[l] = 1;
    s->held[l] += r;
    s->newest[l] = t;
}

static int amskv_layer_begin(void *state, int t, int l, int head, int len, double similarity,
                             int *keep, int *n_keep) {
    amskv_t *s = state;
    if (head == 0)
        decide(s, t, l, similarity);
    if (s->tail[l] < 0 || len != s->was[l] || len < s->cds + s->tail[l])
        return 0;
    int k = 0;
    kv_keep_range(keep, &k, 0, s->cds);
    kv_keep_range(keep, &k, len - s->tail[l], s->tail[l]);
    *n_keep = k;
    return KV_COMPACT;
}

static int amskv_layer_end(void *state, int t, int l, int head, int len, int *keep, int *n_keep,
                           int *cache) {
    (void)t, (void)head, (void)len, (void)keep, (void)n_keep;
    const amskv_t *s = state;
    if (!s->cache_now[l])
        *cache = 0;
    return 0;
}

static void amskv_describe(const void *state, const kv_policy_params_t *p, char *buf, size_t cap) {
    const amskv_t *s = state;
    snprintf(buf, cap,
             "per layer: %d condensed scale%s (%d tokens, the prefix included) always kept; "
             "C_min %d tokens, C_max %d (the scale attended included); a layer expands to "
             "C_max when its keys' similarity to the previous scale's falls below %g; "
             "planned as if every layer expands; the budget is not used",
             p->amskv_condensed_scales, p->amskv_condensed_scales == 1 ? "" : "s", s->cds, s->cmin,
             s->cmax, s->theta);
}

const kv_policy_ops_t kv_policy_amskv = {
    .name = "amskv",
    .default_budget = 1, /* its capacities come from the pyramid, not a budget */
    .takes_budget = 0,
    .step_units = 1u << KV_STEP_SEGMENT,
    .plan_bound = 1, /* every layer planned expanded at its first decision */
    .check = amskv_check,
    .begin = amskv_begin,
    .end = amskv_end,
    .clone = amskv_clone,
    .settled = amskv_settled,
    .layer_similarity = amskv_layer_similarity,
    .layer_begin = amskv_layer_begin,
    .layer_end = amskv_layer_end,
    .describe = amskv_describe,
};
