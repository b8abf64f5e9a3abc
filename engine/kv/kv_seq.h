/* One sequence's KV cache in the paged pool (engine/kv/kv_pool.h): for layer l
 * and head h, heads[l * n_heads + h] holds that head's tokens. Heads may
 * hold different numbers of tokens once a policy compacts them; n_fed
 * counts every token fed (the next token's position), evicted or not. Any
 * model family's forward pass appends to these; the generation loop
 * (engine/generate.h) owns them, two per image (its CFG pair). */
#ifndef ARSERVE_KV_SEQ_H
#define ARSERVE_KV_SEQ_H

#include "engine/kv/kv_pool.h"

typedef struct kv_seq {
    kv_pool_t *pool;
    int n_layers, n_heads;
    int n_fed, capacity; /* tokens fed so far, at most capacity */
    kv_head_t *heads;    /* host, n_layers * n_heads */
    /* Key mass for policies (NULL without): for head i, mass + i * capacity
     * holds heads[i].len floats of backend memory, zero past len. */
    float *mass;
} kv_seq_t;

/* An empty sequence of at most capacity tokens whose KV lives in pool.
 * with_mass allocates its key-mass arrays (pool backend memory, layers x
 * heads x capacity floats, zeroed). Blocks are taken as tokens are fed. */
int kv_seq_init(kv_seq_t *s, kv_pool_t *pool, int n_layers, int n_heads, int capacity,
                int with_mass, ar_error_t *err);

/* Returns every block to the pool. AR_ERR only if the pool reports a double
 * free (then the rest is released all the same). Safe on a zeroed sequence. */
int kv_seq_free(kv_seq_t *s, ar_error_t *err);

/* Blocks the sequence's heads hold now. */
int kv_seq_blocks(const kv_seq_t *s);

/* Reserves the blocks every head of seqs[i] needs for n_new[i] >= 0 more
 * tokens (0: a step that caches nothing, as a next-scale model's last scale)
 * (all sequences in one pool), or none: the free blocks are counted first,
 * and a host allocation failing midway is undone. Fails, with nothing
 * changed, when a sequence would pass its capacity or the pool has too few
 * free blocks. */
int kv_seq_reserve(kv_seq_t *const *seqs, const int *n_new, int n, ar_error_t *err);

#endif
