/* Launchers of arserve's CUDA kernels (kernels/ *.cu), callable from C: the
 * CUDA backend (engine/backend/backend_cuda.c) calls these and cuBLAS, nothing else.
 *
 * Contract: each launcher queues its kernel(s) on `stream` and returns the
 * launch error (cudaGetLastError() right after each launch), cudaSuccess
 * when all went in. Empty work (a zero size) launches nothing. Pointers are
 * device memory unless a parameter says host; `dtype` arguments are the
 * storage types of weights kept as loaded (kern_dtype_t). Shapes follow
 * engine/backend/backend.h; the caller checks them. Nothing here includes a header
 * of the engine: the kernels stand alone. */
#ifndef ARSERVE_KERNELS_H
#define ARSERVE_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime_api.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Storage types as the kernels read them: fp32, IEEE fp16 and bfloat16
 * (weights and the KV cache), fp8 e4m3 (the KV cache and 8-bit Linear
 * weights: 448 the largest finite value, 0x7f NaN, saturating stores) and
 * int8 (8-bit Linear weights only). The codes are the engine's dtype_t's
 * (base/dtype.h), so the CUDA backend passes a type through unchanged (it
 * checks that at compile time). */
typedef enum kern_dtype {
    KERN_F32 = 0,
    KERN_F16 = 1,
    KERN_BF16 = 2,
    KERN_F8_E4M3 = 6,
    KERN_I8 = 7
} kern_dtype_t;

/* Kernels this host thread has started since it began (kernels/cuda/
 * elementwise.cu keeps the count): a launcher's count of kernels is the
 * difference around its call. */
unsigned long long kern_kernels_started(void);

/* ---- norms and softmax (kernels/cuda/norm.cu) ---- */

/* y[r, :] = x[r, :] * rsqrt(mean(x[r, :]^2) + eps) * w[:]; y may be x.
 * y16, when not NULL, gets y rounded to bf16 too (the next GEMM's input in
 * 16-bit activations, without a cast of its own). */
cudaError_t kern_rmsnorm(float *y, void *y16, const float *x, const void *w, kern_dtype_t w_dtype,
                         int rows, int dim, float eps, cudaStream_t stream);

/* LayerNorm without affine: y[r, :] = (x[r, :] - mean) / sqrt(var + eps),
 * the biased variance; y may be x. */
cudaError_t kern_layernorm(float *y, const float *x, int rows, int dim, float eps,
                           cudaStream_t stream);

/* Each head (rows of n_heads * head_dim) of x in place divided by
 * max(its L2 norm, 1e-12), then times mul[h] when mul (n_heads floats) is
 * not NULL. */
cudaError_t kern_l2norm_heads(float *x, const float *mul, int rows, int n_heads, int head_dim,
                              cudaStream_t stream);

/* Row-wise softmax in place over cols; a row of only -inf becomes NaN. */
cudaError_t kern_softmax(float *x, int rows, int cols, cudaStream_t stream);

/* Doubles of scratch kern_groupnorm needs for these sizes. */
size_t kern_groupnorm_scratch(int c, int hw, int groups);
/* GroupNorm of (c, hw) in `groups` groups with affine gamma/beta [c], then
 * SiLU where silu; out may be in; scratch holds kern_groupnorm_scratch(c,
 * hw, groups) doubles. */
cudaError_t kern_groupnorm(float *out, const float *in, const void *gamma, const void *beta,
                           kern_dtype_t affine_dtype, int c, int hw, int groups, float eps,
                           int silu, double *scratch, cudaStream_t stream);

/* ---- rotary embeddings (kernels/cuda/rope.cu) ---- */

/* Rotate-half RoPE in place at positions pos[r] (device, rows ints). */
cudaError_t kern_rope(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                      cudaStream_t stream);
/* LlamaGen's 2D RoPE in place: pos holds (grid row, grid column) per row
 * (device, 2 * rows ints); see backend.h's rope_2d. */
cudaError_t kern_rope_2d(float *x, const int *pos, int rows, int n_heads, int head_dim, float theta,
                         cudaStream_t stream);

/* ---- element-wise (kernels/cuda/elementwise.cu) ---- */

cudaError_t kern_silu(float *x, size_t n, cudaStream_t stream);
/* out = silu(gate) * up; out16, when not NULL, gets out rounded to bf16 too. */
cudaError_t kern_silu_mul(float *out, void *out16, const float *gate, const float *up, size_t n,
                          cudaStream_t stream);
cudaError_t kern_gelu(float *x, size_t n, cudaStream_t stream);      /* exact erf form */
cudaError_t kern_gelu_tanh(float *x, size_t n, cudaStream_t stream); /* tanh approximation */
cudaError_t kern_add(float *y, const float *a, size_t n, cudaStream_t stream); /* y += a */
cudaError_t kern_mul(float *y, const float *a, size_t n, cudaStream_t stream); /* y *= a */
cudaError_t kern_scale(float *x, size_t n, float s, cudaStream_t stream);      /* x *= s */

/* AdaLN: y[r, j] = x[r, j] * (1 + scale[j]) + shift[j]; y may be x. */
cudaError_t kern_modulate(float *y, const float *x, const float *scale, const float *shift,
                          int rows, int dim, cudaStream_t stream);
/* AdaLN over a ragged batch of rows rows (q_start[0] = 0, q_start[n_seq] =
 * rows), one launch for every sequence: row r belongs to sequence s with
 * q_start[s] <= r < q_start[s + 1] (device, n_seq + 1 ints) and reads its
 * table tabs[s] (device, n_seq device pointers). gate 0: y[r, j] =
 * x[r, j] * (1 + tabs[s][a + j]) + tabs[s][b + j] (y may be x); gate 1:
 * y[r, j] += x[r, j] * tabs[s][a + j]. The same arithmetic as
 * kern_modulate and kern_gate_add. */
cudaError_t kern_adaln_seqs(float *y, const float *x, const int *q_start, const float *const *tabs,
                            int n_seq, int rows, size_t a, size_t b, int dim, int gate,
                            cudaStream_t stream);
/* Gated residual: y[r, j] += a[r, j] * gate[j]. */
cudaError_t kern_gate_add(float *y, const float *a, const float *gate, int rows, int dim,
                          cudaStream_t stream);

/* y[r, j] = bias[per_row ? r : j] for a rows x cols y; zeros when bias is
 * NULL. */
cudaError_t kern_fill_bias(float *y, const void *bias, kern_dtype_t bias_dtype, int64_t rows,
                           int64_t cols, int per_row, cudaStream_t stream);

/* Splits fp32 x into two 16-bit values of type dtype (F16 or BF16) with
 * hi = round(x) and lo = round(x - hi), so hi + lo carries about 16 bits of
 * x's 24-bit significand: GEMMs on both halves with fp32 accumulation give
 * nearly fp32 products from tensor cores. n elements each. lo may be NULL:
 * x rounded to dtype into hi alone (16-bit activations). */
cudaError_t kern_split_16(void *hi, void *lo, kern_dtype_t dtype, const float *x, size_t n,
                          cudaStream_t stream);

/* The two half-products of a split GEMM summed, for each of `groups`
 * matrices g: y[g][r, j] = a[r, j] + b[r, j] (+ bias[g * cols + j] when
 * bias is not NULL), where a is prod's rows x cols block at
 * g * 2 * rows * cols and b the block after it; y's groups are
 * y_group_stride floats apart. accumulate: y[g][r, j] += that sum instead
 * (rounded as the sum, then the add). */
cudaError_t kern_add_pair_bias(float *y, size_t y_group_stride, const float *prod, const void *bias,
                               kern_dtype_t bias_dtype, int groups, int rows, int cols,
                               int accumulate, cudaStream_t stream);

/* ---- 8-bit Linear weights (kernels/cuda/weight8.cu) ---- */

/* An 8-bit weight's values (dtype I8 or F8_E4M3) as bf16, exactly (no
 * scale): groups blocks of per_group elements, block g read from src +
 * g * src_group_stride elements and written to dst + g * per_group (a
 * slice of rows of each matrix of a stack, packed for a batched GEMM).
 * dst 16-byte aligned (cudaErrorInvalidValue otherwise). */
cudaError_t kern_widen_8bit(void *dst, const void *src, kern_dtype_t dtype, int groups,
                            size_t per_group, size_t src_group_stride, cudaStream_t stream);

/* The GEMM of an 8-bit weight's values into y, for each of `groups`
 * matrices g and rows x cols products: y[g][r, j] = p[r, j] * scale[g *
 * sb_group_stride + j] (+ bias[g * sb_group_stride + j] when bias is not
 * NULL), where p is prod's rows x cols block at g * rows * cols, or with
 * pair the sum of the two blocks at g * 2 * rows * cols (a split GEMM's
 * half-products, as kern_add_pair_bias). y's rows are ldy floats apart and
 * its groups y_group_stride; accumulate: y[g][r, j] += that value. */
cudaError_t kern_scale_cols(float *y, size_t y_group_stride, int64_t ldy, const float *prod,
                            int pair, const float *scale, const void *bias, kern_dtype_t bias_dtype,
                            size_t sb_group_stride, int groups, int rows, int cols, int accumulate,
                            cudaStream_t stream);

/* ---- lookups (kernels/cuda/embedding.cu) ---- */

/* out[i, :] = table[ids[i], :] (ids on the device, already checked against
 * the vocabulary), optionally divided by max(L2 norm, 1e-12). */
cudaError_t kern_embedding(float *out, const void *table, kern_dtype_t table_dtype, int dim,
                           const int *ids, int n, int l2_normalize, cudaStream_t stream);

/* ---- images (kernels/cuda/image.cu) ---- */

/* The im2col panel of output pixels [p0, p0 + np) of a stride-1 k x k
 * convolution with zero padding pad: row r = (ci*k + ky)*k + kx, column
 * p - p0, np columns. dtype F32 writes floats to hi (lo unused); F16/BF16
 * write the kern_split_16 halves to hi and lo. */
cudaError_t kern_im2col(void *hi, void *lo, kern_dtype_t dtype, const float *in, int c_in, int h,
                        int w, int k, int pad, int wo, int64_t p0, int np, cudaStream_t stream);
cudaError_t kern_upsample_nearest2x(float *out, const float *in, int c, int h, int w,
                                    cudaStream_t stream);
/* (c, h, w) -> (c, H, W) as F.interpolate: bicubic with align_corners=False
 * (A = -0.75, borders clamped), and area (adaptive average pooling). out
 * must not be in. */
cudaError_t kern_resize_bicubic(float *out, const float *in, int c, int h, int w, int H, int W,
                                cudaStream_t stream);
cudaError_t kern_resize_area(float *out, const float *in, int c, int h, int w, int H, int W,
                             cudaStream_t stream);
/* out[j, i] = in[i, j] for a rows x cols in; out must not be in. */
cudaError_t kern_transpose(float *out, const float *in, int rows, int cols, cudaStream_t stream);

/* ---- paged KV cache (kernels/cuda/attention.cu) ---- */

/* One (sequence, head) pair's share of a paged-KV launch, built on the host
 * from backend.h's views and staged to the device with the block tables:
 * query/new rows t0 .. t0 + n_rows - 1 of the pair's n_new (0-based within
 * the sequence), which sit at rows q_row + t of q, out, k and v. Cache
 * index j of the pair is block tables[table + j / block_tokens], row
 * j % block_tokens. row_off is the number of rows of the earlier items of
 * the launch (a prefix sum: launches run one block per row). */
typedef struct kern_kv_item {
    float *mass;            /* device, len floats to accumulate key mass into, or NULL */
    float k_scale, v_scale; /* an fp8 element of K (V) stands for element x scale */
    int table;              /* offset of the block table in the staged ints */
    int len;                /* tokens held, the n_new newest included */
    int n_new;              /* the sequence's new rows this step */
    int t0, n_rows;
    int q_row; /* q_start of the sequence */
    int head;
    int row_off;
} kern_kv_item_t;

/* The paged pool (engine/backend/backend.h's kv_blocks_t): blocks of block_tokens
 * K rows then block_tokens V rows of head_dim elements of type dtype. */
typedef struct kern_kv_pool {
    void *base;
    int dtype; /* kern_dtype_t */
    int block_tokens, head_dim;
} kern_kv_pool_t;

/* Keys one block of the split attention kernel scores (flash-decoding's
 * split size): a query row with n keys runs ceil(n / KERN_ATTN_SPLIT_KEYS)
 * blocks, merged by a combine kernel. */
#define KERN_ATTN_SPLIT_KEYS 64

/* Floats of scratch kern_attention needs for rows query rows of at most
 * max_keys keys each, head_dim wide. */
size_t kern_attention_scratch(int rows, int max_keys, int head_dim);

/* Writes k and v rows (n_heads * head_dim per row) of each item's rows into
 * its cache at indices len - n_new + t. items and tables are device memory
 * (the staging area); rows is the sum of the items' n_rows. */
cudaError_t kern_kv_append(kern_kv_pool_t pool, const kern_kv_item_t *items, int n_items, int rows,
                           const int *tables, const float *k, const float *v, int n_heads,
                           cudaStream_t stream);

/* Causal attention of each item's query rows over its paged cache (row t
 * sees cache indices [0, len - n_new + t]): split over keys, one block per
 * (row, split), then a combine kernel; with any_mass, a third kernel adds
 * the exact softmax probabilities to the items' mass arrays (those not
 * NULL). max_keys bounds len over the items; scratch holds
 * kern_attention_scratch(rows, max_keys, head_dim) floats. head_dim is at
 * most 512. */
cudaError_t kern_attention(float *out, const float *q, kern_kv_pool_t pool,
                           const kern_kv_item_t *items, int n_items, int rows, int max_keys,
                           const int *tables, int n_heads, float scale, int any_mass,
                           float *scratch, cudaStream_t stream);

/* Floats of scratch kern_attention_scale needs for rows query rows. */
size_t kern_attention_scale_scratch(int rows);

/* Attention of next-scale models: each item's query rows attend, with no
 * mask, to all len keys of its cache (here len counts the cached keys
 * only) and then to all n_new new keys of its
 * sequence, rows q_row .. q_row + n_new - 1 of k_new and v_new (n_heads *
 * head_dim per row, not in the cache). Head dims to 128: blocks of 8 query
 * rows of an item that read each K and V row once (max_item_rows bounds
 * n_rows over the items); larger ones a block per query row; with
 * any_mass, a second kernel adds the exact probabilities of the len + n_new
 * keys to the items' mass arrays (those not NULL). max_keys bounds len +
 * n_new over the items; scratch holds kern_attention_scale_scratch(rows)
 * floats. head_dim is at most 512. */
cudaError_t kern_attention_scale(float *out, const float *q, const float *k_new, const float *v_new,
                                 kern_kv_pool_t pool, const kern_kv_item_t *items, int n_items,
                                 int rows, int max_keys, int max_item_rows, const int *tables,
                                 int n_heads, float scale, int any_mass, float *scratch,
                                 cudaStream_t stream);

/* The K rows (values 0) or V rows (values 1) of cache indices [j0, j0 + n)
 * of one head (table: device), widened to fp32 (fp8 times scale), into out
 * (n rows of head_dim). */
cudaError_t kern_kv_read_rows(float *out, kern_kv_pool_t pool, const int *table, int j0, int n,
                              int values, float scale, cudaStream_t stream);

/* Compaction of cache indices [i0, i0 + n) of one head in place: index i
 * takes the K and V rows, as stored (and mass[i], when mass is not NULL) of
 * keep[i - i0], keep ascending with keep[i - i0] >= i. Through scratch (n *
 * (2 * head_dim + 1) floats, enough for any type): everything is read
 * before anything is written, so the copies may overlap. table and keep
 * are device memory. */
cudaError_t kern_kv_gather(kern_kv_pool_t pool, const int *table, const int *keep, int i0, int n,
                           float *mass, float *scratch, cudaStream_t stream);

/* ---- dense attention (kernels/cuda/attention.cu) ---- */

/* Dense attention (backend.h's attention_dense) of sequences [0, n_seq)
 * whose starts are staged on the device: q_start and k_start hold n_seq + 1
 * ascending row indices each (absolute rows of q/out and of k/v, so a
 * launch may cover any run of sequences), rows = q_start[n_seq] -
 * q_start[0]. K and V rows are kv_stride floats with head h at h *
 * head_dim; bias (n_heads * (2 * bias_span - 1) floats) or NULL. One block
 * per (query row, head); head_dim is at most 512. */
cudaError_t kern_attention_dense(float *out, const float *q, const float *k, const float *v,
                                 int kv_stride, const int *q_start, const int *k_start, int n_seq,
                                 int rows, int n_heads, int head_dim, float scale,
                                 const float *bias, int bias_span, cudaStream_t stream);

#ifdef __cplusplus
}
#endif

#endif
