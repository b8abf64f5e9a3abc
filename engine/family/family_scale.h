/* What the scale family (engine/family/family_scale.c) offers besides its table
 * entry: the latent map its decoder draws, for tests and tools. A request
 * run with forced tokens (teacher forcing) keeps, in r->logits, every row
 * of its last step's logits: the scale's conditional rows, then its
 * unconditional rows (codebook_size floats each). */
#ifndef ARSERVE_FAMILY_SCALE_H
#define ARSERVE_FAMILY_SCALE_H

#include "engine/model.h"

/* f_hat after the first n_scales scales of tokens (the whole pyramid's
 * token array), as embed_dim x G x G host floats (G the last scale). */
int scale_latent(model_t *m, const int *tokens, int n_scales, float *fhat_host, ar_error_t *err);

/* The shared Phi scale si of n_scales uses, of phi_count (VAR's nearest
 * tick rule, ties as numpy breaks them). */
int scale_phi_index(int phi_count, int n_scales, int si);

#endif
