/* The backend a model test runs on: ARSERVE_TEST_BACKEND (cpu when unset),
 * so one test binary checks the CPU backend in `make test-unit`, the CUDA
 * backend on a GPU (tests/gpu/run.sh) and under the CPU emulator of CUDA
 * (`make test-backend`). Header-only: each test is one file. */
#ifndef ARSERVE_TESTS_TEST_BACKEND_H
#define ARSERVE_TESTS_TEST_BACKEND_H

#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"

/* The emulator's device memory is host memory allocated on first touch; a
 * golden model and its pools fit in far less than this. */
#define TEST_EMU_RESERVE_BYTES ((size_t)1 << 30)

/* The CUDA backend a test checks, in the graph mode ARSERVE_TEST_GRAPHS
 * names ("off": op by op; else the default, steps as graphs), so that
 * `make test-backend` runs the same suites both ways. */
static inline backend_t *test_cuda_create(int device, size_t reserve, ar_error_t *err) {
    backend_t *be = backend_cuda_create(device, reserve, err);
    const char *graphs = getenv("ARSERVE_TEST_GRAPHS");
    if (be && graphs && !strcmp(graphs, "off"))
        be->graphs = GRAPHS_OFF;
    return be;
}

/* backend_open knows cuda only in a CUDA=1 build (ARSERVE_CUDA); a binary
 * linked against the emulator (compiled with -DARSERVE_TEST_CUDA_EMU, never
 * part of arserve) creates the emulated CUDA backend itself. */
static inline backend_t *test_backend_open_raw(ar_error_t *err) {
    const char *which = getenv("ARSERVE_TEST_BACKEND");
    if (!which || !*which)
        which = "cpu";
#ifdef ARSERVE_TEST_CUDA_EMU
    if (!strcmp(which, "cuda"))
        return test_cuda_create(0, TEST_EMU_RESERVE_BYTES, err);
#endif
    return backend_open(which, 0, err);
}

/* The backend in split activations (backend.h): the mode the checks
 * against the CPU and the official code hold to their tight bounds; a test
 * of the 16-bit mode sets be->activations itself. */
static inline backend_t *test_backend_open(ar_error_t *err) {
    backend_t *be = test_backend_open_raw(err);
    if (be)
        be->activations = ACTIVATIONS_SPLIT;
    return be;
}

#endif
