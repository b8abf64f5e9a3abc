/* What a KV policy implements (one file each, engine/policy_<name>.c) and
 * the helpers they share; engine/policy/kv_policy.c dispatches through the table.
 * Only policy files and kv_policy.c include this header. */
#ifndef ARSERVE_KV_POLICY_IMPL_H
#define ARSERVE_KV_POLICY_IMPL_H

#include "engine/policy/kv_policy.h"

/* One policy. The dispatcher checks the geometry, the budget and the knob
 * ranges before calling check, and calls the others only for parameters
 * that passed check on the same geometry. */
typedef struct kv_policy_ops {
    const char *name;
    double default_budget; /* its own budget (1 for a policy that takes none) */
    int takes_budget;      /* 0: the budget is ignored (full) */
    unsigned stats;        /* KV_STATS_* it asks the engine to collect */
    /* The step units (1 << KV_STEP_*) it runs on; 0: every one. */
    unsigned step_units;
    /* 1 when its trajectory is a worst case that some heads stay below
     * (what it settles while a request runs: kv_policy_remaining_blocks
     * tightens it through clone); 0 when every head holds what it says
     * during every step. kv_policy_plan_exact reads it. */
    int plan_bound;
    /* With plan_bound: the last step during which every head still holds
     * what the plan says (nothing has settled yet), for kv_policy_peak_exact;
     * NULL: none is promised. */
    int (*plan_exact_through)(const kv_policy_params_t *p);
    /* Whether the budget means anything on geometry g (streaming on scales:
     * no). NULL: takes_budget. */
    int (*uses_budget)(const kv_geometry_t *g);
    /* Its own rules on p and g; *field as kv_policy_check says. */
    int (*check)(const kv_policy_params_t *p, const kv_geometry_t *g, const char **field,
                 ar_error_t *err);
    /* Its state for one sequence (what it derives from p and g, and any
     * per-head memory); NULL when out of memory. */
    void *(*begin)(const kv_policy_params_t *p, const kv_geometry_t *g);
    void (*end)(void *state);
    /* A copy of a state, for kv_policy_remaining_blocks to run forward;
     * NULL for a policy whose plan never tightens (exact, or static). */
    void *(*clone)(const void *state);
    /* With clone: did step t settle something its plan took at the worst
     * (HeadKV's grouping, an AMS-KV layer's decision)? Only then is the
     * rest worth simulating again. */
    int (*settled)(const void *state, int t);
    /* Image tokens a worst-case head keeps after step t's compaction when
     * it holds v image tokens during the step: the trajectory's rule. */
    int (*kept_after)(const void *state, int t, int v);
    /* Does it want key mass collected during step t? NULL: never. */
    int (*collect)(const void *state, int t);
    /* kv_policy_step_end for one (layer, head); NULL: keeps everything. */
    int (*step_end)(void *state, int t, int layer, int head, int len, const float *mass, int *keep,
                    int *n_keep);
    /* Pruning inside a step (kv_policy_layered); NULL for a policy that
     * compacts only after steps. Called as kv_policy_step_begin,
     * kv_policy_layer_similarity, kv_policy_layer_begin and
     * kv_policy_layer_end say; their counts may not depend on key mass. A
     * layered policy has layer_end. */
    int (*step_begin)(void *state, int t, int layer, int head, int len, int *keep, int *n_keep);
    int (*layer_similarity)(const void *state, int t, int layer);
    int (*layer_begin)(void *state, int t, int layer, int head, int len, double similarity,
                       int *keep, int *n_keep);
    int (*layer_end)(void *state, int t, int layer, int head, int len, int *keep, int *n_keep,
                     int *cache);
    int (*layer_stored)(void *state, int t, int layer, int head, int len, const float *mass,
                        int *keep, int *n_keep);
    /* With KV_STATS_WINDOW_LOGITS: kv_policy_window_queries. */
    int (*window_queries)(const void *state, int t, int layer, int head, int len, int *rows);
    /* Whether it is layered on geometry g; NULL: whenever it has layer_end. */
    int (*layered_on)(const kv_geometry_t *g);
    /* What its budget comes to on this geometry, in words (kv_policy_describe). */
    void (*describe)(const void *state, const kv_policy_params_t *p, char *buf, size_t cap);
} kv_policy_ops_t;

#define KV_POLICY_OPS_DECL_(kind, name) extern const kv_policy_ops_t kv_policy_##name;
KV_POLICIES(KV_POLICY_OPS_DECL_)

/* The table, indexed by kind (engine/policy/kv_policy_table.c, its own object so
 * that a test can link a table of its own). */
extern const kv_policy_ops_t *const kv_policy_table[KV_POLICY_COUNT];

/* ---- shared by the policy files ---- */

/* floor(budget * n): budgets are fractions, and the epsilon keeps 1/6 of 24
 * lines at 4 lines, not 3. */
int kv_budget_share(double budget, long long n);

/* With one token per step and every segment the same length (a raster
 * grid's lines), sets *w (tokens per line) and *h (lines) and returns 1;
 * else 0, and err (may be NULL) says that `policy` needs lines. */
int kv_geometry_lines(const kv_geometry_t *g, const char *policy, int *w, int *h, ar_error_t *err);

/* Appends first .. first + n - 1 to keep[*k ..]. */
void kv_keep_range(int *keep, int *k, int first, int n);

/* Writes to out[0..n_keep) the n_keep cache indices of [first, first + n)
 * with the highest key mass, ascending; the n - n_keep lowest are evicted
 * (BottomK, LineAR eq. 10); ties evict the older token, NaN scores lowest,
 * mass NULL scores every token 0. out has room for n entries. */
void kv_keep_top(int *out, int first, int n, int n_keep, const float *mass);

/* A scale geometry's cache of one head as a set of whole segments (bit i:
 * segment i is cached), the prefix first: writes the keep list that goes
 * from `have` to `want` (a subset) into keep and returns its length, or -1
 * when len is not what `have` holds. */
int kv_keep_segments(const kv_geometry_t *g, unsigned have, unsigned want, int len, int *keep);

#endif
