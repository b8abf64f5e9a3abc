/* KV calibration: orderings from attention mass, and the file that holds
 * them (kv_calibration.h). */
#include "engine/policy/kv_calibration.h"

#include "engine/format/json_file.h"

#include <cjson/cJSON.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define FORMAT "arserve-kv-calibration"
#define VERSION_SIZES 2 /* several sizes' calibrations */
#define PATH_MAX_WHERE 1200

void kv_calibration_free(kv_calibration_t *c) {
    free(c->beta);
    free(c->htr);
    free(c->cas_order);
    free(c->scas_order);
    memset(c, 0, sizeof *c);
}

static int shape_from(kv_calibration_t *c, const kv_geometry_t *g, int sink_scales,
                      ar_error_t *err) {
    memset(c, 0, sizeof *c);
    if (g->step_unit != KV_STEP_SEGMENT || g->n_segments < 2)
        return ar_errorf(err, "a KV calibration is for next-scale models (two scales or more)");
    c->n_layers = g->n_layers;
    c->n_heads = g->n_heads;
    c->n_scales = g->n_segments;
    memcpy(c->scale_tokens, g->segment_tokens, sizeof c->scale_tokens);
    c->sink_scales = sink_scales;
    const size_t T = (size_t)g->n_layers * g->n_heads;
    c->cas_order = malloc(T * sizeof *c->cas_order);
    c->scas_order = malloc(T * (size_t)(c->n_scales - 1) * sizeof *c->scas_order);
    if (!c->cas_order || !c->scas_order) {
        kv_calibration_free(c);
        return ar_errorf(err, "out of memory");
    }
    return AR_OK;
}

int kv_calibration_synthetic(kv_calibration_t *c, const kv_geometry_t *g, int sink_scales,
                             ar_error_t *err) {
    if (shape_from(c, g, sink_scales, err) != AR_OK)
        return AR_ERR;
    const int T = c->n_layers * c->n_heads;
    for (int i = 0; i < T; i++)
        c->cas_order[i] = i;
    for (int src = 0; src < c->n_scales - 1; src++)
        memcpy(c->scas_order + (size_t)src * T, c->cas_order, (size_t)T * sizeof(int));
    /* Statistics alike for every head: each query scale's mass spread
     * evenly over the scales so far, no history top-K. */
    const int K = c->n_scales;
    c->beta = calloc((size_t)T * K * K, sizeof *c->beta);
    c->htr = calloc((size_t)T * K, sizeof *c->htr);
    if (!c->beta || !c->htr) {
        kv_calibration_free(c);
        return ar_errorf(err, "out of memory");
    }
    for (int h = 0; h < T; h++)
        for (int q = 0; q < K; q++)
            for (int src = 0; src <= q; src++)
                c->beta[((size_t)h * K + q) * K + src] = 1.0f / (float)(q + 1);
    return AR_OK;
}

/* Units (layer * n_heads + head) by ascending score, ties by head, then
 * layer: HeatKV's calibration sorts (score, head, layer) tuples, and on
 * equal scores the order decides which units go first (qsort is not
 * stable, so every tie is broken here). */
typedef struct {
    const double *score;
    int n_heads;
} order_key_t;

static int by_score(const void *a, const void *b, void *key) {
    const int x = *(const int *)a, y = *(const int *)b;
    const order_key_t *k = key;
    if (k->score[x] != k->score[y])
        return k->score[x] < k->score[y] ? -1 : 1;
    const int hx = x % k->n_heads, hy = y % k->n_heads;
    if (hx != hy)
        return (hx > hy) - (hx < hy);
    return (x > y) - (x < y);
}

static void order_by(int *order, const double *score, int T, int n_heads) {
    for (int i = 0; i < T; i++)
        order[i] = i;
    order_key_t key = {score, n_heads};
    qsort_r(order, (size_t)T, sizeof *order, by_score, &key);
}

int kv_calibration_from_beta(kv_calibration_t *c, const kv_geometry_t *g, const float *beta,
                             int n_prompts, int sink_scales, ar_error_t *err) {
    if (shape_from(c, g, sink_scales, err) != AR_OK)
        return AR_ERR;
    const int T = c->n_layers * c->n_heads, K = c->n_scales;
    const size_t n_beta = (size_t)T * K * K;
    double *score = malloc((size_t)T * sizeof *score);
    c->beta = malloc(n_beta * sizeof *c->beta);
    if (!score || !c->beta) {
        free(score);
        kv_calibration_free(c);
        return ar_errorf(err, "out of memory");
    }
    memcpy(c->beta, beta, n_beta * sizeof *beta);
    c->n_prompts = n_prompts;
#define BETA(head, q, src) (double)beta[((size_t)(head)*K + (q)) * K + (src)]
    /* S-CAS (eq. 4): the mass later scales give source src, averaged. */
    for (int src = 0; src < K - 1; src++) {
        for (int h = 0; h < T; h++) {
            double sum = 0;
            for (int q = src + 1; q < K; q++)
                sum += BETA(h, q, src);
            score[h] = sum / (K - 1 - src);
        }
        order_by(c->scas_order + (size_t)src * T, score, T, c->n_heads);
    }
    /* CAS (eq. 3): the last scale's mass on the cached non-sink scales. */
    for (int h = 0; h < T; h++) {
        double sum = 0;
        for (int src = sink_scales; src < K - 1; src++)
            sum += BETA(h, K - 1, src);
        score[h] = sink_scales < K - 1 ? sum / (K - 1 - sink_scales) : 0;
    }
#undef BETA
    order_by(c->cas_order, score, T, c->n_heads);
    free(score);
    return AR_OK;
}

/* v[0..n) as "a,b,c" into buf, cut short (ending "...") where it does not fit. */
static void join_ints(char *buf, size_t cap, const int *v, int n) {
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < n; i++) {
        const int w = snprintf(buf + used, cap - used, "%s%d", i ? "," : "", v[i]);
        if (w < 0 || (size_t)w >= cap - used) {
            snprintf(buf + (cap > 4 ? cap - 4 : 0), cap > 4 ? 4 : cap, "...");
            return;
        }
        used += (size_t)w;
    }
}

static int same_scales(const kv_calibration_t *c, const int *tokens, int n) {
    if (c->n_scales != n)
        return 0;
    for (int i = 0; i < n; i++)
        if (c->scale_tokens[i] != tokens[i])
            return 0;
    return 1;
}

/* 1 when c goes with the size named size of these scales. */
static int made_for(const kv_calibration_t *c, const char *size, const int *tokens, int n) {
    if (c->size[0] && size && size[0])
        return strcmp(c->size, size) == 0;
    return same_scales(c, tokens, n);
}

int kv_calibration_check(const kv_calibration_t *c, const kv_geometry_t *g, ar_error_t *err) {
    const int shape =
        c->n_layers == g->n_layers && c->n_heads == g->n_heads && g->step_unit == KV_STEP_SEGMENT;
    if (shape && same_scales(c, g->segment_tokens, g->n_segments))
        return AR_OK;
    if (shape) {
        char made[96], here[96];
        join_ints(made, sizeof made, c->scale_tokens, c->n_scales);
        join_ints(here, sizeof here, g->segment_tokens, g->n_segments);
        return ar_errorf(err,
                         "the KV calibration has no entry for this image size (scales of %s "
                         "tokens; it was made at scales of %s): `arserve calibrate --size` adds "
                         "a size's",
                         here, made);
    }
    return ar_errorf(err,
                     "the KV calibration is for %d layers x %d heads and %d scales, this model "
                     "has %d x %d and %d scales of these sizes: run `arserve calibrate` on it",
                     c->n_layers, c->n_heads, c->n_scales, g->n_layers, g->n_heads, g->n_segments);
}

/* ---- the file ---- */

static cJSON *int_array(const int *v, int n) { return cJSON_CreateIntArray(v, n); }

/* c's fields into obj; 0 when out of memory. */
static int put_fields(cJSON *obj, const kv_calibration_t *c) {
    const int T = c->n_layers * c->n_heads, K = c->n_scales;
    cJSON *scas = cJSON_CreateArray();
    if (!scas)
        return 0;
    cJSON_AddNumberToObject(obj, "n_layers", c->n_layers);
    cJSON_AddNumberToObject(obj, "n_heads", c->n_heads);
    if (c->size[0])
        cJSON_AddStringToObject(obj, "size", c->size);
    cJSON_AddItemToObject(obj, "scale_tokens", int_array(c->scale_tokens, K));
    cJSON_AddNumberToObject(obj, "sink_scales", c->sink_scales);
    cJSON_AddNumberToObject(obj, "prompts", c->n_prompts);
    cJSON_AddItemToObject(obj, "cas_order", int_array(c->cas_order, T));
    for (int src = 0; src < K - 1; src++)
        cJSON_AddItemToArray(scas, int_array(c->scas_order + (size_t)src * T, T));
    cJSON_AddItemToObject(obj, "scas_order", scas);
    if (c->beta)
        cJSON_AddItemToObject(obj, "beta", json_float_array(c->beta, (size_t)T * K * K));
    if (c->htr)
        cJSON_AddItemToObject(obj, "htr", json_float_array(c->htr, (size_t)T * K));
    return 1;
}

static cJSON *file_root(int version) {
    cJSON *root = cJSON_CreateObject();
    if (root) {
        cJSON_AddStringToObject(root, "format", FORMAT);
        cJSON_AddNumberToObject(root, "version", version);
    }
    return root;
}

static int write_root(cJSON *root, int ok, const char *path, ar_error_t *err) {
    const int rc =
        ok && root ? json_file_write(root, path, err) : ar_errorf(err, "%s: out of memory", path);
    cJSON_Delete(root);
    return rc;
}

int kv_calibration_save(const kv_calibration_t *c, const char *path, ar_error_t *err) {
    cJSON *root = file_root(1);
    return write_root(root, root && put_fields(root, c), path, err);
}

int kv_calibration_set_save(const kv_calibration_set_t *s, const char *path, ar_error_t *err) {
    if (s->n == 1)
        return kv_calibration_save(&s->c[0], path, err);
    cJSON *root = file_root(VERSION_SIZES), *all = cJSON_CreateArray();
    int ok = root && all;
    if (ok)
        cJSON_AddItemToObject(root, "calibrations", all);
    else
        cJSON_Delete(all);
    for (int i = 0; ok && i < s->n; i++) {
        cJSON *one = cJSON_CreateObject();
        ok = one && put_fields(one, &s->c[i]);
        if (one)
            cJSON_AddItemToArray(all, one);
    }
    return write_root(root, ok, path, err);
}

/* A permutation of [0, T) from array a into out. */
static int get_order(const cJSON *a, int T, int *out, const char *path, const char *what,
                     ar_error_t *err) {
    if (!cJSON_IsArray(a) || cJSON_GetArraySize(a) != T)
        return ar_errorf(err, "%s: %s must be an array of the %d heads", path, what, T);
    unsigned char *seen = calloc((size_t)T, 1);
    if (!seen)
        return ar_errorf(err, "out of memory");
    int i = 0, rc = AR_OK;
    for (const cJSON *it = a->child; it; it = it->next, i++) {
        const double v = it->valuedouble;
        if (!cJSON_IsNumber(it) || v != (double)(int)v || v < 0 || v >= T || seen[(int)v]) {
            rc = ar_errorf(err, "%s: %s[%d] is not a head number of its own (0 to %d, each once)",
                           path, what, i, T - 1);
            break;
        }
        seen[(int)v] = 1;
        out[i] = (int)v;
    }
    free(seen);
    return rc;
}

/* One calibration's fields from obj; errors start with where (the file,
 * and the entry in a file of several). */
static int get_fields(kv_calibration_t *c, const cJSON *obj, const char *where, ar_error_t *err) {
    memset(c, 0, sizeof *c);
    kv_geometry_t g = {.step_unit = KV_STEP_SEGMENT};
    const cJSON *tok = cJSON_GetObjectItemCaseSensitive(obj, "scale_tokens");
    int sinks = 0, prompts = 0;
    if (json_get_int(obj, "n_layers", 1, 1 << 12, &g.n_layers, where, err) ||
        json_get_int(obj, "n_heads", 1, 1 << 12, &g.n_heads, where, err) ||
        json_get_int(obj, "prompts", 0, 1 << 30, &prompts, where, err))
        return AR_ERR;
    g.n_segments = cJSON_GetArraySize(tok);
    if (!cJSON_IsArray(tok) || g.n_segments < 2 || g.n_segments > KV_MAX_SEGMENTS)
        return ar_errorf(err, "%s: \"scale_tokens\" must list 2 to %d scales", where,
                         KV_MAX_SEGMENTS);
    int i = 0;
    for (const cJSON *it = tok->child; it; it = it->next, i++) {
        if (!cJSON_IsNumber(it) || it->valuedouble < 1 || it->valuedouble > 1 << 20)
            return ar_errorf(err, "%s: scale_tokens[%d] must be a positive integer", where, i);
        g.segment_tokens[i] = (int)it->valuedouble;
    }
    if (json_get_int(obj, "sink_scales", 0, g.n_segments, &sinks, where, err) ||
        shape_from(c, &g, sinks, err) != AR_OK)
        return AR_ERR;
    c->n_prompts = prompts;
    const cJSON *size = cJSON_GetObjectItemCaseSensitive(obj, "size");
    if (size && (!cJSON_IsString(size) || !size->valuestring[0] ||
                 strlen(size->valuestring) >= sizeof c->size)) {
        kv_calibration_free(c);
        return ar_errorf(err, "%s: \"size\" must be an image size's name (\"WxH\")", where);
    }
    if (size)
        strcpy(c->size, size->valuestring);
    const int T = g.n_layers * g.n_heads, K = g.n_segments;
    const cJSON *scas = cJSON_GetObjectItemCaseSensitive(obj, "scas_order");
    int rc = get_order(cJSON_GetObjectItemCaseSensitive(obj, "cas_order"), T, c->cas_order, where,
                       "cas_order", err);
    if (rc == AR_OK && (!cJSON_IsArray(scas) || cJSON_GetArraySize(scas) != K - 1))
        rc = ar_errorf(err, "%s: \"scas_order\" must hold one ordering per source scale (%d)",
                       where, K - 1);
    i = 0;
    for (const cJSON *it = scas ? scas->child : NULL; rc == AR_OK && it; it = it->next, i++) {
        char what[32];
        snprintf(what, sizeof what, "scas_order[%d]", i);
        rc = get_order(it, T, c->scas_order + (size_t)i * T, where, what, err);
    }
    if (rc == AR_OK &&
        (json_get_floats(obj, "beta", (size_t)T * K * K, &c->beta, where, err) != AR_OK ||
         json_get_floats(obj, "htr", (size_t)T * K, &c->htr, where, err) != AR_OK))
        rc = AR_ERR;
    if (rc != AR_OK)
        kv_calibration_free(c);
    return rc;
}

/* The file's root and version (1 or VERSION_SIZES); NULL on error. */
static cJSON *read_root(const char *path, int *version, ar_error_t *err) {
    cJSON *root = json_file_read(path, err);
    if (!root)
        return NULL;
    const cJSON *fmt = cJSON_GetObjectItemCaseSensitive(root, "format");
    if (!cJSON_IsString(fmt) || strcmp(fmt->valuestring, FORMAT) != 0)
        ar_errorf(err, "%s: \"format\" must be \"%s\"", path, FORMAT);
    else if (json_get_int(root, "version", 1, VERSION_SIZES, version, path, err) == AR_OK)
        return root;
    cJSON_Delete(root);
    return NULL;
}

int kv_calibration_set_load(kv_calibration_set_t *s, const char *path, ar_error_t *err) {
    memset(s, 0, sizeof *s);
    int version = 0, rc = AR_OK;
    cJSON *root = read_root(path, &version, err);
    if (!root)
        return AR_ERR;
    if (version == 1) {
        rc = get_fields(&s->c[0], root, path, err);
        s->n = rc == AR_OK;
        cJSON_Delete(root);
        return rc;
    }
    const cJSON *all = cJSON_GetObjectItemCaseSensitive(root, "calibrations");
    const int n = cJSON_GetArraySize(all);
    if (!cJSON_IsArray(all) || n < 1 || n > KV_CALIBRATION_MAX_SIZES)
        rc = ar_errorf(err, "%s: \"calibrations\" must list 1 to %d image sizes' calibrations",
                       path, KV_CALIBRATION_MAX_SIZES);
    for (const cJSON *it = all ? all->child : NULL; rc == AR_OK && it; it = it->next) {
        char where[PATH_MAX_WHERE];
        snprintf(where, sizeof where, "%s: calibrations[%d]", path, s->n);
        if (!cJSON_IsObject(it))
            rc = ar_errorf(err, "%s must be an object", where);
        else if ((rc = get_fields(&s->c[s->n], it, where, err)) == AR_OK)
            s->n++;
        for (int j = 0; rc == AR_OK && j < s->n - 1; j++)
            if (made_for(&s->c[j], s->c[s->n - 1].size, s->c[s->n - 1].scale_tokens,
                         s->c[s->n - 1].n_scales))
                rc = ar_errorf(err,
                               "%s is for the image size of calibrations[%d]: one entry a "
                               "size",
                               where, j);
    }
    cJSON_Delete(root);
    if (rc != AR_OK)
        kv_calibration_set_free(s);
    return rc;
}

/* ---- a model's set ---- */

void kv_calibration_set_free(kv_calibration_set_t *s) {
    for (int i = 0; i < s->n; i++)
        kv_calibration_free(&s->c[i]);
    s->n = 0;
}

const kv_calibration_t *kv_calibration_set_pick(const kv_calibration_set_t *s, const char *size,
                                                const kv_geometry_t *g) {
    for (int i = 0; s && i < s->n; i++)
        if (made_for(&s->c[i], size, g->segment_tokens, g->n_segments))
            return &s->c[i];
    return NULL;
}

int kv_calibration_set_put(kv_calibration_set_t *s, kv_calibration_t *c, ar_error_t *err) {
    int i = 0;
    while (i < s->n && !made_for(&s->c[i], c->size, c->scale_tokens, c->n_scales))
        i++;
    if (i == KV_CALIBRATION_MAX_SIZES)
        return ar_errorf(err, "a KV calibration file holds at most %d image sizes",
                         KV_CALIBRATION_MAX_SIZES);
    if (i < s->n)
        kv_calibration_free(&s->c[i]);
    else
        s->n++;
    s->c[i] = *c;
    memset(c, 0, sizeof *c);
    return AR_OK;
}
