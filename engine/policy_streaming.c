/* StreamingLLM (Xiao et al.): every head keeps the condition prefix, the
 * first sink_tokens image tokens as attention sinks and a window of the most
 * recent tokens, capped at budget x the full cache's final length (the
 * prefix counted). Works on any geometry with one token per step. */
#include "kv_policy_impl.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct streaming {
    int n_prompt, steps;
    int cap;   /* tokens one head may hold, prefix included */
    int sinks; /* image tokens kept after the prefix */
} streaming_t;

static int streaming_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                           ar_error_t *err) {
    if (g->step_unit != KV_STEP_TOKEN)
        return ar_errorf(err, "streaming works on models that feed one token per step; this "
                              "model's steps are whole segments (scales)");
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

static void *streaming_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    streaming_t *s = malloc(sizeof *s);
    if (!s)
        return NULL;
    s->n_prompt = g->n_prompt;
    s->steps = kv_geometry_steps(g);
    s->cap = kv_budget_share(p->budget, g->n_prompt + kv_geometry_image_tokens(g) - 1);
    s->sinks = p->sink_tokens;
    return s;
}

/* Compacts once a head reaches the cap, so that the next append brings it
 * back to cap; never at the last step (the sequence is released after it). */
static int streaming_compacts(const streaming_t *s, int t, int len) {
    return len >= s->cap && t < s->steps - 1;
}

static int streaming_kept_after(const void *state, int t, int v) {
    const streaming_t *s = state;
    return streaming_compacts(s, t, s->n_prompt + v) ? s->cap - 1 - s->n_prompt : v;
}

/* Prefix + sinks + the most recent tokens (StreamingLLM §3.2). */
static int streaming_step_end(void *state, int t, int layer, int head, int len, const float *mass,
                              int *keep, int *n_keep) {
    const streaming_t *s = state;
    if (!streaming_compacts(s, t, len))
        return 0;
    const int recent = s->cap - 1 - s->n_prompt - s->sinks;
    int k = 0;
    kv_keep_range(keep, &k, 0, s->n_prompt + s->sinks);
    kv_keep_range(keep, &k, len - recent, recent);
    *n_keep = k;
    return KV_COMPACT;
}

static void streaming_describe(const void *state, const kv_policy_params_t *p, char *buf,
                               size_t cap) {
    const streaming_t *s = state;
    snprintf(buf, cap, "cap %d tokens per head: prefix %d + %d sinks + a window of %d", s->cap,
             s->n_prompt, s->sinks, s->cap - s->n_prompt - s->sinks);
}

const kv_policy_ops_t kv_policy_streaming = {
    .name = "streaming",
    /* No ratio of its own: linear's, to compare alike. */
    .default_budget = 1.0 / 6,
    .takes_budget = 1,
    .check = streaming_check,
    .begin = streaming_begin,
    .end = free,
    .kept_after = streaming_kept_after,
    .step_end = streaming_step_end,
    .describe = streaming_describe,
};
