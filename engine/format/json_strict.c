/* The strict RFC 8259 check in front of cJSON (json_strict.h): one pass over
 * the bytes with an explicit stack of open containers, one bit each, so a
 * hostile nesting depth costs neither stack frames nor allocations. */
#include "engine/format/json_strict.h"

#include <cjson/cJSON.h>

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

typedef struct scan {
    const unsigned char *p;
    size_t len, i;
    json_strict_fault_t *fault;
} scan_t;

/* Records the fault at byte `at` and returns AR_ERR. */
static int fail_at(scan_t *s, size_t at, int trailing, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static int fail_at(scan_t *s, size_t at, int trailing, const char *fmt, ...) {
    if (s->fault) {
        s->fault->offset = at;
        s->fault->trailing = trailing;
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(s->fault->why, sizeof s->fault->why, fmt, ap);
        va_end(ap);
    }
    return AR_ERR;
}

/* A byte as a message shows it: 'x', a NUL byte, or byte 0x8f. */
static const char *byte_name(unsigned char c, char buf[16]) {
    if (c == 0)
        snprintf(buf, 16, "a NUL byte");
    else if (c >= 0x20 && c < 0x7f)
        snprintf(buf, 16, "'%c'", c);
    else
        snprintf(buf, 16, "byte 0x%02x", c);
    return buf;
}

static int is_space(unsigned char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }
static int is_digit(unsigned char c) { return c >= '0' && c <= '9'; }

static void skip_space(scan_t *s) {
    while (s->i < s->len && is_space(s->p[s->i]))
        s->i++;
}

static int hex_value(unsigned char c) {
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

/* The code unit of "\uXXXX" at p[at..]; -1 when it is not one. */
static long u_escape(const scan_t *s, size_t at) {
    if (s->len - at < 6 || s->p[at] != '\\' || s->p[at + 1] != 'u')
        return -1;
    long v = 0;
    for (int k = 2; k < 6; k++) {
        int h = hex_value(s->p[at + k]);
        if (h < 0)
            return -1;
        v = v << 4 | h;
    }
    return v;
}

/* One escape sequence at s->i (the backslash); advances past it. */
static int scan_escape(scan_t *s) {
    size_t at = s->i;
    if (at + 1 >= s->len)
        return fail_at(s, at, 0, "unterminated string (it ends in a backslash)");
    unsigned char c = s->p[at + 1];
    if (c && strchr("\"\\/bfnrt", c)) {
        s->i += 2;
        return AR_OK;
    }
    char name[16];
    if (c != 'u')
        return fail_at(s, at, 0, "invalid escape: a backslash followed by %s", byte_name(c, name));
    long u = u_escape(s, at);
    if (u < 0)
        return fail_at(s, at, 0, "a \\u escape needs four hex digits");
    if (u == 0)
        return fail_at(s, at, 0, "\\u0000 is refused: cJSON would cut the string there");
    if (u >= 0xDC00 && u <= 0xDFFF)
        return fail_at(s, at, 0, "a low surrogate escape \\u%04lX without a high one before it",
                       (unsigned long)u);
    if (u >= 0xD800 && u <= 0xDBFF) {
        long lo = u_escape(s, at + 6);
        if (lo < 0xDC00 || lo > 0xDFFF)
            return fail_at(s, at, 0,
                           "a high surrogate escape \\u%04lX must be followed by a low one "
                           "(\\uDC00-\\uDFFF)",
                           (unsigned long)u);
        s->i += 12;
        return AR_OK;
    }
    s->i += 6;
    return AR_OK;
}

size_t json_strict_utf8_len(const unsigned char *p, size_t avail, json_utf8_fault_t *fault) {
    json_utf8_fault_t dummy;
    fault = fault ? fault : &dummy;
    *fault = JSON_UTF8_OK;
    const unsigned char c = p[0];
    if (c < 0x80)
        return 1;
    size_t n;
    unsigned char lo = 0x80, hi = 0xBF; /* the range of the second byte */
    if (c >= 0xC2 && c <= 0xDF) {
        n = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
        n = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        n = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else {
        *fault = c == 0xC0 || c == 0xC1 ? JSON_UTF8_OVERLONG_LEAD
                 : c >= 0xF5            ? JSON_UTF8_NEVER
                                        : JSON_UTF8_STRAY;
        return 0;
    }
    if (avail < 2 || p[1] < 0x80 || p[1] > 0xBF) {
        *fault = JSON_UTF8_TRUNCATED;
        return 0;
    }
    if (p[1] < lo || p[1] > hi) {
        *fault = c == 0xED   ? JSON_UTF8_SURROGATE
                 : c == 0xF4 ? JSON_UTF8_ABOVE_MAX
                             : JSON_UTF8_OVERLONG;
        return 0;
    }
    for (size_t k = 2; k < n; k++)
        if (avail <= k || p[k] < 0x80 || p[k] > 0xBF) {
            *fault = JSON_UTF8_TRUNCATED;
            return 0;
        }
    return n;
}

/* One UTF-8 sequence of two to four bytes at s->i; advances past it. */
static int scan_utf8(scan_t *s) {
    const unsigned char c = s->p[s->i];
    json_utf8_fault_t fault;
    const size_t n = json_strict_utf8_len(s->p + s->i, s->len - s->i, &fault);
    switch (fault) {
    case JSON_UTF8_OK:
        s->i += n;
        return AR_OK;
    case JSON_UTF8_OVERLONG_LEAD:
        return fail_at(s, s->i, 0, "invalid UTF-8: overlong encoding (lead byte 0x%02x)", c);
    case JSON_UTF8_NEVER:
        return fail_at(s, s->i, 0, "invalid UTF-8: byte 0x%02x never appears in UTF-8", c);
    case JSON_UTF8_STRAY:
        return fail_at(s, s->i, 0, "invalid UTF-8: continuation byte 0x%02x without a lead byte",
                       c);
    case JSON_UTF8_TRUNCATED:
        return fail_at(s, s->i, 0, "invalid UTF-8: truncated sequence");
    case JSON_UTF8_SURROGATE:
        return fail_at(s, s->i, 0, "invalid UTF-8: a surrogate (U+D800-U+DFFF) encoded as UTF-8");
    case JSON_UTF8_ABOVE_MAX:
        return fail_at(s, s->i, 0, "invalid UTF-8: a code point above U+10FFFF");
    case JSON_UTF8_OVERLONG:
        break;
    }
    return fail_at(s, s->i, 0, "invalid UTF-8: overlong encoding");
}

/* A string at s->i (the opening quote); advances past the closing quote. */
static int scan_string(scan_t *s) {
    size_t open = s->i++;
    while (s->i < s->len) {
        unsigned char c = s->p[s->i];
        if (c == '"') {
            s->i++;
            return AR_OK;
        }
        if (c == '\\') {
            if (scan_escape(s))
                return AR_ERR;
        } else if (c < 0x20) {
            char name[16];
            return fail_at(s, s->i, 0, "%s inside a string (control characters must be escaped)",
                           byte_name(c, name));
        } else if (c >= 0x80) {
            if (scan_utf8(s))
                return AR_ERR;
        } else {
            s->i++;
        }
    }
    return fail_at(s, open, 0, "unterminated string");
}

/* RFC 8259's number grammar from p[i] ('-' or a digit), without a length
 * limit: NUMBER_OK with the number's end in *at, or what is wrong with it
 * and the byte it is wrong at in *at. */
typedef enum number_fault {
    NUMBER_OK,
    NUMBER_BARE_MINUS,
    NUMBER_LEADING_ZERO,
    NUMBER_BARE_POINT,
    NUMBER_BARE_EXPONENT,
} number_fault_t;

static number_fault_t number_grammar(const unsigned char *p, size_t len, size_t i, size_t *at) {
    const size_t start = i;
    *at = start;
    if (i < len && p[i] == '-')
        i++;
    if (i >= len || !is_digit(p[i]))
        return NUMBER_BARE_MINUS;
    if (p[i] == '0') {
        i++;
        if (i < len && is_digit(p[i]))
            return NUMBER_LEADING_ZERO;
    } else {
        while (i < len && is_digit(p[i]))
            i++;
    }
    if (i < len && p[i] == '.') {
        *at = i++;
        if (i >= len || !is_digit(p[i]))
            return NUMBER_BARE_POINT;
        while (i < len && is_digit(p[i]))
            i++;
    }
    if (i < len && (p[i] == 'e' || p[i] == 'E')) {
        *at = i++;
        if (i < len && (p[i] == '+' || p[i] == '-'))
            i++;
        if (i >= len || !is_digit(p[i]))
            return NUMBER_BARE_EXPONENT;
        while (i < len && is_digit(p[i]))
            i++;
    }
    *at = i;
    return NUMBER_OK;
}

/* A number at s->i ('-' or a digit); advances past it. What follows it is
 * the caller's to judge, so "1x" fails as data after a value. */
static int scan_number(scan_t *s) {
    const size_t start = s->i;
    size_t at;
    switch (number_grammar(s->p, s->len, start, &at)) {
    case NUMBER_BARE_MINUS:
        return fail_at(s, at, 0, "a '-' must be followed by a digit");
    case NUMBER_LEADING_ZERO:
        return fail_at(s, at, 0, "a number may not have a leading zero");
    case NUMBER_BARE_POINT:
        return fail_at(s, at, 0, "a '.' in a number must be followed by a digit");
    case NUMBER_BARE_EXPONENT:
        return fail_at(s, at, 0, "an exponent must have a digit");
    case NUMBER_OK:
        break;
    }
    s->i = at;
    if (s->i - start > JSON_STRICT_MAX_NUMBER_CHARS)
        return fail_at(s, start, 0, "a number of %zu characters; at most %d are read", s->i - start,
                       JSON_STRICT_MAX_NUMBER_CHARS);
    return AR_OK;
}

size_t json_strict_number_len(const char *p, size_t avail) {
    size_t end;
    return p && number_grammar((const unsigned char *)p, avail, 0, &end) == NUMBER_OK ? end : 0;
}

/* Why the byte at s->i cannot start a value (the caller knows it cannot). */
static int not_a_value(scan_t *s) {
    if (s->i >= s->len)
        return fail_at(s, s->i, 0, "the text ends where a value is expected");
    unsigned char c = s->p[s->i];
    char name[16];
    if (c == '+')
        return fail_at(s, s->i, 0, "a number may not start with '+'");
    if (c == '.')
        return fail_at(s, s->i, 0, "a number must have a digit before its '.'");
    if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z'))
        return fail_at(s, s->i, 0, "not a value: the only literals are true, false and null");
    if (c == '\'')
        return fail_at(s, s->i, 0, "strings are quoted with '\"', not \"'\"");
    return fail_at(s, s->i, 0, "expected a value, found %s", byte_name(c, name));
}

static int scan_literal(scan_t *s) {
    static const char *const words[] = {"true", "false", "null"};
    for (int k = 0; k < 3; k++) {
        size_t n = strlen(words[k]);
        if (s->len - s->i >= n && memcmp(s->p + s->i, words[k], n) == 0) {
            s->i += n;
            return AR_OK;
        }
    }
    return not_a_value(s);
}

/* A member name and its ':', at s->i (after '{' or ','); advances past the
 * ':'. */
static int scan_member_name(scan_t *s, int first) {
    char name[16];
    if (s->i >= s->len)
        return fail_at(s, s->i, 0, "the text ends inside an object");
    if (s->p[s->i] != '"')
        return fail_at(s, s->i, 0, "expected a quoted member name%s, found %s",
                       first ? " or '}'" : "", byte_name(s->p[s->i], name));
    if (scan_string(s))
        return AR_ERR;
    skip_space(s);
    if (s->i >= s->len || s->p[s->i] != ':')
        return fail_at(s, s->i, 0, "expected ':' after a member name");
    s->i++;
    return AR_OK;
}

int json_strict_check(const char *text, size_t len, int max_depth, json_strict_fault_t *fault) {
    scan_t s = {(const unsigned char *)text, text ? len : 0, 0, fault};
    if (fault)
        memset(fault, 0, sizeof *fault);
    if (max_depth < 1 || max_depth > JSON_STRICT_MAX_DEPTH)
        return fail_at(&s, 0, 0, "max_depth %d is outside 1..%d", max_depth, JSON_STRICT_MAX_DEPTH);
    /* Bit d of `object` is 1 when the container at depth d + 1 is an object. */
    unsigned char object[JSON_STRICT_MAX_DEPTH / 8 + 1] = {0};
    int depth = 0;
    char name[16];
    if (s.len >= 3 && memcmp(s.p, "\xEF\xBB\xBF", 3) == 0)
        s.i = 3;
    skip_space(&s);
    if (s.i == s.len)
        return fail_at(&s, s.i, 0, "no JSON value: the text is empty or only whitespace");

    /* Each turn scans one value; containers push and come back here for their
     * members, so the loop, not the C stack, holds the nesting. */
    for (;;) {
        skip_space(&s);
        if (s.i >= s.len)
            return not_a_value(&s);
        unsigned char c = s.p[s.i];
        if (c == '{' || c == '[') {
            if (depth == max_depth)
                return fail_at(&s, s.i, 0, "arrays and objects nested deeper than %d levels",
                               max_depth);
            if (c == '{')
                object[depth / 8] |= (unsigned char)(1u << depth % 8);
            else
                object[depth / 8] &= (unsigned char)~(1u << depth % 8);
            depth++;
            s.i++;
            skip_space(&s);
            if (s.i < s.len && s.p[s.i] == (c == '{' ? '}' : ']')) {
                s.i++; /* empty: a complete value */
                depth--;
            } else {
                if (c == '{' && scan_member_name(&s, 1))
                    return AR_ERR;
                continue; /* to the first member's value */
            }
        } else if (c == '"') {
            if (scan_string(&s))
                return AR_ERR;
        } else if (c == '-' || is_digit(c)) {
            if (scan_number(&s))
                return AR_ERR;
        } else if (c == 't' || c == 'f' || c == 'n') {
            if (scan_literal(&s))
                return AR_ERR;
        } else {
            return not_a_value(&s);
        }

        /* A value is complete: close containers, or find the next member. */
        for (;;) {
            skip_space(&s);
            if (depth == 0) {
                if (s.i < s.len)
                    return fail_at(&s, s.i, 1, "unexpected data after the JSON value: %s",
                                   byte_name(s.p[s.i], name));
                return AR_OK;
            }
            int in_object = object[(depth - 1) / 8] >> (depth - 1) % 8 & 1;
            const char close = in_object ? '}' : ']';
            if (s.i >= s.len)
                return fail_at(&s, s.i, 0, "the text ends inside an %s",
                               in_object ? "object" : "array");
            c = s.p[s.i];
            if (c == close) {
                s.i++;
                depth--;
                continue;
            }
            if (c != ',')
                return fail_at(&s, s.i, 0, "expected ',' or '%c' after %s, found %s", close,
                               in_object ? "a member" : "an element", byte_name(c, name));
            size_t comma = s.i++;
            skip_space(&s);
            if (s.i < s.len && (s.p[s.i] == ']' || s.p[s.i] == '}'))
                return fail_at(&s, comma, 0, "a trailing comma before '%c'", s.p[s.i]);
            if (in_object && scan_member_name(&s, 0))
                return AR_ERR;
            break; /* to the next element's or member's value */
        }
    }
}

cJSON *json_parse_strict(const char *text, size_t len, int max_depth, json_strict_fault_t *fault,
                         ar_error_t *err) {
    json_strict_fault_t local;
    if (!fault)
        fault = &local;
    if (json_strict_check(text, len, max_depth, fault) != AR_OK) {
        ar_errorf(err, "byte %zu: %s", fault->offset, fault->why);
        return NULL;
    }
    /* cJSON 1.7.15 skips a byte order mark only in a text of five bytes or
     * more; skipping it here keeps "\xEF\xBB\xBF1" acceptable to both. */
    size_t bom = len >= 3 && memcmp(text, "\xEF\xBB\xBF", 3) == 0 ? 3 : 0;
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text + bom, len - bom, &end, 0);
    if (!root) {
        /* The check accepted the text, so only memory can be short here. */
        fault->offset = end && end >= text && end <= text + len ? (size_t)(end - text) : 0;
        fault->trailing = 0;
        snprintf(fault->why, sizeof fault->why, "cJSON could not parse it (out of memory?)");
        ar_errorf(err, "byte %zu: %s", fault->offset, fault->why);
        return NULL;
    }
    return root;
}
