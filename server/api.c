/* The JSON half of the HTTP API: a lexical pre-scan and cJSON parse of image
 * requests with field-by-field validation that names the field at fault, and
 * cJSON-built response, error and SSE payloads. See api.h for the contract. */
#include "server/api.h"

#include "base/text.h"
#include "engine/format/json_strict.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- errors ----------------------------------------------------------- */

/* Drops a trailing incomplete UTF-8 sequence left by truncation. The text
 * before it is valid, since every string arserve echoes came from a body that
 * passed the UTF-8 scan. */
static void utf8_trim_tail(char *s) {
    size_t len = strlen(s);
    size_t i = len;
    while (i > 0 && ((unsigned char)s[i - 1] & 0xC0) == 0x80 && len - i < 3)
        i--;
    if (i == 0 || (unsigned char)s[i - 1] < 0xC0)
        return; /* ASCII end, or no lead byte */
    unsigned char lead = (unsigned char)s[i - 1];
    size_t need = lead >= 0xF0 ? 4 : lead >= 0xE0 ? 3 : 2;
    if (len - (i - 1) < need)
        s[i - 1] = 0;
}

/* Copies src into dst (cap bytes with the NUL), cut at a character boundary. */
static void copy_trimmed(char *dst, size_t cap, const char *src) {
    snprintf(dst, cap, "%s", src ? src : "");
    utf8_trim_tail(dst);
}

int api_errorf(api_error_t *err, int status, const char *param, const char *code, const char *fmt,
               ...) {
    if (!err)
        return AR_ERR;
    memset(err, 0, sizeof *err);
    err->status = status;
    copy_trimmed(err->type, sizeof err->type,
                 status >= 500 ? "server_error" : "invalid_request_error");
    copy_trimmed(err->param, sizeof err->param, param);
    copy_trimmed(err->code, sizeof err->code, code);
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err->message, sizeof err->message, fmt, ap);
    va_end(ap);
    utf8_trim_tail(err->message);
    return AR_ERR;
}

/* A client string for a message: at most 64 bytes, cut at a character
 * boundary, "..." appended when cut. */
static const char *excerpt(const char *s, char buf[72]) {
    size_t len = strlen(s);
    if (len <= 64)
        return s;
    memcpy(buf, s, 64);
    buf[64] = 0;
    utf8_trim_tail(buf);
    strcat(buf, "...");
    return buf;
}

/* Shortest of %.15g..%.17g that reads back as v; integers without exponent.
 * Infinity can only come from a literal like 1e400 that overflowed. */
static const char *fmt_double(double v, char buf[40]) {
    if (isinf(v)) {
        snprintf(buf, 40, "%s",
                 v > 0 ? "a number too large for a double" : "a number too small for a double");
        return buf;
    }
    if (isfinite(v) && v == floor(v) && fabs(v) < 1e17) {
        snprintf(buf, 40, "%.0f", v);
        return buf;
    }
    for (int prec = 15; prec <= 17; prec++) {
        snprintf(buf, 40, "%.*g", prec, v);
        if (strtod(buf, NULL) == v)
            break;
    }
    return buf;
}

static const char *json_type_name(const cJSON *v) {
    if (cJSON_IsString(v))
        return "a string";
    if (cJSON_IsNumber(v))
        return "a number";
    if (cJSON_IsBool(v))
        return "a boolean";
    if (cJSON_IsArray(v))
        return "an array";
    if (cJSON_IsObject(v))
        return "an object";
    return "null";
}

/* ---- the lexical pre-scan ---------------------------------------------- */

static int is_json_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r';
}

/* The top-level member a \u0000 at byte `at` stands in: its name (when
 * printable ASCII of at most 64 bytes, else none) names the field. */
static int nul_escape_error(const unsigned char *key, size_t key_len, int in_key, size_t at,
                            api_error_t *err) {
    char name[65] = "";
    int printable = key && key_len > 0 && key_len < sizeof name;
    for (size_t k = 0; printable && k < key_len; k++)
        printable = key[k] >= 0x20 && key[k] < 0x7f && key[k] != '"' && key[k] != '\\';
    if (printable)
        memcpy(name, key, key_len), name[key_len] = 0;
    if (in_key || !name[0])
        return api_errorf(err, 400, "", "invalid_json",
                          "malformed JSON: a member name contains \\u0000 (byte %zu); no field's "
                          "name or text may hold a NUL character",
                          at);
    return api_errorf(err, 400, name, "invalid_value",
                      "%s must not contain \\u0000 (a NUL character; byte %zu of the body)", name,
                      at);
}

/* Walks the raw body once, tracking strings and escapes the way cJSON does so
 * that brackets inside strings do not count, and which top-level member it
 * is in. Syntax errors are left to cJSON; this only refuses what cJSON would
 * accept but arserve must not. */
static int body_scan(const unsigned char *p, size_t len, api_error_t *err) {
    int depth = 0, in_string = 0, expect_key = 0, in_key = 0;
    const unsigned char *key = NULL;
    size_t key_len = 0, i = 0;
    while (i < len) {
        unsigned char c = p[i];
        if (c >= 0x80) {
            size_t k = json_strict_utf8_len(p + i, len - i, NULL);
            if (k == 0)
                return api_errorf(err, 400, "", "invalid_json",
                                  "malformed JSON: invalid UTF-8 at byte %zu", i);
            i += k;
            continue;
        }
        if (in_string) {
            if (c == '"') {
                in_string = 0;
                if (in_key)
                    key_len = (size_t)(p + i - key), in_key = 0;
            } else if (c == '\\') {
                if (i + 5 < len && p[i + 1] == 'u' && memcmp(p + i + 2, "0000", 4) == 0)
                    return nul_escape_error(key, key_len, in_key, i, err);
                /* Skip the escaped character unless it starts a multi-byte
                 * sequence, which the UTF-8 check must still see. */
                if (i + 1 < len && p[i + 1] < 0x80)
                    i++;
            } else if (c < 0x20) {
                return api_errorf(err, 400, "", "invalid_json",
                                  "malformed JSON: unescaped control character 0x%02x in a string "
                                  "at byte %zu",
                                  c, i);
            }
        } else if (c == '"') {
            in_string = 1;
            if (depth == 1 && expect_key)
                key = p + i + 1, key_len = 0, in_key = 1, expect_key = 0;
        } else if (c == ',' && depth == 1) {
            expect_key = 1;
        } else if (c == '{' || c == '[') {
            expect_key = depth == 0 && c == '{';
            if (++depth > API_MAX_JSON_DEPTH)
                return api_errorf(err, 400, "", "invalid_json",
                                  "malformed JSON: nested deeper than %d levels at byte %zu",
                                  API_MAX_JSON_DEPTH, i);
        } else if (c == '}' || c == ']') {
            depth--;
        } else if (c < 0x20 && !is_json_space(c)) {
            return api_errorf(err, 400, "", "invalid_json",
                              "malformed JSON: control character 0x%02x at byte %zu", c, i);
        }
        i++;
    }
    return AR_OK;
}

/* ---- field validation --------------------------------------------------- */

/* A numeric field: integer or real, in [lo, hi], or (lo, hi] when lo_open. */
typedef struct num_rule {
    const char *name;
    int integer, lo_open;
    double lo, hi;
} num_rule_t;

/* "an integer from 1 to 4", "a number greater than 0 and at most 1" */
static void num_rule_describe(const num_rule_t *r, char *buf, size_t cap) {
    char lo[40], hi[40];
    const char *kind = r->integer ? "an integer" : "a number";
    fmt_double(r->lo, lo);
    fmt_double(r->hi, hi);
    if (r->lo_open)
        snprintf(buf, cap, "%s greater than %s and at most %s", kind, lo, hi);
    else
        snprintf(buf, cap, "%s from %s to %s", kind, lo, hi);
}

static int check_number(const cJSON *v, const num_rule_t *r, double *out, api_error_t *err) {
    char want[128], got[40];
    num_rule_describe(r, want, sizeof want);
    if (!cJSON_IsNumber(v))
        return api_errorf(err, 400, r->name, "invalid_type", "%s must be %s; got %s", r->name, want,
                          json_type_name(v));
    double x = v->valuedouble;
    fmt_double(x, got);
    if (r->integer && isfinite(x) && x != floor(x))
        return api_errorf(err, 400, r->name, "invalid_type", "%s must be %s; got %s", r->name, want,
                          got);
    int below = r->lo_open ? !(x > r->lo) : !(x >= r->lo);
    if (!isfinite(x) || below || x > r->hi)
        return api_errorf(err, 400, r->name, "invalid_value", "%s must be %s; got %s", r->name,
                          want, got);
    *out = x;
    return AR_OK;
}

static int check_string(const cJSON *v, const char *name, const char *want, api_error_t *err) {
    if (cJSON_IsString(v) && v->valuestring)
        return AR_OK;
    return api_errorf(err, 400, name, "invalid_type", "%s must be %s; got %s", name, want,
                      json_type_name(v));
}

/* "384x384, 768x768" */
static void sizes_list(const api_limits_t *lim, char *buf, size_t cap) {
    size_t used = 0;
    buf[0] = 0;
    for (int i = 0; i < lim->n_sizes; i++)
        text_append(buf, cap, &used, "%s%dx%d", i ? ", " : "", lim->widths[i], lim->heights[i]);
}

/* Parses "WxH", each 1..5 digits without a leading zero, and nothing else;
 * 0 if it is not that. */
static int parse_size(const char *s, int *w, int *h) {
    int dims[2];
    for (int d = 0; d < 2; d++) {
        int digits = 0, value = 0;
        if (*s == '0')
            return 0; /* no leading zeros, and no zero size */
        while (*s >= '0' && *s <= '9' && digits < 6)
            value = value * 10 + (*s++ - '0'), digits++;
        if (digits == 0 || digits > 5)
            return 0;
        dims[d] = value;
        if (d == 0 && *s++ != 'x')
            return 0;
    }
    if (*s)
        return 0;
    *w = dims[0];
    *h = dims[1];
    return 1;
}

typedef struct field field_t;
typedef int (*field_parse_fn)(const field_t *f, const cJSON *v, const api_limits_t *lim,
                              api_image_request_t *r, api_error_t *err);

/* One request field. A numeric field (parse NULL) is checked against its
 * rule (hi from the limits when hi_of is set) and stored at offset as
 * type, with its has_* flag at has_offset (or none); any other field has
 * a function of its own. */
typedef enum { NUM_INT, NUM_U64, NUM_FLOAT, NUM_DOUBLE } num_store_t;
struct field {
    const char *name;
    field_parse_fn parse;
    int integer, lo_open;
    double lo, hi;
    double (*hi_of)(const api_limits_t *lim);
    num_store_t store;
    size_t offset;
    long has_offset; /* -1: no flag */
};

static int parse_number_field(const field_t *f, const cJSON *v, const api_limits_t *lim,
                              api_image_request_t *r, api_error_t *err) {
    num_rule_t rule = {.name = f->name,
                       .integer = f->integer,
                       .lo_open = f->lo_open,
                       .lo = f->lo,
                       .hi = f->hi_of ? f->hi_of(lim) : f->hi};
    double x;
    if (check_number(v, &rule, &x, err))
        return AR_ERR;
    char *at = (char *)r + f->offset;
    switch (f->store) {
    case NUM_INT:
        *(int *)at = (int)x;
        break;
    case NUM_U64:
        *(uint64_t *)at = (uint64_t)x;
        break;
    case NUM_FLOAT: {
        /* A value just inside an open bound can round onto it in a float
         * (top_p 1e-60 is above 0, (float)1e-60 is 0): refuse it rather
         * than run with a value the range excludes. Found by fuzz_request. */
        float fx = (float)x;
        if (rule.lo_open && !(fx > rule.lo)) {
            char want[128], got[40];
            num_rule_describe(&rule, want, sizeof want);
            return api_errorf(err, 400, f->name, "invalid_value",
                              "%s must be %s; got %s, which is %g in single precision", f->name,
                              want, fmt_double(x, got), (double)fx);
        }
        *(float *)at = fx;
        break;
    }
    case NUM_DOUBLE:
        *(double *)at = x;
        break;
    }
    if (f->has_offset >= 0)
        *(int *)((char *)r + f->has_offset) = 1;
    return AR_OK;
}

/* A prompt-like text field into *out: a non-empty string of at most
 * max_prompt_bytes. */
static int parse_text(const field_t *f, const cJSON *v, const api_limits_t *lim, char **out,
                      api_error_t *err) {
    char want[128];
    snprintf(want, sizeof want, "a non-empty string of at most %zu bytes", lim->max_prompt_bytes);
    if (check_string(v, f->name, want, err))
        return AR_ERR;
    size_t len = strlen(v->valuestring);
    if (len == 0)
        return api_errorf(err, 400, f->name, "invalid_value", "%s must be %s; got an empty string",
                          f->name, want);
    if (len > lim->max_prompt_bytes)
        return api_errorf(err, 400, f->name, "invalid_value", "%s must be %s; got %zu bytes",
                          f->name, want, len);
    *out = malloc(len + 1);
    if (!*out)
        return api_errorf(err, 500, "", "out_of_memory", "out of memory copying the %s", f->name);
    memcpy(*out, v->valuestring, len + 1);
    return AR_OK;
}

static int parse_prompt(const field_t *f, const cJSON *v, const api_limits_t *lim,
                        api_image_request_t *r, api_error_t *err) {
    return parse_text(f, v, lim, &r->prompt, err);
}

static int parse_negative_prompt(const field_t *f, const cJSON *v, const api_limits_t *lim,
                                 api_image_request_t *r, api_error_t *err) {
    if (!lim->negative_prompt)
        return api_errorf(err, 400, f->name, "invalid_value",
                          "negative_prompt: this model takes none (only Infinity-architecture "
                          "models do)");
    return parse_text(f, v, lim, &r->negative_prompt, err);
}

/* class_label: an index in [0, num_classes) or one of the class names. */
static int parse_class_label(const field_t *f, const cJSON *v, const api_limits_t *lim,
                             api_image_request_t *r, api_error_t *err) {
    char buf[72], num[40];
    if (lim->num_classes <= 0)
        return api_errorf(err, 400, f->name, "invalid_value",
                          "class_label: this model is not class-conditional; give a prompt");
    const char *where = lim->class_names ? " or one of the class names GET /v1/models lists" : "";
    if (cJSON_IsString(v) && lim->class_names) {
        for (int i = 0; i < lim->num_classes; i++)
            if (strcmp(lim->class_names[i], v->valuestring) == 0) {
                r->has_class = 1;
                r->class_label = i;
                return AR_OK;
            }
        return api_errorf(err, 400, f->name, "invalid_value",
                          "class_label '%s' is not a class of this model; give an integer from 0 "
                          "to %d%s",
                          excerpt(v->valuestring, buf), lim->num_classes - 1, where);
    }
    if (!cJSON_IsNumber(v) || floor(v->valuedouble) != v->valuedouble)
        return api_errorf(err, 400, f->name, "invalid_type",
                          "class_label must be an integer from 0 to %d%s; got %s",
                          lim->num_classes - 1, where, json_type_name(v));
    if (v->valuedouble < 0 || v->valuedouble >= lim->num_classes)
        return api_errorf(err, 400, f->name, "invalid_value",
                          "class_label must be an integer from 0 to %d%s; got %s",
                          lim->num_classes - 1, where, fmt_double(v->valuedouble, num));
    r->has_class = 1;
    r->class_label = (int)v->valuedouble;
    return AR_OK;
}

static int parse_model(const field_t *f, const cJSON *v, const api_limits_t *lim,
                       api_image_request_t *r, api_error_t *err) {
    char buf[72];
    if (check_string(v, f->name, "a string", err))
        return AR_ERR;
    if (!lim->model_name || !strcmp(v->valuestring, lim->model_name))
        return AR_OK;
    const char *names = lim->model_names && *lim->model_names ? lim->model_names : NULL;
    const size_t len = strlen(v->valuestring);
    for (const char *p = names; p && *p;) {
        const size_t n = strcspn(p, ",");
        if (n == len && !memcmp(p, v->valuestring, n))
            return AR_OK;
        p += n + (p[n] == ',');
    }
    return api_errorf(err, 404, f->name, "model_not_found",
                      "model '%s' is not served here; this server serves '%s'",
                      excerpt(v->valuestring, buf), names ? names : lim->model_name);
}

static int parse_size_field(const field_t *f, const cJSON *v, const api_limits_t *lim,
                            api_image_request_t *r, api_error_t *err) {
    char buf[72], sizes[256];
    sizes_list(lim, sizes, sizeof sizes);
    if (check_string(v, f->name, "a string \"WxH\" or \"auto\"", err))
        return AR_ERR;
    if (strcmp(v->valuestring, "auto") == 0) {
        r->width = lim->widths[0];
        r->height = lim->heights[0];
        return AR_OK;
    }
    int w, h;
    const int well_formed = parse_size(v->valuestring, &w, &h);
    if (well_formed)
        for (int i = 0; i < lim->n_sizes; i++)
            if (lim->widths[i] == w && lim->heights[i] == h) {
                r->width = w;
                r->height = h;
                return AR_OK;
            }
    /* The nearest size: the closest aspect ratio, then the closest area
     * (both in log space, so 2:1 and 1:2 are as far from 1:1). */
    char nearest[48] = "";
    if (well_formed && lim->n_sizes > 1) {
        double best = INFINITY;
        for (int i = 0; i < lim->n_sizes; i++) {
            const double d =
                fabs(log((double)w / h) - log((double)lim->widths[i] / lim->heights[i])) +
                0.01 * fabs(log((double)w * h / ((double)lim->widths[i] * lim->heights[i])));
            if (d < best) {
                best = d;
                snprintf(nearest, sizeof nearest, "; the nearest is %dx%d", lim->widths[i],
                         lim->heights[i]);
            }
        }
    }
    return api_errorf(err, 400, f->name, "invalid_value",
                      "size '%s' is not supported%s; supported: %s (or auto)",
                      excerpt(v->valuestring, buf), nearest, sizes);
}

static int parse_response_format(const field_t *f, const cJSON *v, const api_limits_t *lim,
                                 api_image_request_t *r, api_error_t *err) {
    char buf[72];
    if (check_string(v, f->name, "\"b64_json\"", err))
        return AR_ERR;
    if (strcmp(v->valuestring, "b64_json") == 0)
        return AR_OK;
    if (strcmp(v->valuestring, "url") == 0)
        return api_errorf(err, 400, f->name, "unsupported_value",
                          "response_format 'url' is not supported: arserve stores no images; "
                          "use 'b64_json'");
    return api_errorf(err, 400, f->name, "invalid_value",
                      "response_format must be 'b64_json'; got '%s'", excerpt(v->valuestring, buf));
}

static int parse_output_format(const field_t *f, const cJSON *v, const api_limits_t *lim,
                               api_image_request_t *r, api_error_t *err) {
    char buf[72];
    if (check_string(v, f->name, "\"png\"", err))
        return AR_ERR;
    if (strcmp(v->valuestring, "png") == 0)
        return AR_OK;
    if (strcmp(v->valuestring, "jpeg") == 0 || strcmp(v->valuestring, "webp") == 0)
        return api_errorf(err, 400, f->name, "unsupported_value",
                          "output_format '%s' is not supported; supported: png", v->valuestring);
    return api_errorf(err, 400, f->name, "invalid_value", "output_format must be 'png'; got '%s'",
                      excerpt(v->valuestring, buf));
}

static int parse_user(const field_t *f, const cJSON *v, const api_limits_t *lim,
                      api_image_request_t *r, api_error_t *err) {
    char want[128];
    snprintf(want, sizeof want, "a string of at most %zu bytes", sizeof r->user - 1);
    if (check_string(v, f->name, want, err))
        return AR_ERR;
    if (strlen(v->valuestring) >= sizeof r->user)
        return api_errorf(err, 400, f->name, "invalid_value", "user must be %s; got %zu bytes",
                          want, strlen(v->valuestring));
    memcpy(r->user, v->valuestring, strlen(v->valuestring) + 1);
    return AR_OK;
}

static int parse_kv_policy(const field_t *f, const cJSON *v, const api_limits_t *lim,
                           api_image_request_t *r, api_error_t *err) {
    char buf[72], names[128], want[176];
    snprintf(want, sizeof want, "one of %s, auto", kv_policy_list(names, sizeof names));
    if (check_string(v, f->name, want, err))
        return AR_ERR;
    if (strcmp(v->valuestring, "auto") == 0) {
        if (lim->kv_auto <= KV_POLICY_FULL)
            return api_errorf(err, 400, f->name, "invalid_value",
                              "kv_policy auto: no compressed policy runs on this model");
        r->kv_auto = 1;
        r->kv.has_kind = 1;
        r->kv.kind = (kv_policy_kind_t)lim->kv_auto;
        return AR_OK;
    }
    int kind = kv_policy_parse(v->valuestring);
    if (kind < 0)
        return api_errorf(err, 400, f->name, "invalid_value", "kv_policy must be %s; got '%s'",
                          want, excerpt(v->valuestring, buf));
    r->kv.has_kind = 1;
    r->kv.kind = (kv_policy_kind_t)kind;
    return AR_OK;
}

/* A boolean member: 400 naming the field for anything but true or false. */
static int read_bool(const field_t *f, const cJSON *v, int *out, api_error_t *err) {
    if (!cJSON_IsBool(v))
        return api_errorf(err, 400, f->name, "invalid_type", "%s must be a boolean; got %s",
                          f->name, json_type_name(v));
    *out = cJSON_IsTrue(v);
    return AR_OK;
}

static int parse_stream(const field_t *f, const cJSON *v, const api_limits_t *lim,
                        api_image_request_t *r, api_error_t *err) {
    return read_bool(f, v, &r->stream, err);
}

static int parse_async(const field_t *f, const cJSON *v, const api_limits_t *lim,
                       api_image_request_t *r, api_error_t *err) {
    return read_bool(f, v, &r->async, err);
}

static double max_n_of(const api_limits_t *lim) { return lim->max_n; }
static double codebook_of(const api_limits_t *lim) { return lim->codebook_size; }

#define REQ(f) offsetof(api_image_request_t, f)
#define NUMBER(name_, int_, lo_open_, lo_, hi_, hi_of_, store_, dest, has)                         \
    {                                                                                              \
        .name = name_, .integer = int_, .lo_open = lo_open_, .lo = lo_, .hi = hi_,                 \
        .hi_of = hi_of_, .store = store_, .offset = REQ(dest), .has_offset = has                   \
    }

/* The fields arserve knows; the index is the field's place in the seen-set. */
static const field_t FIELDS[] = {
    {.name = "prompt", .parse = parse_prompt},
    {.name = "negative_prompt", .parse = parse_negative_prompt},
    {.name = "class_label", .parse = parse_class_label},
    {.name = "model", .parse = parse_model},
    NUMBER("n", 1, 0, 1, 0, max_n_of, NUM_INT, n, -1),
    {.name = "size", .parse = parse_size_field},
    {.name = "response_format", .parse = parse_response_format},
    {.name = "output_format", .parse = parse_output_format},
    {.name = "user", .parse = parse_user},
    NUMBER("seed", 1, 0, 0, API_MAX_SEED, NULL, NUM_U64, seed, (long)REQ(has_seed)),
    NUMBER("guidance_scale", 0, 0, 0, 100, NULL, NUM_FLOAT, guidance_scale,
           (long)REQ(has_guidance_scale)),
    NUMBER("temperature", 0, 0, 0, 100, NULL, NUM_FLOAT, temperature, (long)REQ(has_temperature)),
    NUMBER("top_k", 1, 0, 0, 0, codebook_of, NUM_INT, top_k, (long)REQ(has_top_k)),
    NUMBER("top_p", 0, 1, 0, 1, NULL, NUM_FLOAT, top_p, (long)REQ(has_top_p)),
    {.name = "kv_policy", .parse = parse_kv_policy},
    NUMBER("kv_budget", 0, 1, 0, 1, NULL, NUM_DOUBLE, kv.budget, -1),
    NUMBER("kv_budget_min", 0, 1, 0, 1, NULL, NUM_DOUBLE, kv_budget_min, -1),
    NUMBER("deadline_ms", 1, 1, 0, 86400000, NULL, NUM_DOUBLE, deadline_ms, -1),
    {.name = "stream", .parse = parse_stream},
    NUMBER("partial_images", 1, 0, 0, API_MAX_PARTIAL_IMAGES, NULL, NUM_INT, partial_images, -1),
    {.name = "async", .parse = parse_async},
};
#define N_FIELDS ((int)(sizeof FIELDS / sizeof FIELDS[0]))

/* The members a request may give: the fields, then the KV knobs. The
 * seen-set has a flag for each, however many there are (no word's width
 * caps them). */
enum { N_MEMBERS = N_FIELDS + KV_POLICY_N_KNOBS };

static int parse_member(const field_t *f, const cJSON *v, const api_limits_t *lim,
                        api_image_request_t *r, api_error_t *err) {
    return (f->parse ? f->parse : parse_number_field)(f, v, lim, r, err);
}

/* A KV policy knob (KV_POLICY_KNOBS): a number in the knob's range. */
static int parse_knob(const kv_policy_knob_t *k, const cJSON *v, api_image_request_t *r,
                      api_error_t *err) {
    num_rule_t rule = {.name = k->name,
                       .integer = k->type == KV_KNOB_INT,
                       .lo_open = k->lo_open,
                       .lo = k->lo,
                       .hi = k->hi};
    double x;
    if (check_number(v, &rule, &x, err))
        return AR_ERR;
    kv_policy_knob_set(&r->kv.knobs, k, x);
    r->kv.knobs_given[k - kv_policy_knobs] = 1;
    return AR_OK;
}

/* A budget range (step 7 of api_parse_image_request): auto's defaults,
 * then the range's own checks. */
static int check_budget_range(api_image_request_t *r, const api_limits_t *lim, api_error_t *err) {
    if (r->kv_auto) {
        if (r->kv.budget == 0)
            r->kv_policy.budget = 1;
        if (r->kv_budget_min == 0)
            r->kv_budget_min = API_BUDGET_LEAST;
    }
    /* The daemon's range for the policy fills what the request left out:
     * the top of a request that gave only its floor, both ends of one
     * that gave neither (a request's own kv_budget fixes its budget). */
    const kv_budget_range_t *def = lim->kv_ranges ? &lim->kv_ranges[r->kv_policy.kind] : NULL;
    if (!r->kv_auto && def && def->min > 0 && r->kv.budget == 0) {
        if (def->max > 0)
            r->kv_policy.budget = def->max;
        if (r->kv_budget_min == 0)
            r->kv_budget_min = def->min;
    }
    if (r->kv_budget_min <= 0)
        return AR_OK;
    if (r->kv_policy.kind == KV_POLICY_FULL)
        return api_errorf(err, 400, "kv_budget_min", "invalid_value",
                          "kv_budget_min: kv_policy full takes no budget, so it has no range");
    if (r->kv_budget_min > r->kv_policy.budget)
        return api_errorf(err, 400, "kv_budget_min", "invalid_value",
                          "kv_budget_min %.4g is above the range's top, kv_budget %.4g%s",
                          r->kv_budget_min, r->kv_policy.budget,
                          r->kv.budget > 0                     ? ""
                          : !r->kv_auto && def && def->max > 0 ? " (the top of the daemon's range)"
                                                               : " (the policy's budget)");
    return AR_OK;
}

static int limits_valid(const api_limits_t *lim) {
    return lim && lim->max_n >= 1 && lim->n_sizes >= 1 && lim->widths && lim->heights &&
           lim->max_prompt_bytes >= 1 && lim->codebook_size >= 0;
}

/* The number at p[0..n) as a JSON number of at most 24 characters that reads
 * back as the same double: strtod's nearest, or 1e999 past the largest
 * double (which cJSON reads back as infinity, as strtod does). p[n] must be
 * writable: it is a NUL while strtod reads. */
static void spell_short(char *p, size_t n, char out[32]) {
    const char after = p[n];
    p[n] = 0;
    const double x = strtod(p, NULL);
    p[n] = after;
    if (isinf(x))
        snprintf(out, 32, "%s", x < 0 ? "-1e999" : "1e999");
    else
        snprintf(out, 32, "%.17g", x);
}

/* cJSON reads at most JSON_STRICT_MAX_NUMBER_CHARS characters of a number,
 * so a longer one (a seed written with 400 digits) would be malformed JSON
 * with no field to name. Returns body, or a copy of it (*copy, the caller
 * frees it) where every such number is respelled as its nearest double,
 * padded with spaces to its length (byte offsets stay true): the field's own
 * checks then judge it like any number (400 digits: too large for a double,
 * out of every range). Strings are skipped; NULL when memory runs out. */
static const char *shorten_long_numbers(const char *body, size_t len, char **copy) {
    *copy = NULL;
    int in_string = 0;
    for (size_t i = 0; i < len;) {
        const char c = body[i];
        if (in_string) {
            if (c == '\\')
                i++;
            else if (c == '"')
                in_string = 0;
            i++;
            continue;
        }
        if (c == '"') {
            in_string = 1;
            i++;
            continue;
        }
        size_t n =
            c == '-' || (c >= '0' && c <= '9') ? json_strict_number_len(body + i, len - i) : 0;
        if (n > JSON_STRICT_MAX_NUMBER_CHARS) {
            if (!*copy) {
                if (!(*copy = malloc(len + 1)))
                    return NULL;
                memcpy(*copy, body, len);
                (*copy)[len] = 0;
            }
            char spelled[32];
            spell_short(*copy + i, n, spelled);
            size_t k = strlen(spelled);
            memcpy(*copy + i, spelled, k);
            memset(*copy + i + k, ' ', n - k);
        }
        i += n ? n : 1;
    }
    return *copy ? *copy : body;
}

/* Steps 1-3 of api_parse_image_request: the body as a cJSON object. */
static cJSON *parse_body(const char *body, size_t len, api_error_t *err) {
    if (!body)
        len = 0;
    size_t first = 0;
    while (first < len && is_json_space((unsigned char)body[first]))
        first++;
    if (first == len) {
        api_errorf(err, 400, "", "invalid_json", "malformed JSON: empty body");
        return NULL;
    }
    if (body_scan((const unsigned char *)body, len, err))
        return NULL;
    char *copy;
    const char *text = shorten_long_numbers(body, len, &copy);
    if (!text) {
        api_errorf(err, 500, "", "out_of_memory", "out of memory reading the body");
        return NULL;
    }
    /* The strict check refuses what RFC 8259 does and cJSON would take
     * (01, 1., trailing commas, data after the value) before cJSON sees it. */
    json_strict_fault_t fault;
    cJSON *root = json_parse_strict(text, len, API_MAX_JSON_DEPTH, &fault, NULL);
    free(copy);
    if (!root) {
        if (fault.trailing)
            api_errorf(err, 400, "", "invalid_json",
                       "malformed JSON: unexpected data after the JSON value at byte %zu",
                       fault.offset);
        else
            api_errorf(err, 400, "", "invalid_json", "malformed JSON: %s at byte %zu", fault.why,
                       fault.offset);
        return NULL;
    }
    if (!cJSON_IsObject(root)) {
        api_errorf(err, 400, "", "invalid_json", "the request body must be a JSON object; got %s",
                   json_type_name(root));
        cJSON_Delete(root);
        return NULL;
    }
    return root;
}

int api_parse_image_request(const char *body, size_t len, const api_limits_t *lim,
                            api_image_request_t *out, api_error_t *err) {
    memset(out, 0, sizeof *out);
    if (!limits_valid(lim))
        return api_errorf(err, 500, "", "invalid_limits",
                          "the server's request limits are invalid");
    cJSON *root = parse_body(body, len, err);
    if (!root)
        return AR_ERR;
    out->n = 1;
    out->width = lim->widths[0];
    out->height = lim->heights[0];
    out->want_b64 = 1;
    /* Every member is either a known field, seen at most once, or an error:
     * the loop stops within N_MEMBERS + 1 members whatever the body holds. */
    unsigned char seen[N_MEMBERS] = {0};
    int rc = AR_OK;
    char buf[72];
    for (const cJSON *m = root->child; m && rc == AR_OK; m = m->next) {
        const char *key = m->string ? m->string : "";
        int f = 0;
        while (f < N_FIELDS && strcmp(key, FIELDS[f].name) != 0)
            f++;
        const kv_policy_knob_t *knob = f == N_FIELDS ? kv_policy_knob_find(key) : NULL;
        if (knob)
            f = N_FIELDS + (int)(knob - kv_policy_knobs);
        if (f == N_FIELDS && !knob) {
            rc = api_errorf(err, 400, key, "unknown_parameter", "unknown parameter '%s'",
                            excerpt(key, buf));
        } else if (seen[f]) {
            rc = api_errorf(err, 400, key, "duplicate_parameter", "parameter '%s' is given twice",
                            key);
        } else {
            seen[f] = 1;
            if (cJSON_IsNull(m))
                continue;
            rc = knob ? parse_knob(knob, m, out, err) : parse_member(&FIELDS[f], m, lim, out, err);
        }
    }
    cJSON_Delete(root);
    if (rc == AR_OK && out->stream && out->async)
        rc = api_errorf(err, 400, "async", "invalid_value",
                        "stream and async cannot both be true: a stream answers as the job "
                        "runs, async answers at once with a job to poll at GET "
                        "/v1/images/jobs/ID; choose one");
    if (rc == AR_OK && out->prompt && out->has_class)
        rc = api_errorf(err, 400, "class_label", "invalid_value",
                        "give class_label or a prompt naming a class, not both");
    if (rc == AR_OK && !out->prompt && !out->has_class)
        rc = lim->num_classes > 0
                 ? api_errorf(err, 400, "prompt", "missing_required_parameter",
                              "class_label (an integer from 0 to %d%s) or a prompt naming a "
                              "class is required",
                              lim->num_classes - 1,
                              lim->class_names ? ", or a class name GET /v1/models lists" : "")
                 : api_errorf(err, 400, "prompt", "missing_required_parameter",
                              "prompt is required: a non-empty string of at most %zu bytes",
                              lim->max_prompt_bytes);
    /* The policy the request runs with, resolved once: a knob of another
     * policy would be ignored, and the client would never know. */
    const char *field = NULL;
    ar_error_t kv_err = {{0}};
    if (rc == AR_OK &&
        kv_policy_resolve(lim->kv_defaults, &out->kv, &out->kv_policy, &field, &kv_err) != AR_OK)
        rc = api_errorf(err, 400, field ? field : "kv_policy", "invalid_value", "%s", kv_err.msg);
    if (rc == AR_OK)
        rc = check_budget_range(out, lim, err);
    if (rc != AR_OK)
        api_image_request_free(out);
    return rc;
}

void api_image_request_free(api_image_request_t *r) {
    if (!r)
        return;
    free(r->prompt);
    free(r->negative_prompt);
    memset(r, 0, sizeof *r);
}

void api_image_request_sampler_params(const api_image_request_t *r,
                                      const sampler_params_t *defaults, sampler_params_t *out) {
    *out = *defaults;
    if (r->has_guidance_scale)
        out->cfg = r->guidance_scale;
    if (r->has_temperature)
        out->temperature = r->temperature;
    if (r->has_top_k)
        out->top_k = r->top_k;
    if (r->has_top_p)
        out->top_p = r->top_p;
}

/* ---- builders ---------------------------------------------------------- */

/* Builders add members with these and check once at the end: cJSON's Add*
 * functions return NULL (and free what they made) when memory runs out. */
static int add_num(cJSON *o, const char *k, double v) {
    return cJSON_AddNumberToObject(o, k, v) != NULL;
}
static int add_str(cJSON *o, const char *k, const char *v) {
    return v && cJSON_AddStringToObject(o, k, v) != NULL;
}

/* Prints o and deletes it; NULL when ok is 0 or printing fails. */
static char *print_and_delete(cJSON *o, int ok) {
    char *text = ok && o ? cJSON_PrintUnformatted(o) : NULL;
    cJSON_Delete(o);
    return text;
}

static int add_usage(cJSON *o, int image_tokens, int prompt_tokens) {
    cJSON *u = cJSON_AddObjectToObject(o, "usage");
    if (!u)
        return 0;
    int ok = add_num(u, "input_tokens", prompt_tokens);
    ok &= add_num(u, "output_tokens", image_tokens);
    ok &= add_num(u, "total_tokens", (double)prompt_tokens + image_tokens);
    cJSON *d = cJSON_AddObjectToObject(u, "input_tokens_details");
    ok &= d != NULL;
    if (d) {
        ok &= add_num(d, "text_tokens", prompt_tokens);
        ok &= add_num(d, "image_tokens", 0);
    }
    return ok;
}

static int add_size(cJSON *o, int width, int height) {
    char size[32];
    snprintf(size, sizeof size, "%dx%d", width, height);
    return add_str(o, "size", size);
}

/* e as o's member "error": {"message", "type", "param", "code"}. */
static int add_error(cJSON *root, const api_error_t *e) {
    cJSON *o = cJSON_AddObjectToObject(root, "error");
    int ok = o != NULL;
    if (o) {
        ok &= add_str(o, "message", e->message);
        ok &= add_str(o, "type", e->type);
        ok &= (e->param[0] ? cJSON_AddStringToObject(o, "param", e->param)
                           : cJSON_AddNullToObject(o, "param")) != NULL;
        ok &= (e->code[0] ? cJSON_AddStringToObject(o, "code", e->code)
                          : cJSON_AddNullToObject(o, "code")) != NULL;
    }
    return ok;
}

char *api_error_json(const api_error_t *e) {
    if (!e)
        return NULL;
    cJSON *root = cJSON_CreateObject();
    return print_and_delete(root, root && add_error(root, e));
}

static int add_kv_report(cJSON *o, const api_kv_report_t *kv) {
    cJSON *k = cJSON_AddObjectToObject(o, "kv_cache");
    if (!k)
        return 0;
    const kv_policy_params_t *p = &kv->policy;
    int ok = add_str(k, "policy", kv_policy_name(p->kind));
    if (p->kind != KV_POLICY_FULL)
        ok &= add_num(k, "budget", p->budget);
    if (kv->budget_min > 0) {
        const double range[2] = {kv->budget_min, kv->budget_max};
        cJSON *r = cJSON_CreateDoubleArray(range, 2);
        ok &= r != NULL && cJSON_AddItemToObject(k, "budget_range", r);
    }
    for (int i = 0; i < KV_POLICY_N_KNOBS; i++)
        if (kv_policy_knob_of(&kv_policy_knobs[i], p->kind))
            ok &= add_num(k, kv_policy_knobs[i].name, kv_policy_knob_get(p, &kv_policy_knobs[i]));
    ok &= add_num(k, "planned_peak_bytes", (double)kv->planned_peak_bytes);
    ok &= add_num(k, "peak_bytes", (double)kv->peak_bytes);
    if (kv->admission)
        ok &= add_str(k, "admission", kv->admission);
    if (kv->predicted_s > 0)
        ok &= add_num(k, "predicted_s", kv->predicted_s);
    return ok;
}

static int add_timings(cJSON *o, const api_timings_t *t) {
    cJSON *k = cJSON_AddObjectToObject(o, "timings");
    if (!k)
        return 0;
    int ok = add_num(k, "queue_s", t->queue_s);
    ok &= add_num(k, "run_s", t->run_s);
    ok &= add_num(k, "steps", t->steps);
    ok &= add_num(k, "decode_png_s", t->decode_png_s);
    return ok;
}

/* The images response's members, added to root. */
/* "warnings": [each line of warnings] when it has any (NULL or "": none). */
static int add_warnings(cJSON *o, const char *warnings) {
    if (!warnings || !warnings[0])
        return 1;
    cJSON *a = cJSON_AddArrayToObject(o, "warnings");
    if (!a)
        return 0;
    for (const char *p = warnings; *p;) {
        const char *end = strchr(p, '\n');
        const size_t n = end ? (size_t)(end - p) : strlen(p);
        char *line = strndup(p, n);
        cJSON *item = line ? cJSON_CreateString(line) : NULL;
        free(line);
        if (!item)
            return 0;
        cJSON_AddItemToArray(a, item);
        p += n + (end != NULL);
    }
    return 1;
}

static int add_images_response(cJSON *root, long created, int n, const char *const *b64_pngs,
                               int width, int height, int image_tokens, int prompt_tokens,
                               const api_kv_report_t *kv, const api_timings_t *timings,
                               const char *warnings) {
    int ok = add_num(root, "created", (double)created);
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    ok &= data != NULL;
    for (int i = 0; ok && i < n; i++) {
        cJSON *img = cJSON_CreateObject();
        ok &= img != NULL && cJSON_AddItemToArray(data, img);
        if (!ok) {
            cJSON_Delete(img);
            break;
        }
        ok &= add_str(img, "b64_json", b64_pngs[i]);
    }
    ok &= add_str(root, "output_format", "png");
    ok &= add_size(root, width, height);
    ok &= add_usage(root, image_tokens, prompt_tokens);
    if (kv)
        ok &= add_kv_report(root, kv);
    if (timings)
        ok &= add_timings(root, timings);
    return ok && add_warnings(root, warnings);
}

char *api_images_response_json(long created, int n, const char *const *b64_pngs, int width,
                               int height, int image_tokens, int prompt_tokens,
                               const api_kv_report_t *kv, const api_timings_t *timings,
                               const char *warnings) {
    if (n < 0 || (n > 0 && !b64_pngs) || image_tokens < 0 || prompt_tokens < 0)
        return NULL;
    cJSON *root = cJSON_CreateObject();
    return print_and_delete(root, root && add_images_response(root, created, n, b64_pngs, width,
                                                              height, image_tokens, prompt_tokens,
                                                              kv, timings, warnings));
}

/* A time member: T, or null for 0. */
static int add_time(cJSON *o, const char *k, long t) {
    return (t ? cJSON_AddNumberToObject(o, k, (double)t) : cJSON_AddNullToObject(o, k)) != NULL;
}

char *api_job_json(const api_job_report_t *j) {
    const int done = j && j->status && !strcmp(j->status, "done");
    if (!j || !j->id || !j->status || !j->poll_url ||
        (done &&
         (j->n < 0 || (j->n > 0 && !j->b64_pngs) || j->image_tokens < 0 || j->prompt_tokens < 0)))
        return NULL;
    cJSON *root = cJSON_CreateObject();
    int ok = root && add_str(root, "id", j->id);
    ok &= add_str(root, "object", "image.generation.job");
    ok &= add_str(root, "status", j->status);
    ok &= add_num(root, "created", (double)j->created);
    ok &= add_time(root, "started", j->started);
    ok &= add_time(root, "completed", j->completed);
    ok &= add_num(root, "queue_position", j->queue_position);
    cJSON *p = cJSON_AddObjectToObject(root, "progress");
    ok &= p && add_num(p, "steps_done", j->steps_done) && add_num(p, "steps_total", j->steps_total);
    ok &= add_str(root, "poll_url", j->poll_url);
    if (done) {
        cJSON *r = cJSON_AddObjectToObject(root, "result");
        ok &= r && add_images_response(r, j->completed, j->n, j->b64_pngs, j->width, j->height,
                                       j->image_tokens, j->prompt_tokens, j->kv, j->timings,
                                       j->warnings);
    } else {
        ok &= cJSON_AddNullToObject(root, "result") != NULL;
    }
    if (j->error)
        ok &= add_error(root, j->error);
    else
        ok &= cJSON_AddNullToObject(root, "error") != NULL;
    return print_and_delete(root, ok);
}

char *api_job_deleted_json(const char *id, const char *status, int deleted) {
    if (!id || !status)
        return NULL;
    cJSON *root = cJSON_CreateObject();
    int ok = root && add_str(root, "id", id);
    ok &= add_str(root, "object", "image.generation.job");
    ok &= add_str(root, "status", status);
    ok &= cJSON_AddBoolToObject(root, "deleted", deleted) != NULL;
    return print_and_delete(root, ok);
}

/* The knobs of p's policy (KV_POLICY_KNOBS), each with its type, range,
 * what a request that does not give it gets (p's value: the server's
 * default) and what it does, as o's "knobs". */
static int add_knobs(cJSON *o, const kv_policy_params_t *p) {
    cJSON *arr = cJSON_AddArrayToObject(o, "knobs");
    int ok = arr != NULL;
    for (int i = 0; ok && i < KV_POLICY_N_KNOBS; i++) {
        const kv_policy_knob_t *k = &kv_policy_knobs[i];
        if (!kv_policy_knob_of(k, p->kind))
            continue;
        cJSON *e = cJSON_CreateObject();
        ok &= e != NULL && cJSON_AddItemToArray(arr, e);
        if (!ok) {
            cJSON_Delete(e);
            break;
        }
        ok &= add_str(e, "name", k->name);
        ok &= add_str(e, "type", k->type == KV_KNOB_INT ? "integer" : "number");
        ok &= add_num(e, "min", k->lo);
        ok &= cJSON_AddBoolToObject(e, "min_exclusive", k->lo_open) != NULL;
        ok &= add_num(e, "max", k->hi);
        ok &= add_num(e, "default", kv_policy_knob_get(p, k));
        ok &= add_str(e, "description", k->help);
    }
    return ok;
}

/* The policies that run on card's geometry with the server's knobs, each
 * with the budget a request naming only kv_policy gets and the least it
 * may ask for, when the budget shapes its cache, the daemon's default
 * range for it when it has one, and its knobs. */
static int add_kv_policies(cJSON *o, const api_limits_t *lim, const api_model_card_t *card) {
    const kv_policy_kind_t def = lim->kv_defaults ? lim->kv_defaults->kind : KV_POLICY_FULL;
    int ok = add_str(o, "kv_policy", kv_policy_name(def));
    if (lim->kv_auto > KV_POLICY_FULL && lim->kv_auto < KV_POLICY_COUNT)
        ok &= add_str(o, "kv_policy_auto", kv_policy_name((kv_policy_kind_t)lim->kv_auto));
    cJSON *arr = cJSON_AddArrayToObject(o, "kv_policies");
    ok &= arr != NULL;
    for (int k = 0; ok && k < KV_POLICY_COUNT; k++) {
        const kv_policy_overrides_t only_kind = {.has_kind = 1, .kind = (kv_policy_kind_t)k};
        kv_policy_params_t p;
        ar_error_t err;
        if (kv_policy_resolve(lim->kv_defaults, &only_kind, &p, NULL, &err) != AR_OK)
            continue;
        /* The sizes it runs at (kv_policy_min_budget >= 0), its budgets the first's. */
        const int n_geoms = card->size_geoms ? lim->n_sizes : 1;
        int n_runs = 0, first = -1;
        double least = -1;
        for (int i = 0; i < n_geoms; i++) {
            const double at =
                kv_policy_min_budget(&p, card->size_geoms ? &card->size_geoms[i] : card->geom);
            n_runs += at >= 0;
            if (at >= 0 && first < 0)
                first = i, least = at;
        }
        if (first < 0)
            continue;
        cJSON *e = cJSON_CreateObject();
        ok &= e != NULL && cJSON_AddItemToArray(arr, e);
        if (!ok) {
            cJSON_Delete(e);
            break;
        }
        ok &= add_str(e, "name", kv_policy_name(p.kind));
        if (n_runs < n_geoms) {
            cJSON *where = cJSON_AddArrayToObject(e, "sizes");
            ok &= where != NULL;
            for (int i = 0; where && i < n_geoms; i++) {
                char name[32];
                snprintf(name, sizeof name, "%dx%d", lim->widths[i], lim->heights[i]);
                if (kv_policy_min_budget(&p, &card->size_geoms[i]) >= 0)
                    ok &= cJSON_AddItemToArray(where, cJSON_CreateString(name));
            }
        }
        if (least > 0) {
            ok &= add_num(e, "budget", p.budget);
            ok &= add_num(e, "min_budget", least);
        }
        const kv_budget_range_t *range = lim->kv_ranges ? &lim->kv_ranges[k] : NULL;
        if (range && range->min > 0) {
            cJSON *b = cJSON_AddArrayToObject(e, "budget_range");
            ok &=
                b && cJSON_AddItemToArray(b, cJSON_CreateNumber(range->min)) &&
                cJSON_AddItemToArray(b, cJSON_CreateNumber(range->max > 0 ? range->max : p.budget));
        }
        ok &= add_knobs(e, &p);
    }
    return ok;
}

/* The "arserve" member of a model card (api_models_json). */
static int add_model_card(cJSON *m, const api_limits_t *lim, const api_model_card_t *card) {
    cJSON *a = cJSON_AddObjectToObject(m, "arserve");
    if (!a)
        return 0;
    const kv_geometry_t *g = card->geom;
    int ok = add_str(a, "family", card->family);
    ok &= add_str(a, "conditioning", lim->num_classes > 0 ? "class" : "text");
    ok &= add_num(a, "width", lim->widths[0]) && add_num(a, "height", lim->heights[0]);
    cJSON *sizes = cJSON_AddArrayToObject(a, "sizes");
    ok &= sizes != NULL;
    for (int i = 0; sizes && i < lim->n_sizes; i++) {
        char name[32];
        snprintf(name, sizeof name, "%dx%d", lim->widths[i], lim->heights[i]);
        ok &= cJSON_AddItemToArray(sizes, cJSON_CreateString(name));
    }
    ok &= cJSON_AddBoolToObject(a, "negative_prompt", lim->negative_prompt) != NULL;
    ok &= add_num(a, "steps", kv_geometry_steps(g));
    ok &= add_str(a, "step_unit", g->step_unit == KV_STEP_TOKEN ? "token" : "segment");
    ok &= add_str(a, "segment_name", card->segment_name);
    cJSON *seg = cJSON_CreateIntArray(g->segment_tokens, g->n_segments);
    ok &= seg != NULL && cJSON_AddItemToObject(a, "segment_tokens", seg);
    if (!seg)
        return 0;
    const sampler_params_t *sp = &card->sampling;
    cJSON *s = cJSON_AddObjectToObject(a, "sampling");
    ok &= s != NULL;
    if (s) {
        ok &= add_num(s, "guidance_scale", sp->cfg);
        ok &= add_num(s, "temperature", sp->temperature > 0 ? sp->temperature : 0);
        ok &= add_num(s, "top_k", sp->top_k);
        ok &= add_num(s, "top_p", sp->top_p < 1 ? (sp->top_p > 0 ? sp->top_p : 0) : 1);
    }
    if (card->n_words > 0) {
        cJSON *w = cJSON_CreateStringArray(card->words, card->n_words);
        ok &= w != NULL && cJSON_AddItemToObject(a, "vocabulary", w);
    }
    cJSON *l = cJSON_AddObjectToObject(a, "limits");
    ok &= l != NULL;
    if (l) {
        ok &= add_num(l, "max_n", lim->max_n);
        ok &= add_num(l, "max_partial_images", API_MAX_PARTIAL_IMAGES);
        ok &= add_num(l, "max_prompt_bytes", (double)lim->max_prompt_bytes);
    }
    return ok && add_kv_policies(a, lim, card);
}

char *api_models_json(const api_limits_t *lim, const api_model_card_t *card) {
    if (!lim || !card || !lim->model_name || lim->n_sizes < 1 || !card->geom || !card->family ||
        !card->segment_name)
        return NULL;
    cJSON *root = cJSON_CreateObject();
    int ok = add_str(root, "object", "list");
    cJSON *data = cJSON_AddArrayToObject(root, "data");
    cJSON *m = cJSON_CreateObject();
    ok &= data != NULL && m != NULL && cJSON_AddItemToArray(data, m);
    if (!ok) {
        cJSON_Delete(m);
        return print_and_delete(root, 0);
    }
    ok &= add_str(m, "id", lim->model_name);
    ok &= add_str(m, "object", "model");
    ok &= add_num(m, "created", (double)card->created);
    ok &= add_str(m, "owned_by", "arserve");
    if (lim->num_classes > 0) {
        ok &= add_num(m, "num_classes", lim->num_classes);
        cJSON *names = lim->class_names ? cJSON_AddArrayToObject(m, "classes") : NULL;
        ok &= !lim->class_names || names != NULL;
        for (int i = 0; ok && names && i < lim->num_classes; i++) {
            cJSON *n = cJSON_CreateString(lim->class_names[i]);
            ok &= n != NULL && cJSON_AddItemToArray(names, n);
        }
    }
    ok &= add_model_card(m, lim, card);
    return print_and_delete(root, ok);
}

char *api_sse_progress_kv(int steps_done, int steps_total, int image_index,
                          const kv_policy_params_t *admitted) {
    if (steps_done < 0 || steps_total < 0 || image_index < 0)
        return NULL;
    cJSON *o = cJSON_CreateObject();
    int ok = add_str(o, "type", API_SSE_PROGRESS);
    ok &= add_num(o, "image_index", image_index);
    ok &= add_num(o, "steps_done", steps_done);
    ok &= add_num(o, "steps_total", steps_total);
    if (admitted) {
        cJSON *k = cJSON_AddObjectToObject(o, "kv_cache");
        ok &= k && add_str(k, "policy", kv_policy_name(admitted->kind));
        if (k && admitted->kind != KV_POLICY_FULL)
            ok &= add_num(k, "budget", admitted->budget);
    }
    return print_and_delete(o, ok);
}

char *api_sse_progress(int steps_done, int steps_total, int image_index) {
    return api_sse_progress_kv(steps_done, steps_total, image_index, NULL);
}

/* The members partial and completed events share after b64_json. */
static int add_image_event_common(cJSON *o, long created_at, int width, int height) {
    int ok = add_num(o, "created_at", (double)created_at);
    ok &= add_size(o, width, height);
    ok &= add_str(o, "quality", "auto");
    ok &= add_str(o, "background", "opaque");
    ok &= add_str(o, "output_format", "png");
    return ok;
}

char *api_sse_partial_image(const char *b64, int partial_image_index, int image_index,
                            long created_at, int width, int height) {
    if (!b64 || partial_image_index < 0 || image_index < 0)
        return NULL;
    cJSON *o = cJSON_CreateObject();
    int ok = add_str(o, "type", API_SSE_PARTIAL_IMAGE);
    ok &= add_str(o, "b64_json", b64);
    ok &= add_num(o, "partial_image_index", partial_image_index);
    ok &= add_image_event_common(o, created_at, width, height);
    ok &= add_num(o, "image_index", image_index);
    return print_and_delete(o, ok);
}

char *api_sse_completed(const char *b64, int image_index, long created_at, int width, int height,
                        int image_tokens, int prompt_tokens, const api_kv_report_t *kv,
                        const api_timings_t *timings, const char *warnings) {
    if (!b64 || image_index < 0 || image_tokens < 0 || prompt_tokens < 0)
        return NULL;
    cJSON *o = cJSON_CreateObject();
    int ok = add_str(o, "type", API_SSE_COMPLETED);
    ok &= add_str(o, "b64_json", b64);
    ok &= add_image_event_common(o, created_at, width, height);
    ok &= add_usage(o, image_tokens, prompt_tokens);
    ok &= add_num(o, "image_index", image_index);
    if (kv)
        ok &= add_kv_report(o, kv);
    if (timings)
        ok &= add_timings(o, timings);
    ok &= add_warnings(o, warnings);
    return print_and_delete(o, ok);
}

char *api_sse_frame(const char *event, const char *json) {
    if (!event || !json || !event[0] || strpbrk(event, "\r\n"))
        return NULL;
    /* SSE readers end a line at CRLF, CR or LF alike, so each of them in
     * json starts another data line; a raw CR left inside one would end it
     * early and let the rest be read as a field of its own. */
    size_t event_len = strlen(event), json_len = strlen(json), lines = 1;
    for (const char *p = json; *p; p++)
        lines += *p == '\n' || (*p == '\r' && p[1] != '\n');
    /* "event: " EVENT "\n", then per line "data: " LINE "\n", then "\n" and NUL */
    char *out = malloc(7 + event_len + 1 + lines * 7 + json_len + 2);
    if (!out)
        return NULL;
    char *w = out;
    memcpy(w, "event: ", 7);
    memcpy(w + 7, event, event_len);
    w += 7 + event_len;
    *w++ = '\n';
    const char *line = json;
    for (;;) {
        size_t k = strcspn(line, "\r\n");
        memcpy(w, "data: ", 6);
        memcpy(w + 6, line, k);
        w += 6 + k;
        *w++ = '\n';
        if (!line[k])
            break;
        line += k + (line[k] == '\r' && line[k + 1] == '\n' ? 2 : 1);
    }
    *w++ = '\n';
    *w = 0;
    return out;
}

char *api_base64(const uint8_t *buf, size_t n) {
    static const char alphabet[] =
        "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    if (!buf && n > 0)
        return NULL;
    if (n / 3 >= (SIZE_MAX - 1) / 4 - 1)
        return NULL;
    size_t out_len = (n + 2) / 3 * 4;
    char *out = malloc(out_len + 1);
    if (!out)
        return NULL;
    char *w = out;
    size_t i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)buf[i] << 16 | (uint32_t)buf[i + 1] << 8 | buf[i + 2];
        *w++ = alphabet[v >> 18];
        *w++ = alphabet[(v >> 12) & 63];
        *w++ = alphabet[(v >> 6) & 63];
        *w++ = alphabet[v & 63];
    }
    if (i < n) { /* one or two bytes left: pad to a full quantum */
        uint32_t v = (uint32_t)buf[i] << 16 | (i + 1 < n ? (uint32_t)buf[i + 1] << 8 : 0);
        *w++ = alphabet[v >> 18];
        *w++ = alphabet[(v >> 12) & 63];
        *w++ = i + 1 < n ? alphabet[(v >> 6) & 63] : '=';
        *w++ = '=';
    }
    *w = 0;
    return out;
}
