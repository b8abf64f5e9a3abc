/* HeatKV (static per head-scale pruning for next-scale models): the
 * schedule (engine/policy/heatkv.h) is built once per request from the model's
 * calibration; each (layer, head) then holds whole scales, and drops, as
 * soon as its layer has attended at a step, every scale the next step's
 * attention does not see (the step's G and the next step's early set E:
 * HeatKV's code compacts each layer after its attention to the next
 * scale's schedule). The policy keeps, per head, the set of scales
 * it holds, so it can turn the schedule into keep lists. heatkv prunes
 * head-scales by S-CAS; heatkv_binary (policy_heatkv_binary.c) whole heads
 * by CAS. docs/kv-policies.md. */
#include "engine/policy/heatkv.h"
#include "engine/policy/kv_policy_impl.h"

#include <stdio.h>
#include <stdlib.h>

typedef struct heatkv {
    kv_geometry_t g;
    heatkv_schedule_t sch;
    unsigned *have; /* per (layer, head): bit i when scale i is cached */
} heatkv_t;

int heatkv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, int binary,
                        const char **field, ar_error_t *err) {
    const char *name = binary ? "heatkv_binary" : "heatkv";
    if (g->step_unit != KV_STEP_SEGMENT || g->n_segments > 32)
        return ar_errorf(err,
                         "%s works on next-scale models (at most 32 scales); this model's "
                         "steps are %s",
                         name, g->step_unit == KV_STEP_SEGMENT ? "more than 32 scales" : "tokens");
    if (!g->calibration)
        return ar_errorf(err,
                         "%s needs the model's KV calibration at this image size (%s in the "
                         "model directory): run `arserve calibrate --model DIR --prompts FILE "
                         "--size WxH` with this size",
                         name, KV_CALIBRATION_FILE);
    if (kv_calibration_check(g->calibration, g, err) != AR_OK)
        return AR_ERR;
    if (binary && g->calibration->sink_scales != p->sink_scales) {
        if (field)
            *field = "sink_scales";
        return ar_errorf(err,
                         "sink_scales %d: the calibration's CAS ordering was made with %d sink "
                         "scales (run `arserve calibrate --sink-scales %d` for another)",
                         p->sink_scales, g->calibration->sink_scales, p->sink_scales);
    }
    const double min_b = heatkv_min_budget(g, p->sink_scales);
    if (p->budget < min_b * (1 - 1e-12)) {
        if (field)
            *field = "budget";
        return ar_errorf(err,
                         "budget %g holds less than the %d sink scales, which %s keeps whole "
                         "(budget >= %.4g, or fewer sink_scales)",
                         p->budget, p->sink_scales, name, min_b);
    }
    return AR_OK;
}

void heatkv_policy_end(void *state) {
    heatkv_t *s = state;
    if (!s)
        return;
    heatkv_schedule_free(&s->sch);
    free(s->have);
    free(s);
}

void *heatkv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g, int binary) {
    heatkv_t *s = calloc(1, sizeof *s);
    if (!s)
        return NULL;
    s->g = *g;
    s->have = calloc((size_t)g->n_layers * g->n_heads, sizeof *s->have);
    if (!s->have || heatkv_schedule_build(&s->sch, g, g->calibration, p->sink_scales, p->budget,
                                          binary, NULL) != AR_OK) {
        heatkv_policy_end(s);
        return NULL;
    }
    return s;
}

static void *heatkv_begin(const kv_policy_params_t *p, const kv_geometry_t *g) {
    return heatkv_policy_begin(p, g, 0);
}

/* The scales before step t a head holds at the step's start (before) or
 * once its layer has run the step. */
static unsigned old_scales(const heatkv_t *s, int head, int t, int before) {
    unsigned m = 0;
    for (int src = 0; src < t && src < 32; src++)
        if (heatkv_present(&s->sch, src, head, t, before))
            m |= 1u << src;
    return m;
}

/* have -> want as a compaction; 0 when nothing goes. */
static int compact_to(heatkv_t *s, int head, unsigned want, int len, int *keep, int *n_keep) {
    const unsigned have = s->have[head];
    if ((have & want) == have)
        return 0;
    const int k = kv_keep_segments(&s->g, have, have & want, len, keep);
    if (k < 0)
        return 0; /* the cache is not what the schedule says: keep it all */
    s->have[head] = have & want;
    *n_keep = k;
    return KV_COMPACT;
}

int heatkv_policy_step_begin(void *state, int t, int layer, int head, int len, int *keep,
                             int *n_keep) {
    heatkv_t *s = state;
    const int u = layer * s->g.n_heads + head;
    return compact_to(s, u, old_scales(s, u, t, 1), len, keep, n_keep);
}

int heatkv_policy_layer_end(void *state, int t, int layer, int head, int len, int *keep,
                            int *n_keep, int *cache) {
    heatkv_t *s = state;
    const int u = layer * s->g.n_heads + head;
    /* What step t + 1 attends to, once its early set has gone: nothing
     * before that reads the head again. */
    const int what = compact_to(s, u, old_scales(s, u, t + 1, 1), len, keep, n_keep);
    if (!heatkv_present(&s->sch, t, u, t + 1, 1))
        *cache = 0;
    if (*cache)
        s->have[u] |= 1u << t;
    return what;
}

void heatkv_policy_describe(const void *state, const kv_policy_params_t *p, char *buf, size_t cap) {
    const heatkv_t *s = state;
    const heatkv_schedule_t *h = &s->sch;
    const int T = h->n_layers * h->n_heads;
    int used = snprintf(buf, cap,
                        "B = %.0f tokens over %d heads (%.4g per head); %d sink scale%s kept "
                        "whole; heads pruned per scale N_k =",
                        h->cap_tokens, T, h->cap_tokens / T, h->sinks, h->sinks == 1 ? "" : "s");
    for (int k = 0; k < h->n_scales - 1 && used > 0 && (size_t)used < cap; k++)
        used +=
            snprintf(buf + used, cap - (size_t)used, " %d%s", h->N[k], h->n_early[k] ? "*" : "");
    if (used > 0 && (size_t)used < cap)
        snprintf(buf + used, cap - (size_t)used, " (* with early pruning)");
}

static int heatkv_check(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                        ar_error_t *err) {
    return heatkv_policy_check(p, g, 0, field, err);
}

const kv_policy_ops_t kv_policy_heatkv = {
    .name = "heatkv",
    .default_budget = 0.1, /* HeatKV's middle budget (Tab. 1: 4%, 10%, 20%) */
    .takes_budget = 1,
    .step_units = 1u << KV_STEP_SEGMENT,
    .check = heatkv_check,
    .begin = heatkv_begin,
    .end = heatkv_policy_end,
    .step_begin = heatkv_policy_step_begin,
    .layer_end = heatkv_policy_layer_end,
    .describe = heatkv_policy_describe,
};
