/* JSON files arserve writes and reads back (json_file.h). */
#include "engine/format/json_file.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/file.h"
#include "engine/format/json_strict.h"

/* The largest file read: VAR-d30's KV calibration, the largest measured,
 * is 1.3 MB. */
#define JSON_FILE_MAX_BYTES ((size_t)64 << 20)

cJSON *json_file_read(const char *path, ar_error_t *err) {
    size_t n;
    char *text = file_read_all(path, NULL, JSON_FILE_MAX_BYTES, &n, err);
    if (!text)
        return NULL;
    cJSON *root = json_parse_strict(text, (size_t)n, JSON_STRICT_DEFAULT_DEPTH, NULL, err);
    free(text);
    if (!root)
        ar_error_prefix(err, "%s: not valid JSON", path);
    return root;
}

int json_file_write(const cJSON *root, const char *path, ar_error_t *err) {
    char *text = cJSON_PrintUnformatted(root);
    if (!text)
        return ar_errorf(err, "%s: out of memory", path);
    FILE *f = fopen(path, "w");
    int ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = (f && fclose(f) == 0) && ok;
    free(text);
    return ok ? AR_OK : ar_errorf(err, "%s: cannot write: %s", path, strerror(errno));
}

int json_get_int(const cJSON *o, const char *key, int lo, int hi, int *out, const char *path,
                 ar_error_t *err) {
    const cJSON *it = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!cJSON_IsNumber(it) || it->valuedouble != (double)(int)it->valuedouble ||
        it->valuedouble < lo || it->valuedouble > hi)
        return ar_errorf(err, "%s: \"%s\" must be an integer from %d to %d", path, key, lo, hi);
    *out = (int)it->valuedouble;
    return AR_OK;
}

int json_get_floats(const cJSON *o, const char *key, size_t n, float **out, const char *path,
                    ar_error_t *err) {
    const cJSON *a = cJSON_GetObjectItemCaseSensitive(o, key);
    if (!a)
        return AR_OK;
    if (!cJSON_IsArray(a) || (size_t)cJSON_GetArraySize(a) != n)
        return ar_errorf(err, "%s: \"%s\" must hold %zu numbers", path, key, n);
    if (!(*out = malloc(n * sizeof **out)))
        return ar_errorf(err, "out of memory");
    size_t j = 0;
    for (const cJSON *it = a->child; it; it = it->next, j++) {
        if (!cJSON_IsNumber(it))
            return ar_errorf(err, "%s: %s[%zu] is not a number", path, key, j);
        (*out)[j] = (float)it->valuedouble;
    }
    return AR_OK;
}

cJSON *json_float_array(const float *v, size_t n) {
    cJSON *a = cJSON_CreateArray();
    for (size_t i = 0; a && i < n; i++)
        cJSON_AddItemToArray(a, cJSON_CreateNumber((double)v[i]));
    return a;
}
