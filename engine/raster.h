/* The raster (next-token) family, Janus-Pro architecture: a Llama-style
 * language model whose image path is gen_embed -> gen_aligner -> LM ->
 * gen_head -> logits over the image codebook. One forward pass advances a
 * ragged batch of sequences, each feeding either prompt text (prefill) or
 * image tokens (decode), over a full per-head KV cache. */
#ifndef ARSERVE_RASTER_H
#define ARSERVE_RASTER_H

#include "backend.h"
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

/* One sequence's KV cache: for layer l and head h, k[l*H + h] holds len rows
 * of head_dim floats (capacity rows allocated). */
typedef struct raster_seq {
    int len, capacity;
    int n_layers, n_heads;
    float **k, **v; /* host arrays of backend pointers */
    void *block;    /* the single backend allocation behind them */
} raster_seq_t;

/* What one sequence feeds in one forward pass: n tokens, either text ids
 * (through llm.embed) or image ids (through gen.embed and the aligner). */
typedef struct raster_input {
    raster_seq_t *seq;
    int n;
    const int *ids; /* host */
    int is_image;
} raster_input_t;

int raster_load(raster_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                ar_error_t *err);
void raster_free(raster_model_t *m);

int raster_seq_init(raster_seq_t *s, const raster_model_t *m, int capacity, ar_error_t *err);
void raster_seq_free(raster_seq_t *s, const raster_model_t *m);

/* Runs one forward pass over n_in inputs and writes, for each input, the
 * image-codebook logits after its last token to logits_host[i * K]. Fails
 * (with nothing changed) when a sequence would pass its capacity. */
int raster_forward(raster_model_t *m, const raster_input_t *in, int n_in, float *logits_host,
                   ar_error_t *err);

#endif
