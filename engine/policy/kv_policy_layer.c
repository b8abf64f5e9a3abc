/* The layered policies' hook in the forward pass (kv_policy_layer.h): what
 * each (layer, head) keeps, asked of the policy through kv_policy.h and
 * applied to the sequence's caches in the paged pool. */
#include "engine/policy/kv_policy_layer.h"

#include <math.h>

/* Before the layer attends: the policy may evict from each head (with the
 * layer's key similarity when it asked for it), and the views the
 * attention reads follow. */
static int on_keys(const kv_layer_seq_t *s, int li, double similarity, kv_view_t *views,
                   ar_error_t *err) {
    kv_seq_t *sq = s->seq;
    const int H = sq->n_heads;
    for (int h = 0; h < H; h++) {
        kv_head_t *kh = &sq->heads[li * H + h];
        int n_keep;
        const int what =
            kv_policy_layer_begin(s->policy, s->step, li, h, kh->len, similarity, s->keep, &n_keep);
        if ((what & KV_COMPACT) &&
            kv_head_compact(sq->pool, kh, s->keep, n_keep, NULL, err) != AR_OK)
            return ar_error_prefix(err, "step %d, layer %d, head %d", s->step, li, h);
        views[h] = kv_head_view(kh, kh->len);
    }
    return AR_OK;
}

/* After the layer has attended: the policy compacts each head, then the
 * heads it says cache the step take their blocks and the newest rows it
 * says of the step's K and V; every compaction comes before any reserve. */
static int on_attended(const kv_layer_seq_t *s, int li, ar_error_t *err) {
    kv_seq_t *sq = s->seq;
    kv_pool_t *pool = sq->pool;
    backend_t *be = pool->be;
    const int H = sq->n_heads, rows = s->row1 - s->row0;
    int *counts = s->counts;
    for (int h = 0; h < H; h++) {
        kv_head_t *kh = &sq->heads[li * H + h];
        int n_keep, cache;
        const int what =
            kv_policy_layer_end(s->policy, s->step, li, h, kh->len, s->keep, &n_keep, &cache);
        if ((what & KV_COMPACT) && kv_head_compact(pool, kh, s->keep, n_keep, NULL, err) != AR_OK)
            return ar_error_prefix(err, "step %d, layer %d, head %d", s->step, li, h);
        counts[h] = s->cache ? (cache < rows ? cache : rows) : 0;
    }
    for (int h = 0; h < H; h++) {
        kv_head_t *kh = &sq->heads[li * H + h];
        if (counts[h] > 0 && kv_head_reserve(pool, kh, kh->len + counts[h], err) != AR_OK)
            return ar_error_prefix(err, "step %d, layer %d, head %d: the KV plan was exceeded",
                                   s->step, li, h);
    }
    /* One append per distinct count (a policy's heads mostly share one):
     * each takes the step's newest rows. */
    for (int first = 0; first < H; first++) {
        const int c = counts[first];
        if (c == 0)
            continue;
        for (int h = 0; h < H; h++) {
            kv_head_t *kh = &sq->heads[li * H + h];
            s->append[h] =
                counts[h] == c ? kv_head_view(kh, kh->len + c) : (kv_view_t){NULL, 0, 0, 0};
        }
        const int newest[2] = {s->row1 - c, s->row1};
        be->kv_append(be, &pool->blocks, s->append, s->k, s->v, newest, 1, H);
        for (int h = 0; h < H; h++)
            if (counts[h] == c) {
                sq->heads[li * H + h].len += c;
                counts[h] = 0;
            }
    }
    return AR_OK;
}

/* Head h's scores for a policy that asks for its window queries' logits
 * (kv_policy_window_queries), into s->host; 0 when it asks for none (the
 * head is not cut), -1 on error. Each logit is rounded to float, divided by
 * sqrt(head_dim) and summed in the order of rows, as torch sums a float
 * matmul's rows. */
static int window_scores(const kv_layer_seq_t *s, int li, int h, int len, ar_error_t *err) {
    kv_seq_t *sq = s->seq;
    backend_t *be = sq->pool->be;
    const int H = sq->n_heads, D = sq->pool->blocks.head_dim;
    int rows[KV_MAX_WINDOW_QUERIES];
    const int n = kv_policy_window_queries(s->policy, s->step, li, h, len, rows);
    if (n <= 0)
        return 0;
    if (!s->q_proj || !s->q_bias || !s->keys || !s->keys_host || !s->queries_host) {
        ar_errorf(err,
                  "step %d, layer %d: the KV policy scores keys by its queries, and this model "
                  "family does not give them",
                  s->step, li);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        float *q = s->queries_host + (size_t)i * D;
        if (rows[i] < 0 || rows[i] >= s->row1 - s->row0) {
            ar_errorf(err, "step %d, layer %d: window query row %d of %d", s->step, li, rows[i],
                      s->row1 - s->row0);
            return -1;
        }
        be->download(be, q, s->q_proj + ((size_t)(s->row0 + rows[i]) * H + h) * D,
                     (size_t)D * sizeof(float));
        for (int d = 0; d < D; d++)
            q[d] -= s->q_bias[h * D + d];
    }
    const kv_view_t view = kv_head_view(&sq->heads[li * H + h], len);
    be->kv_read_rows(be, s->keys, &sq->pool->blocks, &view, 0, len, 0);
    be->download(be, s->keys_host, s->keys, (size_t)len * D * sizeof(float));
    const float root = sqrtf((float)D);
    for (int j = 0; j < len; j++) {
        const float *k = s->keys_host + (size_t)j * D;
        float sum = 0;
        for (int i = 0; i < n; i++) {
            const float *q = s->queries_host + (size_t)i * D;
            double dot = 0;
            for (int d = 0; d < D; d++)
                dot += (double)q[d] * k[d];
            sum += (float)dot / root;
        }
        s->host[j] = sum;
    }
    return 1;
}

/* Once the batch holds the layer's new tokens: cuts by the step's key mass
 * (downloaded into s->host, then zeroed on the backend), or by the window
 * queries' logits when the policy asks for them. */
static int on_stored(const kv_layer_seq_t *s, int li, ar_error_t *err) {
    kv_seq_t *sq = s->seq;
    backend_t *be = sq->pool->be;
    for (int h = 0; h < sq->n_heads; h++) {
        const int i = li * sq->n_heads + h;
        kv_head_t *kh = &sq->heads[i];
        const int len = kh->len;
        float *mass = s->collect_mass ? sq->mass + (size_t)i * sq->capacity : NULL;
        if (mass)
            be->download(be, s->host, mass, (size_t)len * sizeof *s->host);
        const int scored = window_scores(s, li, h, len, err);
        if (scored < 0)
            return AR_ERR;
        int n_keep;
        const int what = kv_policy_layer_stored(s->policy, s->step, li, h, len,
                                                mass || scored ? s->host : NULL, s->keep, &n_keep);
        if ((what & KV_COMPACT) &&
            kv_head_compact(sq->pool, kh, s->keep, n_keep, NULL, err) != AR_OK)
            return ar_error_prefix(err, "step %d, layer %d, head %d", s->step, li, h);
        if (mass)
            be->upload(be, mass, s->zeros, (size_t)len * sizeof *s->zeros);
    }
    return AR_OK;
}

int kv_policy_on_layer(const kv_layer_seq_t *s, kv_layer_moment_t when, int layer,
                       double similarity, kv_view_t *views, ar_error_t *err) {
    switch (when) {
    case KV_LAYER_KEYS:
        return on_keys(s, layer, similarity, views, err);
    case KV_LAYER_ATTENDED:
        return on_attended(s, layer, err);
    case KV_LAYER_STORED:
        return on_stored(s, layer, err);
    }
    return ar_errorf(err, "kv_policy_on_layer: no moment %d", (int)when);
}
