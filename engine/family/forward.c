/* A forward pass's KV bookkeeping, shared by the model families
 * (forward.h): what raster.c and var.c both did around their layers. */
#include "engine/family/forward.h"

#include <math.h>

int forward_begin(forward_t *f, int n_seq, ar_error_t *err) {
    arena_t *a = f->arena;
    const size_t heads = (size_t)n_seq * (size_t)f->n_heads;
    arena_begin(a);
    f->n_seq = n_seq;
    f->in = arena_calloc(a, (size_t)n_seq, sizeof *f->in);
    f->q_start = arena_alloc(a, (size_t)(n_seq + 1) * sizeof *f->q_start);
    f->views = arena_alloc(a, heads * sizeof *f->views);
    f->grown = f->attend_new ? f->views : arena_alloc(a, heads * sizeof *f->grown);
    f->mass = arena_alloc(a, heads * sizeof *f->mass);
    if (!f->in || !f->q_start || !f->views || !f->grown || !f->mass)
        return ar_errorf(err, "out of memory");
    f->q_start[0] = 0;
    f->any_mass = f->any_layered = f->any_window = 0;
    f->keys = NULL;
    f->q_proj = f->q_bias = NULL;
    return AR_OK;
}

int forward_add(forward_t *f, int s, const forward_seq_t *in, ar_error_t *err) {
    if (in->collect_mass && !in->seq->mass)
        return ar_errorf(err,
                         "sequence %d: key mass asked for, but the sequence has no mass arrays", s);
    forward_seq_t *q = &f->in[s];
    *q = *in;
    if (kv_policy_layered(q->policy)) {
        if (f->attend_new)
            return ar_errorf(err,
                             "sequence %d: a layered KV policy prunes before the layer "
                             "attends, and this family appends before it attends",
                             s);
        q->n_new = 0; /* it caches layer by layer (kv_policy_on_layer) */
        f->any_layered = 1;
        f->any_window |= kv_policy_window_logits(q->policy);
    }
    if (f->attend_new && q->n_new != q->rows)
        return ar_errorf(err,
                         "sequence %d: attention reads the new tokens from the cache, but it "
                         "caches %d of %d",
                         s, q->n_new, q->rows);
    f->any_mass |= q->collect_mass;
    f->q_start[s + 1] = f->q_start[s] + q->rows;
    if (s == 0)
        f->pool = q->seq->pool;
    return AR_OK;
}

int forward_reserve(forward_t *f, ar_error_t *err) {
    arena_t *a = f->arena;
    const int n = f->n_seq;
    kv_seq_t **seqs = arena_alloc(a, (size_t)n * sizeof *seqs);
    int *n_new = arena_alloc(a, (size_t)n * sizeof *n_new);
    if (!seqs || !n_new)
        return ar_errorf(err, "out of memory");
    int max_cap = 1;
    for (int s = 0; s < n; s++) {
        seqs[s] = f->in[s].seq;
        n_new[s] = f->in[s].n_new;
        max_cap = seqs[s]->capacity > max_cap ? seqs[s]->capacity : max_cap;
    }
    if (f->any_layered) {
        kv_layer_seq_t *t = &f->scratch;
        float *zeros = arena_calloc(a, (size_t)max_cap, sizeof *zeros);
        t->keep = arena_alloc(a, (size_t)max_cap * sizeof *t->keep);
        t->host = arena_alloc(a, (size_t)max_cap * sizeof *t->host);
        t->counts = arena_alloc(a, (size_t)f->n_heads * sizeof *t->counts);
        t->append = arena_alloc(a, (size_t)f->n_heads * sizeof *t->append);
        t->zeros = zeros;
        if (!t->keep || !t->host || !zeros || !t->counts || !t->append)
            return ar_errorf(err, "out of memory");
        if (f->any_window) {
            const size_t D = (size_t)f->head_dim;
            t->keys_host = arena_alloc(a, (size_t)max_cap * D * sizeof *t->keys_host);
            t->queries_host = arena_alloc(a, KV_MAX_WINDOW_QUERIES * D * sizeof *t->queries_host);
            f->keys = t->keys = f->be->alloc(f->be, (size_t)max_cap * D * sizeof *t->keys);
            if (!D || !t->keys_host || !t->queries_host || !t->keys)
                return ar_errorf(err, "out of memory for the window scores' keys");
        }
    }
    f->batch = (attn_batch_t){n, f->q_start, f->views, f->any_mass ? f->mass : NULL};
    return kv_seq_reserve(seqs, n_new, n, err);
}

void forward_layer(forward_t *f, int layer) {
    const int H = f->n_heads;
    for (int s = 0; s < f->n_seq; s++) {
        const forward_seq_t *q = &f->in[s];
        const kv_seq_t *sq = q->seq;
        for (int h = 0; h < H; h++) {
            const kv_head_t *kh = &sq->heads[layer * H + h];
            const int i = s * H + h;
            if (f->attend_new) {
                f->views[i] = kv_head_view(kh, kh->len + q->n_new);
            } else {
                f->views[i] = kv_head_view(kh, kh->len);
                /* A sequence that caches nothing now: a view the append skips. */
                f->grown[i] =
                    q->n_new ? kv_head_view(kh, kh->len + q->n_new) : (kv_view_t){NULL, 0, 0, 0};
            }
            f->mass[i] =
                q->collect_mass ? sq->mass + (size_t)(layer * H + h) * (size_t)sq->capacity : NULL;
        }
    }
}

/* Sequence s as its layered policy's hook sees it. */
static kv_layer_seq_t layered_seq(const forward_t *f, int s, const float *k, const float *v) {
    const forward_seq_t *q = &f->in[s];
    kv_layer_seq_t t = f->scratch;
    t.policy = q->policy;
    t.seq = q->seq;
    t.step = q->step;
    t.cache = q->cache;
    t.collect_mass = q->collect_mass;
    t.k = k;
    t.v = v;
    t.row0 = f->q_start[s];
    t.row1 = f->q_start[s + 1];
    t.q_proj = f->q_proj;
    t.q_bias = f->q_bias;
    return t;
}

static int is_layered(const forward_t *f, int s) { return kv_policy_layered(f->in[s].policy); }

int forward_prune(forward_t *f, int layer, const float *k, ar_error_t *err) {
    for (int s = 0; f->any_layered && s < f->n_seq; s++) {
        if (!is_layered(f, s))
            continue;
        const forward_seq_t *q = &f->in[s];
        double similarity = NAN;
        if (f->similarity && kv_policy_layer_similarity(q->policy, q->step, layer))
            similarity = f->similarity(f->family, f, s, k);
        const kv_layer_seq_t t = layered_seq(f, s, k, NULL);
        if (kv_policy_on_layer(&t, KV_LAYER_KEYS, layer, similarity, &f->views[s * f->n_heads],
                               err) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

/* Each peak_blocks pointer's sequences' blocks now, if more than before. */
static void track_peaks(const forward_t *f) {
    const forward_seq_t *in = f->in;
    for (int s = 0; s < f->n_seq; s++) {
        int first = in[s].peak_blocks != NULL, total = 0;
        for (int t = 0; t < s && first; t++)
            first = in[t].peak_blocks != in[s].peak_blocks; /* counted with input t */
        if (!first)
            continue;
        for (int t = s; t < f->n_seq; t++)
            if (in[t].peak_blocks == in[s].peak_blocks)
                total += kv_seq_blocks(in[t].seq);
        if (total > *in[s].peak_blocks)
            *in[s].peak_blocks = total;
    }
}

void forward_queries(forward_t *f, float *dst, const float *q, const float *bias, int rows) {
    f->be->copy(f->be, dst, q, (size_t)rows * f->n_heads * f->head_dim * sizeof *dst);
    f->q_proj = dst;
    f->q_bias = bias;
}

int forward_store(forward_t *f, int layer, const float *k, const float *v, ar_error_t *err) {
    backend_t *be = f->be;
    int any_new = 0;
    for (int s = 0; s < f->n_seq; s++) {
        any_new |= f->in[s].n_new > 0;
        if (!is_layered(f, s))
            continue;
        const kv_layer_seq_t t = layered_seq(f, s, k, v);
        if (kv_policy_on_layer(&t, KV_LAYER_ATTENDED, layer, NAN, NULL, err) != AR_OK)
            return AR_ERR;
    }
    if (any_new)
        be->kv_append(be, &f->pool->blocks, f->grown, k, v, f->q_start, f->n_seq, f->n_heads);
    track_peaks(f);
    for (int s = 0; f->any_layered && s < f->n_seq; s++) {
        if (!is_layered(f, s))
            continue;
        const kv_layer_seq_t t = layered_seq(f, s, k, v);
        if (kv_policy_on_layer(&t, KV_LAYER_STORED, layer, NAN, NULL, err) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

void forward_advance(forward_t *f) {
    for (int s = 0; s < f->n_seq; s++) {
        kv_seq_t *sq = f->in[s].seq;
        for (int i = 0; i < sq->n_layers * sq->n_heads; i++)
            sq->heads[i].len += f->in[s].n_new;
        sq->n_fed += f->in[s].n_fed;
    }
}

void forward_end(forward_t *f) {
    if (f->keys)
        f->be->free(f->be, f->keys);
    f->keys = NULL;
    arena_end(f->arena);
}
