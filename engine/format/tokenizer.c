/* Hugging Face tokenizer.json, WordLevel and BPE models: split added tokens
 * out of the text, normalise, pre-tokenise into words (PCRE2 regexes for
 * Split, Whitespace and ByteLevel), then look each word up (WordLevel) or
 * merge it by rank (BPE, a heap over a linked list of symbols, as HF does).
 * Contract and HF differences: tokenizer.h. */
#include "engine/format/tokenizer.h"

#include "base/file.h"
#include "engine/format/json_strict.h"
#include "engine/format/tokenizer_unigram.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

/* The largest tokenizer.json read: the released ones are 2 to 35 MB. */
#define TOKENIZER_MAX_FILE_BYTES ((size_t)256 << 20)
#define TOKENIZER_MAX_NORM_STEPS 16
#define TOKENIZER_MAX_PRE_STEPS 16
#define TOKENIZER_MAX_NESTING 4
/* continuing_subword_prefix and end_of_word_suffix longer than this are
 * refused: a symbol's lookup key is built in a fixed buffer. */
#define TOKENIZER_MAX_AFFIX_BYTES 32
/* Words are quoted in error messages up to this many bytes. */
#define TOKENIZER_QUOTE_BYTES 48
/* PCRE2's JIT stack grows up to this much per match (the default, 32 KiB,
 * runs out on long runs of whitespace with \s+(?!\S)). */
#define TOKENIZER_JIT_STACK_MAX ((size_t)8 << 20)

/* HF's Whitespace pre-tokenizer is the Oniguruma regex \w+|[^\w\s]+, whose
 * Unicode \w is Alphabetic, marks, decimal digits, connector punctuation and
 * Join_Control; PCRE2's \w is narrower (letters and numbers), so the classes
 * are spelt out. */
#define WORD_CLASS "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}"
static const char WHITESPACE_REGEX[] = "[" WORD_CLASS "]+|[^" WORD_CLASS "\\s]+";
/* GPT-2's regex, what ByteLevel splits with when use_regex is true. */
static const char GPT2_REGEX[] =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";

/* ---- hash table: (bytes, length) -> id; linear probing, never deletes ---- */

typedef struct tok_slot {
    const char *text; /* NULL: empty slot; not owned */
    size_t len;
    int id;
} tok_slot_t;

typedef struct tok_table {
    tok_slot_t *slots;
    size_t mask; /* capacity - 1; capacity is a power of two */
    size_t count;
} tok_table_t;

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 14695981039346656037ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 1099511628211ull;
    }
    return h;
}

/* Sized for n entries at a load factor of at most one half. */
static int table_init(tok_table_t *tb, size_t n) {
    size_t cap = 16;
    while (cap < 2 * n + 1)
        cap <<= 1;
    tb->slots = calloc(cap, sizeof *tb->slots);
    tb->mask = cap - 1;
    tb->count = 0;
    return tb->slots ? AR_OK : AR_ERR;
}

/* The slot holding (s, n), or the empty slot where it would go. */
static tok_slot_t *table_slot(const tok_table_t *tb, const char *s, size_t n) {
    size_t i = (size_t)hash_bytes(s, n) & tb->mask;
    for (;;) {
        tok_slot_t *slot = &tb->slots[i];
        if (!slot->text || (slot->len == n && memcmp(slot->text, s, n) == 0))
            return slot;
        i = (i + 1) & tb->mask;
    }
}

static int table_get(const tok_table_t *tb, const char *s, size_t n) {
    if (!tb->slots)
        return -1;
    const tok_slot_t *slot = table_slot(tb, s, n);
    return slot->text ? slot->id : -1;
}

/* ---- merge table: (left id, right id) -> (rank, merged id) ---- */

typedef struct merge_slot {
    uint64_t key; /* left << 32 | right; MERGE_EMPTY: empty slot */
    int rank;
    int new_id;
} merge_slot_t;

#define MERGE_EMPTY UINT64_MAX

typedef struct merge_table {
    merge_slot_t *slots;
    size_t mask;
} merge_table_t;

static uint64_t merge_key(int left, int right) {
    return (uint64_t)(uint32_t)left << 32 | (uint32_t)right;
}

static merge_slot_t *merge_slot(const merge_table_t *mt, uint64_t key) {
    size_t i = (size_t)((key * 0x9E3779B97F4A7C15ull) >> 17) & mt->mask;
    for (;;) {
        merge_slot_t *slot = &mt->slots[i];
        if (slot->key == key || slot->key == MERGE_EMPTY)
            return slot;
        i = (i + 1) & mt->mask;
    }
}

static const merge_slot_t *merge_get(const merge_table_t *mt, int left, int right) {
    if (!mt->slots)
        return NULL;
    const merge_slot_t *slot = merge_slot(mt, merge_key(left, right));
    return slot->key == MERGE_EMPTY ? NULL : slot;
}

/* ---- UTF-8 ---- */

/* Length of the well-formed UTF-8 sequence at s[0..n), or 0 if s starts an
 * ill-formed one; *bad gets the length of its maximal ill-formed prefix (at
 * least 1), the unit Python's errors="replace" and Rust's from_utf8_lossy
 * turn into one U+FFFD. */
static size_t utf8_valid_len(const unsigned char *s, size_t n, size_t *bad) {
    unsigned c = s[0];
    *bad = 1;
    if (c < 0x80)
        return 1;
    size_t need;
    unsigned lo = 0x80, hi = 0xBF;
    if (c >= 0xC2 && c <= 0xDF)
        need = 2;
    else if (c >= 0xE0 && c <= 0xEF) {
        need = 3;
        if (c == 0xE0)
            lo = 0xA0;
        else if (c == 0xED)
            hi = 0x9F;
    } else if (c >= 0xF0 && c <= 0xF4) {
        need = 4;
        if (c == 0xF0)
            lo = 0x90;
        else if (c == 0xF4)
            hi = 0x8F;
    } else
        return 0;
    for (size_t k = 1; k < need; k++) {
        if (k >= n || s[k] < lo || s[k] > hi) {
            *bad = k;
            return 0;
        }
        lo = 0x80, hi = 0xBF;
    }
    return need;
}

/* Byte length of the (valid) UTF-8 character starting with byte c. */
static size_t utf8_char_len(unsigned char c) {
    return c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
}

/* ---- growable byte buffer (tok_buf_t: tokenizer_unigram.h) ---- */

static int buf_reserve(tok_buf_t *b, size_t extra) {
    if (b->n + extra + 1 <= b->cap)
        return AR_OK;
    size_t cap = b->cap ? b->cap : 64;
    while (cap < b->n + extra + 1)
        cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p)
        return AR_ERR;
    b->p = p;
    b->cap = cap;
    return AR_OK;
}

int tok_buf_append(tok_buf_t *b, const void *s, size_t n) {
    if (buf_reserve(b, n) != AR_OK)
        return AR_ERR;
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
    return AR_OK;
}

/* Appends s[0..n) with each ill-formed UTF-8 subsequence replaced by U+FFFD. */
static int buf_append_lossy(tok_buf_t *b, const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0, run = 0, bad;
    while (i + run < n) {
        size_t len = utf8_valid_len(s + i + run, n - i - run, &bad);
        if (len) {
            run += len;
            continue;
        }
        if (tok_buf_append(b, s + i, run) != AR_OK || tok_buf_append(b, "\xEF\xBF\xBD", 3) != AR_OK)
            return AR_ERR;
        i += run + bad;
        run = 0;
    }
    return tok_buf_append(b, s + i, run);
}

static bool utf8_is_valid(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    size_t bad;
    for (size_t i = 0, len; i < n; i += len)
        if (!(len = utf8_valid_len(s + i, n - i, &bad)))
            return false;
    return true;
}

/* ---- whitespace (Rust's char::is_whitespace, which HF's Strip, WhitespaceSplit
 * and added tokens' lstrip/rstrip use) ---- */

/* Length of the whitespace character starting at s: ASCII \t\n\v\f\r and
 * space, plus the non-ASCII Unicode White_Space characters. 0 if s[0] does
 * not start one. */
static size_t space_len(const char *str, size_t n) {
    const unsigned char *s = (const unsigned char *)str;
    if (n == 0)
        return 0;
    if (s[0] == ' ' || (s[0] >= '\t' && s[0] <= '\r'))
        return 1;
    if (n >= 2 && s[0] == 0xC2 && (s[1] == 0x85 || s[1] == 0xA0))
        return 2; /* U+0085, U+00A0 */
    if (n < 3)
        return 0;
    if (s[0] == 0xE1 && s[1] == 0x9A && s[2] == 0x80)
        return 3; /* U+1680 */
    if (s[0] == 0xE3 && s[1] == 0x80 && s[2] == 0x80)
        return 3; /* U+3000 */
    if (s[0] == 0xE2 && s[1] == 0x80) {
        unsigned c = s[2]; /* U+2000..U+200A, U+2028, U+2029, U+202F */
        if ((c >= 0x80 && c <= 0x8A) || c == 0xA8 || c == 0xA9 || c == 0xAF)
            return 3;
    }
    if (s[0] == 0xE2 && s[1] == 0x81 && s[2] == 0x9F)
        return 3; /* U+205F */
    return 0;
}

/* Length of the whitespace character ending at s + end, 0 if none. */
static size_t space_len_before(const char *s, size_t end) {
    for (size_t k = 1; k <= 3 && k <= end; k++)
        if (space_len(s + end - k, k) == k)
            return k;
    return 0;
}

/* \w for single_word added tokens: ASCII letters, digits and '_', and every
 * byte >= 0x80 (non-ASCII whitespace is caught by space_len first). */
static bool is_word_byte(unsigned char c) {
    return c >= 0x80 || c == '_' || (c >= '0' && c <= '9') ||
           ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
}

/* ---- the tokenizer ---- */

typedef enum {
    NORM_LOWERCASE,
    NORM_STRIP,
    NORM_REPLACE,
    NORM_PREPEND,
    NORM_PRECOMPILED
} norm_kind_t;

typedef struct norm_step {
    norm_kind_t kind;
    bool strip_left, strip_right; /* NORM_STRIP */
    char *pattern;                /* NORM_REPLACE: what is replaced (a String); owned */
    size_t pattern_len;
    pcre2_code *re;       /* NORM_REPLACE with a Regex pattern (then pattern is NULL) */
    charsmap_t *charsmap; /* NORM_PRECOMPILED */
    char *content;        /* NORM_REPLACE: the replacement; NORM_PREPEND: the prefix; owned */
    size_t content_len;
} norm_step_t;

typedef enum { PRE_SPLIT, PRE_WHITESPACE_SPLIT, PRE_BYTE_LEVEL, PRE_METASPACE } pre_kind_t;

/* HF's Metaspace PrependScheme. */
typedef enum { PREPEND_ALWAYS, PREPEND_FIRST, PREPEND_NEVER } prepend_scheme_t;

/* Metaspace's replacement character: up to 4 UTF-8 bytes. */
typedef struct metaspace {
    char rep[5];
    size_t rep_len;
    prepend_scheme_t prepend;
    bool split;
} metaspace_t;

/* HF's SplitDelimiterBehavior. */
typedef enum {
    SPLIT_REMOVED,
    SPLIT_ISOLATED,
    SPLIT_MERGED_WITH_PREVIOUS,
    SPLIT_MERGED_WITH_NEXT,
    SPLIT_CONTIGUOUS
} split_behavior_t;

typedef struct pre_step {
    pre_kind_t kind;
    /* PRE_SPLIT: the pattern, a compiled regex or a literal (owned); PRE_BYTE_LEVEL:
     * GPT-2's regex when use_regex, else NULL. */
    pcre2_code *re;
    char *literal;
    size_t literal_len;
    split_behavior_t behavior;
    bool invert;
    bool add_prefix_space; /* PRE_BYTE_LEVEL */
    metaspace_t metaspace; /* PRE_METASPACE */
} pre_step_t;

typedef enum { MODEL_WORD_LEVEL, MODEL_BPE, MODEL_UNIGRAM } model_kind_t;

typedef enum {
    DEC_JOIN_SPACES,
    DEC_BYTE_LEVEL,
    DEC_BPE,
    DEC_METASPACE,
    DEC_UNSUPPORTED
} decoder_kind_t;

typedef struct added_token {
    char *content; /* owned */
    int id;
    /* What is searched for: content, run through the normalizer when
     * normalized is set (as HF does); owned; may be empty (never matches). */
    char *match;
    size_t match_len;
    bool special, normalized, single_word, lstrip, rstrip;
} added_token_t;

struct tokenizer {
    char *path; /* for messages at encode time; owned */
    model_kind_t model;
    tok_table_t vocab; /* model.vocab; keys owned (freed through the slots) */
    int unk_id;        /* -1: none */
    char *unk_token;   /* BPE: model.unk_token, NULL if none; owned */
    /* BPE */
    merge_table_t merges;
    bool fuse_unk, byte_fallback, ignore_merges;
    char *prefix, *suffix; /* continuing_subword_prefix, end_of_word_suffix; owned, may be NULL */
    size_t prefix_len, suffix_len;
    int byte_id[256]; /* byte_fallback: the id of "<0xAB>", -1 if absent */
    norm_step_t norm[TOKENIZER_MAX_NORM_STEPS];
    int n_norm;
    /* No steps: the whole text is one word. */
    pre_step_t pre[TOKENIZER_MAX_PRE_STEPS];
    int n_pre;
    unigram_t *unigram; /* MODEL_UNIGRAM */
    decoder_kind_t decoder;
    metaspace_t decoder_metaspace; /* DEC_METASPACE */
    char decoder_type[48];         /* DEC_UNSUPPORTED: the type the file names */
    char *decoder_suffix;          /* DEC_BPE; owned */
    /* GPT-2's byte <-> character map: byte b is the UTF-8 string
     * byte_char[b] (byte_char_len[b] bytes); char_byte[c] is the byte of
     * code point c < 324, -1 if none. */
    char byte_char[256][2];
    unsigned char byte_char_len[256];
    short char_byte[324];
    /* Sorted by first byte, then longest first, so the first match found at a
     * position is the longest; added_first[b]..added_first[b + 1] are the
     * tokens starting with byte b. */
    added_token_t *added;
    int n_added;
    int added_first[257];
    tok_table_t added_index; /* content -> id */
    const char **id_text;    /* [vocab_size]; borrowed from vocab and added */
    bool *id_special;        /* [vocab_size]: a special added token */
    /* [vocab_size]: what decoding writes for an id: its text, but for added
     * tokens with normalized set their normalised content, as HF does. */
    const char **id_decode;
    int vocab_size;
};

static void quote_word(char *out, size_t out_size, const char *s, size_t n) {
    if (n > TOKENIZER_QUOTE_BYTES)
        snprintf(out, out_size, "%.*s...", TOKENIZER_QUOTE_BYTES, s);
    else
        snprintf(out, out_size, "%.*s", (int)n, s);
}

void tokenizer_free(tokenizer_t *t) {
    if (!t)
        return;
    if (t->vocab.slots) {
        for (size_t i = 0; i <= t->vocab.mask; i++)
            free((char *)t->vocab.slots[i].text);
        free(t->vocab.slots);
    }
    free(t->merges.slots);
    for (int i = 0; i < t->n_norm; i++) {
        free(t->norm[i].pattern);
        free(t->norm[i].content);
        pcre2_code_free(t->norm[i].re);
        charsmap_free(t->norm[i].charsmap);
    }
    unigram_free(t->unigram);
    for (int i = 0; i < t->n_pre; i++) {
        pcre2_code_free(t->pre[i].re);
        free(t->pre[i].literal);
    }
    for (int i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].match);
    }
    free(t->added);
    free(t->added_index.slots);
    free(t->id_text);
    free(t->id_special);
    free(t->id_decode);
    free(t->unk_token);
    free(t->prefix);
    free(t->suffix);
    free(t->decoder_suffix);
    free(t->path);
    free(t);
}

/* ---- GPT-2's byte-to-unicode map ---- */

/* Printable Latin-1 bytes ('!'..'~', U+00A1..U+00AC, U+00AE..U+00FF) stand for
 * themselves; the other 68 bytes, in order, take U+0100 onwards. */
static void byte_level_init(tokenizer_t *t) {
    int next = 256;
    for (int i = 0; i < 324; i++)
        t->char_byte[i] = -1;
    for (int b = 0; b < 256; b++) {
        bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
        int cp = printable ? b : next++;
        t->char_byte[cp] = (short)b;
        if (cp < 0x80) {
            t->byte_char[b][0] = (char)cp;
            t->byte_char_len[b] = 1;
        } else {
            t->byte_char[b][0] = (char)(0xC0 | (cp >> 6));
            t->byte_char[b][1] = (char)(0x80 | (cp & 0x3F));
            t->byte_char_len[b] = 2;
        }
    }
}

/* ---- loading ---- */

/* A JSON number that is a whole id in [0, TOKENIZER_MAX_ID], else -1. */
static int json_id(const cJSON *item) {
    if (!cJSON_IsNumber(item))
        return -1;
    double v = item->valuedouble;
    if (!(v >= 0 && v <= TOKENIZER_MAX_ID) || (double)(int)v != v)
        return -1;
    return (int)v;
}

/* An optional boolean member: absent or null leaves *out as is. */
static int json_opt_bool(const cJSON *obj, const char *key, bool *out, const char *path,
                         const char *where, ar_error_t *err) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    if (!item || cJSON_IsNull(item))
        return AR_OK;
    if (!cJSON_IsBool(item))
        return ar_errorf(err, "%s: %s.%s is not a boolean", path, where, key);
    *out = cJSON_IsTrue(item);
    return AR_OK;
}

/* An optional string member: absent or null gives *out = NULL; else a copy. */
static int json_opt_string(const cJSON *obj, const char *key, char **out, const char *path,
                           const char *where, ar_error_t *err) {
    const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
    *out = NULL;
    if (!item || cJSON_IsNull(item))
        return AR_OK;
    if (!cJSON_IsString(item))
        return ar_errorf(err, "%s: %s.%s is not a string", path, where, key);
    if (!(*out = strdup(item->valuestring)))
        return ar_errorf(err, "%s: out of memory", path);
    return AR_OK;
}

static const char *json_type_name(const cJSON *obj) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(type) ? type->valuestring : NULL;
}

/* Compiles a pattern as HF's Oniguruma would read it: UTF-8, Unicode
 * properties for \s \d \w and POSIX classes, ^ and $ at line ends (Ruby
 * syntax, which HF uses), newline = \n. JIT-compiled where PCRE2 has a JIT.
 * A pattern that can match the empty string is refused: HF's splits around
 * empty matches have rules of their own that we do not follow. */
static pcre2_code *regex_compile(const char *pattern, const char *path, const char *where,
                                 ar_error_t *err) {
    pcre2_compile_context *cctx = pcre2_compile_context_create(NULL);
    if (!cctx) {
        ar_errorf(err, "%s: out of memory compiling %s", path, where);
        return NULL;
    }
    pcre2_set_newline(cctx, PCRE2_NEWLINE_LF);
    int code;
    PCRE2_SIZE offset;
    pcre2_code *re = pcre2_compile((PCRE2_SPTR)pattern, PCRE2_ZERO_TERMINATED,
                                   PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &code, &offset, cctx);
    pcre2_compile_context_free(cctx);
    if (!re) {
        PCRE2_UCHAR why[160];
        pcre2_get_error_message(code, why, sizeof why);
        char quoted[TOKENIZER_QUOTE_BYTES + 8];
        quote_word(quoted, sizeof quoted, pattern, strlen(pattern));
        ar_errorf(err, "%s: %s: bad regex '%s' at offset %zu: %s", path, where, quoted,
                  (size_t)offset, (const char *)why);
        return NULL;
    }
    uint32_t min_len = 0;
    pcre2_pattern_info(re, PCRE2_INFO_MINLENGTH, &min_len);
    if (min_len == 0) {
        pcre2_code_free(re);
        ar_errorf(err, "%s: %s: regex '%s' can match the empty string, which is not supported",
                  path, where, pattern);
        return NULL;
    }
    (void)pcre2_jit_compile(re, PCRE2_JIT_COMPLETE); /* falls back to the interpreter */
    return re;
}

/* HF's Replace pattern, Split pattern: {"String": s} or {"Regex": r}. */
static int parse_pattern(const cJSON *node, const char **string, const char **regex,
                         const char *path, const char *where, ar_error_t *err) {
    const cJSON *pattern = cJSON_GetObjectItemCaseSensitive(node, "pattern");
    *string = *regex = NULL;
    const cJSON *s = cJSON_GetObjectItemCaseSensitive(pattern, "String");
    const cJSON *r = cJSON_GetObjectItemCaseSensitive(pattern, "Regex");
    if (cJSON_IsString(s))
        *string = s->valuestring;
    else if (cJSON_IsString(r))
        *regex = r->valuestring;
    else
        return ar_errorf(err, "%s: %s.pattern is not {\"String\": ...} or {\"Regex\": ...}", path,
                         where);
    return AR_OK;
}

/* A normalizer or pre-tokenizer at where: parses node (nested depth deep). */
typedef int (*component_parse_fn)(tokenizer_t *t, const cJSON *node, const char *where, int depth,
                                  const char *path, ar_error_t *err);

/* What every component (normalizer, pre-tokenizer) begins with: null is
 * none, a Sequence is its list (list_key; what names the kind in errors)
 * parsed child by child with parse. *type is then NULL (nothing left to
 * do); otherwise the component's type, for the caller. */
static int parse_component(tokenizer_t *t, const cJSON *node, const char *where, int depth,
                           const char *path, const char *list_key, const char *what,
                           component_parse_fn parse, const char **type, ar_error_t *err) {
    *type = NULL;
    if (!node || cJSON_IsNull(node))
        return AR_OK;
    if (!cJSON_IsObject(node))
        return ar_errorf(err, "%s: %s is not an object", path, where);
    const char *name = json_type_name(node);
    if (!name)
        return ar_errorf(err, "%s: %s.type is missing or not a string", path, where);
    if (strcmp(name, "Sequence") != 0) {
        *type = name;
        return AR_OK;
    }
    const cJSON *list = cJSON_GetObjectItemCaseSensitive(node, list_key);
    if (!cJSON_IsArray(list))
        return ar_errorf(err, "%s: %s.%s is missing or not an array", path, where, list_key);
    if (depth >= TOKENIZER_MAX_NESTING)
        return ar_errorf(err, "%s: %s: Sequence %s nested too deeply", path, where, what);
    int i = 0;
    const cJSON *child;
    cJSON_ArrayForEach(child, list) {
        char child_where[128];
        snprintf(child_where, sizeof child_where, "%s.%s[%d]", where, list_key, i++);
        if (parse(t, child, child_where, depth + 1, path, err) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

static int parse_normalizer(tokenizer_t *t, const cJSON *node, const char *where, int depth,
                            const char *path, ar_error_t *err) {
    const char *type;
    if (parse_component(t, node, where, depth, path, "normalizers", "normalizers", parse_normalizer,
                        &type, err) != AR_OK)
        return AR_ERR;
    if (!type)
        return AR_OK;
    if (strcmp(type, "NFC") == 0)
        return AR_OK; /* identity on what we handle; see tokenizer.h */
    if (t->n_norm == TOKENIZER_MAX_NORM_STEPS)
        return ar_errorf(err, "%s: more than %d normalizer steps", path, TOKENIZER_MAX_NORM_STEPS);
    norm_step_t *step = &t->norm[t->n_norm];
    *step = (norm_step_t){0};
    if (strcmp(type, "Lowercase") == 0) {
        step->kind = NORM_LOWERCASE;
    } else if (strcmp(type, "Strip") == 0) {
        step->kind = NORM_STRIP;
        step->strip_left = step->strip_right = true;
        if (json_opt_bool(node, "strip_left", &step->strip_left, path, where, err) != AR_OK ||
            json_opt_bool(node, "strip_right", &step->strip_right, path, where, err) != AR_OK)
            return AR_ERR;
    } else if (strcmp(type, "Replace") == 0) {
        const char *string, *regex;
        if (parse_pattern(node, &string, &regex, path, where, err) != AR_OK)
            return AR_ERR;
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(node, "content");
        if (!cJSON_IsString(content))
            return ar_errorf(err, "%s: %s.content is missing or not a string", path, where);
        step->kind = NORM_REPLACE;
        if (regex) {
            char re_where[160];
            snprintf(re_where, sizeof re_where, "%s.pattern.Regex", where);
            if (!(step->re = regex_compile(regex, path, re_where, err)))
                return AR_ERR;
        }
        step->pattern = regex ? NULL : strdup(string);
        step->content = strdup(content->valuestring);
        t->n_norm++; /* owned by t from here */
        if ((!regex && !step->pattern) || !step->content)
            return ar_errorf(err, "%s: out of memory", path);
        step->pattern_len = regex ? 0 : strlen(step->pattern);
        step->content_len = strlen(step->content);
        return AR_OK;
    } else if (strcmp(type, "Prepend") == 0) {
        const cJSON *prepend = cJSON_GetObjectItemCaseSensitive(node, "prepend");
        if (!cJSON_IsString(prepend))
            return ar_errorf(err, "%s: %s.prepend is missing or not a string", path, where);
        step->kind = NORM_PREPEND;
        step->content = strdup(prepend->valuestring);
        t->n_norm++;
        if (!step->content)
            return ar_errorf(err, "%s: out of memory", path);
        step->content_len = strlen(step->content);
        return AR_OK;
    } else if (strcmp(type, "Precompiled") == 0) {
        const cJSON *map = cJSON_GetObjectItemCaseSensitive(node, "precompiled_charsmap");
        if (!cJSON_IsString(map))
            return ar_errorf(err, "%s: %s.precompiled_charsmap is missing or not a string", path,
                             where);
        char map_where[160];
        snprintf(map_where, sizeof map_where, "%s.precompiled_charsmap", where);
        step->kind = NORM_PRECOMPILED;
        if (!(step->charsmap = charsmap_load(map->valuestring, path, map_where, err)))
            return AR_ERR;
    } else {
        return ar_errorf(err,
                         "%s: normalizer type '%s' is not supported (supported: Lowercase, "
                         "Strip, NFC, Replace, Prepend, Precompiled, or a Sequence of these)",
                         path, type);
    }
    t->n_norm++;
    return AR_OK;
}

static pre_step_t *pre_step_add(tokenizer_t *t, pre_kind_t kind, const char *path,
                                ar_error_t *err) {
    if (t->n_pre == TOKENIZER_MAX_PRE_STEPS) {
        ar_errorf(err, "%s: more than %d pre-tokenizer steps", path, TOKENIZER_MAX_PRE_STEPS);
        return NULL;
    }
    pre_step_t *step = &t->pre[t->n_pre++];
    *step = (pre_step_t){.kind = kind};
    return step;
}

static int parse_split(tokenizer_t *t, const cJSON *node, const char *where, const char *path,
                       ar_error_t *err) {
    static const char *const behaviors[] = {"Removed", "Isolated", "MergedWithPrevious",
                                            "MergedWithNext", "Contiguous"};
    const char *string, *regex;
    if (parse_pattern(node, &string, &regex, path, where, err) != AR_OK)
        return AR_ERR;
    const cJSON *behavior = cJSON_GetObjectItemCaseSensitive(node, "behavior");
    int b = -1;
    for (int i = 0; i < 5 && cJSON_IsString(behavior); i++)
        if (strcmp(behavior->valuestring, behaviors[i]) == 0)
            b = i;
    if (b < 0)
        return ar_errorf(err,
                         "%s: %s.behavior is missing or not one of Removed, Isolated, "
                         "MergedWithPrevious, MergedWithNext, Contiguous",
                         path, where);
    bool invert = false;
    if (json_opt_bool(node, "invert", &invert, path, where, err) != AR_OK)
        return AR_ERR;
    pre_step_t *step = pre_step_add(t, PRE_SPLIT, path, err);
    if (!step)
        return AR_ERR;
    step->behavior = (split_behavior_t)b;
    step->invert = invert;
    if (regex) {
        char re_where[160];
        snprintf(re_where, sizeof re_where, "%s.pattern.Regex", where);
        step->re = regex_compile(regex, path, re_where, err);
        return step->re ? AR_OK : AR_ERR;
    }
    /* An empty String pattern matches nothing in HF. */
    step->literal = strdup(string);
    step->literal_len = strlen(string);
    return step->literal ? AR_OK : ar_errorf(err, "%s: out of memory", path);
}

/* HF's Metaspace (pre-tokenizer and decoder alike): replacement, one
 * character; prepend_scheme "always" (the default), "first" or "never"; the
 * legacy add_prefix_space, where false means "never" and contradicts any
 * other declared scheme (HF refuses that file too); split (default true). */
static int parse_metaspace(const cJSON *node, const char *where, metaspace_t *ms, const char *path,
                           ar_error_t *err) {
    const cJSON *rep = cJSON_GetObjectItemCaseSensitive(node, "replacement");
    size_t len = cJSON_IsString(rep) ? strlen(rep->valuestring) : 0;
    if (len == 0 || len > 4 || utf8_char_len((unsigned char)rep->valuestring[0]) != len ||
        !utf8_is_valid(rep->valuestring, len))
        return ar_errorf(err, "%s: %s.replacement is missing or not one character", path, where);
    *ms = (metaspace_t){.rep_len = len, .prepend = PREPEND_ALWAYS, .split = true};
    memcpy(ms->rep, rep->valuestring, len);
    const cJSON *scheme = cJSON_GetObjectItemCaseSensitive(node, "prepend_scheme");
    if (scheme && !cJSON_IsNull(scheme)) {
        static const char *const names[] = {"always", "first", "never"};
        int k = -1;
        for (int i = 0; i < 3 && cJSON_IsString(scheme); i++)
            if (strcmp(scheme->valuestring, names[i]) == 0)
                k = i;
        if (k < 0)
            return ar_errorf(err, "%s: %s.prepend_scheme is not \"always\", \"first\" or \"never\"",
                             path, where);
        ms->prepend = (prepend_scheme_t)k;
    }
    bool add_prefix_space = true;
    const cJSON *aps = cJSON_GetObjectItemCaseSensitive(node, "add_prefix_space");
    if (json_opt_bool(node, "add_prefix_space", &add_prefix_space, path, where, err) != AR_OK ||
        json_opt_bool(node, "split", &ms->split, path, where, err) != AR_OK)
        return AR_ERR;
    if (aps && !cJSON_IsNull(aps) && !add_prefix_space) {
        if (ms->prepend != PREPEND_NEVER)
            return ar_errorf(err,
                             "%s: %s.add_prefix_space is false but prepend_scheme is not "
                             "\"never\" (HF refuses this too)",
                             path, where);
    }
    return AR_OK;
}

static int parse_pre_tokenizer(tokenizer_t *t, const cJSON *node, const char *where, int depth,
                               const char *path, ar_error_t *err) {
    const char *type;
    if (parse_component(t, node, where, depth, path, "pretokenizers", "pre-tokenizers",
                        parse_pre_tokenizer, &type, err) != AR_OK)
        return AR_ERR;
    if (!type)
        return AR_OK;
    if (strcmp(type, "Split") == 0)
        return parse_split(t, node, where, path, err);
    pre_step_t *step;
    if (strcmp(type, "Whitespace") == 0) {
        /* HF: the words are the regex's matches, the rest is dropped. */
        if (!(step = pre_step_add(t, PRE_SPLIT, path, err)))
            return AR_ERR;
        step->behavior = SPLIT_REMOVED;
        step->invert = true;
        step->re = regex_compile(WHITESPACE_REGEX, path, where, err);
        return step->re ? AR_OK : AR_ERR;
    }
    if (strcmp(type, "WhitespaceSplit") == 0)
        return pre_step_add(t, PRE_WHITESPACE_SPLIT, path, err) ? AR_OK : AR_ERR;
    if (strcmp(type, "Metaspace") == 0) {
        metaspace_t ms;
        if (parse_metaspace(node, where, &ms, path, err) != AR_OK ||
            !(step = pre_step_add(t, PRE_METASPACE, path, err)))
            return AR_ERR;
        step->metaspace = ms;
        return AR_OK;
    }
    if (strcmp(type, "Digits") == 0) {
        /* HF splits on char::is_numeric (Nd, Nl, No), each digit alone or in runs. */
        bool individual = false;
        if (json_opt_bool(node, "individual_digits", &individual, path, where, err) != AR_OK)
            return AR_ERR;
        if (!(step = pre_step_add(t, PRE_SPLIT, path, err)))
            return AR_ERR;
        step->behavior = individual ? SPLIT_ISOLATED : SPLIT_CONTIGUOUS;
        step->re = regex_compile("\\p{N}", path, where, err);
        return step->re ? AR_OK : AR_ERR;
    }
    if (strcmp(type, "ByteLevel") == 0) {
        bool add_prefix_space = true, use_regex = true;
        if (json_opt_bool(node, "add_prefix_space", &add_prefix_space, path, where, err) != AR_OK ||
            json_opt_bool(node, "use_regex", &use_regex, path, where, err) != AR_OK)
            return AR_ERR;
        if (!(step = pre_step_add(t, PRE_BYTE_LEVEL, path, err)))
            return AR_ERR;
        step->add_prefix_space = add_prefix_space;
        step->behavior = SPLIT_ISOLATED;
        if (use_regex && !(step->re = regex_compile(GPT2_REGEX, path, where, err)))
            return AR_ERR;
        return AR_OK;
    }
    return ar_errorf(err,
                     "%s: pre_tokenizer type '%s' is not supported (supported: Whitespace, "
                     "WhitespaceSplit, Split, Digits, ByteLevel, Metaspace, a Sequence of these, "
                     "null)",
                     path, type);
}

static int parse_decoder(tokenizer_t *t, const cJSON *node, const char *path, ar_error_t *err) {
    t->decoder = DEC_JOIN_SPACES;
    if (!node || cJSON_IsNull(node))
        return AR_OK;
    const char *type = cJSON_IsObject(node) ? json_type_name(node) : NULL;
    if (!type)
        return ar_errorf(err, "%s: decoder is not an object with a string type", path);
    if (strcmp(type, "ByteLevel") == 0) {
        t->decoder = DEC_BYTE_LEVEL;
    } else if (strcmp(type, "BPEDecoder") == 0) {
        t->decoder = DEC_BPE;
        if (json_opt_string(node, "suffix", &t->decoder_suffix, path, "decoder", err) != AR_OK)
            return AR_ERR;
        if (!t->decoder_suffix && !(t->decoder_suffix = strdup("</w>")))
            return ar_errorf(err, "%s: out of memory", path);
    } else if (strcmp(type, "Metaspace") == 0) {
        t->decoder = DEC_METASPACE;
        return parse_metaspace(node, "decoder", &t->decoder_metaspace, path, err);
    } else {
        /* Encoding does not need the decoder: tokenizer_decode refuses instead. */
        t->decoder = DEC_UNSUPPORTED;
        snprintf(t->decoder_type, sizeof t->decoder_type, "%s", type);
    }
    return AR_OK;
}

/* Fills t->vocab and a first id_text (sized for the vocab's largest id). */
static int parse_vocab(tokenizer_t *t, const cJSON *vocab, const char *path, ar_error_t *err) {
    if (!cJSON_IsObject(vocab))
        return ar_errorf(err, "%s: model.vocab is missing or not an object (word -> id)", path);
    int n = 0, max_id = -1;
    const cJSON *item;
    cJSON_ArrayForEach(item, vocab) {
        int id = json_id(item);
        if (id < 0)
            return ar_errorf(err, "%s: model.vocab['%s'] is not a whole number in [0, %d]", path,
                             item->string, TOKENIZER_MAX_ID);
        if (id > max_id)
            max_id = id;
        n++;
    }
    if (table_init(&t->vocab, (size_t)n) != AR_OK)
        return ar_errorf(err, "%s: out of memory for the vocab", path);
    t->vocab_size = max_id + 1;
    t->id_text = calloc((size_t)t->vocab_size + 1, sizeof *t->id_text);
    if (!t->id_text)
        return ar_errorf(err, "%s: out of memory for the vocab", path);
    cJSON_ArrayForEach(item, vocab) {
        const char *word = item->string;
        int id = (int)item->valuedouble;
        tok_slot_t *slot = table_slot(&t->vocab, word, strlen(word));
        if (slot->text)
            return ar_errorf(err, "%s: model.vocab has the word '%s' twice", path, word);
        if (t->id_text[id])
            return ar_errorf(err, "%s: model.vocab gives id %d to both '%s' and '%s'", path, id,
                             t->id_text[id], word);
        char *copy = strdup(word);
        if (!copy)
            return ar_errorf(err, "%s: out of memory for the vocab", path);
        *slot = (tok_slot_t){copy, strlen(copy), id};
        t->vocab.count++;
        t->id_text[id] = copy;
    }
    return AR_OK;
}

/* The file's text, for what cJSON does not keep: where each number is. */
typedef struct json_source {
    const char *text;
    size_t len;
} json_source_t;

/* Counts the numbers in node's tree that come before target in document
 * order (cJSON keeps it); true once target is reached. */
static bool numbers_before(const cJSON *node, const cJSON *target, size_t *count) {
    if (node == target)
        return true;
    if (cJSON_IsNumber(node))
        (*count)++;
    for (const cJSON *c = node->child; c; c = c->next)
        if (numbers_before(c, target, count))
            return true;
    return false;
}

/* The offset in src of the number after the first skip numbers (the text
 * passed json_strict_check, so strings and numbers are well formed). */
static const char *nth_number(const json_source_t *src, size_t skip, size_t *len) {
    const char *p = src->text, *end = src->text + src->len;
    while (p < end) {
        if (*p == '"') {
            for (p++; p < end && *p != '"'; p++)
                if (*p == '\\')
                    p++;
            p++;
        } else if (*p == '-' || (*p >= '0' && *p <= '9')) {
            size_t n = json_strict_number_len(p, (size_t)(end - p));
            if (skip-- == 0) {
                *len = n;
                return p;
            }
            p += n ? n : 1;
        } else {
            p++;
        }
    }
    return NULL;
}

/* The longest Unigram piece, and all pieces' bytes together: the piece trie
 * took 4.89 GB of RSS for one 100 MB piece (about 49 bytes per piece byte),
 * so these bound its memory (about 0.8 GB at most) whatever the file.
 * SentencePiece's pieces are at most 16 characters (T5's longest is 20
 * bytes; its 32,100 pieces hold 0.27 MB). */
#define UNIGRAM_MAX_PIECE_BYTES 256
#define UNIGRAM_MAX_PIECES_BYTES ((size_t)16 << 20)

/* A Unigram model: {"vocab": [[piece, score], ...], "unk_id": id or null,
 * "byte_fallback"}; ids are positions in vocab. A piece listed twice maps to
 * its last id, as in HF. Scores are read from the file's text as HF's
 * serde_json reads them (unigram_score_parse). */
static int parse_unigram(tokenizer_t *t, const cJSON *root, const cJSON *model,
                         const json_source_t *src, const char *path, ar_error_t *err) {
    const cJSON *vocab = cJSON_GetObjectItemCaseSensitive(model, "vocab");
    if (!cJSON_IsArray(vocab))
        return ar_errorf(err, "%s: model.vocab is missing or not an array of [piece, score]", path);
    int n = cJSON_GetArraySize(vocab);
    if (n > TOKENIZER_MAX_ID)
        return ar_errorf(err, "%s: model.vocab has %d pieces, more than %d", path, n,
                         TOKENIZER_MAX_ID);
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_id");
    t->unk_id = -1;
    if (unk && !cJSON_IsNull(unk)) {
        t->unk_id = json_id(unk);
        if (t->unk_id < 0)
            return ar_errorf(err, "%s: model.unk_id is not null or a whole number", path);
        if (t->unk_id >= n)
            return ar_errorf(err, "%s: model.unk_id %d is out of range: model.vocab has %d pieces",
                             path, t->unk_id, n);
    }
    bool byte_fallback = false;
    if (json_opt_bool(model, "byte_fallback", &byte_fallback, path, "model", err) != AR_OK)
        return AR_ERR;
    double *scores = malloc(((size_t)n + 1) * sizeof *scores);
    t->vocab_size = n;
    t->id_text = calloc((size_t)n + 1, sizeof *t->id_text);
    if (!scores || !t->id_text || table_init(&t->vocab, (size_t)n) != AR_OK) {
        free(scores);
        return ar_errorf(err, "%s: out of memory for the vocab", path);
    }
    size_t number_index = 0;
    numbers_before(root, vocab, &number_index);
    const char *number = nth_number(src, number_index, &(size_t){0});
    int id = 0;
    size_t piece_bytes = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, vocab) {
        const cJSON *piece = cJSON_GetArrayItem(item, 0), *score = cJSON_GetArrayItem(item, 1);
        if (!cJSON_IsArray(item) || cJSON_GetArraySize(item) != 2 || !cJSON_IsString(piece)) {
            free(scores);
            return ar_errorf(err, "%s: model.vocab[%d] is not [piece, score]", path, id);
        }
        const size_t len = strlen(piece->valuestring);
        if (len > UNIGRAM_MAX_PIECE_BYTES || (piece_bytes += len) > UNIGRAM_MAX_PIECES_BYTES) {
            free(scores);
            if (len > UNIGRAM_MAX_PIECE_BYTES)
                return ar_errorf(err,
                                 "%s: model.vocab[%d] is a piece of %zu bytes; pieces have at "
                                 "most %d (SentencePiece's, 16 characters)",
                                 path, id, len, UNIGRAM_MAX_PIECE_BYTES);
            return ar_errorf(err, "%s: model.vocab's pieces hold more than %zu MiB in all", path,
                             UNIGRAM_MAX_PIECES_BYTES >> 20);
        }
        /* Each earlier item held one number, so this score is the next in the text. */
        size_t number_len = 0;
        const char *at =
            number ? nth_number(&(json_source_t){number, src->len - (size_t)(number - src->text)},
                                0, &number_len)
                   : NULL;
        double value = 0;
        if (!cJSON_IsNumber(score) || !at || unigram_score_parse(at, number_len, &value) != AR_OK) {
            free(scores);
            return ar_errorf(err,
                             "%s: model.vocab[%d] ('%s'): the score is not a number in f64 range",
                             path, id, piece->valuestring);
        }
        number = at + number_len;
        const char *word = piece->valuestring;
        tok_slot_t *slot = table_slot(&t->vocab, word, strlen(word));
        if (slot->text) {
            slot->id = id; /* HF's map keeps the last id */
        } else {
            char *copy = strdup(word);
            if (!copy) {
                free(scores);
                return ar_errorf(err, "%s: out of memory for the vocab", path);
            }
            *slot = (tok_slot_t){copy, strlen(copy), id};
            t->vocab.count++;
        }
        t->id_text[id] = slot->text;
        scores[id++] = value;
    }
    t->unigram = unigram_new(t->id_text, scores, n, t->unk_id, byte_fallback, path, err);
    free(scores);
    return t->unigram ? AR_OK : AR_ERR;
}

/* model.merges: ["a b", ...] or [["a", "b"], ...]; rank = index; a later
 * duplicate of a pair replaces the earlier one (as HF's map does). */
static int parse_merges(tokenizer_t *t, const cJSON *list, const char *path, ar_error_t *err) {
    if (!list || cJSON_IsNull(list))
        return AR_OK;
    if (!cJSON_IsArray(list))
        return ar_errorf(err, "%s: model.merges is not an array", path);
    size_t n = (size_t)cJSON_GetArraySize(list), cap = 16;
    while (cap < 2 * n + 1)
        cap <<= 1;
    t->merges.slots = malloc(cap * sizeof *t->merges.slots);
    if (!t->merges.slots)
        return ar_errorf(err, "%s: out of memory for model.merges", path);
    t->merges.mask = cap - 1;
    for (size_t i = 0; i < cap; i++)
        t->merges.slots[i].key = MERGE_EMPTY;
    int rank = 0;
    const cJSON *item;
    tok_buf_t joined = {0};
    int rc = AR_OK;
    cJSON_ArrayForEach(item, list) {
        const char *a = NULL, *b = NULL;
        size_t a_len = 0, b_len = 0;
        if (cJSON_IsString(item)) {
            const char *s = item->valuestring, *space = strchr(s, ' ');
            if (space && space > s && space[1] && !strchr(space + 1, ' ')) {
                a = s, a_len = (size_t)(space - s);
                b = space + 1, b_len = strlen(b);
            }
        } else if (cJSON_IsArray(item) && cJSON_GetArraySize(item) == 2 &&
                   cJSON_IsString(cJSON_GetArrayItem(item, 0)) &&
                   cJSON_IsString(cJSON_GetArrayItem(item, 1))) {
            a = cJSON_GetArrayItem(item, 0)->valuestring, a_len = strlen(a);
            b = cJSON_GetArrayItem(item, 1)->valuestring, b_len = strlen(b);
        }
        if (!a) {
            rc = ar_errorf(err,
                           "%s: model.merges[%d] is not \"left right\" (one space) or "
                           "[\"left\", \"right\"]",
                           path, rank);
            break;
        }
        int left = table_get(&t->vocab, a, a_len), right = table_get(&t->vocab, b, b_len);
        if (left < 0 || right < 0) {
            const char *which = left < 0 ? a : b;
            size_t which_len = left < 0 ? a_len : b_len;
            rc = ar_errorf(err, "%s: model.merges[%d]: '%.*s' is not in model.vocab", path, rank,
                           (int)which_len, which);
            break;
        }
        /* HF drops continuing_subword_prefix from the right part. */
        if (t->prefix && b_len >= t->prefix_len && memcmp(b, t->prefix, t->prefix_len) == 0)
            b += t->prefix_len, b_len -= t->prefix_len;
        joined.n = 0;
        if (tok_buf_append(&joined, a, a_len) != AR_OK ||
            tok_buf_append(&joined, b, b_len) != AR_OK) {
            rc = ar_errorf(err, "%s: out of memory for model.merges", path);
            break;
        }
        int new_id = table_get(&t->vocab, joined.p, joined.n);
        if (new_id < 0) {
            rc = ar_errorf(err, "%s: model.merges[%d]: the merged token '%s' is not in model.vocab",
                           path, rank, joined.p);
            break;
        }
        merge_slot_t *slot = merge_slot(&t->merges, merge_key(left, right));
        *slot = (merge_slot_t){merge_key(left, right), rank, new_id};
        rank++;
    }
    free(joined.p);
    return rc;
}

static int parse_bpe(tokenizer_t *t, const cJSON *model, const char *path, ar_error_t *err) {
    const cJSON *dropout = cJSON_GetObjectItemCaseSensitive(model, "dropout");
    if (dropout && !cJSON_IsNull(dropout) &&
        !(cJSON_IsNumber(dropout) && dropout->valuedouble == 0))
        return ar_errorf(err,
                         "%s: model.dropout must be null or 0: BPE dropout makes encoding random, "
                         "which is not supported",
                         path);
    if (json_opt_bool(model, "fuse_unk", &t->fuse_unk, path, "model", err) != AR_OK ||
        json_opt_bool(model, "byte_fallback", &t->byte_fallback, path, "model", err) != AR_OK ||
        json_opt_bool(model, "ignore_merges", &t->ignore_merges, path, "model", err) != AR_OK ||
        json_opt_string(model, "unk_token", &t->unk_token, path, "model", err) != AR_OK ||
        json_opt_string(model, "continuing_subword_prefix", &t->prefix, path, "model", err) !=
            AR_OK ||
        json_opt_string(model, "end_of_word_suffix", &t->suffix, path, "model", err) != AR_OK)
        return AR_ERR;
    t->prefix_len = t->prefix ? strlen(t->prefix) : 0;
    t->suffix_len = t->suffix ? strlen(t->suffix) : 0;
    if (t->prefix_len > TOKENIZER_MAX_AFFIX_BYTES || t->suffix_len > TOKENIZER_MAX_AFFIX_BYTES)
        return ar_errorf(err,
                         "%s: model.continuing_subword_prefix or end_of_word_suffix is longer "
                         "than %d bytes",
                         path, TOKENIZER_MAX_AFFIX_BYTES);
    if (t->unk_token)
        t->unk_id = table_get(&t->vocab, t->unk_token, strlen(t->unk_token));
    for (int b = 0; b < 256; b++) {
        char name[8];
        snprintf(name, sizeof name, "<0x%02X>", b);
        t->byte_id[b] = table_get(&t->vocab, name, strlen(name));
    }
    return parse_merges(t, cJSON_GetObjectItemCaseSensitive(model, "merges"), path, err);
}

/* Replaces every occurrence of pat in b (left to right, not overlapping). */
static int replace_all(tok_buf_t *b, const char *pat, size_t pat_len, const char *with,
                       size_t with_len, tok_buf_t *tmp, size_t *first_at) {
    *first_at = SIZE_MAX;
    if (pat_len == 0 || b->n < pat_len)
        return AR_OK;
    tmp->n = 0;
    size_t i = 0;
    while (i < b->n) {
        const char *hit = memmem(b->p + i, b->n - i, pat, pat_len);
        size_t stop = hit ? (size_t)(hit - b->p) : b->n;
        if (hit && *first_at == SIZE_MAX)
            *first_at = stop;
        if (tok_buf_append(tmp, b->p + i, stop - i) != AR_OK)
            return AR_ERR;
        if (!hit)
            break;
        if (tok_buf_append(tmp, with, with_len) != AR_OK)
            return AR_ERR;
        i = stop + pat_len;
    }
    if (buf_reserve(tmp, 0) != AR_OK)
        return AR_ERR;
    tmp->p[tmp->n] = '\0';
    tok_buf_t swap = *b;
    *b = *tmp;
    *tmp = swap;
    return AR_OK;
}

/* Lowercase on ASCII and Latin-1 capitals U+00C0..U+00DE (not U+00D7), in place. */
static void lowercase(char *str, size_t n) {
    unsigned char *s = (unsigned char *)str;
    for (size_t i = 0; i < n; i++) {
        if (s[i] >= 'A' && s[i] <= 'Z') {
            s[i] += 'a' - 'A';
        } else if (s[i] == 0xC3 && i + 1 < n && s[i + 1] >= 0x80 && s[i + 1] <= 0x9E &&
                   s[i + 1] != 0x97) {
            s[i + 1] += 0x20;
            i++;
        }
    }
}

/* Replaces every match of re in b (left to right) with with[0..with_len).
 * *first_at: where the first match began, SIZE_MAX for none. */
static int replace_regex(tok_buf_t *b, const pcre2_code *re, const char *with, size_t with_len,
                         tok_buf_t *tmp, size_t *first_at) {
    *first_at = SIZE_MAX;
    pcre2_match_data *md = pcre2_match_data_create_from_pattern(re, NULL);
    if (!md)
        return AR_ERR;
    tmp->n = 0;
    int rc = buf_reserve(tmp, b->n);
    size_t from = 0;
    while (rc == AR_OK && from < b->n) {
        int found = pcre2_match(re, (PCRE2_SPTR)b->p, b->n, from, PCRE2_NO_UTF_CHECK, md, NULL);
        if (found <= 0)
            break; /* no match, or a matching error: the rest is kept */
        PCRE2_SIZE *ov = pcre2_get_ovector_pointer(md);
        if (ov[1] <= ov[0] || ov[0] < from)
            break; /* empty matches are refused at load; \K tricks end the scan */
        if (*first_at == SIZE_MAX)
            *first_at = ov[0];
        rc = tok_buf_append(tmp, b->p + from, ov[0] - from);
        if (rc == AR_OK)
            rc = tok_buf_append(tmp, with, with_len);
        from = ov[1];
    }
    pcre2_match_data_free(md);
    if (rc == AR_OK)
        rc = tok_buf_append(tmp, b->p + from, b->n - from);
    if (rc != AR_OK)
        return AR_ERR;
    tok_buf_t swap = *b;
    *b = *tmp;
    *tmp = swap;
    return AR_OK;
}

/* The bytes of b's first character, or 0 when empty. */
static size_t first_char_bytes(const tok_buf_t *b) {
    return b->n ? utf8_char_len((unsigned char)b->p[0]) : 0;
}

/* Applies the normalizer steps to s[0..n), leaving the result in out (tmp is
 * scratch). *origin_end (may be NULL): how many leading bytes of the result
 * stand at the text's original offset 0 in HF's alignments, which Metaspace's
 * prepend_scheme "first" asks of a piece split off it: the first character
 * of the text; stripped, or replaced by nothing, none; mapped by a charsmap,
 * as charsmap_normalize follows it. */
static int normalize(const tokenizer_t *t, const char *s, size_t n, tok_buf_t *out, tok_buf_t *tmp,
                     size_t *origin_end) {
    out->n = 0;
    if (tok_buf_append(out, s, n) != AR_OK)
        return AR_ERR;
    size_t origin = first_char_bytes(out);
    for (int k = 0; k < t->n_norm; k++) {
        const norm_step_t *step = &t->norm[k];
        size_t off = 0, len = out->n, sp, first_at;
        char *mapped = NULL;
        size_t mapped_len = 0;
        switch (step->kind) {
        case NORM_PRECOMPILED:
            if (charsmap_normalize(step->charsmap, out->p, out->n, &mapped, &mapped_len, origin,
                                   &origin) != AR_OK)
                return AR_ERR;
            free(out->p);
            *out = (tok_buf_t){mapped, mapped_len, mapped_len + 1};
            break;
        case NORM_LOWERCASE:
            lowercase(out->p, out->n); /* in place, each character's bytes kept */
            break;
        case NORM_STRIP:
            if (step->strip_left)
                while ((sp = space_len(out->p + off, len)))
                    off += sp, len -= sp;
            origin = off > 0 ? 0 : origin;
            if (step->strip_right)
                while ((sp = space_len_before(out->p + off, len)))
                    len -= sp;
            memmove(out->p, out->p + off, len);
            out->n = len;
            out->p[len] = '\0';
            break;
        case NORM_REPLACE:
            if ((step->re ? replace_regex(out, step->re, step->content, step->content_len, tmp,
                                          &first_at)
                          : replace_all(out, step->pattern, step->pattern_len, step->content,
                                        step->content_len, tmp, &first_at)) != AR_OK)
                return AR_ERR;
            /* A match within the bytes at offset 0 ends them there; one at
             * 0 leaves its content (inserted at 0), or nothing. */
            if (first_at < origin)
                origin = first_at > 0 ? first_at : step->content_len;
            break;
        case NORM_PREPEND:
            if (out->n == 0)
                break; /* HF prepends to non-empty text only */
            if (buf_reserve(out, step->content_len) != AR_OK)
                return AR_ERR;
            memmove(out->p + step->content_len, out->p, out->n);
            memcpy(out->p, step->content, step->content_len);
            out->n += step->content_len;
            out->p[out->n] = '\0';
            origin = origin ? origin + step->content_len : 0;
            break;
        }
    }
    if (origin_end)
        *origin_end = origin;
    return AR_OK;
}

/* Empty match strings sort last, past every bucket. */
static int added_first_byte(const added_token_t *a) {
    return a->match_len ? (unsigned char)a->match[0] : 256;
}

static int added_cmp(const void *pa, const void *pb) {
    const added_token_t *a = pa, *b = pb;
    int fa = added_first_byte(a), fb = added_first_byte(b);
    if (fa != fb)
        return fa < fb ? -1 : 1;
    if (a->match_len != b->match_len)
        return a->match_len > b->match_len ? -1 : 1;
    return 0;
}

/* Reads the fields of one added token (where: "added_tokens[i]") into tok,
 * and its content into *text. */
static int added_token_read(const cJSON *item, const char *where, const char *path,
                            added_token_t *tok, const char **text, ar_error_t *err) {
    if (!cJSON_IsObject(item))
        return ar_errorf(err, "%s: %s is not an object", path, where);
    const cJSON *content = cJSON_GetObjectItemCaseSensitive(item, "content");
    if (!cJSON_IsString(content))
        return ar_errorf(err, "%s: %s.content is missing or not a string", path, where);
    int id = json_id(cJSON_GetObjectItemCaseSensitive(item, "id"));
    if (id < 0)
        return ar_errorf(err, "%s: %s.id is missing or not a whole number in [0, %d]", path, where,
                         TOKENIZER_MAX_ID);
    *tok = (added_token_t){.id = id};
    if (json_opt_bool(item, "special", &tok->special, path, where, err) != AR_OK)
        return AR_ERR;
    tok->normalized = !tok->special;
    if (json_opt_bool(item, "normalized", &tok->normalized, path, where, err) != AR_OK ||
        json_opt_bool(item, "single_word", &tok->single_word, path, where, err) != AR_OK ||
        json_opt_bool(item, "lstrip", &tok->lstrip, path, where, err) != AR_OK ||
        json_opt_bool(item, "rstrip", &tok->rstrip, path, where, err) != AR_OK)
        return AR_ERR;
    *text = content->valuestring;
    return AR_OK;
}

/* added_token_check_id's answer for the same token listed again. */
enum { ADDED_REPEAT = 1 };

/* Checks that id is the one HF would give the added token text (len bytes):
 * the vocab's id if text is a vocab word, otherwise (vocab word count + number
 * of earlier added tokens that were not vocab words, *n_new), which is what
 * HF `tokenizers` 0.23 does whatever the file says. Returns AR_OK for a new
 * token (*slot: its empty place in added_index), ADDED_REPEAT for a harmless
 * repeat, AR_ERR for a file HF would read differently. */
static int added_token_check_id(tokenizer_t *t, const char *text, size_t len, int id, int *n_new,
                                tok_slot_t **slot, const char *path, ar_error_t *err) {
    *slot = table_slot(&t->added_index, text, len);
    if ((*slot)->text) {
        if ((*slot)->id == id)
            return ADDED_REPEAT;
        return ar_errorf(err, "%s: added token '%s' appears twice, with ids %d and %d", path, text,
                         (*slot)->id, id);
    }
    int vocab_id = table_get(&t->vocab, text, len);
    if (vocab_id >= 0) {
        if (vocab_id != id)
            return ar_errorf(err, "%s: added token '%s' has id %d, but model.vocab gives it id %d",
                             path, text, id, vocab_id);
        return AR_OK;
    }
    /* HF counts the model's vocab: for Unigram every listed piece, repeats too. */
    int base = t->model == MODEL_UNIGRAM ? t->vocab_size : (int)t->vocab.count;
    int expected = base + (*n_new)++;
    if (id != expected)
        return ar_errorf(err,
                         "%s: added token '%s' has id %d, but HF tokenizers would give "
                         "it id %d (added tokens outside model.vocab take the ids after "
                         "it, in order)",
                         path, text, id, expected);
    if (id < t->vocab_size && t->id_text[id])
        return ar_errorf(err, "%s: added token '%s' has id %d, which model.vocab gives to '%s'",
                         path, text, id, t->id_text[id]);
    return AR_OK;
}

/* Fills tok's content and match: text itself, or text run through the
 * normalizer when tok is normalized (norm and tmp: normalize's buffers, kept
 * from one token to the next). AR_ERR: out of memory (what was allocated is
 * in tok). */
static int added_token_match(const tokenizer_t *t, added_token_t *tok, const char *text, size_t len,
                             tok_buf_t *norm, tok_buf_t *tmp) {
    tok->content = strdup(text);
    tok->match = NULL;
    tok->match_len = len;
    if (!tok->content)
        return AR_ERR;
    if (!tok->normalized) {
        tok->match = strdup(text);
        return tok->match ? AR_OK : AR_ERR;
    }
    if (normalize(t, text, len, norm, tmp, NULL) != AR_OK)
        return AR_ERR;
    tok->match = norm->p;
    tok->match_len = norm->n;
    *norm = (tok_buf_t){0};
    return AR_OK;
}

/* Reads added_tokens[index] into t (n_new, norm, tmp: as above). */
static int added_token_add(tokenizer_t *t, const cJSON *item, int index, int *n_new,
                           tok_buf_t *norm, tok_buf_t *tmp, const char *path, ar_error_t *err) {
    char where[64];
    snprintf(where, sizeof where, "added_tokens[%d]", index);
    added_token_t tok;
    const char *text = NULL;
    if (added_token_read(item, where, path, &tok, &text, err) != AR_OK)
        return AR_ERR;
    size_t len = strlen(text);
    if (len == 0)
        return AR_OK; /* HF skips empty added tokens too */
    tok_slot_t *slot;
    int rc = added_token_check_id(t, text, len, tok.id, n_new, &slot, path, err);
    if (rc != AR_OK)
        return rc == ADDED_REPEAT ? AR_OK : AR_ERR;
    rc = added_token_match(t, &tok, text, len, norm, tmp);
    t->added[t->n_added++] = tok; /* owned by t from here, even on error */
    if (rc != AR_OK)
        return ar_errorf(err, "%s: out of memory for added_tokens", path);
    *slot = (tok_slot_t){tok.content, len, tok.id};
    t->added_index.count++;
    return AR_OK;
}

/* Points id_text at the added tokens' content, growing it to cover their
 * ids, and sorts them for matching (added_first). */
static int added_tokens_index(tokenizer_t *t, const char *path, ar_error_t *err) {
    int max_id = t->vocab_size - 1;
    for (int i = 0; i < t->n_added; i++)
        if (t->added[i].id > max_id)
            max_id = t->added[i].id;
    if (max_id + 1 > t->vocab_size) {
        const char **grown = realloc(t->id_text, ((size_t)max_id + 2) * sizeof *grown);
        if (!grown)
            return ar_errorf(err, "%s: out of memory for added_tokens", path);
        for (int i = t->vocab_size; i <= max_id + 1; i++)
            grown[i] = NULL;
        t->id_text = grown;
        t->vocab_size = max_id + 1;
    }
    qsort(t->added, (size_t)t->n_added, sizeof *t->added, added_cmp);
    for (int i = 0; i < t->n_added; i++)
        t->id_text[t->added[i].id] = t->added[i].content;
    int i = 0;
    for (int b = 0; b <= 256; b++) {
        while (i < t->n_added && added_first_byte(&t->added[i]) < b)
            i++;
        t->added_first[b] = i;
    }
    return AR_OK;
}

/* Reads added_tokens, each checked as added_token_check_id says. */
static int parse_added_tokens(tokenizer_t *t, const cJSON *list, const char *path,
                              ar_error_t *err) {
    if (!list || cJSON_IsNull(list))
        return AR_OK;
    if (!cJSON_IsArray(list))
        return ar_errorf(err, "%s: added_tokens is not an array", path);
    int n = cJSON_GetArraySize(list);
    t->added = calloc((size_t)n + 1, sizeof *t->added);
    if (!t->added || table_init(&t->added_index, (size_t)n) != AR_OK)
        return ar_errorf(err, "%s: out of memory for added_tokens", path);
    int rc = AR_OK, index = 0, n_new = 0;
    tok_buf_t norm = {0}, tmp = {0};
    const cJSON *item;
    cJSON_ArrayForEach(item, list) {
        if ((rc = added_token_add(t, item, index++, &n_new, &norm, &tmp, path, err)) != AR_OK)
            break;
    }
    free(norm.p);
    free(tmp.p);
    return rc == AR_OK ? added_tokens_index(t, path, err) : AR_ERR;
}

static int parse_root(tokenizer_t *t, const cJSON *root, const json_source_t *src, const char *path,
                      ar_error_t *err) {
    if (!cJSON_IsObject(root))
        return ar_errorf(err, "%s: top level is not a JSON object", path);
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return ar_errorf(err, "%s: 'model' is missing or not an object", path);
    const char *type = json_type_name(model);
    if (!type)
        return ar_errorf(err,
                         "%s: model.type is missing or not a string (expected 'WordLevel' or "
                         "'BPE')",
                         path);
    if (strcmp(type, "WordLevel") == 0)
        t->model = MODEL_WORD_LEVEL;
    else if (strcmp(type, "BPE") == 0)
        t->model = MODEL_BPE;
    else if (strcmp(type, "Unigram") == 0)
        t->model = MODEL_UNIGRAM;
    else
        return ar_errorf(err,
                         "%s: tokenizer model type '%s' is not supported (WordLevel, BPE and "
                         "Unigram are)",
                         path, type);
    t->unk_id = -1;
    if (t->model == MODEL_UNIGRAM) {
        if (parse_unigram(t, root, model, src, path, err) != AR_OK)
            return AR_ERR;
    } else if (parse_vocab(t, cJSON_GetObjectItemCaseSensitive(model, "vocab"), path, err) !=
               AR_OK) {
        return AR_ERR;
    }
    if (t->model == MODEL_BPE) {
        if (parse_bpe(t, model, path, err) != AR_OK)
            return AR_ERR;
    } else if (t->model == MODEL_WORD_LEVEL) {
        const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
        if (cJSON_IsString(unk))
            t->unk_id = table_get(&t->vocab, unk->valuestring, strlen(unk->valuestring));
        else if (unk && !cJSON_IsNull(unk))
            return ar_errorf(err, "%s: model.unk_token is not a string", path);
    }
    if (parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer", 0,
                         path, err) != AR_OK)
        return AR_ERR;
    if (parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"),
                            "pre_tokenizer", 0, path, err) != AR_OK)
        return AR_ERR;
    if (parse_decoder(t, cJSON_GetObjectItemCaseSensitive(root, "decoder"), path, err) != AR_OK)
        return AR_ERR;
    if (parse_added_tokens(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), path, err) !=
        AR_OK)
        return AR_ERR;
    t->id_special = calloc((size_t)t->vocab_size + 1, sizeof *t->id_special);
    t->id_decode = malloc(((size_t)t->vocab_size + 1) * sizeof *t->id_decode);
    if (!t->id_special || !t->id_decode)
        return ar_errorf(err, "%s: out of memory", path);
    memcpy(t->id_decode, t->id_text, (size_t)t->vocab_size * sizeof *t->id_decode);
    for (int i = 0; i < t->n_added; i++) {
        const added_token_t *a = &t->added[i];
        t->id_special[a->id] = a->special;
        if (a->normalized)
            t->id_decode[a->id] = a->match;
    }
    /* unk_id is a position in model.vocab: a vocab that lost its <unk>
     * shifts every later id, and unk_id then names an ordinary piece. */
    if (t->unigram && t->unk_id >= 0 && !t->id_special[t->unk_id] &&
        strcmp(t->id_text[t->unk_id], "<unk>") != 0)
        return ar_errorf(err,
                         "%s: model.unk_id %d names '%s', which is neither '<unk>' nor a special "
                         "token of added_tokens (has the vocab lost its unknown piece?)",
                         path, t->unk_id, t->id_text[t->unk_id]);
    return AR_OK;
}

tokenizer_t *tokenizer_load(const char *path, ar_error_t *err) {
    size_t len = 0;
    char *buf = file_read_all(path, NULL, TOKENIZER_MAX_FILE_BYTES, &len, err);
    if (!buf)
        return NULL;
    json_strict_fault_t fault;
    cJSON *root = json_parse_strict(buf, len, JSON_STRICT_DEFAULT_DEPTH, &fault, NULL);
    if (!root) {
        int line = 1, col = 1;
        for (const char *p = buf; p < buf + fault.offset && p < buf + len; p++, col++)
            if (*p == '\n')
                line++, col = 0;
        if (len == 0)
            ar_errorf(err, "%s: empty file, expected JSON", path);
        else if (fault.trailing)
            ar_errorf(err, "%s: unexpected data after the JSON value (byte %zu)", path,
                      fault.offset);
        else
            ar_errorf(err, "%s: invalid JSON at line %d, column %d: %s", path, line, col,
                      fault.why);
        free(buf);
        return NULL;
    }
    tokenizer_t *t = calloc(1, sizeof *t);
    if (!t || !(t->path = strdup(path))) {
        ar_errorf(err, "%s: out of memory", path);
        tokenizer_free(t);
        t = NULL;
    } else {
        byte_level_init(t);
        if (parse_root(t, root, &(json_source_t){buf, len}, path, err) != AR_OK) {
            tokenizer_free(t);
            t = NULL;
        }
    }
    cJSON_Delete(root);
    free(buf);
    return t;
}

/* ---- encoding ---- */

/* A BPE symbol: a token id over len bytes of the word, in a doubly linked
 * list (prev/next are indices, -1 at the ends); len 0 once merged away. */
typedef struct bpe_symbol {
    int id, prev, next;
    size_t len;
} bpe_symbol_t;

/* A candidate merge of the symbol at pos with its next one. */
typedef struct bpe_candidate {
    int rank, pos, new_id;
} bpe_candidate_t;

typedef struct encode_state {
    const tokenizer_t *t;
    int *ids;
    int max_ids;
    int count; /* ids needed so far; only the first max_ids are written */
    tok_buf_t norm, norm_tmp;
    /* BPE scratch, grown as words need */
    bpe_symbol_t *syms;
    bpe_candidate_t *heap;
    size_t syms_cap, heap_cap;
    pcre2_match_data *match;
    pcre2_match_context *mctx;
    pcre2_jit_stack *jit_stack;
    unigram_scratch_t unigram; /* Unigram scratch */
    tok_buf_t meta;            /* Metaspace's rewritten piece */
    /* Where a piece lies in the original text, for Metaspace's "first":
     * text is the start of the whole (UTF-8-cleaned) prompt, seg the start of
     * the normalised segment being pre-tokenised and seg_origin whether that
     * segment begins at the prompt's offset 0 (seg_origin_end: how many of
     * its leading normalised bytes stand there, normalize's origin_end). */
    const char *text, *seg;
    bool seg_origin;
    size_t seg_origin_end;
    struct unknown_list *unknown; /* tokenizer_unknown's; NULL for tokenizer_encode */
    ar_error_t *err;
} encode_state_t;

/* The text pieces no token spells, as tokenizer_unknown lists them:
 * 'piece', 'piece', ... in out (cap bytes), each once. Characters noted
 * one after another in the same buffer are one piece (the run). */
typedef struct unknown_list {
    char *out;
    size_t cap, used;
    int count; /* distinct pieces, listed or not */
    bool full; /* ", ..." written: no room for more */
    char run[TOKENIZER_QUOTE_BYTES + 1];
    size_t run_len;      /* bytes of the run (run holds the first QUOTE_BYTES) */
    const char *run_end; /* where the run ends in its buffer; NULL: no run */
} unknown_list_t;

/* The run, quoted, into the list unless listed already. */
static void unknown_flush(unknown_list_t *u) {
    if (!u || !u->run_end)
        return;
    char piece[TOKENIZER_QUOTE_BYTES + 8], quoted[TOKENIZER_QUOTE_BYTES + 12];
    quote_word(piece, sizeof piece, u->run, u->run_len);
    snprintf(quoted, sizeof quoted, "'%s'", piece);
    u->run_end = NULL;
    u->run_len = 0;
    if (u->used && strstr(u->out, quoted))
        return;
    u->count++;
    if (u->full)
        return;
    const char *sep = u->used ? ", " : "";
    if (u->used + strlen(sep) + strlen(quoted) + strlen(", ...") + 1 > u->cap) {
        if (u->used + strlen(", ...") + 1 <= u->cap)
            u->used += (size_t)snprintf(u->out + u->used, u->cap - u->used, ", ...");
        u->full = true;
        return;
    }
    u->used += (size_t)snprintf(u->out + u->used, u->cap - u->used, "%s%s", sep, quoted);
}

/* Notes s[0..n) as text the model cannot spell (when st lists them). */
static void note_unknown(encode_state_t *st, const char *s, size_t n) {
    unknown_list_t *u = st->unknown;
    if (!u || n == 0)
        return;
    if (u->run_end != s)
        unknown_flush(u);
    const size_t room = TOKENIZER_QUOTE_BYTES -
                        (u->run_len < TOKENIZER_QUOTE_BYTES ? u->run_len : TOKENIZER_QUOTE_BYTES);
    memcpy(u->run + (u->run_len < TOKENIZER_QUOTE_BYTES ? u->run_len : TOKENIZER_QUOTE_BYTES), s,
           n < room ? n : room);
    u->run_len += n;
    u->run_end = s + n;
}

typedef int (*segment_fn)(encode_state_t *st, const char *s, size_t n);

static void emit(encode_state_t *st, int id) {
    if (st->count < st->max_ids)
        st->ids[st->count] = id;
    st->count++;
}

static int encode_word_level(encode_state_t *st, const char *s, size_t n) {
    int id = table_get(&st->t->vocab, s, n);
    if (id < 0) {
        id = st->t->unk_id;
        note_unknown(st, s, n);
    }
    if (id < 0) {
        char word[TOKENIZER_QUOTE_BYTES + 8];
        quote_word(word, sizeof word, s, n);
        return ar_errorf(st->err,
                         "prompt word '%s' is not in the vocabulary and the tokenizer has no unk "
                         "token",
                         word);
    }
    emit(st, id);
    return AR_OK;
}

static bool candidate_less(const bpe_candidate_t *a, const bpe_candidate_t *b) {
    return a->rank != b->rank ? a->rank < b->rank : a->pos < b->pos;
}

static void heap_push(bpe_candidate_t *heap, size_t *n, bpe_candidate_t c) {
    size_t i = (*n)++;
    while (i > 0 && candidate_less(&c, &heap[(i - 1) / 2])) {
        heap[i] = heap[(i - 1) / 2];
        i = (i - 1) / 2;
    }
    heap[i] = c;
}

static bpe_candidate_t heap_pop(bpe_candidate_t *heap, size_t *n) {
    bpe_candidate_t top = heap[0], last = heap[--*n];
    size_t i = 0;
    for (;;) {
        size_t child = 2 * i + 1;
        if (child >= *n)
            break;
        if (child + 1 < *n && candidate_less(&heap[child + 1], &heap[child]))
            child++;
        if (!candidate_less(&heap[child], &last))
            break;
        heap[i] = heap[child];
        i = child;
    }
    heap[i] = last;
    return top;
}

static void push_candidate(const tokenizer_t *t, bpe_candidate_t *heap, size_t *n_heap,
                           const bpe_symbol_t *syms, int pos) {
    const merge_slot_t *m = merge_get(&t->merges, syms[pos].id, syms[syms[pos].next].id);
    if (m)
        heap_push(heap, n_heap, (bpe_candidate_t){m->rank, pos, m->new_id});
}

static int add_symbol(encode_state_t *st, size_t *n_syms, int id, size_t len) {
    if (*n_syms == st->syms_cap) {
        size_t cap = st->syms_cap ? 2 * st->syms_cap : 64;
        bpe_symbol_t *grown = realloc(st->syms, cap * sizeof *grown);
        if (!grown)
            return ar_errorf(st->err, "out of memory encoding a prompt");
        st->syms = grown;
        st->syms_cap = cap;
    }
    int i = (int)*n_syms;
    st->syms[i] = (bpe_symbol_t){id, i - 1, -1, len};
    if (i > 0)
        st->syms[i - 1].next = i;
    (*n_syms)++;
    return AR_OK;
}

/* HF's BPE on one word: each character (with continuing_subword_prefix
 * after the first, end_of_word_suffix on the last) becomes a symbol, or its
 * bytes' <0xAB> tokens (byte_fallback), or unk (fused runs with fuse_unk),
 * or nothing when there is no unk_token; then the lowest-ranked merge of two
 * neighbours is applied until none applies, leftmost first among equal
 * ranks. A heap of candidates over a linked list: O(n log n) in the word's
 * length, at most 3n candidates held. */
static int encode_bpe(encode_state_t *st, const char *s, size_t n) {
    const tokenizer_t *t = st->t;
    if (n == 0)
        return AR_OK;
    if (t->ignore_merges) {
        int id = table_get(&t->vocab, s, n);
        if (id >= 0) {
            emit(st, id);
            return AR_OK;
        }
    }
    size_t n_syms = 0, unk_len = 0;
    bool unk_pending = false;
    char key[TOKENIZER_MAX_AFFIX_BYTES * 2 + 8];
    for (size_t i = 0; i < n;) {
        size_t len = utf8_char_len((unsigned char)s[i]);
        if (len > n - i)
            len = n - i;
        size_t k = 0;
        if (i > 0 && t->prefix_len)
            memcpy(key, t->prefix, t->prefix_len), k = t->prefix_len;
        memcpy(key + k, s + i, len), k += len;
        if (i + len == n && t->suffix_len)
            memcpy(key + k, t->suffix, t->suffix_len), k += t->suffix_len;
        int id = table_get(&t->vocab, key, k);
        if (id >= 0) {
            if (unk_pending && add_symbol(st, &n_syms, t->unk_id, unk_len) != AR_OK)
                return AR_ERR;
            unk_pending = false;
            if (add_symbol(st, &n_syms, id, len) != AR_OK)
                return AR_ERR;
            i += len;
            continue;
        }
        bool bytes_known = t->byte_fallback;
        for (size_t b = 0; bytes_known && b < k; b++)
            bytes_known = t->byte_id[(unsigned char)key[b]] >= 0;
        if (bytes_known) {
            for (size_t b = 0; b < k; b++)
                if (add_symbol(st, &n_syms, t->byte_id[(unsigned char)key[b]], 1) != AR_OK)
                    return AR_ERR;
        } else if (t->unk_token) {
            if (t->unk_id < 0)
                return ar_errorf(st->err, "%s: model.unk_token '%s' is not in model.vocab", t->path,
                                 t->unk_token);
            note_unknown(st, s + i, len);
            if (unk_pending && t->fuse_unk) {
                unk_len += len;
            } else {
                if (unk_pending && add_symbol(st, &n_syms, t->unk_id, unk_len) != AR_OK)
                    return AR_ERR;
                unk_pending = true;
                unk_len = len;
            }
        } else {
            note_unknown(st, s + i, len); /* dropped, as HF drops it */
        }
        i += len;
    }
    if (unk_pending && add_symbol(st, &n_syms, t->unk_id, unk_len) != AR_OK)
        return AR_ERR;
    if (n_syms == 0)
        return AR_OK;
    /* Each merge pushes at most two candidates: n initial + 2n. */
    size_t need = 3 * n_syms;
    if (need > st->heap_cap) {
        bpe_candidate_t *grown = realloc(st->heap, need * sizeof *grown);
        if (!grown)
            return ar_errorf(st->err, "out of memory encoding a prompt");
        st->heap = grown;
        st->heap_cap = need;
    }
    bpe_symbol_t *syms = st->syms;
    size_t n_heap = 0;
    for (size_t i = 0; i + 1 < n_syms; i++)
        push_candidate(t, st->heap, &n_heap, syms, (int)i);
    while (n_heap > 0) {
        bpe_candidate_t top = heap_pop(st->heap, &n_heap);
        bpe_symbol_t *cur = &syms[top.pos];
        if (cur->len == 0 || cur->next < 0)
            continue;
        /* A stale candidate: the pair at pos has changed since it was pushed. */
        const merge_slot_t *m = merge_get(&t->merges, cur->id, syms[cur->next].id);
        if (!m || m->new_id != top.new_id)
            continue;
        bpe_symbol_t *right = &syms[cur->next];
        cur->id = top.new_id;
        cur->len += right->len;
        cur->next = right->next;
        right->len = 0;
        if (cur->next >= 0)
            syms[cur->next].prev = top.pos;
        if (cur->prev >= 0)
            push_candidate(t, st->heap, &n_heap, syms, cur->prev);
        if (cur->next >= 0)
            push_candidate(t, st->heap, &n_heap, syms, top.pos);
    }
    for (int i = 0; i >= 0; i = syms[i].next)
        emit(st, syms[i].id);
    return AR_OK;
}

static void emit_cb(void *ctx, int id, const char *unknown, size_t n) {
    if (unknown)
        note_unknown(ctx, unknown, n);
    emit(ctx, id);
}

static int encode_model(encode_state_t *st, const char *s, size_t n) {
    if (st->t->model == MODEL_BPE)
        return encode_bpe(st, s, n);
    if (st->t->model == MODEL_UNIGRAM)
        return unigram_encode(st->t->unigram, s, n, &st->unigram, emit_cb, st, st->err);
    return n ? encode_word_level(st, s, n) : AR_OK;
}

static int run_pre(encode_state_t *st, int step, const char *s, size_t n);

/* The [start, end) of the next match of step's pattern in s[0..n) at or after
 * from; 0 if none, AR_ERR on a matching error. */
static int find_match(encode_state_t *st, const pre_step_t *step, const char *s, size_t n,
                      size_t from, size_t *start, size_t *end) {
    if (!step->re) {
        if (step->literal_len == 0 || from >= n)
            return 0;
        const char *hit = memmem(s + from, n - from, step->literal, step->literal_len);
        if (!hit)
            return 0;
        *start = (size_t)(hit - s);
        *end = *start + step->literal_len;
        return 1;
    }
    if (!st->match) {
        st->match = pcre2_match_data_create(1, NULL);
        st->mctx = pcre2_match_context_create(NULL);
        st->jit_stack = pcre2_jit_stack_create(32 * 1024, TOKENIZER_JIT_STACK_MAX, NULL);
        if (!st->match || !st->mctx || !st->jit_stack)
            return ar_errorf(st->err, "out of memory encoding a prompt");
        pcre2_jit_stack_assign(st->mctx, NULL, st->jit_stack);
    }
    int rc = pcre2_match(step->re, (PCRE2_SPTR)s, n, from, PCRE2_NO_UTF_CHECK, st->match, st->mctx);
    if (rc == PCRE2_ERROR_NOMATCH)
        return 0;
    if (rc < 0) {
        PCRE2_UCHAR why[160];
        pcre2_get_error_message(rc, why, sizeof why);
        return ar_errorf(st->err, "%s: pre-tokenizer regex failed on the prompt: %s", st->t->path,
                         (const char *)why);
    }
    PCRE2_SIZE *ov = pcre2_get_ovector_pointer(st->match);
    *start = ov[0];
    *end = ov[1];
    if (*end <= *start || *start < from) /* \K or lookbehind tricks: skip a character */
        return ar_errorf(st->err, "%s: pre-tokenizer regex matched an empty string", st->t->path);
    return 1;
}

typedef struct split_piece {
    size_t start, end;
    bool is_match;
} split_piece_t;

/* HF's split with a SplitDelimiterBehavior: the text cut at the matches,
 * matches (or, with invert, the text between them) removed, kept alone or
 * glued to a neighbour; empty pieces are dropped; each piece goes on to the
 * next step. */
static int run_split(encode_state_t *st, int step_index, const char *s, size_t n) {
    const pre_step_t *step = &st->t->pre[step_index];
    split_piece_t *pieces = NULL;
    size_t n_pieces = 0, cap = 0, from = 0, start, end;
    int rc = AR_OK, found;
    for (;;) {
        found = from < n ? find_match(st, step, s, n, from, &start, &end) : 0;
        if (found < 0) {
            rc = AR_ERR;
            break;
        }
        if (n_pieces + 2 > cap) {
            cap = cap ? 2 * cap : 16;
            split_piece_t *grown = realloc(pieces, cap * sizeof *grown);
            if (!grown) {
                rc = ar_errorf(st->err, "out of memory encoding a prompt");
                break;
            }
            pieces = grown;
        }
        if (!found) {
            if (from < n)
                pieces[n_pieces++] = (split_piece_t){from, n, false};
            break;
        }
        if (start > from)
            pieces[n_pieces++] = (split_piece_t){from, start, false};
        pieces[n_pieces++] = (split_piece_t){start, end, true};
        from = end;
    }
    if (rc != AR_OK) {
        free(pieces);
        return rc;
    }
    size_t out = 0;
    bool previous_match = false;
    for (size_t i = 0; i < n_pieces; i++) {
        split_piece_t p = pieces[i];
        if (step->invert)
            p.is_match = !p.is_match;
        switch (step->behavior) {
        case SPLIT_REMOVED:
            if (!p.is_match)
                pieces[out++] = p;
            break;
        case SPLIT_ISOLATED:
            pieces[out++] = p;
            break;
        case SPLIT_MERGED_WITH_PREVIOUS:
            if (p.is_match && !previous_match && out > 0)
                pieces[out - 1].end = p.end;
            else
                pieces[out++] = p;
            break;
        case SPLIT_CONTIGUOUS:
            if (p.is_match == previous_match && out > 0)
                pieces[out - 1].end = p.end;
            else
                pieces[out++] = p;
            break;
        case SPLIT_MERGED_WITH_NEXT:
            pieces[out++] = p; /* merged below, right to left */
            break;
        }
        previous_match = p.is_match;
    }
    if (step->behavior == SPLIT_MERGED_WITH_NEXT) {
        /* Right to left: a match whose right neighbour is not a match joins
         * it. Results are written from the end of the array down, never
         * past the piece being read. */
        size_t keep = out;
        bool next_match = false;
        out = 0;
        for (size_t i = keep; i-- > 0;) {
            split_piece_t p = pieces[i];
            if (p.is_match && !next_match && out > 0)
                pieces[keep - out].start = p.start;
            else
                pieces[keep - 1 - out++] = p;
            next_match = p.is_match;
        }
        memmove(pieces, pieces + keep - out, out * sizeof *pieces);
    }
    for (size_t i = 0; i < out && rc == AR_OK; i++)
        if (pieces[i].end > pieces[i].start)
            rc = run_pre(st, step_index + 1, s + pieces[i].start, pieces[i].end - pieces[i].start);
    free(pieces);
    return rc;
}

/* WhitespaceSplit: the runs between whitespace characters. */
static int run_whitespace_split(encode_state_t *st, int step, const char *s, size_t n) {
    size_t i = 0, sp;
    while (i < n) {
        if ((sp = space_len(s + i, n - i))) {
            i += sp;
            continue;
        }
        size_t start = i;
        while (i < n && !space_len(s + i, n - i))
            i++;
        if (run_pre(st, step + 1, s + start, i - start) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
}

/* ByteLevel: a space in front unless there is one (add_prefix_space), the
 * GPT-2 regex's pieces (use_regex), each byte written as its GPT-2 character. */
static int run_byte_level(encode_state_t *st, int step_index, const char *s, size_t n) {
    const tokenizer_t *t = st->t;
    const pre_step_t *step = &t->pre[step_index];
    tok_buf_t text = {0}, mapped = {0};
    int rc = AR_OK;
    if (step->add_prefix_space && (n == 0 || s[0] != ' ')) {
        if (tok_buf_append(&text, " ", 1) != AR_OK || tok_buf_append(&text, s, n) != AR_OK) {
            free(text.p);
            return ar_errorf(st->err, "out of memory encoding a prompt");
        }
        s = text.p;
        n = text.n;
    }
    size_t from = 0, start, end;
    while (from < n && rc == AR_OK) {
        int found = 0;
        if (step->re && (found = find_match(st, step, s, n, from, &start, &end)) < 0) {
            rc = AR_ERR;
            break;
        }
        if (!found)
            start = end = n;
        /* Isolated: the text before the match, then the match. */
        size_t cuts[2][2] = {{from, start}, {start, end}};
        for (int c = 0; c < 2 && rc == AR_OK; c++) {
            if (cuts[c][1] <= cuts[c][0])
                continue;
            mapped.n = 0;
            for (size_t i = cuts[c][0]; i < cuts[c][1] && rc == AR_OK; i++) {
                unsigned char b = (unsigned char)s[i];
                if (tok_buf_append(&mapped, t->byte_char[b], t->byte_char_len[b]) != AR_OK)
                    rc = ar_errorf(st->err, "out of memory encoding a prompt");
            }
            if (rc == AR_OK)
                rc = run_pre(st, step_index + 1, mapped.p, mapped.n);
        }
        from = end;
    }
    free(text.p);
    free(mapped.p);
    return rc;
}

/* Metaspace: spaces become the replacement character, which is put in front
 * (prepend_scheme "always"; "first": only for the piece at the prompt's
 * offset 0) unless the piece starts with it; then, with split, a new piece
 * begins at each replacement character (HF's MergedWithNext). */
static int run_metaspace(encode_state_t *st, int step_index, const char *s, size_t n) {
    const metaspace_t *ms = &st->t->pre[step_index].metaspace;
    tok_buf_t *b = &st->meta;
    /* A piece is at offset 0 where HF's alignment of its first character is
     * (see tokenizer.h); the whole segment, before any split, always. */
    bool at_origin = st->seg_origin &&
                     (step_index == 0 ? s == st->seg
                                      : s >= st->seg && (size_t)(s - st->seg) < st->seg_origin_end);
    b->n = 0;
    int rc = buf_reserve(b, n + ms->rep_len);
    bool starts = n >= ms->rep_len && memcmp(s, ms->rep, ms->rep_len) == 0;
    bool leading_space = n > 0 && s[0] == ' ';
    if (!starts && !leading_space &&
        (ms->prepend == PREPEND_ALWAYS || (ms->prepend == PREPEND_FIRST && at_origin)))
        rc = tok_buf_append(b, ms->rep, ms->rep_len);
    for (size_t i = 0; i < n && rc == AR_OK; i++)
        rc = s[i] == ' ' ? tok_buf_append(b, ms->rep, ms->rep_len) : tok_buf_append(b, s + i, 1);
    if (rc != AR_OK)
        return ar_errorf(st->err, "out of memory encoding a prompt");
    /* The next steps may use st->meta again: work on a private copy. */
    char *text = b->p;
    size_t len = b->n;
    *b = (tok_buf_t){0};
    if (!ms->split) {
        rc = run_pre(st, step_index + 1, text, len);
    } else {
        size_t start = 0;
        for (size_t i = 1; i <= len && rc == AR_OK; i++) {
            if (i < len && (len - i < ms->rep_len || memcmp(text + i, ms->rep, ms->rep_len) != 0))
                continue;
            rc = run_pre(st, step_index + 1, text + start, i - start);
            start = i;
        }
    }
    if (!st->meta.p)
        st->meta = (tok_buf_t){text, 0, len + 1};
    else
        free(text);
    return rc;
}

/* Applies pre-tokenizer steps step.. to one piece; the model gets what the
 * last one gives. */
static int run_pre(encode_state_t *st, int step, const char *s, size_t n) {
    if (step == st->t->n_pre)
        return encode_model(st, s, n);
    switch (st->t->pre[step].kind) {
    case PRE_SPLIT:
        return run_split(st, step, s, n);
    case PRE_WHITESPACE_SPLIT:
        return run_whitespace_split(st, step, s, n);
    case PRE_BYTE_LEVEL:
        return run_byte_level(st, step, s, n);
    case PRE_METASPACE:
        return run_metaspace(st, step, s, n);
    }
    return AR_ERR;
}

static int pre_tokenize(encode_state_t *st, const char *s, size_t n) {
    if (n == 0)
        return AR_OK;
    return run_pre(st, 0, s, n);
}

/* Index into t->added of the longest token with the given `normalized` flag
 * that matches at s[0..n), or -1. */
static int match_added(const tokenizer_t *t, const char *s, size_t n, bool normalized) {
    unsigned char b = (unsigned char)s[0];
    for (int k = t->added_first[b]; k < t->added_first[b + 1]; k++) {
        const added_token_t *a = &t->added[k];
        if (a->normalized == normalized && a->match_len <= n &&
            memcmp(a->match, s, a->match_len) == 0)
            return k;
    }
    return -1;
}

static bool ends_with_word(const char *s, size_t end) {
    return end > 0 && !space_len_before(s, end) && is_word_byte((unsigned char)s[end - 1]);
}

static bool starts_with_word(const char *s, size_t n) {
    return n > 0 && !space_len(s, n) && is_word_byte((unsigned char)s[0]);
}

/* Emits the added tokens (of one `normalized` kind) found in s[0..n) and
 * hands the text between them to on_text, the way HF's AddedVocabulary does:
 * leftmost-longest matches; a single_word match inside a word is skipped;
 * lstrip/rstrip swallow neighbouring whitespace. */
static int split_added(encode_state_t *st, const char *s, size_t n, bool normalized,
                       segment_fn on_text) {
    const tokenizer_t *t = st->t;
    size_t seg = 0, i = 0;
    while (i < n) {
        int k = t->n_added ? match_added(t, s + i, n - i, normalized) : -1;
        if (k < 0) {
            i++;
            continue;
        }
        const added_token_t *a = &t->added[k];
        size_t start = i, stop = i + a->match_len, sp;
        i = stop;
        if (a->single_word && (ends_with_word(s, start) || starts_with_word(s + stop, n - stop)))
            continue;
        if (a->lstrip)
            while (start > seg && (sp = space_len_before(s, start)) && start - sp >= seg)
                start -= sp;
        if (a->rstrip)
            while ((sp = space_len(s + stop, n - stop)))
                stop += sp;
        if (start > seg && on_text(st, s + seg, start - seg) != AR_OK)
            return AR_ERR;
        emit(st, a->id);
        seg = i = stop;
    }
    return seg < n ? on_text(st, s + seg, n - seg) : AR_OK;
}

/* A raw segment between non-normalised added tokens: normalise a copy, then
 * split out normalised added tokens and pre-tokenise the rest. */
static int encode_raw_segment(encode_state_t *st, const char *s, size_t n) {
    const tokenizer_t *t = st->t;
    unknown_flush(st->unknown); /* the last segment's buffer is rewritten */
    st->seg_origin = s == st->text;
    st->seg_origin_end = n ? utf8_char_len((unsigned char)s[0]) : 0;
    if (t->n_norm == 0) {
        st->seg = s;
        return split_added(st, s, n, true, pre_tokenize);
    }
    if (normalize(t, s, n, &st->norm, &st->norm_tmp, &st->seg_origin_end) != AR_OK)
        return ar_errorf(st->err, "out of memory encoding a %zu-byte prompt", n);
    st->seg = st->norm.p;
    return split_added(st, st->norm.p, st->norm.n, true, pre_tokenize);
}

static int encode_text(const tokenizer_t *t, const char *text, int *ids, int max_ids, int *n_ids,
                       unknown_list_t *unknown, ar_error_t *err) {
    *n_ids = 0;
    if (!text)
        return ar_errorf(err, "prompt text is NULL");
    if (max_ids < 0 || (max_ids > 0 && !ids))
        return ar_errorf(err, "tokenizer_encode: bad output buffer (max_ids %d)", max_ids);
    size_t n = strlen(text);
    if (n > (size_t)INT32_MAX / 2)
        return ar_errorf(err, "prompt is %zu bytes, too long", n);
    encode_state_t st = {.t = t, .ids = ids, .max_ids = max_ids, .unknown = unknown, .err = err};
    tok_buf_t clean = {0};
    if (!utf8_is_valid(text, n)) {
        if (buf_append_lossy(&clean, text, n) != AR_OK) {
            free(clean.p);
            return ar_errorf(err, "out of memory encoding a %zu-byte prompt", n);
        }
        text = clean.p;
        n = clean.n;
    }
    st.text = text;
    int rc = split_added(&st, text, n, false, encode_raw_segment);
    unknown_flush(unknown);
    free(clean.p);
    free(st.meta.p);
    unigram_scratch_free(&st.unigram);
    free(st.norm.p);
    free(st.norm_tmp.p);
    free(st.syms);
    free(st.heap);
    pcre2_match_data_free(st.match);
    pcre2_match_context_free(st.mctx);
    pcre2_jit_stack_free(st.jit_stack);
    if (rc != AR_OK)
        return AR_ERR;
    if (st.count > max_ids) {
        *n_ids = st.count;
        return ar_errorf(err, "prompt is %d tokens, more than the limit %d", st.count, max_ids);
    }
    *n_ids = st.count;
    return AR_OK;
}

int tokenizer_encode(const tokenizer_t *t, const char *text, int *ids, int max_ids, int *n_ids,
                     ar_error_t *err) {
    return encode_text(t, text, ids, max_ids, n_ids, NULL, err);
}

int tokenizer_unknown(const tokenizer_t *t, const char *text, char *out, size_t cap,
                      ar_error_t *err) {
    unknown_list_t u = {.out = out, .cap = cap};
    if (!out || cap < 8)
        return ar_errorf(err, "tokenizer_unknown: bad output buffer (%zu bytes)", cap), -1;
    out[0] = 0;
    int n_ids;
    /* Ids are not kept (max_ids 0): only the count past the limit is an error. */
    if (encode_text(t, text, NULL, 0, &n_ids, &u, err) != AR_OK && n_ids == 0)
        return -1;
    return u.count;
}

/* ---- decoding ---- */

/* Code point of the UTF-8 character at s[0..n) (valid UTF-8 assumed). */
static uint32_t utf8_decode(const unsigned char *s, size_t len) {
    if (len == 1)
        return s[0];
    uint32_t cp = s[0] & (0x7F >> len);
    for (size_t k = 1; k < len; k++)
        cp = cp << 6 | (s[k] & 0x3F);
    return cp;
}

/* HF's ByteLevel decoder on one token: its characters mapped back to bytes,
 * or, if any character is not in the map, the token's own bytes. */
static int byte_level_token(const tokenizer_t *t, const char *tok, tok_buf_t *out) {
    size_t n = strlen(tok), mark = out->n;
    const unsigned char *s = (const unsigned char *)tok;
    for (size_t i = 0; i < n;) {
        size_t len = utf8_char_len(s[i]);
        if (len > n - i)
            len = n - i;
        uint32_t cp = utf8_decode(s + i, len);
        if (cp >= 324 || t->char_byte[cp] < 0) {
            out->n = mark;
            return tok_buf_append(out, tok, n);
        }
        unsigned char b = (unsigned char)t->char_byte[cp];
        if (tok_buf_append(out, &b, 1) != AR_OK)
            return AR_ERR;
        i += len;
    }
    return AR_OK;
}

int tokenizer_decode(const tokenizer_t *t, const int *ids, int n_ids, bool skip_special, char *out,
                     size_t cap, size_t *len, ar_error_t *err) {
    if (len)
        *len = 0;
    if (cap > 0)
        out[0] = '\0';
    if (n_ids < 0 || (n_ids > 0 && !ids))
        return ar_errorf(err, "tokenizer_decode: bad ids (n_ids %d)", n_ids);
    if (t->decoder == DEC_UNSUPPORTED)
        return ar_errorf(err,
                         "%s: decoder type '%s' is not supported (ByteLevel, BPEDecoder, "
                         "Metaspace and null are)",
                         t->path, t->decoder_type);
    int last = -1; /* the last token kept, for BPEDecoder */
    for (int i = 0; i < n_ids; i++) {
        const char *text = tokenizer_token_text(t, ids[i]);
        if (!text)
            return ar_errorf(err, "id %d is not a token of %s", ids[i], t->path);
        if (!(skip_special && t->id_special[ids[i]]))
            last = i;
    }
    tok_buf_t raw = {0}, text = {0};
    int rc = AR_OK;
    bool first = true;
    for (int i = 0; i < n_ids && rc == AR_OK; i++) {
        if (skip_special && t->id_special[ids[i]])
            continue;
        const char *tok = t->id_decode[ids[i]];
        if (t->decoder == DEC_BYTE_LEVEL) {
            rc = byte_level_token(t, tok, &raw);
        } else if (t->decoder == DEC_BPE) {
            /* Each end_of_word_suffix becomes a space, or nothing in the last token. */
            tok_buf_t one = {0}, tmp = {0};
            rc = tok_buf_append(&one, tok, strlen(tok));
            const char *sep = i == last ? "" : " ";
            size_t suffix_len = strlen(t->decoder_suffix), first_at;
            if (rc == AR_OK)
                rc = replace_all(&one, t->decoder_suffix, suffix_len, sep, strlen(sep), &tmp,
                                 &first_at);
            if (rc == AR_OK)
                rc = tok_buf_append(&raw, one.p, one.n);
            free(one.p);
            free(tmp.p);
        } else if (t->decoder == DEC_METASPACE) {
            /* Each replacement character becomes a space; in the first token
             * kept, every one is dropped unless prepend_scheme is "never". */
            const metaspace_t *ms = &t->decoder_metaspace;
            bool drop = first && ms->prepend != PREPEND_NEVER;
            for (const char *p = tok; *p && rc == AR_OK;) {
                if (strncmp(p, ms->rep, ms->rep_len) == 0) {
                    if (!drop)
                        rc = tok_buf_append(&raw, " ", 1);
                    p += ms->rep_len;
                } else {
                    rc = tok_buf_append(&raw, p++, 1);
                }
            }
        } else {
            if (!first)
                rc = tok_buf_append(&raw, " ", 1);
            if (rc == AR_OK)
                rc = tok_buf_append(&raw, tok, strlen(tok));
        }
        first = false;
    }
    if (rc == AR_OK)
        rc = buf_append_lossy(&text, raw.p ? raw.p : "", raw.n);
    free(raw.p);
    if (rc != AR_OK) {
        free(text.p);
        return ar_errorf(err, "out of memory decoding %d ids", n_ids);
    }
    if (len)
        *len = text.n;
    if (text.n + 1 > cap) {
        free(text.p);
        return ar_errorf(err, "decoded text is %zu bytes, more than the buffer's %zu", text.n,
                         cap ? cap - 1 : 0);
    }
    memcpy(out, text.p ? text.p : "", text.n);
    out[text.n] = '\0';
    free(text.p);
    return AR_OK;
}

int tokenizer_token_id(const tokenizer_t *t, const char *token) {
    size_t n = strlen(token);
    int id = table_get(&t->added_index, token, n);
    return id >= 0 ? id : table_get(&t->vocab, token, n);
}

int tokenizer_vocab_size(const tokenizer_t *t) { return t->vocab_size; }

int tokenizer_words(const tokenizer_t *t, const char **words, int cap) {
    if (t->model != MODEL_WORD_LEVEL)
        return 0;
    int n = 0;
    for (int id = 0; id < t->vocab_size; id++) {
        if (!t->id_text[id] || t->id_special[id] || id == t->unk_id)
            continue;
        if (n < cap)
            words[n] = t->id_text[id];
        n++;
    }
    return n;
}

const char *tokenizer_token_text(const tokenizer_t *t, int id) {
    return id >= 0 && id < t->vocab_size ? t->id_text[id] : NULL;
}
