/* A stand-in for engine/kv_policy.c (the policies of issue 5, written on
 * another branch) that serves only the full cache, so the engine, the
 * daemon and the tests link until the real file lands. The Makefile builds
 * it only while engine/kv_policy.c does not exist; it is not a policy
 * implementation and goes away with that merge. */
#include <stdlib.h>
#include <string.h>

#include "engine/kv_policy.h"

static const char *const names[] = {"full", "streaming", "linear", "headkv"};

void kv_policy_defaults(kv_policy_params_t *p, kv_policy_kind_t kind) {
    memset(p, 0, sizeof *p);
    p->kind = kind;
    p->budget = 1.0;
}

int kv_policy_parse(const char *name) {
    for (int i = 0; i < 4; i++)
        if (strcmp(name, names[i]) == 0)
            return i;
    return -1;
}

const char *kv_policy_name(kv_policy_kind_t kind) {
    return (unsigned)kind < 4 ? names[kind] : "unknown";
}

int kv_policy_validate(const kv_policy_params_t *p, const kv_geometry_t *g, ar_error_t *err) {
    if (p->kind != KV_POLICY_FULL)
        return ar_errorf(err, "kv_policy '%s' is not built into this server yet",
                         kv_policy_name(p->kind));
    if (g->n_prompt < 1 || g->line_width < 1 || g->n_lines < 1)
        return ar_errorf(err, "a request of %d prompt tokens and %d x %d image tokens", g->n_prompt,
                         g->n_lines, g->line_width);
    return AR_OK;
}

int kv_policy_trajectory(const kv_policy_params_t *p, const kv_geometry_t *g, int *tokens) {
    if (p->kind != KV_POLICY_FULL)
        return AR_ERR;
    for (int t = 0; t < kv_geometry_steps(g); t++)
        tokens[t] = g->n_prompt + t;
    return AR_OK;
}

struct kv_policy_state {
    int unused;
};

kv_policy_state_t *kv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g,
                                   ar_error_t *err) {
    if (kv_policy_validate(p, g, err) != AR_OK)
        return NULL;
    kv_policy_state_t *s = calloc(1, sizeof *s);
    if (!s)
        ar_errorf(err, "out of memory");
    return s;
}

void kv_policy_end(kv_policy_state_t *s) { free(s); }

int kv_policy_collect(const kv_policy_state_t *s, int step) { return 0; }

int kv_policy_step_end(kv_policy_state_t *s, int step, int layer, int head, int len,
                       const float *mass, int *keep, int *n_keep) {
    *n_keep = len;
    return 0;
}
