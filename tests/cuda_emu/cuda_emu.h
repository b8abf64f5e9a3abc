/* CUDA on the CPU, for tests: the subset of the CUDA runtime, cuBLAS, the
 * half/bfloat16 types and the kernel language that arserve's kernels and
 * CUDA backend use, so that kernels/ *.cu (as C++ under g++) and
 * engine/backend/backend_cuda.c (as C under gcc) build and run on a machine without
 * a GPU. The forwarding headers in tests/cuda_emu/include/ (cuda_runtime.h,
 * cublas_v2.h, ...) make the same #include lines work for both compilers.
 *
 * How a launch runs (tests/cuda_emu/cuda_emu.cpp): blocks one after another
 * (or spread over OS threads, CUDA_EMU_THREADS), and the threads of a block
 * as fibers, each with its own small stack, scheduled cooperatively: every
 * thread runs until it reaches a barrier (__syncthreads, a warp shuffle,
 * __syncwarp, a vote) or returns; then the scheduler releases whatever
 * barrier all of its threads have reached and runs the released threads
 * again. A barrier nobody can release is a deadlock, reported as a sticky
 * launch failure like a device fault. Device memory is host memory; streams
 * and events are synchronous. This is a test tool: never link it into
 * arserve. */
#ifndef CUDA_EMU_H
#define CUDA_EMU_H

#define CUDA_EMU 1

#include <math.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ---- runtime API (C) ----------------------------------------------------- */

/* The values are CUDA's, so that messages and tests read the same. */
typedef enum cudaError {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidDevicePointer = 17,
    cudaErrorInvalidMemcpyDirection = 21,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorIllegalState = 401,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureInvalidated = 901,
    cudaErrorStreamCaptureWrongThread = 908,
    cudaErrorGraphExecUpdateFailure = 910,
    cudaErrorUnknown = 999
} cudaError_t;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

#define cudaStreamDefault 0x00
#define cudaStreamNonBlocking 0x01
#define cudaEventDefault 0x00
#define cudaEventDisableTiming 0x02

typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;

typedef struct uint3 {
    unsigned int x, y, z;
} uint3;

typedef struct uint4 {
    unsigned int x, y, z, w;
} uint4;

typedef struct dim3 {
    unsigned int x, y, z;
#ifdef __cplusplus
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
        : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
#endif
} dim3;

/* The fields of cudaDeviceProp the backend reads (the real struct has many
 * more; code names fields, so the layout need not match). */
typedef struct cudaDeviceProp {
    char name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int major, minor;
    int multiProcessorCount;
} cudaDeviceProp;

cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaDeviceSynchronize(void);
/* Clears a sticky error (the emulator keeps its allocations). */
cudaError_t cudaDeviceReset(void);

cudaError_t cudaMalloc(void **p, size_t bytes);
cudaError_t cudaFree(void *p);
cudaError_t cudaMallocHost(void **p, size_t bytes);
cudaError_t cudaFreeHost(void *p);
cudaError_t cudaMemGetInfo(size_t *free_bytes, size_t *total_bytes);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t bytes, enum cudaMemcpyKind kind,
                            cudaStream_t stream);
cudaError_t cudaMemset(void *p, int value, size_t bytes);
cudaError_t cudaMemsetAsync(void *p, int value, size_t bytes, cudaStream_t stream);

cudaError_t cudaStreamCreate(cudaStream_t *stream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t *stream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
cudaError_t cudaEventCreate(cudaEvent_t *event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream);
cudaError_t cudaEventSynchronize(cudaEvent_t event);
cudaError_t cudaEventElapsedTime(float *ms, cudaEvent_t start, cudaEvent_t end);

/* Graphs, as far as stream capture makes them: between
 * cudaStreamBeginCapture and cudaStreamEndCapture a stream records its
 * kernel launches, device-to-device copies, memsets and cuBLAS calls (with
 * their arguments as they were at the call) instead of running them;
 * cudaGraphLaunch runs the recording, in order. Stricter than CUDA where
 * that catches bugs early: a capture records only device work (a copy to
 * or from host memory fails with cudaErrorStreamCaptureUnsupported, even
 * pinned). As in CUDA, a wait for the capturing stream fails, and so do
 * synchronising calls (cudaDeviceSynchronize, cudaStreamSynchronize,
 * cudaMemcpy, cudaMemset, cudaMalloc, cudaFree) where the capture's mode
 * forbids them; each invalidates the capture. cudaGraphExecUpdate succeeds
 * where the new graph has the same nodes, one for one, of the same kinds
 * (a kernel's function and arguments, a copy's addresses may change). */
typedef struct CUgraph_st *cudaGraph_t;
typedef struct CUgraphExec_st *cudaGraphExec_t;
typedef struct CUgraphNode_st *cudaGraphNode_t;

enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};
enum cudaStreamCaptureMode {
    cudaStreamCaptureModeGlobal = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed = 2
};
enum cudaGraphExecUpdateResult {
    cudaGraphExecUpdateSuccess = 0,
    cudaGraphExecUpdateError = 1,
    cudaGraphExecUpdateErrorTopologyChanged = 2,
    cudaGraphExecUpdateErrorNodeTypeChanged = 3
};
typedef struct cudaGraphExecUpdateResultInfo_st {
    enum cudaGraphExecUpdateResult result;
    cudaGraphNode_t errorNode;
    cudaGraphNode_t errorFromNode;
} cudaGraphExecUpdateResultInfo;

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, enum cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t *graph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, enum cudaStreamCaptureStatus *status);
/* nodes NULL: *n_nodes is set to the graph's node count. */
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t *nodes, size_t *n_nodes);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t *exec, cudaGraph_t graph,
                                 unsigned long long flags);
cudaError_t cudaGraphExecUpdate(cudaGraphExec_t exec, cudaGraph_t graph,
                                cudaGraphExecUpdateResultInfo *info);
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec);

/* Returns and clears the last error (a sticky one stays). */
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t error);
const char *cudaGetErrorName(cudaError_t error);

/* ---- cuBLAS (C) ------------------------------------------------------------ */

typedef struct cublasContext *cublasHandle_t;

typedef enum {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_ALLOC_FAILED = 3,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_ARCH_MISMATCH = 8,
    CUBLAS_STATUS_MAPPING_ERROR = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR = 14,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
    CUBLAS_STATUS_LICENSE_ERROR = 16
} cublasStatus_t;

typedef enum { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1, CUBLAS_OP_C = 2 } cublasOperation_t;

typedef enum cudaDataType_t {
    CUDA_R_32F = 0,
    CUDA_R_64F = 1,
    CUDA_R_16F = 2,
    CUDA_R_16BF = 14
} cudaDataType_t;
typedef cudaDataType_t cudaDataType;

typedef enum {
    CUBLAS_COMPUTE_32F = 68,
    CUBLAS_COMPUTE_32F_PEDANTIC = 69,
    CUBLAS_COMPUTE_32F_FAST_16F = 74,
    CUBLAS_COMPUTE_32F_FAST_16BF = 75,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77
} cublasComputeType_t;

typedef enum { CUBLAS_GEMM_DEFAULT = -1 } cublasGemmAlgo_t;

typedef enum {
    CUBLAS_DEFAULT_MATH = 0,
    CUBLAS_PEDANTIC_MATH = 2,
    CUBLAS_TF32_TENSOR_OP_MATH = 3
} cublasMath_t;

cublasStatus_t cublasCreate(cublasHandle_t *handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void *workspace, size_t bytes);
const char *cublasGetStatusString(cublasStatus_t status);
const char *cublasGetStatusName(cublasStatus_t status);

/* Column-major, as cuBLAS: C = alpha op(A) op(B) + beta C, C m x n. alpha
 * and beta are host pointers (the default pointer mode). */
cublasStatus_t cublasSgemm(cublasHandle_t handle, cublasOperation_t transa,
                           cublasOperation_t transb, int m, int n, int k, const float *alpha,
                           const float *A, int lda, const float *B, int ldb, const float *beta,
                           float *C, int ldc);
/* A and B of one type (32F, 16F or 16BF), C 32F, fp32 compute. */
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa,
                            cublasOperation_t transb, int m, int n, int k, const void *alpha,
                            const void *A, cudaDataType Atype, int lda, const void *B,
                            cudaDataType Btype, int ldb, const void *beta, void *C,
                            cudaDataType Ctype, int ldc, cublasComputeType_t computeType,
                            cublasGemmAlgo_t algo);

/* batchCount products of cublasGemmEx's form; product i reads A + i *
 * strideA, B + i * strideB and writes C + i * strideC (elements; a stride
 * of 0 shares the operand). */
cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t handle, cublasOperation_t transa,
                                          cublasOperation_t transb, int m, int n, int k,
                                          const void *alpha, const void *A, cudaDataType Atype,
                                          int lda, long long strideA, const void *B,
                                          cudaDataType Btype, int ldb, long long strideB,
                                          const void *beta, void *C, cudaDataType Ctype, int ldc,
                                          long long strideC, int batchCount,
                                          cublasComputeType_t computeType, cublasGemmAlgo_t algo);

/* ---- emulator controls (tests only) -------------------------------------- */

/* Sets the device memory the emulator pretends to have (default 16 GiB);
 * cudaMalloc fails past it and cudaMemGetInfo reports it. */
void cuda_emu_set_device_memory(size_t total_bytes);
/* Bytes currently allocated with cudaMalloc. */
size_t cuda_emu_allocated_bytes(void);
/* The message of the last kernel fault (deadlock, warp misuse), "" if none. */
const char *cuda_emu_last_fault(void);
/* Kernel launches so far (counts the ones that ran). */
unsigned long long cuda_emu_launch_count(void);
/* Plants a device fault: the launch `after` launches from now (0: the
 * next one) does not run and fails with error, sticky as a kernel fault
 * is (every call returns it until cudaDeviceReset), so that tests can see
 * what code above CUDA does when the device dies (cudaErrorIllegalAddress
 * stands for an out-of-bounds kernel). cuda_emu_last_fault() names the
 * kernel. cudaSuccess, or cudaDeviceReset, disarms a fault not yet fired. */
void cuda_emu_fault_launch(unsigned long long after, cudaError_t error);
/* As cuda_emu_fault_launch, but the way a GPU reports a kernel that faults
 * while it runs: the launch itself succeeds (cudaGetLastError right after
 * it says cudaSuccess) and the error surfaces at the next call that
 * touches the device (a copy, a synchronisation, the next launch, a
 * cuBLAS call), sticky from then on. The kernel does not run. */
void cuda_emu_fault_launch_async(unsigned long long after, cudaError_t error);
/* With refuse set, cudaStreamBeginCapture fails with cudaErrorNotSupported,
 * as on a driver or platform without stream capture. */
void cuda_emu_refuse_capture(int refuse);

#ifdef __cplusplus
} /* extern "C" */
#endif

/* ---- the kernel language (C++ only) ---------------------------------------- */
#ifdef __cplusplus

#include <stdio.h>
#include <string.h>

#include <functional>
#include <memory>
#include <tuple>
#include <type_traits>
#include <utility>

/* Stream capture (the graph API above): whether stream is capturing, and
 * a node appended to its capture (kind: what cudaGraphExecUpdate compares;
 * run: the work, returning the error it ends with). */
enum cuda_emu_node_kind { CUDA_EMU_NODE_KERNEL = 1, CUDA_EMU_NODE_COPY, CUDA_EMU_NODE_MEMSET };
int cuda_emu_capturing(cudaStream_t stream);
cudaError_t cuda_emu_capture(cudaStream_t stream, enum cuda_emu_node_kind kind,
                             std::function<cudaError_t()> run);
/* A launch's grid, block and shared memory checked as a launch checks them. */
cudaError_t cuda_emu_launch_config(dim3 grid, dim3 block, size_t shmem, cudaStream_t stream);

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __noinline__ __attribute__((noinline))
#define __align__(n) __attribute__((aligned(n)))
#define __launch_bounds__(...)
/* Static shared memory: one copy per OS thread, shared by the fibers (the
 * threads) of the block running on it; blocks on one OS thread run one
 * after another. Dynamic shared memory: see AR_DYNAMIC_SHARED in
 * kernels/cuda/launch.h and cuda_emu_dynamic_shared() below. */
#define __shared__ static __thread

/* Built-in variables: set by the scheduler for the fiber it resumes. */
extern __thread uint3 threadIdx;
extern __thread uint3 blockIdx;
extern __thread dim3 blockDim;
extern __thread dim3 gridDim;
static const int warpSize = 32;

/* The launch's dynamic shared memory (16-byte aligned, poisoned with 0xff
 * bytes, i.e. NaN floats, at the start of every block). */
void *cuda_emu_dynamic_shared(void);

/* ---- barriers and warp operations ---- */

void __syncthreads(void);
void __syncwarp(unsigned mask = 0xffffffffu);

enum cuda_emu_warp_op { CUDA_EMU_SHFL = 1, CUDA_EMU_BALLOT, CUDA_EMU_SYNCWARP };

/* Waits until every lane named in mask has reached a warp operation, then
 * returns the 64-bit value published by lane src (a shuffle; the caller's
 * own value when src names no participating lane) or the ballot of the
 * published values (bit i set where lane i's value is non-zero). */
uint64_t cuda_emu_warp_sync(enum cuda_emu_warp_op op, unsigned mask, uint64_t value, int src);
int cuda_emu_lane(void);

template <typename T> static inline uint64_t cuda_emu_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a big type");
    uint64_t u = 0;
    memcpy(&u, &v, sizeof v);
    return u;
}

template <typename T> static inline T cuda_emu_from_bits(uint64_t u) {
    T v;
    memcpy(&v, &u, sizeof v);
    return v;
}

/* Shuffles within segments of width lanes (a power of two <= 32), as CUDA. */
template <typename T>
static inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = 32) {
    const int lane = cuda_emu_lane(), base = lane & ~(width - 1);
    const int src = base + (src_lane & (width - 1));
    return cuda_emu_from_bits<T>(cuda_emu_warp_sync(CUDA_EMU_SHFL, mask, cuda_emu_bits(var), src));
}

template <typename T>
static inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = 32) {
    const int lane = cuda_emu_lane(), base = lane & ~(width - 1);
    int src = lane ^ lane_mask;
    if (src < base || src >= base + width)
        src = lane;
    return cuda_emu_from_bits<T>(cuda_emu_warp_sync(CUDA_EMU_SHFL, mask, cuda_emu_bits(var), src));
}

template <typename T>
static inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    const int lane = cuda_emu_lane(), base = lane & ~(width - 1);
    int src = lane + (int)delta;
    if (src >= base + width)
        src = lane;
    return cuda_emu_from_bits<T>(cuda_emu_warp_sync(CUDA_EMU_SHFL, mask, cuda_emu_bits(var), src));
}

template <typename T>
static inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = 32) {
    const int lane = cuda_emu_lane(), base = lane & ~(width - 1);
    int src = lane - (int)delta;
    if (src < base)
        src = lane;
    return cuda_emu_from_bits<T>(cuda_emu_warp_sync(CUDA_EMU_SHFL, mask, cuda_emu_bits(var), src));
}

static inline unsigned __ballot_sync(unsigned mask, int pred) {
    return (unsigned)cuda_emu_warp_sync(CUDA_EMU_BALLOT, mask, pred != 0, 0);
}
static inline int __any_sync(unsigned mask, int pred) { return __ballot_sync(mask, pred) != 0; }
static inline int __all_sync(unsigned mask, int pred) {
    return (__ballot_sync(mask, !pred) & mask) == 0;
}

/* ---- atomics: real ones, since blocks may run on several OS threads ---- */

static inline int atomicAdd(int *p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
static inline unsigned atomicAdd(unsigned *p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
static inline float atomicAdd(float *p, float v) {
    uint32_t old = __atomic_load_n((uint32_t *)p, __ATOMIC_RELAXED), want;
    do {
        float f;
        memcpy(&f, &old, 4);
        f += v;
        memcpy(&want, &f, 4);
    } while (!__atomic_compare_exchange_n((uint32_t *)p, &old, want, 0, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    float r;
    memcpy(&r, &old, 4);
    return r;
}
static inline double atomicAdd(double *p, double v) {
    uint64_t old = __atomic_load_n((uint64_t *)p, __ATOMIC_RELAXED), want;
    do {
        double f;
        memcpy(&f, &old, 8);
        f += v;
        memcpy(&want, &f, 8);
    } while (!__atomic_compare_exchange_n((uint64_t *)p, &old, want, 0, __ATOMIC_RELAXED,
                                          __ATOMIC_RELAXED));
    double r;
    memcpy(&r, &old, 8);
    return r;
}
static inline int atomicSub(int *p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
static inline int atomicMax(int *p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v &&
           !__atomic_compare_exchange_n(p, &old, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
static inline unsigned atomicMax(unsigned *p, unsigned v) {
    unsigned old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old < v &&
           !__atomic_compare_exchange_n(p, &old, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
static inline int atomicMin(int *p, int v) {
    int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (old > v &&
           !__atomic_compare_exchange_n(p, &old, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}
static inline int atomicCAS(int *p, int compare, int v) {
    __atomic_compare_exchange_n(p, &compare, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
static inline unsigned atomicCAS(unsigned *p, unsigned compare, unsigned v) {
    __atomic_compare_exchange_n(p, &compare, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
static inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long compare,
                                           unsigned long long v) {
    __atomic_compare_exchange_n(p, &compare, v, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return compare;
}
static inline int atomicExch(int *p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
static inline void __threadfence(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
static inline void __threadfence_block(void) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

/* ---- math: the host's correctly rounded or libm functions stand in for the
 * device's (the fast intrinsics are more accurate here than on a GPU, so
 * tolerances must be set for the GPU, not for this) ---- */

/* __expf, __logf, __sinf, __cosf and __sincosf need no definition: glibc's
 * math.h declares functions of those names (its own entry points for expf,
 * logf, ...), which are what the emulator wants. */
static inline float __fdividef(float a, float b) { return a / b; }
static inline float __frcp_rn(float x) { return 1.0f / x; }
static inline float __fsqrt_rn(float x) { return sqrtf(x); }
static inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __saturatef(float x) { return x < 0.0f ? 0.0f : x > 1.0f ? 1.0f : x; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline double rsqrt(double x) { return 1.0 / sqrt(x); }
static inline int __float2int_rn(float x) { return (int)lrintf(x); }
static inline float __int_as_float(int i) { return cuda_emu_from_bits<float>((uint32_t)i); }
static inline int __float_as_int(float f) { return (int)(uint32_t)cuda_emu_bits(f); }
static inline float __uint_as_float(unsigned u) { return cuda_emu_from_bits<float>(u); }
static inline unsigned __float_as_uint(float f) { return (unsigned)cuda_emu_bits(f); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline int max(int a, int b) { return a > b ? a : b; }
static inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
static inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
static inline long long min(long long a, long long b) { return a < b ? a : b; }
static inline long long max(long long a, long long b) { return a > b ? a : b; }
static inline size_t min(size_t a, size_t b) { return a < b ? a : b; }
static inline size_t max(size_t a, size_t b) { return a > b ? a : b; }
template <typename T> static inline T __ldg(const T *p) { return *p; }

/* ---- __half and __nv_bfloat16: storage types with the conversions of
 * cuda_fp16.h / cuda_bf16.h (round to nearest even; every NaN becomes the
 * canonical 0x7fff, as the hardware's cvt.rn does) ---- */

static inline unsigned short cuda_emu_f32_to_f16(float f) {
    uint32_t u = (uint32_t)cuda_emu_bits(f);
    const uint32_t sign = (u >> 16) & 0x8000u;
    u &= 0x7fffffffu;
    if (u > 0x7f800000u)
        return 0x7fff;
    if (u >= 0x477ff000u) /* >= 65520: rounds to infinity */
        return (unsigned short)(sign | 0x7c00u);
    if (u >= 0x38800000u) { /* normal half (>= 2^-14) */
        const uint32_t mant = u & 0x7fffffu, exp = (u >> 23) - 127 + 15;
        uint32_t h = (exp << 10) | (mant >> 13);
        const uint32_t rest = mant & 0x1fffu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u)))
            h++; /* a carry into the exponent is still right */
        return (unsigned short)(sign | h);
    }
    if (u < 0x33000000u) /* below half of the smallest subnormal: zero */
        return (unsigned short)sign;
    /* subnormal half: value = mant_h * 2^-24 */
    const uint32_t exp = u >> 23, mant = (u & 0x7fffffu) | 0x800000u;
    const int shift = 126 - (int)exp; /* 14 - (exp - 127) - 1 + 10 - 23 + 24 */
    uint32_t h = mant >> shift;
    const uint32_t rest = mant & ((1u << shift) - 1u), halfway = 1u << (shift - 1);
    if (rest > halfway || (rest == halfway && (h & 1u)))
        h++;
    return (unsigned short)(sign | h);
}

static inline float cuda_emu_f16_to_f32(unsigned short h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (mant << 13);
    } else if (exp == 0) {
        if (mant == 0) {
            u = sign;
        } else {
            exp = 113;
            while (!(mant & 0x400u)) {
                mant <<= 1;
                exp--;
            }
            u = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
        }
    } else {
        u = sign | ((exp + 112) << 23) | (mant << 13);
    }
    return cuda_emu_from_bits<float>(u);
}

static inline unsigned short cuda_emu_f32_to_bf16(float f) {
    uint32_t u = (uint32_t)cuda_emu_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return 0x7fff;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

static inline float cuda_emu_bf16_to_f32(unsigned short b) {
    return cuda_emu_from_bits<float>((uint32_t)b << 16);
}

struct __half {
    unsigned short __x;
    __half() = default;
    __half(float f) : __x(cuda_emu_f32_to_f16(f)) {}
    operator float() const { return cuda_emu_f16_to_f32(__x); }
};

struct __nv_bfloat16 {
    unsigned short __x;
    __nv_bfloat16() = default;
    __nv_bfloat16(float f) : __x(cuda_emu_f32_to_bf16(f)) {}
    operator float() const { return cuda_emu_bf16_to_f32(__x); }
};

static inline __half __float2half(float f) {
    __half h;
    h.__x = cuda_emu_f32_to_f16(f);
    return h;
}
static inline __half __float2half_rn(float f) { return __float2half(f); }
static inline float __half2float(__half h) { return cuda_emu_f16_to_f32(h.__x); }
static inline unsigned short __half_as_ushort(__half h) { return h.__x; }
static inline __half __ushort_as_half(unsigned short u) {
    __half h;
    h.__x = u;
    return h;
}
static inline __nv_bfloat16 __float2bfloat16(float f) {
    __nv_bfloat16 b;
    b.__x = cuda_emu_f32_to_bf16(f);
    return b;
}
static inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __float2bfloat16(f); }
static inline float __bfloat162float(__nv_bfloat16 b) { return cuda_emu_bf16_to_f32(b.__x); }
static inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.__x; }
static inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) {
    __nv_bfloat16 b;
    b.__x = u;
    return b;
}

/* ---- launches ---- */

/* Runs body(ctx) for every thread of every block; returns the launch error
 * (also left for cudaGetLastError), as a <<<...>>> launch would. */
cudaError_t cuda_emu_run(const char *name, dim3 grid, dim3 block, size_t shmem, cudaStream_t stream,
                         void (*body)(void *), void *ctx);

/* The emulator's kernel<<<grid, block, shmem, stream>>>(args...): the
 * arguments are converted to the kernel's parameter types and copied once,
 * as CUDA copies a launch's parameters. */
template <typename... Params, typename... Args>
static inline void cuda_emu_launch(const char *name, void (*kernel)(Params...), dim3 grid,
                                   dim3 block, size_t shmem, cudaStream_t stream, Args &&...args) {
    static_assert(sizeof...(Params) == sizeof...(Args), "wrong number of kernel arguments");
    struct closure {
        void (*kernel)(Params...);
        std::tuple<typename std::decay<Params>::type...> params;
    } c{kernel, std::tuple<typename std::decay<Params>::type...>(std::forward<Args>(args)...)};
    void (*body)(void *) = [](void *p) {
        closure *cl = static_cast<closure *>(p);
        std::apply(cl->kernel, cl->params);
    };
    if (!cuda_emu_capturing(stream)) {
        cuda_emu_run(name, grid, block, shmem, stream, body, &c);
        return;
    }
    if (cuda_emu_launch_config(grid, block, shmem, stream) != cudaSuccess)
        return;
    auto kept = std::make_shared<closure>(c);
    cuda_emu_capture(stream, CUDA_EMU_NODE_KERNEL, [=]() {
        return cuda_emu_run(name, grid, block, shmem, NULL, body, kept.get());
    });
}

#endif /* __cplusplus */

#endif
