/* Reader for safetensors files (weights and golden data): the file is
 * memory-mapped read-only and its whole header is validated before any pointer
 * into it is formed, so a corrupt or hostile file yields an error, never a crash. */
#ifndef ARSERVE_SAFETENSORS_H
#define ARSERVE_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "base/dtype.h"
#include "base/status.h"

#define ST_MAX_DIMS 8

typedef struct st_tensor {
    const char *name; /* owned by the safetensors_t */
    dtype_t dtype;
    int ndim; /* 0..ST_MAX_DIMS; 0 is a scalar */
    int64_t shape[ST_MAX_DIMS];
    /* Points into the read-only mapping; NULL exactly when nbytes == 0. Not
     * necessarily aligned for dtype (the format does not promise it): read
     * through memcpy or dtype_to_f32. */
    const void *data;
    size_t nbytes;
} st_tensor_t;

typedef struct safetensors {
    char *path;
    void *map;
    size_t map_size;
    st_tensor_t *tensors; /* sorted by name (strcmp order) */
    int n_tensors;
    /* private */
    void *json;           /* parsed header (cJSON *); owns the names and metadata */
    const void *metadata; /* the `__metadata__` object (cJSON *), or NULL */
} safetensors_t;

/* Opens and validates path. On AR_OK, st owns the mapping until
 * safetensors_close. On AR_ERR, err names the file, the tensor (if any) and the
 * problem, and st is left zeroed (closing it is harmless). st must not already
 * hold an open file. */
int safetensors_open(safetensors_t *st, const char *path, ar_error_t *err);

/* Releases everything; safe on a zeroed, failed or already closed struct. */
void safetensors_close(safetensors_t *st);

/* Gives back the mapping's resident pages wholly inside [data, data + n):
 * bytes a caller has copied out stop counting in the process's RSS, so loading
 * a model holds its copy and one tensor of the file, not the file as well. A
 * later read of them maps them in again from the file. */
void safetensors_release(const safetensors_t *st, const void *data, size_t n);

/* The tensor called name, or NULL. Binary search: O(log n). */
const st_tensor_t *safetensors_find(const safetensors_t *st, const char *name);

/* Finds name and checks its dtype is a float type (F32, F16, BF16) and its shape
 * equals shape[0..ndim). On AR_ERR the message names the file and tensor, e.g.
 * "model.safetensors: tensor 'llm.norm.weight': shape [64] expected [32]".
 * out may be NULL when only the check is wanted. */
int safetensors_get(const safetensors_t *st, const char *name, int ndim, const int64_t *shape,
                    const st_tensor_t **out, ar_error_t *err);

/* As safetensors_get but accepts any dtype (integer data in golden files). */
int safetensors_get_any(const safetensors_t *st, const char *name, int ndim, const int64_t *shape,
                        const st_tensor_t **out, ar_error_t *err);

/* The string value of key in `__metadata__`, or NULL if there is none. */
const char *safetensors_metadata(const safetensors_t *st, const char *key);

#endif
