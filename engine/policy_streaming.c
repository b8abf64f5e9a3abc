/* StreamingLLM (Xiao et al.): every head keeps the condition prefix, the
 * first tokens as attention sinks and a window of the most recent tokens.
 * One token per step (raster): sink_tokens sinks, the window capped at
 * budget x the full cache's final length (the prefix counted). One scale
 * per step (next-scale): the first sink_scales scales as sinks and the most
 * recent scale, as HeatKV runs it on Infinity (HeatKV §4); the scales fix
 * the cache, so the budget is not used there. docs/kv-policies.md. */
#include "kv_policy_impl.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct streaming {
    int n_prompt, steps;
    int cap;   /* tokens: tokens one head may hold, prefix included */
    int sinks; /* tokens: image tokens kept after the prefix; scales: sink scales */
    /* scales only */
    int scales;               /* 1 when the steps are whole segments */
    int sink_tokens;          /* image tokens of the sink scales */
    int seg[KV_MAX_SEGMENTS]; /* tokens of each scale */
} streaming_t;

/* The sink scales' tokens on a scale geometry: the first sink_scales
 * scales (all of them when there are fewer). */
static int sink_scale_tokens(const kv_geometry_t *g, int sink_scales) {
    int n = 0;
    for (int i = 0; i < sink_scales && i < g->n_segments; i++)
        n += g->segment_tokens[i];
    return n;
}

static int streaming_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                           ar_error_t *err) {
    /* Scales: sinks and the most recent scale suit any pyramid (with more
     * sink scales than cached scales nothing is ever evicted). */
    if (g->step_unit == KV_STEP_SEGMENT)
        return AR_OK;
    const int P = g->n_prompt, N = P + kv_geometry_image_tokens(g) - 1;
    const int cap = kv_budget_share(p->budget, N);
    const long long need = (long long)P + p->sink_tokens + 1;
    if (cap >= need)
        return AR_OK;
    ar_errorf(err,
              "budget %g holds %d of the %d tokens of a full cache; streaming needs the prefix "
              "(%d) + sink_tokens (%d) + 1 recent token = %lld (budget >= %lld/%d = %.4g)",
              p->budget, cap, N, P, p->sink_tokens, need, need, N, (double)need / N);
    if (field)
        *field = "budget";
    return AR_ERR;
}

static int streaming_uses_budget(const kv_geometry_t *g) { return g->step_unit != KV_STEP_SEGMENT; }

static void *streaming_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    streaming_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->n_prompt = g->n_prompt;
    s->steps = kv_geometry_steps(g);
    s->scales = g->step_unit == KV_STEP_SEGMENT;
    if (s->scales) {
        s->sinks = p->sink_scales;
        s->sink_tokens = sink_scale_tokens(g, p->sink_scales);
        for (int i = 0; i < g->n_segments && i < KV_MAX_SEGMENTS; i++)
            s->seg[i] = g->segment_tokens[i];
        return s;
    }
    s->cap = kv_budget_share(p->budget, g->n_prompt + kv_geometry_image_tokens(g) - 1);
    s->sinks = p->sink_tokens;
    return s;
}

/* Tokens: compacts once a head reaches the cap, so that the next append
 * brings it back to cap. Scales: after step t's append a head holds the
 * sink scales, scale t - 1 and scale t; from t = sinks + 1 on, scale t - 1
 * is neither a sink nor the most recent scale, and goes. Never at the last
 * step (the sequence is released after it). */
static int streaming_compacts(const streaming_t *s, int t, int len) {
    if (t >= s->steps - 1)
        return 0;
    return s->scales ? t > s->sinks : len >= s->cap;
}

static int streaming_kept_after(const void *state, int t, int v) {
    const streaming_t *s = state;
    if (!streaming_compacts(s, t, s->n_prompt + v))
        return v;
    return s->scales ? s->sink_tokens + s->seg[t] : s->cap - 1 - s->n_prompt;
}

/* Prefix + sinks + the most recent tokens (StreamingLLM §3.2), or prefix +
 * sink scales + the scale just appended. */
static int streaming_step_end(void *state, int t, int layer, int head, int len, const float *mass,
                              int *keep, int *n_keep) {
    const streaming_t *s = state;
    if (!streaming_compacts(s, t, len))
        return 0;
    const int first = s->n_prompt + (s->scales ? s->sink_tokens : s->sinks);
    const int recent = s->scales ? s->seg[t] : s->cap - 1 - first;
    int k = 0;
    kv_keep_range(keep, &k, 0, first);
    kv_keep_range(keep, &k, len - recent, recent);
    *n_keep = k;
    return KV_COMPACT;
}

static void streaming_describe(const void *state, const kv_policy_params_t *p, char *buf,
                               size_t cap) {
    const streaming_t *s = state;
    if (!s->scales) {
        snprintf(buf, cap, "cap %d tokens per head: prefix %d + %d sinks + a window of %d", s->cap,
                 s->n_prompt, s->sinks, s->cap - s->n_prompt - s->sinks);
        return;
    }
    /* The peak: the most a head holds after any step's append. */
    int peak = 0, at = 0, v = 0;
    for (int t = 0; t < s->steps; t++) {
        v += t < s->steps - 1 ? s->seg[t] : 0;
        if (s->n_prompt + v > peak) {
            peak = s->n_prompt + v;
            at = t;
        }
        v = streaming_kept_after(s, t, v);
    }
    const int n_sinks = s->sinks < s->steps ? s->sinks : s->steps;
    snprintf(buf, cap,
             "prefix %d + %d sink scale%s (%d tokens) + the most recent scale, per head; peak %d "
             "tokens at step %d; the budget is not used on scales (sink_tokens neither)",
             s->n_prompt, n_sinks, n_sinks == 1 ? "" : "s", s->sink_tokens, peak, at);
}

const kv_policy_ops_t kv_policy_streaming = {
    .name = "streaming",
    /* No ratio of its own: linear's, to compare alike. */
    .default_budget = 1.0 / 6,
    .takes_budget = 1,
    .uses_budget = streaming_uses_budget,
    .check = streaming_check,
    .begin = streaming_begin,
    .end = free,
    .kept_after = streaming_kept_after,
    .step_end = streaming_step_end,
    .describe = streaming_describe,
};
