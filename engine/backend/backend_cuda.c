/* The CUDA backend: GEMMs through cuBLAS, every other op a kernel from
 * kernels/, all queued in order on one stream. C, like the rest of the
 * engine; only kernels/ is C++. Built with CUDA=1 against the CUDA toolkit,
 * and in tests against the CPU emulator (tests/cuda_emu), which runs the
 * same code without a GPU.
 *
 * Memory: one cudaMalloc at creation (the reservation), cut up by a
 * first-fit arena for weights, buffers, the KV pool and this backend's
 * scratch, so nothing is allocated on the device after start-up.
 *
 * Errors: ops return nothing, so every CUDA and cuBLAS call goes through
 * CUDA_CHECK / CUBLAS_CHECK, which keep the first failure (statement, file,
 * line, CUDA's message) for ->status and print it once; kernel launchers
 * return the launch's cudaGetLastError(), checked the same way. A kernel
 * that faults on a GPU does so after its launch returned, so the failure
 * surfaces at a later call, in a later op: ARSERVE_CUDA_CHECK=1 in the
 * environment at creation synchronises and checks after every op instead,
 * so that the op that faulted is the one named (checked_ops below).
 *
 * Steps as graphs (be->graphs, on by default): the first op after a wait
 * for the stream begins a stream capture, so the step's launches, cuBLAS
 * calls and device copies are recorded, not run; the host arrays ops take
 * are written into the step's staging (a pinned host area whose pieces
 * kernels read at the same offsets of a device area). The next wait (a
 * download, ->sync) ends the capture, copies the staging in one upload and
 * launches the graph: a step costs one upload, one graph launch, one
 * download and one wait. A step's graph updates an instantiated graph of
 * the same number of nodes (cudaGraphExecUpdate, cheaper than
 * instantiating), so replays need no per-step instantiation. Off (and with
 * ARSERVE_CUDA_CHECK=1): every op runs as it is issued and each staged
 * piece is copied as it is staged.
 *
 * Counters (->stats): launches, kernels, copies and syncs are counted where
 * they are issued (LAUNCH_CHECK, gemm_batched, copy_async, stream_wait),
 * graphs where they are launched (step_submit), the memory high-water mark
 * by the arena. */
#include "engine/backend/backend.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cublas_v2.h>
#include <cuda_runtime_api.h>

#include "kernels/cuda/kernels.h"

/* A weight's or the cache's storage type as the kernels take it: the same codes. */
_Static_assert((int)KERN_F32 == (int)DTYPE_F32 && (int)KERN_F16 == (int)DTYPE_F16 &&
                   (int)KERN_BF16 == (int)DTYPE_BF16 && (int)KERN_F8_E4M3 == (int)DTYPE_F8_E4M3 &&
                   (int)KERN_I8 == (int)DTYPE_I8,
               "kern_dtype_t and dtype_t must share their codes");
static kern_dtype_t kern_type(dtype_t t) { return (kern_dtype_t)t; }

/* Scratch for the GEMM operands (16-bit activation halves, im2col panels,
 * the two half-products) and GroupNorm's statistics; large ops run in
 * slices that fit. 64 MiB holds a 4096-wide decode batch of 1600 rows. */
#define SCRATCH_BYTES ((size_t)64 << 20)
/* cuBLAS's workspace, given to it so that it never allocates: 32 MiB is
 * what NVIDIA recommends for Hopper. */
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
/* The step's staging (host and device, STEP_STAGING_BYTES each), which
 * the host arrays that ops take (positions, ids, block tables) are written
 * into; one op stages at most STAGING_INTS ints at once, and an op with
 * more goes in pieces. */
#define STEP_STAGING_BYTES ((size_t)8 << 20)
#define STAGING_INTS ((size_t)1 << 16)
#define STAGE_ALIGN ((size_t)16)
/* Host ints staged again and again unchanged within a step
 * (stage_ints_kept) are staged once: RoPE's positions, and a ragged
 * batch's row starts and AdaLN tables, one slot a kind, up to KEPT_INTS. */
#define KEPT_INTS ((size_t)1 << 14)
enum { KEPT_POSITIONS, KEPT_SEQ_TABLES, KEPT_SLOTS };
/* Instantiated graphs kept for updates, one per node count seen lately. */
#define GRAPH_CACHE 8
/* Every arena allocation starts on this boundary (cudaMalloc's). */
#define ARENA_ALIGN ((size_t)256)
/* With reserve_bytes = 0, this much of the free memory (or 5%, if more)
 * stays free for the CUDA context, cuBLAS's own state and other processes. */
#define RESERVE_MARGIN ((size_t)512 << 20)

#define MIB(b) ((double)(b) / (1024.0 * 1024.0))
/* What a backend carves from its reservation for itself. */
#define OWN_BYTES (SCRATCH_BYTES + BLAS_WORKSPACE_BYTES + STEP_STAGING_BYTES + 3 * ARENA_ALIGN)

/* ---- the arena --------------------------------------------------------------- */

/* Blocks in address order, free ones coalesced with free neighbours. A
 * daemon makes a few thousand allocations (weights, buffers) at start-up and
 * few afterwards, so a linked list is enough. */
typedef struct arena_block {
    size_t off, size;
    int used;
    struct arena_block *prev, *next;
} arena_block_t;

typedef struct arena {
    char *base;
    size_t size, in_use;
    size_t peak; /* the most in_use has been */
    arena_block_t *head;
} arena_t;

static int arena_init(arena_t *a, void *base, size_t size) {
    a->base = base;
    a->size = size;
    a->in_use = a->peak = 0;
    a->head = calloc(1, sizeof *a->head);
    if (!a->head)
        return AR_ERR;
    a->head->size = size;
    return AR_OK;
}

static void arena_release(arena_t *a) {
    for (arena_block_t *b = a->head, *next; b; b = next) {
        next = b->next;
        free(b);
    }
    a->head = NULL;
}

/* NULL when no free block is large enough (or the host is out of memory). */
static void *arena_alloc(arena_t *a, size_t bytes) {
    if (bytes > SIZE_MAX - ARENA_ALIGN)
        return NULL;
    const size_t need = bytes ? (bytes + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1) : ARENA_ALIGN;
    for (arena_block_t *b = a->head; b; b = b->next) {
        if (b->used || b->size < need)
            continue;
        if (b->size > need) { /* split: the rest stays free */
            arena_block_t *rest = calloc(1, sizeof *rest);
            if (!rest)
                return NULL;
            rest->off = b->off + need;
            rest->size = b->size - need;
            rest->prev = b;
            rest->next = b->next;
            if (b->next)
                b->next->prev = rest;
            b->next = rest;
            b->size = need;
        }
        b->used = 1;
        a->in_use += b->size;
        if (a->in_use > a->peak)
            a->peak = a->in_use;
        return a->base + b->off;
    }
    return NULL;
}

static void arena_merge_next(arena_block_t *b) {
    arena_block_t *n = b->next;
    b->size += n->size;
    b->next = n->next;
    if (n->next)
        n->next->prev = b;
    free(n);
}

/* AR_ERR when p is not a live allocation of this arena. */
static int arena_free(arena_t *a, void *p) {
    if ((char *)p < a->base || (char *)p >= a->base + a->size)
        return AR_ERR;
    const size_t off = (size_t)((char *)p - a->base);
    for (arena_block_t *b = a->head; b; b = b->next) {
        if (b->off != off)
            continue;
        if (!b->used)
            return AR_ERR;
        b->used = 0;
        a->in_use -= b->size;
        if (b->next && !b->next->used)
            arena_merge_next(b);
        if (b->prev && !b->prev->used)
            arena_merge_next(b->prev);
        return AR_OK;
    }
    return AR_ERR;
}

/* ---- state and errors ---------------------------------------------------------- */

typedef struct cuda_impl {
    int device;
    char device_name[256];
    cudaStream_t stream;
    cublasHandle_t blas;
    void *reservation; /* the one cudaMalloc, or a fork's block of its parent's */
    backend_t *parent; /* a fork's: its reservation goes back to the parent's arena */
    arena_t arena;
    void *scratch; /* SCRATCH_BYTES */
    /* The step's staging: stage_host (pinned) and stage_dev, the first
     * stage_used bytes in use, the first stage_sent of them copied or
     * queued to be; stage_epoch counts the restarts (stage_reset). */
    char *stage_host, *stage_dev;
    size_t stage_used, stage_sent;
    unsigned stage_epoch;
    /* stage_ints_kept's slots: kept_n ints at kept_off of the staging,
     * valid in epoch kept_epoch; pack: a host array of KEPT_INTS that an
     * op assembles its kept ints in. */
    size_t kept_off[KEPT_SLOTS], kept_n[KEPT_SLOTS];
    unsigned kept_epoch[KEPT_SLOTS];
    int *pack;
    /* Whether the stream is capturing the step (be->graphs), and the
     * instantiated graphs that a step's graph updates; no_graphs: why
     * graphs do not work here (graphs_probe), "" where they do. */
    int capturing;
    char no_graphs[256];
    struct graph_slot {
        cudaGraphExec_t exec;
        size_t nodes;
        unsigned long long used; /* the graph launch that last used it */
    } graphs[GRAPH_CACHE];
    /* Host assembly areas of the KV ops (STAGING_INTS ints each): the
     * items and tables, and the tables and lists of the others. */
    char *kv_host;
    kern_kv_item_t *kv_items;
    int *kv_ints;
    unsigned n_errors; /* failures since creation; the first is kept */
    ar_error_t first_error;
    /* ARSERVE_CUDA_CHECK=1: the op table holds checked_ops' wrappers, and
     * op names the op running in one of them (NULL outside), which
     * cuda_fail puts in front of its message. */
    int check_ops;
    const char *op;
    /* Launches, copies and syncs since creation; the arena keeps the
     * memory figures (cuda_stats fills them in). */
    backend_stats_t counts;
    unsigned long long kernels_mark; /* kern_kernels_started before the launcher running now */
    /* Work queued on the stream since its last wait (a launch, a cuBLAS
     * call, a copy): ->sync with none has nothing to wait for. */
    int queued;
    /* 16-bit activations: the op just run (rmsnorm, silu_mul) also left
     * its output, rounded to bf16, in the scratch; x16_src and x16_n say
     * whose (its fp32 address and length), so that a matmul of a bf16
     * weight reading it next skips its cast. Every op clears them on entry
     * (use_device), so they never outlive the next op. */
    const float *x16_src;
    size_t x16_n;
} cuda_impl_t;

static cuda_impl_t *impl_of(const backend_t *be) { return (cuda_impl_t *)be->impl; }

static void cuda_fail(backend_t *be, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Failures printed before the rest are only counted: one device fault
 * makes every later call fail too. */
#define MAX_PRINTED_ERRORS 8

/* Records a failure of an op: the first is kept for ->status, the first few
 * are printed. */
static void cuda_fail(backend_t *be, const char *fmt, ...) {
    cuda_impl_t *impl = impl_of(be);
    const unsigned nth = ++impl->n_errors;
    if (nth > MAX_PRINTED_ERRORS)
        return;
    ar_error_t e;
    int used = impl->op ? snprintf(e.msg, sizeof e.msg, "in op %s: ", impl->op) : 0;
    used = used < 0 || (size_t)used >= sizeof e.msg ? 0 : used;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e.msg + used, sizeof e.msg - (size_t)used, fmt, ap);
    va_end(ap);
    if (nth == 1)
        impl->first_error = e;
    fprintf(stderr, "arserve: cuda backend: %s%s\n", e.msg,
            nth == MAX_PRINTED_ERRORS ? " (later errors are counted, not printed)" : "");
}

static int cuda_check(backend_t *be, cudaError_t e, const char *stmt, const char *file, int line) {
    if (e == cudaSuccess)
        return AR_OK;
    (void)cudaGetLastError(); /* consumed: the next launch check must not report it again */
    cuda_fail(be, "%s failed at %s:%d: %s (%s)", stmt, file, line, cudaGetErrorString(e),
              cudaGetErrorName(e));
    return AR_ERR;
}

static int cublas_check(backend_t *be, cublasStatus_t s, const char *stmt, const char *file,
                        int line) {
    if (s == CUBLAS_STATUS_SUCCESS)
        return AR_OK;
    cuda_fail(be, "%s failed at %s:%d: %s (%s)", stmt, file, line, cublasGetStatusString(s),
              cublasGetStatusName(s));
    return AR_ERR;
}

/* Every CUDA runtime call, kernel launcher and cuBLAS call in an op goes
 * through one of these; they return AR_OK or AR_ERR. */
#define CUDA_CHECK(be, stmt) cuda_check((be), (stmt), #stmt, __FILE__, __LINE__)
#define CUBLAS_CHECK(be, stmt) cublas_check((be), (stmt), #stmt, __FILE__, __LINE__)
/* A kernel launcher's call, counted as a launch and by the kernels it
 * started (->stats). */
#define LAUNCH_CHECK(be, stmt)                                                                     \
    (impl_of(be)->kernels_mark = kern_kernels_started(),                                           \
     launch_check((be), (stmt), #stmt, __LINE__))

static int launch_check(backend_t *be, cudaError_t e, const char *stmt, int line) {
    cuda_impl_t *impl = impl_of(be);
    impl->queued = 1;
    impl->counts.launches++;
    impl->counts.kernels += kern_kernels_started() - impl->kernels_mark;
    return cuda_check(be, e, stmt, __FILE__, line);
}

/* At creation the error goes straight to the caller's err. */
#define CUBLAS_TRY(err, stmt)                                                                      \
    do {                                                                                           \
        cublasStatus_t s_ = (stmt);                                                                \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                                         \
            ar_errorf((err), "cuda backend: %s failed at %s:%d: %s (%s)", #stmt, __FILE__,         \
                      __LINE__, cublasGetStatusString(s_), cublasGetStatusName(s_));               \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)
#define CUDA_TRY(err, stmt)                                                                        \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess) {                                                                   \
            ar_errorf((err), "cuda backend: %s failed at %s:%d: %s (%s)", #stmt, __FILE__,         \
                      __LINE__, cudaGetErrorString(e_), cudaGetErrorName(e_));                     \
            goto fail;                                                                             \
        }                                                                                          \
    } while (0)

static int cuda_status(backend_t *be, ar_error_t *err) {
    const cuda_impl_t *impl = impl_of(be);
    if (!impl->n_errors)
        return AR_OK;
    if (impl->n_errors == 1)
        return ar_errorf(err, "cuda backend: %s", impl->first_error.msg);
    return ar_errorf(err, "cuda backend: %s (and %u later errors)", impl->first_error.msg,
                     impl->n_errors - 1);
}

/* Every failure is sticky (->status reports the first for as long as the
 * backend lives, so every later step fails with it), as a faulted CUDA
 * context is: the first failure makes the backend unusable. */
static const char *cuda_unusable(backend_t *be) {
    const cuda_impl_t *impl = impl_of(be);
    return impl->n_errors ? impl->first_error.msg : NULL;
}

/* cudaSetDevice is per host thread, and the thread driving a backend may
 * change (the daemon's scheduler is not the thread that loaded the model),
 * so each op makes its device current; a thread-local cache keeps that to
 * a compare when nothing changed. */
static _Thread_local int tls_device = -1;

static int use_device(backend_t *be) {
    impl_of(be)->x16_src = NULL;
    const int d = impl_of(be)->device;
    if (tls_device == d)
        return AR_OK;
    if (CUDA_CHECK(be, cudaSetDevice(d)) != AR_OK)
        return AR_ERR;
    tls_device = d;
    return AR_OK;
}

/* ---- memory ---------------------------------------------------------------------- */

static void *cuda_alloc(backend_t *be, size_t bytes) {
    return arena_alloc(&impl_of(be)->arena, bytes);
}

static void cuda_free(backend_t *be, void *p) {
    if (p && arena_free(&impl_of(be)->arena, p) != AR_OK)
        cuda_fail(be, "free of %p, which is not a live allocation of this backend", p);
}

/* Every copy an op makes: queued on the stream, counted by direction. */
static int copy_async(backend_t *be, void *dst, const void *src, size_t bytes,
                      enum cudaMemcpyKind kind) {
    cuda_impl_t *impl = impl_of(be);
    backend_stats_t *c = &impl->counts;
    impl->queued = 1;
    if (kind == cudaMemcpyHostToDevice)
        c->h2d_copies++, c->h2d_bytes += bytes;
    else if (kind == cudaMemcpyDeviceToHost)
        c->d2h_copies++, c->d2h_bytes += bytes;
    else
        c->d2d_copies++, c->d2d_bytes += bytes;
    return CUDA_CHECK(be, cudaMemcpyAsync(dst, src, bytes, kind, impl->stream));
}

static void step_submit(backend_t *be);
static void stage_reset(cuda_impl_t *impl);

/* Every wait for the stream, counted; stmt and line name it in an error.
 * A step being captured is launched first; after the wait nothing queued
 * reads the staging, so it starts again. */
static int stream_wait(backend_t *be, const char *stmt, int line) {
    cuda_impl_t *impl = impl_of(be);
    step_submit(be);
    impl->counts.syncs++;
    impl->queued = 0;
    const int rc = cuda_check(be, cudaStreamSynchronize(impl->stream), stmt, __FILE__, line);
    stage_reset(impl);
    return rc;
}
#define STREAM_SYNC(be) stream_wait((be), "cudaStreamSynchronize", __LINE__)

static void *stage_reserve(backend_t *be, size_t bytes, char **host);

/* Returns once the host buffer may be reused. In a step being captured, a
 * small buffer goes with the step's staging (a device copy from there in
 * the graph); otherwise the copy is synchronised (uploads happen at load
 * time and for the odd host buffer, not per op). */
static void cuda_upload(backend_t *be, void *dst, const void *host_src, size_t bytes) {
    if (!bytes || use_device(be) != AR_OK)
        return;
    cuda_impl_t *impl = impl_of(be);
    if (impl->capturing && bytes <= STAGING_INTS * sizeof(int)) {
        char *h;
        const void *d = stage_reserve(be, bytes, &h);
        if (d) {
            memcpy(h, host_src, bytes);
            copy_async(be, dst, d, bytes, cudaMemcpyDeviceToDevice);
        }
        return;
    }
    if (impl->capturing && STREAM_SYNC(be) != AR_OK)
        return;
    if (copy_async(be, dst, host_src, bytes, cudaMemcpyHostToDevice) == AR_OK)
        STREAM_SYNC(be);
}

/* Launches the step being captured, waits for the queued work that
 * produces src, then for the copy. */
static void cuda_download(backend_t *be, void *host_dst, const void *src, size_t bytes) {
    if (!bytes || use_device(be) != AR_OK)
        return;
    step_submit(be);
    if (copy_async(be, host_dst, src, bytes, cudaMemcpyDeviceToHost) == AR_OK)
        STREAM_SYNC(be);
}

static int use_stream(backend_t *be);

static void cuda_copy(backend_t *be, void *dst, const void *src, size_t bytes) {
    if (!bytes || use_stream(be) != AR_OK)
        return;
    copy_async(be, dst, src, bytes, cudaMemcpyDeviceToDevice);
}

/* Nothing queued since the last wait: the stream is idle, and any failure
 * of its work was reported by that wait. */
static void cuda_sync(backend_t *be) {
    if (impl_of(be)->queued && use_device(be) == AR_OK)
        STREAM_SYNC(be);
}

/* ---- the step: staging, capture, graphs ------------------------------------------------ */

/* Begins capturing the step, where graphs are on and nothing failed. */
static int capture_begin(backend_t *be) {
    cuda_impl_t *impl = impl_of(be);
    if (impl->capturing || be->graphs != GRAPHS_ON || impl->check_ops || impl->n_errors ||
        impl->no_graphs[0])
        return AR_OK;
    /* relaxed: the thread driving a backend may change between two ops */
    if (CUDA_CHECK(be, cudaStreamBeginCapture(impl->stream, cudaStreamCaptureModeRelaxed)) != AR_OK)
        return AR_ERR;
    impl->capturing = 1;
    return AR_OK;
}

/* use_device for an op that queues work: the step's capture begins with it. */
static int use_stream(backend_t *be) {
    if (use_device(be) != AR_OK)
        return AR_ERR;
    return capture_begin(be);
}

static void stage_reset(cuda_impl_t *impl) {
    impl->stage_used = impl->stage_sent = 0;
    impl->stage_epoch++;
}

/* The instantiated graph to launch g with: one of the same node count
 * updated to g, else g instantiated in the least recently used slot; the
 * slot is marked used by the coming launch. */
static cudaGraphExec_t graph_exec_for(backend_t *be, cudaGraph_t g) {
    cuda_impl_t *impl = impl_of(be);
    size_t nodes = 0;
    if (CUDA_CHECK(be, cudaGraphGetNodes(g, NULL, &nodes)) != AR_OK)
        return NULL;
    struct graph_slot *lru = &impl->graphs[0];
    for (int i = 0; i < GRAPH_CACHE; i++) {
        struct graph_slot *sl = &impl->graphs[i];
        if (sl->exec && sl->nodes == nodes) {
            cudaGraphExecUpdateResultInfo info;
            if (cudaGraphExecUpdate(sl->exec, g, &info) == cudaSuccess) {
                impl->counts.graph_updates++;
                sl->used = impl->counts.graph_launches + 1;
                return sl->exec;
            }
            (void)cudaGetLastError(); /* a refused update is not a failure: instantiate */
            lru = sl;
            break;
        }
        if (!sl->exec || sl->used < lru->used)
            lru = sl;
    }
    if (lru->exec && CUDA_CHECK(be, cudaGraphExecDestroy(lru->exec)) != AR_OK)
        return NULL;
    lru->exec = NULL;
    if (CUDA_CHECK(be, cudaGraphInstantiate(&lru->exec, g, 0)) != AR_OK)
        return NULL;
    lru->nodes = nodes;
    lru->used = impl->counts.graph_launches + 1;
    impl->counts.graph_builds++;
    return lru->exec;
}

/* Ends the step's capture and launches it: the staging not yet sent in one
 * copy, then the graph. A step that failed while it was captured is not
 * launched (its failure is already recorded). */
static void step_submit(backend_t *be) {
    cuda_impl_t *impl = impl_of(be);
    if (!impl->capturing)
        return;
    impl->capturing = 0;
    const unsigned errors = impl->n_errors;
    cudaGraph_t g = NULL;
    if (CUDA_CHECK(be, cudaStreamEndCapture(impl->stream, &g)) != AR_OK || !g)
        return;
    cudaGraphExec_t exec = errors ? NULL : graph_exec_for(be, g);
    if (exec && impl->stage_used > impl->stage_sent &&
        copy_async(be, impl->stage_dev + impl->stage_sent, impl->stage_host + impl->stage_sent,
                   impl->stage_used - impl->stage_sent, cudaMemcpyHostToDevice) != AR_OK)
        exec = NULL;
    impl->stage_sent = impl->stage_used;
    if (exec && CUDA_CHECK(be, cudaGraphLaunch(exec, impl->stream)) == AR_OK) {
        impl->counts.graph_launches++;
        impl->queued = 1;
    }
    CUDA_CHECK(be, cudaGraphDestroy(g));
}

/* Room for bytes in the staging: the device address kernels will read
 * them at, and in *host where to write them now; NULL on failure. A full
 * staging first waits for the stream (launching a captured step, which
 * then goes on in a new capture). */
static void *stage_reserve(backend_t *be, size_t bytes, char **host) {
    cuda_impl_t *impl = impl_of(be);
    assert(bytes <= STEP_STAGING_BYTES);
    size_t off = (impl->stage_used + STAGE_ALIGN - 1) & ~(STAGE_ALIGN - 1);
    if (off + bytes > STEP_STAGING_BYTES) {
        const int was_capturing = impl->capturing;
        if (STREAM_SYNC(be) != AR_OK || (was_capturing && capture_begin(be) != AR_OK))
            return NULL;
        off = 0;
    }
    if (impl->stage_sent == impl->stage_used) /* nothing waits to be sent: skip the padding */
        impl->stage_sent = off;
    impl->stage_used = off + bytes;
    *host = impl->stage_host + off;
    return impl->stage_dev + off;
}

/* The pieces reserved since the last commit, written: outside a capture
 * copied now (the stream orders the copy before the kernels that read
 * it); in a capture they go with the step (step_submit). */
static int stage_commit(backend_t *be) {
    cuda_impl_t *impl = impl_of(be);
    if (impl->capturing || impl->stage_used == impl->stage_sent)
        return AR_OK;
    const size_t from = impl->stage_sent;
    impl->stage_sent = impl->stage_used;
    return copy_async(be, impl->stage_dev + from, impl->stage_host + from, impl->stage_used - from,
                      cudaMemcpyHostToDevice);
}

/* n host ints (n <= STAGING_INTS) staged: their device address, NULL on
 * failure. The caller's array may change at once. */
static const int *stage_ints(backend_t *be, const int *host, size_t n) {
    assert(n <= STAGING_INTS);
    char *h;
    const int *d = stage_reserve(be, n * sizeof(int), &h);
    if (!d)
        return NULL;
    memcpy(h, host, n * sizeof(int));
    return stage_commit(be) == AR_OK ? d : NULL;
}

/* stage_ints for host ints an op is given again and again unchanged (the
 * positions RoPE turns q and k by, the same in every layer of a step):
 * staged again only when they differ from what the slot staged last in
 * this epoch of the staging, so a step stages them once. */
static const int *stage_ints_kept(backend_t *be, int slot, const int *host, size_t n) {
    cuda_impl_t *impl = impl_of(be);
    if (n > KEPT_INTS)
        return stage_ints(be, host, n);
    if (n && impl->kept_epoch[slot] == impl->stage_epoch && impl->kept_n[slot] == n &&
        !memcmp(impl->stage_host + impl->kept_off[slot], host, n * sizeof(int)))
        return (const int *)(impl->stage_dev + impl->kept_off[slot]);
    const int *d = stage_ints(be, host, n);
    if (d) {
        impl->kept_epoch[slot] = impl->stage_epoch;
        impl->kept_off[slot] = (size_t)((const char *)d - impl->stage_dev);
        impl->kept_n[slot] = n;
    }
    return d;
}

/* ---- weights ---------------------------------------------------------------------- */

/* Weights stay in the type they were stored in: bf16/fp16 halve the memory
 * and the bandwidth of every decode GEMM (which is bandwidth-bound) and feed
 * the tensor cores directly; kernels widen small weights (norms, biases,
 * tables) as they read them. */
static int cuda_weight_load(backend_t *be, tensor_t *out, const void *host_src, dtype_t src_dtype,
                            int ndim, const int64_t *shape, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    int64_t numel;
    if (backend_check_weight("cuda", host_src, src_dtype, ndim, shape, &numel, err) != AR_OK)
        return AR_ERR;
    cuda_impl_t *impl = impl_of(be);
    const size_t bytes = (size_t)numel * dtype_size(src_dtype);
    void *data = arena_alloc(&impl->arena, bytes);
    if (!data)
        return ar_errorf(err,
                         "out of device memory for a weight of %lld elements (%.1f MiB): %.1f of "
                         "%.1f MiB reserved on device %d are in use",
                         (long long)numel, MIB(bytes), MIB(impl->arena.in_use),
                         MIB(impl->arena.size), impl->device);
    const unsigned before = impl->n_errors;
    cuda_upload(be, data, host_src, bytes);
    if (impl->n_errors != before) {
        arena_free(&impl->arena, data);
        return ar_errorf(err, "copying a weight to the device: %s", impl->first_error.msg);
    }
    out->data = data;
    out->dtype = src_dtype;
    out->ndim = ndim;
    for (int i = 0; i < 4; i++)
        out->shape[i] = i < ndim ? shape[i] : 1;
    return AR_OK;
}

/* An 8-bit Linear weight: its elements as they are (one byte each) and its
 * G * n row scales in fp32 beside them (out->scale); matmul widens the
 * elements to bf16 a slice at a time and scales the products (linear_8bit). */
static int cuda_weight_load_8bit(backend_t *be, tensor_t *out, const void *host_src,
                                 dtype_t src_dtype, const float *host_scale, int ndim,
                                 const int64_t *shape, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    int64_t numel, rows;
    if (backend_check_weight_8bit("cuda", host_src, src_dtype, host_scale, ndim, shape, &numel,
                                  &rows, err) != AR_OK)
        return AR_ERR;
    cuda_impl_t *impl = impl_of(be);
    const size_t bytes = (size_t)numel, scale_bytes = (size_t)rows * sizeof(float);
    void *data = arena_alloc(&impl->arena, bytes);
    void *scale = data ? arena_alloc(&impl->arena, scale_bytes) : NULL;
    if (!scale) {
        if (data)
            arena_free(&impl->arena, data);
        return ar_errorf(err,
                         "out of device memory for an 8-bit weight of %lld elements and %lld "
                         "scales (%.1f MiB): %.1f of %.1f MiB reserved on device %d are in use",
                         (long long)numel, (long long)rows, MIB(bytes + scale_bytes),
                         MIB(impl->arena.in_use), MIB(impl->arena.size), impl->device);
    }
    const unsigned before = impl->n_errors;
    cuda_upload(be, data, host_src, bytes);
    cuda_upload(be, scale, host_scale, scale_bytes);
    if (impl->n_errors != before) {
        arena_free(&impl->arena, data);
        arena_free(&impl->arena, scale);
        return ar_errorf(err, "copying an 8-bit weight to the device: %s", impl->first_error.msg);
    }
    out->data = data;
    out->scale = scale;
    out->dtype = src_dtype;
    out->ndim = ndim;
    for (int i = 0; i < 4; i++)
        out->shape[i] = i < ndim ? shape[i] : 1;
    return AR_OK;
}

static void cuda_weight_free(backend_t *be, tensor_t *t) {
    if (!t)
        return;
    cuda_free(be, t->data);
    cuda_free(be, t->scale);
    memset(t, 0, sizeof *t);
}

/* ---- GEMMs ---------------------------------------------------------------------------- */

static cudaDataType blas_type(dtype_t t) {
    return t == DTYPE_BF16 ? CUDA_R_16BF : t == DTYPE_F16 ? CUDA_R_16F : CUDA_R_32F;
}

/* Row-major C[M, N] = A[M, K] * B where B is [N, K] (b_trans, a Linear
 * weight) or [K, N], with beta 0 or 1, as a column-major cuBLAS call
 * (C^T = op(B) * A^T). A and B share type t; C is fp32; fp32 compute (no
 * TF32: fp32 operands stay fp32). With batch > 1, batch products in one
 * call: B and C step by stride_b and stride_c elements, A stays (the
 * matrices of a stacked Linear weight over one input). */
static int gemm_batched(backend_t *be, int M, int N, int K, const void *A, int lda, const void *B,
                        int ldb, int b_trans, dtype_t t, float beta, float *C, int ldc, int batch,
                        long long stride_b, long long stride_c) {
    const float one = 1.0f;
    impl_of(be)->counts.launches++;
    impl_of(be)->counts.kernels++;
    impl_of(be)->queued = 1;
    const cublasOperation_t tb = b_trans ? CUBLAS_OP_T : CUBLAS_OP_N;
    if (batch == 1)
        return CUBLAS_CHECK(be,
                            cublasGemmEx(impl_of(be)->blas, tb, CUBLAS_OP_N, N, M, K, &one, B,
                                         blas_type(t), ldb, A, blas_type(t), lda, &beta, C,
                                         CUDA_R_32F, ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    return CUBLAS_CHECK(be, cublasGemmStridedBatchedEx(
                                impl_of(be)->blas, tb, CUBLAS_OP_N, N, M, K, &one, B, blas_type(t),
                                ldb, stride_b, A, blas_type(t), lda, 0, &beta, C, CUDA_R_32F, ldc,
                                stride_c, batch, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

static int gemm_rowmajor(backend_t *be, int M, int N, int K, const void *A, int lda, const void *B,
                         int ldb, int b_trans, dtype_t t, float beta, float *C, int ldc) {
    return gemm_batched(be, M, N, K, A, lda, B, ldb, b_trans, t, beta, C, ldc, 1, 0, 0);
}

/* Bytes rounded up to the arena's alignment: where the next piece of the
 * scratch may start. */
static size_t scratch_align(size_t bytes) { return (bytes + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1); }

/* linear for an 8-bit weight (cuda_weight_load_8bit): y (+)= x w^T (+ bias)
 * where w's element (g, j, p) stands for its value times scale[g * n + j].
 *
 * cuBLAS multiplies no int8 or fp8 operand by fp32 activations, so the
 * weight's values are widened to bf16 in the scratch, exactly (int8 and
 * e4m3 fit bf16's 8 significant bits and its range), x goes in as for a
 * bf16 weight (rounded in 16-bit activations, or taken from the op before
 * (x16); hi + lo halves in split), one batched GEMM multiplies them into
 * fp32 products in the scratch, and kern_scale_cols writes each product
 * times its row's scale (+ bias) into y. Scaling the sum, as the CPU's
 * gemm_packed_scaled does, leaves the weight unrounded: split activations
 * stay within the CPU's bounds for a bf16 weight. Widened rows take at
 * most half the scratch (a larger weight goes in slices of its rows, every
 * matrix of a stack at once, each slice widened once), x and the products
 * the rest (more rows than fit go in slices of x's rows; x16 stays whole
 * where a row of products fits beside it). Where it all fits: a cast, a
 * widening, a GEMM and the scaling (three launches with x16), whatever the
 * stack.
 *
 * What it costs: a decode step, bandwidth-bound, reads the 8-bit weight,
 * writes and reads its bf16 copy (5 bytes an element where a bf16 weight
 * reads 2), so 8-bit weights save device memory, not time. A GEMM that
 * reads the 8 bits itself (an int8 kernel, or cuBLASLt's fp8 with per-row
 * scales on sm_89 and later) is the follow-up that would save time too;
 * neither runs under the emulator the tests use. */
static void linear_8bit(backend_t *be, float *y, const float *x, const void *x16, const tensor_t *w,
                        const tensor_t *bias, int m, int accumulate, int split) {
    cuda_impl_t *impl = impl_of(be);
    const int groups = w->ndim == 3 ? (int)w->shape[0] : 1;
    const int n = (int)w->shape[w->ndim - 2], k = (int)w->shape[w->ndim - 1];
    const kern_dtype_t b_type = kern_type(bias ? bias->dtype : DTYPE_F32);
    const char *b_data = bias ? bias->data : NULL;
    const size_t b_size = bias ? dtype_size(bias->dtype) : 0, y_group = (size_t)m * n;
    if (k == 0) { /* no products: y is the bias, or zeros (accumulate: nothing to add) */
        for (int g = 0; g < groups && !accumulate; g++)
            if (LAUNCH_CHECK(be, kern_fill_bias(y + g * y_group,
                                                b_data ? b_data + (size_t)g * n * b_size : NULL,
                                                b_type, m, n, 0, impl->stream)) != AR_OK)
                return;
        return;
    }
    if (groups == 0)
        return;
    const int halves = split ? 2 : 1;
    const size_t room = SCRATCH_BYTES - 2 * ARENA_ALIGN, half = room / 2;
    const size_t x_row = (size_t)k * 2 * halves;      /* one row of x in bf16 */
    const size_t w_row = (size_t)groups * k * 2;      /* one widened row of every matrix */
    const size_t p_col = (size_t)groups * 4 * halves; /* the products of an x row and a w row */
    /* weight rows a slice: within half the scratch, leaving room for one
     * row of x and its products in the other half */
    size_t nr = half > x_row ? (half - x_row) / p_col : 0;
    if (half / w_row < nr)
        nr = half / w_row;
    if (nr == 0) {
        cuda_fail(be,
                  "matmul: a row of k=%d of an 8-bit weight of %d matrices does not fit the "
                  "%.0f MiB scratch",
                  k, groups, MIB(SCRATCH_BYTES));
        return;
    }
    if (nr > (size_t)n)
        nr = (size_t)n;
    const size_t rest = room - nr * w_row;
    /* x16 stays where it is, if a row of products fits beside it */
    const size_t x_bf16 = (size_t)m * k * 2; /* x16's bytes, and those of x's hi half */
    if (x16 && (x_bf16 > rest || rest - x_bf16 < nr * p_col))
        x16 = NULL;
    const size_t fit = x16 ? (rest - x_bf16) / (nr * p_col) : rest / (x_row + nr * p_col);
    const int slice = fit >= (size_t)m ? m : (int)fit; /* at least 1, by nr */
    char *xs = impl->scratch; /* [slice, k] bf16 (split: hi rows, then lo rows) */
    char *wide = xs + scratch_align(x16 ? x_bf16 : (size_t)slice * x_row);
    float *prod = (float *)(wide + scratch_align(nr * w_row)); /* [groups][halves * rows, cols] */
    if (!x16 && slice == m &&
        LAUNCH_CHECK(be, kern_split_16(xs, split ? xs + x_bf16 : NULL, KERN_BF16, x, (size_t)m * k,
                                       impl->stream)) != AR_OK)
        return;
    const float *scale = w->scale;
    for (int j0 = 0; j0 < n; j0 += (int)nr) {
        const int cols = n - j0 < (int)nr ? n - j0 : (int)nr;
        if (LAUNCH_CHECK(be, kern_widen_8bit(wide, (const char *)w->data + (size_t)j0 * k,
                                             kern_type(w->dtype), groups, (size_t)cols * k,
                                             (size_t)n * k, impl->stream)) != AR_OK)
            return;
        for (int r0 = 0; r0 < m; r0 += slice) {
            const int rows = m - r0 < slice ? m - r0 : slice;
            const char *xa = x16 ? (const char *)x16 + (size_t)r0 * k * 2 : xs;
            if (!x16 && slice < m &&
                LAUNCH_CHECK(be, kern_split_16(xs, split ? xs + (size_t)rows * k * 2 : NULL,
                                               KERN_BF16, x + (size_t)r0 * k, (size_t)rows * k,
                                               impl->stream)) != AR_OK)
                return;
            if (gemm_batched(be, halves * rows, cols, k, xa, k, wide, k, 1, DTYPE_BF16, 0.0f, prod,
                             cols, groups, (long long)cols * k,
                             (long long)halves * rows * cols) != AR_OK)
                return;
            if (LAUNCH_CHECK(be, kern_scale_cols(y + (size_t)r0 * n + j0, y_group, n, prod, split,
                                                 scale + j0,
                                                 b_data ? b_data + (size_t)j0 * b_size : NULL,
                                                 b_type, (size_t)n, groups, rows, cols, accumulate,
                                                 impl->stream)) != AR_OK)
                return;
        }
    }
}

/* y (+)= x w^T (+ bias), the Linear of cuda_matmul and cuda_matmul_add
 * (accumulate: y += the product, no bias).
 *
 * 16-bit weights meet fp32 activations, and cuBLAS wants both operands of
 * one type. be->activations says how:
 * - ACTIVATIONS_16BIT (the default): x rounded to the weight's type (as
 *   every GPU server and transformers in bf16 multiply), one GEMM with
 *   fp32 accumulation straight into y: a cast and a GEMM.
 * - ACTIVATIONS_SPLIT: x split into hi + lo halves of the weight's type
 *   (kern_split_16), stacked as 2m rows of one GEMM, and the two
 *   half-products added: about 16 bits of x survive (the CPU reference
 *   keeps all 24), the weight is still read once (decode stays
 *   bandwidth-bound on it), and prefill pays twice the tensor-core work: a
 *   split, a GEMM and a sum. The end-to-end and golden checks against the
 *   CPU run in this mode.
 * Rows go in slices that fit the scratch. A stacked weight (backend.h)
 * costs what one matrix does in launches: its matrices in one batched GEMM. */
static void linear(backend_t *be, float *y, const float *x, const tensor_t *w, const tensor_t *bias,
                   int m, int accumulate) {
    assert((w->ndim == 2 || w->ndim == 3) && m >= 0 && !(accumulate && bias));
    const int64_t *d = w->shape + (w->ndim - 2);
    assert(d[0] <= INT32_MAX && d[1] <= INT32_MAX && (w->ndim == 2 || w->shape[0] <= INT32_MAX));
    const int groups = w->ndim == 3 ? (int)w->shape[0] : 1, n = (int)d[0], k = (int)d[1];
    assert(!bias || tensor_numel(bias) == (int64_t)groups * n);
    cuda_impl_t *impl = impl_of(be);
    const int split = w->dtype != DTYPE_F32 && be->activations == ACTIVATIONS_SPLIT;
    /* x already in bf16, left by the op before (x16_src) */
    const void *x16 = !split && (w->dtype == DTYPE_BF16 || dtype_is_weight8(w->dtype)) &&
                              impl->x16_src == x && impl->x16_n == (size_t)m * (size_t)k
                          ? impl->scratch
                          : NULL;
    if (m == 0 || n == 0 || use_stream(be) != AR_OK)
        return;
    if (dtype_is_weight8(w->dtype)) {
        linear_8bit(be, y, x, x16, w, bias, m, accumulate, split);
        return;
    }
    const void *b_data = bias ? bias->data : NULL;
    const kern_dtype_t b_type = kern_type(bias ? bias->dtype : DTYPE_F32);
    const size_t y_group = (size_t)m * n, b_group = bias ? (size_t)n * dtype_size(bias->dtype) : 0;
    /* The GEMM writes y itself except in split mode: a bias goes in first. */
    if (k == 0 || (!split && bias)) {
        for (int g = 0; g < groups && !accumulate; g++)
            if (LAUNCH_CHECK(be, kern_fill_bias(y + g * y_group, (const char *)b_data + g * b_group,
                                                b_type, m, n, 0, impl->stream)) != AR_OK)
                return;
        if (k == 0)
            return;
    }
    const float beta = bias || accumulate ? 1.0f : 0.0f;
    if (w->dtype == DTYPE_F32 || x16) {
        gemm_batched(be, m, n, k, x16 ? x16 : x, k, w->data, k, 1, w->dtype, beta, y, n, groups,
                     (long long)n * k, (long long)y_group);
        return;
    }
    /* per row: k 16-bit values of x (split: 2 of them, and 2 product rows of n floats a matrix) */
    const size_t row_bytes =
        split ? (size_t)k * 4 + (size_t)groups * n * 8 + 2 * ARENA_ALIGN : (size_t)k * 2;
    const size_t fit = (SCRATCH_BYTES - 2 * ARENA_ALIGN) / row_bytes;
    if (fit == 0) {
        cuda_fail(be, "matmul: a row of k=%d, n=%d x %d does not fit the %.0f MiB scratch", k,
                  groups, n, MIB(SCRATCH_BYTES));
        return;
    }
    const int slice = fit < (size_t)m ? (int)fit : m;
    for (int r0 = 0; r0 < m; r0 += slice) {
        const int rows = m - r0 < slice ? m - r0 : slice;
        char *halves = impl->scratch; /* [rows, k] (split: [2 * rows, k], hi rows then lo rows) */
        const float *xs = x + (size_t)r0 * k;
        if (!split) {
            if (LAUNCH_CHECK(be, kern_split_16(halves, NULL, kern_type(w->dtype), xs,
                                               (size_t)rows * k, impl->stream)) != AR_OK)
                return;
            if (gemm_batched(be, rows, n, k, halves, k, w->data, k, 1, w->dtype, beta,
                             y + (size_t)r0 * n, n, groups, (long long)n * k,
                             (long long)y_group) != AR_OK)
                return;
            continue;
        }
        const size_t half_bytes = (size_t)2 * rows * k * 2;
        /* [groups][2 * rows, n]: each matrix's hi products, then its lo ones */
        float *prod = (float *)(halves + ((half_bytes + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1)));
        if (LAUNCH_CHECK(be,
                         kern_split_16(halves, halves + (size_t)rows * k * 2, kern_type(w->dtype),
                                       xs, (size_t)rows * k, impl->stream)) != AR_OK)
            return;
        if (gemm_batched(be, 2 * rows, n, k, halves, k, w->data, k, 1, w->dtype, 0.0f, prod, n,
                         groups, (long long)n * k, (long long)2 * rows * n) != AR_OK)
            return;
        if (LAUNCH_CHECK(be, kern_add_pair_bias(y + (size_t)r0 * n, y_group, prod, b_data, b_type,
                                                groups, rows, n, accumulate, impl->stream)) !=
            AR_OK)
            return;
    }
}

static void cuda_matmul(backend_t *be, float *y, const float *x, const tensor_t *w,
                        const tensor_t *bias, int m) {
    linear(be, y, x, w, bias, m, 0);
}

static void cuda_matmul_add(backend_t *be, float *y, const float *x, const tensor_t *w, int m) {
    linear(be, y, x, w, NULL, m, 1);
}

/* ---- transformer ops ------------------------------------------------------------------ */

/* Where an op producing a matmul's input (rmsnorm, silu_mul) puts a bf16
 * copy of its n-float output: the scratch, in 16-bit activations when it
 * fits; else NULL. */
static void *x16_slot(backend_t *be, size_t n) {
    return be->activations == ACTIVATIONS_16BIT && n * 2 <= SCRATCH_BYTES ? impl_of(be)->scratch
                                                                          : NULL;
}

/* After the producing op's launch: y (n floats) has its bf16 copy. */
static void x16_made(backend_t *be, const float *y, size_t n, int launch_rc) {
    if (launch_rc == AR_OK) {
        impl_of(be)->x16_src = y;
        impl_of(be)->x16_n = n;
    }
}

static void cuda_rmsnorm(backend_t *be, float *y, const float *x, const tensor_t *w, int rows,
                         int dim, float eps) {
    assert(tensor_numel(w) == dim && rows >= 0 && dim > 0);
    if (use_stream(be) != AR_OK)
        return;
    const size_t n = (size_t)rows * dim;
    void *y16 = x16_slot(be, n);
    const int rc = LAUNCH_CHECK(be, kern_rmsnorm(y, y16, x, w->data, kern_type(w->dtype), rows, dim,
                                                 eps, impl_of(be)->stream));
    if (y16)
        x16_made(be, y, n, rc);
}

static void cuda_layernorm(backend_t *be, float *y, const float *x, int rows, int dim, float eps) {
    assert(rows >= 0 && dim > 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_layernorm(y, x, rows, dim, eps, impl_of(be)->stream));
}

static void cuda_modulate(backend_t *be, float *y, const float *x, const float *scale,
                          const float *shift, int rows, int dim) {
    assert(rows >= 0 && dim >= 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_modulate(y, x, scale, shift, rows, dim, impl_of(be)->stream));
}

static void cuda_gate_add(backend_t *be, float *y, const float *a, const float *gate, int rows,
                          int dim) {
    assert(rows >= 0 && dim >= 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_gate_add(y, a, gate, rows, dim, impl_of(be)->stream));
}

/* modulate_seqs (gate 0) and gate_add_seqs (gate 1): the row starts and
 * the tables' addresses packed into one kept upload (the same for every
 * call of a step, so copied once), one launch; sequence by sequence where
 * they do not fit. */
static void adaln_seqs(backend_t *be, float *y, const float *x, const int *q_start,
                       const float *const *tabs, int n_seq, size_t a, size_t b, int dim, int gate) {
    assert(n_seq >= 0 && dim >= 0);
    cuda_impl_t *impl = impl_of(be);
    if (n_seq == 0 || dim == 0 || use_stream(be) != AR_OK)
        return;
    /* q_start, padded to 8 bytes, then the n_seq addresses */
    const size_t at = ((size_t)n_seq + 2) & ~(size_t)1, n = at + 2 * (size_t)n_seq;
    if (q_start[0] == 0 && n <= KEPT_INTS) {
        memcpy(impl->pack, q_start, ((size_t)n_seq + 1) * sizeof(int));
        memcpy(impl->pack + at, tabs, (size_t)n_seq * sizeof *tabs);
        const int *d = stage_ints_kept(be, KEPT_SEQ_TABLES, impl->pack, n);
        if (d)
            LAUNCH_CHECK(be, kern_adaln_seqs(y, x, d, (const float *const *)(d + at), n_seq,
                                             q_start[n_seq], a, b, dim, gate, impl->stream));
        return;
    }
    for (int s = 0; s < n_seq; s++) {
        const size_t r0 = (size_t)q_start[s] * dim;
        const int rows = q_start[s + 1] - q_start[s];
        if (LAUNCH_CHECK(be,
                         gate ? kern_gate_add(y + r0, x + r0, tabs[s] + a, rows, dim, impl->stream)
                              : kern_modulate(y + r0, x + r0, tabs[s] + a, tabs[s] + b, rows, dim,
                                              impl->stream)) != AR_OK)
            return;
    }
}

static void cuda_modulate_seqs(backend_t *be, float *y, const float *x, const int *q_start,
                               const float *const *tabs, int n_seq, size_t sc, size_t sh, int dim) {
    adaln_seqs(be, y, x, q_start, tabs, n_seq, sc, sh, dim, 0);
}

static void cuda_gate_add_seqs(backend_t *be, float *y, const float *a, const int *q_start,
                               const float *const *tabs, int n_seq, size_t g, int dim) {
    adaln_seqs(be, y, a, q_start, tabs, n_seq, g, 0, dim, 1);
}

static void cuda_l2norm_heads(backend_t *be, float *x, const float *mul, int rows, int n_heads,
                              int head_dim) {
    assert(rows >= 0 && n_heads >= 0 && head_dim > 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_l2norm_heads(x, mul, rows, n_heads, head_dim, impl_of(be)->stream));
}

/* Positions go through the staging buffer, STAGING_INTS at a time. */
static void cuda_rope(backend_t *be, float *x, const int *pos, int rows, int n_heads, int head_dim,
                      float theta) {
    assert(head_dim > 0 && head_dim % 2 == 0 && rows >= 0 && n_heads >= 0 && theta > 0);
    if (rows == 0 || n_heads == 0 || use_stream(be) != AR_OK)
        return;
    for (int r0 = 0; r0 < rows; r0 += (int)STAGING_INTS) {
        const int n = rows - r0 < (int)STAGING_INTS ? rows - r0 : (int)STAGING_INTS;
        const int *d_pos = stage_ints_kept(be, KEPT_POSITIONS, pos + r0, (size_t)n);
        if (!d_pos ||
            LAUNCH_CHECK(be, kern_rope(x + (size_t)r0 * n_heads * head_dim, d_pos, n, n_heads,
                                       head_dim, theta, impl_of(be)->stream)) != AR_OK)
            return;
    }
}

static void cuda_rope_2d(backend_t *be, float *x, const int *pos, int rows, int n_heads,
                         int head_dim, float theta) {
    assert(head_dim > 0 && head_dim % 4 == 0 && rows >= 0 && n_heads >= 0 && theta > 0);
    if (rows == 0 || n_heads == 0 || use_stream(be) != AR_OK)
        return;
    const int per = (int)STAGING_INTS / 2;
    for (int r0 = 0; r0 < rows; r0 += per) {
        const int n = rows - r0 < per ? rows - r0 : per;
        const int *d_pos = stage_ints_kept(be, KEPT_POSITIONS, pos + 2 * (size_t)r0, 2 * (size_t)n);
        if (!d_pos ||
            LAUNCH_CHECK(be, kern_rope_2d(x + (size_t)r0 * n_heads * head_dim, d_pos, n, n_heads,
                                          head_dim, theta, impl_of(be)->stream)) != AR_OK)
            return;
    }
}

/* The KV ops take host block tables and views; each launch stages them,
 * with one kern_kv_item_t per (sequence, head) pair, into the staging
 * buffer in one copy. A batch too large for the staging buffer (or, for
 * attention, for the scratch that holds the split partials) goes in
 * several launches, queued in order on the stream, which also orders each
 * staging copy after the kernels that read the previous one. */
#define KV_STAGE_BYTES (STAGING_INTS * sizeof(int))

static size_t kv_items_bytes(int n_items) {
    return ((size_t)n_items * sizeof(kern_kv_item_t) + 15) & ~(size_t)15;
}

static int kv_stage_fits(int n_items, int n_ints) {
    return kv_items_bytes(n_items) + (size_t)n_ints * sizeof(int) <= KV_STAGE_BYTES;
}

/* Blocks holding cache indices [0, len). */
static int kv_blocks_of(int len, int block_tokens) {
    return (len + block_tokens - 1) / block_tokens;
}

/* The items and tables gathered on the host (impl->kv_items, kv_ints)
 * staged as one piece: items first, tables after. */
static int kv_stage_upload(backend_t *be, int n_items, int n_ints, const kern_kv_item_t **d_items,
                           const int **d_tables) {
    cuda_impl_t *impl = impl_of(be);
    const size_t ib = kv_items_bytes(n_items);
    char *h;
    const char *d = stage_reserve(be, ib + (size_t)n_ints * sizeof(int), &h);
    if (!d)
        return AR_ERR;
    memcpy(h, impl->kv_items, (size_t)n_items * sizeof(kern_kv_item_t));
    memcpy(h + ib, impl->kv_ints, (size_t)n_ints * sizeof(int));
    *d_items = (const kern_kv_item_t *)d;
    *d_tables = (const int *)(d + ib);
    return stage_commit(be);
}

/* Adds an item for rows [t0, t0 + n_rows) of pair (s, h) with its table. */
/* The pool as the kernels take it. */
static kern_kv_pool_t kv_pool_of(const kv_blocks_t *p) {
    return (kern_kv_pool_t){p->base, (int)p->dtype, p->block_tokens, p->head_dim};
}

static void kv_item_add(cuda_impl_t *impl, int *n_items, int *n_ints, int *rows, const kv_view_t *c,
                        int block_tokens, int n_new, int t0, int n_rows, int q_row, int head,
                        float *mass) {
    const int nb = kv_blocks_of(c->len, block_tokens);
    kern_kv_item_t *it = &impl->kv_items[(*n_items)++];
    it->mass = mass;
    it->k_scale = c->k_scale;
    it->v_scale = c->v_scale;
    it->table = *n_ints;
    it->len = c->len;
    it->n_new = n_new;
    it->t0 = t0;
    it->n_rows = n_rows;
    it->q_row = q_row;
    it->head = head;
    it->row_off = *rows;
    if (nb) /* an empty cache (a first scale) may have no table at all */
        memcpy(impl->kv_ints + *n_ints, c->blocks, (size_t)nb * sizeof(int));
    *n_ints += nb;
    *rows += n_rows;
}

static void cuda_kv_append(backend_t *be, const kv_blocks_t *pool, const kv_view_t *kv,
                           const float *k, const float *v, const int *q_start, int n_seq,
                           int n_heads) {
    assert(n_seq >= 0 && n_heads >= 0 && pool->head_dim > 0 && pool->block_tokens > 0);
    cuda_impl_t *impl = impl_of(be);
    const int bt = pool->block_tokens;
    if (n_seq == 0 || n_heads == 0 || use_stream(be) != AR_OK)
        return;
    int n_items = 0, n_ints = 0, rows = 0;
    for (int i = 0; i < n_seq * n_heads; i++) {
        const int s = i / n_heads, n_new = q_start[s + 1] - q_start[s];
        if (n_new == 0 || !kv[i].blocks)
            continue; /* nothing to write, or a head that does not cache these rows */
        assert(n_new >= 0 && kv[i].len >= n_new);
        const int nb = kv_blocks_of(kv[i].len, bt);
        if (!kv_stage_fits(n_items + 1, n_ints + nb)) {
            const kern_kv_item_t *d_items;
            const int *d_tables;
            if (n_items == 0) {
                cuda_fail(be,
                          "kv_append: a block table of %d blocks does not fit the staging "
                          "buffer",
                          nb);
                return;
            }
            if (kv_stage_upload(be, n_items, n_ints, &d_items, &d_tables) != AR_OK ||
                LAUNCH_CHECK(be, kern_kv_append(kv_pool_of(pool), d_items, n_items, rows, d_tables,
                                                k, v, n_heads, impl->stream)) != AR_OK)
                return;
            n_items = n_ints = rows = 0;
            i--; /* this pair again, into the empty staging buffer */
            continue;
        }
        kv_item_add(impl, &n_items, &n_ints, &rows, &kv[i], bt, n_new, 0, n_new, q_start[s],
                    i % n_heads, NULL);
    }
    const kern_kv_item_t *d_items;
    const int *d_tables;
    if (n_items && kv_stage_upload(be, n_items, n_ints, &d_items, &d_tables) == AR_OK)
        LAUNCH_CHECK(be, kern_kv_append(kv_pool_of(pool), d_items, n_items, rows, d_tables, k, v,
                                        n_heads, impl->stream));
}

/* Launches the staged attention items; AR_ERR stops the op. */
static int attention_flush(backend_t *be, float *out, const float *q, const kv_blocks_t *pool,
                           int n_items, int n_ints, int rows, int max_keys, int any_mass,
                           int n_heads, float scale) {
    cuda_impl_t *impl = impl_of(be);
    const kern_kv_item_t *d_items;
    const int *d_tables;
    if (kv_stage_upload(be, n_items, n_ints, &d_items, &d_tables) != AR_OK)
        return AR_ERR;
    return LAUNCH_CHECK(be, kern_attention(out, q, kv_pool_of(pool), d_items, n_items, rows,
                                           max_keys, d_tables, n_heads, scale, any_mass,
                                           impl->scratch, impl->stream));
}

/* Query rows are cut into launches whose split partials fit the scratch;
 * a sequence with more rows than one launch holds is cut between rows (its
 * mass then gets each launch's rows in turn). */
static void cuda_attention(backend_t *be, float *out, const float *q, const kv_blocks_t *pool,
                           const attn_batch_t *batch, int n_heads, float scale) {
    const int hd = pool->head_dim, bt = pool->block_tokens;
    assert(batch->n_seq >= 0 && n_heads >= 0 && hd > 0 && bt > 0);
    if (hd > 512) {
        cuda_fail(be, "attention: head_dim %d is more than the kernels' 512", hd);
        return;
    }
    if (batch->n_seq == 0 || n_heads == 0 || use_stream(be) != AR_OK)
        return;
    cuda_impl_t *impl = impl_of(be);
    const size_t scratch_floats = SCRATCH_BYTES / sizeof(float);
    int n_items = 0, n_ints = 0, rows = 0, max_keys = 0, any_mass = 0;
    for (int i = 0; i < batch->n_seq * n_heads; i++) {
        const int s = i / n_heads, q0 = batch->q_start[s];
        const int n_new = batch->q_start[s + 1] - q0;
        const kv_view_t *c = &batch->kv[i];
        assert(n_new >= 0 && c->len >= n_new);
        float *mass = batch->mass ? batch->mass[i] : NULL;
        for (int t = 0; t < n_new;) {
            const int keys = c->len > max_keys ? c->len : max_keys;
            const size_t per_row = kern_attention_scratch(1, keys, hd);
            const int64_t room = (int64_t)(scratch_floats / per_row) - rows;
            const int nb = kv_blocks_of(c->len, bt);
            if (room < 1 || !kv_stage_fits(n_items + 1, n_ints + nb)) {
                if (n_items == 0) {
                    cuda_fail(be,
                              "attention: one query row over %d keys (%d blocks) does not "
                              "fit the scratch and staging buffers",
                              c->len, nb);
                    return;
                }
                if (attention_flush(be, out, q, pool, n_items, n_ints, rows, max_keys, any_mass,
                                    n_heads, scale) != AR_OK)
                    return;
                n_items = n_ints = rows = max_keys = any_mass = 0;
                continue;
            }
            const int take = n_new - t < room ? n_new - t : (int)room;
            kv_item_add(impl, &n_items, &n_ints, &rows, c, bt, n_new, t, take, q0, i % n_heads,
                        mass);
            max_keys = keys;
            any_mass |= mass != NULL;
            t += take;
        }
    }
    if (n_items)
        attention_flush(be, out, q, pool, n_items, n_ints, rows, max_keys, any_mass, n_heads,
                        scale);
}

/* Launches the staged attention_scale items; AR_ERR stops the op. */
static int attention_scale_flush(backend_t *be, float *out, const float *q, const float *k_new,
                                 const float *v_new, const kv_blocks_t *pool, int n_items,
                                 int n_ints, int rows, int max_keys, int any_mass, int n_heads,
                                 float scale) {
    cuda_impl_t *impl = impl_of(be);
    const kern_kv_item_t *d_items;
    const int *d_tables;
    int max_item_rows = 1;
    for (int i = 0; i < n_items; i++)
        max_item_rows =
            impl->kv_items[i].n_rows > max_item_rows ? impl->kv_items[i].n_rows : max_item_rows;
    if (kv_stage_upload(be, n_items, n_ints, &d_items, &d_tables) != AR_OK)
        return AR_ERR;
    return LAUNCH_CHECK(be, kern_attention_scale(out, q, k_new, v_new, kv_pool_of(pool), d_items,
                                                 n_items, rows, max_keys, max_item_rows, d_tables,
                                                 n_heads, scale, any_mass, impl->scratch,
                                                 impl->stream));
}

/* As cuda_attention, one item per (sequence, head) pair with its whole
 * scale of rows, in launches that fit the staging buffer (and the scratch,
 * which holds each row's max and sum for the mass). A cache may be empty
 * (the first scale): its item has no table. */
static void cuda_attention_scale(backend_t *be, float *out, const float *q, const float *k_new,
                                 const float *v_new, const kv_blocks_t *pool,
                                 const attn_batch_t *batch, int n_heads, float scale) {
    const int hd = pool->head_dim, bt = pool->block_tokens;
    assert(batch->n_seq >= 0 && n_heads >= 0 && hd > 0 && bt > 0);
    if (hd > 512) {
        cuda_fail(be, "attention_scale: head_dim %d is more than the kernels' 512", hd);
        return;
    }
    if (batch->n_seq == 0 || n_heads == 0 || use_stream(be) != AR_OK)
        return;
    cuda_impl_t *impl = impl_of(be);
    const int64_t max_rows =
        (int64_t)(SCRATCH_BYTES / sizeof(float) / kern_attention_scale_scratch(1));
    int n_items = 0, n_ints = 0, rows = 0, max_keys = 0, any_mass = 0;
    for (int i = 0; i < batch->n_seq * n_heads; i++) {
        const int s = i / n_heads, q0 = batch->q_start[s];
        const int n_new = batch->q_start[s + 1] - q0;
        const kv_view_t *c = &batch->kv[i];
        assert(n_new >= 0 && c->len >= 0);
        float *mass = batch->mass ? batch->mass[i] : NULL;
        for (int t = 0; t < n_new;) {
            const int64_t room = max_rows - rows;
            const int nb = kv_blocks_of(c->len, bt);
            if (room < 1 || !kv_stage_fits(n_items + 1, n_ints + nb)) {
                if (n_items == 0) {
                    cuda_fail(be,
                              "attention_scale: a block table of %d blocks does not fit the "
                              "staging buffer",
                              nb);
                    return;
                }
                if (attention_scale_flush(be, out, q, k_new, v_new, pool, n_items, n_ints, rows,
                                          max_keys, any_mass, n_heads, scale) != AR_OK)
                    return;
                n_items = n_ints = rows = max_keys = any_mass = 0;
                continue;
            }
            const int take = n_new - t < room ? n_new - t : (int)room;
            kv_item_add(impl, &n_items, &n_ints, &rows, c, bt, n_new, t, take, q0, i % n_heads,
                        mass);
            max_keys = c->len + n_new > max_keys ? c->len + n_new : max_keys;
            any_mass |= mass != NULL;
            t += take;
        }
    }
    if (n_items)
        attention_scale_flush(be, out, q, k_new, v_new, pool, n_items, n_ints, rows, max_keys,
                              any_mass, n_heads, scale);
}

/* In launches of as many kept rows as the staging buffer (the table and
 * the keep list) and the scratch (the rows in transit) hold: a launch
 * writes indices [i0, i0 + n) and reads keep[i] >= i >= i0, which no
 * earlier launch has written. */
static void cuda_kv_gather(backend_t *be, const kv_blocks_t *pool, const int *blocks,
                           const int *keep, int n_keep, float *mass) {
    assert(n_keep >= 0 && pool->block_tokens > 0 && pool->head_dim > 0);
    if (n_keep == 0 || use_stream(be) != AR_OK)
        return;
    cuda_impl_t *impl = impl_of(be);
    const int hd = pool->head_dim, bt = pool->block_tokens;
    const int nb = keep[n_keep - 1] / bt + 1;
    const int64_t by_scratch = (int64_t)(SCRATCH_BYTES / sizeof(float) / (2 * (size_t)hd + 1));
    const int64_t by_staging = (int64_t)STAGING_INTS - nb;
    const int64_t per = by_scratch < by_staging ? by_scratch : by_staging;
    if (per < 1) {
        cuda_fail(be, "kv_gather: a block table of %d blocks does not fit the staging buffer", nb);
        return;
    }
    int *h = (int *)impl->kv_host;
    memcpy(h, blocks, (size_t)nb * sizeof(int));
    for (int i0 = 0; i0 < n_keep; i0 += (int)per) {
        const int n = n_keep - i0 < per ? n_keep - i0 : (int)per;
        for (int i = 0; i < n; i++)
            assert(keep[i0 + i] >= i0 + i && (i0 + i == 0 || keep[i0 + i] > keep[i0 + i - 1]));
        memcpy(h + nb, keep + i0, (size_t)n * sizeof(int));
        const int *d = stage_ints(be, h, (size_t)nb + (size_t)n);
        if (!d || LAUNCH_CHECK(be, kern_kv_gather(kv_pool_of(pool), d, d + nb, i0, n, mass,
                                                  impl->scratch, impl->stream)) != AR_OK)
            return;
    }
}

static void cuda_kv_read_rows(backend_t *be, float *out, const kv_blocks_t *pool,
                              const kv_view_t *view, int j0, int n, int values) {
    assert(j0 >= 0 && n >= 0 && j0 + n <= view->len);
    if (n == 0 || use_stream(be) != AR_OK)
        return;
    const int nb = kv_blocks_of(j0 + n, pool->block_tokens);
    if ((size_t)nb > STAGING_INTS) {
        cuda_fail(be, "kv_read_rows: a block table of %d blocks does not fit the staging buffer",
                  nb);
        return;
    }
    int *h = (int *)impl_of(be)->kv_host;
    memcpy(h, view->blocks, (size_t)nb * sizeof(int));
    const int *d = stage_ints(be, h, (size_t)nb);
    if (d)
        LAUNCH_CHECK(be, kern_kv_read_rows(out, kv_pool_of(pool), d, j0, n, values,
                                           values ? view->v_scale : view->k_scale,
                                           impl_of(be)->stream));
}

/* ---- element-wise ------------------------------------------------------------------------ */

static void cuda_silu_mul(backend_t *be, float *out, const float *gate, const float *up, size_t n) {
    if (use_stream(be) != AR_OK)
        return;
    void *out16 = x16_slot(be, n);
    const int rc = LAUNCH_CHECK(be, kern_silu_mul(out, out16, gate, up, n, impl_of(be)->stream));
    if (out16)
        x16_made(be, out, n, rc);
}

static void cuda_silu(backend_t *be, float *x, size_t n) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_silu(x, n, impl_of(be)->stream));
}

static void cuda_gelu(backend_t *be, float *x, size_t n) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_gelu(x, n, impl_of(be)->stream));
}

static void cuda_gelu_tanh(backend_t *be, float *x, size_t n) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_gelu_tanh(x, n, impl_of(be)->stream));
}

static void cuda_add(backend_t *be, float *y, const float *a, size_t n) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_add(y, a, n, impl_of(be)->stream));
}

static void cuda_mul(backend_t *be, float *y, const float *a, size_t n) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_mul(y, a, n, impl_of(be)->stream));
}

/* q_start and k_start are host arrays: each launch stages a run of
 * sequences' starts (both arrays, n + 1 ints each) in one copy, as many
 * sequences as the staging buffer holds; the kernel finds a row's sequence
 * in them. */
static void cuda_attention_dense(backend_t *be, float *out, const float *q, const float *k,
                                 const float *v, int kv_stride, const int *q_start,
                                 const int *k_start, int n_seq, int n_heads, int head_dim,
                                 float scale, const float *bias, int bias_span) {
    assert(n_seq >= 0 && n_heads > 0 && head_dim > 0 && kv_stride >= n_heads * head_dim);
    if (head_dim > 512) {
        cuda_fail(be, "attention_dense: head_dim %d is more than the kernels' 512", head_dim);
        return;
    }
    if (n_seq == 0 || q_start[n_seq] == q_start[0] || use_stream(be) != AR_OK)
        return;
    int *h = (int *)impl_of(be)->kv_host;
    const int per = (int)(STAGING_INTS / 2) - 1;
    for (int s0 = 0; s0 < n_seq; s0 += per) {
        const int n = n_seq - s0 < per ? n_seq - s0 : per;
        const int rows = q_start[s0 + n] - q_start[s0];
        for (int s = s0; s < s0 + n; s++)
            assert(q_start[s + 1] >= q_start[s] && k_start[s + 1] >= k_start[s] &&
                   (!bias || (q_start[s + 1] - q_start[s] <= bias_span &&
                              k_start[s + 1] - k_start[s] <= bias_span)));
        if (rows == 0)
            continue;
        memcpy(h, q_start + s0, ((size_t)n + 1) * sizeof(int));
        memcpy(h + n + 1, k_start + s0, ((size_t)n + 1) * sizeof(int));
        const int *d = stage_ints(be, h, 2 * ((size_t)n + 1));
        if (!d || LAUNCH_CHECK(be, kern_attention_dense(out, q, k, v, kv_stride, d, d + n + 1, n,
                                                        rows, n_heads, head_dim, scale, bias,
                                                        bias_span, impl_of(be)->stream)) != AR_OK)
            return;
    }
}

static void cuda_scale(backend_t *be, float *x, size_t n, float s) {
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_scale(x, n, s, impl_of(be)->stream));
}

static void cuda_softmax(backend_t *be, float *x, int rows, int cols) {
    assert(rows >= 0 && cols > 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_softmax(x, rows, cols, impl_of(be)->stream));
}

/* The ids are on the host, so they are checked here: an id outside the
 * table would read outside it on the device. */
static void cuda_embedding(backend_t *be, float *out, const tensor_t *table, const int *ids, int n,
                           int l2_normalize) {
    assert(table->ndim == 2 && n >= 0 && table->shape[1] <= INT32_MAX);
    const int64_t vocab = table->shape[0];
    const int dim = (int)table->shape[1];
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= vocab) {
            cuda_fail(be, "embedding: id %d (at %d) is outside the table's %lld rows", ids[i], i,
                      (long long)vocab);
            return;
        }
    if (n == 0 || use_stream(be) != AR_OK)
        return;
    for (int i0 = 0; i0 < n; i0 += (int)STAGING_INTS) {
        const int cnt = n - i0 < (int)STAGING_INTS ? n - i0 : (int)STAGING_INTS;
        const int *d_ids = stage_ints(be, ids + i0, (size_t)cnt);
        if (!d_ids || LAUNCH_CHECK(be, kern_embedding(out + (size_t)i0 * dim, table->data,
                                                      kern_type(table->dtype), dim, d_ids, cnt,
                                                      l2_normalize, impl_of(be)->stream)) != AR_OK)
            return;
    }
}

/* ---- image ops ----------------------------------------------------------------------------- */

/* im2col into the scratch and a cuBLAS GEMM, in slices of output pixels that
 * fit, rather than an implicit-GEMM kernel or cuDNN: the GEMM is cuBLAS's
 * tensor-core code, which a hand-written implicit GEMM would have to match
 * in tiling and pipelining to be worth it; the panel costs one extra write
 * and read (at 384 px the largest is about 0.3 GB of traffic, well under a
 * millisecond) in a decoder that runs once per image; and it adds no
 * dependency (cuDNN is 1 GB of libraries). For 16-bit weights the panel
 * holds the hi/lo halves (see cuda_matmul) and two GEMMs accumulate into
 * out; fp32 1x1 convolutions without padding are one GEMM on the input. */
static void cuda_conv2d(backend_t *be, float *out, const float *in, const tensor_t *w,
                        const tensor_t *bias, int c_in, int h, int w_, int pad) {
    assert(w->ndim == 4 && w->shape[1] == c_in && w->shape[2] == w->shape[3]);
    assert(pad >= 0 && h >= 0 && w_ >= 0);
    cuda_impl_t *impl = impl_of(be);
    const int c_out = (int)w->shape[0], k = (int)w->shape[2];
    const int ho = h + 2 * pad - k + 1, wo = w_ + 2 * pad - k + 1;
    assert(!bias || tensor_numel(bias) == c_out);
    assert(ho >= 0 && wo >= 0);
    const int64_t npix = (int64_t)ho * wo;
    assert(npix <= INT32_MAX);
    if (c_out == 0 || npix == 0 || use_stream(be) != AR_OK)
        return;
    const void *b_data = bias ? bias->data : NULL;
    const kern_dtype_t b_type = kern_type(bias ? bias->dtype : DTYPE_F32);
    if (LAUNCH_CHECK(be, kern_fill_bias(out, b_data, b_type, c_out, npix, 1, impl->stream)) !=
        AR_OK)
        return;
    const int kk = c_in * k * k;
    if (kk == 0)
        return;
    /* out^T [npix, c_out] (column-major, ld npix) = panel^T [npix, kk] * W^T */
    const float beta = bias ? 1.0f : 0.0f;
    if (w->dtype == DTYPE_F32 && k == 1 && pad == 0) {
        gemm_rowmajor(be, c_out, (int)npix, kk, w->data, kk, in, (int)npix, 0, DTYPE_F32, beta, out,
                      (int)npix);
        return;
    }
    const size_t px_bytes = (size_t)kk * 4; /* one fp32, or two 16-bit values, per row */
    const int64_t fit = (int64_t)((SCRATCH_BYTES - ARENA_ALIGN) / px_bytes);
    if (fit == 0) {
        cuda_fail(be, "conv2d: a column of %d values does not fit the %.0f MiB scratch", kk,
                  MIB(SCRATCH_BYTES));
        return;
    }
    char *panel = impl->scratch;
    for (int64_t p0 = 0; p0 < npix; p0 += fit) {
        const int np = (int)(npix - p0 < fit ? npix - p0 : fit);
        char *lo = panel + (((size_t)kk * np * 2 + ARENA_ALIGN - 1) & ~(ARENA_ALIGN - 1));
        if (LAUNCH_CHECK(be, kern_im2col(panel, lo, kern_type(w->dtype), in, c_in, h, w_, k, pad,
                                         wo, p0, np, impl->stream)) != AR_OK)
            return;
        /* W [c_out, kk] times panel [kk, np] into out's columns p0.. (ld npix) */
        if (gemm_rowmajor(be, c_out, np, kk, w->data, kk, panel, np, 0, w->dtype, beta, out + p0,
                          (int)npix) != AR_OK)
            return;
        if (w->dtype != DTYPE_F32 && gemm_rowmajor(be, c_out, np, kk, w->data, kk, lo, np, 0,
                                                   w->dtype, 1.0f, out + p0, (int)npix) != AR_OK)
            return;
    }
}

static void cuda_groupnorm(backend_t *be, float *out, const float *in, const tensor_t *gamma,
                           const tensor_t *beta, int c, int hw, int groups, float eps, int silu) {
    assert(groups > 0 && c % groups == 0 && hw > 0);
    assert(tensor_numel(gamma) == c && tensor_numel(beta) == c && gamma->dtype == beta->dtype);
    if (use_stream(be) != AR_OK)
        return;
    if (kern_groupnorm_scratch(c, hw, groups) * sizeof(double) > SCRATCH_BYTES) {
        cuda_fail(be, "groupnorm: %d channels in %d groups need more than the scratch", c, groups);
        return;
    }
    LAUNCH_CHECK(be,
                 kern_groupnorm(out, in, gamma->data, beta->data, kern_type(gamma->dtype), c, hw,
                                groups, eps, silu, impl_of(be)->scratch, impl_of(be)->stream));
}

static void cuda_upsample_nearest2x(backend_t *be, float *out, const float *in, int c, int h,
                                    int w) {
    assert(c >= 0 && h >= 0 && w >= 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_upsample_nearest2x(out, in, c, h, w, impl_of(be)->stream));
}

static void cuda_resize_bicubic(backend_t *be, float *out, const float *in, int c, int h, int w,
                                int H, int W) {
    assert(c >= 0 && h > 0 && w > 0 && H >= 0 && W >= 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_resize_bicubic(out, in, c, h, w, H, W, impl_of(be)->stream));
}

static void cuda_resize_area(backend_t *be, float *out, const float *in, int c, int h, int w, int H,
                             int W) {
    assert(c >= 0 && h > 0 && w > 0 && H >= 0 && W >= 0);
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_resize_area(out, in, c, h, w, H, W, impl_of(be)->stream));
}

static void cuda_transpose(backend_t *be, float *out, const float *in, int rows, int cols) {
    assert(rows >= 0 && cols >= 0 && (out != in || rows == 0 || cols == 0));
    if (use_stream(be) == AR_OK)
        LAUNCH_CHECK(be, kern_transpose(out, in, rows, cols, impl_of(be)->stream));
}

/* ---- ARSERVE_CUDA_CHECK=1 and the counters ------------------------------------------------- */

/* Before an op under ARSERVE_CUDA_CHECK=1: failures from here on name it. */
static unsigned op_begin(backend_t *be, const char *op) {
    cuda_impl_t *impl = impl_of(be);
    impl->op = op;
    return impl->n_errors;
}

/* After it: waits for the op's work and records what failed there (a
 * fault that the op's own calls did not see, since a kernel faults after
 * its launch has returned), named with the op. An op that already failed
 * is not blamed twice. */
static void op_end(backend_t *be, unsigned errors_before) {
    cuda_impl_t *impl = impl_of(be);
    if (impl->n_errors == errors_before && use_device(be) == AR_OK)
        stream_wait(be, "cudaStreamSynchronize after the op (ARSERVE_CUDA_CHECK=1)", __LINE__);
    impl->op = NULL;
}

/* The ops that queue device work, X(op, parameters, arguments): with
 * ARSERVE_CUDA_CHECK=1, cuda_start puts checked_<op> in the table instead
 * of cuda_<op>, so that a backend without the switch pays nothing for it.
 * An op added to the table belongs here too. */
#define CHECKED_OPS(X)                                                                             \
    X(upload, (backend_t * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))   \
    X(download, (backend_t * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes)) \
    X(copy, (backend_t * be, void *dst, const void *src, size_t bytes), (be, dst, src, bytes))     \
    X(matmul,                                                                                      \
      (backend_t * be, float *y, const float *x, const tensor_t *w, const tensor_t *bias, int m),  \
      (be, y, x, w, bias, m))                                                                      \
    X(matmul_add, (backend_t * be, float *y, const float *x, const tensor_t *w, int m),            \
      (be, y, x, w, m))                                                                            \
    X(rmsnorm,                                                                                     \
      (backend_t * be, float *y, const float *x, const tensor_t *w, int rows, int dim, float eps), \
      (be, y, x, w, rows, dim, eps))                                                               \
    X(rope,                                                                                        \
      (backend_t * be, float *x, const int *pos, int rows, int n_heads, int head_dim,              \
       float theta),                                                                               \
      (be, x, pos, rows, n_heads, head_dim, theta))                                                \
    X(rope_2d,                                                                                     \
      (backend_t * be, float *x, const int *pos, int rows, int n_heads, int head_dim,              \
       float theta),                                                                               \
      (be, x, pos, rows, n_heads, head_dim, theta))                                                \
    X(kv_append,                                                                                   \
      (backend_t * be, const kv_blocks_t *pool, const kv_view_t *kv, const float *k,               \
       const float *v, const int *q_start, int n_seq, int n_heads),                                \
      (be, pool, kv, k, v, q_start, n_seq, n_heads))                                               \
    X(attention,                                                                                   \
      (backend_t * be, float *out, const float *q, const kv_blocks_t *pool,                        \
       const attn_batch_t *batch, int n_heads, float scale),                                       \
      (be, out, q, pool, batch, n_heads, scale))                                                   \
    X(attention_scale,                                                                             \
      (backend_t * be, float *out, const float *q, const float *k_new, const float *v_new,         \
       const kv_blocks_t *pool, const attn_batch_t *batch, int n_heads, float scale),              \
      (be, out, q, k_new, v_new, pool, batch, n_heads, scale))                                     \
    X(attention_dense,                                                                             \
      (backend_t * be, float *out, const float *q, const float *k, const float *v, int kv_stride,  \
       const int *q_start, const int *k_start, int n_seq, int n_heads, int head_dim, float scale,  \
       const float *bias, int bias_span),                                                          \
      (be, out, q, k, v, kv_stride, q_start, k_start, n_seq, n_heads, head_dim, scale, bias,       \
       bias_span))                                                                                 \
    X(kv_gather,                                                                                   \
      (backend_t * be, const kv_blocks_t *pool, const int *blocks, const int *keep, int n_keep,    \
       float *mass),                                                                               \
      (be, pool, blocks, keep, n_keep, mass))                                                      \
    X(kv_read_rows,                                                                                \
      (backend_t * be, float *out, const kv_blocks_t *pool, const kv_view_t *view, int j0, int n,  \
       int values),                                                                                \
      (be, out, pool, view, j0, n, values))                                                        \
    X(layernorm, (backend_t * be, float *y, const float *x, int rows, int dim, float eps),         \
      (be, y, x, rows, dim, eps))                                                                  \
    X(modulate,                                                                                    \
      (backend_t * be, float *y, const float *x, const float *scale, const float *shift, int rows, \
       int dim),                                                                                   \
      (be, y, x, scale, shift, rows, dim))                                                         \
    X(gate_add, (backend_t * be, float *y, const float *a, const float *gate, int rows, int dim),  \
      (be, y, a, gate, rows, dim))                                                                 \
    X(modulate_seqs,                                                                               \
      (backend_t * be, float *y, const float *x, const int *q_start, const float *const *tabs,     \
       int n_seq, size_t sc, size_t sh, int dim),                                                  \
      (be, y, x, q_start, tabs, n_seq, sc, sh, dim))                                               \
    X(gate_add_seqs,                                                                               \
      (backend_t * be, float *y, const float *a, const int *q_start, const float *const *tabs,     \
       int n_seq, size_t g, int dim),                                                              \
      (be, y, a, q_start, tabs, n_seq, g, dim))                                                    \
    X(l2norm_heads,                                                                                \
      (backend_t * be, float *x, const float *mul, int rows, int n_heads, int head_dim),           \
      (be, x, mul, rows, n_heads, head_dim))                                                       \
    X(silu_mul, (backend_t * be, float *out, const float *gate, const float *up, size_t n),        \
      (be, out, gate, up, n))                                                                      \
    X(silu, (backend_t * be, float *x, size_t n), (be, x, n))                                      \
    X(gelu, (backend_t * be, float *x, size_t n), (be, x, n))                                      \
    X(gelu_tanh, (backend_t * be, float *x, size_t n), (be, x, n))                                 \
    X(add, (backend_t * be, float *y, const float *a, size_t n), (be, y, a, n))                    \
    X(mul, (backend_t * be, float *y, const float *a, size_t n), (be, y, a, n))                    \
    X(scale, (backend_t * be, float *x, size_t n, float s), (be, x, n, s))                         \
    X(softmax, (backend_t * be, float *x, int rows, int cols), (be, x, rows, cols))                \
    X(embedding,                                                                                   \
      (backend_t * be, float *out, const tensor_t *table, const int *ids, int n,                   \
       int l2_normalize),                                                                          \
      (be, out, table, ids, n, l2_normalize))                                                      \
    X(conv2d,                                                                                      \
      (backend_t * be, float *out, const float *in, const tensor_t *w, const tensor_t *bias,       \
       int c_in, int h, int w_, int pad),                                                          \
      (be, out, in, w, bias, c_in, h, w_, pad))                                                    \
    X(groupnorm,                                                                                   \
      (backend_t * be, float *out, const float *in, const tensor_t *gamma, const tensor_t *beta,   \
       int c, int hw, int groups, float eps, int silu),                                            \
      (be, out, in, gamma, beta, c, hw, groups, eps, silu))                                        \
    X(upsample_nearest2x, (backend_t * be, float *out, const float *in, int c, int h, int w),      \
      (be, out, in, c, h, w))                                                                      \
    X(resize_bicubic,                                                                              \
      (backend_t * be, float *out, const float *in, int c, int h, int w, int H, int W),            \
      (be, out, in, c, h, w, H, W))                                                                \
    X(resize_area,                                                                                 \
      (backend_t * be, float *out, const float *in, int c, int h, int w, int H, int W),            \
      (be, out, in, c, h, w, H, W))                                                                \
    X(transpose, (backend_t * be, float *out, const float *in, int rows, int cols),                \
      (be, out, in, rows, cols))

#define CHECKED_OP_DEFINE(op, params, args)                                                        \
    static void checked_##op params {                                                              \
        const unsigned before = op_begin(be, #op);                                                 \
        cuda_##op args;                                                                            \
        op_end(be, before);                                                                        \
    }
CHECKED_OPS(CHECKED_OP_DEFINE)

static void cuda_stats(backend_t *be, backend_stats_t *out) {
    const cuda_impl_t *impl = impl_of(be);
    *out = impl->counts;
    out->device_peak_bytes = impl->arena.peak;
    out->device_reserved_bytes = impl->arena.size;
}

/* ---- lifetime ------------------------------------------------------------------------------- */

/* Teardown cannot fail the caller, but a failure still says something
 * (a fault in the last queued work, say): printed, with the statement. */
#define TEARDOWN_CHECK(stmt)                                                                       \
    do {                                                                                           \
        cudaError_t e_ = (stmt);                                                                   \
        if (e_ != cudaSuccess)                                                                     \
            fprintf(stderr, "arserve: cuda backend: at teardown, %s failed at %s:%d: %s\n", #stmt, \
                    __FILE__, __LINE__, cudaGetErrorString(e_));                                   \
    } while (0)

static void cuda_destroy(backend_t *be) {
    if (!be)
        return;
    cuda_impl_t *impl = impl_of(be);
    /* Only a device that was set up is touched: a failing call here would
     * leave an error for the next cudaGetLastError. */
    if (impl && impl->reservation) {
        TEARDOWN_CHECK(cudaSetDevice(impl->device));
        if (impl->capturing) { /* a step never launched: its graph is dropped */
            cudaGraph_t g = NULL;
            TEARDOWN_CHECK(cudaStreamEndCapture(impl->stream, &g));
            if (g)
                TEARDOWN_CHECK(cudaGraphDestroy(g));
        }
        if (impl->stream)
            TEARDOWN_CHECK(cudaStreamSynchronize(impl->stream));
        for (int i = 0; i < GRAPH_CACHE; i++)
            if (impl->graphs[i].exec)
                TEARDOWN_CHECK(cudaGraphExecDestroy(impl->graphs[i].exec));
        if (impl->stage_host)
            TEARDOWN_CHECK(cudaFreeHost(impl->stage_host));
        if (impl->blas) {
            const cublasStatus_t s = cublasDestroy(impl->blas);
            if (s != CUBLAS_STATUS_SUCCESS)
                fprintf(stderr, "arserve: cuda backend: at teardown, cublasDestroy failed: %s\n",
                        cublasGetStatusString(s));
        }
        if (impl->stream)
            TEARDOWN_CHECK(cudaStreamDestroy(impl->stream));
        if (impl->parent) {
            if (arena_free(&impl_of(impl->parent)->arena, impl->reservation) != AR_OK)
                fprintf(stderr, "arserve: cuda backend: at teardown, a fork's memory was not "
                                "its parent's\n");
        } else {
            TEARDOWN_CHECK(cudaFree(impl->reservation));
            tls_device = -1;
        }
    }
    if (impl) {
        arena_release(&impl->arena);
        free(impl->kv_host);
        free(impl->kv_items);
        free(impl->kv_ints);
        free(impl->pack);
    }
    free(impl);
    free(be);
}

int backend_cuda_device_count(void) {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        (void)cudaGetLastError(); /* not a failure of anything that runs later */
        return 0;
    }
    return count;
}

static backend_t *cuda_fork(backend_t *parent, size_t bytes, int n_threads, ar_error_t *err);

/* Records why graphs are off for good (impl->no_graphs) and clears the
 * error state the failure left; AR_ERR. */
static int graphs_refused(cuda_impl_t *impl, const char *what, cudaError_t e) {
    snprintf(impl->no_graphs, sizeof impl->no_graphs, "%s: %s", what, cudaGetErrorString(e));
    enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(impl->stream, &st) == cudaSuccess &&
        st != cudaStreamCaptureStatusNone) {
        cudaGraph_t g = NULL;
        if (cudaStreamEndCapture(impl->stream, &g) == cudaSuccess && g)
            cudaGraphDestroy(g);
    }
    (void)cudaGetLastError();
    return AR_ERR;
}

/* Whether this device and these libraries capture and replay what a step
 * records (a kernel, a cuBLAS GEMM, a memset and a device copy), checked
 * once at creation: a stream capture of y = (3 x0) (3 x1) into scratch,
 * replayed, must give 9. Where it does not, impl->no_graphs says why and
 * every step runs op by op (capture_begin). */
static int graphs_probe(cuda_impl_t *impl) {
    float *x = impl->scratch, ones[2] = {1.0f, 1.0f}, y = 0.0f, one = 1.0f, zero = 0.0f;
    cudaError_t e = cudaMemcpy(x, ones, sizeof ones, cudaMemcpyHostToDevice);
    if (e != cudaSuccess)
        return graphs_refused(impl, "cudaMemcpy", e);
    if ((e = cudaStreamBeginCapture(impl->stream, cudaStreamCaptureModeRelaxed)) != cudaSuccess)
        return graphs_refused(impl, "cudaStreamBeginCapture", e);
    if ((e = cudaMemsetAsync(x + 4, 0, 4 * sizeof(float), impl->stream)) != cudaSuccess)
        return graphs_refused(impl, "cudaMemsetAsync in a capture", e);
    if ((e = kern_scale(x, 2, 3.0f, impl->stream)) != cudaSuccess)
        return graphs_refused(impl, "a kernel in a capture", e);
    if (cublasSgemm(impl->blas, CUBLAS_OP_N, CUBLAS_OP_N, 1, 1, 1, &one, x, 1, x + 1, 1, &zero,
                    x + 4, 1) != CUBLAS_STATUS_SUCCESS)
        return graphs_refused(impl, "cublasSgemm in a capture", cudaErrorNotSupported);
    if ((e = cudaMemcpyAsync(x + 8, x + 4, sizeof(float), cudaMemcpyDeviceToDevice,
                             impl->stream)) != cudaSuccess)
        return graphs_refused(impl, "cudaMemcpyAsync in a capture", e);
    cudaGraph_t g = NULL;
    if ((e = cudaStreamEndCapture(impl->stream, &g)) != cudaSuccess)
        return graphs_refused(impl, "cudaStreamEndCapture", e);
    cudaGraphExec_t exec = NULL;
    e = cudaGraphInstantiate(&exec, g, 0);
    cudaGraphDestroy(g);
    if (e != cudaSuccess)
        return graphs_refused(impl, "cudaGraphInstantiate", e);
    e = cudaGraphLaunch(exec, impl->stream);
    if (e == cudaSuccess)
        e = cudaStreamSynchronize(impl->stream);
    cudaGraphExecDestroy(exec);
    if (e != cudaSuccess)
        return graphs_refused(impl, "cudaGraphLaunch", e);
    if ((e = cudaMemcpy(&y, x + 8, sizeof y, cudaMemcpyDeviceToHost)) != cudaSuccess)
        return graphs_refused(impl, "cudaMemcpy", e);
    if (y != 9.0f) {
        snprintf(impl->no_graphs, sizeof impl->no_graphs,
                 "a replayed test graph computed %g where 9 was expected", (double)y);
        return AR_ERR;
    }
    return AR_OK;
}

/* Everything a backend sets up in its reservation (impl->reservation,
 * size bytes): the arena, its own scratch, its stream and cuBLAS handle,
 * and the op table. */
static int cuda_start(backend_t *be, size_t reserve, ar_error_t *err) {
    cuda_impl_t *impl = impl_of(be);
    if (arena_init(&impl->arena, impl->reservation, reserve) != AR_OK) {
        ar_errorf(err, "cuda backend: out of host memory");
        goto fail;
    }
    void *workspace = arena_alloc(&impl->arena, BLAS_WORKSPACE_BYTES);
    impl->scratch = arena_alloc(&impl->arena, SCRATCH_BYTES);
    impl->stage_dev = arena_alloc(&impl->arena, STEP_STAGING_BYTES);
    impl->pack = malloc(KEPT_INTS * sizeof(int));
    if (!workspace || !impl->scratch || !impl->stage_dev || !impl->pack) {
        ar_errorf(err, "cuda backend: out of host memory");
        goto fail;
    }
    CUDA_TRY(err, cudaMallocHost((void **)&impl->stage_host, STEP_STAGING_BYTES));
    CUDA_TRY(err, cudaStreamCreateWithFlags(&impl->stream, cudaStreamNonBlocking));
    CUBLAS_TRY(err, cublasCreate(&impl->blas));
    CUBLAS_TRY(err, cublasSetStream(impl->blas, impl->stream));
    CUBLAS_TRY(err, cublasSetWorkspace(impl->blas, workspace, BLAS_WORKSPACE_BYTES));
    be->name = "cuda";
    be->alloc = cuda_alloc;
    be->free = cuda_free;
    be->upload = cuda_upload;
    be->download = cuda_download;
    be->copy = cuda_copy;
    be->sync = cuda_sync;
    be->weight_load = cuda_weight_load;
    be->weight_load_8bit = cuda_weight_load_8bit;
    be->weight_free = cuda_weight_free;
    be->matmul = cuda_matmul;
    be->matmul_add = cuda_matmul_add;
    be->modulate_seqs = cuda_modulate_seqs;
    be->gate_add_seqs = cuda_gate_add_seqs;
    be->rmsnorm = cuda_rmsnorm;
    be->rope = cuda_rope;
    be->rope_2d = cuda_rope_2d;
    be->kv_append = cuda_kv_append;
    be->attention = cuda_attention;
    be->attention_scale = cuda_attention_scale;
    be->kv_gather = cuda_kv_gather;
    be->kv_read_rows = cuda_kv_read_rows;
    be->layernorm = cuda_layernorm;
    be->modulate = cuda_modulate;
    be->gate_add = cuda_gate_add;
    be->l2norm_heads = cuda_l2norm_heads;
    be->silu_mul = cuda_silu_mul;
    be->silu = cuda_silu;
    be->gelu = cuda_gelu;
    be->gelu_tanh = cuda_gelu_tanh;
    be->add = cuda_add;
    be->mul = cuda_mul;
    be->attention_dense = cuda_attention_dense;
    be->scale = cuda_scale;
    be->softmax = cuda_softmax;
    be->embedding = cuda_embedding;
    be->conv2d = cuda_conv2d;
    be->groupnorm = cuda_groupnorm;
    be->upsample_nearest2x = cuda_upsample_nearest2x;
    be->resize_bicubic = cuda_resize_bicubic;
    be->resize_area = cuda_resize_area;
    be->transpose = cuda_transpose;
    be->status = cuda_status;
    be->unusable = cuda_unusable;
    be->destroy = cuda_destroy;
    be->fork = cuda_fork;
    be->stats = cuda_stats;
    if (impl->check_ops) {
#define CHECKED_OP_INSTALL(op, params, args) be->op = checked_##op;
        CHECKED_OPS(CHECKED_OP_INSTALL)
#undef CHECKED_OP_INSTALL
    }
    return AR_OK;
fail:
    return AR_ERR;
}

/* A backend's host side for device: NULL when out of host memory. */
static backend_t *cuda_new(int device, ar_error_t *err) {
    backend_t *be = calloc(1, sizeof *be);
    cuda_impl_t *impl = calloc(1, sizeof *impl);
    if (be && impl) {
        be->impl = impl;
        impl->device = device;
        impl->kv_host = malloc(STAGING_INTS * sizeof(int));
        impl->kv_items = malloc(STAGING_INTS * sizeof(int));
        impl->kv_ints = malloc(STAGING_INTS * sizeof(int));
        if (impl->kv_host && impl->kv_items && impl->kv_ints)
            return be;
    }
    if (be && impl)
        cuda_destroy(be);
    else {
        free(be);
        free(impl);
    }
    ar_errorf(err, "cuda backend: out of host memory");
    return NULL;
}

/* A fork's reservation is a block of its parent's: its own scratch,
 * workspace and staging, and the bytes it will allocate, each allocation
 * rounded up to the arena's alignment (the slack covers a few hundred). */
static backend_t *cuda_fork(backend_t *parent, size_t bytes, int n_threads, ar_error_t *err) {
    cuda_impl_t *p = impl_of(parent);
    const size_t reserve = OWN_BYTES + bytes + 256 * ARENA_ALIGN;
    backend_t *be = cuda_new(p->device, err);
    if (!be)
        return NULL;
    cuda_impl_t *impl = impl_of(be);
    snprintf(impl->device_name, sizeof impl->device_name, "%s", p->device_name);
    if (use_device(parent) != AR_OK || !(impl->reservation = arena_alloc(&p->arena, reserve))) {
        ar_errorf(err,
                  "cuda backend: a fork needs %.1f MiB of the reservation on device %d (%s), "
                  "which has %.1f MiB of %.1f MiB in use",
                  MIB(reserve), p->device, p->device_name, MIB(p->arena.in_use),
                  MIB(p->arena.size));
        cuda_destroy(be);
        return NULL;
    }
    impl->parent = parent;
    impl->check_ops = p->check_ops;
    memcpy(impl->no_graphs, p->no_graphs, sizeof impl->no_graphs);
    be->batch_invariant = parent->batch_invariant;
    be->activations = parent->activations;
    be->graphs = parent->graphs;
    if (cuda_start(be, reserve, err) != AR_OK) {
        cuda_destroy(be);
        return NULL;
    }
    return be;
}

backend_t *backend_cuda_create(int device, size_t reserve_bytes, ar_error_t *err) {
    backend_t *be = cuda_new(device, err);
    if (!be)
        return NULL;
    cuda_impl_t *impl = impl_of(be);
    const char *check = getenv("ARSERVE_CUDA_CHECK");
    if (check && *check && strcmp(check, "0") && strcmp(check, "1")) {
        ar_errorf(err,
                  "cuda backend: ARSERVE_CUDA_CHECK=%s: expected 1 (synchronise and check after "
                  "every op) or 0",
                  check);
        goto fail;
    }
    impl->check_ops = check && !strcmp(check, "1");
    /* Launch checks read cudaGetLastError(), which also returns the last
     * failed runtime call of anyone in the process: start from a clean
     * slate so an earlier, unrelated failure is not blamed on a kernel. */
    (void)cudaGetLastError();
    int count = 0;
    const cudaError_t ce = cudaGetDeviceCount(&count);
    if (ce != cudaSuccess || count == 0) {
        ar_errorf(err, "cuda backend: no CUDA device available (%s)",
                  ce != cudaSuccess ? cudaGetErrorString(ce) : "none found");
        goto fail;
    }
    if (device < 0 || device >= count) {
        ar_errorf(err, "cuda backend: device %d does not exist (%d device%s: 0 to %d)", device,
                  count, count == 1 ? "" : "s", count - 1);
        goto fail;
    }
    CUDA_TRY(err, cudaSetDevice(device));
    tls_device = device;
    struct cudaDeviceProp prop; /* no typedef in C */
    CUDA_TRY(err, cudaGetDeviceProperties(&prop, device));
    snprintf(impl->device_name, sizeof impl->device_name, "%s", prop.name);

    size_t free_b = 0, total_b = 0;
    CUDA_TRY(err, cudaMemGetInfo(&free_b, &total_b));
    const size_t own = OWN_BYTES;
    size_t reserve = reserve_bytes;
    if (reserve == 0) {
        const size_t margin = free_b / 20 > RESERVE_MARGIN ? free_b / 20 : RESERVE_MARGIN;
        reserve = free_b > margin ? (free_b - margin) / ARENA_ALIGN * ARENA_ALIGN : 0;
    }
    if (reserve < own) {
        ar_errorf(err,
                  "cuda backend: a reservation of %.1f MiB on device %d (%s) is less than the "
                  "%.1f MiB the backend needs for itself (scratch and cuBLAS workspace); %.1f "
                  "MiB free of %.1f MiB",
                  MIB(reserve), device, impl->device_name, MIB(own), MIB(free_b), MIB(total_b));
        goto fail;
    }
    if (reserve > free_b) {
        ar_errorf(err,
                  "cuda backend: cannot reserve %.1f MiB on device %d (%s): %.1f MiB free of "
                  "%.1f MiB",
                  MIB(reserve), device, impl->device_name, MIB(free_b), MIB(total_b));
        goto fail;
    }
    const cudaError_t me = cudaMalloc(&impl->reservation, reserve);
    if (me != cudaSuccess) {
        ar_errorf(err,
                  "cuda backend: cannot reserve %.1f MiB on device %d (%s): cudaMalloc: %s; %.1f "
                  "MiB were free of %.1f MiB",
                  MIB(reserve), device, impl->device_name, cudaGetErrorString(me), MIB(free_b),
                  MIB(total_b));
        impl->reservation = NULL;
        goto fail;
    }
    if (cuda_start(be, reserve, err) != AR_OK)
        goto fail;
    /* A first launch: a GPU this build has no code for (CUDA_ARCHS) fails
     * here, at start-up, rather than at the first request. */
    cudaError_t le = kern_fill_bias(impl->scratch, NULL, KERN_F32, 1, 1, 0, impl->stream);
    if (le == cudaSuccess)
        le = cudaStreamSynchronize(impl->stream);
    if (le != cudaSuccess) {
        ar_errorf(err,
                  "cuda backend: cannot run kernels on device %d (%s, compute capability %d.%d): "
                  "%s; rebuild with CUDA_ARCHS including %d%d",
                  device, impl->device_name, prop.major, prop.minor, cudaGetErrorString(le),
                  prop.major, prop.minor);
        goto fail;
    }
    if (impl->check_ops)
        fprintf(stderr, "arserve: cuda backend: ARSERVE_CUDA_CHECK=1: synchronising and checking "
                        "after every op (slower; a fault is blamed on the op that caused it)\n");
    else if (graphs_probe(impl) != AR_OK)
        fprintf(stderr,
                "arserve: cuda backend: CUDA graphs do not work on device %d (%s): %s; steps run "
                "op by op\n",
                device, impl->device_name, impl->no_graphs);
    return be;

fail:
    cuda_destroy(be);
    return NULL;
}
