/* Kernel launches, dynamic shared memory and unrolled loops, spelled once for both
 * compilers: nvcc builds the real kernels; g++ builds the same files against
 * the CPU emulator (tests/cuda_emu), which has no <<<>>> syntax and no way to
 * bind an `extern __shared__` array. Every launch in kernels/ goes through
 * AR_LAUNCH and is followed by a launch-error check (cudaGetLastError). */
#ifndef ARSERVE_KERNELS_LAUNCH_H
#define ARSERVE_KERNELS_LAUNCH_H

#include <cuda_runtime.h>

/* Kernels this host thread has started through AR_LAUNCH (kernels.h's
 * kern_kernels_started reads it for the backend's counters). */
extern thread_local unsigned long long ar_kernels_started;

#if defined(__CUDACC__)

/* A loop nvcc unrolls (so that an array it indexes stays in registers). */
#define AR_UNROLL _Pragma("unroll")

#define AR_LAUNCH(kernel, grid, block, shmem, stream, ...)                                         \
    (++ar_kernels_started, kernel<<<(grid), (block), (shmem), (stream)>>>(__VA_ARGS__))

/* `type *name` pointing at the launch's dynamic shared memory. */
#define AR_DYNAMIC_SHARED(type, name)                                                              \
    extern __shared__ __align__(16) unsigned char ar_dynamic_smem_[];                              \
    type *name = reinterpret_cast<type *>(ar_dynamic_smem_)

#elif defined(CUDA_EMU)

#define AR_UNROLL

#define AR_LAUNCH(kernel, grid, block, shmem, stream, ...)                                         \
    (++ar_kernels_started,                                                                         \
     cuda_emu_launch(#kernel, kernel, (grid), (block), (shmem), (stream), __VA_ARGS__))

#define AR_DYNAMIC_SHARED(type, name)                                                              \
    type *name = reinterpret_cast<type *>(cuda_emu_dynamic_shared())

#else
#error "kernels/ build with nvcc, or with g++ against tests/cuda_emu (-Itests/cuda_emu/include)"
#endif

#endif
