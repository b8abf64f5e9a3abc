/* Unit tests for engine/format/json_strict.c: RFC 8259 texts it must accept, a table
 * of texts cJSON alone would take (or over-read) that it must refuse with the
 * byte and the reason, the nesting limit, and a property check: every text the
 * check accepts, cJSON parses to its end. Each text is copied into a buffer of
 * exactly its length, so under ASan a read past the end is a failure. */
#include "engine/format/json_strict.h"
#include "engine/format/safetensors.h"
#include "engine/format/tokenizer.h"
#include "engine/model_config.h"
#include "engine/policy/kv_calibration.h"
#include "server/api.h"
#include "tests/test.h"

#include <cjson/cJSON.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

/* json_strict_check on a heap copy of exactly len bytes. */
static int check_exact(const char *text, size_t len, int max_depth, json_strict_fault_t *f) {
    char *copy = malloc(len ? len : 1);
    if (!copy)
        return AR_ERR;
    memcpy(copy, text, len);
    int rc = json_strict_check(copy, len, max_depth, f);
    free(copy);
    return rc;
}

static void test_valid_texts_accepted(void) {
    static const char *const texts[] = {
        "0",
        "-0",
        "12",
        "-1.5e-3",
        "1E+2",
        "0.0e0",
        "1e400", /* grammatical; out of a double's range is the caller's check */
        "true",
        "false",
        "null",
        "\"\"",
        "[]",
        "{}",
        " \t\r\n[ 1 , 2 ] \r\n",
        "{\"a\":[1,2,{\"b\":null}],\"c\":{\"d\":\"e\"}}",
        "{\"a\":1,\"a\":2}", /* duplicate names: RFC 8259 says SHOULD be unique */
        "\"\\\" \\\\ \\/ \\b \\f \\n \\r \\t \\u00e9 \\u00E9 \\ud83d\\ude00 \\uffff\"",
        "\"\xc3\xa9 \xe2\x82\xac \xef\xbf\xbf \xf0\x9f\x98\x80 \xf4\x8f\xbf\xbf\"",
        "\"[[[[{{{{\"",   /* brackets inside a string are text */
        "\xef\xbb\xbf{}", /* one byte order mark, which RFC 8259 8.1 lets a parser skip */
        "123456789012345678901234567890123456789012345678901234567890123", /* 63 chars */
    };
    for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
        json_strict_fault_t f;
        int rc = check_exact(texts[i], strlen(texts[i]), JSON_STRICT_DEFAULT_DEPTH, &f);
        CHECK_MSG(rc == AR_OK, "%s: byte %zu: %s", texts[i], f.offset, f.why);
    }
}

typedef struct bad_text {
    const char *text;
    size_t len; /* 0: strlen(text) */
    size_t offset;
    int trailing;
    const char *why_has;
} bad_text_t;

#define NUL_LEN(s) (sizeof(s) - 1)

static const bad_text_t bad_texts[] = {
    /* numbers */
    {"01", 0, 0, 0, "leading zero"},
    {"[-012]", 0, 1, 0, "leading zero"},
    {"1.", 0, 1, 0, "'.' in a number must be followed by a digit"},
    {"1.e5", 0, 1, 0, "'.' in a number must be followed by a digit"},
    {"-", 0, 0, 0, "'-' must be followed by a digit"},
    {"-a", 0, 0, 0, "'-' must be followed by a digit"},
    {"1e", 0, 1, 0, "exponent must have a digit"},
    {"1e+", 0, 1, 0, "exponent must have a digit"},
    {".5", 0, 0, 0, "digit before its '.'"},
    {"+1", 0, 0, 0, "may not start with '+'"},
    {"0x10", 0, 1, 1, "after the JSON value: 'x'"},
    {"1234567890123456789012345678901234567890123456789012345678901234", 0, 0, 0,
     "64 characters; at most 63"},
    /* commas: CVE-2023-53154 is cJSON reading past the end after the last comma */
    {"{\"1\":1,", 0, 7, 0, "ends inside an object"},
    {"[1e400,", 0, 7, 0, "ends where a value is expected"},
    {"{\"a\":1e400,}", 0, 10, 0, "trailing comma before '}'"},
    {"[1,]", 0, 2, 0, "trailing comma before ']'"},
    {"[1 , \n]", 0, 3, 0, "trailing comma before ']'"},
    {"[,1]", 0, 1, 0, "expected a value, found ','"},
    {"[1 2]", 0, 3, 0, "expected ',' or ']' after an element, found '2'"},
    {"{\"a\":1 \"b\":2}", 0, 7, 0, "expected ',' or '}' after a member"},
    /* objects */
    {"{a:1}", 0, 1, 0, "expected a quoted member name or '}'"},
    {"{\"a\" 1}", 0, 5, 0, "expected ':'"},
    {"{\"a\":1,\"b\" 2}", 0, 11, 0, "expected ':'"},
    {"{\"a\":1,2:3}", 0, 7, 0, "expected a quoted member name"},
    {"{\"a\":}", 0, 5, 0, "expected a value, found '}'"},
    {"{", 0, 1, 0, "ends inside an object"},
    {"[", 0, 1, 0, "ends where a value is expected"},
    {"[1", 0, 2, 0, "ends inside an array"},
    {"]", 0, 0, 0, "expected a value, found ']'"},
    /* literals */
    {"tru", 0, 0, 0, "only literals are true, false and null"},
    {"True", 0, 0, 0, "only literals"},
    {"NaN", 0, 0, 0, "only literals"},
    {"[Infinity]", 0, 1, 0, "only literals"},
    {"nulll", 0, 4, 1, "after the JSON value: 'l'"},
    {"'a'", 0, 0, 0, "quoted with '\"'"},
    /* the text as a whole */
    {"", 0, 0, 0, "empty or only whitespace"},
    {" \r\n\t", 0, 4, 0, "empty or only whitespace"},
    {"1 2", 0, 2, 1, "unexpected data after the JSON value: '2'"},
    {"{}{}", 0, 2, 1, "after the JSON value: '{'"},
    {"\x0c"
     "1",
     0, 0, 0, "found byte 0x0c"}, /* form feed is not JSON whitespace */
    {"\xef\xbb\xbf\xef\xbb\xbf{}", 0, 3, 0, "found byte 0xef"},
    {"{}\0", NUL_LEN("{}\0"), 2, 1, "after the JSON value: a NUL byte"},
    {"\0{}", NUL_LEN("\0{}"), 0, 0, "found a NUL byte"},
    {"[1,\0]", NUL_LEN("[1,\0]"), 3, 0, "found a NUL byte"},
    /* strings */
    {"\"a\0b\"", NUL_LEN("\"a\0b\""), 2, 0, "a NUL byte inside a string"},
    {"\"a\x01\"", 0, 2, 0, "byte 0x01 inside a string"},
    {"\"a\tb\"", 0, 2, 0, "inside a string (control characters must be escaped)"},
    {"\"abc", 0, 0, 0, "unterminated string"},
    {"\"abc\\", 0, 4, 0, "ends in a backslash"},
    {"\"\\x\"", 0, 1, 0, "invalid escape: a backslash followed by 'x'"},
    {"\"\\u12G4\"", 0, 1, 0, "four hex digits"},
    {"\"\\u12\"", 0, 1, 0, "four hex digits"},
    {"\"a\\u0000b\"", 0, 2, 0, "\\u0000 is refused"},
    {"\"\\ud800\"", 0, 1, 0, "high surrogate escape \\uD800 must be followed by a low one"},
    {"\"\\ud800\\u0041\"", 0, 1, 0, "must be followed by a low one"},
    {"\"\\udbff\\udbff\"", 0, 1, 0, "must be followed by a low one"},
    {"\"\\udc00x\"", 0, 1, 0, "low surrogate escape \\uDC00 without a high one"},
    /* UTF-8 (Unicode table 3-7) */
    {"\"\xc0\xaf\"", 0, 1, 0, "overlong encoding (lead byte 0xc0)"},
    {"\"\xc1\xbf\"", 0, 1, 0, "overlong"},
    {"\"\xe0\x80\xaf\"", 0, 1, 0, "overlong encoding"},
    {"\"\xf0\x80\x80\xaf\"", 0, 1, 0, "overlong encoding"},
    {"\"\xed\xa0\x80\"", 0, 1, 0, "surrogate (U+D800-U+DFFF) encoded as UTF-8"},
    {"\"\xed\xbf\xbf\"", 0, 1, 0, "surrogate"},
    {"\"\xf4\x90\x80\x80\"", 0, 1, 0, "above U+10FFFF"},
    {"\"\xf5\x80\x80\x80\"", 0, 1, 0, "byte 0xf5 never appears in UTF-8"},
    {"\"\xff\"", 0, 1, 0, "never appears"},
    {"\"\x80\"", 0, 1, 0, "continuation byte 0x80 without a lead byte"},
    {"\"\xe2\x82\"", 0, 1, 0, "truncated sequence"},
    {"\"\xe2\x82", 0, 1, 0, "truncated sequence"},
    {"\"\xf0\x9f\x98\"", 0, 1, 0, "truncated sequence"},
    {"\"\xc3\"", 0, 1, 0, "truncated sequence"},
    {"\"\xe2\x82\xc0\"", 0, 1, 0, "truncated sequence"}, /* a third byte that continues nothing */
    {"\"\xf0\x9f\x98\xff\"", 0, 1, 0, "truncated sequence"},
    {"\xc3\xa9", 0, 0, 0, "found byte 0xc3"}, /* UTF-8 outside a string */
};

static void test_invalid_texts_refused_with_byte_and_reason(void) {
    for (size_t i = 0; i < sizeof bad_texts / sizeof bad_texts[0]; i++) {
        const bad_text_t *b = &bad_texts[i];
        size_t len = b->len ? b->len : strlen(b->text);
        json_strict_fault_t f;
        int rc = check_exact(b->text, len, JSON_STRICT_DEFAULT_DEPTH, &f);
        CHECK_MSG(rc == AR_ERR, "case %zu was accepted", i);
        if (rc != AR_ERR)
            continue;
        CHECK_MSG(f.offset == b->offset, "case %zu: fault at byte %zu, expected %zu (%s)", i,
                  f.offset, b->offset, f.why);
        CHECK_MSG(f.trailing == b->trailing, "case %zu: trailing %d", i, f.trailing);
        CHECK_MSG(strstr(f.why, b->why_has) != NULL, "case %zu: \"%s\" lacks \"%s\"", i, f.why,
                  b->why_has);
    }
}

/* n '[' then n ']' into a fresh buffer of exactly 2n bytes. */
static char *nested(size_t n) {
    char *s = malloc(2 * n);
    if (s) {
        memset(s, '[', n);
        memset(s + n, ']', n);
    }
    return s;
}

/* The number grammar alone, without the length limit, for callers that
 * respell long numbers (server/api.c). */
static void test_number_len(void) {
    static const struct {
        const char *text;
        size_t len;
    } cases[] = {
        {"0", 1},  {"-0", 2}, {"12x", 2}, {"1.5e-3,", 6}, {"1E+9}", 4}, {"01", 0},
        {"-", 0},  {"-a", 0}, {"1.", 0},  {"1.e5", 0},    {"1e", 0},    {"1e+", 0},
        {".5", 0}, {"+1", 0}, {"x", 0},   {"0.5.5", 3},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        size_t n = json_strict_number_len(cases[i].text, strlen(cases[i].text));
        CHECK_MSG(n == cases[i].len, "%s: %zu, want %zu", cases[i].text, n, cases[i].len);
    }
    /* No length limit, and never a byte past avail. */
    char digits[400];
    memset(digits, '9', sizeof digits);
    CHECK(json_strict_number_len(digits, sizeof digits) == sizeof digits);
    CHECK(json_strict_number_len(digits, 10) == 10);
    CHECK(json_strict_number_len("-5", 1) == 0);
    CHECK(json_strict_number_len("", 0) == 0);
}

static void test_nesting_limit(void) {
    json_strict_fault_t f;
    char *s = nested(64);
    CHECK(json_strict_check(s, 128, 64, &f) == AR_OK);
    CHECK(json_strict_check(s, 128, 63, &f) == AR_ERR);
    CHECK(f.offset == 63);
    CHECK_STR_CONTAINS(f.why, "nested deeper than 63 levels");
    free(s);
    /* 100000 levels: refused at the first level past the limit, in one pass
     * with no recursion, whatever the limit. */
    s = nested(100000);
    CHECK(json_strict_check(s, 200000, JSON_STRICT_DEFAULT_DEPTH, &f) == AR_ERR);
    CHECK(f.offset == JSON_STRICT_DEFAULT_DEPTH);
    CHECK(json_strict_check(s, 200000, JSON_STRICT_MAX_DEPTH, &f) == AR_ERR);
    CHECK(f.offset == JSON_STRICT_MAX_DEPTH);
    free(s);
    /* cJSON's own limit: 1000 levels parse, so the check's largest limit is one
     * cJSON honours. */
    s = nested(JSON_STRICT_MAX_DEPTH);
    cJSON *root = json_parse_strict(s, 2 * JSON_STRICT_MAX_DEPTH, JSON_STRICT_MAX_DEPTH, &f, NULL);
    CHECK_MSG(root != NULL, "byte %zu: %s", f.offset, f.why);
    cJSON_Delete(root);
    free(s);
    /* Objects and arrays share the count; an object's value is one level in. */
    const char *mixed = "{\"a\":[{\"b\":[]}]}";
    CHECK(json_strict_check(mixed, strlen(mixed), 4, &f) == AR_OK);
    CHECK(json_strict_check(mixed, strlen(mixed), 3, &f) == AR_ERR && f.offset == 11);
    /* The limit itself must be one cJSON can honour. */
    CHECK(json_strict_check("1", 1, 0, &f) == AR_ERR);
    CHECK_STR_CONTAINS(f.why, "max_depth 0 is outside 1..1000");
    CHECK(json_strict_check("1", 1, JSON_STRICT_MAX_DEPTH + 1, &f) == AR_ERR);
}

static void test_parse_strict_reports_byte_and_reason(void) {
    ar_error_t err = {{0}};
    const char *text = "{\"width\": 1, \"h\": 01}";
    CHECK(json_parse_strict(text, strlen(text), 8, NULL, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "byte 18: a number may not have a leading zero");
    text = "{\"n\": 4.2e1, \"s\": \"\\u00e9\"}";
    cJSON *root = json_parse_strict(text, strlen(text), 8, NULL, &err);
    CHECK(root != NULL);
    if (root) {
        CHECK(cJSON_GetObjectItemCaseSensitive(root, "n")->valuedouble == 42);
        CHECK(strcmp(cJSON_GetObjectItemCaseSensitive(root, "s")->valuestring, "\xc3\xa9") == 0);
        cJSON_Delete(root);
    }
    /* Only len bytes are the text: what follows is not read. */
    root = json_parse_strict("[1]garbage", 3, 8, NULL, &err);
    CHECK(cJSON_IsArray(root));
    cJSON_Delete(root);
    CHECK(json_parse_strict("[1,2]", 4, 8, NULL, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg, "byte 4: the text ends inside an array");
    CHECK(json_parse_strict(NULL, 5, 8, NULL, &err) == NULL);
    /* cJSON 1.7.15 skips a byte order mark only in a text of five bytes or
     * more; json_parse_strict skips it itself, so a short text after one parses. */
    root = json_parse_strict("\xef\xbb\xbf"
                             "7",
                             4, 8, NULL, &err);
    CHECK(root && cJSON_IsNumber(root) && root->valuedouble == 7);
    cJSON_Delete(root);
}

/* Random edits of valid texts: whatever the check accepts, cJSON parses, and
 * to the end of the text. The texts mix every token kind, so the edits make
 * numbers, escapes, UTF-8 and commas at the edges of the grammar. */
/* xorshift32: a fixed sequence, so a failure reproduces. */
static uint32_t next_u32(uint32_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 17;
    *x ^= *x << 5;
    return *x;
}

static void test_accepted_texts_parse_in_cjson(void) {
    static const char *const seeds[] = {
        "{\"a\": [1, -2.5e+3, true, false, null], \"b\": {\"c\": \"x\\u00e9\\ud83d\\ude00\"}}",
        "[0, 0.5, \"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\", [], {}, [[[1]]]]",
        "  {\"k\" : \"\\\\\\\"\\/\\b\\f\\n\\r\\t\" , \"e\":1E9 }  ",
    };
    static const char alphabet[] = "{}[],:\"\\ -+.eE0123456789tfnulrsaxu\x01\xc3\xa9\xed\xa0";
    uint32_t rng = 7;
    int accepted = 0, tried = 0;
    for (int round = 0; round < 20000; round++) {
        const char *seed = seeds[round % 3];
        size_t len = strlen(seed);
        char buf[256];
        memcpy(buf, seed, len);
        int edits = 1 + (int)(next_u32(&rng) % 3);
        for (int e = 0; e < edits && len > 1; e++) {
            size_t at = next_u32(&rng) % len;
            unsigned kind = next_u32(&rng) % 3;
            char c = alphabet[next_u32(&rng) % (sizeof alphabet - 1)];
            if (kind == 0) {
                buf[at] = c;
            } else if (kind == 1) {
                memmove(buf + at, buf + at + 1, len - at - 1);
                len--;
            } else if (len < sizeof buf) {
                memmove(buf + at + 1, buf + at, len - at);
                buf[at] = c;
                len++;
            }
        }
        char *exact = malloc(len);
        memcpy(exact, buf, len);
        tried++;
        if (json_strict_check(exact, len, 16, NULL) == AR_OK) {
            accepted++;
            const char *end = NULL;
            cJSON *root = cJSON_ParseWithLengthOpts(exact, len, &end, 0);
            CHECK_MSG(root != NULL, "cJSON refused an accepted text: %.*s", (int)len, exact);
            size_t at = root && end ? (size_t)(end - exact) : len;
            while (at < len && strchr(" \t\r\n", exact[at]))
                at++;
            CHECK_MSG(at == len, "cJSON stopped at byte %zu of %.*s", at, (int)len, exact);
            cJSON_Delete(root);
        }
        free(exact);
    }
    /* Both outcomes must be common, or the property checks nothing. */
    CHECK_MSG(accepted > tried / 50 && accepted < tried / 2, "%d of %d accepted", accepted, tried);
}

/* Writes n bytes to a fresh temporary file; returns its path (static). */
static const char *temp_file(const char *bytes, size_t n) {
    static char path[512];
    const char *dir = getenv("TMPDIR");
    snprintf(path, sizeof path, "%s/test_json_strict.XXXXXX", dir && *dir ? dir : "/tmp");
    int fd = mkstemp(path);
    if (fd < 0)
        return NULL;
    ssize_t w = write(fd, bytes, n);
    close(fd);
    return w == (ssize_t)n ? path : NULL;
}

/* Every parse of a file or request goes through the strict check: a leading
 * zero, which cJSON alone reads as a number, is refused at each with the byte
 * and the reason, in that parser's own wording. */
static void test_every_parse_site_is_strict(void) {
    static const int w[] = {384}, h[] = {384};
    const api_limits_t lim = {.max_n = 4,
                              .n_sizes = 1,
                              .widths = w,
                              .heights = h,
                              .max_prompt_bytes = 32,
                              .codebook_size = 16};
    const char *body = "{\"prompt\":\"x\",\"n\":01}";
    api_image_request_t r;
    api_error_t aerr;
    CHECK(api_parse_image_request(body, strlen(body), &lim, &r, &aerr) == AR_ERR);
    CHECK(aerr.status == 400 && strcmp(aerr.code, "invalid_json") == 0);
    CHECK_STR_CONTAINS(aerr.message,
                       "malformed JSON: a number may not have a leading zero at byte 18");

    ar_error_t err = {{0}};
    const char *cfg = "{\"format_version\": 01}";
    model_config_t mc;
    CHECK(model_config_parse(&mc, cfg, strlen(cfg), "m/arserve.json", &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "m/arserve.json: not valid JSON: byte 19: a number may not have a "
                                "leading zero");

    const char *cal = "{\"format\": \"arserve-kv-calibration\", \"version\": 01}";
    const char *path = temp_file(cal, strlen(cal));
    kv_calibration_set_t kc;
    CHECK(path && kv_calibration_set_load(&kc, path, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "not valid JSON: byte 48: a number may not have a leading zero");
    if (path)
        unlink(path);

    const char *tok = "{\"model\": {\"type\": \"WordLevel\",\n \"vocab\": {\"a\": 01}}}";
    path = temp_file(tok, strlen(tok));
    CHECK(path && tokenizer_load(path, &err) == NULL);
    CHECK_STR_CONTAINS(err.msg,
                       "invalid JSON at line 2, column 17: a number may not have a leading "
                       "zero");
    if (path)
        unlink(path);

    /* 8-byte little-endian header length, the header, one byte of data. */
    const char *hdr = "{\"w\":{\"dtype\":\"U8\",\"shape\":[01],\"data_offsets\":[0,1]}}";
    char file[128] = {0};
    size_t hn = strlen(hdr);
    file[0] = (char)hn;
    memcpy(file + 8, hdr, hn);
    path = temp_file(file, 8 + hn + 1);
    safetensors_t st;
    CHECK(path && safetensors_open(&st, path, &err) == AR_ERR);
    CHECK_STR_CONTAINS(err.msg, "header is not valid JSON: byte 28 of 54: a number may not have a "
                                "leading zero");
    if (path)
        unlink(path);
}

int main(void) {
    TEST_RUN(test_valid_texts_accepted);
    TEST_RUN(test_invalid_texts_refused_with_byte_and_reason);
    TEST_RUN(test_number_len);
    TEST_RUN(test_nesting_limit);
    TEST_RUN(test_parse_strict_reports_byte_and_reason);
    TEST_RUN(test_accepted_texts_parse_in_cjson);
    TEST_RUN(test_every_parse_site_is_strict);
    return TEST_SUMMARY();
}
