/* safetensors reader: mmap the file, check every header rule the reference
 * implementation enforces (size caps, dtypes, shapes, contiguous non-overlapping
 * spans, unique names), and only then form pointers into the mapping. */
#include "engine/format/safetensors.h"

#include "base/file.h"
#include "engine/format/json_strict.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* The reference implementation's cap on the JSON header. */
#define ST_MAX_HEADER 100000000ull
/* cJSON keeps numbers as doubles: integers above 2^53 are not exact. */
#define ST_MAX_INT 9007199254740992.0
/* Names are untrusted and may be huge: messages quote at most this much. */
#define NAME_FMT "'%.200s'"

/* One entry while validating, before any pointer is formed. */
typedef struct st_entry {
    const char *name;
    dtype_t dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;
} st_entry_t;

static int parse_dtype(const char *s, dtype_t *out) {
    static const struct {
        const char *name;
        dtype_t t;
    } known[] = {{"F32", DTYPE_F32}, {"F16", DTYPE_F16},        {"BF16", DTYPE_BF16},
                 {"I32", DTYPE_I32}, {"I64", DTYPE_I64},        {"U8", DTYPE_U8},
                 {"I8", DTYPE_I8},   {"F8_E4M3", DTYPE_F8_E4M3}};
    for (size_t i = 0; i < sizeof known / sizeof known[0]; i++) {
        if (strcmp(s, known[i].name) == 0) {
            *out = known[i].t;
            return 1;
        }
    }
    return 0;
}

/* A JSON number that is a non-negative integer representable exactly.
 * Returns NULL on success or a phrase describing what is wrong. */
static const char *json_uint(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item))
        return "is not a number";
    double v = item->valuedouble;
    if (!isfinite(v))
        return "is not finite";
    if (v < 0)
        return "is negative";
    if (v > ST_MAX_INT)
        return "is too large (above 2^53)";
    if (v != (double)(uint64_t)v)
        return "is not an integer";
    *out = (uint64_t)v;
    return NULL;
}

/* Writes "[a, b, c]" into buf. */
static const char *format_shape(char *buf, size_t cap, int ndim, const int64_t *shape) {
    size_t n = 0;
    n += (size_t)snprintf(buf + n, cap - n, "[");
    for (int i = 0; i < ndim && n < cap; i++)
        n += (size_t)snprintf(buf + n, cap - n, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (n < cap)
        snprintf(buf + n, cap - n, "]");
    return buf;
}

/* Checks one tensor entry and fills e. */
static int parse_entry(const char *path, const cJSON *item, st_entry_t *e, ar_error_t *err) {
    const char *name = item->string;
    if (!cJSON_IsObject(item))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": entry is not an object", path, name);
    const cJSON *dtype = NULL, *shape = NULL, *offsets = NULL;
    for (const cJSON *k = item->child; k; k = k->next) {
        const cJSON **slot = NULL;
        if (strcmp(k->string, "dtype") == 0)
            slot = &dtype;
        else if (strcmp(k->string, "shape") == 0)
            slot = &shape;
        else if (strcmp(k->string, "data_offsets") == 0)
            slot = &offsets;
        else
            return ar_errorf(err, "%s: tensor " NAME_FMT ": unexpected key '%.100s'", path, name,
                             k->string);
        if (*slot)
            return ar_errorf(err, "%s: tensor " NAME_FMT ": duplicate key '%s'", path, name,
                             k->string);
        *slot = k;
    }
    if (!dtype || !shape || !offsets)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": missing '%s'", path, name,
                         !dtype   ? "dtype"
                         : !shape ? "shape"
                                  : "data_offsets");

    e->name = name;
    if (!cJSON_IsString(dtype))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": dtype is not a string", path, name);
    if (!parse_dtype(dtype->valuestring, &e->dtype))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": unknown dtype '%.32s'", path, name,
                         dtype->valuestring);

    if (!cJSON_IsArray(shape))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": shape is not an array", path, name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > ST_MAX_DIMS)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": shape has %d dims, at most %d supported",
                         path, name, ndim, ST_MAX_DIMS);
    e->ndim = ndim;
    uint64_t numel = 1;
    int overflow = 0, d = 0;
    for (const cJSON *dim = shape->child; dim; dim = dim->next, d++) {
        uint64_t v;
        const char *why = json_uint(dim, &v);
        if (why)
            return ar_errorf(err, "%s: tensor " NAME_FMT ": shape dim %d %s", path, name, d, why);
        e->shape[d] = (int64_t)v;
        if (v && numel > UINT64_MAX / v)
            overflow = 1;
        numel *= v;
    }
    uint64_t size = dtype_size(e->dtype);
    if (overflow || (numel && numel > UINT64_MAX / size))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": shape size overflows 64 bits", path, name);
    uint64_t nbytes = numel * size;

    if (!cJSON_IsArray(offsets) || cJSON_GetArraySize(offsets) != 2)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": data_offsets is not a [begin, end] array",
                         path, name);
    const char *why = json_uint(offsets->child, &e->begin);
    if (why)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": data_offsets begin %s", path, name, why);
    why = json_uint(offsets->child->next, &e->end);
    if (why)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": data_offsets end %s", path, name, why);
    if (e->begin > e->end)
        return ar_errorf(err, "%s: tensor " NAME_FMT ": data_offsets [%llu, %llu] reversed", path,
                         name, (unsigned long long)e->begin, (unsigned long long)e->end);
    if (e->end - e->begin != nbytes) {
        char buf[256];
        return ar_errorf(err,
                         "%s: tensor " NAME_FMT ": data_offsets span %llu bytes but shape %s of "
                         "%s needs %llu",
                         path, name, (unsigned long long)(e->end - e->begin),
                         format_shape(buf, sizeof buf, e->ndim, e->shape), dtype_name(e->dtype),
                         (unsigned long long)nbytes);
    }
    return AR_OK;
}

static int cmp_str_ptr(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

static int check_metadata(const char *path, const cJSON *meta, ar_error_t *err) {
    if (!cJSON_IsObject(meta))
        return ar_errorf(err, "%s: __metadata__ is not an object", path);
    size_t n = 0;
    for (const cJSON *k = meta->child; k; k = k->next, n++)
        if (!cJSON_IsString(k))
            return ar_errorf(err, "%s: __metadata__ value of '%.100s' is not a string", path,
                             k->string);
    /* Sorted, so a header with many keys cannot make this quadratic. */
    const char **keys = malloc((n ? n : 1) * sizeof *keys);
    if (!keys)
        return ar_errorf(err, "%s: out of memory", path);
    n = 0;
    for (const cJSON *k = meta->child; k; k = k->next)
        keys[n++] = k->string;
    qsort(keys, n, sizeof *keys, cmp_str_ptr);
    int rc = AR_OK;
    for (size_t i = 1; i < n && rc == AR_OK; i++)
        if (strcmp(keys[i - 1], keys[i]) == 0)
            rc = ar_errorf(err, "%s: __metadata__ has duplicate key '%.100s'", path, keys[i]);
    free(keys);
    return rc;
}

static int cmp_entry_name(const void *a, const void *b) {
    return strcmp(((const st_entry_t *)a)->name, ((const st_entry_t *)b)->name);
}

static int cmp_entry_ptr_span(const void *a, const void *b) {
    const st_entry_t *x = *(const st_entry_t *const *)a, *y = *(const st_entry_t *const *)b;
    if (x->begin != y->begin)
        return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end)
        return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

/* Spans must tile [0, data_size) exactly: sorted by begin, each starts where
 * the previous ended. */
static int check_spans(const char *path, st_entry_t *e, int n, uint64_t data_size,
                       ar_error_t *err) {
    for (int i = 0; i < n; i++)
        if (e[i].end > data_size)
            return ar_errorf(err,
                             "%s: tensor " NAME_FMT ": data_offsets [%llu, %llu] past the end "
                             "of the data section (%llu bytes)",
                             path, e[i].name, (unsigned long long)e[i].begin,
                             (unsigned long long)e[i].end, (unsigned long long)data_size);
    const st_entry_t **by_span = malloc((n > 0 ? (size_t)n : 1) * sizeof *by_span);
    if (!by_span)
        return ar_errorf(err, "%s: out of memory", path);
    for (int i = 0; i < n; i++)
        by_span[i] = &e[i];
    qsort(by_span, (size_t)n, sizeof *by_span, cmp_entry_ptr_span);
    uint64_t pos = 0;
    const char *prev = NULL;
    int rc = AR_OK;
    for (int i = 0; i < n && rc == AR_OK; i++) {
        const st_entry_t *t = by_span[i];
        if (t->begin < pos)
            rc = ar_errorf(
                err, "%s: tensor " NAME_FMT ": data_offsets [%llu, %llu] overlap tensor " NAME_FMT,
                path, t->name, (unsigned long long)t->begin, (unsigned long long)t->end, prev);
        else if (t->begin > pos)
            rc = ar_errorf(err,
                           "%s: tensor " NAME_FMT ": hole of %llu bytes before data_offsets "
                           "[%llu, %llu]",
                           path, t->name, (unsigned long long)(t->begin - pos),
                           (unsigned long long)t->begin, (unsigned long long)t->end);
        pos = t->end;
        prev = t->name;
    }
    free(by_span);
    if (rc == AR_OK && pos != data_size)
        rc = ar_errorf(err,
                       "%s: hole at the end of the data section: %llu trailing bytes after the "
                       "last tensor",
                       path, (unsigned long long)(data_size - pos));
    return rc;
}

/* Validates the header JSON (already checked to lie within the file) and, on
 * success, fills st->tensors with offsets still relative to the data section. */
static int parse_header(safetensors_t *st, const char *hdr, size_t hdr_len, uint64_t data_size,
                        ar_error_t *err) {
    const char *path = st->path;
    if (hdr_len == 0 || hdr[0] != '{')
        return ar_errorf(err, "%s: header does not start with '{' (not a safetensors file?)", path);
    /* Writers pad the header with spaces, which the strict check allows
     * after the object; anything else there is junk. */
    json_strict_fault_t fault;
    cJSON *root = json_parse_strict(hdr, hdr_len, JSON_STRICT_DEFAULT_DEPTH, &fault, NULL);
    if (!root && fault.trailing)
        return ar_errorf(err, "%s: header has junk after the JSON object at byte %zu", path,
                         fault.offset);
    if (!root)
        return ar_errorf(err, "%s: header is not valid JSON: byte %zu of %zu: %s", path,
                         fault.offset, hdr_len, fault.why);
    st->json = root;
    if (!cJSON_IsObject(root))
        return ar_errorf(err, "%s: header is not a JSON object", path);

    int n = 0, n_meta = 0;
    for (const cJSON *k = root->child; k; k = k->next) {
        if (strcmp(k->string, "__metadata__") == 0)
            n_meta++;
        else
            n++;
    }
    if (n_meta > 1)
        return ar_errorf(err, "%s: duplicate __metadata__", path);

    st_entry_t *e = calloc((n > 0 ? (size_t)n : 1), sizeof *e);
    if (!e)
        return ar_errorf(err, "%s: out of memory for %d tensors", path, n);
    int i = 0, rc = AR_OK;
    for (const cJSON *k = root->child; k && rc == AR_OK; k = k->next) {
        if (strcmp(k->string, "__metadata__") == 0) {
            rc = check_metadata(path, k, err);
            st->metadata = k;
        } else if (k->string[0] == '\0') {
            rc = ar_errorf(err, "%s: tensor with an empty name", path);
        } else {
            rc = parse_entry(path, k, &e[i++], err);
        }
    }
    if (rc == AR_OK) {
        qsort(e, (size_t)n, sizeof *e, cmp_entry_name);
        for (i = 1; i < n && rc == AR_OK; i++)
            if (strcmp(e[i - 1].name, e[i].name) == 0)
                rc = ar_errorf(err, "%s: duplicate tensor name " NAME_FMT, path, e[i].name);
    }
    if (rc == AR_OK)
        rc = check_spans(path, e, n, data_size, err);
    if (rc == AR_OK) {
        st->tensors = calloc((n > 0 ? (size_t)n : 1), sizeof *st->tensors);
        if (!st->tensors)
            rc = ar_errorf(err, "%s: out of memory for %d tensors", path, n);
    }
    if (rc == AR_OK) {
        /* Only now, with every span known to lie inside the data section, form pointers. */
        const unsigned char *data = (const unsigned char *)hdr + hdr_len;
        for (i = 0; i < n; i++) {
            st_tensor_t *t = &st->tensors[i];
            t->name = e[i].name;
            t->dtype = e[i].dtype;
            t->ndim = e[i].ndim;
            memcpy(t->shape, e[i].shape, sizeof t->shape);
            t->nbytes = (size_t)(e[i].end - e[i].begin);
            t->data = t->nbytes ? data + e[i].begin : NULL;
        }
        st->n_tensors = n;
    }
    free(e);
    return rc;
}

void safetensors_close(safetensors_t *st) {
    if (!st)
        return;
    if (st->map)
        munmap(st->map, st->map_size);
    cJSON_Delete(st->json);
    free(st->tensors);
    free(st->path);
    memset(st, 0, sizeof *st);
}

void safetensors_release(const safetensors_t *st, const void *data, size_t n) {
    const uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE), map = (uintptr_t)st->map;
    uintptr_t begin = (uintptr_t)data, end = begin + n;
    if (!data || begin < map || end > map + st->map_size)
        return;
    begin = (begin + page - 1) / page * page;
    end = end / page * page;
    if (end > begin)
        madvise((void *)begin, end - begin, MADV_DONTNEED); /* advice: its failure costs RSS only */
}

int safetensors_open(safetensors_t *st, const char *path, ar_error_t *err) {
    memset(st, 0, sizeof *st);
    uint64_t file_size;
    int fd = file_open_regular(path, NULL, &file_size, err);
    if (fd < 0)
        return AR_ERR;
    if (file_size < 8) {
        close(fd);
        return ar_errorf(err, "%s: file is %s (%llu bytes; a safetensors file has at least 8)",
                         path, file_size ? "truncated" : "empty", (unsigned long long)file_size);
    }
    if (file_size > SIZE_MAX) {
        close(fd);
        return ar_errorf(err, "%s: file too large to map", path);
    }
    void *map = mmap(NULL, (size_t)file_size, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED)
        return ar_errorf(err, "%s: cannot mmap: %s", path, strerror(map_errno));
    st->map = map;
    st->map_size = (size_t)file_size;
    st->path = strdup(path);
    if (!st->path) {
        ar_errorf(err, "%s: out of memory", path);
        safetensors_close(st);
        return AR_ERR;
    }

    const unsigned char *b = map;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--)
        n = n << 8 | b[i];
    int rc;
    if (n > ST_MAX_HEADER)
        rc = ar_errorf(err, "%s: header length %llu exceeds the %llu byte limit", path,
                       (unsigned long long)n, ST_MAX_HEADER);
    else if (n > file_size - 8)
        rc = ar_errorf(err, "%s: header length %llu runs past the end of the file (%llu bytes)",
                       path, (unsigned long long)n, (unsigned long long)file_size);
    else
        rc = parse_header(st, (const char *)b + 8, (size_t)n, file_size - 8 - n, err);
    if (rc != AR_OK)
        safetensors_close(st);
    return rc;
}

const st_tensor_t *safetensors_find(const safetensors_t *st, const char *name) {
    if (!st || !name)
        return NULL;
    int lo = 0, hi = st->n_tensors;
    while (lo < hi) {
        int mid = lo + (hi - lo) / 2;
        int c = strcmp(st->tensors[mid].name, name);
        if (c == 0)
            return &st->tensors[mid];
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

static int get_checked(const safetensors_t *st, const char *name, int ndim, const int64_t *shape,
                       int any_dtype, const st_tensor_t **out, ar_error_t *err) {
    const char *path = st && st->path ? st->path : "(no file)";
    if (out)
        *out = NULL;
    const st_tensor_t *t = safetensors_find(st, name);
    if (!t)
        return ar_errorf(err, "%s: tensor " NAME_FMT " not found", path, name);
    if (!any_dtype && !dtype_is_float(t->dtype))
        return ar_errorf(err, "%s: tensor " NAME_FMT ": dtype %s, expected F32, F16 or BF16", path,
                         name, dtype_name(t->dtype));
    int same = ndim == t->ndim;
    for (int i = 0; same && i < ndim; i++)
        same = shape[i] == t->shape[i];
    if (!same) {
        char got[256], want[256];
        int wn = ndim < 0 ? 0 : ndim > ST_MAX_DIMS ? ST_MAX_DIMS : ndim;
        return ar_errorf(err, "%s: tensor " NAME_FMT ": shape %s expected %s%s", path, name,
                         format_shape(got, sizeof got, t->ndim, t->shape),
                         format_shape(want, sizeof want, wn, shape), wn != ndim ? " (...)" : "");
    }
    if (out)
        *out = t;
    return AR_OK;
}

int safetensors_get(const safetensors_t *st, const char *name, int ndim, const int64_t *shape,
                    const st_tensor_t **out, ar_error_t *err) {
    return get_checked(st, name, ndim, shape, 0, out, err);
}

int safetensors_get_any(const safetensors_t *st, const char *name, int ndim, const int64_t *shape,
                        const st_tensor_t **out, ar_error_t *err) {
    return get_checked(st, name, ndim, shape, 1, out, err);
}

const char *safetensors_metadata(const safetensors_t *st, const char *key) {
    if (!st || !st->metadata || !key)
        return NULL;
    const cJSON *v = cJSON_GetObjectItemCaseSensitive((const cJSON *)st->metadata, key);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}
