/* StreamingLLM (Xiao et al.): every head keeps the condition prefix, the
 * first tokens as attention sinks and a window of the most recent tokens,
 * within a cap of budget x the full cache's final length (the prefix
 * counted). One token per step (raster): sink_tokens sinks, compacted after
 * steps. One scale per step (next-scale): the first sink_scales scales as
 * sinks, as HeatKV runs it on Infinity (HeatKV §4), and the cap holds after
 * every layer: before a layer's new scale is appended the oldest tokens
 * past the sinks make room for it, and of a scale larger than the room
 * beside the sinks only the newest tokens are cached (a layered policy
 * there). docs/kv-policies.md. */
#include "engine/policy/kv_policy_impl.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct streaming {
    int steps;
    int cap;   /* tokens one head may hold, prefix included */
    int sinks; /* tokens: image tokens kept after the prefix; scales: sink scales */
    /* scales only */
    int scales;      /* 1 when the steps are whole segments */
    int kept;        /* tokens never evicted: the prefix and the sink scales */
    kv_geometry_t g; /* for the tokens each step feeds */
} streaming_t;

/* The prefix and the sink scales' tokens on a scale geometry: the first
 * sink_scales scales (all of them when there are fewer). */
static int sink_scale_tokens(const kv_geometry_t *g, int sink_scales) {
    int n = g->n_prompt;
    for (int i = 0; i < sink_scales && i < g->n_segments; i++)
        n += g->segment_tokens[i];
    return n;
}

/* Tokens of the full cache at its end: the prefix and every token fed. */
static int full_tokens(const kv_geometry_t *g) {
    return kv_geometry_held(g, kv_geometry_steps(g) - 1);
}

static int streaming_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                           ar_error_t *err) {
    const int N = full_tokens(g), cap = kv_budget_share(p->budget, N);
    if (g->step_unit == KV_STEP_SEGMENT) {
        /* The sinks and one recent token, unless the sinks are everything. */
        const int kept = sink_scale_tokens(g, p->sink_scales);
        const int need = kept < N ? kept + 1 : N;
        if (cap >= need)
            return AR_OK;
        ar_errorf(err,
                  "budget %g holds %d of the %d tokens of a full cache; streaming needs the "
                  "prefix and %d sink scales (%d tokens) + 1 recent token = %d (budget >= "
                  "%d/%d = %.4g, or fewer sink_scales)",
                  p->budget, cap, N, p->sink_scales, kept, need, need, N, (double)need / N);
        if (field)
            *field = "budget";
        return AR_ERR;
    }
    const int P = g->n_prompt;
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

static int streaming_layered_on(const kv_geometry_t *g) { return g->step_unit == KV_STEP_SEGMENT; }

static void *streaming_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    streaming_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->steps = kv_geometry_steps(g);
    s->scales = g->step_unit == KV_STEP_SEGMENT;
    s->cap = kv_budget_share(p->budget, full_tokens(g));
    s->sinks = s->scales ? p->sink_scales : p->sink_tokens;
    s->kept = s->scales ? sink_scale_tokens(g, p->sink_scales) : g->n_prompt + p->sink_tokens;
    s->g = *g;
    return s;
}

/* Keeps the first `kept` tokens and the newest `recent` of len. */
static int keep_ends(int *keep, int *n_keep, int len, int kept, int recent) {
    int k = 0;
    kv_keep_range(keep, &k, 0, kept);
    kv_keep_range(keep, &k, len - recent, recent);
    *n_keep = k;
    return KV_COMPACT;
}

/* Scales, before layer l's new tokens are appended: the newest of them
 * that fit beside the sinks are cached, and the oldest others make room
 * for them. */
static int streaming_layer_end(void *state, int t, int l, int head, int len, int *keep, int *n_keep,
                               int *cache) {
    (void)t, (void)l, (void)head;
    const streaming_t *s = state;
    const int fed = *cache, room = s->cap - s->kept; /* room: tokens past the sinks */
    if (len + fed <= s->cap)
        return 0;
    *cache = fed < room ? fed : room;
    const int stay = room - *cache; /* older tokens past the sinks that stay */
    return len - s->kept <= stay ? 0 : keep_ends(keep, n_keep, len, s->kept, stay);
}

/* Tokens: compacts once a head reaches the cap, so that the next append
 * brings it back to cap. Never at the last step (the sequence is released
 * after it). Scales compact inside the step (above). */
static int streaming_compacts(const streaming_t *s, int t, int len) {
    return !s->scales && t < s->steps - 1 && len >= s->cap;
}

static int streaming_kept_after(const void *state, int t, int v) {
    const streaming_t *s = state;
    return streaming_compacts(s, t, s->g.n_prompt + v) ? s->cap - 1 - s->g.n_prompt : v;
}

/* Prefix + sinks + the most recent tokens (StreamingLLM §3.2). */
static int streaming_step_end(void *state, int t, int layer, int head, int len, const float *mass,
                              int *keep, int *n_keep) {
    (void)layer, (void)head, (void)mass;
    const streaming_t *s = state;
    if (!streaming_compacts(s, t, len))
        return 0;
    return keep_ends(keep, n_keep, len, s->kept, s->cap - 1 - s->kept);
}

static void streaming_describe(const void *state, const kv_policy_params_t *p, char *buf,
                               size_t cap) {
    const streaming_t *s = state;
    if (!s->scales) {
        snprintf(buf, cap, "cap %d tokens per head: prefix %d + %d sinks + a window of %d", s->cap,
                 s->g.n_prompt, s->sinks, s->cap - s->g.n_prompt - s->sinks);
        return;
    }
    const int n_sinks = s->sinks < s->g.n_segments ? s->sinks : s->g.n_segments;
    snprintf(buf, cap,
             "cap %d tokens per head after every layer: prefix %d + %d sink scale%s (%d tokens "
             "with the prefix) + the %d most recent tokens",
             s->cap, s->g.n_prompt, n_sinks, n_sinks == 1 ? "" : "s", s->kept, s->cap - s->kept);
    (void)p;
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
    .layer_end = streaming_layer_end,
    .layered_on = streaming_layered_on,
    .describe = streaming_describe,
};
