/* A layered KV policy (kv_policy_layered: streaming on scales, HeatKV,
 * HeatKV-binary, AMS-KV, ScaleKV) prunes inside a forward pass, layer by
 * layer. kv_policy_on_layer is the one hook a family's forward pass calls
 * for it (through engine/family/forward.h), at three moments of each layer:
 * it asks the policy's layer questions (kv_policy.h) and applies the
 * answers to one sequence's caches in the paged pool (compaction, the
 * blocks and append of the step's new tokens, the key mass). Unlike
 * kv_policy.h, this acts on backend memory. */
#ifndef ARSERVE_KV_POLICY_LAYER_H
#define ARSERVE_KV_POLICY_LAYER_H

#include "engine/kv/kv_seq.h"
#include "engine/policy/kv_policy.h"

/* When in a layer the hook runs. */
typedef enum kv_layer_moment {
    /* The layer's keys for the step are computed and it has not attended:
     * kv_policy_layer_begin may evict from each head, and views[h] become
     * what the layer attends to. */
    KV_LAYER_KEYS,
    /* It has attended, the step's new K and V not cached yet:
     * kv_policy_layer_end compacts each head, then the heads it says cache
     * the step take their blocks (every compaction before any reserve) and
     * the newest rows it says of the step's K and V. */
    KV_LAYER_ATTENDED,
    /* Every sequence of the batch holds the layer's new tokens (so a CFG
     * pair peaks together, as planned): a head holding more than the policy
     * keeps is cut (kv_policy_layer_stored), by the key mass the step's
     * queries gave it when the sequence collects (then zeroed for the next
     * step), or by its window queries' logits when the policy asks for
     * them (kv_policy_window_queries). */
    KV_LAYER_STORED,
} kv_layer_moment_t;

/* One sequence under a layered policy during one forward pass. */
typedef struct kv_layer_seq {
    kv_policy_state_t *policy; /* layered (kv_policy_layered) */
    kv_seq_t *seq;
    int step;
    int cache;        /* the step's tokens may be cached (0 at a last step) */
    int collect_mass; /* seq->mass accumulates the step's key mass */
    /* The layer's new K and V (backend, n_heads * head_dim per row), rows
     * [row0, row1) this sequence's. */
    const float *k, *v;
    int row0, row1;
    /* Host scratch, shareable between sequences: keep, host and zeros of
     * seq->capacity entries (a keep list, a head's key mass, zeros), counts
     * and append of n_heads. */
    int *keep, *counts;
    float *host;
    const float *zeros;
    kv_view_t *append;
    /* For a policy collecting KV_STATS_WINDOW_LOGITS: the layer's query
     * projections before normalisation (backend, rows as k's), q_bias (host,
     * n_heads * head_dim: what they include beyond the raw projection), and
     * scratch for one head's keys (keys on the backend, keys_host on the
     * host, seq->capacity x head_dim floats each) and its window's queries
     * (host, KV_MAX_WINDOW_QUERIES x head_dim). NULL when the family gives
     * none: such a policy then fails. */
    const float *q_proj, *q_bias;
    float *keys, *keys_host, *queries_host;
} kv_layer_seq_t;

/* Runs the policy's part of layer `layer` at moment `when` on s.
 * KV_LAYER_KEYS: similarity is the layer's key similarity, measured by the
 * caller when kv_policy_layer_similarity asks (NaN otherwise), and views
 * (n_heads entries) receives what each head attends to; the other moments
 * ignore both. AR_ERR when a compaction fails, or the pool runs out at a
 * reserve (the KV plan was exceeded): the sequence is then half advanced,
 * to be freed. */
int kv_policy_on_layer(const kv_layer_seq_t *s, kv_layer_moment_t when, int layer,
                       double similarity, kv_view_t *views, ar_error_t *err);

#endif
