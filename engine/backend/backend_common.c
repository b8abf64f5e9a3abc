/* Checks shared by every backend implementation. */
#include <stdint.h>
#include <stdio.h>

#include "engine/backend/backend.h"

const char *const backend_activations_names[] = {"bf16", "split", NULL};
const char *const backend_graphs_names[] = {"on", "off", NULL};
const char *const backend_cpu_activations_names[] = {"f32", "bf16", NULL};

/* The shape half of backend_check_weight. */
static int check_shape(const void *host_src, int ndim, const int64_t *shape, int64_t *numel,
                       ar_error_t *err) {
    if (ndim < 1 || ndim > 4)
        return ar_errorf(err, "weight with %d dimensions: expected 1 to 4", ndim);
    int64_t n = 1;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return ar_errorf(err, "weight dimension %d is negative (%lld)", i, (long long)shape[i]);
        if (shape[i] > 0 && n > (INT64_MAX / 4) / shape[i])
            return ar_errorf(err, "weight too large (dimension %d is %lld)", i,
                             (long long)shape[i]);
        n *= shape[i];
    }
    if ((uint64_t)n > SIZE_MAX / 4)
        return ar_errorf(err, "weight of %lld elements is too large", (long long)n);
    if (n > 0 && !host_src)
        return ar_errorf(err, "weight has no data");
    *numel = n;
    return AR_OK;
}

int backend_check_weight(const char *backend, const void *host_src, dtype_t dtype, int ndim,
                         const int64_t *shape, int64_t *numel, ar_error_t *err) {
    if (!dtype_is_float(dtype))
        return ar_errorf(err, "weight of type %s: the %s backend loads only F32, F16 and BF16",
                         dtype_name(dtype), backend);
    return check_shape(host_src, ndim, shape, numel, err);
}

int backend_check_weight_8bit(const char *backend, const void *host_src, dtype_t dtype,
                              const float *host_scale, int ndim, const int64_t *shape,
                              int64_t *numel, int64_t *rows, ar_error_t *err) {
    if (!dtype_is_weight8(dtype))
        return ar_errorf(err, "8-bit weight of type %s: the %s backend takes I8 and F8_E4M3",
                         dtype_name(dtype), backend);
    if (ndim != 2 && ndim != 3)
        return ar_errorf(err,
                         "8-bit weight with %d dimensions: a Linear weight has 2 (or 3, a "
                         "stack of them)",
                         ndim);
    if (check_shape(host_src, ndim, shape, numel, err) != AR_OK)
        return AR_ERR;
    *rows = ndim == 3 ? shape[0] * shape[1] : shape[0];
    if (*rows > 0 && !host_scale)
        return ar_errorf(err, "8-bit weight without its scales");
    for (int64_t r = 0; r < *rows; r++)
        if (!isfinite(host_scale[r]) || !isfinite(host_scale[r] * 256.0f))
            return ar_errorf(err, "8-bit weight: the scale of row %lld is %g, not finite%s",
                             (long long)r, (double)host_scale[r],
                             isfinite(host_scale[r]) ? " times 256" : "");
    /* An fp8 NaN would widen to a finite value in the vector kernels and to
     * NaN in the portable ones: refused, whatever --check-weights says. */
    size_t first = 0;
    if (dtype == DTYPE_F8_E4M3 && dtype_count_nonfinite(host_src, dtype, (size_t)*numel, &first))
        return ar_errorf(err, "8-bit weight: element %zu is an fp8 NaN", first);
    return AR_OK;
}

void backend_stats_add(backend_stats_t *sum, const backend_stats_t *after,
                       const backend_stats_t *before) {
    sum->launches += after->launches - before->launches;
    sum->kernels += after->kernels - before->kernels;
    sum->h2d_copies += after->h2d_copies - before->h2d_copies;
    sum->h2d_bytes += after->h2d_bytes - before->h2d_bytes;
    sum->d2h_copies += after->d2h_copies - before->d2h_copies;
    sum->d2h_bytes += after->d2h_bytes - before->d2h_bytes;
    sum->d2d_copies += after->d2d_copies - before->d2d_copies;
    sum->d2d_bytes += after->d2d_bytes - before->d2d_bytes;
    sum->syncs += after->syncs - before->syncs;
    sum->graph_launches += after->graph_launches - before->graph_launches;
    sum->graph_builds += after->graph_builds - before->graph_builds;
    sum->graph_updates += after->graph_updates - before->graph_updates;
}

const char *backend_stats_per_step(const backend_stats_t *sum, double steps, char *buf,
                                   size_t cap) {
    const double n = steps > 0 ? steps : 1;
    snprintf(buf, cap,
             "%.1f launches (%.1f kernels), %.1f graph launches, %.1f host->device and %.1f "
             "device->host copies (%.1f KiB), %.1f stream waits",
             (double)sum->launches / n, (double)sum->kernels / n, (double)sum->graph_launches / n,
             (double)sum->h2d_copies / n, (double)sum->d2h_copies / n,
             (double)(sum->h2d_bytes + sum->d2h_bytes) / n / 1024.0, (double)sum->syncs / n);
    return buf;
}
