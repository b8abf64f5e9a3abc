/* --backend: the one place that knows which backends this binary has. auto
 * falls back to the CPU only when there is no GPU; a GPU that is there but
 * cannot be used (out of memory, no kernels for it) is an error, not a
 * silent switch to a backend a hundred times slower. */
#include "engine/backend/backend.h"

#include <string.h>

backend_t *backend_open(const char *name, int threads, ar_error_t *err) {
    if (!strcmp(name, "cpu"))
        return backend_cpu_create(threads, err);
    if (strcmp(name, "cuda") && strcmp(name, "auto")) {
        ar_errorf(err, "--backend %s: unknown backend (cpu, cuda or auto)", name);
        return NULL;
    }
#ifdef ARSERVE_CUDA
    if (!strcmp(name, "auto") && backend_cuda_device_count() == 0)
        return backend_cpu_create(threads, err);
    backend_t *be = backend_cuda_create(0, 0, err);
    if (!be)
        ar_error_prefix(err, "--backend %s", name);
    return be;
#else
    if (!strcmp(name, "auto"))
        return backend_cpu_create(threads, err);
    ar_errorf(err, "--backend cuda: this arserve was built without the CUDA backend (cpu only); "
                   "rebuild with make CUDA=1");
    return NULL;
#endif
}
