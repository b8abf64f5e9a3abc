/* Loading named, shape-checked tensors from a model's safetensors files. */
#include "engine/weights.h"

#include <assert.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int weight_set_open(weight_set_t *ws, const char *dir, const model_config_t *cfg, backend_t *be,
                    ar_error_t *err) {
    memset(ws, 0, sizeof *ws);
    ws->be = be;
    ws->check_finite = 1;
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

/* Whether name is NAME_scale beside an 8-bit tensor NAME. */
static int is_8bit_scales(const weight_set_t *ws, const char *name) {
    const size_t len = strlen(name);
    if (len <= 6 || len >= 300 || strcmp(name + len - 6, "_scale") != 0)
        return 0;
    char base[300];
    memcpy(base, name, len - 6);
    base[len - 6] = '\0';
    for (int f = 0; f < ws->n_files; f++) {
        const st_tensor_t *t = safetensors_find(&ws->files[f], base);
        if (t)
            return dtype_is_weight8(t->dtype);
    }
    return 0;
}

/* The float type file's 8-bit weights were quantised from: its metadata's
 * quantized_from (tools/convert/ckpt.py), else bf16, what GPU servers pair
 * 8-bit weights with. */
static dtype_t quantized_from(const safetensors_t *file) {
    const char *from = safetensors_metadata(file, "quantized_from");
    for (dtype_t t = DTYPE_F32; from && t <= DTYPE_BF16; t++)
        if (strcmp(from, dtype_name(t)) == 0)
            return t;
    return DTYPE_BF16;
}

dtype_t weight_set_main_dtype(const weight_set_t *ws) {
    size_t bytes[3] = {0}; /* DTYPE_F32, DTYPE_F16, DTYPE_BF16 */
    for (int f = 0; f < ws->n_files; f++)
        for (int i = 0; i < ws->files[f].n_tensors; i++) {
            const st_tensor_t *t = &ws->files[f].tensors[i];
            if (dtype_is_weight8(t->dtype)) { /* as the type it stands for */
                const dtype_t from = quantized_from(&ws->files[f]);
                bytes[from] += dtype_size(from) * t->nbytes;
            } else if (dtype_is_float(t->dtype) && !is_8bit_scales(ws, t->name))
                bytes[t->dtype] += t->nbytes;
        }
    dtype_t best = DTYPE_F32;
    for (dtype_t t = DTYPE_F16; t <= DTYPE_BF16; t++)
        if (bytes[t] > bytes[best])
            best = t;
    return best;
}

size_t weight_set_bytes(const weight_set_t *ws) {
    size_t bytes = 0;
    for (int f = 0; f < ws->n_files; f++)
        for (int i = 0; i < ws->files[f].n_tensors; i++)
            bytes += ws->files[f].tensors[i].nbytes;
    return bytes;
}

/* The tensor called name with the given shape, from whichever file has it:
 * of a float type, or 8-bit where linear (read only as a Linear weight). */
static int find_tensor(weight_set_t *ws, const char *name, int ndim, const int64_t *shape,
                       int linear, const st_tensor_t **t, int *file, ar_error_t *err) {
    for (int i = 0; i < ws->n_files; i++) {
        if (!safetensors_find(&ws->files[i], name))
            continue;
        *file = i;
        if (safetensors_get_any(&ws->files[i], name, ndim, shape, t, err) != AR_OK)
            return AR_ERR;
        if (dtype_is_weight8((*t)->dtype) && !linear)
            return ar_errorf(err,
                             "%s: tensor '%s': dtype %s, but only Linear weights may be 8-bit "
                             "and arserve reads this one otherwise: store it as F32, F16 or BF16",
                             ws->files[i].path, name, dtype_name((*t)->dtype));
        if (!dtype_is_float((*t)->dtype) && !dtype_is_weight8((*t)->dtype))
            return ar_errorf(err, "%s: tensor '%s': dtype %s, expected F32, F16 or BF16%s",
                             ws->files[i].path, name, dtype_name((*t)->dtype),
                             linear ? " (or I8 or F8_E4M3 with its scales)" : "");
        return AR_OK;
    }
    return ar_errorf(err, "%s: tensor '%s' not found",
                     ws->n_files ? ws->files[0].path : "(no weights)", name);
}

/* Rows [row0, row0 + n) of the scales of the 8-bit weight name (the F32
 * tensor name_scale of `rows` elements), copied into scale; adds their
 * bytes to *bytes. The backend's weight_load_8bit checks their values. */
static int read_scales(weight_set_t *ws, const char *name, int64_t rows, int64_t row0, int64_t n,
                       float *scale, size_t *bytes, ar_error_t *err) {
    char sname[300];
    snprintf(sname, sizeof sname, "%s_scale", name);
    const st_tensor_t *t;
    int file;
    if (find_tensor(ws, sname, SHAPE1(rows), 0, &t, &file, err) != AR_OK)
        return ar_error_prefix(err, "the scales of 8-bit weight '%s'", name);
    if (t->dtype != DTYPE_F32)
        return ar_errorf(err, "%s: tensor '%s': dtype %s, expected F32 (an 8-bit weight's scales)",
                         ws->files[file].path, sname, dtype_name(t->dtype));
    memcpy(scale, (const char *)t->data + (size_t)row0 * sizeof(float), (size_t)n * sizeof(float));
    *bytes += (size_t)n * sizeof(float);
    return AR_OK;
}

/* Fails when any of the n values from data of tensor t (of file) is NaN or
 * infinite: such weights give NaN logits, and images of one colour with
 * nothing said. (8-bit weights: the backend's weight_load_8bit refuses an
 * fp8 NaN whatever --check-weights says.) */
static int check_finite(const weight_set_t *ws, const st_tensor_t *t, int file, const char *name,
                        const void *data, size_t n, ar_error_t *err) {
    size_t first = 0, bad;
    if (!ws->check_finite || !dtype_is_float(t->dtype) ||
        !(bad = dtype_count_nonfinite(data, t->dtype, n, &first)))
        return AR_OK;
    return ar_errorf(err,
                     "%s: tensor '%s' has %zu values that are NaN or infinite (of %zu; the first "
                     "at index %zu): the file is damaged or the training diverged "
                     "(--check-weights off loads it anyway)",
                     ws->files[file].path, name, bad, n, first);
}

/* The backend's weight_load_8bit, or why it has none. */
static int load_8bit(weight_set_t *ws, tensor_t *out, const void *src, dtype_t dtype,
                     const float *scale, int ndim, const int64_t *shape, ar_error_t *err) {
    if (!ws->be->weight_load_8bit)
        return ar_errorf(err, "8-bit (%s) weights do not load on the %s backend", dtype_name(dtype),
                         ws->be->name);
    return ws->be->weight_load_8bit(ws->be, out, src, dtype, scale, ndim, shape, err);
}

/* Rows [row0, row0 + n_rows) along the first dimension (all of them when
 * n_rows < 0) into backend memory; a weight of one op (use, not
 * LAYOUT_PLAIN) in the backend's own layout for it. */
static int load_rows(weight_set_t *ws, tensor_t *out, int64_t row0, int64_t n_rows, int ndim,
                     const int64_t *shape, tensor_layout_t use, ar_error_t *err, const char *name) {
    memset(out, 0, sizeof *out);
    const st_tensor_t *t;
    int file;
    if (find_tensor(ws, name, ndim, shape, use == LAYOUT_LINEAR, &t, &file, err) != AR_OK)
        return AR_ERR;
    int64_t sub[4], row = 1;
    for (int d = 0; d < ndim; d++) {
        sub[d] = shape[d];
        row *= d ? shape[d] : 1;
    }
    if (n_rows >= 0)
        sub[0] = n_rows;
    const size_t row_bytes = (size_t)row * dtype_size(t->dtype);
    const char *src = (const char *)t->data + (size_t)(n_rows >= 0 ? row0 : 0) * row_bytes;
    if (check_finite(ws, t, file, name, src, (size_t)sub[0] * (size_t)row, err) != AR_OK)
        return AR_ERR;
    size_t scale_bytes = 0;
    if (dtype_is_weight8(t->dtype)) {
        float *scale = ndim == 2 ? malloc((size_t)sub[0] * sizeof(float) + 1) : NULL;
        int rc = ndim != 2 ? ar_errorf(err, "an 8-bit weight must be a matrix, not %d-D", ndim)
                 : !scale  ? ar_errorf(err, "out of memory")
                           : read_scales(ws, name, shape[0], n_rows >= 0 ? row0 : 0, sub[0], scale,
                                         &scale_bytes, err);
        if (rc == AR_OK)
            rc = load_8bit(ws, out, src, t->dtype, scale, ndim, sub, err);
        free(scale);
        if (rc != AR_OK)
            return ar_error_prefix(err, "%s: tensor '%s'", ws->files[file].path, name);
    } else if (ws->be->weight_load(ws->be, out, src, t->dtype, ndim, sub, err) != AR_OK) {
        return ar_error_prefix(err, "%s: tensor '%s'", ws->files[file].path, name);
    }
    if (use != LAYOUT_PLAIN && ws->be->weight_prepare &&
        ws->be->weight_prepare(ws->be, out, use, err) != AR_OK) {
        ws->be->weight_free(ws->be, out);
        return ar_error_prefix(err, "%s: tensor '%s'", ws->files[file].path, name);
    }
    ws->bytes_loaded += (n_rows >= 0 ? (size_t)sub[0] * row_bytes : t->nbytes) + scale_bytes;
    safetensors_release(&ws->files[file], src, (size_t)sub[0] * row_bytes);
    return AR_OK;
}

/* The four loaders: load_rows with the name formatted. */
#define LOAD_ROWS(row0, n_rows, use)                                                               \
    do {                                                                                           \
        char name[256];                                                                            \
        va_list ap;                                                                                \
        va_start(ap, fmt);                                                                         \
        vsnprintf(name, sizeof name, fmt, ap);                                                     \
        va_end(ap);                                                                                \
        return load_rows(ws, out, row0, n_rows, ndim, shape, use, err, name);                      \
    } while (0)

int weight_load(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape, ar_error_t *err,
                const char *fmt, ...) {
    LOAD_ROWS(0, -1, LAYOUT_PLAIN);
}

int weight_load_rows(weight_set_t *ws, tensor_t *out, int64_t row0, int64_t n_rows, int ndim,
                     const int64_t *shape, ar_error_t *err, const char *fmt, ...) {
    LOAD_ROWS(row0, n_rows, LAYOUT_PLAIN);
}

int weight_load_linear(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape,
                       ar_error_t *err, const char *fmt, ...) {
    LOAD_ROWS(0, -1, LAYOUT_LINEAR);
}

int weight_load_linear_rows(weight_set_t *ws, tensor_t *out, int64_t row0, int64_t n_rows, int ndim,
                            const int64_t *shape, ar_error_t *err, const char *fmt, ...) {
    LOAD_ROWS(row0, n_rows, LAYOUT_LINEAR);
}

int weight_load_conv(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape,
                     ar_error_t *err, const char *fmt, ...) {
    LOAD_ROWS(0, -1, LAYOUT_CONV);
}

int weight_load_linear_stack(weight_set_t *ws, tensor_t *out, int groups,
                             const weight_part_t *parts, int64_t n, int64_t k, ar_error_t *err) {
    memset(out, 0, sizeof *out);
    const st_tensor_t *t[WEIGHT_MAX_STACK] = {0};
    int file[WEIGHT_MAX_STACK];
    if (groups < 1 || groups > WEIGHT_MAX_STACK)
        return ar_errorf(err, "a stacked Linear weight of %d parts (1 to %d)", groups,
                         WEIGHT_MAX_STACK);
    for (int g = 0; g < groups; g++) {
        const weight_part_t *p = &parts[g];
        if (find_tensor(ws, p->name, SHAPE2(p->rows, k), 1, &t[g], &file[g], err) != AR_OK)
            return AR_ERR;
        assert(p->row0 >= 0 && p->row0 + n <= p->rows);
        if (t[g]->dtype != t[0]->dtype)
            return ar_errorf(err,
                             "%s: tensor '%s' is %s where '%s' is %s: the Linears stacked into "
                             "one weight must share a type",
                             ws->files[file[g]].path, p->name, dtype_name(t[g]->dtype),
                             parts[0].name, dtype_name(t[0]->dtype));
    }
    const size_t esize = dtype_size(t[0]->dtype), part_bytes = (size_t)n * (size_t)k * esize;
    /* Consecutive row blocks of one tensor (a fused qkv) are the stack as
     * stored: loaded from the file's bytes, not copied first. */
    int in_place = 1;
    for (int g = 1; g < groups; g++)
        in_place &= t[g] == t[0] && parts[g].row0 == parts[0].row0 + g * n;
    const char *first = (const char *)t[0]->data + (size_t)parts[0].row0 * (size_t)k * esize;
    char *copy = in_place ? NULL : malloc(part_bytes * (size_t)groups + 1);
    if (!in_place && !copy)
        return ar_errorf(err, "out of memory stacking '%s' and %d more Linear weights",
                         parts[0].name, groups - 1);
    const int q8 = dtype_is_weight8(t[0]->dtype);
    float *scale = q8 ? malloc((size_t)groups * (size_t)n * sizeof(float) + 1) : NULL;
    size_t scale_bytes = 0;
    int rc = q8 && !scale ? ar_errorf(err, "out of memory") : AR_OK;
    for (int g = 0; g < groups && rc == AR_OK; g++) {
        const char *src = (const char *)t[g]->data + (size_t)parts[g].row0 * (size_t)k * esize;
        rc = check_finite(ws, t[g], file[g], parts[g].name, src, (size_t)n * (size_t)k, err);
        if (rc == AR_OK && q8)
            rc = read_scales(ws, parts[g].name, parts[g].rows, parts[g].row0, n,
                             scale + (size_t)g * n, &scale_bytes, err);
        if (copy)
            memcpy(copy + g * part_bytes, src, part_bytes);
    }
    if (rc == AR_OK &&
        (q8 ? load_8bit(ws, out, copy ? copy : first, t[0]->dtype, scale, SHAPE3(groups, n, k), err)
            : ws->be->weight_load(ws->be, out, copy ? copy : first, t[0]->dtype,
                                  SHAPE3(groups, n, k), err)) != AR_OK)
        rc = ar_error_prefix(err, "%s: tensor '%s' stacked with %d more", ws->files[file[0]].path,
                             parts[0].name, groups - 1);
    free(copy);
    free(scale);
    if (rc == AR_OK && ws->be->weight_prepare &&
        ws->be->weight_prepare(ws->be, out, LAYOUT_LINEAR, err) != AR_OK) {
        ws->be->weight_free(ws->be, out);
        rc = ar_error_prefix(err, "%s: tensor '%s' stacked with %d more", ws->files[file[0]].path,
                             parts[0].name, groups - 1);
    }
    if (rc == AR_OK) {
        ws->bytes_loaded += part_bytes * (size_t)groups + scale_bytes;
        for (int g = 0; g < groups; g++)
            safetensors_release(
                &ws->files[file[g]],
                (const char *)t[g]->data + (size_t)parts[g].row0 * (size_t)k * esize, part_bytes);
    }
    return rc;
}

int weight_load_qkv_biased(weight_set_t *ws, tensor_t *qkv, tensor_t *qkv_b, float **q_bias,
                           const char *prefix, const char *matrix, int64_t dim, ar_error_t *err) {
    weight_part_t parts[3];
    for (int j = 0; j < 3; j++) {
        snprintf(parts[j].name, sizeof parts[j].name, "%s.%s", prefix, matrix);
        parts[j].row0 = j * dim;
        parts[j].rows = 3 * dim;
    }
    memset(qkv_b, 0, sizeof *qkv_b);
    float *b = calloc(3 * (size_t)dim, sizeof *b);
    *q_bias = malloc((size_t)dim * sizeof **q_bias);
    const int rc =
        !b || !*q_bias
            ? ar_errorf(err, "out of memory")
            : weight_load_linear_stack(ws, qkv, 3, parts, dim, dim, err) ||
                  weight_read_f32(ws, b, SHAPE1(dim), err, "%s.q_bias", prefix) ||
                  weight_read_f32(ws, b + 2 * dim, SHAPE1(dim), err, "%s.v_bias", prefix) ||
                  ws->be->weight_load(ws->be, qkv_b, b, DTYPE_F32, SHAPE2(3, dim), err);
    if (!rc)
        memcpy(*q_bias, b, (size_t)dim * sizeof **q_bias);
    free(b);
    if (rc && qkv->data)
        ws->be->weight_free(ws->be, qkv);
    if (rc) {
        free(*q_bias);
        *q_bias = NULL;
    }
    return rc ? AR_ERR : AR_OK;
}

int weight_read_f32(weight_set_t *ws, float *host, int ndim, const int64_t *shape, ar_error_t *err,
                    const char *fmt, ...) {
    char name[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(name, sizeof name, fmt, ap);
    va_end(ap);
    const st_tensor_t *t;
    int file;
    if (find_tensor(ws, name, ndim, shape, 0, &t, &file, err) != AR_OK)
        return AR_ERR;
    int64_t n = 1;
    for (int d = 0; d < ndim; d++)
        n *= shape[d];
    if (check_finite(ws, t, file, name, t->data, (size_t)n, err) != AR_OK)
        return AR_ERR;
    dtype_to_f32(host, t->data, t->dtype, (size_t)n);
    ws->bytes_loaded += t->nbytes;
    return AR_OK;
}
