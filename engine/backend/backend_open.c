/* --backend: the one place that knows which backends arserve has and which
 * of them this binary was built with; every list of their names (the
 * config's choices, the help texts, --version) asks it. auto falls back to
 * the CPU only when there is no GPU; a GPU that is there but cannot be used
 * (out of memory, no kernels for it) is an error, not a silent switch to a
 * backend a hundred times slower. */
#include "engine/backend/backend.h"

#include <stdio.h>
#include <string.h>

#include "base/text.h"

static backend_t *open_cpu(int threads, ar_error_t *err) {
    return backend_cpu_create(threads, err);
}

#ifdef ARSERVE_CUDA
static backend_t *open_cuda(int threads, ar_error_t *err) {
    (void)threads;
    return backend_cuda_create(0, 0, err);
}
#define OPEN_CUDA open_cuda
#define CUDA_DEVICES backend_cuda_device_count
#else
#define OPEN_CUDA NULL
#define CUDA_DEVICES NULL
#endif

/* The backends, X(name, open, devices, device, how to build it in), in the
 * order they are listed; auto takes the last that is built in and has a
 * device. open NULL: not in this binary. device NULL: always there (the
 * CPU); else what devices() (set where open is) counts. */
#define BACKEND_KINDS(X)                                                                           \
    X(cpu, open_cpu, NULL, NULL, NULL)                                                             \
    X(cuda, OPEN_CUDA, CUDA_DEVICES, "a GPU", "make CUDA=1")

typedef struct backend_kind {
    const char *name;
    backend_t *(*open)(int threads, ar_error_t *err);
    int (*devices)(void);
    const char *device; /* what devices() counts, in words */
    const char *build;  /* the command that builds it in */
} backend_kind_t;

#define BACKEND_KIND_(name_, open_, devices_, device_, build_)                                     \
    {.name = #name_, .open = open_, .devices = devices_, .device = device_, .build = build_},
static const backend_kind_t KINDS[] = {BACKEND_KINDS(BACKEND_KIND_)};
#define N_KINDS ((int)(sizeof KINDS / sizeof KINDS[0]))

#define BACKEND_NAME_(name_, ...) #name_,
const char *const backend_names[] = {BACKEND_AUTO, BACKEND_KINDS(BACKEND_NAME_) NULL};

const char *backend_list(int built_in_only, char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = 0; i < N_KINDS; i++)
        if (!built_in_only || KINDS[i].open)
            text_append(buf, cap, &used, "%s%s", used ? ", " : "", KINDS[i].name);
    return buf;
}

const char *backend_auto_rule(char *buf, size_t cap) {
    size_t used = 0;
    if (cap)
        buf[0] = 0;
    for (int i = N_KINDS - 1; i >= 0; i--) {
        text_append(buf, cap, &used, "%s%s", used ? ", else " : "", KINDS[i].name);
        if (!KINDS[i].device)
            break; /* always there: auto never looks further */
        text_append(buf, cap, &used, " when built in and %s is present", KINDS[i].device);
    }
    return buf;
}

backend_t *backend_open(const char *name, int threads, ar_error_t *err) {
    const int is_auto = !strcmp(name, BACKEND_AUTO);
    const backend_kind_t *k = NULL;
    for (int i = 0; i < N_KINDS && !k; i++)
        if (!strcmp(name, KINDS[i].name))
            k = &KINDS[i];
    for (int i = N_KINDS - 1; is_auto && i >= 0 && !k; i--)
        if (KINDS[i].open && (!KINDS[i].device || KINDS[i].devices() > 0))
            k = &KINDS[i];
    if (!k) {
        char names[128];
        ar_errorf(err, "--backend %s: unknown backend (%s or %s)", name,
                  backend_list(0, names, sizeof names), BACKEND_AUTO);
        return NULL;
    }
    if (!k->open) {
        char names[128];
        ar_errorf(err,
                  "--backend %s: this arserve was built without the %s backend (%s only); "
                  "rebuild with %s",
                  name, k->name, backend_list(1, names, sizeof names), k->build);
        return NULL;
    }
    backend_t *be = k->open(threads, err);
    /* A device's message says which --backend (auto, or its name) chose it. */
    if (!be && k->device)
        ar_error_prefix(err, "--backend %s", name);
    return be;
}
