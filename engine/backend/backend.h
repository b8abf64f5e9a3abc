/* The backend interface: every numeric op the engine runs, as a table of
 * function pointers over backend memory. The CPU backend (backend_cpu.c) is
 * the reference every other backend is tested against.
 *
 * Conventions: activations are fp32, row-major; "rows" are tokens. Buffers
 * passed to ops are backend memory (from ->alloc) unless a parameter says
 * "host". Ops do not fail: shapes are the caller's contract, checked with
 * asserts in debug and sanitizer builds (release builds define NDEBUG). Images are NCHW with N = 1
 * (C, H, W).
 *
 * A backend is driven by one thread at a time (like a CUDA stream): backends
 * keep scratch memory and handles that are not shared between callers.
 *
 * The KV cache is paged (docs/kv-cache.md): ops reach it through block
 * tables, which are host memory (a device backend copies the few ints it
 * needs); the blocks themselves are backend memory. */
#ifndef ARSERVE_BACKEND_H
#define ARSERVE_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"

/* How a weight is stored in backend memory: as loaded (row-major, its
 * shape's order), or in the backend's own layout for the one op that may
 * read it after weight_prepare: matmul's (a Linear weight) or conv2d's. */
typedef enum { LAYOUT_PLAIN = 0, LAYOUT_LINEAR, LAYOUT_CONV } tensor_layout_t;

/* A weight in backend memory. shape[0] is the output dimension for
 * matrices (PyTorch Linear layout: [out, in]); conv weights are
 * [C_out, C_in, kh, kw]. */
typedef struct tensor {
    void *data;
    dtype_t dtype; /* as stored in backend memory */
    int ndim;
    int64_t shape[4]; /* the logical shape, whatever the layout */
    tensor_layout_t layout;
    /* A second copy a backend keeps beside data (the CPU's bf16 Winograd
     * kernels under cpu_activations bf16), freed with it; NULL if none. */
    void *aux;
    /* An 8-bit Linear weight's (dtype DTYPE_I8 or DTYPE_F8_E4M3, from
     * weight_load_8bit): one fp32 scale per output row of each matrix of
     * the stack, element (g, n, k) standing for its value times the scale
     * of (g, n); backend memory, freed with data: as loaded (G * n floats,
     * the stack's matrices one after the other) while the layout is
     * LAYOUT_PLAIN, the backend's own once weight_prepare has changed it.
     * NULL for every other weight. */
    void *scale;
} tensor_t;

static inline int64_t tensor_numel(const tensor_t *t) {
    int64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= t->shape[i];
    return n;
}

/* The KV pool as the backend sees it (engine/kv/kv_pool.h owns the free list
 * and the block tables): one backend allocation cut into blocks of
 * block_tokens tokens of ONE (sequence, layer, head), every element stored
 * as dtype (f32, bf16, f16 or fp8 e4m3). Block b holds its K rows, then its
 * V rows: in elements, K row o of block b is at
 * base + b * 2 * block_tokens * head_dim + o * head_dim, V row o at the same
 * place + block_tokens * head_dim. Appends round each value to dtype;
 * attention widens them back and computes in fp32. */
typedef struct kv_blocks {
    void *base; /* backend memory */
    dtype_t dtype;
    int block_tokens;
    int head_dim;
} kv_blocks_t;

/* One (sequence, head) cache: cache index j lives in block
 * blocks[j / block_tokens], row j % block_tokens. Block ids need not be
 * contiguous or ordered. In an fp8 pool an element e of K stands for
 * e * k_scale (V: v_scale), scales append divides by (kv_head_view
 * gives them). Other types ignore them. */
typedef struct kv_view {
    const int *blocks; /* host: at least ceil(len / block_tokens) block ids */
    int len;           /* tokens held, the newest rows included */
    float k_scale, v_scale;
} kv_view_t;

/* Attention over per-head paged caches for a ragged batch of sequences.
 * Sequence s owns query rows [q_start[s], q_start[s+1]) of q; these are its
 * n_s newest tokens, already appended: for head h, kv[s*n_heads + h] holds
 * them at cache indices [len - n_s, len). Query row i (0-based within the
 * sequence's rows) attends causally to cache indices [0, len - n_s + i].
 *
 * Key mass (attention statistics for KV policies): when mass is not NULL
 * and mass[s*n_heads + h] is not NULL, that backend array of len floats is
 * ACCUMULATED into: mass[j] += sum over the sequence's query rows of the
 * softmax probability the row gave key j (the same probabilities that
 * weighted the values). Pairs whose pointer is NULL cost nothing extra. */
typedef struct attn_batch {
    int n_seq;
    const int *q_start;  /* host, n_seq + 1 */
    const kv_view_t *kv; /* host, n_seq * n_heads */
    float *const *mass;  /* NULL, or host array of n_seq * n_heads backend pointers (or NULL) */
} attn_batch_t;

/* What a device backend has done since it was created (->stats), for
 * benchmarks and the GPU run's report: how many launches and copies a
 * decode step costs, and how much of its reservation it ever used. */
typedef struct backend_stats {
    /* Kernel launches: every kernel launcher call and every cuBLAS call
     * issued (one cuBLAS call may run more than one kernel). */
    uint64_t launches;
    /* Kernels started: each launcher's own (attention's launcher starts a
     * split and a combine kernel), and one per cuBLAS call (whose own
     * kernels only the GPU knows). */
    uint64_t kernels;
    uint64_t h2d_copies, h2d_bytes; /* host to device (uploads and staged host arrays) */
    uint64_t d2h_copies, d2h_bytes; /* device to host (downloads) */
    uint64_t d2d_copies, d2d_bytes; /* device to device (->copy) */
    uint64_t syncs;                 /* waits for the stream to drain */
    /* Graphs (be->graphs): launched, instantiated, and updated in place of
     * an instantiation. */
    uint64_t graph_launches, graph_builds, graph_updates;
    size_t device_peak_bytes;     /* the most of its reservation in use at once */
    size_t device_reserved_bytes; /* the reservation */
} backend_stats_t;

typedef struct backend backend_t;

/* How a device backend multiplies fp32 activations by 16-bit weights:
 * rounded to the weight's type, fp32 accumulation (16BIT: bf16 for bf16
 * weights, as GPU servers and transformers in bf16 do; the default), or as
 * hi + lo halves of it, about 16 bits of each value kept at twice the GEMM
 * work (SPLIT: within rounding of the CPU, which keeps all 24). */
typedef enum { ACTIVATIONS_16BIT = 0, ACTIVATIONS_SPLIT } backend_activations_t;
/* Their setting names, in the enum's order, NULL-terminated: "bf16", "split". */
extern const char *const backend_activations_names[];

/* How the CPU backend multiplies activations by bf16 Linear weights: in
 * fp32 (F32, the default and the reference), or rounded to bf16 first as
 * PyTorch's bf16 autocast does (BF16: on AMX tiles where the CPU has them,
 * kernels/cpu/gemm_amx.h, else through the fp32 kernels), at 8 bits of
 * mantissa. Other weights' GEMMs are fp32 either way. */
typedef enum { CPU_ACTIVATIONS_F32 = 0, CPU_ACTIVATIONS_BF16 } backend_cpu_activations_t;
/* Their setting names, in the enum's order, NULL-terminated: "f32", "bf16". */
extern const char *const backend_cpu_activations_names[];

/* Whether a device backend captures each step (what it queues between two
 * waits for its stream) into a graph and launches that (ON, the default),
 * or launches each op's kernels as the op is called (OFF). The bytes are
 * the same either way. */
typedef enum { GRAPHS_ON = 0, GRAPHS_OFF } backend_graphs_t;
/* Their setting names, in the enum's order, NULL-terminated: "on", "off". */
extern const char *const backend_graphs_names[];

struct backend {
    const char *name;
    void *impl; /* backend private state */
    /* Not an op: how the engine drives this backend, set by whoever opened
     * it (serve's batch_invariant, --batch-invariant). When set, a ragged
     * batch's sequences (next-scale steps, seq_rows.h) each get a GEMM of
     * their own wherever matmul's rows are not independent of the batch
     * (a weight not in LAYOUT_LINEAR, as on CUDA), so an image's bytes do
     * not depend on what else is in its step; 0 (default): one GEMM over
     * every sequence's rows, the weights read once a step. */
    int batch_invariant;
    /* Not an op either, set the same way (serve's gpu_activations,
     * --gpu-activations): how a device backend feeds fp32 activations to
     * GEMMs with 16-bit weights. The CPU computes in fp32 whatever it says. */
    backend_activations_t activations;
    /* Set the same way (serve's cpu_activations, --cpu-activations): the CPU
     * backend's; device backends ignore it. */
    backend_cpu_activations_t cpu_activations;
    /* Set the same way (serve's gpu_graphs, --gpu-graphs); the CPU has no
     * graphs. */
    backend_graphs_t graphs;

    /* Memory. alloc returns NULL when out of memory; free accepts NULL. */
    void *(*alloc)(backend_t *be, size_t bytes);
    void (*free)(backend_t *be, void *p);
    void (*upload)(backend_t *be, void *dst, const void *host_src, size_t bytes);
    void (*download)(backend_t *be, void *host_dst, const void *src, size_t bytes);
    void (*copy)(backend_t *be, void *dst, const void *src, size_t bytes);
    /* Waits for queued work; a no-op on synchronous backends. */
    void (*sync)(backend_t *be);

    /* Copies a host weight of type `src_dtype` into backend memory in the
     * backend's preferred storage type. AR_ERR if out of memory. */
    int (*weight_load)(backend_t *be, tensor_t *out, const void *host_src, dtype_t src_dtype,
                       int ndim, const int64_t *shape, ar_error_t *err);
    /* An 8-bit Linear weight: host_src holds the [n, k] or [G, n, k]
     * elements of type src_dtype (DTYPE_I8 or DTYPE_F8_E4M3), host_scale
     * its G * n fp32 row scales (finite); element (g, n, k) stands for
     * element * host_scale[g * n + n]. Kept in 8 bits (tensor_t's scale):
     * the weight is matmul's only, so weight_prepare(LAYOUT_LINEAR) follows
     * on a backend that has one, and matmul dequantises as it reads. NULL
     * on a backend that cannot. AR_ERR if out of memory or not 8-bit. */
    int (*weight_load_8bit)(backend_t *be, tensor_t *out, const void *host_src, dtype_t src_dtype,
                            const float *host_scale, int ndim, const int64_t *shape,
                            ar_error_t *err);
    void (*weight_free)(backend_t *be, tensor_t *t);
    /* Optional (NULL: every op reads weights as loaded, as on CUDA). Says
     * that w is from now on only the weight of one op, `use`: LAYOUT_LINEAR
     * (matmul's w, a matrix or a stack of them) or LAYOUT_CONV (conv2d's
     * w), so that the backend may store it in the layout that op reads
     * fastest and set
     * w->layout = use, or leave it as it is. No other op may read it after.
     * The CPU stores Linear weights in gemm_packed.h's panels, and 3x3
     * kernels of CONV_WINOGRAD_MIN_CHANNELS or more channels as Winograd's
     * transformed kernels (kernels/cpu/conv_winograd.h). A backend that
     * sets LAYOUT_LINEAR keeps matmul's rows over w independent: each
     * row's bytes are the same whatever m (so a ragged batch's sequences
     * may share one call). AR_ERR if out of memory (w unchanged). */
    int (*weight_prepare)(backend_t *be, tensor_t *w, tensor_layout_t use, ar_error_t *err);

    /* y[m, n] = x[m, k] * w[n, k]^T (+ bias[n] when bias is not NULL), with
     * n = w->shape[0], k = w->shape[1].
     * A stacked weight (w->ndim 3, shape [G, n, k]: G Linears of one input
     * fused at load, as q, k and v) gives G outputs back to back in one
     * call: y + g*m*n = x * w[g]^T (+ bias[g], bias then of [G, n]), what
     * G matmuls over its matrices give (on the CPU, the same bytes). */
    void (*matmul)(backend_t *be, float *y, const float *x, const tensor_t *w, const tensor_t *bias,
                   int m);

    /* Optional (NULL: the engine runs matmul into a buffer, then add; see
     * backend_matmul_add). y[m, n] += x[m, k] * w[n, k]^T, each product
     * rounded before it is added (as matmul then add would), for a
     * residual: one op where there would be two. */
    void (*matmul_add)(backend_t *be, float *y, const float *x, const tensor_t *w, int m);

    /* y[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w[:], rows of dim. y may be x. */
    void (*rmsnorm)(backend_t *be, float *y, const float *x, const tensor_t *w, int rows, int dim,
                    float eps);

    /* Rotary embedding in place, rotate-half pairing (element j pairs with
     * j + head_dim/2) at position pos[r] (host) for each row r; a row holds
     * n_heads heads of head_dim. */
    void (*rope)(backend_t *be, float *x, const int *pos, int rows, int n_heads, int head_dim,
                 float theta);
    /* LlamaGen's 2D rotary embedding in place: pos holds (grid row, grid
     * column) per row (host, 2 * rows ints). Interleaved pairs (2j, 2j+1),
     * j < head_dim/2: the first head_dim/4 pairs turn with the grid row,
     * the rest with the column, pair j at frequency 1 / theta^(2f /
     * (head_dim/2)) with f = j mod head_dim/4. A negative grid row marks a
     * condition token: cos = sin = 0 there (LlamaGen's cache), so the row
     * becomes zero. head_dim is a multiple of 4. */
    void (*rope_2d)(backend_t *be, float *x, const int *pos, int rows, int n_heads, int head_dim,
                    float theta);

    /* Writes the new K and V rows of each sequence into its paged caches:
     * rows [q_start[s], q_start[s+1]) of k and v (n_heads * head_dim per
     * row) go, head h, to cache indices [len - n_s, len) of
     * kv[s*n_heads + h] (its blocks already reserved; len counts them). A
     * view whose blocks is NULL is skipped: that head does not cache them. */
    void (*kv_append)(backend_t *be, const kv_blocks_t *pool, const kv_view_t *kv, const float *k,
                      const float *v, const int *q_start, int n_seq, int n_heads);

    /* out[row, h*head_dim ...] = softmax(q k^T * scale) v per head, keys
     * and values read through the block tables; see attn_batch_t. */
    void (*attention)(backend_t *be, float *out, const float *q, const kv_blocks_t *pool,
                      const attn_batch_t *batch, int n_heads, float scale);

    /* Attention of next-scale models, where a step feeds a whole scale:
     * sequence s's query rows [q_start[s], q_start[s+1]) attend to all
     * kv[s*n_heads + h].len keys of its cache (earlier scales) AND to all of
     * its own n_s new keys, whose K and V are rows [q_start[s], q_start[s+1])
     * of k_new and v_new (n_heads * head_dim per row, not in the cache): a
     * scale sees every earlier scale and the whole of itself. Key mass, when
     * asked for, covers len + n_s keys (the cache's, then the new ones). */
    void (*attention_scale)(backend_t *be, float *out, const float *q, const float *k_new,
                            const float *v_new, const kv_blocks_t *pool, const attn_batch_t *batch,
                            int n_heads, float scale);

    /* Dense attention of sequences over keys of their own (not cached,
     * not causal): sequence s's query rows [q_start[s], q_start[s+1]) of q
     * (n_heads * head_dim per row) attend to its key rows [k_start[s],
     * k_start[s+1]) of k and v, rows of kv_stride floats with head h at
     * h * head_dim. Scores are q.k * scale, plus, when bias is not NULL,
     * bias[h * (2 * bias_span - 1) + (j - i) + bias_span - 1] for query row
     * i and key row j of the sequence (both 0-based; |j - i| < bias_span):
     * T5's relative position bias. Infinity's cross-attention to the text,
     * its attentive pool and the T5 encoder run on it. */
    void (*attention_dense)(backend_t *be, float *out, const float *q, const float *k,
                            const float *v, int kv_stride, const int *q_start, const int *k_start,
                            int n_seq, int n_heads, int head_dim, float scale, const float *bias,
                            int bias_span);

    /* Compaction of one (sequence, layer, head) cache in place: cache index
     * i takes the K and V rows (and mass[i] the value, when mass is not
     * NULL) of index keep[i], for i < n_keep. keep is host memory, strictly
     * ascending (so keep[i] >= i and a forward copy never overwrites a row
     * still to be read). Rows past n_keep are left as they were. */
    void (*kv_gather)(backend_t *be, const kv_blocks_t *pool, const int *blocks, const int *keep,
                      int n_keep, float *mass);

    /* The K rows (values 0) or V rows (values 1) of cache indices
     * [j0, j0 + n) of one (sequence, head) cache, widened to fp32 (fp8
     * times the view's k_scale or v_scale): out is n rows of head_dim
     * floats. */
    void (*kv_read_rows)(backend_t *be, float *out, const kv_blocks_t *pool, const kv_view_t *view,
                         int j0, int n, int values);

    /* LayerNorm without affine parameters: y[r, :] = (x[r, :] - mean) /
     * sqrt(var + eps), the biased variance, rows of dim. y may be x. */
    void (*layernorm)(backend_t *be, float *y, const float *x, int rows, int dim, float eps);
    /* AdaLN modulation: y[r, :] = x[r, :] * (1 + scale[:]) + shift[:] for
     * rows of dim; scale and shift are dim floats (backend). y may be x. */
    void (*modulate)(backend_t *be, float *y, const float *x, const float *scale,
                     const float *shift, int rows, int dim);
    /* Gated residual: y[r, :] += a[r, :] * gate[:], rows of dim. */
    void (*gate_add)(backend_t *be, float *y, const float *a, const float *gate, int rows, int dim);
    /* Optional (NULL: the engine calls modulate and gate_add once a
     * sequence, seq_rows.h). The two over a ragged batch in one op:
     * sequence s's rows [q_start[s], q_start[s + 1]) (host, n_seq + 1 ints)
     * take their scale, shift and gate from its own table tabs[s] (host
     * array of n_seq backend pointers) at offsets sc, sh and g. */
    void (*modulate_seqs)(backend_t *be, float *y, const float *x, const int *q_start,
                          const float *const *tabs, int n_seq, size_t sc, size_t sh, int dim);
    void (*gate_add_seqs)(backend_t *be, float *y, const float *a, const int *q_start,
                          const float *const *tabs, int n_seq, size_t g, int dim);
    /* Each head of each row (rows of n_heads * head_dim) divided by its L2
     * norm (max(norm, 1e-12), as torch's F.normalize), then multiplied by
     * mul[h] when mul (n_heads floats, backend) is not NULL. In place. */
    void (*l2norm_heads)(backend_t *be, float *x, const float *mul, int rows, int n_heads,
                         int head_dim);

    /* Element-wise. */
    void (*silu_mul)(backend_t *be, float *out, const float *gate, const float *up, size_t n);
    void (*silu)(backend_t *be, float *x, size_t n);
    void (*gelu)(backend_t *be, float *x, size_t n);                /* exact erf form */
    void (*gelu_tanh)(backend_t *be, float *x, size_t n);           /* tanh approximation */
    void (*add)(backend_t *be, float *y, const float *a, size_t n); /* y += a */
    void (*mul)(backend_t *be, float *y, const float *a, size_t n); /* y *= a */
    void (*scale)(backend_t *be, float *x, size_t n, float s);      /* x *= s */
    /* Row-wise softmax in place over cols, rows of x. */
    void (*softmax)(backend_t *be, float *x, int rows, int cols);

    /* out[i, :] = table[ids[i], :] (ids on the host), optionally divided by
     * its L2 norm (max(norm, 1e-12)). table is [vocab, dim]. */
    void (*embedding)(backend_t *be, float *out, const tensor_t *table, const int *ids, int n,
                      int l2_normalize);

    /* 2D convolution, stride 1, zero padding pad, weight [C_out, C_in, k, k],
     * bias [C_out] or NULL; in is (C_in, H, W), out (C_out, H + 2pad - k + 1, ...). */
    void (*conv2d)(backend_t *be, float *out, const float *in, const tensor_t *w,
                   const tensor_t *bias, int c_in, int h, int w_, int pad);
    /* GroupNorm over (C, HW) with affine gamma/beta [C]; out may be in.
     * With silu, SiLU of the result (as the silu op gives it) in the same
     * pass: the decoder's norms are followed by one but for attention's. */
    void (*groupnorm)(backend_t *be, float *out, const float *in, const tensor_t *gamma,
                      const tensor_t *beta, int c, int hw, int groups, float eps, int silu);
    /* Nearest-neighbour 2x upsampling: (C, H, W) -> (C, 2H, 2W). */
    void (*upsample_nearest2x)(backend_t *be, float *out, const float *in, int c, int h, int w);
    /* Resampling (C, h, w) -> (C, H, W) as torch's F.interpolate:
     * bicubic with align_corners=False (A = -0.75, source indices clamped
     * at the borders, no antialiasing), and area (adaptive average pooling:
     * output cell i averages input rows floor(i*h/H) .. ceil((i+1)*h/H) - 1,
     * and likewise columns). */
    void (*resize_bicubic)(backend_t *be, float *out, const float *in, int c, int h, int w, int H,
                           int W);
    void (*resize_area)(backend_t *be, float *out, const float *in, int c, int h, int w, int H,
                        int W);
    /* out[j, i] = in[i, j] for an in of rows x cols (used to move between
     * channel-major images and token rows). */
    void (*transpose)(backend_t *be, float *out, const float *in, int rows, int cols);

    /* Optional (NULL: the backend's ops cannot fail, as on the CPU). Ops
     * return nothing, so a backend whose calls can fail (CUDA: a launch, a
     * cuBLAS call, an op it does not implement) keeps the first failure,
     * as a CUDA context does, and reports it here: AR_OK, or AR_ERR with
     * that message in err. Later ops still run. The engine checks it after
     * sync, once per step; see backend_status(). */
    int (*status)(backend_t *be, ar_error_t *err);

    /* Optional (NULL: never, as on the CPU). NULL while the backend can
     * still run a step; once it cannot, why, from then on for as long as
     * it lives. A backend whose failures are sticky (CUDA: a faulted
     * context fails every later call, and ->status keeps the first failure,
     * so every later step fails) answers with its first failure. Called
     * from the thread driving the backend, like an op; the string stays
     * valid until destroy, and a caller that shows it to other threads
     * copies it. See backend_unusable(). */
    const char *(*unusable)(backend_t *be);

    /* A sibling for another thread: the same device and memory, so
     * weights loaded through either serve both, with its own scratch,
     * stream and handles, and n_threads threads (0: as many as this one).
     * The two may run ops at the same time from two threads. The fork
     * allocates at most bytes itself (a device backend carves them, with
     * its scratch, from this one's memory at once); what it allocates, it
     * frees. Make it while no other thread uses be, and destroy it before
     * be. NULL with err set when it cannot be made. */
    backend_t *(*fork)(backend_t *be, size_t bytes, int n_threads, ar_error_t *err);

    /* Optional (NULL: no counters, as on the CPU, which launches and
     * copies nothing). The counters since creation into out; a fork
     * counts its own. Counting is a few increments per call, always on.
     * See backend_stats(). */
    void (*stats)(backend_t *be, backend_stats_t *out);

    void (*destroy)(backend_t *be);
};

/* be->stats into out where the backend has counters (1), else out zeroed (0). */
static inline int backend_stats(backend_t *be, backend_stats_t *out) {
    *out = (backend_stats_t){0};
    if (!be->stats)
        return 0;
    be->stats(be, out);
    return 1;
}

/* Adds the counts from before to after (launches, kernels, copies, bytes,
 * syncs; not the memory figures) into sum. */
void backend_stats_add(backend_stats_t *sum, const backend_stats_t *after,
                       const backend_stats_t *before);
/* sum's counts per step over steps steps, in words ("280.0 launches (304.0
 * kernels), 50.0 host->device and ..."), into buf; returns buf. One
 * wording for every tool that prints them. */
const char *backend_stats_per_step(const backend_stats_t *sum, double steps, char *buf, size_t cap);

/* y += x w^T over m rows: be->matmul_add where the backend has it, else
 * matmul into tmp (m * n floats of backend memory) and add. */
static inline void backend_matmul_add(backend_t *be, float *y, const float *x, const tensor_t *w,
                                      int m, float *tmp) {
    if (be->matmul_add) {
        be->matmul_add(be, y, x, w, m);
        return;
    }
    be->matmul(be, tmp, x, w, NULL, m);
    be->add(be, y, tmp, (size_t)m * (size_t)w->shape[w->ndim - 2]);
}

/* be->status where the backend has one, AR_OK otherwise. */
static inline int backend_status(backend_t *be, ar_error_t *err) {
    return be->status ? be->status(be, err) : AR_OK;
}

/* be->unusable where the backend has one, NULL (usable) otherwise. */
static inline const char *backend_unusable(backend_t *be) {
    return be->unusable ? be->unusable(be) : NULL;
}

/* Checks a weight every backend can load: a float dtype, 1 to 4
 * non-negative dimensions whose fp32 size fits in memory, data present when
 * it has elements. Sets *numel; the message names the backend. */
int backend_check_weight(const char *backend, const void *host_src, dtype_t dtype, int ndim,
                         const int64_t *shape, int64_t *numel, ar_error_t *err);

/* The same for weight_load_8bit's: an 8-bit type, 2 or 3 dimensions, and
 * a finite scale for each of the *rows rows (shape[0], or G * n). */
int backend_check_weight_8bit(const char *backend, const void *host_src, dtype_t dtype,
                              const float *host_scale, int ndim, const int64_t *shape,
                              int64_t *numel, int64_t *rows, ar_error_t *err);

/* Creates the CPU backend with n_threads worker threads (0: all cores). */
backend_t *backend_cpu_create(int n_threads, ar_error_t *err);

/* The name with which backend_open chooses: a GPU backend when this binary
 * has it and a GPU is present, else cpu. */
#define BACKEND_AUTO "auto"
/* The names backend_open takes, NULL-terminated: BACKEND_AUTO, then every
 * backend arserve has, built into this binary or not (the config's
 * choices). engine/backend/backend_open.c is the only list of them. */
extern const char *const backend_names[];
/* "cpu, cuda": the backends (built_in_only: those this binary has), in
 * backend_names' order, into buf (cap bytes); returns buf. */
const char *backend_list(int built_in_only, char *buf, size_t cap);
/* What BACKEND_AUTO chooses, in words ("cuda when built in and a GPU is
 * present, else cpu"), into buf; returns buf. */
const char *backend_auto_rule(char *buf, size_t cap);

/* The backend called name (one of backend_names); threads is the CPU
 * backend's thread count (0: all cores). NULL with a message in err when
 * the name is unknown, names a backend this binary was built without (the
 * message says how to build it in), or the backend cannot start. */
backend_t *backend_open(const char *name, int threads, ar_error_t *err);

/* Creates the CUDA backend on device `device` (builds with CUDA=1 only).
 * It reserves reserve_bytes of device memory at once (0: the free memory
 * less a margin for the CUDA context) and carves weights, buffers and its
 * own scratch from that reservation, so nothing is allocated on the device
 * after start-up and ->alloc fails only when the reservation is full.
 * NULL with a message in err (naming what was asked and what is free) when
 * the device or the memory is not there. */
backend_t *backend_cuda_create(int device, size_t reserve_bytes, ar_error_t *err);

/* CUDA devices present (builds with CUDA=1 only); 0 when there are none or
 * the driver cannot say. */
int backend_cuda_device_count(void);

#endif
