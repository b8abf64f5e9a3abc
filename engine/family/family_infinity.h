/* What the infinity architecture (engine/family/family_infinity.c) offers
 * besides its table entry: its networks, and the host arithmetic between
 * its scales, for tests and tools. A request run with forced tokens
 * (teacher forcing) keeps, in r->logits, every row of its last step's
 * logits: the scale's conditional rows, then its unconditional rows
 * (2 x image.bits floats each). */
#ifndef ARSERVE_FAMILY_INFINITY_H
#define ARSERVE_FAMILY_INFINITY_H

#include "engine/family/infinity.h"
#include "engine/family/vq_decoder.h"
#include "engine/model.h"

/* What the family's load puts in model_t.net. */
typedef struct infinity_net {
    inf_model_t inf;  /* T5, conditioning, transformer */
    vq_decoder_t dec; /* the BSQ-VAE decoder */
    float *rows;      /* backend: the step's next-scale inputs */
    size_t rows_cap;  /* floats */
} infinity_net_t;

/* The VAE latent after the first n_scales scales of bits (a request's
 * token array: every token's image.bits values, scale after scale) of image
 * size `size`, as latent_channels x H x W host floats (the last scale's
 * map, twice each side when patchified). */
int infinity_latent(const model_config_t *cfg, int size, const int *bits, int n_scales, float *fhat,
                    ar_error_t *err);
/* Floats of the largest latent of the model's sizes. */
size_t infinity_latent_floats(const model_config_t *cfg);

/* The input of scale si > 0 from the latent: fhat resized down to the
 * scale, as h * w rows of image.bits (host). */
int infinity_next_input(const model_config_t *cfg, int size, const float *fhat, int si, float *rows,
                        ar_error_t *err);

/* One bit from its two conditional logits lc and unconditional lu (NULL:
 * no guidance): cfg * lc / tau + (1 - cfg) * lu / tau, then top-p over the
 * two values (top-k 1 or tau <= 0: the larger), then 0 when u < p(0),
 * else 1. */
int infinity_sample_bit(const float *lc, const float *lu, float cfg, float tau, int top_k,
                        float top_p, double u);

#endif
