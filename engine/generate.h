/* One image generation as a sequence of steps, so a caller (the CLI, later
 * the scheduler) can advance many requests in one forward pass. A request
 * owns its CFG pair of sequences (conditional, unconditional); step 0 feeds
 * both prompt rows (prefill), every later step feeds the last sampled image
 * token to both rows, and each step samples one image token. The pair's KV
 * lives in a pool shared by every request; a KV policy (engine/kv_policy.h)
 * may compact it after each step. */
#ifndef ARSERVE_GENERATE_H
#define ARSERVE_GENERATE_H

#include <stdint.h>

#include "kv_policy.h"
#include "kv_pool.h"
#include "model.h"
#include "sampler.h"

typedef struct gen_request {
    model_t *model;
    sampler_params_t params;
    uint64_t seed, stream; /* the RNG draws (seed, stream, step) */
    int n_prompt;
    int *cond_ids, *uncond_ids;
    raster_seq_t seq[2]; /* conditional, unconditional */
    int step, n_steps;
    int *tokens;       /* n_steps image tokens in raster order */
    const int *forced; /* optional: take these tokens instead of sampling */
    float *logits;     /* host: the last step's logits, cond then uncond (2 x K) */
    sampler_t sampler;
    /* KV: blocks come from pool; with a policy other than full, each
     * sequence runs it on its own cache with its own state (as LineAR and
     * HeadKV do: the unconditional row's attention is not the conditional
     * row's). Without one (the fast path) nothing below is allocated. */
    kv_pool_t *pool;
    kv_policy_params_t policy;
    kv_policy_state_t *policy_state[2];
    uint8_t *mass_live[2]; /* per (layer, head): mass collected since its last reset */
    float *mass_host;      /* host: one sequence's mass arrays, as raster_seq_t lays them out */
    float *zeros;          /* host: capacity zeros, to clear mass */
    int *keep;             /* host: capacity entries, the policy's keep list */
    /* The most pool blocks the pair has held at once: counted after each
     * step's appends, before its compaction (the planner's convention), so
     * times the block bytes it is the image's measured KV peak. */
    int kv_peak_blocks;
} gen_request_t;

/* Prepares a request from prompt rows made by model_prompt_from_*. Its KV
 * blocks come from pool (whose head_dim is the model's) as it runs; policy
 * NULL or of kind KV_POLICY_FULL keeps every token and costs nothing;
 * another policy is validated against the request's geometry here. */
int gen_request_init(gen_request_t *r, model_t *m, kv_pool_t *pool,
                     const kv_policy_params_t *policy, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err);
/* Returns the request's blocks to the pool. A double free found there is
 * counted in pool->bad_frees (a bug: the pool reports it, nothing crashes). */
void gen_request_free(gen_request_t *r);

static inline int gen_request_done(const gen_request_t *r) { return r->step >= r->n_steps; }

/* Advances every unfinished request in reqs by one step, in one forward
 * pass over all their sequences (which share one pool), then lets each
 * request's policy compact its caches. */
int gen_step(gen_request_t *const *reqs, int n, ar_error_t *err);

/* Decodes a finished request's tokens into rgb (image_height x image_width x 3). */
int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err);

#endif
