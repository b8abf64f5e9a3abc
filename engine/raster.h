/* The raster (next-token) family, Janus-Pro architecture: a Llama-style
 * language model whose image path is gen_embed -> gen_aligner -> LM ->
 * gen_head -> logits over the image codebook. One forward pass advances a
 * ragged batch of sequences, each feeding either prompt text (prefill) or
 * image tokens (decode), over per-(layer, head) caches in a paged KV pool
 * (engine/kv_pool.h) that KV policies may compact between steps. */
#ifndef ARSERVE_RASTER_H
#define ARSERVE_RASTER_H

#include "backend.h"
#include "kv_pool.h"
#include "model_config.h"
#include "weights.h"

#define RASTER_MAX_ALIGNER 16

typedef struct raster_layer {
    tensor_t attn_norm, q, k, v, o;
    tensor_t mlp_norm, gate, up, down;
} raster_layer_t;

typedef struct raster_model {
    const model_config_t *cfg;
    backend_t *be;
    tensor_t embed, norm;
    raster_layer_t *layers;
    tensor_t gen_embed;
    tensor_t aligner_w[RASTER_MAX_ALIGNER], aligner_b[RASTER_MAX_ALIGNER];
    tensor_t head_fc1_w, head_fc1_b, head_fc2_w, head_fc2_b;
    /* Workspace, grown on demand (backend memory). */
    int ws_rows, ws_seqs;
    float *x, *xn, *q, *k, *v, *att, *tmp, *gate, *up, *last, *head, *logits;
    int *pos; /* host, ws_rows */
} raster_model_t;

/* One sequence's KV cache: for layer l and head h, heads[l*n_heads + h]
 * holds that head's tokens in the shared pool. Heads may hold different
 * numbers of tokens once a policy compacts them; n_fed counts every token
 * fed (the next token's RoPE position), evicted or not. */
typedef struct raster_seq {
    kv_pool_t *pool;
    int n_layers, n_heads;
    int n_fed, capacity; /* tokens fed so far, at most capacity */
    kv_head_t *heads;    /* host, n_layers * n_heads */
    /* Key mass for policies (NULL without one): for head i, mass + i *
     * capacity holds heads[i].len floats of backend memory, zero past len. */
    float *mass;
} raster_seq_t;

/* What one sequence feeds in one forward pass: n tokens, either text ids
 * (through llm.embed) or image ids (through gen.embed and the aligner). */
typedef struct raster_input {
    raster_seq_t *seq;
    int n;
    const int *ids; /* host */
    int is_image;
    int collect_mass; /* accumulate key mass into seq->mass (which must exist) */
} raster_input_t;

int raster_load(raster_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                ar_error_t *err);
void raster_free(raster_model_t *m);

/* An empty sequence of at most capacity tokens whose KV lives in pool (the
 * pool's head_dim must be the model's). with_mass allocates its key-mass
 * arrays (backend memory, layers x heads x capacity floats). Blocks are
 * taken from the pool as tokens are fed. */
int raster_seq_init(raster_seq_t *s, const raster_model_t *m, kv_pool_t *pool, int capacity,
                    int with_mass, ar_error_t *err);
/* Returns every block to the pool. AR_ERR only if the pool reports a
 * double free (then the rest is released all the same). */
int raster_seq_free(raster_seq_t *s, const raster_model_t *m, ar_error_t *err);

/* Runs one forward pass over n_in inputs (whose sequences share one pool)
 * and writes, for each input, the image-codebook logits after its last
 * token to logits_host[i * K]. Reserves the new rows' blocks first; fails,
 * with nothing changed, when a sequence would pass its capacity or the pool
 * has too few free blocks. */
int raster_forward(raster_model_t *m, const raster_input_t *in, int n_in, float *logits_host,
                   ar_error_t *err);

#endif
