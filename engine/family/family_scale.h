/* What the scale family (engine/family/family_scale.c) offers besides its table
 * entry: its networks and the latent map its decoder draws, for tests and
 * tools. A request
 * run with forced tokens (teacher forcing) keeps, in r->logits, every row
 * of its last step's logits: the scale's conditional rows, then its
 * unconditional rows (codebook_size floats each). */
#ifndef ARSERVE_FAMILY_SCALE_H
#define ARSERVE_FAMILY_SCALE_H

#include "engine/family/var.h"
#include "engine/family/vq_decoder.h"
#include "engine/model.h"

/* What the family's load puts in model_t.net. */
typedef struct scale_net {
    var_model_t var;  /* the transformer */
    vq_decoder_t dec; /* the VQVAE decoder and its codebook */
    tensor_t phi_w[MODEL_MAX_SCALES], phi_b[MODEL_MAX_SCALES]; /* image.phi_count of them */
    struct scale_ws *ws; /* the step's backend buffers, kept between steps */
} scale_net_t;

/* m's networks; m must be a loaded scale-family model. */
static inline scale_net_t *scale_net_of(const model_t *m) { return m->net; }

/* f_hat after the first n_scales scales of tokens (the whole pyramid's
 * token array), as embed_dim x G x G host floats (G the last scale). */
int scale_latent(model_t *m, const int *tokens, int n_scales, float *fhat_host, ar_error_t *err);

/* The shared Phi scale si of n_scales uses, of phi_count (VAR's nearest
 * tick rule, ties as numpy breaks them). */
int scale_phi_index(int phi_count, int n_scales, int si);

#endif
