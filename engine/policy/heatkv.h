/* HeatKV's static schedule (HeatKV §3.2-3.3, Algorithm 1): for budget b,
 * which head-scales (source scale i, layer l, head h) are pruned at which
 * step, computed once before a request runs from the calibration's
 * orderings, so the request's KV at every layer of every step is known.
 *
 * Steps are scales (0-based): step k feeds scale k; the last scale is never
 * cached. With P the tokens of every cached scale, c_k the tokens through
 * scale k and c_s those of the s sink scales, step k >= s prunes
 *   N_k = clamp(ceil(T (c_k - bP) / (c_k - c_s)), 0, T)
 * heads of each source scale i <= k (eq. 5; 0 when c_k <= bP), the first
 * N_k of that scale's S-CAS ordering (scale-dependent) or of the CAS
 * ordering (binary, where a pruned head keeps only its sinks). G_k, the
 * union, only grows. Step k's attention sees what is left once the early
 * set E_k is gone; after layer l's attention at step k, layer l drops the
 * rest of G_k and E_{k+1} (nothing reads them again) and appends scale k
 * unless it is in either (HeatKV's code: each layer compacts after its
 * attention to the next scale's schedule). The budget B = b T P
 * tokens holds after every layer: whenever it would not, greedy early
 * pruning adds candidates of G_k \ G_{k-1} from layers past l to E_k, by
 * layer descending, then source scale descending, then rank (a binary
 * candidate is a whole head). */
#ifndef ARSERVE_HEATKV_H
#define ARSERVE_HEATKV_H

#include "base/status.h"
#include "engine/policy/kv_calibration.h"
#include "engine/policy/kv_policy.h"

typedef struct heatkv_schedule {
    int n_scales, n_layers, n_heads, sinks;
    double cap_tokens;      /* B: tokens every head may hold together, b T P */
    int N[KV_MAX_SEGMENTS]; /* N_k per step */
    /* Per unit (i * T + head), for source scales i < n_scales - 1: the step
     * whose G it enters first (n_scales: never), and whether it is in that
     * step's early set E. */
    unsigned char *gone;
    unsigned char *early;
    int n_early[KV_MAX_SEGMENTS]; /* |E_k| in candidates (heads when binary) */
} heatkv_schedule_t;

/* The least budget heatkv takes on g: the sink scales' share of the cache. */
double heatkv_min_budget(const kv_geometry_t *g, int sinks);

/* N_k for step k (eq. 5), for T heads. */
int heatkv_n_pruned(const kv_geometry_t *g, int sinks, double budget, int k);

/* Builds the schedule from c's orderings (CAS when binary, else S-CAS).
 * AR_ERR when b is below heatkv_min_budget or memory runs out. */
int heatkv_schedule_build(heatkv_schedule_t *s, const kv_geometry_t *g, const kv_calibration_t *c,
                          int sinks, double budget, int binary, ar_error_t *err);
void heatkv_schedule_free(heatkv_schedule_t *s);

/* Is unit (src, head) cached after layer `head / n_heads` has run step k?
 * before: at the start of step k instead (after E_k went). */
int heatkv_present(const heatkv_schedule_t *s, int src, int head, int k, int before);

/* Tokens every head holds together at the start of step k (before = 1) or
 * after layer l has run it: Algorithm 2's CacheSizeAfterLayer for our step
 * (layers past l do not hold scale k yet). For tests and the planner. */
long long heatkv_tokens_at(const heatkv_schedule_t *s, const kv_geometry_t *g, int k, int l,
                           int before);

/* The policy's hooks, shared by heatkv and heatkv_binary (policy_heatkv.c). */
int heatkv_policy_check(const kv_policy_params_t *p, const kv_geometry_t *g, int binary,
                        const char **field, ar_error_t *err);
void *heatkv_policy_begin(const kv_policy_params_t *p, const kv_geometry_t *g, int binary);
void heatkv_policy_end(void *state);
int heatkv_policy_step_begin(void *state, int t, int layer, int head, int len, int *keep,
                             int *n_keep);
int heatkv_policy_layer_end(void *state, int t, int layer, int head, int len, int *keep,
                            int *n_keep, int *cache);
void heatkv_policy_describe(const void *state, const kv_policy_params_t *p, char *buf, size_t cap);

#endif
