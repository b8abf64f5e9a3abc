/* One image generation as a sequence of steps, so a caller (the command
 * line, the batcher) can advance many requests in one forward pass. A
 * request owns its CFG pair of sequences (conditional, unconditional); its
 * model's family decides what each step feeds and how many steps there are
 * (engine/model_family.h), and samples the step's tokens. The pair's KV lives in
 * a pool shared by every request; a KV policy (engine/policy/kv_policy.h) may
 * compact it after each step. */
#ifndef ARSERVE_GENERATE_H
#define ARSERVE_GENERATE_H

#include <stdint.h>

#include "engine/kv/kv_pool.h"
#include "engine/kv/kv_seq.h"
#include "engine/model.h"
#include "engine/policy/kv_policy.h"
#include "engine/sampler.h"

/* What a request may ask beyond its prompt rows: its image size, and
 * (Infinity) a negative prompt's token ids, which replace the learned
 * unconditional rows of its unconditional sequence. Zeroed: the default. */
typedef struct gen_image_opts {
    int size;            /* an index into image.sizes (0: the default) */
    const int *negative; /* n_negative text ids with </s>, or NULL */
    int n_negative;
} gen_image_opts_t;

typedef struct gen_request {
    model_t *model;
    sampler_params_t params;
    uint64_t seed, stream; /* the RNG draws (seed, stream, step) */
    int n_prompt;
    int size; /* image size: an index into image.sizes (0: the default) */
    int *cond_ids, *uncond_ids;
    int *neg_ids, n_neg; /* a negative prompt (NULL, 0 without) */
    kv_seq_t seq[2];     /* conditional, unconditional */
    int step, n_steps;
    int n_tokens;      /* image tokens of the whole request */
    int *tokens;       /* n_tokens image tokens, in the family's order */
    const int *forced; /* optional: take these tokens instead of sampling */
    float *logits;     /* host: the last step's logits, cond then uncond */
    size_t n_logits;   /* how many logits holds for the last step (0: none kept) */
    /* Backend memory the family keeps per sequence for the whole request
     * (the scale family: the AdaLN tables of its class), NULL until it
     * makes it; freed with the request. */
    float *cond_table[2];
    sampler_t sampler;
    /* KV: blocks come from pool; with a policy other than full, each
     * sequence runs it on its own cache with its own state (as LineAR and
     * HeadKV do: the unconditional row's attention is not the conditional
     * row's). Without one (the fast path) nothing below is allocated. */
    kv_pool_t *pool;
    kv_policy_params_t policy;
    kv_policy_state_t *policy_state[2];
    int collect[2];        /* this step: sequence j accumulates key mass */
    uint8_t *mass_live[2]; /* per (layer, head): mass collected since its last reset */
    float *mass_host;      /* host: one sequence's mass arrays, as kv_seq_t lays them out */
    float *zeros;          /* host: capacity zeros, to clear mass */
    int *keep;             /* host: capacity entries, the policy's keep list */
    /* The most pool blocks the pair has held at once: counted after each
     * step's appends, before its compaction (the planner's convention), so
     * times the block bytes it is the image's measured KV peak. */
    int kv_peak_blocks;
    /* gen_request_collect_mass: the conditional sequence accumulates key
     * mass at every step, for the caller to read and clear. */
    int collect_all;
} gen_request_t;

/* Prepares a request from prompt rows made by model_prompt_from_*. Its KV
 * blocks come from pool (whose head_dim is the model's) as it runs; policy
 * NULL or of kind KV_POLICY_FULL keeps every token and costs nothing;
 * another policy is checked against the request's geometry here. */
int gen_request_init(gen_request_t *r, model_t *m, kv_pool_t *pool,
                     const kv_policy_params_t *policy, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err);
/* The same with opts (NULL: the defaults); a size out of range, or a
 * negative prompt for a model that takes none, is an error. */
int gen_request_init_opts(gen_request_t *r, model_t *m, kv_pool_t *pool,
                          const kv_policy_params_t *policy, const int *cond, const int *uncond,
                          int n_prompt, const gen_image_opts_t *opts,
                          const sampler_params_t *params, uint64_t seed, uint64_t stream,
                          ar_error_t *err);
/* Before the first step of a request under the full cache: its
 * conditional sequence accumulates, at every step, the softmax mass each
 * key receives from the step's queries into r->seq[0].mass (for head i at
 * i * capacity; on a next-scale model the step's own keys follow the
 * cache's). Nothing clears it: the caller reads and zeroes it (calibration,
 * engine/calibration_run.h). */
int gen_request_collect_mass(gen_request_t *r, ar_error_t *err);

/* A KV pool that holds exactly one full-cache image of n_prompt prefix
 * tokens, K and V stored as kv_dtype: the peak of its planned trajectory
 * (at the model's largest-caching image size), in blocks of the size the
 * daemon would choose. */
int gen_pool_for_one_image(kv_pool_t *pool, model_t *m, int n_prompt, dtype_t kv_dtype,
                           ar_error_t *err);

/* The request's KV (both CFG sequences) at each of its next n steps,
 * from its policies' states now (kv_policy_remaining_blocks): 1 and
 * bytes[0..n) when its policy can tell better than the plan, 0 when not,
 * -1 out of memory. n is the steps it has left. */
int gen_request_remaining_bytes(const gen_request_t *r, size_t *bytes, int n, ar_error_t *err);

/* The values in r->tokens: its image tokens (at its size) times the
 * family's token width. */
size_t gen_request_token_values(const gen_request_t *r);

/* Teacher forcing (tests, calibration): a copy of the step's n logits
 * (every row of both sequences) into r->logits, grown as needed. */
int gen_request_keep_logits(gen_request_t *r, const float *logits, size_t n, ar_error_t *err);

/* Returns the request's blocks to the pool. A double free found there is
 * counted in pool->bad_frees (a bug: the pool reports it, nothing crashes). */
void gen_request_free(gen_request_t *r);

static inline int gen_request_done(const gen_request_t *r) { return r->step >= r->n_steps; }

/* Advances every unfinished request in reqs by one step, in one forward
 * pass over all their sequences (which share one model and one pool), then
 * lets each request's policy compact its caches. */
int gen_step(gen_request_t *const *reqs, int n, ar_error_t *err);

/* Decodes a finished request's tokens into rgb (image_height x image_width
 * x 3) on the model's backend, with the model's decoder buffers (made at
 * the first call): for a caller that steps and draws on one thread. */
int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err);

/* Decodes an unfinished request's tokens so far into rgb (a preview), the
 * same way. */
int gen_preview(gen_request_t *r, uint8_t *rgb, ar_error_t *err);

/* The image from tokens (a copy of a request's, model_image_tokens long)
 * after n_done of its steps, on w's backend. */
int gen_draw(const model_t *m, struct vq_work *w, const int *tokens, int size, int n_done,
             uint8_t *rgb, ar_error_t *err);

/* What a thread needs to draw images while another steps the model: a
 * fork of the model's backend (its own scratch and threads, the same
 * weights) holding the decoder's buffers, made once and reused. */
typedef struct gen_drawer {
    const model_t *model;
    backend_t *be;
    struct vq_work *work;
} gen_drawer_t;

/* Forks m->be with n_threads threads (0: as many as m->be) while no other
 * thread uses it. The message names the backend and the memory asked. */
int gen_drawer_open(gen_drawer_t *d, const model_t *m, int n_threads, ar_error_t *err);
void gen_drawer_close(gen_drawer_t *d); /* accepts a zeroed one */
static inline int gen_drawer_draw(gen_drawer_t *d, const int *tokens, int size, int n_done,
                                  uint8_t *rgb, ar_error_t *err) {
    return gen_draw(d->model, d->work, tokens, size, n_done, rgb, err);
}

/* ---- jobs: what the batcher runs ---- */

/* n_images images of one prompt under one policy: image i draws from
 * (seed, stream i). The driver fills the fields above `images`; the
 * prompt rows are read while the job starts and are the driver's. */
typedef struct gen_job {
    model_t *model;
    const int *cond, *uncond;
    int n_prompt;
    gen_image_opts_t opts; /* size and negative prompt (the driver's rows) */
    int n_images;
    sampler_params_t params;
    uint64_t seed;
    kv_policy_params_t policy;
    /* Elastic budgets: the budget of each of the batcher job's levels
     * (batcher_job_t.n_levels entries), the driver's; set_level copies the
     * admitted one into policy.budget. NULL without levels. */
    const double *level_budgets;
    gen_request_t *images; /* n_images, while it runs and after it finished */
} gen_job_t;

/* The engine's batcher ops (engine/batcher.h) over gen_job_t works; ctx is
 * the kv_pool_t every job takes its KV from. start makes the job's
 * requests, step advances every image of the batch in one gen_step and
 * reports the pool's peak, stop gives back the KV but keeps the tokens, so
 * a finished job can still be decoded; gen_job_free frees the rest;
 * set_level runs the job at its admitted level's budget. */
extern const struct batcher_ops gen_batcher_ops;
void gen_job_free(gen_job_t *j);

#endif
