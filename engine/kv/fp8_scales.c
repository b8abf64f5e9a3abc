/* fp8 KV scales (fp8_scales.h). */
#include "engine/kv/fp8_scales.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "engine/backend/backend.h"
#include "engine/format/json_file.h"

#define FORMAT "arserve-kv-scales"
#define VERSION 1
#define E4M3_MAX 448.0f

float fp8_scale_of(float amax) { return amax > 0 ? amax / E4M3_MAX : 1.0f; }

int fp8_scales_init(fp8_scales_t *s, int n_layers, int n_heads, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    const size_t T = (size_t)n_layers * (size_t)n_heads;
    s->n_layers = n_layers;
    s->n_heads = n_heads;
    s->k_amax = calloc(T, sizeof *s->k_amax);
    s->v_amax = calloc(T, sizeof *s->v_amax);
    if (!s->k_amax || !s->v_amax) {
        fp8_scales_free(s);
        return ar_errorf(err, "out of memory");
    }
    return AR_OK;
}

void fp8_scales_free(fp8_scales_t *s) {
    free(s->k_amax);
    free(s->v_amax);
    memset(s, 0, sizeof *s);
}

int fp8_scales_observe(fp8_scales_t *s, const kv_seq_t *seq, ar_error_t *err) {
    if (seq->n_layers != s->n_layers || seq->n_heads != s->n_heads)
        return ar_errorf(err, "a sequence of %d x %d heads, scales of %d x %d", seq->n_layers,
                         seq->n_heads, s->n_layers, s->n_heads);
    backend_t *be = seq->pool->be;
    const kv_blocks_t *pool = &seq->pool->blocks;
    const int T = s->n_layers * s->n_heads;
    int longest = 0;
    for (int i = 0; i < T; i++)
        longest = seq->heads[i].len > longest ? seq->heads[i].len : longest;
    if (longest == 0)
        return AR_OK;
    const size_t n = (size_t)longest * (size_t)pool->head_dim;
    float *dev = be->alloc(be, n * sizeof *dev), *host = malloc(n * sizeof *host);
    int rc = dev && host ? AR_OK : ar_errorf(err, "out of memory for %d cached rows", longest);
    for (int i = 0; rc == AR_OK && i < T; i++) {
        const kv_head_t *h = &seq->heads[i];
        const kv_view_t view = kv_head_view(h, h->len);
        const size_t m = (size_t)h->len * (size_t)pool->head_dim;
        for (int values = 0; values <= 1; values++) {
            be->kv_read_rows(be, dev, pool, &view, 0, h->len, values);
            be->download(be, host, dev, m * sizeof *host);
            float *amax = values ? &s->v_amax[i] : &s->k_amax[i];
            for (size_t j = 0; j < m; j++)
                *amax = fabsf(host[j]) > *amax ? fabsf(host[j]) : *amax;
        }
    }
    if (rc == AR_OK && backend_status(be, err) != AR_OK)
        rc = AR_ERR;
    if (dev)
        be->free(be, dev);
    free(host);
    return rc;
}

void fp8_scales_apply(const fp8_scales_t *s, kv_seq_t *seq) {
    const int T = s->n_layers * s->n_heads;
    for (int i = 0; i < T; i++) {
        seq->heads[i].k_scale = fp8_scale_of(s->k_amax[i]);
        seq->heads[i].v_scale = fp8_scale_of(s->v_amax[i]);
    }
}

int fp8_scales_save(const fp8_scales_t *s, const char *path, ar_error_t *err) {
    const size_t T = (size_t)s->n_layers * (size_t)s->n_heads;
    cJSON *root = cJSON_CreateObject();
    if (!root)
        return ar_errorf(err, "%s: out of memory", path);
    cJSON_AddStringToObject(root, "format", FORMAT);
    cJSON_AddNumberToObject(root, "version", VERSION);
    cJSON_AddNumberToObject(root, "n_layers", s->n_layers);
    cJSON_AddNumberToObject(root, "n_heads", s->n_heads);
    cJSON_AddNumberToObject(root, "prompts", s->n_prompts);
    cJSON_AddItemToObject(root, "k_amax", json_float_array(s->k_amax, T));
    cJSON_AddItemToObject(root, "v_amax", json_float_array(s->v_amax, T));
    const int rc = json_file_write(root, path, err);
    cJSON_Delete(root);
    return rc;
}

/* Every amax a finite number >= 0. */
static int check_amax(const float *a, size_t n, const char *path, const char *key,
                      ar_error_t *err) {
    for (size_t i = 0; i < n; i++)
        if (!(a[i] >= 0) || !isfinite(a[i]))
            return ar_errorf(err, "%s: %s[%zu] must be a finite number >= 0", path, key, i);
    return AR_OK;
}

int fp8_scales_load(fp8_scales_t *s, const char *path, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    cJSON *root = json_file_read(path, err);
    if (!root)
        return AR_ERR;
    int rc = AR_ERR, version = 0;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, FORMAT) != 0)
        ar_errorf(err, "%s: \"format\" must be \"%s\"", path, FORMAT);
    else if (json_get_int(root, "version", VERSION, VERSION, &version, path, err) == AR_OK &&
             json_get_int(root, "n_layers", 1, 1 << 12, &s->n_layers, path, err) == AR_OK &&
             json_get_int(root, "n_heads", 1, 1 << 12, &s->n_heads, path, err) == AR_OK &&
             json_get_int(root, "prompts", 0, 1 << 30, &s->n_prompts, path, err) == AR_OK) {
        const size_t T = (size_t)s->n_layers * (size_t)s->n_heads;
        if (json_get_floats(root, "k_amax", T, &s->k_amax, path, err) == AR_OK &&
            json_get_floats(root, "v_amax", T, &s->v_amax, path, err) == AR_OK) {
            if (!s->k_amax || !s->v_amax)
                ar_errorf(err, "%s: \"%s\" is missing", path, s->k_amax ? "v_amax" : "k_amax");
            else if (check_amax(s->k_amax, T, path, "k_amax", err) == AR_OK &&
                     check_amax(s->v_amax, T, path, "v_amax", err) == AR_OK)
                rc = AR_OK;
        }
    }
    cJSON_Delete(root);
    if (rc != AR_OK)
        fp8_scales_free(s);
    return rc;
}
