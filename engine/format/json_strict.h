/* A strict RFC 8259 check in front of cJSON, which on its own accepts texts
 * RFC 8259 refuses (01, 1., trailing commas, any nesting up to 1000) and has
 * read past the end of a buffer on some of them (CVE-2023-53154). Every parse
 * of a file or request arserve did not write goes through json_parse_strict.
 * The check is one pass with an explicit depth stack: no recursion, no
 * allocation, O(len). */
#ifndef ARSERVE_JSON_STRICT_H
#define ARSERVE_JSON_STRICT_H

#include "base/status.h"

#include <stddef.h>

/* Nesting limit for the model, tokenizer, safetensors and config files: their
 * deepest legitimate nesting is about 6. */
#define JSON_STRICT_DEFAULT_DEPTH 64
/* The largest max_depth accepted: cJSON's own compiled-in CJSON_NESTING_LIMIT,
 * so every text the check accepts is one cJSON can hold. */
#define JSON_STRICT_MAX_DEPTH 1000
/* cJSON copies a number into a 64-byte buffer before strtod and fails on a
 * longer one; the check refuses those itself, with a message that says so. */
#define JSON_STRICT_MAX_NUMBER_CHARS 63

/* Where and why a text was refused. */
typedef struct json_strict_fault {
    size_t offset; /* byte offset of the fault, 0-based */
    int trailing;  /* 1: the value was complete and the fault is data after it */
    char why[112]; /* one phrase, e.g. "a number may not have a leading zero" */
} json_strict_fault_t;

/* Checks that text[0..len) is exactly one JSON text by RFC 8259:
 *  - one value, with only ' ', \t, \n and \r around it; one leading UTF-8 byte
 *    order mark is allowed (RFC 8259 8.1 lets a parser ignore it; cJSON
 *    skips it too). A NUL byte anywhere is refused;
 *  - numbers -?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?, at most
 *    JSON_STRICT_MAX_NUMBER_CHARS characters;
 *  - strings: no control character below 0x20, escapes \" \\ \/ \b \f \n \r \t
 *    and \uXXXX; valid UTF-8 (no overlong forms, no surrogates, nothing above
 *    U+10FFFF). Refused though RFC 8259's grammar allows them: \u0000 (cJSON
 *    would cut the string there) and an unpaired surrogate escape, high or
 *    low (cJSON refuses it, and it names no character);
 *  - literals true, false and null only; no trailing commas;
 *  - arrays and objects nested at most max_depth deep (a top-level array or
 *    object is depth 1), max_depth in 1..JSON_STRICT_MAX_DEPTH.
 * Returns AR_OK, or AR_ERR with *fault (may be NULL) saying where and why. */
int json_strict_check(const char *text, size_t len, int max_depth, json_strict_fault_t *fault);

/* Length of the RFC 8259 number at p (the grammar above, without the
 * JSON_STRICT_MAX_NUMBER_CHARS limit), of which avail bytes may be read; 0
 * when what is there is not a number. Whatever follows it is not looked at:
 * "12x" is a number of 2. */
size_t json_strict_number_len(const char *p, size_t avail);

/* What is wrong with a UTF-8 sequence (json_strict_utf8_len). */
typedef enum json_utf8_fault {
    JSON_UTF8_OK,
    JSON_UTF8_OVERLONG_LEAD, /* 0xC0 or 0xC1: only ever an overlong form */
    JSON_UTF8_NEVER,         /* 0xF5..0xFF never appear */
    JSON_UTF8_STRAY,         /* a continuation byte without a lead byte */
    JSON_UTF8_TRUNCATED,
    JSON_UTF8_SURROGATE, /* U+D800..DFFF encoded as UTF-8 */
    JSON_UTF8_ABOVE_MAX, /* above U+10FFFF */
    JSON_UTF8_OVERLONG,
} json_utf8_fault_t;

/* Length (1 to 4) of the well-formed UTF-8 sequence at p, of which avail
 * bytes may be read (Unicode 15, table 3-7); 0 when it is malformed, with
 * *fault (may be NULL) saying how. */
size_t json_strict_utf8_len(const unsigned char *p, size_t avail, json_utf8_fault_t *fault);

struct cJSON;

/* json_strict_check, then cJSON_ParseWithLengthOpts. Returns the parsed value
 * (the caller cJSON_Deletes it), or NULL with err (may be NULL) holding
 * "byte N: why" for the caller to prefix with its file, and *fault (may be
 * NULL) the same as json_strict_check's. text need not be NUL-terminated:
 * neither the check nor cJSON reads text[len]. */
struct cJSON *json_parse_strict(const char *text, size_t len, int max_depth,
                                json_strict_fault_t *fault, ar_error_t *err);

#endif
