/* The weights of a model directory: its safetensors files, opened together,
 * and a loader that finds a tensor by canonical name, checks its shape and
 * copies it into backend memory. */
#ifndef ARSERVE_WEIGHTS_H
#define ARSERVE_WEIGHTS_H

#include "engine/backend/backend.h"
#include "engine/format/safetensors.h"
#include "engine/model_config.h"

typedef struct weight_set {
    int n_files;
    safetensors_t files[MODEL_MAX_WEIGHT_FILES];
    backend_t *be;
    size_t bytes_loaded;
    int check_finite; /* refuse a tensor holding NaN or Inf (weight_set_open sets it) */
} weight_set_t;

/* Opens the files cfg lists, relative to dir. */
int weight_set_open(weight_set_t *ws, const char *dir, const model_config_t *cfg, backend_t *be,
                    ar_error_t *err);
void weight_set_close(weight_set_t *ws);

/* The float type most bytes of the files' tensors are stored in (f32 when
 * none): the model's "weights' type", which the KV cache takes by default.
 * An 8-bit Linear weight counts as the type it was quantised from (its
 * file's metadata quantized_from; bf16 without it), its scales not at
 * all: a quantised model keeps its KV type. */
dtype_t weight_set_main_dtype(const weight_set_t *ws);

/* The bytes of every tensor in the files, as stored (8-bit weights and
 * their scales as they are): what the model takes in backend memory, but
 * for the CPU's fp32 copies of 16-bit vectors. */
size_t weight_set_bytes(const weight_set_t *ws);

/* Loads the tensor named by fmt (printf-style) with the given shape into
 * out. Errors name the file, the tensor and the expected/actual shape, or
 * how many of its values are not finite (unless check_finite is 0). */
int weight_load(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape, ar_error_t *err,
                const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* weight_load of rows [row0, row0 + n_rows) along the first dimension of
 * the tensor, whose whole shape is `shape` (a fused matrix split in parts). */
int weight_load_rows(weight_set_t *ws, tensor_t *out, int64_t row0, int64_t n_rows, int ndim,
                     const int64_t *shape, ar_error_t *err, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));

/* weight_load and weight_load_rows of a matrix used only as a Linear
 * weight (matmul's w): the backend may then store it in its own layout
 * (backend.h's weight_prepare), so no other op may read it. */
int weight_load_linear(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape,
                       ar_error_t *err, const char *fmt, ...) __attribute__((format(printf, 6, 7)));
int weight_load_linear_rows(weight_set_t *ws, tensor_t *out, int64_t row0, int64_t n_rows, int ndim,
                            const int64_t *shape, ar_error_t *err, const char *fmt, ...)
    __attribute__((format(printf, 8, 9)));

/* One matrix of a stacked Linear weight: rows [row0, row0 + n) of the
 * tensor called name, whose shape is [rows, k]. */
typedef struct weight_part {
    char name[256];
    int64_t row0, rows;
} weight_part_t;

/* The most matrices one stacked Linear weight holds (q, k and v). */
#define WEIGHT_MAX_STACK 4

/* The stacked Linear weight [groups, n, k] (backend.h's matmul: one call
 * for Linears that read the same input) from its groups parts, which must
 * share a storage type; used only as matmul's w, like weight_load_linear.
 * Errors name the file and the part. */
int weight_load_linear_stack(weight_set_t *ws, tensor_t *out, int groups,
                             const weight_part_t *parts, int64_t n, int64_t k, ar_error_t *err);

/* The fused q/k/v matrix prefix.matrix ([3 dim, dim], VAR's and
 * Infinity's self-attention) as a stacked Linear weight [3, dim, dim] into
 * qkv, and its biases as [3, dim] fp32 into qkv_b: prefix.q_bias, zeros for
 * k, prefix.v_bias. *q_bias: a host copy of prefix.q_bias (dim floats,
 * malloc'd; the caller frees it), what ScaleKV's scores take off the query
 * rows (kv_policy_layer.h). */
int weight_load_qkv_biased(weight_set_t *ws, tensor_t *qkv, tensor_t *qkv_b, float **q_bias,
                           const char *prefix, const char *matrix, int64_t dim, ar_error_t *err);

/* weight_load of a convolution's kernels, used only as conv2d's w: the
 * backend may then store them in its own layout (backend.h's
 * weight_prepare), so no other op may read them. */
int weight_load_conv(weight_set_t *ws, tensor_t *out, int ndim, const int64_t *shape,
                     ar_error_t *err, const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* The whole tensor as host fp32 in host (numel floats), for weights that
 * are transformed before use. */
int weight_read_f32(weight_set_t *ws, float *host, int ndim, const int64_t *shape, ar_error_t *err,
                    const char *fmt, ...) __attribute__((format(printf, 6, 7)));

/* Shape shorthands for weight_load. */
#define SHAPE1(a)                                                                                  \
    1, (const int64_t[]) { (a) }
#define SHAPE2(a, b)                                                                               \
    2, (const int64_t[]) { (a), (b) }
#define SHAPE3(a, b, c)                                                                            \
    3, (const int64_t[]) { (a), (b), (c) }
#define SHAPE4(a, b, c, d)                                                                         \
    4, (const int64_t[]) { (a), (b), (c), (d) }

#endif
