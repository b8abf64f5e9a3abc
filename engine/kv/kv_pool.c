/* The paged KV pool: a free list of block ids over one backend allocation,
 * per-head block tables, and compaction through the backend's gather. */
#include "engine/kv/kv_pool.h"

#include <stdlib.h>
#include <string.h>

int kv_pool_choose_block_tokens(int min_budget_tokens) {
    /* overhead (bt - 1) < 5% of the budget, in integers: 20 (bt - 1) < budget */
    int bt = 1;
    while (bt < (1 << 20) && (int64_t)20 * (2 * bt - 1) < min_budget_tokens)
        bt *= 2;
    return bt;
}

size_t kv_pool_block_bytes(int block_tokens, int head_dim, dtype_t dtype) {
    return (size_t)2 * (size_t)block_tokens * (size_t)head_dim * dtype_size(dtype);
}

int kv_pool_init(kv_pool_t *p, backend_t *be, int n_blocks, int block_tokens, int head_dim,
                 dtype_t dtype, ar_error_t *err) {
    memset(p, 0, sizeof *p);
    if (!kv_dtype_ok(dtype))
        return ar_errorf(err, "KV pool: elements of type %s: the cache holds f32, bf16, f16 or fp8",
                         dtype_name(dtype));
    if (n_blocks < 1 || block_tokens < 1 || head_dim < 1)
        return ar_errorf(err,
                         "KV pool: %d blocks of %d tokens x head_dim %d: every size must be "
                         "positive (is the pool smaller than one block?)",
                         n_blocks, block_tokens, head_dim);
    const size_t block_bytes = kv_pool_block_bytes(block_tokens, head_dim, dtype);
    if ((size_t)n_blocks > SIZE_MAX / block_bytes)
        return ar_errorf(err, "KV pool: %d blocks of %zu bytes overflow", n_blocks, block_bytes);
    p->be = be;
    p->blocks.dtype = dtype;
    p->blocks.block_tokens = block_tokens;
    p->blocks.head_dim = head_dim;
    p->blocks.base = be->alloc(be, (size_t)n_blocks * block_bytes);
    p->free_list = malloc((size_t)n_blocks * sizeof *p->free_list);
    p->in_use = calloc((size_t)n_blocks, 1);
    if (!p->blocks.base || !p->free_list || !p->in_use) {
        kv_pool_free(p);
        return ar_errorf(err, "KV pool: out of memory for %d blocks of %zu bytes (%.1f MiB)",
                         n_blocks, block_bytes, (double)n_blocks * block_bytes / 1048576.0);
    }
    p->n_blocks = p->n_free = n_blocks;
    /* A stack popped from the end: blocks go out as 0, 1, 2, ... at first. */
    for (int i = 0; i < n_blocks; i++)
        p->free_list[i] = n_blocks - 1 - i;
    return AR_OK;
}

void kv_pool_free(kv_pool_t *p) {
    if (p->be)
        p->be->free(p->be, p->blocks.base);
    free(p->free_list);
    free(p->in_use);
    memset(p, 0, sizeof *p);
}

/* Returns one block; a block that is not in use (freed twice, or an id
 * that was never handed out) is reported and left alone. */
static int block_free(kv_pool_t *p, int id, ar_error_t *err) {
    if (id < 0 || id >= p->n_blocks || !p->in_use[id]) {
        p->bad_frees++;
        return ar_errorf(err, "KV pool: block %d released but it is %s (double free)", id,
                         id < 0 || id >= p->n_blocks ? "not a block of the pool" : "not in use");
    }
    p->in_use[id] = 0;
    p->free_list[p->n_free++] = id;
    return AR_OK;
}

int kv_head_reserve(kv_pool_t *p, kv_head_t *h, int new_len, ar_error_t *err) {
    const int need = kv_pool_blocks_for(p, new_len) - h->n_blocks;
    if (need <= 0)
        return AR_OK;
    if (need > p->n_free)
        return ar_errorf(err, "KV pool exhausted: %d more blocks needed, %d of %d free", need,
                         p->n_free, p->n_blocks);
    if (h->n_blocks + need > h->cap) {
        int cap = h->cap ? 2 * h->cap : 8;
        if (cap < h->n_blocks + need)
            cap = h->n_blocks + need;
        int *b = realloc(h->blocks, (size_t)cap * sizeof *b);
        if (!b)
            return ar_errorf(err, "out of memory for a block table of %d blocks", cap);
        h->blocks = b;
        h->cap = cap;
    }
    for (int i = 0; i < need; i++) {
        const int id = p->free_list[--p->n_free];
        p->in_use[id] = 1;
        h->blocks[h->n_blocks++] = id;
    }
    if (kv_pool_blocks_in_use(p) > p->peak_in_use)
        p->peak_in_use = kv_pool_blocks_in_use(p);
    return AR_OK;
}

/* Frees h's blocks from index keep_blocks on. The blocks came from the pool
 * through h, so a failure here is a bug: it is counted in bad_frees. */
static void free_tail(kv_pool_t *p, kv_head_t *h, int keep_blocks) {
    for (int i = keep_blocks; i < h->n_blocks; i++)
        block_free(p, h->blocks[i], NULL);
    if (h->n_blocks > keep_blocks)
        h->n_blocks = keep_blocks;
}

void kv_head_trim(kv_pool_t *p, kv_head_t *h) { free_tail(p, h, kv_pool_blocks_for(p, h->len)); }

int kv_head_compact(kv_pool_t *p, kv_head_t *h, const int *keep, int n_keep, float *mass,
                    ar_error_t *err) {
    if (n_keep < 0 || n_keep > h->len)
        return ar_errorf(err, "keep list of %d entries for a head of %d tokens", n_keep, h->len);
    for (int i = 0; i < n_keep; i++)
        if (keep[i] < 0 || keep[i] >= h->len || (i > 0 && keep[i] <= keep[i - 1]))
            return ar_errorf(err,
                             "keep list entry %d is %d: entries must be strictly ascending "
                             "cache indices below %d",
                             i, keep[i], h->len);
    /* n_keep == len with strictly ascending entries is the identity. */
    if (n_keep < h->len)
        p->be->kv_gather(p->be, &p->blocks, h->blocks, keep, n_keep, mass);
    free_tail(p, h, kv_pool_blocks_for(p, n_keep));
    h->len = n_keep;
    return AR_OK;
}

int kv_head_release(kv_pool_t *p, kv_head_t *h, ar_error_t *err) {
    int rc = AR_OK;
    for (int i = 0; i < h->n_blocks; i++)
        if (block_free(p, h->blocks[i], rc == AR_OK ? err : NULL) != AR_OK)
            rc = AR_ERR;
    free(h->blocks);
    memset(h, 0, sizeof *h);
    return rc;
}
