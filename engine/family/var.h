/* The VAR transformer of the scale family (engine/family/family_scale.c): a
 * class-conditional next-scale model. One forward pass advances a ragged
 * batch of sequences, each feeding the whole of one scale (its start token
 * at scale 0, else the word embedding of the latent map downsampled to that
 * scale), and returns the codebook logits of every row. Attention is
 * block-causal: a scale attends to the earlier scales in its cache and to
 * the whole of itself. */
#ifndef ARSERVE_VAR_H
#define ARSERVE_VAR_H

#include "base/arena.h"
#include "engine/backend/backend.h"
#include "engine/kv/kv_seq.h"
#include "engine/model_config.h"
#include "engine/policy/kv_policy.h"
#include "engine/weights.h"

typedef struct var_block {
    tensor_t adaln_w, adaln_b; /* [6 hidden, hidden], [6 hidden] without shared AdaLN */
    tensor_t adaln_gss;        /* [6, hidden] with shared AdaLN */
    tensor_t qkv, qkv_b; /* q, k, v stacked [3, hidden, hidden]; biases [3, hidden], k's zeros */
    tensor_t head_mul, proj, proj_b;
    tensor_t fc1, fc1_b, fc2, fc2_b;
    float *q_bias; /* host [hidden]: qkv_b's first row, for ScaleKV's raw queries */
} var_block_t;

typedef struct var_model {
    const model_config_t *cfg;
    backend_t *be;
    arena_t *arena; /* the model's step arena (model_t.arena), for a pass's host arrays */
    int n_tokens;   /* tokens of every scale */
    int scale_at[MODEL_MAX_SCALES + 1]; /* scale si's first token; scale_at[n_scales] = n_tokens */
    tensor_t class_embed, word_embed, word_embed_b;
    tensor_t shared_adaln_w, shared_adaln_b; /* with shared AdaLN */
    tensor_t head_adaln_w, head_adaln_b, head, head_b;
    float *level_pos; /* backend, n_tokens x hidden: level embedding + position, per token */
    float *start;     /* backend, scales[0]^2 x hidden: pos_start + level_pos of scale 0 */
    var_block_t *blocks;
    /* Workspace, grown on demand (backend memory). */
    int ws_rows, ws_seqs;
    float *x, *xn, *qkv, *att, *tmp, *ffn, *cond, *logits; /* qkv: q, k, v row blocks */
} var_model_t;

/* What one sequence feeds in one forward pass: scale si's n = scales[si]^2
 * rows. */
typedef struct var_input {
    kv_seq_t *seq;
    int scale; /* si */
    int label; /* class; num_classes is the unconditional one */
    /* si > 0: the latent map downsampled to this scale, as n rows of
     * embed_dim (backend memory); NULL at si = 0. */
    const float *latent;
    int cache; /* append the scale's K and V to the cache (not for the last) */
    /* The sequence's AdaLN tables (backend, var_adaln_floats): made from its
     * class when adaln_ready is 0, then reused at every later scale. */
    float *adaln;
    int adaln_ready;
    int collect_mass; /* accumulate key mass into seq->mass (which must exist) */
    /* A layered KV policy (kv_policy_layered) on this sequence, or NULL:
     * after each layer has attended, the policy compacts that layer's
     * heads and says which of them cache the scale (step `scale`); their
     * blocks are reserved then, layer by layer. */
    kv_policy_state_t *policy;
    /* When not NULL: the most blocks the sequences sharing this pointer
     * (a request's CFG pair) have held together after any layer. */
    int *peak_blocks;
} var_input_t;

/* Floats of one sequence's AdaLN tables: every block's six chunks, then the
 * head's scale and shift. */
size_t var_adaln_floats(const var_model_t *m);

int var_load(var_model_t *m, const model_config_t *cfg, weight_set_t *ws, backend_t *be,
             ar_error_t *err);
void var_free(var_model_t *m);

/* Runs one forward pass over n_in inputs (whose sequences share one pool)
 * and writes every row's codebook logits, input by input, to logits_host
 * (rows x codebook_size). Reserves the cached rows' blocks first; fails,
 * with nothing changed, when a sequence would pass its capacity or the pool
 * has too few free blocks. A sequence under a layered policy reserves
 * layer by layer instead: the pool running out there (a plan exceeded)
 * fails the step with the sequences half advanced, to be freed. */
int var_forward(var_model_t *m, const var_input_t *in, int n_in, float *logits_host,
                ar_error_t *err);

/* AMS-KV's inter-scale similarity (eq. 3) of one layer of one sequence:
 * minus the mean squared distance, over every head and channel, between
 * the current scale's keys k_cur (side_cur^2 rows of n_heads * head_dim,
 * backend) and the previous scale's, the newest side_prev^2 rows of each
 * head's cache heads[h], resized to side_cur x side_cur (bicubic, as VAR
 * resizes its maps). NaN when a head holds fewer rows. scratch: four
 * backend buffers of n_heads * head_dim * side_cur^2 floats. */
double var_key_similarity(backend_t *be, const kv_blocks_t *pool, const kv_view_t *heads,
                          int n_heads, int head_dim, const float *k_cur, int side_prev,
                          int side_cur, float *const scratch[4]);

#endif
