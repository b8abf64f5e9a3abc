/* The KV planner: every request's KV trajectory (bytes held during each of
 * its steps) is known before it runs, so admission can check that the pool
 * holds the running requests plus a new one at every future iteration. A
 * trajectory comes from the request's policy (kv_policy_trajectory: tokens
 * per head per step, on the geometry the model's family gives) counted in
 * whole pool blocks, so it is exact: the pool's blocks in use never pass
 * the sum of the running trajectories. */
#ifndef ARSERVE_PLANNER_H
#define ARSERVE_PLANNER_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"
#include "engine/model_config.h"
#include "engine/policy/kv_policy.h"

/* The element types a plan counts the cache's K and V in (f32, bf16, f16
 * or fp8 each). The engine's pool stores both in one type (kv_pool_t's
 * blocks.dtype: `serve --kv-dtype`, by default the weights' type); VAR's and
 * HeatKV's reference code keep K in fp32 and V in 16 bits under autocast,
 * Janus's and LlamaGen's both in bf16, which `arserve plan` can count. */
typedef struct planner_kv_dtype {
    dtype_t k, v;
} planner_kv_dtype_t;
/* Both in fp32: the golden tests' pool, and planner_plan's. */
extern const planner_kv_dtype_t planner_kv_f32;
/* Both in t. */
planner_kv_dtype_t planner_kv_same(dtype_t t);

/* "f32", "bf16", "f16" or "fp8" (how `arserve plan` and `serve` spell them). */
const char *planner_kv_dtype_name(dtype_t t);
/* "K,V" (e.g. "f32,bf16") or one type for both -> *out. AR_ERR naming the
 * part at fault and the types allowed. */
int planner_kv_dtype_parse(const char *s, planner_kv_dtype_t *out, ar_error_t *err);
/* The values a pool-type setting takes (NULL-terminated): "auto", then one
 * type for K and V as planner_kv_dtype_name spells them. */
extern const char *const planner_kv_dtype_settings[];
/* The pool's type from a setting: "auto" (weights: the model's weights'
 * type) or one type for K and V. AR_ERR naming the value otherwise. */
int planner_kv_dtype_choose(const char *name, dtype_t weights, dtype_t *out, ar_error_t *err);
/* 1 when a and b are the same types. */
int planner_kv_dtype_equal(planner_kv_dtype_t a, planner_kv_dtype_t b);

/* Bytes of one token's K and V in every (layer, head) of both CFG
 * sequences of one image, in dtype dt. */
size_t planner_token_image_bytes(const model_config_t *cfg, planner_kv_dtype_t dt);

/* Bytes of K and V one image (its CFG pair of sequences) holds at its
 * peak under the full cache with a prompt of n_prompt tokens, in fp32:
 * every token fed (the last scale of a next-scale
 * model is never cached), without the pool's block rounding. */
size_t planner_full_cache_bytes(const model_config_t *cfg, int n_prompt);
/* The same in dtype dt. */
size_t planner_full_cache_bytes_dtype(const model_config_t *cfg, int n_prompt,
                                      planner_kv_dtype_t dt);

/* The smallest KV budget the pool's block size is chosen for: 1/8, the
 * smallest budget the KV benchmark runs. */
#define PLANNER_MIN_BUDGET_INV 8

/* The pool block size for a model: kv_pool_choose_block_tokens for the
 * image tokens a head holds at budget 1/PLANNER_MIN_BUDGET_INV, so a head's
 * last partial block costs under 5% of its compressed cache. */
int planner_block_tokens(const model_config_t *cfg);

/* A request's KV plan under its policy, in a pool of block_tokens-token
 * blocks: for each step t < steps the most tokens one head holds (after the
 * step's append, before its compaction) and the most bytes one image (its
 * CFG pair) holds at any moment of the step: kv_policy_trajectory_blocks's
 * blocks of one sequence x block bytes x 2 sequences (for a policy that
 * compacts after steps, ceil(tokens / block_tokens) blocks per (layer,
 * head) after the append). */
typedef struct planner_plan {
    int steps;
    int *tokens;
    size_t *bytes;
    /* 1 at a step during which the policy collects key mass from the step's
     * queries (LineAR's guide queue, HeadKV's buffer): its attention does
     * more work a key (engine/cost_model.h's kv_scored). */
    unsigned char *scored;
    size_t peak_bytes; /* the most bytes of any step */
    int peak_step;     /* the first step holding the most tokens */
} planner_plan_t;

/* Plans a request of n_prompt prefix tokens under policy p, K and V in
 * fp32: the policy is checked once, here (AR_ERR naming the setting in
 * *field, which may be NULL, as kv_policy_check does). */
int planner_plan(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                 int n_prompt, int block_tokens, const char **field, ar_error_t *err);
/* The same with K and V counted in dtype dt (a block of block_tokens
 * tokens of one head: block_tokens x head_dim x (K bytes + V bytes)). */
int planner_plan_dtype(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                       int n_prompt, int block_tokens, planner_kv_dtype_t dt, const char **field,
                       ar_error_t *err);
/* The same for a request of image size `size` (an index into
 * image.sizes; planner_plan_dtype plans size 0, the default). */
int planner_plan_sized(planner_plan_t *pl, const model_config_t *cfg, const kv_policy_params_t *p,
                       int n_prompt, int size, int block_tokens, planner_kv_dtype_t dt,
                       const char **field, ar_error_t *err);
void planner_plan_free(planner_plan_t *pl);

/* ---- elastic budgets ---- */

/* The most levels a budget range is planned at (a range finer than this is
 * sampled evenly, its ends kept). */
#define PLANNER_MAX_LEVELS 32

/* A request's plans over a budget range [lo, hi]: the budgets its policy
 * can tell apart, the largest first. Candidates are hi, every k / (image
 * tokens) strictly inside, and lo; of candidates whose plans are the same
 * bytes at every step only the largest budget stays (same memory, more
 * cache kept), so every level needs less KV somewhere than the one above
 * it. The last level (the floor) has lo's plan, at the largest budget
 * that has it. */
typedef struct planner_levels {
    int n;
    double budgets[PLANNER_MAX_LEVELS];
    planner_plan_t plans[PLANNER_MAX_LEVELS];
} planner_levels_t;

/* Plans p at the levels of [lo, hi] (0 < lo <= hi <= 1; p's own budget is
 * ignored), as planner_plan_dtype. AR_ERR when the floor's plan fails (the
 * check's message; *field as planner_plan's) or memory runs out. A
 * candidate between the ends that fails its check is left out. */
int planner_plan_levels(planner_levels_t *lv, const model_config_t *cfg,
                        const kv_policy_params_t *p, double lo, double hi, int n_prompt, int size,
                        int block_tokens, planner_kv_dtype_t dt, const char **field,
                        ar_error_t *err);
void planner_levels_free(planner_levels_t *lv);

/* ---- admission ---- */

typedef struct planner_entry {
    uint64_t id;
    int steps_left; /* iterations until it releases everything */
    size_t *bytes;  /* bytes held at each remaining iteration (steps_left entries) */
} planner_entry_t;

typedef struct planner {
    size_t pool_bytes;
    int n, cap;
    planner_entry_t *entries;
} planner_t;

void planner_init(planner_t *p, size_t pool_bytes);
void planner_free(planner_t *p);

/* Would a request holding bytes[i] at its i-th iteration from now (n_steps
 * entries) fit beside everything admitted, at every future iteration? */
int planner_fits(const planner_t *p, const size_t *bytes, int n_steps);
/* The same for a request that starts `delay` iterations from now (planner_tick
 * calls away) and holds nothing before. */
int planner_fits_after(const planner_t *p, const size_t *bytes, int n_steps, int delay);

/* Records an admitted request (copies bytes). AR_ERR on out of memory. */
int planner_add(planner_t *p, uint64_t id, const size_t *bytes, int n_steps);
/* The same for a request that starts `delay` iterations from now: its
 * entry reserves nothing until then, then bytes[0] at its first iteration. */
int planner_add_after(planner_t *p, uint64_t id, const size_t *bytes, int n_steps, int delay);

/* Advances every entry by one iteration (drops entries that are done). */
void planner_tick(planner_t *p);

/* A tighter plan for a running request: bytes[i] (n_steps entries) for its
 * i-th iteration from now. Each entry only ever goes down (the smaller of
 * the two), so what was admitted against the old plan still fits; what it
 * frees is free for the next admission at once. Returns how much its
 * peak over the iterations left went down. */
size_t planner_tighten(planner_t *p, uint64_t id, const size_t *bytes, int n_steps);

/* Removes a request (finished early, cancelled). */
void planner_remove(planner_t *p, uint64_t id);

/* Bytes reserved now: the sum over entries of what they hold this iteration. */
size_t planner_reserved_now(const planner_t *p);

#endif
