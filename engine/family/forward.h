/* One forward pass's KV side, the same in every model family (raster.c,
 * var.c): the batch's rows, the blocks reserved before the pass, each
 * layer's views of every sequence's heads (what attention reads, where the
 * new K and V go), a layered KV policy's hook around the attention
 * (engine/policy/kv_policy_layer.h) and the lengths advanced at the end.
 * A family's forward pass is its own layers between these calls:
 *
 *   forward_begin, forward_add for each sequence, the family's workspace,
 *   forward_reserve; for each layer forward_layer, the layer's Q, K and V,
 *   forward_prune, attention over f.batch, forward_store (forward_store
 *   before the attention when the family attends to the new tokens in the
 *   cache: attend_new); then forward_advance; and forward_end, always,
 *   once forward_begin has run. */
#ifndef ARSERVE_FORWARD_H
#define ARSERVE_FORWARD_H

#include "base/arena.h"
#include "engine/backend/backend.h"
#include "engine/kv/kv_seq.h"
#include "engine/policy/kv_policy_layer.h"

/* What one sequence feeds in one pass, as the KV side sees it. */
typedef struct forward_seq {
    kv_seq_t *seq;
    int rows;         /* its query rows: the batch's next rows */
    int n_new;        /* tokens every head caches, its newest rows (reserved up front) */
    int n_fed;        /* added to seq->n_fed at the end */
    int collect_mass; /* accumulate key mass into seq->mass (which must exist) */
    /* The sequence's KV policy, or NULL. A layered one (kv_policy_layered)
     * prunes and caches layer by layer instead of n_new, at step `step`,
     * caching the step's tokens only when `cache`; its blocks are reserved
     * then, layer by layer. */
    kv_policy_state_t *policy;
    int step, cache;
    /* When not NULL: the most blocks the sequences sharing this pointer (a
     * request's CFG pair) have held together after any layer. */
    int *peak_blocks;
} forward_seq_t;

typedef struct forward forward_t;

/* The current layer's key similarity (AMS-KV eq. 3, as
 * kv_policy_layer_similarity defines it) for sequence s, whose keys are
 * its rows of k: the family measures it, knowing how its maps resize. */
typedef double (*forward_similarity_fn)(void *family, const forward_t *f, int s, const float *k);

struct forward {
    /* Set by the family before forward_begin. */
    backend_t *be;
    arena_t *arena; /* the pass's host arrays (arena_begin at forward_begin) */
    int n_heads;    /* heads of every cache */
    int attend_new; /* attention reads the new tokens from the cache, appended before it
                       (backend attention): then every sequence caches all its rows */
    forward_similarity_fn similarity; /* NULL: a layered policy that asks gets NaN */
    void *family;                     /* similarity's first argument */
    int head_dim;                     /* of every cache (window scores' scratch) */

    /* Set by the family at each layer when any_window (below), before
     * forward_store: the layer's query projections before normalisation
     * (backend, rows as the keys'), and the bias they include (host,
     * n_heads * head_dim); kv_policy_layer.h's q_proj and q_bias. */
    const float *q_proj, *q_bias;

    /* Filled by forward_begin, forward_add and forward_reserve. */
    int n_seq;
    forward_seq_t *in; /* n_seq */
    int *q_start;      /* n_seq + 1: sequence s's rows are [q_start[s], q_start[s + 1]) */
    kv_pool_t *pool;   /* the sequences' pool (they share one) */
    /* At the current layer (forward_layer), n_seq * n_heads each: */
    kv_view_t *views;   /* what attention reads: the caches, with the new tokens when attend_new */
    kv_view_t *grown;   /* where forward_store appends (views itself when attend_new) */
    float **mass;       /* each head's key mass (backend), NULL where not collected */
    attn_batch_t batch; /* attention's batch: q_start, views, and mass when any is collected */

    int any_window; /* some sequence's policy scores keys by its queries' logits */

    /* Private. */
    int any_mass, any_layered;
    float *keys;            /* window scores' backend scratch (forward_reserve) */
    kv_layer_seq_t scratch; /* a layered policy's host scratch */
};

/* Starts a pass of n_seq sequences: arena_begin, then its arrays. */
int forward_begin(forward_t *f, int n_seq, ar_error_t *err);
/* Sequence s, in order from 0. Fails when it asks for key mass its
 * sequence has no arrays for. */
int forward_add(forward_t *f, int s, const forward_seq_t *in, ar_error_t *err);
/* Once every sequence is added and the family's workspace is ready:
 * reserves the blocks of every sequence's n_new tokens, or fails with
 * nothing changed (a sequence would pass its capacity, or the pool has too
 * few free blocks). Nothing else fails past it but a layered policy's
 * reserve. */
int forward_reserve(forward_t *f, ar_error_t *err);

/* Layer `layer`'s views and mass pointers. */
void forward_layer(forward_t *f, int layer);
/* Once the layer's keys k are computed, before it attends: each layered
 * policy's KV_LAYER_KEYS (its views follow). */
int forward_prune(forward_t *f, int layer, const float *k, ar_error_t *err);
/* With any_window, before the layer normalises its queries q (rows x
 * n_heads * head_dim, backend): copies them to dst (as many floats, free
 * until forward_store returns) and points q_proj at it, q_bias at bias
 * (host). */
void forward_queries(forward_t *f, float *dst, const float *q, const float *bias, int rows);
/* The layer's new K and V rows into the caches: each layered policy's
 * KV_LAYER_ATTENDED (it appends what it keeps), the other sequences' n_new
 * newest rows in one append, the peaks, then each layered policy's
 * KV_LAYER_STORED. AR_ERR only from a layered policy (kv_policy_on_layer). */
int forward_store(forward_t *f, int layer, const float *k, const float *v, ar_error_t *err);

/* After the last layer: every head's length and each sequence's n_fed
 * count the pass's tokens. */
void forward_advance(forward_t *f);
/* Frees the pass's host arrays (arena_end). */
void forward_end(forward_t *f);

#endif
