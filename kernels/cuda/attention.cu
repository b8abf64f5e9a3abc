/* The paged KV cache's kernels: append through block tables, causal
 * attention split over keys (flash-decoding: partial max / sum / weighted
 * values per split, merged by a combine kernel) for one or many query rows
 * per sequence, next-scale attention (the cache, then a scale's own dense
 * keys), the exact key mass policies ask for, and in-place compaction; and
 * dense attention over keys outside the cache (Infinity's text, T5).
 * References: cpu_kv_append, cpu_attention, cpu_attention_scale,
 * cpu_kv_gather, cpu_attention_dense in engine/backend/backend_cpu.c; the
 * layout is backend.h's kv_blocks_t. */
#include "kernels/cuda/common.cuh"

/* Head dims up to this fit the per-lane accumulators (16 per lane). */
#define ATTN_MAX_HEAD_DIM 512
#define ATTN_ACC (ATTN_MAX_HEAD_DIM / 32)

/* K row of cache index j (elements of the pool's type); its V row is
 * v_offset(p) bytes further. */
static __device__ __forceinline__ char *k_row(const kern_kv_pool_t &p, const int *table, int j) {
    const int bt = p.block_tokens;
    return (char *)p.base + ((size_t)table[j / bt] * 2 * bt + (size_t)(j % bt)) *
                                (size_t)p.head_dim * kv_esize(p.dtype);
}

static __device__ __forceinline__ size_t v_offset(const kern_kv_pool_t &p) {
    return (size_t)p.block_tokens * (size_t)p.head_dim * kv_esize(p.dtype);
}

/* The item holding launch row r (items sorted by row_off). */
static __device__ __forceinline__ int item_of(const kern_kv_item_t *items, int n_items, int r) {
    int lo = 0, hi = n_items - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (items[mid].row_off <= r)
            lo = mid;
        else
            hi = mid - 1;
    }
    return lo;
}

/* One thread's dot product of a with a cache row (widened as ld_kv does),
 * in index order: the split kernel and the mass kernel both score with it,
 * so the mass is the softmax the output used. */
static __device__ __forceinline__ float dot_row(const float *a, const void *row, int dtype, int n,
                                                float scale) {
    float s = 0.0f;
    for (int i = 0; i < n; i++)
        s += a[i] * ld_kv(row, dtype, i, scale);
    return s;
}

/* The same against a dense fp32 row (a scale's new keys). */
static __device__ __forceinline__ float dot_f32(const float *a, const float *b, int n) {
    float s = 0.0f;
    for (int i = 0; i < n; i++)
        s += a[i] * b[i];
    return s;
}

/* One round of the online softmax over the scores a warp holds (sc:
 * -INFINITY where a lane has no key; at least one lane's is finite): the
 * lane's probability (0 where invalid) into *pr, m and l updated (counted:
 * whether this lane's probability joins the sum; a key scored by a group
 * of lanes counts once). Returns the factor what was accumulated before
 * is rescaled by (0 in the first round). */
static __device__ __forceinline__ float softmax_round(float sc, bool valid, bool counted, float &m,
                                                      float &l, float *pr) {
    const float m_new = fmaxf(m, warp_max(sc));
    const float rescale = expf(m - m_new);
    *pr = valid ? expf(sc - m_new) : 0.0f;
    l = l * rescale + warp_sum(counted ? *pr : 0.0f);
    m = m_new;
    return rescale;
}

/* ---- cache rows read by lane groups ------------------------------------------------ */

/* Decode attention reads cache rows with groups of L lanes of a warp (L a
 * power of two, at most 32; 32 / L keys at once), lane `sub` of a group
 * reading the row's 16-byte pieces sub, sub + L, ...: a group's lanes read
 * consecutive 16 bytes each, so a row is read in whole 16-byte loads (as
 * FlashDecoding's and vLLM's paged kernels read), each piece widened in
 * registers. Rows whose pieces are not 16-byte aligned (a row of
 * head_dim * element size not a multiple of 16) are read element by
 * element, in the same pieces. */
struct __align__(16) kv_piece {
    unsigned w[4];
};

/* Elements a 16-byte piece holds. */
template <int DT> static __host__ __device__ __forceinline__ constexpr int piece_elems() {
    return DT == KERN_F32 ? 4 : DT == KERN_F8_E4M3 ? 16 : 8;
}

/* Element i of a piece, as ld_kv widens it. */
template <int DT>
static __device__ __forceinline__ float piece_elem(const kv_piece &v, int i, float scale) {
    if (DT == KERN_F32)
        return __uint_as_float(v.w[i]);
    if (DT == KERN_BF16)
        return __uint_as_float(i % 2 ? v.w[i / 2] & 0xffff0000u : v.w[i / 2] << 16);
    if (DT == KERN_F16)
        return __half2float(__ushort_as_half((unsigned short)(v.w[i / 2] >> (i % 2 ? 16 : 0))));
    return f8e4m3_to_float((unsigned char)(v.w[i / 4] >> (8 * (i % 4)))) * scale;
}

/* Piece c of a row of n elements, widened into out (elements past n: 0). */
template <int DT>
static __device__ __forceinline__ void ld_piece(const char *row, int c, int n, float scale,
                                                bool aligned, float *out) {
    constexpr int E = piece_elems<DT>();
    const int i0 = c * E;
    if (aligned && i0 + E <= n) {
        const kv_piece v = *(const kv_piece *)(row + (size_t)c * 16);
        for (int i = 0; i < E; i++)
            out[i] = piece_elem<DT>(v, i, scale);
    } else {
        for (int i = 0; i < E; i++)
            out[i] = i0 + i < n ? ld_kv(row, DT, i0 + i, scale) : 0.0f;
    }
}

/* Sum over the L lanes of each group (every lane gets its group's sum,
 * the same bits on each: the butterfly adds the same pairs). */
static __device__ __forceinline__ float group_sum(float v, int L) {
    for (int o = L / 2; o > 0; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Sum over the groups of a warp of a value that every lane of a group
 * holds alike. */
static __device__ __forceinline__ float across_groups(float v, int L) {
    for (int o = 16; o >= L; o /= 2)
        v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* The dot product of q (head_dim floats) with a cache row, by a group: its
 * pieces' products summed in element order, then over the group. Every
 * lane of the warp must call it (shuffles); the split kernel and the mass
 * kernel score with it, so the mass is the softmax the output used. */
template <int DT>
static __device__ __forceinline__ float group_dot(const float *q, const char *row, int sub, int L,
                                                  int hd, float kscale, bool aligned) {
    constexpr int E = piece_elems<DT>();
    const int n_pieces = (hd + E - 1) / E;
    float s = 0.0f, k[E];
    for (int c = sub; c < n_pieces; c += L) {
        ld_piece<DT>(row, c, hd, kscale, aligned, k);
        for (int i = 0; i < E && c * E + i < hd; i++)
            s += q[c * E + i] * k[i];
    }
    return group_sum(s, L);
}

/* Lanes per group for a row of hd elements: enough for one piece each, at most 32. */
template <int DT> static int group_lanes(int hd) {
    const int pieces = (hd + piece_elems<DT>() - 1) / piece_elems<DT>();
    int L = 1;
    while (L < pieces && L < 32)
        L *= 2;
    return L;
}

/* ---- append -------------------------------------------------------------------- */

/* One block per new row of a pair: its K and V rows into the cache. */
__global__ void kv_append_kernel(kern_kv_pool_t p, const kern_kv_item_t *items, int n_items,
                                 const int *tables, const float *k, const float *v, int n_heads) {
    const int r = blockIdx.x, hd = p.head_dim;
    const kern_kv_item_t it = items[item_of(items, n_items, r)];
    const int t = it.t0 + (r - it.row_off);
    const int j = it.len - it.n_new + t;
    char *dk = k_row(p, tables + it.table, j), *dv = dk + v_offset(p);
    const size_t src = ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
    const float k_inv = 1.0f / it.k_scale, v_inv = 1.0f / it.v_scale;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        st_kv(dk, p.dtype, d, k[src + d], k_inv);
        st_kv(dv, p.dtype, d, v[src + d], v_inv);
    }
}

cudaError_t kern_kv_append(kern_kv_pool_t pool, const kern_kv_item_t *items, int n_items, int rows,
                           const int *tables, const float *k, const float *v, int n_heads,
                           cudaStream_t stream) {
    if (rows <= 0 || n_items <= 0 || pool.head_dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(kv_append_kernel, rows, block_for((size_t)pool.head_dim), 0, stream, pool, items,
              n_items, tables, k, v, n_heads);
    return cudaGetLastError();
}

/* ---- attention ------------------------------------------------------------------- */

static __host__ __device__ __forceinline__ int n_splits_for(int keys) {
    return (keys + KERN_ATTN_SPLIT_KEYS - 1) / KERN_ATTN_SPLIT_KEYS;
}

/* Partials: per (row, split) the running max m, the sum l and the weighted
 * values acc[head_dim]; then per row the final max and sum for the mass. */
size_t kern_attention_scratch(int rows, int max_keys, int head_dim) {
    const size_t splits = (size_t)n_splits_for(max_keys > 0 ? max_keys : 1);
    return (size_t)rows * splits * ((size_t)head_dim + 2) + (size_t)rows * 2;
}

/* Visible keys of row t of an item. */
static __device__ __forceinline__ int keys_of(const kern_kv_item_t &it, int t) {
    return it.len - it.n_new + t + 1;
}

/* One warp per (row, split), 32 / L keys at a time, a lane group each
 * (group_dot): the keys' max and their probabilities' sum over the groups
 * by shuffles (online softmax, one rescale a round); each group adds its
 * key's weighted V row to the accumulators of its lanes' pieces; at the
 * end the groups' accumulators are summed and the first group writes the
 * split's partials. */
template <int DT>
__global__ void attn_split_kernel(float *part, const float *q, kern_kv_pool_t p,
                                  const kern_kv_item_t *items, int n_items, const int *tables,
                                  int n_heads, float scale, int n_splits, int L, bool aligned) {
    constexpr int E = piece_elems<DT>();
    const int hd = p.head_dim, n_pieces = (hd + E - 1) / E;
    AR_DYNAMIC_SHARED(float, qs);
    const int r = blockIdx.x, split = blockIdx.y, lane = threadIdx.x;
    const int g = lane / L, sub = lane % L, per_round = 32 / L;
    const kern_kv_item_t it = items[item_of(items, n_items, r)];
    const int t = it.t0 + (r - it.row_off);
    const int n_keys = keys_of(it, t);
    const int j0 = split * KERN_ATTN_SPLIT_KEYS;
    if (j0 >= n_keys)
        return; /* the combine kernel reads only the splits a row has */
    const int j1 = min(n_keys, j0 + KERN_ATTN_SPLIT_KEYS);
    const int *table = tables + it.table;
    const float *qr = q + ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
    for (int d = lane; d < hd; d += 32)
        qs[d] = qr[d];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[ATTN_ACC], v[E];
    for (int i = 0; i < ATTN_ACC; i++)
        acc[i] = 0.0f;
    const size_t voff = v_offset(p);
    for (int base = j0; base < j1; base += per_round) {
        const int j = base + g;
        const bool valid = j < j1;
        const char *kr = k_row(p, table, valid ? j : base); /* every lane shuffles */
        const float dot = group_dot<DT>(qs, kr, sub, L, hd, it.k_scale, aligned);
        const float sc = valid ? dot * scale : -INFINITY;
        float pr; /* key `base` is visible: a finite score */
        const float rescale = softmax_round(sc, valid, sub == 0, m, l, &pr);
        AR_UNROLL
        for (int i = 0; i < ATTN_ACC; i++)
            acc[i] *= rescale;
        /* a lane's pieces c = sub + k L, at most ATTN_ACC / E of them (head
         * dims to 512): unrolled, so that acc stays in registers */
        AR_UNROLL
        for (int k = 0; k < ATTN_ACC / E; k++) {
            const int c = sub + k * L;
            if (!valid || c >= n_pieces)
                break;
            ld_piece<DT>(kr + voff, c, hd, it.v_scale, aligned, v);
            AR_UNROLL
            for (int i = 0; i < E; i++)
                acc[k * E + i] += pr * v[i];
        }
    }
    AR_UNROLL
    for (int i = 0; i < ATTN_ACC; i++)
        acc[i] = across_groups(acc[i], L);
    float *out = part + ((size_t)r * n_splits + split) * (size_t)(hd + 2);
    if (lane == 0) {
        out[0] = m;
        out[1] = l;
    }
    if (g == 0) {
        AR_UNROLL
        for (int k = 0; k < ATTN_ACC / E; k++) {
            const int c = sub + k * L;
            if (c >= n_pieces)
                break;
            AR_UNROLL
            for (int i = 0; i < E; i++)
                if (c * E + i < hd)
                    out[2 + c * E + i] = acc[k * E + i];
        }
    }
}

/* One warp per row: the splits' partials rescaled to the common max and
 * summed (flash-decoding's reduction); keeps the row's max and sum for
 * the mass kernel. */
__global__ void attn_combine_kernel(float *out, const float *part, float *stats,
                                    const kern_kv_item_t *items, int n_items, int hd, int n_heads,
                                    int n_splits) {
    const int r = blockIdx.x;
    const kern_kv_item_t it = items[item_of(items, n_items, r)];
    const int t = it.t0 + (r - it.row_off);
    const int ns = n_splits_for(keys_of(it, t));
    const float *pr = part + (size_t)r * n_splits * (size_t)(hd + 2);
    float m = -INFINITY;
    for (int s = 0; s < ns; s++)
        m = fmaxf(m, pr[(size_t)s * (hd + 2)]);
    float l = 0.0f;
    for (int s = 0; s < ns; s++)
        l += pr[(size_t)s * (hd + 2) + 1] * expf(pr[(size_t)s * (hd + 2)] - m);
    const float inv = 1.0f / l;
    float *o = out + ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.0f;
        for (int s = 0; s < ns; s++)
            a += pr[(size_t)s * (hd + 2) + 2 + d] * expf(pr[(size_t)s * (hd + 2)] - m);
        o[d] = a * inv;
    }
    if (threadIdx.x == 0) {
        stats[2 * (size_t)r] = m;
        stats[2 * (size_t)r + 1] = l;
    }
}

/* One warp per (item, 32 / L keys), a lane group per key j: the
 * probability every row of the item gave key j, rescored with the split
 * kernel's group_dot and normalised with the row's final max and sum,
 * added to mass[j] in row order (as the CPU does). No atomics: a key
 * belongs to one group, an item to one pair. */
template <int DT>
__global__ void attn_mass_kernel(const float *q, kern_kv_pool_t p, const kern_kv_item_t *items,
                                 const int *tables, int n_heads, float scale, const float *stats,
                                 int L, bool aligned) {
    const kern_kv_item_t it = items[blockIdx.y];
    const int lane = threadIdx.x, g = lane / L, sub = lane % L, hd = p.head_dim;
    if (!it.mass || it.n_rows == 0)
        return;
    const int last = keys_of(it, it.t0 + it.n_rows - 1); /* keys the item's last row sees */
    const int base = blockIdx.x * (32 / L), j = base + g;
    if (base >= last)
        return;
    const char *kr = k_row(p, tables + it.table, j < last ? j : base);
    float add = 0.0f;
    for (int t = it.t0; t < it.t0 + it.n_rows; t++) {
        const size_t r = (size_t)it.row_off + (size_t)(t - it.t0);
        const float *qr = q + ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
        const float s = group_dot<DT>(qr, kr, sub, L, hd, it.k_scale, aligned) * scale;
        if (j < keys_of(it, t))
            add += expf(s - stats[2 * r]) / stats[2 * r + 1];
    }
    if (j < last && sub == 0)
        it.mass[j] += add;
}

/* The decode kernels of one cache type. */
template <int DT>
static cudaError_t attention_of(float *out, const float *q, kern_kv_pool_t pool,
                                const kern_kv_item_t *items, int n_items, int rows, int max_keys,
                                const int *tables, int n_heads, float scale, int any_mass,
                                float *scratch, cudaStream_t stream) {
    const int head_dim = pool.head_dim, n_splits = n_splits_for(max_keys);
    const int L = group_lanes<DT>(head_dim);
    const bool aligned = ((size_t)head_dim * kv_esize(DT)) % 16 == 0 && (size_t)pool.base % 16 == 0;
    float *part = scratch;
    float *stats = scratch + (size_t)rows * n_splits * (size_t)(head_dim + 2);
    AR_LAUNCH(attn_split_kernel<DT>, dim3((unsigned)rows, (unsigned)n_splits), 32,
              (size_t)head_dim * sizeof(float), stream, part, q, pool, items, n_items, tables,
              n_heads, scale, n_splits, L, aligned);
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return e;
    AR_LAUNCH(attn_combine_kernel, rows, 32, 0, stream, out, part, stats, items, n_items, head_dim,
              n_heads, n_splits);
    e = cudaGetLastError();
    if (e != cudaSuccess || !any_mass)
        return e;
    const int per_block = 32 / L;
    AR_LAUNCH(attn_mass_kernel<DT>,
              dim3((unsigned)((max_keys + per_block - 1) / per_block), (unsigned)n_items), 32, 0,
              stream, q, pool, items, tables, n_heads, scale, stats, L, aligned);
    return cudaGetLastError();
}

cudaError_t kern_attention(float *out, const float *q, kern_kv_pool_t pool,
                           const kern_kv_item_t *items, int n_items, int rows, int max_keys,
                           const int *tables, int n_heads, float scale, int any_mass,
                           float *scratch, cudaStream_t stream) {
    const int head_dim = pool.head_dim;
    if (rows <= 0 || n_items <= 0 || head_dim <= 0)
        return cudaSuccess;
    if (head_dim > ATTN_MAX_HEAD_DIM || max_keys <= 0)
        return cudaErrorInvalidValue;
    switch (pool.dtype) {
    case KERN_BF16:
        return attention_of<KERN_BF16>(out, q, pool, items, n_items, rows, max_keys, tables,
                                       n_heads, scale, any_mass, scratch, stream);
    case KERN_F16:
        return attention_of<KERN_F16>(out, q, pool, items, n_items, rows, max_keys, tables, n_heads,
                                      scale, any_mass, scratch, stream);
    case KERN_F8_E4M3:
        return attention_of<KERN_F8_E4M3>(out, q, pool, items, n_items, rows, max_keys, tables,
                                          n_heads, scale, any_mass, scratch, stream);
    default:
        return attention_of<KERN_F32>(out, q, pool, items, n_items, rows, max_keys, tables, n_heads,
                                      scale, any_mass, scratch, stream);
    }
}

/* ---- attention of next-scale models -------------------------------------------- */

size_t kern_attention_scale_scratch(int rows) { return (size_t)rows * 2; }

/* The score of key j of a scale item: a cached key (j < len, through the
 * block table, widened) or the sequence's new key j - len (fp32 rows of
 * k_new). */
static __device__ __forceinline__ float scale_score(const float *qs, const kern_kv_pool_t &p,
                                                    const int *table, const kern_kv_item_t &it,
                                                    const float *k_new, int n_heads, int j) {
    if (j < it.len)
        return dot_row(qs, k_row(p, table, j), p.dtype, p.head_dim, it.k_scale);
    return dot_f32(qs, k_new + ((size_t)(it.q_row + j - it.len) * n_heads + it.head) * p.head_dim,
                   p.head_dim);
}

/* Element d of key j's value, as scale_score finds the key. */
static __device__ __forceinline__ float scale_value(const kern_kv_pool_t &p, const int *table,
                                                    const kern_kv_item_t &it, const float *v_new,
                                                    int n_heads, int j, int d) {
    if (j < it.len)
        return ld_kv(k_row(p, table, j) + v_offset(p), p.dtype, d, it.v_scale);
    return v_new[((size_t)(it.q_row + j - it.len) * n_heads + it.head) * p.head_dim + d];
}

/* One warp per query row over all len + n_new keys, in tiles of 32 as
 * attn_split_kernel scores them (lane l scores key tile + l; every lane then
 * adds the tile's weighted V rows for its own dimensions), without splits:
 * a scale's rows are many and its keys a few thousand at most, so the rows
 * alone fill the GPU. Keeps each row's final max and sum for the mass. */
__global__ void attn_scale_kernel(float *out, float *stats, const float *q, const float *k_new,
                                  const float *v_new, kern_kv_pool_t p, const kern_kv_item_t *items,
                                  int n_items, const int *tables, int n_heads, float scale) {
    AR_DYNAMIC_SHARED(float, qs);
    __shared__ float ps[32];
    const int r = blockIdx.x, lane = threadIdx.x, hd = p.head_dim;
    const kern_kv_item_t it = items[item_of(items, n_items, r)];
    const int t = it.t0 + (r - it.row_off), n_keys = it.len + it.n_new;
    const int *table = tables + it.table;
    const size_t at = ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
    for (int d = lane; d < hd; d += 32)
        qs[d] = q[at + d];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[ATTN_ACC];
    for (int i = 0; i < ATTN_ACC; i++)
        acc[i] = 0.0f;
    for (int tile = 0; tile < n_keys; tile += 32) {
        const int j = tile + lane;
        const float s =
            j < n_keys ? scale_score(qs, p, table, it, k_new, n_heads, j) * scale : -INFINITY;
        float pr; /* key `tile` exists: a finite score */
        const float rescale = softmax_round(s, j < n_keys, true, m, l, &pr);
        ps[lane] = pr;
        __syncthreads();
        for (int i = 0; i < ATTN_ACC; i++)
            acc[i] *= rescale;
        const int nt = min(32, n_keys - tile);
        for (int jj = 0; jj < nt; jj++) {
            const float pj = ps[jj];
            for (int i = 0; i < ATTN_ACC && lane + 32 * i < hd; i++)
                acc[i] += pj * scale_value(p, table, it, v_new, n_heads, tile + jj, lane + 32 * i);
        }
        __syncthreads(); /* ps is rewritten by the next tile */
    }
    const float inv = 1.0f / l;
    for (int i = 0; i < ATTN_ACC && lane + 32 * i < hd; i++)
        out[at + lane + 32 * i] = acc[i] * inv;
    if (lane == 0) {
        stats[2 * (size_t)r] = m;
        stats[2 * (size_t)r + 1] = l;
    }
}

/* Head dims up to this take the tiled kernel (its K and V tiles fit the
 * default 48 KiB of shared memory); larger ones the per-row kernel. */
#define SCALE_TILE_MAX_HEAD_DIM 128
/* Query rows of a tile (a warp each) and keys of a K/V tile (a lane each). */
#define SCALE_TILE_ROWS 8
#define SCALE_TILE_KEYS 32

static size_t scale_tile_smem(int hd) {
    return ((size_t)SCALE_TILE_KEYS * (2 * (size_t)hd + 1) + (size_t)SCALE_TILE_ROWS * hd +
            (size_t)SCALE_TILE_ROWS * SCALE_TILE_KEYS) *
           sizeof(float);
}

/* attn_scale_kernel's arithmetic for SCALE_TILE_ROWS rows of an item at
 * once (block (item, tile): its rows t0 + tile * 8 + warp), each key and
 * value row read once per tile instead of once per query row: the block
 * loads a tile of 32 keys' K and V rows into shared memory, widened to
 * fp32, in coalesced reads (consecutive threads, consecutive elements of
 * a row), then each warp scores and accumulates its row against the tile
 * exactly as the per-row kernel does (lane l: key l, the dot product in
 * element order; V in key order), so the two kernels give the same bits.
 * K rows are padded to hd + 1 floats: lane l's reads of row l fall in
 * distinct banks. */
__global__ void attn_scale_tiled_kernel(float *out, float *stats, const float *q,
                                        const float *k_new, const float *v_new, kern_kv_pool_t p,
                                        const kern_kv_item_t *items, const int *tables, int n_heads,
                                        float scale) {
    AR_DYNAMIC_SHARED(float, smem);
    const int hd = p.head_dim, kst = hd + 1;
    float *ks = smem, *vs = ks + SCALE_TILE_KEYS * kst, *qs = vs + SCALE_TILE_KEYS * hd;
    float *ps = qs + SCALE_TILE_ROWS * hd;
    const kern_kv_item_t it = items[blockIdx.x];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int first = blockIdx.y * SCALE_TILE_ROWS;
    if (first >= it.n_rows)
        return; /* the whole block: an item with fewer tiles */
    const int t = it.t0 + first + warp, n_keys = it.len + it.n_new;
    const bool active = first + warp < it.n_rows;
    const int *table = tables + it.table;
    const size_t at = ((size_t)(it.q_row + t) * n_heads + it.head) * hd;
    float *qw = qs + warp * hd, *pw = ps + warp * SCALE_TILE_KEYS;
    if (active)
        for (int d = lane; d < hd; d += 32)
            qw[d] = q[at + d];
    float m = -INFINITY, l = 0.0f, acc[SCALE_TILE_MAX_HEAD_DIM / 32];
    for (int i = 0; i < SCALE_TILE_MAX_HEAD_DIM / 32; i++)
        acc[i] = 0.0f;
    for (int tile = 0; tile < n_keys; tile += SCALE_TILE_KEYS) {
        const int nt = min(SCALE_TILE_KEYS, n_keys - tile);
        __syncthreads(); /* the previous tile has been used */
        for (int e = threadIdx.x; e < nt * hd; e += blockDim.x) {
            const int kk = e / hd, d = e % hd, j = tile + kk;
            float kv, vv;
            if (j < it.len) {
                const char *kr = k_row(p, table, j);
                kv = ld_kv(kr, p.dtype, d, it.k_scale);
                vv = ld_kv(kr + v_offset(p), p.dtype, d, it.v_scale);
            } else {
                const size_t nr = ((size_t)(it.q_row + j - it.len) * n_heads + it.head) * hd;
                kv = k_new[nr + d];
                vv = v_new[nr + d];
            }
            ks[kk * kst + d] = kv;
            vs[kk * hd + d] = vv;
        }
        __syncthreads();
        if (!active)
            continue;
        float sc = -INFINITY;
        if (lane < nt) {
            const float *kr = ks + lane * kst;
            float dot = 0.0f;
            for (int d = 0; d < hd; d++)
                dot += qw[d] * kr[d];
            sc = dot * scale;
        }
        float pr; /* key `tile` exists: a finite score */
        const float rescale = softmax_round(sc, lane < nt, true, m, l, &pr);
        pw[lane] = pr;
        __syncwarp();
        for (int i = 0; i < SCALE_TILE_MAX_HEAD_DIM / 32; i++)
            acc[i] *= rescale;
        for (int jj = 0; jj < nt; jj++) {
            const float pj = pw[jj];
            for (int i = 0; i < SCALE_TILE_MAX_HEAD_DIM / 32 && lane + 32 * i < hd; i++)
                acc[i] += pj * vs[jj * hd + lane + 32 * i];
        }
        __syncwarp(); /* pw is rewritten by the next tile */
    }
    if (!active)
        return;
    const float inv = 1.0f / l;
    for (int i = 0; i < SCALE_TILE_MAX_HEAD_DIM / 32 && lane + 32 * i < hd; i++)
        out[at + lane + 32 * i] = acc[i] * inv;
    if (lane == 0) {
        const size_t r = (size_t)it.row_off + (size_t)(t - it.t0);
        stats[2 * r] = m;
        stats[2 * r + 1] = l;
    }
}

/* The second pass for key mass, as attn_mass_kernel: one thread per (item,
 * key j of len + n_new), the probability each of the item's rows gave key
 * j rescored with the same dot product and normalised with the row's
 * final max and sum, added to mass[j]. */
__global__ void attn_scale_mass_kernel(const float *q, const float *k_new, kern_kv_pool_t p,
                                       const kern_kv_item_t *items, const int *tables, int n_heads,
                                       float scale, const float *stats) {
    const kern_kv_item_t it = items[blockIdx.y];
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (!it.mass || j >= it.len + it.n_new)
        return;
    float add = 0.0f;
    for (int t = it.t0; t < it.t0 + it.n_rows; t++) {
        const size_t r = (size_t)it.row_off + (size_t)(t - it.t0);
        const float *qr = q + ((size_t)(it.q_row + t) * n_heads + it.head) * p.head_dim;
        const float s = scale_score(qr, p, tables + it.table, it, k_new, n_heads, j) * scale;
        add += expf(s - stats[2 * r]) / stats[2 * r + 1];
    }
    it.mass[j] += add;
}

cudaError_t kern_attention_scale(float *out, const float *q, const float *k_new, const float *v_new,
                                 kern_kv_pool_t pool, const kern_kv_item_t *items, int n_items,
                                 int rows, int max_keys, int max_item_rows, const int *tables,
                                 int n_heads, float scale, int any_mass, float *scratch,
                                 cudaStream_t stream) {
    const int head_dim = pool.head_dim;
    if (rows <= 0 || n_items <= 0 || head_dim <= 0)
        return cudaSuccess;
    if (head_dim > ATTN_MAX_HEAD_DIM || max_keys <= 0 || max_item_rows <= 0)
        return cudaErrorInvalidValue;
    if (head_dim <= SCALE_TILE_MAX_HEAD_DIM)
        AR_LAUNCH(attn_scale_tiled_kernel,
                  dim3((unsigned)n_items,
                       (unsigned)((max_item_rows + SCALE_TILE_ROWS - 1) / SCALE_TILE_ROWS)),
                  32 * SCALE_TILE_ROWS, scale_tile_smem(head_dim), stream, out, scratch, q, k_new,
                  v_new, pool, items, tables, n_heads, scale);
    else
        AR_LAUNCH(attn_scale_kernel, rows, 32, (size_t)head_dim * sizeof(float), stream, out,
                  scratch, q, k_new, v_new, pool, items, n_items, tables, n_heads, scale);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess || !any_mass)
        return e;
    AR_LAUNCH(attn_scale_mass_kernel,
              dim3((unsigned)((max_keys + AR_BLOCK - 1) / AR_BLOCK), (unsigned)n_items), AR_BLOCK,
              0, stream, q, k_new, pool, items, tables, n_heads, scale, scratch);
    return cudaGetLastError();
}

/* ---- dense attention ------------------------------------------------------------ */

/* One warp per (query row, head), as attn_scale_kernel: the sequence's
 * keys in tiles of 32, lane l scoring key tile + l (a whole strided K row;
 * plus its relative-position bias), the online softmax's max and sum by
 * shuffles, then every lane adds the tile's weighted V rows for its own
 * dimensions (d = lane + 32 i). The keys are few (a text of at most 512
 * tokens), so no splits. A sequence without keys gives zeros, as the CPU. */
__global__ void attn_dense_kernel(float *out, const float *q, const float *k, const float *v,
                                  int kv_stride, const int *q_start, const int *k_start, int n_seq,
                                  int n_heads, int hd, float scale, const float *bias,
                                  int bias_span) {
    AR_DYNAMIC_SHARED(float, qs);
    __shared__ float ps[32];
    const int lane = threadIdx.x, h = blockIdx.y;
    const int r = q_start[0] + (int)blockIdx.x, s = seq_of(q_start, n_seq, r);
    const int i = r - q_start[s], n_keys = k_start[s + 1] - k_start[s];
    const size_t at = ((size_t)r * n_heads + h) * hd;
    const size_t kv0 = (size_t)k_start[s] * kv_stride + (size_t)h * hd;
    /* Key j's bias is bs[j]: (j - i) + span - 1 into the head's table. */
    const float *bs = bias ? bias + (size_t)h * (2 * bias_span - 1) + (bias_span - 1 - i) : NULL;
    for (int d = lane; d < hd; d += 32)
        qs[d] = q[at + d];
    __syncthreads();
    float m = -INFINITY, l = 0.0f, acc[ATTN_ACC];
    for (int a = 0; a < ATTN_ACC; a++)
        acc[a] = 0.0f;
    for (int tile = 0; tile < n_keys; tile += 32) {
        const int j = tile + lane;
        float sc = -INFINITY;
        if (j < n_keys) {
            sc = dot_f32(qs, k + kv0 + (size_t)j * kv_stride, hd) * scale;
            if (bs)
                sc += bs[j];
        }
        float pr; /* key `tile` exists: a finite score */
        const float rescale = softmax_round(sc, j < n_keys, true, m, l, &pr);
        ps[lane] = pr;
        __syncthreads();
        for (int a = 0; a < ATTN_ACC; a++)
            acc[a] *= rescale;
        const int nt = min(32, n_keys - tile);
        for (int jj = 0; jj < nt; jj++) {
            const float pj = ps[jj], *vr = v + kv0 + (size_t)(tile + jj) * kv_stride;
            for (int a = 0; a < ATTN_ACC && lane + 32 * a < hd; a++)
                acc[a] += pj * vr[lane + 32 * a];
        }
        __syncthreads(); /* ps is rewritten by the next tile */
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    for (int a = 0; a < ATTN_ACC && lane + 32 * a < hd; a++)
        out[at + lane + 32 * a] = acc[a] * inv;
}

cudaError_t kern_attention_dense(float *out, const float *q, const float *k, const float *v,
                                 int kv_stride, const int *q_start, const int *k_start, int n_seq,
                                 int rows, int n_heads, int head_dim, float scale,
                                 const float *bias, int bias_span, cudaStream_t stream) {
    if (rows <= 0 || n_seq <= 0 || n_heads <= 0 || head_dim <= 0)
        return cudaSuccess;
    if (head_dim > ATTN_MAX_HEAD_DIM)
        return cudaErrorInvalidValue;
    AR_LAUNCH(attn_dense_kernel, dim3((unsigned)rows, (unsigned)n_heads), 32,
              (size_t)head_dim * sizeof(float), stream, out, q, k, v, kv_stride, q_start, k_start,
              n_seq, n_heads, head_dim, scale, bias, bias_span);
    return cudaGetLastError();
}

/* ---- reading rows --------------------------------------------------------------- */

/* One block per token: cache index j0 + i's K row (V row with values),
 * widened, to out row i. */
__global__ void kv_read_rows_kernel(float *out, kern_kv_pool_t p, const int *table, int j0,
                                    int values, float scale) {
    const int i = blockIdx.x;
    const char *r = k_row(p, table, j0 + i) + (values ? v_offset(p) : 0);
    for (int d = threadIdx.x; d < p.head_dim; d += blockDim.x)
        out[(size_t)i * p.head_dim + d] = ld_kv(r, p.dtype, d, scale);
}

cudaError_t kern_kv_read_rows(float *out, kern_kv_pool_t pool, const int *table, int j0, int n,
                              int values, float scale, cudaStream_t stream) {
    if (n <= 0 || pool.head_dim <= 0)
        return cudaSuccess;
    AR_LAUNCH(kv_read_rows_kernel, n, block_for((size_t)pool.head_dim), 0, stream, out, pool, table,
              j0, values, scale);
    return cudaGetLastError();
}

/* ---- compaction ------------------------------------------------------------------- */

/* Rows keep[i] (and mass[keep[i]]) into scratch row i, as stored (bytes:
 * the pool's type goes through unchanged) ... */
__global__ void kv_gather_read_kernel(float *scratch, kern_kv_pool_t p, const int *table,
                                      const int *keep, int n, const float *mass) {
    const int i = blockIdx.x;
    const size_t row = (size_t)p.head_dim * kv_esize(p.dtype);
    const char *kr = k_row(p, table, keep[i]), *vr = kr + v_offset(p);
    char *dst = (char *)scratch + (size_t)i * 2 * row;
    for (size_t d = threadIdx.x; d < row; d += blockDim.x) {
        dst[d] = kr[d];
        dst[row + d] = vr[d];
    }
    if (mass && threadIdx.x == 0)
        scratch[(size_t)n * 2 * p.head_dim + i] = mass[keep[i]];
}

/* ... then back to cache indices i0 + i, once every read is done (a
 * second launch on the same stream). */
__global__ void kv_gather_write_kernel(kern_kv_pool_t p, const int *table, int i0, int n,
                                       const float *scratch, float *mass) {
    const int i = blockIdx.x;
    const size_t row = (size_t)p.head_dim * kv_esize(p.dtype);
    char *kr = k_row(p, table, i0 + i), *vr = kr + v_offset(p);
    const char *src = (const char *)scratch + (size_t)i * 2 * row;
    for (size_t d = threadIdx.x; d < row; d += blockDim.x) {
        kr[d] = src[d];
        vr[d] = src[row + d];
    }
    if (mass && threadIdx.x == 0)
        mass[i0 + i] = scratch[(size_t)n * 2 * p.head_dim + i];
}

cudaError_t kern_kv_gather(kern_kv_pool_t pool, const int *table, const int *keep, int i0, int n,
                           float *mass, float *scratch, cudaStream_t stream) {
    if (n <= 0 || pool.head_dim <= 0)
        return cudaSuccess;
    const unsigned threads = block_for((size_t)pool.head_dim);
    AR_LAUNCH(kv_gather_read_kernel, n, threads, 0, stream, scratch, pool, table, keep, n, mass);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess)
        return e;
    AR_LAUNCH(kv_gather_write_kernel, n, threads, 0, stream, pool, table, i0, n, scratch, mass);
    return cudaGetLastError();
}
