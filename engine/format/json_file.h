/* JSON files arserve writes and reads back (the KV calibration, the fp8 KV
 * scales): the whole file parsed strictly (json_strict.h), members checked
 * one by one, every error naming the file and the member. */
#ifndef ARSERVE_JSON_FILE_H
#define ARSERVE_JSON_FILE_H

#include <stddef.h>

#include "base/status.h"

struct cJSON;

/* The file at path, parsed; NULL with err naming the file and the fault.
 * The caller cJSON_Deletes it. */
struct cJSON *json_file_read(const char *path, ar_error_t *err);

/* Writes root to path, one line. */
int json_file_write(const struct cJSON *root, const char *path, ar_error_t *err);

/* Member key of o as an integer in [lo, hi]. */
int json_get_int(const struct cJSON *o, const char *key, int lo, int hi, int *out, const char *path,
                 ar_error_t *err);

/* An optional member of n numbers into a new array *out (left NULL when the
 * member is absent; the caller frees it, also on error). */
int json_get_floats(const struct cJSON *o, const char *key, size_t n, float **out, const char *path,
                    ar_error_t *err);

/* A new array of v's n numbers (NULL when out of memory). */
struct cJSON *json_float_array(const float *v, size_t n);

#endif
