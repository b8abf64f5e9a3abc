/* The host sampler: turns one row's conditional (and optional unconditional)
 * logits into the next token with CFG, temperature, top-k and top-p, drawing
 * its single uniform from rng_uniform so that a seed reproduces a token. */
#ifndef ARSERVE_SAMPLER_H
#define ARSERVE_SAMPLER_H

#include "base/status.h"

#include <stdint.h>

typedef struct sampler_params {
    float cfg;         /* guidance weight; used only when uncond logits are given */
    float temperature; /* > 0 samples; 0 (or anything not a positive finite number) is greedy */
    int top_k;         /* keep the k highest logits; 0 or >= vocab = off, 1 = greedy */
    float top_p;       /* nucleus mass in (0, 1); >= 1 or NaN = off, <= 0 keeps one token */
} sampler_params_t;

/* Per-thread scratch sized for one vocabulary; not shared between threads. */
typedef struct sampler {
    int vocab;
    float *logits; /* combined, sanitised logits, by token id */
    float *probs;  /* unnormalised probabilities, by token id (valid for candidates) */
    int *order;    /* candidate token ids: the top-k selection, then two heaps */
    int *ranked;   /* candidates popped so far, in rank order */
} sampler_t;

/* Allocates scratch for vocab tokens (vocab >= 1). AR_OK, or AR_ERR with a
 * message on a bad size or out of memory (s is then left freeable). */
int sampler_init(sampler_t *s, int vocab, ar_error_t *err);

/* Frees the scratch; safe on a zeroed or already-freed sampler. */
void sampler_free(sampler_t *s);

/* CFG combine: out = uncond + cfg * (cond - uncond), element by element, in
 * float; out = cond when uncond is NULL. out may alias cond or uncond. */
void sampler_cfg_combine(float *out, const float *cond, const float *uncond, int n, float cfg);

/* Picks the next token from s->vocab logits.
 *  1. CFG combine (above). NaN becomes -inf; +inf becomes FLT_MAX so that
 *     several +inf tokens share the mass instead of producing NaN.
 *  2. Greedy when top_k == 1 or the temperature is not positive: the highest
 *     logit, lowest token id on ties.
 *  3. Otherwise candidates are the top_k highest logits (all when top_k is
 *     off), ranked by descending logit then ascending id: this is descending
 *     probability with ties broken by the lower id. Probabilities are
 *     softmax(logit / temperature) over the candidates.
 *  4. top-p keeps the shortest prefix of that ranking whose mass reaches
 *     top_p of the candidates' mass (at least one token).
 *  5. u = rng_uniform(seed, stream, step); the token is the first in the
 *     ranking whose cumulative mass exceeds u times the kept mass.
 * Returns token 0 when every logit is -inf or NaN. Cost: O(vocab) for the
 * combine, top-k selection and softmax, plus O(h + r log h) to rank the r
 * tokens a draw visits out of the h that carry all but 1/1024 of the mass;
 * only a flat distribution approaches a full sort. */
int sampler_next(sampler_t *s, const float *cond, const float *uncond, const sampler_params_t *p,
                 uint64_t seed, uint64_t stream, uint64_t step);

#endif
