/* Unit tests for engine/format/safetensors.c: valid files of every dtype, lookup and
 * shape checks, metadata, and a table of malformed files, each of which must be
 * refused with a message naming the file, the tensor and the problem; and the
 * stacked Linear weights engine/weights.c assembles from a file's tensors. */
#include "engine/format/safetensors.h"
#include "engine/weights.h"
#include "tests/test.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char tmp_dir[256];

/* One tensor entry of a header, e.g. T("a", "F32", "[2]", 0, 8). */
#define T(name, dtype, shape, begin, end)                                                          \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" #begin "," #end \
    "]}"

static void tmp_path(char *buf, size_t cap, const char *name) {
    snprintf(buf, cap, "%s/%s", tmp_dir, name);
}

/* "{e0,e1,...}" followed by pad, into buf. */
static const char *header_of(char *buf, size_t cap, const char *const *entries, size_t n,
                             const char *pad) {
    size_t len = (size_t)snprintf(buf, cap, "{");
    for (size_t i = 0; i < n && len < cap; i++)
        len += (size_t)snprintf(buf + len, cap - len, "%s%s", i ? "," : "", entries[i]);
    if (len < cap)
        snprintf(buf + len, cap - len, "}%s", pad);
    return buf;
}

static int write_bytes(const char *path, const void *bytes, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f)
        return -1;
    size_t w = n ? fwrite(bytes, 1, n, f) : 0;
    return fclose(f) == 0 && w == n ? 0 : -1;
}

/* Writes an 8-byte little-endian length, then header_len bytes of json, then
 * data (zeros when data is NULL). header_len may differ from strlen(json) to
 * forge a bad length; only min(header_len, strlen) bytes of json are written. */
static int write_st_raw(const char *path, uint64_t header_len, const char *json, const void *data,
                        size_t data_len) {
    size_t jn = strlen(json);
    if (header_len < jn)
        jn = (size_t)header_len;
    size_t n = 8 + jn + data_len;
    unsigned char *buf = calloc(n, 1);
    if (!buf)
        return -1;
    for (int i = 0; i < 8; i++)
        buf[i] = (unsigned char)(header_len >> (8 * i));
    memcpy(buf + 8, json, jn);
    if (data)
        memcpy(buf + 8 + jn, data, data_len);
    int rc = write_bytes(path, buf, n);
    free(buf);
    return rc;
}

static int write_st(const char *path, const char *json, const void *data, size_t data_len) {
    return write_st_raw(path, strlen(json), json, data, data_len);
}

/* Writes a file, opens it and removes it (the mapping outlives the name). */
static int open_st(safetensors_t *st, const char *name, const char *json, const void *data,
                   size_t data_len, ar_error_t *err) {
    char path[512];
    tmp_path(path, sizeof path, name);
    if (write_st(path, json, data, data_len) != 0) {
        snprintf(err->msg, sizeof err->msg, "test could not write %s", path);
        return -2;
    }
    int rc = safetensors_open(st, path, err);
    unlink(path);
    return rc;
}

static float f32_at(const st_tensor_t *t, size_t i) {
    float v;
    dtype_to_f32(&v, (const unsigned char *)t->data + i * dtype_size(t->dtype), t->dtype, 1);
    return v;
}

static void test_open_reads_every_dtype(void) {
    /* Offsets deliberately not in name order, and the header padded with spaces. */
    static const char *const entries[] = {
        T("z_f32", "F32", "[2,3]", 0, 24),  T("b_f16", "F16", "[2]", 24, 28),
        T("c_bf16", "BF16", "[2]", 28, 32), T("d_i32", "I32", "[3]", 32, 44),
        T("e_i64", "I64", "[1]", 44, 52),   T("f_u8", "U8", "[5]", 52, 57),
        T("a_scalar", "F32", "[]", 57, 61),
    };
    char json[1024];
    header_of(json, sizeof json, entries, sizeof entries / sizeof entries[0], "  ");
    unsigned char data[61];
    float f[6] = {0, 1, 2, 3, 4, 5};
    uint16_t h[2] = {0x3c00, 0xc000};  /* f16 1, -2 */
    uint16_t bf[2] = {0x3f80, 0x4040}; /* bf16 1, 3 */
    int32_t i32[3] = {-1, 7, 1 << 30};
    int64_t i64 = -((int64_t)1 << 40);
    unsigned char u8[5] = {0, 1, 2, 254, 255};
    float scalar = 42.5f;
    memcpy(data, f, 24);
    memcpy(data + 24, h, 4);
    memcpy(data + 28, bf, 4);
    memcpy(data + 32, i32, 12);
    memcpy(data + 44, &i64, 8);
    memcpy(data + 52, u8, 5);
    memcpy(data + 57, &scalar, 4);

    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "dtypes.safetensors", json, data, sizeof data, &err) == AR_OK, "%s",
              err.msg);
    CHECK(st.n_tensors == 7);
    CHECK(st.map_size == 8 + strlen(json) + sizeof data);
    CHECK_STR_CONTAINS(st.path, "dtypes.safetensors");
    for (int i = 1; i < st.n_tensors; i++)
        CHECK(strcmp(st.tensors[i - 1].name, st.tensors[i].name) < 0);

    const st_tensor_t *t = safetensors_find(&st, "z_f32");
    CHECK(t && t->dtype == DTYPE_F32 && t->ndim == 2 && t->shape[0] == 2 && t->shape[1] == 3);
    CHECK(t && t->nbytes == 24 && f32_at(t, 0) == 0 && f32_at(t, 5) == 5);
    t = safetensors_find(&st, "b_f16");
    CHECK(t && t->dtype == DTYPE_F16 && f32_at(t, 0) == 1 && f32_at(t, 1) == -2);
    t = safetensors_find(&st, "c_bf16");
    CHECK(t && t->dtype == DTYPE_BF16 && f32_at(t, 0) == 1 && f32_at(t, 1) == 3);
    t = safetensors_find(&st, "d_i32");
    int32_t gi[3] = {0};
    if (t)
        memcpy(gi, t->data, sizeof gi);
    CHECK(t && t->dtype == DTYPE_I32 && gi[0] == -1 && gi[1] == 7 && gi[2] == 1 << 30);
    t = safetensors_find(&st, "e_i64");
    int64_t g64 = 0;
    if (t)
        memcpy(&g64, t->data, 8);
    CHECK(t && t->dtype == DTYPE_I64 && g64 == i64);
    t = safetensors_find(&st, "f_u8");
    CHECK(t && t->dtype == DTYPE_U8 && t->nbytes == 5 && memcmp(t->data, u8, 5) == 0);
    t = safetensors_find(&st, "a_scalar");
    CHECK(t && t->ndim == 0 && t->nbytes == 4 && f32_at(t, 0) == 42.5f);
    safetensors_close(&st);
    CHECK(st.map == NULL && st.tensors == NULL && st.n_tensors == 0 && st.path == NULL);
}

static void test_find_among_many_tensors(void) {
    /* 200 one-byte tensors named t000..t199, written in reverse name order. */
    enum { N = 200 };
    size_t cap = N * 96 + 8;
    char *json = malloc(cap);
    unsigned char data[N];
    size_t n = 0;
    n += (size_t)snprintf(json + n, cap - n, "{");
    for (int i = 0; i < N; i++) {
        int k = N - 1 - i;
        n += (size_t)snprintf(
            json + n, cap - n,
            "%s\"t%03d\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[%d,%d]}", i ? "," : "",
            k, i, i + 1);
        data[i] = (unsigned char)k;
    }
    snprintf(json + n, cap - n, "}");
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "many.safetensors", json, data, sizeof data, &err) == AR_OK, "%s",
              err.msg);
    int all_found = 1;
    for (int k = 0; k < N; k++) {
        char name[16];
        snprintf(name, sizeof name, "t%03d", k);
        const st_tensor_t *t = safetensors_find(&st, name);
        if (!t || strcmp(t->name, name) != 0 || *(const unsigned char *)t->data != k)
            all_found = 0;
    }
    CHECK(all_found);
    CHECK(safetensors_find(&st, "t200") == NULL);
    CHECK(safetensors_find(&st, "") == NULL);
    CHECK(safetensors_find(&st, "t") == NULL);
    CHECK(safetensors_find(&st, NULL) == NULL);
    safetensors_close(&st);
    free(json);
}

static void test_get_checks_shape_and_dtype(void) {
    const char *json =
        "{" T("llm.norm.weight", "F32", "[2,3]", 0, 24) "," T("ids", "I32", "[4]", 24, 40) "}";
    unsigned char data[40] = {0};
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "model.safetensors", json, data, sizeof data, &err) == AR_OK, "%s",
              err.msg);

    const st_tensor_t *t = NULL;
    CHECK(safetensors_get(&st, "llm.norm.weight", 2, (int64_t[]){2, 3}, &t, &err) == AR_OK);
    CHECK(t && strcmp(t->name, "llm.norm.weight") == 0);
    CHECK(safetensors_get(&st, "llm.norm.weight", 2, (int64_t[]){2, 3}, NULL, &err) == AR_OK);

    CHECK(safetensors_get(&st, "llm.norm.weight", 2, (int64_t[]){3, 2}, &t, &err) == AR_ERR);
    CHECK(t == NULL);
    CHECK_STR_CONTAINS(err.msg, "model.safetensors: tensor 'llm.norm.weight': shape [2, 3] "
                                "expected [3, 2]");
    CHECK(safetensors_get(&st, "llm.norm.weight", 1, (int64_t[]){6}, &t, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "shape [2, 3] expected [6]");

    CHECK(safetensors_get(&st, "x", 1, (int64_t[]){1}, &t, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "model.safetensors: tensor 'x' not found");

    /* Integer data is refused where weights are expected, accepted by _any. */
    CHECK(safetensors_get(&st, "ids", 1, (int64_t[]){4}, &t, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "tensor 'ids': dtype I32");
    CHECK(safetensors_get_any(&st, "ids", 1, (int64_t[]){4}, &t, &err) == AR_OK);
    CHECK(t && t->dtype == DTYPE_I32);
    CHECK(safetensors_get_any(&st, "ids", 1, (int64_t[]){5}, &t, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "tensor 'ids': shape [4] expected [5]");
    CHECK(safetensors_get(&st, "ids", 1, (int64_t[]){4}, &t, NULL) == AR_ERR); /* err optional */
    safetensors_close(&st);
}

static void test_metadata(void) {
    const char *json =
        "{\"__metadata__\":{\"format\":\"pt\",\"model\":\"tiny\"}," T("w", "BF16", "[1]", 0, 2) "}";
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "meta.safetensors", json, "\0\0", 2, &err) == AR_OK, "%s", err.msg);
    CHECK(st.n_tensors == 1); /* __metadata__ is not a tensor */
    CHECK(safetensors_find(&st, "__metadata__") == NULL);
    const char *v = safetensors_metadata(&st, "model");
    CHECK(v && strcmp(v, "tiny") == 0);
    v = safetensors_metadata(&st, "format");
    CHECK(v && strcmp(v, "pt") == 0);
    CHECK(safetensors_metadata(&st, "absent") == NULL);
    safetensors_close(&st);

    CHECK_MSG(open_st(&st, "nometa.safetensors", "{" T("w", "BF16", "[1]", 0, 2) "}", "\0\0", 2,
                      &err) == AR_OK,
              "%s", err.msg);
    CHECK(safetensors_metadata(&st, "model") == NULL);
    safetensors_close(&st);
}

static void test_zero_element_tensors(void) {
    /* Empty tensors sit at the start, middle and end of the data section. */
    static const char *const entries[] = {
        T("empty0", "F32", "[0]", 0, 0),        T("a", "F32", "[1]", 0, 4),
        T("empty_mid", "F16", "[3,0,2]", 4, 4), T("b", "U8", "[2]", 4, 6),
        T("empty_end", "I64", "[0]", 6, 6),
    };
    char json[1024];
    header_of(json, sizeof json, entries, sizeof entries / sizeof entries[0], "");
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "zero.safetensors", json, "\0\0\0\0\1\2", 6, &err) == AR_OK, "%s",
              err.msg);
    const st_tensor_t *t = safetensors_find(&st, "empty_mid");
    CHECK(t && t->nbytes == 0 && t->data == NULL && t->ndim == 3 && t->shape[1] == 0);
    t = safetensors_find(&st, "empty_end");
    CHECK(t && t->nbytes == 0 && t->data == NULL);
    t = safetensors_find(&st, "b");
    CHECK(t && t->nbytes == 2 && ((const unsigned char *)t->data)[1] == 2);
    CHECK(safetensors_get(&st, "empty_mid", 3, (int64_t[]){3, 0, 2}, NULL, &err) == AR_OK);
    safetensors_close(&st);

    /* A file holding only an empty tensor has an empty data section. */
    CHECK_MSG(open_st(&st, "only_empty.safetensors", "{" T("e", "F32", "[0,4]", 0, 0) "}", NULL, 0,
                      &err) == AR_OK,
              "%s", err.msg);
    CHECK(st.n_tensors == 1);
    safetensors_close(&st);
}

static void test_empty_header_object(void) {
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "empty_set.safetensors", "{}", NULL, 0, &err) == AR_OK, "%s", err.msg);
    CHECK(st.n_tensors == 0);
    CHECK(safetensors_find(&st, "anything") == NULL);
    CHECK(safetensors_metadata(&st, "anything") == NULL);
    CHECK(safetensors_get(&st, "w", 0, NULL, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "tensor 'w' not found");
    safetensors_close(&st);

    /* Padding to a multiple of 8, as writers do, is whitespace and accepted. */
    CHECK_MSG(open_st(&st, "padded.safetensors", "{}      ", NULL, 0, &err) == AR_OK, "%s",
              err.msg);
    safetensors_close(&st);
}

/* Files whose first bytes are already wrong: too short or a bad length. */
static void test_malformed_length_prefix(void) {
    static const struct {
        const char *label;
        uint64_t header_len;
        const char *json; /* NULL: write only the first raw_len bytes of the length */
        size_t raw_len, data_len;
        const char *word;
    } cases[] = {
        {"empty.safetensors", 0, NULL, 0, 0, "empty"},
        {"truncated.safetensors", 2, NULL, 5, 0, "truncated"},
        {"len_past_end.safetensors", 100, "{}", 0, 10, "past the end of the file"},
        {"len_huge.safetensors", 200000000, "{}", 0, 0, "exceeds the 100000000 byte limit"},
        {"len_max.safetensors", UINT64_MAX, "{}", 0, 0, "exceeds"},
        {"len_zero.safetensors", 0, "", 0, 4, "does not start with '{'"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[512];
        tmp_path(path, sizeof path, cases[i].label);
        int w;
        if (cases[i].json) {
            w = write_st_raw(path, cases[i].header_len, cases[i].json, NULL, cases[i].data_len);
        } else {
            unsigned char b[8] = {(unsigned char)cases[i].header_len};
            w = write_bytes(path, b, cases[i].raw_len);
        }
        CHECK(w == 0);
        safetensors_t st;
        ar_error_t err = {{0}};
        int rc = safetensors_open(&st, path, &err);
        unlink(path);
        CHECK_MSG(rc == AR_ERR, "%s opened", cases[i].label);
        CHECK_STR_CONTAINS(err.msg, path);
        CHECK_STR_CONTAINS(err.msg, cases[i].word);
        CHECK(st.map == NULL && st.path == NULL);
        safetensors_close(&st);
    }
}

/* Headers that are JSON (or nearly) but break a rule. */
static void test_malformed_headers(void) {
    static const struct {
        const char *label;
        const char *json;
        size_t data_len;
        const char *words[3];
    } cases[] = {
        {"not_json", "{\"a\": }", 0, {"not valid JSON"}},
        {"unterminated", "{\"a\":{\"dtype\":\"F32\"", 0, {"not valid JSON"}},
        {"not_object", "[1, 2]", 0, {"does not start with '{'"}},
        {"leading_space", " {}", 0, {"does not start with '{'"}},
        {"junk_after", "{} x", 0, {"junk after the JSON object"}},
        {"entry_not_object", "{\"a\":5}", 0, {"tensor 'a'", "not an object"}},
        {"bad_dtype", "{" T("w", "F64", "[1]", 0, 8) "}", 8, {"tensor 'w'", "unknown dtype 'F64'"}},
        {"dtype_not_string",
         "{\"w\":{\"dtype\":3,\"shape\":[1],\"data_offsets\":[0,4]}}",
         4,
         {"tensor 'w'", "dtype is not a string"}},
        {"size_mismatch",
         "{" T("w", "F32", "[2,2]", 0, 12) "}",
         12,
         {"tensor 'w'", "span 12 bytes", "shape [2, 2] of F32 needs 16"}},
        {"negative_dim", "{" T("w", "F32", "[-1]", 0, 4) "}", 4, {"tensor 'w'", "negative"}},
        {"fractional_dim",
         "{" T("w", "F32", "[1.5]", 0, 4) "}",
         4,
         {"tensor 'w'", "not an integer"}},
        {"string_dim", "{" T("w", "F32", "[\"1\"]", 0, 4) "}", 4, {"tensor 'w'", "not a number"}},
        {"shape_not_array", "{" T("w", "F32", "4", 0, 4) "}", 4, {"tensor 'w'", "not an array"}},
        {"too_many_dims",
         "{" T("w", "U8", "[1,1,1,1,1,1,1,1,1]", 0, 1) "}",
         1,
         {"tensor 'w'", "9 dims", "at most 8"}},
        {"shape_overflow",
         "{" T("w", "U8", "[4294967296,4294967296,4294967296]", 0, 1) "}",
         1,
         {"tensor 'w'", "overflows"}},
        {"offset_not_exact",
         "{" T("w", "U8", "[1]", 0, 18014398509481984) "}",
         1,
         {"tensor 'w'", "too large"}},
        {"offsets_reversed", "{" T("w", "U8", "[0]", 8, 4) "}", 8, {"tensor 'w'", "reversed"}},
        {"offsets_one_number",
         "{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}",
         1,
         {"tensor 'w'", "[begin, end]"}},
        {"offset_negative", "{" T("w", "U8", "[0]", -1, -1) "}", 0, {"tensor 'w'", "negative"}},
        {"span_past_end",
         "{" T("w", "F32", "[2]", 0, 8) "}",
         4,
         {"tensor 'w'", "past the end of the data section"}},
        {"overlap",
         "{" T("a", "F32", "[2]", 0, 8) "," T("b", "F32", "[2]", 4, 12) "}",
         12,
         {"tensor 'b'", "overlap", "'a'"}},
        {"same_span",
         "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 0, 4) "}",
         4,
         {"overlap"}},
        {"hole_between",
         "{" T("a", "F32", "[1]", 0, 4) "," T("b", "F32", "[1]", 8, 12) "}",
         12,
         {"tensor 'b'", "hole of 4 bytes"}},
        {"hole_at_start", "{" T("a", "F32", "[1]", 4, 8) "}", 8, {"tensor 'a'", "hole"}},
        {"trailing_bytes", "{" T("a", "F32", "[1]", 0, 4) "}", 8, {"hole", "4 trailing bytes"}},
        {"trailing_bytes_no_tensors", "{}", 3, {"3 trailing bytes"}},
        {"duplicate_name",
         "{" T("a", "F32", "[1]", 0, 4) "," T("a", "F32", "[1]", 4, 8) "}",
         8,
         {"duplicate tensor name 'a'"}},
        {"empty_name", "{" T("", "F32", "[1]", 0, 4) "}", 4, {"empty name"}},
        {"missing_offsets",
         "{\"w\":{\"dtype\":\"F32\",\"shape\":[1]}}",
         4,
         {"tensor 'w'", "missing 'data_offsets'"}},
        {"missing_dtype",
         "{\"w\":{\"shape\":[1],\"data_offsets\":[0,4]}}",
         4,
         {"tensor 'w'", "missing 'dtype'"}},
        {"extra_key",
         "{\"w\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"extra\":1}}",
         4,
         {"tensor 'w'", "unexpected key 'extra'"}},
        {"duplicate_key",
         "{\"w\":{\"dtype\":\"F32\",\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]}}",
         4,
         {"tensor 'w'", "duplicate key 'dtype'"}},
        {"metadata_not_string",
         "{\"__metadata__\":{\"a\":\"ok\",\"n\":3}," T("w", "U8", "[1]", 0, 1) "}",
         1,
         {"__metadata__", "'n'", "not a string"}},
        {"metadata_not_object", "{\"__metadata__\":[\"a\"]}", 0, {"__metadata__", "not an object"}},
        {"metadata_duplicate_key",
         "{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}",
         0,
         {"__metadata__", "duplicate key 'k'"}},
        {"metadata_twice",
         "{\"__metadata__\":{},\"__metadata__\":{}}",
         0,
         {"duplicate __metadata__"}},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char path[512];
        tmp_path(path, sizeof path, cases[i].label);
        CHECK(write_st(path, cases[i].json, NULL, cases[i].data_len) == 0);
        safetensors_t st;
        ar_error_t err = {{0}};
        int rc = safetensors_open(&st, path, &err);
        unlink(path);
        CHECK_MSG(rc == AR_ERR, "%s opened", cases[i].label);
        CHECK_STR_CONTAINS(err.msg, path);
        for (int w = 0; w < 3 && cases[i].words[w]; w++)
            CHECK_STR_CONTAINS(err.msg, cases[i].words[w]);
        CHECK(st.map == NULL && st.tensors == NULL && st.json == NULL && st.n_tensors == 0);
        safetensors_close(&st);
    }
}

static void test_unopenable_paths(void) {
    safetensors_t st;
    ar_error_t err = {{0}};
    char path[512];
    tmp_path(path, sizeof path, "does_not_exist.safetensors");
    CHECK(safetensors_open(&st, path, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, path);
    CHECK_STR_CONTAINS(err.msg, "No such file");
    safetensors_close(&st);

    CHECK(safetensors_open(&st, tmp_dir, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not a regular file");
    safetensors_close(&st);
    CHECK(safetensors_open(&st, tmp_dir, NULL) == AR_ERR); /* err optional */
}

static void test_close_is_safe_when_nothing_is_open(void) {
    safetensors_t st;
    memset(&st, 0, sizeof st);
    safetensors_close(&st);
    safetensors_close(&st);
    safetensors_close(NULL);
    CHECK(safetensors_find(&st, "x") == NULL);
    CHECK(safetensors_metadata(&st, "x") == NULL);
    ar_error_t err = {{0}};
    CHECK(safetensors_get(&st, "x", 0, NULL, NULL, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not found");
}

/* A stack from separate tensors and from row blocks of one fused tensor
 * holds each part's rows in order (read back through matmul with x =
 * [1, 0, 0], which picks column 0 of every row); parts of two types and a
 * missing part are refused, naming the file and the tensor. */
static void test_stacked_linear_from_parts(void) {
    const char *json = "{" T("a", "F32", "[2,3]", 0, 24) "," T("b", "F32", "[2,3]", 24, 48) "," T(
        "f", "F32", "[6,3]", 48, 120) "," T("c", "BF16", "[2,3]", 120, 132) "}";
    float data[33] = {0};
    for (int i = 0; i < 30; i++)
        data[i] = (float)(i + 1);
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "stack.safetensors", json, data, 132, &err) == AR_OK, "%s", err.msg);
    backend_t *be = backend_cpu_create(1, &err);
    weight_set_t ws = {.n_files = 1, .be = be, .check_finite = 1};
    ws.files[0] = st;
    tensor_t w;
    weight_part_t two[2] = {{"b", 0, 2}, {"a", 0, 2}};
    CHECK_MSG(weight_load_linear_stack(&ws, &w, 2, two, 2, 3, &err) == AR_OK, "%s", err.msg);
    CHECK(w.ndim == 3 && w.shape[0] == 2 && w.shape[1] == 2 && w.shape[2] == 3);
    CHECK(ws.bytes_loaded == 48);
    float x[3] = {1, 0, 0}, y[6];
    be->matmul(be, y, x, &w, NULL, 1);
    CHECK(y[0] == 7 && y[1] == 10 && y[2] == 1 && y[3] == 4); /* b's rows, then a's */
    be->weight_free(be, &w);
    weight_part_t fused[3] = {{"f", 0, 6}, {"f", 2, 6}, {"f", 4, 6}};
    CHECK_MSG(weight_load_linear_stack(&ws, &w, 3, fused, 2, 3, &err) == AR_OK, "%s", err.msg);
    be->matmul(be, y, x, &w, NULL, 1);
    for (int i = 0; i < 6; i++)
        CHECK_MSG(y[i] == (float)(13 + 3 * i), "row %d: %g", i, y[i]);
    be->weight_free(be, &w);
    /* consecutive blocks from row 2 (loaded as stored, not copied), and
     * blocks out of order (copied) */
    weight_part_t later[2] = {{"f", 2, 6}, {"f", 4, 6}}, swapped[2] = {{"f", 4, 6}, {"f", 2, 6}};
    const weight_part_t *cases[2] = {later, swapped};
    for (int c = 0; c < 2; c++) {
        CHECK_MSG(weight_load_linear_stack(&ws, &w, 2, cases[c], 2, 3, &err) == AR_OK, "%s",
                  err.msg);
        be->matmul(be, y, x, &w, NULL, 1);
        for (int i = 0; i < 4; i++) {
            const int row = c ? (i < 2 ? 4 + i : i) : 2 + i;
            CHECK_MSG(y[i] == (float)(13 + 3 * row), "case %d, row %d: %g", c, i, y[i]);
        }
        be->weight_free(be, &w);
    }
    weight_part_t mixed[2] = {{"a", 0, 2}, {"c", 0, 2}};
    CHECK(weight_load_linear_stack(&ws, &w, 2, mixed, 2, 3, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "stack.safetensors: tensor 'c' is BF16 where 'a' is F32");
    weight_part_t missing[2] = {{"a", 0, 2}, {"zz", 0, 2}};
    CHECK(weight_load_linear_stack(&ws, &w, 2, missing, 2, 3, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "tensor 'zz' not found");
    be->destroy(be);
    safetensors_close(&st);
}

/* Resident pages of this process (/proc/self/statm's second field). */
static long resident_pages(void) {
    long size = 0, resident = -1;
    FILE *f = fopen("/proc/self/statm", "r");
    if (f) {
        if (fscanf(f, "%ld %ld", &size, &resident) != 2)
            resident = -1;
        fclose(f);
    }
    return resident;
}

/* Loading a weight gives back the file's pages it was copied from: a model's
 * load holds its copy, not the file's pages as well. */
static void test_loading_gives_back_the_files_pages(void) {
    enum { N = 4 << 20 }; /* 16 MiB of floats, 4096 pages */
    const long page = sysconf(_SC_PAGESIZE), pages = (long)N * 4 / page;
    float *data = malloc((size_t)N * 4);
    CHECK(data != NULL);
    if (!data)
        return;
    for (int i = 0; i < N; i++)
        data[i] = (float)(i % 1000);
    char json[128];
    snprintf(json, sizeof json, "{" T("w", "F32", "[1024,4096]", 0, % d) "}", N * 4);
    safetensors_t st;
    ar_error_t err = {{0}};
    CHECK_MSG(open_st(&st, "release.safetensors", json, data, (size_t)N * 4, &err) == AR_OK, "%s",
              err.msg);
    free(data);
    const st_tensor_t *t = safetensors_find(&st, "w");
    CHECK(t != NULL);
    if (!t)
        return;
    const long before = resident_pages();
    volatile unsigned sum = 0; /* a byte a page: the data need not be aligned for float */
    for (size_t i = 0; i < (size_t)N * 4; i += (size_t)page)
        sum += ((const unsigned char *)t->data)[i];
    const long touched = resident_pages();
    CHECK_MSG(touched - before > pages * 3 / 4, "reading the tensor mapped %ld of %ld pages",
              touched - before, pages);
    safetensors_release(&st, t->data, t->nbytes);
    const long released = resident_pages();
    CHECK_MSG(touched - released > pages * 3 / 4, "release gave back %ld of %ld pages",
              touched - released, pages);
    /* through the loader: the backend's copy stays, the file's pages go */
    backend_t *be = backend_cpu_create(1, &err);
    weight_set_t ws = {.n_files = 1, .be = be, .check_finite = 1};
    ws.files[0] = st;
    tensor_t w;
    CHECK_MSG(weight_load(&ws, &w, 2, (int64_t[]){1024, 4096}, &err, "w") == AR_OK, "%s", err.msg);
    const long loaded = resident_pages();
    CHECK_MSG(loaded - released < pages * 3 / 2,
              "loading 16 MiB left %ld pages resident (%ld a "
              "copy)",
              loaded - released, pages);
    CHECK(f32_at(t, 1001) == 1.0f); /* a released page reads back from the file */
    be->weight_free(be, &w);
    be->destroy(be);
    safetensors_close(&st);
}

int main(void) {
    const char *base = getenv("TMPDIR");
    snprintf(tmp_dir, sizeof tmp_dir, "%s/test_safetensors.XXXXXX", base && *base ? base : "/tmp");
    if (!mkdtemp(tmp_dir)) {
        perror("mkdtemp");
        printf("0 passed, 1 failed\n");
        return 1;
    }
    TEST_RUN(test_open_reads_every_dtype);
    TEST_RUN(test_find_among_many_tensors);
    TEST_RUN(test_get_checks_shape_and_dtype);
    TEST_RUN(test_metadata);
    TEST_RUN(test_zero_element_tensors);
    TEST_RUN(test_empty_header_object);
    TEST_RUN(test_malformed_length_prefix);
    TEST_RUN(test_malformed_headers);
    TEST_RUN(test_unopenable_paths);
    TEST_RUN(test_close_is_safe_when_nothing_is_open);
    TEST_RUN(test_stacked_linear_from_parts);
    TEST_RUN(test_loading_gives_back_the_files_pages);
    rmdir(tmp_dir);
    return TEST_SUMMARY();
}
