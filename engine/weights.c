/* Loading named, shape-checked tensors from a model's safetensors files. */
#include "weights.h"

#include <stdarg.h>
#include <stdio.h>
#include <string.h>

int weight_set_open(weight_set_t *ws, const char *dir, const model_config_t *cfg, backend_t *be,
                    ar_error_t *err) {
    memset(ws, 0, sizeof *ws);
    ws->be = be;
    for (int i = 0; i < cfg->n_weight_files; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, cfg->weight_files[i]);
        if (safetensors_open(&ws->files[i], path, err) != AR_OK) {
            weight_set_close(ws);
            return AR_ERR;
        }
        ws->n_files = i + 1;
    }
    return AR_OK;
}

void weight_set_close(weight_set_t *ws) {
    for (int i = 0; i < ws->n_files; i++)
        safetensors_close(&ws->files[i]);
    ws->n_files = 0;
}

int weight_load(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape, ar_error_t *err,
                const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    memset(out, 0, sizeof *out);
    for (int i = 0; i < ws->n_files; i++) {
        if (!safetensors_find(&ws->files[i], name))
            continue;
        const st_tensor_t *t;
        if (safetensors_get(&ws->files[i], name, ndim, shape, &t, err) != AR_OK)
            return AR_ERR;
        if (ws->be->weight_load(ws->be, out, t->data, t->dtype, t->ndim, t->shape, err) != AR_OK)
            return ar_error_prefix(err, "%s: tensor '%s'", ws->files[i].path, name);
        ws->bytes_loaded += t->nbytes;
        return AR_OK;
    }
    return ar_errorf(err, "%s: tensor '%s' not found",
                     ws->n_files ? ws->files[0].path : "(no weights)", name);
}
