/* The CUDA emulator's runtime: the block scheduler (threads as fibers that
 * run from barrier to barrier), the runtime API over host memory, and cuBLAS
 * GEMMs through OpenBLAS. See cuda_emu.h for what it covers. Test tool only.
 *
 * Scheduling a block: every thread is a fiber with its own stack. The
 * scheduler resumes each runnable fiber in turn; a fiber runs until it
 * returns or reaches a barrier, where it records what it waits for and
 * switches back. A thread that returns hands its stack to the next thread
 * if that one has not started yet, which then runs there at once, in the
 * order the scheduler would have run it: a block of a kernel without
 * barriers runs on one fiber, two switches in all, not two per thread.
 * When no fiber is runnable the scheduler releases, first, every warp
 * whose participating lanes have all reached a warp operation (computing
 * each lane's shuffle result or ballot before any of them runs on, so a
 * lane that races ahead to the next shuffle cannot overwrite a value
 * another lane has still to read), then, if every live thread waits at
 * __syncthreads, the block barrier (threads that returned count as
 * arrived, as on the hardware). If neither applies the block is
 * deadlocked: the launch fails with a message saying who waits where. */
#include "cuda_emu.h"

#include <cblas.h>
#include <errno.h>
#include <omp.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <vector>

#if !defined(__x86_64__)
#include <ucontext.h>
#endif

/* ---- fibers ------------------------------------------------------------------ */

/* Each fiber's stack; kernels are C-like and keep little on the stack. */
enum { FIBER_STACK = 64 * 1024, PAGE = 4096, MAX_THREADS = 1024, WARP = 32 };

#if defined(__x86_64__)
/* A context is the saved stack pointer; the callee-saved registers sit on
 * the stack it points at. MXCSR and the x87 control word are not switched:
 * nothing in the process changes them (no rounding mode, no flush to zero),
 * so every fiber runs under its OS thread's, and saving and loading them
 * was most of a switch's time (ldmxcsr and stmxcsr stall). */
struct fiber_ctx {
    void *sp;
};
extern "C" void cuda_emu_switch(fiber_ctx *from, fiber_ctx *to);
__asm__(".text\n"
        ".globl cuda_emu_switch\n"
        ".type cuda_emu_switch,@function\n"
        "cuda_emu_switch:\n"
        "  pushq %rbp\n"
        "  pushq %rbx\n"
        "  pushq %r12\n"
        "  pushq %r13\n"
        "  pushq %r14\n"
        "  pushq %r15\n"
        "  movq %rsp, (%rdi)\n"
        "  movq (%rsi), %rsp\n"
        "  popq %r15\n"
        "  popq %r14\n"
        "  popq %r13\n"
        "  popq %r12\n"
        "  popq %rbx\n"
        "  popq %rbp\n"
        "  ret\n"
        ".size cuda_emu_switch, .-cuda_emu_switch\n"
        ".section .note.GNU-stack,\"\",@progbits\n"
        ".text\n");

static void fiber_entry(void);

/* Lays out a fresh stack so that switching to it "returns" into
 * fiber_entry with the stack aligned as after a call. */
static void fiber_init(fiber_ctx *c, char *stack_top) {
    uint64_t *sp = (uint64_t *)((uintptr_t)stack_top & ~(uintptr_t)15);
    *--sp = 0;                      /* fiber_entry's return address: it never returns */
    *--sp = (uint64_t)&fiber_entry; /* where cuda_emu_switch's ret goes */
    for (int i = 0; i < 6; i++)
        *--sp = 0; /* rbp rbx r12 r13 r14 r15 */
    c->sp = sp;
}
static inline void fiber_switch(fiber_ctx *from, fiber_ctx *to) { cuda_emu_switch(from, to); }
#else
struct fiber_ctx {
    ucontext_t uc;
};
static void fiber_entry(void);
static void fiber_init(fiber_ctx *c, char *stack_top) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = stack_top - FIBER_STACK;
    c->uc.uc_stack.ss_size = FIBER_STACK;
    c->uc.uc_link = NULL;
    makecontext(&c->uc, fiber_entry, 0);
}
static inline void fiber_switch(fiber_ctx *from, fiber_ctx *to) { swapcontext(&from->uc, &to->uc); }
#endif

/* ---- the per-OS-thread block scheduler ------------------------------------------ */

enum thread_state { T_NOT_STARTED, T_RUNNABLE, T_AT_SYNCTHREADS, T_AT_WARP, T_DONE };

struct emu_thread {
    fiber_ctx ctx;
    thread_state state;
    uint3 tid;
    /* while T_AT_WARP: */
    cuda_emu_warp_op op;
    unsigned mask;
    uint64_t value;
    int src;
    uint64_t result;
};

struct scheduler {
    char *stacks; /* MAX_THREADS stacks, each above a PROT_NONE guard page */
    emu_thread *threads;
    int n_threads, current;
    fiber_ctx main_ctx;
    void (*body)(void *);
    void *ctx;
    void *dyn_smem; /* dynamic shared memory, allocated at its largest size */
    size_t dyn_smem_cap;
};

static __thread scheduler *tls_sched;
__thread uint3 threadIdx;
__thread uint3 blockIdx;
__thread dim3 blockDim;
__thread dim3 gridDim;
static __thread void *tls_dyn_smem;

void *cuda_emu_dynamic_shared(void) { return tls_dyn_smem; }

static scheduler *scheduler_get(void) {
    if (tls_sched)
        return tls_sched;
    scheduler *s = (scheduler *)calloc(1, sizeof *s);
    const size_t per = FIBER_STACK + PAGE, total = per * MAX_THREADS;
    void *mem = mmap(NULL, total, PROT_READ | PROT_WRITE,
                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (!s || mem == MAP_FAILED) {
        fprintf(stderr, "cuda_emu: cannot map %zu bytes of fiber stacks: %s\n", total,
                strerror(errno));
        abort();
    }
    for (int i = 0; i < MAX_THREADS; i++) /* overflowing a stack faults instead of corrupting */
        mprotect((char *)mem + (size_t)i * per, PAGE, PROT_NONE);
    s->stacks = (char *)mem;
    s->threads = (emu_thread *)calloc(MAX_THREADS, sizeof(emu_thread));
    tls_sched = s;
    return s;
}

/* The first thread from i on that can run in this pass, its fiber set up if
 * it had not started; -1 when none is left. */
static int next_in_pass(scheduler *s, int i) {
    for (; i < s->n_threads; i++) {
        emu_thread *t = &s->threads[i];
        if (t->state == T_NOT_STARTED) {
            t->state = T_RUNNABLE;
            fiber_init(&t->ctx, s->stacks + (size_t)(i + 1) * (FIBER_STACK + PAGE));
            return i;
        }
        if (t->state == T_RUNNABLE)
            return i;
    }
    return -1;
}

static void switch_to(scheduler *s, fiber_ctx *from, int next) {
    s->current = next;
    threadIdx = s->threads[next].tid;
    fiber_switch(from, &s->threads[next].ctx);
}

/* Leaves the fiber whose context is from for the next thread of the pass,
 * or for the scheduler when the pass is over. A pass runs the threads in
 * index order, each until it waits at a barrier or returns, as when the
 * scheduler switched to each in turn; switching from thread to thread
 * directly takes one switch a thread instead of two, and each switch
 * returns to the call site it left from (the barrier they all wait at),
 * which the CPU predicts, where returns into the scheduler and back it did
 * not (make test-backend's emulated runs took 126 s of CPU against 172 on a
 * 2-core AVX2 machine). The order of execution, and so every result, is the
 * same. */
static void pass_on(scheduler *s, fiber_ctx *from) {
    const int next = next_in_pass(s, s->current + 1);
    if (next < 0)
        fiber_switch(from, &s->main_ctx);
    else
        switch_to(s, from, next);
}

/* Runs the thread the pass started, then each following thread that has
 * not started yet, until one waits at a barrier (it switches out from
 * inside the body, and this fiber is that thread's from then on) or the
 * next has started already. */
static void fiber_entry(void) {
    scheduler *s = tls_sched;
    for (;;) {
        s->body(s->ctx);
        const int i = s->current;
        s->threads[i].state = T_DONE;
        if (i + 1 == s->n_threads || s->threads[i + 1].state != T_NOT_STARTED)
            break;
        s->current = i + 1;
        s->threads[i + 1].state = T_RUNNABLE;
        threadIdx = s->threads[i + 1].tid;
    }
    pass_on(s, &s->threads[s->current].ctx);
    abort(); /* a finished fiber is never resumed */
}

/* Called by a thread at a barrier: records nothing more, switches out. */
static void switch_out(scheduler *s) { pass_on(s, &s->threads[s->current].ctx); }

void __syncthreads(void) {
    scheduler *s = tls_sched;
    s->threads[s->current].state = T_AT_SYNCTHREADS;
    switch_out(s);
}

int cuda_emu_lane(void) { return tls_sched->current % WARP; }

uint64_t cuda_emu_warp_sync(cuda_emu_warp_op op, unsigned mask, uint64_t value, int src) {
    scheduler *s = tls_sched;
    emu_thread *t = &s->threads[s->current];
    t->state = T_AT_WARP;
    t->op = op;
    t->mask = mask;
    t->value = value;
    t->src = src;
    switch_out(s);
    return t->result;
}

void __syncwarp(unsigned mask) { cuda_emu_warp_sync(CUDA_EMU_SYNCWARP, mask, 0, 0); }

/* Releases every lane at a warp operation whose mask names only lanes that
 * are at one too; returns how many threads it released, or 0 with a
 * message in fault on misuse (a mask without the caller's own lane, a mask
 * naming lanes that returned, lanes of one mask at different operations). */
static int release_warps(scheduler *s, char *fault, size_t fault_len) {
    int released = 0;
    for (int w0 = 0; w0 < s->n_threads; w0 += WARP) {
        const int n = s->n_threads - w0 < WARP ? s->n_threads - w0 : WARP;
        emu_thread *lanes = s->threads + w0;
        unsigned waiting = 0, exited = 0, ready = 0;
        for (int l = 0; l < n; l++) {
            if (lanes[l].state == T_AT_WARP)
                waiting |= 1u << l;
            if (lanes[l].state == T_DONE)
                exited |= 1u << l;
        }
        if (!waiting)
            continue;
        /* Lanes past the end of a partial last warp do not exist: a full
         * mask there names only the lanes that do. */
        const unsigned exists = n == WARP ? 0xffffffffu : (1u << n) - 1u;
        for (int l = 0; l < n; l++) {
            if (!(waiting >> l & 1u))
                continue;
            const unsigned m = lanes[l].mask & exists;
            if (!(m >> l & 1u)) {
                snprintf(fault, fault_len,
                         "thread %d: warp operation with mask 0x%08x leaves out its own lane",
                         w0 + l, lanes[l].mask);
                return 0;
            }
            if (m & exited) {
                snprintf(fault, fault_len,
                         "thread %d: warp operation with mask 0x%08x names lanes that have "
                         "returned (0x%08x)",
                         w0 + l, lanes[l].mask, m & exited);
                return 0;
            }
            if ((m & waiting) == m)
                ready |= 1u << l;
        }
        /* A mask's lanes are checked and its ballot taken once: the lanes
         * that share it (a whole warp, mostly) find them here. Every lane of
         * a checked mask is at the first checker's operation, so a later
         * lane with the same mask would pass the same check. */
        unsigned checked = 0;
        uint64_t ballot = 0;
        int have = 0;
        for (int l = 0; l < n; l++) {
            if (!(ready >> l & 1u))
                continue;
            emu_thread *t = &lanes[l];
            const unsigned m = t->mask & exists;
            if (!have || m != checked) {
                ballot = 0;
                for (int j = 0; j < n; j++) {
                    if (!(m >> j & 1u))
                        continue;
                    if (lanes[j].op != t->op) {
                        snprintf(fault, fault_len,
                                 "warp %d: lanes %d and %d of one mask reached different warp "
                                 "operations (divergent shuffle, vote or __syncwarp)",
                                 w0 / WARP, l, j);
                        return 0;
                    }
                    if (lanes[j].value)
                        ballot |= 1ull << j;
                }
                checked = m;
                have = 1;
            }
            if (t->op == CUDA_EMU_BALLOT)
                t->result = ballot;
            else if (t->op == CUDA_EMU_SHFL)
                t->result = t->src >= 0 && t->src < n && (waiting >> t->src & 1u)
                                ? lanes[t->src].value
                                : t->value;
            else
                t->result = 0;
        }
        /* Results are all computed before any lane runs on. */
        for (int l = 0; l < n; l++)
            if (ready >> l & 1u) {
                lanes[l].state = T_RUNNABLE;
                released++;
            }
    }
    return released;
}

/* Runs one block to completion; returns 0, or -1 with a message in fault. */
static int run_block(scheduler *s, char *fault, size_t fault_len) {
    const int n = s->n_threads;
    uint3 tid = {0, 0, 0}; /* thread i's index, x fastest, counted rather than divided */
    for (int i = 0; i < n; i++) {
        emu_thread *t = &s->threads[i];
        t->state = T_NOT_STARTED;
        t->tid = tid;
        if (++tid.x == blockDim.x) {
            tid.x = 0;
            if (++tid.y == blockDim.y) {
                tid.y = 0;
                tid.z++;
            }
        }
    }
    for (;;) {
        const int first = next_in_pass(s, 0); /* a pass: the threads switch on among themselves */
        if (first >= 0)
            switch_to(s, &s->main_ctx, first);
        int done = 0, at_sync = 0;
        for (int i = 0; i < n; i++) {
            done += s->threads[i].state == T_DONE;
            at_sync += s->threads[i].state == T_AT_SYNCTHREADS;
        }
        if (done == n)
            return 0;
        fault[0] = 0;
        if (release_warps(s, fault, fault_len))
            continue;
        if (fault[0])
            return -1;
        if (at_sync + done == n) {
            for (int i = 0; i < n; i++)
                if (s->threads[i].state == T_AT_SYNCTHREADS)
                    s->threads[i].state = T_RUNNABLE;
            continue;
        }
        int at_warp = n - done - at_sync, first_warp = -1, first_sync = -1;
        for (int i = 0; i < n; i++) {
            if (first_warp < 0 && s->threads[i].state == T_AT_WARP)
                first_warp = i;
            if (first_sync < 0 && s->threads[i].state == T_AT_SYNCTHREADS)
                first_sync = i;
        }
        snprintf(fault, fault_len,
                 "deadlock: %d threads wait at a warp operation (first: thread %d, mask 0x%08x), "
                 "%d at __syncthreads (first: thread %d), %d returned",
                 at_warp, first_warp, first_warp >= 0 ? s->threads[first_warp].mask : 0, at_sync,
                 first_sync, done);
        return -1;
    }
}

/* ---- errors ---------------------------------------------------------------------- */

static std::mutex g_lock;                  /* guards everything below and the allocation map */
static cudaError_t g_last = cudaSuccess;   /* for cudaGetLastError */
static cudaError_t g_sticky = cudaSuccess; /* a kernel fault: every call fails until reset */
static char g_fault[512];
static unsigned long long g_launches;
/* A planted fault (cuda_emu_fault_launch): launches to let through first, then the error;
 * g_planted_async: fired as cuda_emu_fault_launch_async says, through g_pending. */
static cudaError_t g_planted = cudaSuccess;
static unsigned long long g_planted_after;
static int g_planted_async;
/* An asynchronous fault that has happened but that no call has reported yet. */
static cudaError_t g_pending = cudaSuccess;

static cudaError_t set_error(cudaError_t e) {
    if (e != cudaSuccess)
        g_last = e;
    return e;
}

/* A pending asynchronous fault becomes the sticky error at the first call
 * that touches the device after it. Caller holds g_lock. */
static void surface_pending(void) {
    if (g_pending != cudaSuccess && g_sticky == cudaSuccess)
        g_sticky = g_pending;
    g_pending = cudaSuccess;
}

/* Every API call returns the sticky error first, as a faulted context does. */
#define STICKY_CHECK()                                                                             \
    do {                                                                                           \
        surface_pending();                                                                         \
        if (g_sticky != cudaSuccess)                                                               \
            return g_sticky;                                                                       \
    } while (0)

const char *cuda_emu_last_fault(void) { return g_fault; }
unsigned long long cuda_emu_launch_count(void) { return g_launches; }

void cuda_emu_fault_launch(unsigned long long after, cudaError_t error) {
    std::lock_guard<std::mutex> lk(g_lock);
    g_planted = error;
    g_planted_after = after;
    g_planted_async = 0;
}

void cuda_emu_fault_launch_async(unsigned long long after, cudaError_t error) {
    std::lock_guard<std::mutex> lk(g_lock);
    g_planted = error;
    g_planted_after = after;
    g_planted_async = 1;
}

cudaError_t cudaGetLastError(void) {
    std::lock_guard<std::mutex> lk(g_lock);
    if (g_sticky != cudaSuccess)
        return g_sticky;
    cudaError_t e = g_last;
    g_last = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError(void) {
    std::lock_guard<std::mutex> lk(g_lock);
    return g_sticky != cudaSuccess ? g_sticky : g_last;
}

const char *cudaGetErrorName(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "cudaSuccess";
    case cudaErrorInvalidValue:
        return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
        return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError:
        return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration:
        return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidDevicePointer:
        return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
        return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
        return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
        return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
        return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
        return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
        return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources:
        return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchFailure:
        return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported:
        return "cudaErrorNotSupported";
    case cudaErrorIllegalState:
        return "cudaErrorIllegalState";
    case cudaErrorStreamCaptureUnsupported:
        return "cudaErrorStreamCaptureUnsupported";
    case cudaErrorStreamCaptureInvalidated:
        return "cudaErrorStreamCaptureInvalidated";
    case cudaErrorStreamCaptureWrongThread:
        return "cudaErrorStreamCaptureWrongThread";
    case cudaErrorGraphExecUpdateFailure:
        return "cudaErrorGraphExecUpdateFailure";
    case cudaErrorUnknown:
        return "cudaErrorUnknown";
    }
    return "cudaErrorUnknown";
}

/* CUDA's own wording, where the emulator has the error. */
const char *cudaGetErrorString(cudaError_t e) {
    switch (e) {
    case cudaSuccess:
        return "no error";
    case cudaErrorInvalidValue:
        return "invalid argument";
    case cudaErrorMemoryAllocation:
        return "out of memory";
    case cudaErrorInitializationError:
        return "initialization error";
    case cudaErrorInvalidConfiguration:
        return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
        return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
        return "invalid copy direction for memcpy";
    case cudaErrorNoDevice:
        return "no CUDA-capable device is detected";
    case cudaErrorInvalidDevice:
        return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
        return "invalid resource handle";
    case cudaErrorNotReady:
        return "device not ready";
    case cudaErrorIllegalAddress:
        return "an illegal memory access was encountered";
    case cudaErrorLaunchOutOfResources:
        return "too many resources requested for launch";
    case cudaErrorLaunchFailure:
        return "unspecified launch failure";
    case cudaErrorNotSupported:
        return "operation not supported";
    case cudaErrorIllegalState:
        return "the operation cannot be performed in the present state";
    case cudaErrorStreamCaptureUnsupported:
        return "operation not permitted when stream is capturing";
    case cudaErrorStreamCaptureInvalidated:
        return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureWrongThread:
        return "attempt to terminate a thread-local capture sequence from another thread";
    case cudaErrorGraphExecUpdateFailure:
        return "the graph update was not performed because it included changes which violated "
               "constraints specific to instantiated graph update";
    case cudaErrorUnknown:
        return "unknown error";
    }
    return "unknown error";
}

/* ---- launches -------------------------------------------------------------------------- */

struct emu_node {
    cuda_emu_node_kind kind;
    std::function<cudaError_t()> run;
};
struct CUgraph_st {
    unsigned magic;
    std::vector<emu_node> nodes;
};
struct CUgraphExec_st {
    unsigned magic;
    std::vector<emu_node> nodes;
};
struct CUstream_st {
    unsigned magic;
    /* While capturing: the graph being recorded, the thread that began it,
     * and whether a forbidden call has invalidated it. */
    CUgraph_st *capture;
    pthread_t capture_thread;
    cudaStreamCaptureMode capture_mode;
    int invalidated;
};
struct CUevent_st {
    unsigned magic;
    struct timespec at;
};
enum {
    STREAM_MAGIC = 0x57e4a11u,
    EVENT_MAGIC = 0xe7e47u,
    GRAPH_MAGIC = 0x96a9u,
    EXEC_MAGIC = 0xe8ecu,
    DEAD_MAGIC = 0xdeadu
};

static int stream_ok(cudaStream_t s) { return s == NULL || s->magic == STREAM_MAGIC; }

/* CUDA's limits for sm_80/sm_90: 1024 threads per block, (1024, 1024, 64)
 * per dimension, grid (2^31 - 1, 65535, 65535), 48 KiB of dynamic shared
 * memory without the opt-in attribute (which the backend does not use). */
enum { MAX_DYN_SMEM = 48 * 1024 };

static int n_workers(void) {
    static int n = -1;
    if (n < 0) {
        const char *env = getenv("CUDA_EMU_THREADS");
        n = env && atoi(env) > 0 ? atoi(env) : omp_get_max_threads();
    }
    return n;
}

/* Caller holds g_lock. */
static cudaError_t launch_config_error(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream) {
    const unsigned long long nt = (unsigned long long)block.x * block.y * block.z;
    if (nt == 0 || nt > MAX_THREADS || block.x > 1024 || block.y > 1024 || block.z > 64 ||
        grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7fffffffu || grid.y > 65535 ||
        grid.z > 65535)
        return set_error(cudaErrorInvalidConfiguration);
    if (shmem > MAX_DYN_SMEM)
        return set_error(cudaErrorInvalidValue);
    if (!stream_ok(stream))
        return set_error(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cuda_emu_launch_config(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    return launch_config_error(grid, block, shmem, stream);
}

cudaError_t cuda_emu_run(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                         void (*body)(void *), void *ctx) {
    {
        std::lock_guard<std::mutex> lk(g_lock);
        STICKY_CHECK();
        const cudaError_t config = launch_config_error(grid, block, shmem, stream);
        if (config != cudaSuccess)
            return config;
        if (g_planted != cudaSuccess && g_planted_after-- == 0) {
            snprintf(g_fault, sizeof g_fault, "%s: a planted fault (%s)", name,
                     g_planted_async ? "cuda_emu_fault_launch_async" : "cuda_emu_fault_launch");
            fprintf(stderr, "cuda_emu: kernel fault in %s\n", g_fault);
            const cudaError_t e = g_planted;
            g_planted = cudaSuccess;
            if (g_planted_async) { /* the launch went through; the kernel faults later */
                g_pending = e;
                return cudaSuccess;
            }
            g_sticky = e;
            return set_error(g_sticky);
        }
        g_launches++;
    }
    const long long n_blocks = (long long)grid.x * grid.y * grid.z;
    const int workers = n_blocks < n_workers() ? (int)n_blocks : n_workers();
    int failed = 0;
    char fault[400] = "";
#pragma omp parallel num_threads(workers)
    {
        scheduler *s = scheduler_get();
        if (s->dyn_smem_cap < shmem || !s->dyn_smem) {
            free(s->dyn_smem);
            s->dyn_smem_cap = MAX_DYN_SMEM;
            s->dyn_smem = aligned_alloc(64, MAX_DYN_SMEM);
        }
        s->n_threads = (int)(block.x * block.y * block.z);
        s->body = body;
        s->ctx = ctx;
        tls_dyn_smem = s->dyn_smem;
        blockDim = block;
        gridDim = grid;
        char my_fault[400];
#pragma omp for schedule(dynamic, 1)
        for (long long b = 0; b < n_blocks; b++) {
            if (__atomic_load_n(&failed, __ATOMIC_RELAXED))
                continue;
            blockIdx.x = (unsigned)(b % grid.x);
            blockIdx.y = (unsigned)((b / grid.x) % grid.y);
            blockIdx.z = (unsigned)(b / ((long long)grid.x * grid.y));
            if (shmem)
                memset(s->dyn_smem, 0xff, shmem);
            if (run_block(s, my_fault, sizeof my_fault) != 0) {
                std::lock_guard<std::mutex> lk(g_lock);
                if (!failed) {
                    snprintf(fault, sizeof fault, "block (%u,%u,%u): %s", blockIdx.x, blockIdx.y,
                             blockIdx.z, my_fault);
                    __atomic_store_n(&failed, 1, __ATOMIC_RELAXED);
                }
            }
        }
    }
    if (failed) {
        std::lock_guard<std::mutex> lk(g_lock);
        snprintf(g_fault, sizeof g_fault, "%s: %s", name, fault);
        fprintf(stderr, "cuda_emu: kernel fault in %s\n", g_fault);
        g_sticky = cudaErrorLaunchFailure;
        return set_error(cudaErrorLaunchFailure);
    }
    return cudaSuccess;
}

/* ---- capture state ----------------------------------------------------------------------- */

/* The streams capturing now (under g_lock). */
static std::vector<cudaStream_t> g_capturing;

static int captured_by_me(cudaStream_t s) {
    return s && s->capture && pthread_equal(s->capture_thread, pthread_self());
}

/* A synchronising call while captures run: as CUDA's capture modes say,
 * it fails where a capture forbids it (a global one: from any thread; a
 * thread-local one: from its own thread; a relaxed one: never), and the
 * captures that forbid it are invalidated (cudaStreamEndCapture then
 * fails). Caller holds g_lock. */
static cudaError_t capture_forbids(void) {
    int any = 0;
    for (cudaStream_t s : g_capturing)
        if (s->capture_mode == cudaStreamCaptureModeGlobal ||
            (s->capture_mode == cudaStreamCaptureModeThreadLocal && captured_by_me(s)))
            s->invalidated = any = 1;
    return any ? set_error(cudaErrorStreamCaptureUnsupported) : cudaSuccess;
}

/* ---- devices ----------------------------------------------------------------------------- */

static size_t g_total = (size_t)16 << 30, g_used;
/* Live allocations by base address, so copies and frees can be checked. */
static std::map<uintptr_t, size_t> g_allocs;

/* Allocations up to this size are filled with 0xff bytes (NaN floats) so a
 * kernel that reads what nobody wrote shows it; larger ones (a backend
 * reserving most of the pretend device) are mapped lazily and read as
 * zeros, so that they cost no time or memory until used. */
#define POISON_MAX ((size_t)1 << 30)

void cuda_emu_set_device_memory(size_t total_bytes) {
    std::lock_guard<std::mutex> lk(g_lock);
    g_total = total_bytes;
}

size_t cuda_emu_allocated_bytes(void) {
    std::lock_guard<std::mutex> lk(g_lock);
    return g_used;
}

cudaError_t cudaGetDeviceCount(int *count) {
    if (!count)
        return set_error(cudaErrorInvalidValue);
    *count = 1;
    return cudaSuccess;
}

static int g_device;

cudaError_t cudaSetDevice(int device) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (device != 0)
        return set_error(cudaErrorInvalidDevice);
    g_device = device;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    if (!device)
        return set_error(cudaErrorInvalidValue);
    *device = g_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    if (!prop)
        return set_error(cudaErrorInvalidValue);
    if (device != 0)
        return set_error(cudaErrorInvalidDevice);
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "cuda_emu (CPU emulation)");
    prop->totalGlobalMem = g_total;
    prop->sharedMemPerBlock = MAX_DYN_SMEM;
    prop->warpSize = WARP;
    prop->maxThreadsPerBlock = MAX_THREADS;
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7fffffff;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = n_workers();
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *version) {
    if (!version)
        return set_error(cudaErrorInvalidValue);
    *version = 13000;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version) { return cudaDriverGetVersion(version); }

cudaError_t cudaDeviceSynchronize(void) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    return capture_forbids();
}

cudaError_t cudaDeviceReset(void) {
    std::lock_guard<std::mutex> lk(g_lock);
    g_sticky = cudaSuccess;
    g_last = cudaSuccess;
    g_fault[0] = 0;
    g_planted = cudaSuccess;
    g_pending = cudaSuccess;
    return cudaSuccess;
}

/* ---- memory ------------------------------------------------------------------------------ */

cudaError_t cudaMalloc(void **p, size_t bytes) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (capture_forbids() != cudaSuccess)
        return cudaErrorStreamCaptureUnsupported;
    if (!p)
        return set_error(cudaErrorInvalidValue);
    *p = NULL;
    if (bytes == 0)
        return cudaSuccess; /* as CUDA: success, a NULL pointer */
    if (bytes > g_total - g_used)
        return set_error(cudaErrorMemoryAllocation);
    const size_t rounded = (bytes + 255) & ~(size_t)255; /* 256-byte aligned, as cudaMalloc */
    void *mem;
    if (rounded <= POISON_MAX) {
        mem = aligned_alloc(256, rounded);
        if (mem)
            memset(mem, 0xff, rounded);
    } else {
        mem = mmap(NULL, rounded, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        mem = mem == MAP_FAILED ? NULL : mem;
    }
    if (!mem)
        return set_error(cudaErrorMemoryAllocation);
    g_allocs[(uintptr_t)mem] = bytes;
    g_used += bytes;
    *p = mem;
    return cudaSuccess;
}

cudaError_t cudaFree(void *p) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (capture_forbids() != cudaSuccess)
        return cudaErrorStreamCaptureUnsupported;
    if (!p)
        return cudaSuccess;
    auto it = g_allocs.find((uintptr_t)p);
    if (it == g_allocs.end())
        return set_error(cudaErrorInvalidValue);
    const size_t rounded = (it->second + 255) & ~(size_t)255;
    g_used -= it->second;
    g_allocs.erase(it);
    if (rounded <= POISON_MAX)
        free(p);
    else
        munmap(p, rounded);
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void **p, size_t bytes) {
    if (!p)
        return set_error(cudaErrorInvalidValue);
    *p = malloc(bytes ? bytes : 1);
    return *p ? cudaSuccess : set_error(cudaErrorMemoryAllocation);
}

cudaError_t cudaFreeHost(void *p) {
    free(p);
    return cudaSuccess;
}

cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (!free_bytes || !total_bytes)
        return set_error(cudaErrorInvalidValue);
    *free_bytes = g_total - g_used;
    *total_bytes = g_total;
    return cudaSuccess;
}

/* Whether [p, p + bytes) lies inside one live allocation. Caller holds g_lock. */
static int device_range_ok(const void *p, size_t bytes) {
    auto it = g_allocs.upper_bound((uintptr_t)p);
    if (it == g_allocs.begin())
        return 0;
    --it;
    const uintptr_t lo = it->first, hi = lo + it->second, a = (uintptr_t)p;
    return a >= lo && a <= hi && bytes <= hi - a;
}

/* A copy, done now. Caller holds g_lock. */
static cudaError_t copy_now(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    STICKY_CHECK();
    if (bytes == 0)
        return cudaSuccess;
    if (!dst || !src)
        return set_error(cudaErrorInvalidValue);
    const int dst_dev = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    const int src_dev = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind > cudaMemcpyDefault)
        return set_error(cudaErrorInvalidMemcpyDirection);
    if ((dst_dev && !device_range_ok(dst, bytes)) || (src_dev && !device_range_ok(src, bytes)))
        return set_error(cudaErrorInvalidValue);
    memmove(dst, src, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (capture_forbids() != cudaSuccess)
        return cudaErrorStreamCaptureUnsupported;
    return copy_now(dst, src, bytes, kind);
}

/* Caller holds g_lock. */
static cudaError_t memset_now(void *p, int value, size_t bytes) {
    STICKY_CHECK();
    if (bytes == 0)
        return cudaSuccess;
    if (!device_range_ok(p, bytes))
        return set_error(cudaErrorInvalidValue);
    memset(p, value, bytes);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) {
    if (!stream_ok(stream))
        return set_error(cudaErrorInvalidResourceHandle);
    if (cuda_emu_capturing(stream)) {
        if (kind != cudaMemcpyDeviceToDevice) {
            std::lock_guard<std::mutex> lk(g_lock);
            stream->invalidated = 1;
            return set_error(cudaErrorStreamCaptureUnsupported);
        }
        return cuda_emu_capture(stream, CUDA_EMU_NODE_COPY, [=]() {
            std::lock_guard<std::mutex> lk(g_lock);
            return copy_now(dst, src, bytes, kind);
        });
    }
    std::lock_guard<std::mutex> lk(g_lock);
    return copy_now(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void *p, int value, size_t bytes) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (capture_forbids() != cudaSuccess)
        return cudaErrorStreamCaptureUnsupported;
    return memset_now(p, value, bytes);
}

cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream) {
    if (!stream_ok(stream))
        return set_error(cudaErrorInvalidResourceHandle);
    if (cuda_emu_capturing(stream))
        return cuda_emu_capture(stream, CUDA_EMU_NODE_MEMSET, [=]() {
            std::lock_guard<std::mutex> lk(g_lock);
            return memset_now(p, value, bytes);
        });
    std::lock_guard<std::mutex> lk(g_lock);
    return memset_now(p, value, bytes);
}

/* ---- streams and events: work is done when it is issued ---------------------------- */

cudaError_t cudaStreamCreate(cudaStream_t *stream) { return cudaStreamCreateWithFlags(stream, 0); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (!stream || flags > cudaStreamNonBlocking)
        return set_error(cudaErrorInvalidValue);
    *stream = (cudaStream_t)calloc(1, sizeof **stream);
    (*stream)->magic = STREAM_MAGIC;
    return cudaSuccess;
}

cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    if (!stream || stream->magic != STREAM_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    stream->magic = DEAD_MAGIC;
    free(stream);
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (!stream_ok(stream))
        return set_error(cudaErrorInvalidResourceHandle);
    if (stream && stream->capture) {
        stream->invalidated = 1;
        return set_error(cudaErrorStreamCaptureUnsupported);
    }
    return capture_forbids();
}

/* ---- graphs: a capture records, a launch replays ------------------------------------- */

int cuda_emu_capturing(cudaStream_t stream) {
    std::lock_guard<std::mutex> lk(g_lock);
    return stream && stream->magic == STREAM_MAGIC && stream->capture;
}

cudaError_t cuda_emu_capture(cudaStream_t stream, cuda_emu_node_kind kind,
                             std::function<cudaError_t()> run) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (!stream_ok(stream) || !stream || !stream->capture)
        return set_error(cudaErrorInvalidResourceHandle);
    stream->capture->nodes.push_back(emu_node{kind, std::move(run)});
    return cudaSuccess;
}

static int g_refuse_capture;

void cuda_emu_refuse_capture(int refuse) {
    std::lock_guard<std::mutex> lk(g_lock);
    g_refuse_capture = refuse;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    std::lock_guard<std::mutex> lk(g_lock);
    STICKY_CHECK();
    if (g_refuse_capture)
        return set_error(cudaErrorNotSupported);
    if (!stream_ok(stream) || mode > cudaStreamCaptureModeRelaxed)
        return set_error(cudaErrorInvalidValue);
    if (!stream) /* the legacy default stream cannot be captured */
        return set_error(cudaErrorStreamCaptureUnsupported);
    if (stream->capture)
        return set_error(cudaErrorIllegalState);
    stream->capture = new CUgraph_st{GRAPH_MAGIC, {}};
    stream->capture_thread = pthread_self();
    stream->capture_mode = mode;
    stream->invalidated = 0;
    g_capturing.push_back(stream);
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph) {
    std::lock_guard<std::mutex> lk(g_lock);
    if (!graph || !stream_ok(stream) || !stream)
        return set_error(cudaErrorInvalidValue);
    *graph = NULL;
    if (!stream->capture)
        return set_error(cudaErrorIllegalState);
    if (stream->capture_mode != cudaStreamCaptureModeRelaxed && !captured_by_me(stream))
        return set_error(cudaErrorStreamCaptureWrongThread);
    CUgraph_st *g = stream->capture;
    const int invalidated = stream->invalidated;
    stream->capture = NULL;
    for (size_t i = 0; i < g_capturing.size(); i++)
        if (g_capturing[i] == stream) {
            g_capturing.erase(g_capturing.begin() + (long)i);
            break;
        }
    if (invalidated) {
        delete g;
        return set_error(cudaErrorStreamCaptureInvalidated);
    }
    *graph = g;
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status) {
    std::lock_guard<std::mutex> lk(g_lock);
    if (!status || !stream_ok(stream))
        return set_error(cudaErrorInvalidValue);
    *status = !stream || !stream->capture ? cudaStreamCaptureStatusNone
              : stream->invalidated       ? cudaStreamCaptureStatusInvalidated
                                          : cudaStreamCaptureStatusActive;
    return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *n_nodes) {
    if (!graph || graph->magic != GRAPH_MAGIC || !n_nodes || nodes)
        return set_error(cudaErrorInvalidValue);
    *n_nodes = graph->nodes.size();
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags) {
    if (!exec || !graph || graph->magic != GRAPH_MAGIC || flags)
        return set_error(cudaErrorInvalidValue);
    *exec = new CUgraphExec_st{EXEC_MAGIC, graph->nodes};
    return cudaSuccess;
}

cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info) {
    if (!exec || exec->magic != EXEC_MAGIC || !graph || graph->magic != GRAPH_MAGIC || !info)
        return set_error(cudaErrorInvalidValue);
    *info = cudaGraphExecUpdateResultInfo{cudaGraphExecUpdateSuccess, NULL, NULL};
    if (exec->nodes.size() != graph->nodes.size())
        info->result = cudaGraphExecUpdateErrorTopologyChanged;
    for (size_t i = 0; i < exec->nodes.size() && !info->result; i++)
        if (exec->nodes[i].kind != graph->nodes[i].kind)
            info->result = cudaGraphExecUpdateErrorNodeTypeChanged;
    if (info->result)
        return set_error(cudaErrorGraphExecUpdateFailure);
    exec->nodes = graph->nodes;
    return cudaSuccess;
}

cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) {
    {
        std::lock_guard<std::mutex> lk(g_lock);
        STICKY_CHECK();
        if (!exec || exec->magic != EXEC_MAGIC || !stream_ok(stream))
            return set_error(cudaErrorInvalidResourceHandle);
        if (stream && stream->capture) /* a graph inside a capture: not needed, not emulated */
            return set_error(cudaErrorNotSupported);
    }
    for (const emu_node &n : exec->nodes) {
        const cudaError_t e = n.run();
        if (e != cudaSuccess) {
            std::lock_guard<std::mutex> lk(g_lock);
            if (g_sticky == cudaSuccess) /* a replayed node that fails faults the context */
                g_sticky = e;
            return set_error(e);
        }
    }
    return cudaSuccess;
}

/* A graph or an instantiated graph, checked by its magic, then freed. */
template <typename T> static cudaError_t destroy_handle(T *h, unsigned magic) {
    if (!h || h->magic != magic)
        return set_error(cudaErrorInvalidValue);
    h->magic = DEAD_MAGIC;
    delete h;
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) { return destroy_handle(graph, GRAPH_MAGIC); }

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) { return destroy_handle(exec, EXEC_MAGIC); }

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if (!stream_ok(stream) || !event || event->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t *event) { return cudaEventCreateWithFlags(event, 0); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags) {
    if (!event)
        return set_error(cudaErrorInvalidValue);
    *event = (cudaEvent_t)calloc(1, sizeof **event);
    (*event)->magic = EVENT_MAGIC;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    if (!event || event->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    event->magic = DEAD_MAGIC;
    free(event);
    return cudaSuccess;
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (!event || event->magic != EVENT_MAGIC || !stream_ok(stream))
        return set_error(cudaErrorInvalidResourceHandle);
    clock_gettime(CLOCK_MONOTONIC, &event->at);
    return cudaSuccess;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    if (!event || event->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    return cudaSuccess;
}

cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end) {
    if (!ms || !start || !end || start->magic != EVENT_MAGIC || end->magic != EVENT_MAGIC)
        return set_error(cudaErrorInvalidResourceHandle);
    *ms = (float)((end->at.tv_sec - start->at.tv_sec) * 1e3 +
                  (end->at.tv_nsec - start->at.tv_nsec) * 1e-6);
    return cudaSuccess;
}

/* ---- cuBLAS ---------------------------------------------------------------------------- */

struct cublasContext {
    unsigned magic;
    cudaStream_t stream;
};
enum { BLAS_MAGIC = 0xb1a5u };

cublasStatus_t cublasCreate(cublasHandle_t *handle) {
    if (!handle)
        return CUBLAS_STATUS_INVALID_VALUE;
    *handle = (cublasHandle_t)calloc(1, sizeof **handle);
    if (!*handle)
        return CUBLAS_STATUS_ALLOC_FAILED;
    (*handle)->magic = BLAS_MAGIC;
    /* one OpenBLAS thread: the emulator's OS threads are the parallelism */
    openblas_set_num_threads(1);
    return CUBLAS_STATUS_SUCCESS;
}

static int blas_ok(cublasHandle_t h) { return h && h->magic == BLAS_MAGIC; }

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
    if (!blas_ok(handle))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->magic = DEAD_MAGIC;
    free(handle);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
    if (!blas_ok(handle))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    return blas_ok(handle) ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_NOT_INITIALIZED;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void *workspace, size_t bytes) {
    if (!blas_ok(handle))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    return bytes && !workspace ? CUBLAS_STATUS_INVALID_VALUE : CUBLAS_STATUS_SUCCESS;
}

const char *cublasGetStatusName(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS:
        return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "CUBLAS_STATUS_NOT_INITIALIZED";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "CUBLAS_STATUS_ALLOC_FAILED";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "CUBLAS_STATUS_INVALID_VALUE";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "CUBLAS_STATUS_ARCH_MISMATCH";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "CUBLAS_STATUS_MAPPING_ERROR";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "CUBLAS_STATUS_EXECUTION_FAILED";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "CUBLAS_STATUS_INTERNAL_ERROR";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "CUBLAS_STATUS_NOT_SUPPORTED";
    case CUBLAS_STATUS_LICENSE_ERROR:
        return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

const char *cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
    case CUBLAS_STATUS_SUCCESS:
        return "success";
    case CUBLAS_STATUS_NOT_INITIALIZED:
        return "the library was not initialized";
    case CUBLAS_STATUS_ALLOC_FAILED:
        return "the resource allocation failed";
    case CUBLAS_STATUS_INVALID_VALUE:
        return "an invalid numeric value was used as an argument";
    case CUBLAS_STATUS_ARCH_MISMATCH:
        return "an absent device architectural feature is required";
    case CUBLAS_STATUS_MAPPING_ERROR:
        return "an access to GPU memory space failed";
    case CUBLAS_STATUS_EXECUTION_FAILED:
        return "the GPU program failed to execute";
    case CUBLAS_STATUS_INTERNAL_ERROR:
        return "an internal operation failed";
    case CUBLAS_STATUS_NOT_SUPPORTED:
        return "the functionality requested is not supported";
    case CUBLAS_STATUS_LICENSE_ERROR:
        return "error detected trying to check the license";
    }
    return "unknown error";
}

/* A column-major rows x cols operand (ld >= rows) as fp32, converted from its
 * storage type. */
static float *operand_f32(const void *p, cudaDataType t, int rows, int cols, int ld) {
    const size_t n = (size_t)rows * cols;
    float *out = (float *)malloc((n ? n : 1) * sizeof(float));
    for (int c = 0; c < cols; c++)
        for (int r = 0; r < rows; r++) {
            const size_t i = (size_t)c * ld + r;
            float v;
            if (t == CUDA_R_32F)
                v = ((const float *)p)[i];
            else if (t == CUDA_R_16F)
                v = cuda_emu_f16_to_f32(((const unsigned short *)p)[i]);
            else
                v = cuda_emu_bf16_to_f32(((const unsigned short *)p)[i]);
            out[(size_t)c * rows + r] = v;
        }
    return out;
}

static cublasStatus_t gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               float alpha, const void *A, cudaDataType at, int lda, const void *B,
                               cudaDataType bt, int ldb, float beta, float *C, int ldc);

/* Checks the arguments, then runs the product (gemm_run), or records it
 * where the handle's stream is capturing. */
static cublasStatus_t gemm(cublasHandle_t h, cublasOperation_t ta, cublasOperation_t tb, int m,
                           int n, int k, float alpha, const void *A, cudaDataType at, int lda,
                           const void *B, cudaDataType bt, int ldb, float beta, float *C, int ldc) {
    if (!blas_ok(h))
        return CUBLAS_STATUS_NOT_INITIALIZED;
    if (m < 0 || n < 0 || k < 0 || (ta != CUBLAS_OP_N && ta != CUBLAS_OP_T) ||
        (tb != CUBLAS_OP_N && tb != CUBLAS_OP_T))
        return CUBLAS_STATUS_INVALID_VALUE;
    /* op(A) is m x k: A is stored m x k (N) or k x m (T), column-major. */
    const int a_rows = ta == CUBLAS_OP_N ? m : k, b_rows = tb == CUBLAS_OP_N ? k : n;
    if (lda < (a_rows > 1 ? a_rows : 1) || ldb < (b_rows > 1 ? b_rows : 1) || ldc < (m > 1 ? m : 1))
        return CUBLAS_STATUS_INVALID_VALUE;
    if (m == 0 || n == 0)
        return CUBLAS_STATUS_SUCCESS;
    if (cuda_emu_capturing(h->stream)) { /* alpha and beta are read now, as cuBLAS reads them */
        const cudaError_t e = cuda_emu_capture(h->stream, CUDA_EMU_NODE_KERNEL, [=]() {
            return gemm_run(ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ldc) ==
                           CUBLAS_STATUS_SUCCESS
                       ? cudaSuccess
                       : cudaErrorIllegalAddress;
        });
        return e == cudaSuccess ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return gemm_run(ta, tb, m, n, k, alpha, A, at, lda, B, bt, ldb, beta, C, ldc);
}

/* The product itself, its arguments checked (m, n > 0). */
static cublasStatus_t gemm_run(cublasOperation_t ta, cublasOperation_t tb, int m, int n, int k,
                               float alpha, const void *A, cudaDataType at, int lda, const void *B,
                               cudaDataType bt, int ldb, float beta, float *C, int ldc) {
    const int a_rows = ta == CUBLAS_OP_N ? m : k, a_cols = ta == CUBLAS_OP_N ? k : m;
    const int b_rows = tb == CUBLAS_OP_N ? k : n, b_cols = tb == CUBLAS_OP_N ? n : k;
    {
        std::lock_guard<std::mutex> lk(g_lock);
        surface_pending();
        if (g_sticky != cudaSuccess)
            return CUBLAS_STATUS_EXECUTION_FAILED;
        const size_t es_a = at == CUDA_R_32F ? 4 : 2, es_b = bt == CUDA_R_32F ? 4 : 2;
        if ((k > 0 && (!device_range_ok(A, ((size_t)(a_cols - 1) * lda + a_rows) * es_a) ||
                       !device_range_ok(B, ((size_t)(b_cols - 1) * ldb + b_rows) * es_b))) ||
            !device_range_ok(C, ((size_t)(n - 1) * ldc + m) * 4))
            return CUBLAS_STATUS_EXECUTION_FAILED; /* a device fault on the GPU */
    }
    if (k == 0) { /* C = beta C; beta 0 writes zeros without reading C */
        for (int c = 0; c < n; c++)
            for (int r = 0; r < m; r++) {
                float *x = C + (size_t)c * ldc + r;
                *x = beta == 0.0f ? 0.0f : beta * *x;
            }
        return CUBLAS_STATUS_SUCCESS;
    }
    float *a = operand_f32(A, at, a_rows, a_cols, lda),
          *b = operand_f32(B, bt, b_rows, b_cols, ldb);
    if (beta == 0.0f) /* cuBLAS does not read C when beta is 0: NaNs there do not leak */
        for (int c = 0; c < n; c++)
            for (int r = 0; r < m; r++)
                C[(size_t)c * ldc + r] = 0.0f;
    cblas_sgemm(CblasColMajor, ta == CUBLAS_OP_N ? CblasNoTrans : CblasTrans,
                tb == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, m, n, k, alpha, a, a_rows, b, b_rows,
                beta == 0.0f ? 1.0f : beta, C, ldc);
    free(a);
    free(b);
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc) {
    if (!alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    return gemm(handle, transa, transb, m, n, k, *alpha, A, CUDA_R_32F, lda, B, CUDA_R_32F, ldb,
                *beta, C, ldc);
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo) {
    if (!alpha || !beta)
        return CUBLAS_STATUS_INVALID_VALUE;
    /* The combinations cuBLAS supports with fp32 compute and an fp32 C. */
    const int type_ok =
        Atype == Btype && (Atype == CUDA_R_32F || Atype == CUDA_R_16F || Atype == CUDA_R_16BF);
    const int compute_ok =
        computeType == CUBLAS_COMPUTE_32F || computeType == CUBLAS_COMPUTE_32F_PEDANTIC ||
        computeType == CUBLAS_COMPUTE_32F_FAST_16F || computeType == CUBLAS_COMPUTE_32F_FAST_16BF ||
        computeType == CUBLAS_COMPUTE_32F_FAST_TF32;
    if (!type_ok || Ctype != CUDA_R_32F || !compute_ok)
        return CUBLAS_STATUS_NOT_SUPPORTED;
    return gemm(handle, transa, transb, m, n, k, *(const float *)alpha, A, Atype, lda, B, Btype,
                ldb, *(const float *)beta, (float *)C, ldc);
}

cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType Atype,
                                          int lda, long long strideA, const void *B,
                                          cudaDataType Btype, int ldb, long long strideB,
                                          const void *beta, void *C, cudaDataType Ctype, int ldc,
                                          long long strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
    if (batchCount < 0 || strideA < 0 || strideB < 0 || strideC < 0)
        return CUBLAS_STATUS_INVALID_VALUE;
    const size_t es_a = Atype == CUDA_R_32F ? 4 : 2, es_b = Btype == CUDA_R_32F ? 4 : 2;
    for (int i = 0; i < batchCount; i++) {
        const cublasStatus_t st = cublasGemmEx(
            handle, transa, transb, m, n, k, alpha, (const char *)A + i * strideA * (long long)es_a,
            Atype, lda, (const char *)B + i * strideB * (long long)es_b, Btype, ldb, beta,
            (float *)C + i * strideC, Ctype, ldc, computeType, algo);
        if (st != CUBLAS_STATUS_SUCCESS)
            return st;
    }
    return CUBLAS_STATUS_SUCCESS;
}
