/* A sequence's per-(layer, head) caches in the paged pool (kv_seq.h). */
#include "engine/kv/kv_seq.h"

#include <stdlib.h>
#include <string.h>

int kv_seq_init(kv_seq_t *s, kv_pool_t *pool, int n_layers, int n_heads, int capacity,
                int with_mass, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    if (capacity < 1 || n_layers < 1 || n_heads < 1)
        return ar_errorf(err, "a sequence of %d tokens in %d x %d heads", capacity, n_layers,
                         n_heads);
    const size_t heads = (size_t)n_layers * (size_t)n_heads;
    s->pool = pool;
    s->n_layers = n_layers;
    s->n_heads = n_heads;
    s->capacity = capacity;
    s->heads = calloc(heads, sizeof *s->heads);
    if (!s->heads) {
        memset(s, 0, sizeof *s);
        return ar_errorf(err, "out of memory");
    }
    /* Block tables for the whole capacity now, so feeding never allocates. */
    const int table = kv_pool_blocks_for(pool, capacity);
    for (size_t i = 0; i < heads; i++) {
        if (!(s->heads[i].blocks = malloc((size_t)table * sizeof(int)))) {
            kv_seq_free(s, NULL);
            return ar_errorf(err, "out of memory for the block tables of a %d-token sequence",
                             capacity);
        }
        s->heads[i].cap = table;
    }
    if (with_mass) {
        backend_t *be = pool->be;
        const size_t n = heads * (size_t)capacity;
        float *zeros = calloc(n, sizeof *zeros);
        s->mass = be->alloc(be, n * sizeof(float));
        if (!zeros || !s->mass) {
            free(zeros);
            kv_seq_free(s, NULL);
            return ar_errorf(err, "out of memory for the key mass of a %d-token sequence",
                             capacity);
        }
        be->upload(be, s->mass, zeros, n * sizeof(float));
        free(zeros);
    }
    return AR_OK;
}

int kv_seq_free(kv_seq_t *s, ar_error_t *err) {
    int rc = AR_OK;
    for (int i = 0; s->heads && i < s->n_layers * s->n_heads; i++)
        if (kv_head_release(s->pool, &s->heads[i], rc == AR_OK ? err : NULL) != AR_OK)
            rc = AR_ERR;
    if (s->mass)
        s->pool->be->free(s->pool->be, s->mass);
    free(s->heads);
    memset(s, 0, sizeof *s);
    return rc;
}

int kv_seq_blocks(const kv_seq_t *s) {
    int n = 0;
    for (int i = 0; s->heads && i < s->n_layers * s->n_heads; i++)
        n += s->heads[i].n_blocks;
    return n;
}

int kv_seq_reserve(kv_seq_t *const *seqs, const int *n_new, int n, ar_error_t *err) {
    if (n <= 0)
        return AR_OK;
    kv_pool_t *pool = seqs[0]->pool;
    long long need = 0;
    for (int s = 0; s < n; s++) {
        const kv_seq_t *sq = seqs[s];
        if (n_new[s] < 0 || sq->n_fed + n_new[s] > sq->capacity)
            return ar_errorf(err,
                             "sequence %d: %d new tokens do not fit its capacity (%d of %d fed)", s,
                             n_new[s], sq->n_fed, sq->capacity);
        if (sq->pool != pool)
            return ar_errorf(err,
                             "sequence %d: the sequences of one forward pass must share a "
                             "KV pool",
                             s);
        for (int i = 0; i < sq->n_layers * sq->n_heads; i++) {
            const kv_head_t *h = &sq->heads[i];
            const int more = kv_pool_blocks_for(pool, h->len + n_new[s]) - h->n_blocks;
            if (more > 0)
                need += more;
        }
    }
    if (need > pool->n_free)
        return ar_errorf(err, "KV pool exhausted: this step needs %lld more blocks, %d of %d free",
                         need, pool->n_free, pool->n_blocks);
    for (int s = 0; s < n; s++) {
        kv_seq_t *sq = seqs[s];
        for (int i = 0; i < sq->n_layers * sq->n_heads; i++) {
            if (kv_head_reserve(pool, &sq->heads[i], sq->heads[i].len + n_new[s], err) == AR_OK)
                continue;
            for (int t = 0; t <= s; t++)
                for (int j = 0; j < seqs[t]->n_layers * seqs[t]->n_heads; j++)
                    kv_head_trim(pool, &seqs[t]->heads[j]);
            return AR_ERR;
        }
    }
    return AR_OK;
}
