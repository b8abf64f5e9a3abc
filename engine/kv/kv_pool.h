/* The paged KV pool (docs/kv-cache.md): one backend allocation of fixed-size
 * blocks, each holding block_tokens tokens of ONE (sequence, layer, head),
 * K rows then V rows. A host free list hands blocks out; every (sequence,
 * layer, head) keeps its own block table (kv_head_t), so heads hold
 * different numbers of tokens and allocation equals occupancy up to the last
 * partial block of each head. Append (reserve), compaction and release cost
 * O(blocks touched). Not thread-safe: the engine thread owns the pool. */
#ifndef ARSERVE_KV_POOL_H
#define ARSERVE_KV_POOL_H

#include <stddef.h>
#include <stdint.h>

#include "base/status.h"
#include "engine/backend/backend.h"

typedef struct kv_pool {
    backend_t *be;
    kv_blocks_t blocks;  /* base, block_tokens, head_dim: what backend ops take */
    int n_blocks;        /* capacity */
    int n_free;          /* free_list[0..n_free) are free */
    int *free_list;      /* host, n_blocks: a stack of free block ids */
    uint8_t *in_use;     /* host, n_blocks: 1 while a head owns the block */
    int peak_in_use;     /* most blocks in use since kv_pool_reset_peak */
    long long bad_frees; /* release of a block that was not in use (a bug, reported) */
} kv_pool_t;

/* One (sequence, layer, head) cache: len tokens in blocks[0..n_blocks),
 * n_blocks == ceil(len / block_tokens) between steps (a reserve may run
 * ahead of len until the append that fills it). cap is the room in blocks. */
typedef struct kv_head {
    int len;
    int n_blocks;
    int cap;
    int *blocks; /* host, block ids in cache order */
    /* fp8's K and V scales (a cached e is the value e * scale); 0 means 1,
     * what vLLM's fp8 cache uses without calibrated scales. The model's
     * per-(layer, head) ones come from its kv_scales.json (engine/model.h). */
    float k_scale, v_scale;
} kv_head_t;

/* h's first len cache indices as backend ops see them. */
static inline kv_view_t kv_head_view(const kv_head_t *h, int len) {
    return (kv_view_t){h->blocks, len, h->k_scale > 0 ? h->k_scale : 1.0f,
                       h->v_scale > 0 ? h->v_scale : 1.0f};
}

/* The largest power of two block_tokens whose worst-case overhead per head
 * (block_tokens - 1 tokens in a last, partial block) stays under 5% of
 * min_budget_tokens, the fewest tokens a head holds under the smallest
 * budget served; at least 1. */
int kv_pool_choose_block_tokens(int min_budget_tokens);

/* 1 for the types the cache can hold: f32, bf16, f16 and fp8 (e4m3). */
static inline int kv_dtype_ok(dtype_t t) {
    return t == DTYPE_F32 || t == DTYPE_BF16 || t == DTYPE_F16 || t == DTYPE_F8_E4M3;
}

/* Bytes of one block: K and V rows of block_tokens tokens of head_dim
 * elements of type dtype. */
size_t kv_pool_block_bytes(int block_tokens, int head_dim, dtype_t dtype);

/* Allocates n_blocks blocks of K and V stored as dtype (kv_dtype_ok) in one
 * backend allocation. AR_ERR (message names the size) when out of memory,
 * a size is not positive or the type is not a cache type. */
int kv_pool_init(kv_pool_t *p, backend_t *be, int n_blocks, int block_tokens, int head_dim,
                 dtype_t dtype, ar_error_t *err);
void kv_pool_free(kv_pool_t *p);

static inline int kv_pool_blocks_in_use(const kv_pool_t *p) { return p->n_blocks - p->n_free; }
/* Bytes of one of p's blocks. */
static inline size_t kv_pool_bytes_per_block(const kv_pool_t *p) {
    return kv_pool_block_bytes(p->blocks.block_tokens, p->blocks.head_dim, p->blocks.dtype);
}
static inline size_t kv_pool_capacity_bytes(const kv_pool_t *p) {
    return (size_t)p->n_blocks * kv_pool_bytes_per_block(p);
}
static inline size_t kv_pool_used_bytes(const kv_pool_t *p) {
    return (size_t)kv_pool_blocks_in_use(p) * kv_pool_bytes_per_block(p);
}
/* Starts a new high-water mark at the blocks in use now. */
static inline void kv_pool_reset_peak(kv_pool_t *p) { p->peak_in_use = kv_pool_blocks_in_use(p); }

/* Blocks a head needs to hold len tokens. */
static inline int kv_pool_blocks_for(const kv_pool_t *p, int len) {
    return (len + p->blocks.block_tokens - 1) / p->blocks.block_tokens;
}

/* Makes room for new_len tokens in h (whole blocks from the free list);
 * len is left to the caller, who sets it once the rows are written. AR_ERR,
 * with h and the pool unchanged, when the pool has too few free blocks or
 * the host is out of memory. */
int kv_head_reserve(kv_pool_t *p, kv_head_t *h, int new_len, ar_error_t *err);

/* Returns the blocks past what h->len needs to the free list (undoes a
 * reserve that was not followed by an append). */
void kv_head_trim(kv_pool_t *p, kv_head_t *h);

/* Keeps cache indices keep[0..n_keep) (strictly ascending, < h->len): one
 * backend gather moves them (and mass entries, when mass is not NULL) to
 * the front, then the blocks past the new length go back to the pool.
 * AR_ERR, with nothing changed, when keep is not a valid keep list. */
int kv_head_compact(kv_pool_t *p, kv_head_t *h, const int *keep, int n_keep, float *mass,
                    ar_error_t *err);

/* Returns every block of h to the pool and frees its table. AR_ERR (the
 * rest still released) when a block was not in use: a double free, counted
 * in p->bad_frees and left alone. */
int kv_head_release(kv_pool_t *p, kv_head_t *h, ar_error_t *err);

#endif
