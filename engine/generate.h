/* One image generation as a sequence of steps, so a caller (the CLI, later
 * the scheduler) can advance many requests in one forward pass. A request
 * owns its CFG pair of sequences (conditional, unconditional); step 0 feeds
 * both prompt rows (prefill), every later step feeds the last sampled image
 * token to both rows, and each step samples one image token. */
#ifndef ARSERVE_GENERATE_H
#define ARSERVE_GENERATE_H

#include <stdint.h>

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
    int *tokens;         /* n_steps image tokens in raster order */
    const int *forced;   /* optional: take these tokens instead of sampling */
    float *logits;       /* host: the last step's logits, cond then uncond (2 x K) */
    sampler_t sampler;
} gen_request_t;

/* Prepares a request from prompt rows made by model_prompt_from_*. */
int gen_request_init(gen_request_t *r, model_t *m, const int *cond, const int *uncond,
                     int n_prompt, const sampler_params_t *params, uint64_t seed, uint64_t stream,
                     ar_error_t *err);
void gen_request_free(gen_request_t *r);

static inline int gen_request_done(const gen_request_t *r) { return r->step >= r->n_steps; }

/* Advances every unfinished request in reqs by one step, in one forward
 * pass over all their sequences. */
int gen_step(gen_request_t *const *reqs, int n, ar_error_t *err);

/* Decodes a finished request's tokens into rgb (image_height x image_width x 3). */
int gen_decode(gen_request_t *r, uint8_t *rgb, ar_error_t *err);

#endif
