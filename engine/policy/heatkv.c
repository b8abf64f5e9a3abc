/* HeatKV's static schedule (heatkv.h). */
#include "engine/policy/heatkv.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Tokens of the scales before `end` (the cached ones at most). */
static long long tokens_before(const kv_geometry_t *g, int end) {
    long long n = 0;
    for (int i = 0; i < end && i < g->n_segments - 1; i++)
        n += g->segment_tokens[i];
    return n;
}

static int clamp_sinks(const kv_geometry_t *g, int sinks) {
    return sinks < g->n_segments - 1 ? sinks : g->n_segments - 1;
}

double heatkv_min_budget(const kv_geometry_t *g, int sinks) {
    const long long P = tokens_before(g, g->n_segments - 1);
    return P > 0 ? (double)tokens_before(g, clamp_sinks(g, sinks)) / (double)P : 0;
}

int heatkv_n_pruned(const kv_geometry_t *g, int sinks, double budget, int k) {
    const int s = clamp_sinks(g, sinks), T = g->n_layers * g->n_heads;
    if (k < s || k >= g->n_segments - 1)
        return 0;
    const double P = (double)tokens_before(g, g->n_segments - 1), bP = budget * P;
    const double ck = (double)tokens_before(g, k + 1), cs = (double)tokens_before(g, s);
    if (ck <= bP * (1 + 1e-12))
        return 0;
    /* The epsilon keeps an exact quotient from rounding up past itself. */
    const double n = ceil((double)T * (ck - bP) / (ck - cs) - 1e-9);
    return n < 0 ? 0 : n > T ? T : (int)n;
}

void heatkv_schedule_free(heatkv_schedule_t *s) {
    free(s->gone);
    free(s->early);
    memset(s, 0, sizeof *s);
}

int heatkv_present(const heatkv_schedule_t *s, int src, int head, int k, int before) {
    if (src >= s->n_scales - 1 || src > k || (before && src == k))
        return 0;
    if (src < s->sinks)
        return 1;
    const size_t u = (size_t)src * s->n_layers * s->n_heads + head;
    const int g = s->gone[u];
    return !(g < k || (g == k && (!before || s->early[u])));
}

long long heatkv_tokens_at(const heatkv_schedule_t *s, const kv_geometry_t *g, int k, int l,
                           int before) {
    const int T = s->n_layers * s->n_heads;
    long long n = 0;
    for (int head = 0; head < T; head++) {
        const int b = before || head / s->n_heads > l;
        for (int src = 0; src <= k && src < s->n_scales - 1; src++)
            if (heatkv_present(s, src, head, k, b))
                n += g->segment_tokens[src];
    }
    return n;
}

/* A candidate for early pruning at one step: one unit (src, head), or a
 * whole head (src = -1, binary). */
typedef struct {
    int src, head, layer, rank;
} candidate_t;

static int candidate_cmp(const void *a, const void *b) {
    const candidate_t *x = a, *y = b;
    if (x->layer != y->layer)
        return y->layer - x->layer; /* layer descending */
    if (x->src != y->src)
        return y->src - x->src; /* source scale descending */
    return x->rank - y->rank;   /* rank ascending */
}

/* Marks candidate c early at step k; returns the tokens it frees in layers
 * that have not run step k yet. */
static long long activate(heatkv_schedule_t *s, const kv_geometry_t *g, const candidate_t *c,
                          int k) {
    const int T = s->n_layers * s->n_heads;
    long long freed = 0;
    for (int src = s->sinks; src <= k && src < s->n_scales - 1; src++) {
        if (c->src >= 0 && src != c->src)
            continue;
        const size_t u = (size_t)src * T + c->head;
        if (s->gone[u] != k || s->early[u])
            continue;
        s->early[u] = 1;
        if (src < k)
            freed += g->segment_tokens[src];
    }
    return freed;
}

int heatkv_schedule_build(heatkv_schedule_t *s, const kv_geometry_t *g, const kv_calibration_t *c,
                          int sinks, double budget, int binary, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    const int K = g->n_segments, L = g->n_layers, H = g->n_heads, T = L * H;
    if (kv_calibration_check(c, g, err) != AR_OK)
        return AR_ERR;
    s->n_scales = K;
    s->n_layers = L;
    s->n_heads = H;
    s->sinks = clamp_sinks(g, sinks);
    s->cap_tokens = budget * (double)T * (double)tokens_before(g, K - 1);
    const double min_b = heatkv_min_budget(g, sinks);
    if (budget < min_b * (1 - 1e-12))
        return ar_errorf(err,
                         "budget %g is below the %d sink scales' share of the cache, %lld of %lld "
                         "tokens per head (budget >= %.4g, or fewer sink_scales)",
                         budget, s->sinks, tokens_before(g, s->sinks), tokens_before(g, K - 1),
                         min_b);
    const size_t n_units = (size_t)(K - 1) * T;
    s->gone = malloc(n_units);
    s->early = calloc(n_units, 1);
    int *rank = malloc(n_units * sizeof *rank); /* of each unit in its ordering */
    candidate_t *cand = malloc(n_units * sizeof *cand);
    if (!s->gone || !s->early || !rank || !cand) {
        free(rank);
        free(cand);
        heatkv_schedule_free(s);
        return ar_errorf(err, "out of memory for a HeatKV schedule of %zu head-scales", n_units);
    }
    memset(s->gone, K, n_units);
    for (int src = 0; src < K - 1; src++) {
        const int *order = binary ? c->cas_order : c->scas_order + (size_t)src * T;
        for (int r = 0; r < T; r++)
            rank[(size_t)src * T + order[r]] = r;
    }
    /* G_k: the first N_k of each ordering, for every source scale so far. */
    for (int k = s->sinks; k < K - 1; k++) {
        s->N[k] = heatkv_n_pruned(g, sinks, budget, k);
        for (int src = s->sinks; src <= k; src++)
            for (int head = 0; head < T; head++) {
                const size_t u = (size_t)src * T + head;
                if (s->gone[u] == K && rank[u] < s->N[k])
                    s->gone[u] = (unsigned char)k;
            }
    }
    /* Greedy early pruning, step by step. */
    int rc = AR_OK;
    for (int k = s->sinks; k < K - 1 && rc == AR_OK; k++) {
        int n = 0;
        for (int head = 0; head < T; head++) {
            if (binary) {
                /* A head entering G at k, with something cached to free. */
                if (k > s->sinks && s->gone[(size_t)s->sinks * T + head] == k)
                    cand[n++] = (candidate_t){-1, head, head / H, rank[head]};
                continue;
            }
            for (int src = s->sinks; src < k; src++)
                if (s->gone[(size_t)src * T + head] == k)
                    cand[n++] = (candidate_t){src, head, head / H, rank[(size_t)src * T + head]};
        }
        qsort(cand, (size_t)n, sizeof *cand, candidate_cmp);
        unsigned char *used = calloc((size_t)n + 1, 1);
        if (!used) {
            rc = ar_errorf(err, "out of memory");
            break;
        }
        const double B = s->cap_tokens * (1 + 1e-12);
        for (int l = 0; l < L && rc == AR_OK; l++) {
            long long total = heatkv_tokens_at(s, g, k, l, 0);
            for (int i = 0; total > B && i < n; i++) {
                if (used[i] || cand[i].layer <= l)
                    continue;
                used[i] = 1;
                s->n_early[k]++;
                total -= activate(s, g, &cand[i], k);
            }
            if (total > B)
                rc = ar_errorf(err, "HeatKV: budget %g cannot hold after layer %d of scale %d",
                               budget, l, k);
        }
        free(used);
    }
    free(rank);
    free(cand);
    if (rc != AR_OK)
        heatkv_schedule_free(s);
    return rc;
}
