/* The language model of the raster family (engine/family/family_raster.c), a
 * Llama-style transformer in one of two architectures:
 *   janus:    text prompt; image path gen_embed -> gen_aligner -> LM ->
 *             gen_head (Linear, GELU, Linear); 1D RoPE.
 *   llamagen: one class token (LlamaGen c2i, cls_token_num = 1); image path
 *             gen_embed -> LM -> gen_head (one Linear); 2D RoPE over the
 *             grid, the class token's q and k zeroed (backend rope_2d).
 * One forward pass advances a ragged batch of sequences, each feeding either
 * its condition prefix (prefill) or image tokens (decode), over
 * per-(layer, head) caches in the paged KV pool (engine/kv/kv_seq.h) that KV
 * policies may compact between steps. */
#ifndef ARSERVE_RASTER_H
#define ARSERVE_RASTER_H

#include "base/arena.h"
#include "engine/backend/backend.h"
#include "engine/kv/kv_seq.h"
#include "engine/model_config.h"
#include "engine/weights.h"

#define RASTER_MAX_ALIGNER 16

typedef struct raster_layer {
    tensor_t attn_norm, qkv, o;       /* qkv: q, k and v stacked ([3, H * head_dim, hidden]) */
    tensor_t mlp_norm, gate_up, down; /* gate_up: gate and up stacked ([2, F, hidden]) */
} raster_layer_t;

typedef struct raster_model {
    const model_config_t *cfg;
    backend_t *be;
    tensor_t embed, norm;
    raster_layer_t *layers;
    tensor_t gen_embed;
    tensor_t aligner_w[RASTER_MAX_ALIGNER], aligner_b[RASTER_MAX_ALIGNER];
    tensor_t head_fc1_w, head_fc1_b, head_fc2_w, head_fc2_b; /* head_mlp */
    tensor_t head_w;                                         /* else: Linear, no bias */
    /* What the architecture switches, set at load (janus: aligner and
     * head_mlp; llamagen: rope_2d). */
    int image_aligner; /* image embeddings go through the aligner (else gen_embed is hidden wide) */
    int rope_2d;       /* RoPE over (grid row, column) pairs; else 1D over positions */
    int head_mlp;      /* head Linear, GELU, Linear; else one Linear (head_w) */
    /* Workspace, grown on demand (backend memory). */
    int ws_rows, ws_seqs;
    float *x, *xn, *att, *tmp, *last, *head, *logits;
    float *qkv, *gate_up; /* the stacked weights' outputs: q, k, v (gate, up) row blocks */
    int *pos;       /* host, 4 * ws_rows: positions, or (grid row, column) pairs (rope_2d), twice */
    arena_t *arena; /* the model's step arena (model_t.arena), for a pass's host arrays */
} raster_model_t;

/* What one sequence feeds in one forward pass: n tokens, either condition
 * ids (text through llm.embed; llamagen: a class through llm.class_embed)
 * or image ids (through gen.embed, and the aligner for janus). */
typedef struct raster_input {
    kv_seq_t *seq;
    int n;
    const int *ids; /* host */
    int is_image;
    int image_index;  /* is_image: raster index of ids[0] in the grid (rope_2d) */
    int collect_mass; /* accumulate key mass into seq->mass (which must exist) */
} raster_input_t;

int raster_load(raster_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
                ar_error_t *err);
void raster_free(raster_model_t *m);

/* Bytes of the weights one image-token step reads whole, as stored: every
 * layer, the final norm, the aligner and the head (the embedding tables
 * are read a row per token and not counted). A step over any number of
 * rows reads at least this much: the decode step's memory roofline. */
size_t raster_step_weight_bytes(const raster_model_t *m);
/* The same weights' elements: each is a multiply-add per row of a step,
 * the step's compute roofline. */
size_t raster_step_weight_elems(const raster_model_t *m);

/* Runs one forward pass over n_in inputs (whose sequences share one pool)
 * and writes, for each input, the image-codebook logits after its last
 * token to logits_host[i * K]. Reserves the new rows' blocks first; fails,
 * with nothing changed, when a sequence would pass its capacity or the pool
 * has too few free blocks. */
int raster_forward(raster_model_t *m, const raster_input_t *in, int n_in, float *logits_host,
                   ar_error_t *err);

#endif
