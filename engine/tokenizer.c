/* Word-level tokenizer read from a Hugging Face tokenizer.json: split added
 * tokens out of the text, normalise, pre-tokenise into words, look each word
 * up in an open-addressing hash table. Contract and HF differences: tokenizer.h. */
#include "tokenizer.h"

#include "json_strict.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define TOKENIZER_MAX_FILE_BYTES ((size_t)1 << 30)
#define TOKENIZER_MAX_NORM_STEPS 16
#define TOKENIZER_MAX_NORM_DEPTH 4
/* Words are quoted in error messages up to this many bytes. */
#define TOKENIZER_QUOTE_BYTES 48

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

/* ---- byte classes ---- */

/* Length of the whitespace character starting at s: ASCII \t\n\v\f\r and
 * space, plus the non-ASCII Unicode White_Space characters (as Rust's
 * char::is_whitespace, which HF uses). 0 if s[0] does not start one. */
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

/* \w for our purposes: ASCII letters, digits and '_', and every byte >= 0x80
 * (non-ASCII whitespace is caught by space_len before this is asked). */
static bool is_word_byte(unsigned char c) {
    return c >= 0x80 || c == '_' || (c >= '0' && c <= '9') ||
           ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
}

enum { CLASS_SPACE, CLASS_WORD, CLASS_PUNCT };

/* Class of the character at s, and its length in bytes in *len. */
static int char_class(const char *s, size_t n, size_t *len) {
    size_t sp = space_len(s, n);
    if (sp) {
        *len = sp;
        return CLASS_SPACE;
    }
    *len = 1;
    return is_word_byte((unsigned char)s[0]) ? CLASS_WORD : CLASS_PUNCT;
}

/* ---- the tokenizer ---- */

typedef enum { NORM_LOWERCASE, NORM_STRIP } norm_kind_t;

typedef struct norm_step {
    norm_kind_t kind;
    bool strip_left, strip_right; /* NORM_STRIP */
} norm_step_t;

typedef enum { PRE_NONE, PRE_WHITESPACE, PRE_WHITESPACE_SPLIT } pre_kind_t;

typedef struct added_token {
    char *content; /* owned */
    int id;
    /* What is searched for: content, run through the normalizer when
     * normalized is set (as HF does); owned; may be empty (never matches). */
    char *match;
    size_t match_len;
    bool normalized, single_word, lstrip, rstrip;
} added_token_t;

struct tokenizer {
    tok_table_t vocab; /* model.vocab; keys owned (freed through the slots) */
    int unk_id;        /* -1: none */
    norm_step_t norm[TOKENIZER_MAX_NORM_STEPS];
    int n_norm;
    pre_kind_t pre;
    /* Sorted by first byte, then longest first, so the first match found at a
     * position is the longest; added_first[b]..added_first[b + 1] are the
     * tokens starting with byte b. */
    added_token_t *added;
    int n_added;
    int added_first[257];
    tok_table_t added_index; /* content -> id */
    const char **id_text;    /* [vocab_size]; borrowed from vocab and added */
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
    for (int i = 0; i < t->n_added; i++) {
        free(t->added[i].content);
        free(t->added[i].match);
    }
    free(t->added);
    free(t->added_index.slots);
    free(t->id_text);
    free(t);
}

/* ---- loading ---- */

static char *read_file(const char *path, size_t *len, ar_error_t *err) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        ar_errorf(err, "%s: cannot open: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    while (buf) {
        if (n == cap) {
            if (cap >= TOKENIZER_MAX_FILE_BYTES) {
                ar_errorf(err, "%s: larger than %zu bytes", path, TOKENIZER_MAX_FILE_BYTES);
                free(buf);
                fclose(f);
                return NULL;
            }
            char *grown = realloc(buf, cap * 2);
            if (!grown) {
                free(buf);
                buf = NULL;
                break;
            }
            buf = grown;
            cap *= 2;
        }
        size_t got = fread(buf + n, 1, cap - n, f);
        n += got;
        if (got == 0)
            break;
    }
    if (!buf) {
        ar_errorf(err, "%s: out of memory reading the file", path);
        fclose(f);
        return NULL;
    }
    if (ferror(f)) {
        ar_errorf(err, "%s: read error: %s", path, strerror(errno));
        free(buf);
        fclose(f);
        return NULL;
    }
    fclose(f);
    *len = n;
    return buf;
}

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

static const char *json_type_name(const cJSON *obj) {
    const cJSON *type = cJSON_GetObjectItemCaseSensitive(obj, "type");
    return cJSON_IsString(type) ? type->valuestring : NULL;
}

static int parse_normalizer(tokenizer_t *t, const cJSON *node, const char *where, int depth,
                            const char *path, ar_error_t *err) {
    if (!node || cJSON_IsNull(node))
        return AR_OK;
    if (!cJSON_IsObject(node))
        return ar_errorf(err, "%s: %s is not an object", path, where);
    const char *type = json_type_name(node);
    if (!type)
        return ar_errorf(err, "%s: %s.type is missing or not a string", path, where);
    if (strcmp(type, "Sequence") == 0) {
        const cJSON *list = cJSON_GetObjectItemCaseSensitive(node, "normalizers");
        if (!cJSON_IsArray(list))
            return ar_errorf(err, "%s: %s.normalizers is missing or not an array", path, where);
        if (depth >= TOKENIZER_MAX_NORM_DEPTH)
            return ar_errorf(err, "%s: %s: Sequence normalizers nested too deeply", path, where);
        int i = 0;
        const cJSON *child;
        cJSON_ArrayForEach(child, list) {
            char child_where[128];
            snprintf(child_where, sizeof child_where, "%s.normalizers[%d]", where, i++);
            if (parse_normalizer(t, child, child_where, depth + 1, path, err) != AR_OK)
                return AR_ERR;
        }
        return AR_OK;
    }
    if (strcmp(type, "NFC") == 0)
        return AR_OK; /* identity on what we handle; see tokenizer.h */
    norm_step_t step = {0};
    if (strcmp(type, "Lowercase") == 0) {
        step.kind = NORM_LOWERCASE;
    } else if (strcmp(type, "Strip") == 0) {
        step.kind = NORM_STRIP;
        step.strip_left = step.strip_right = true;
        if (json_opt_bool(node, "strip_left", &step.strip_left, path, where, err) != AR_OK ||
            json_opt_bool(node, "strip_right", &step.strip_right, path, where, err) != AR_OK)
            return AR_ERR;
    } else {
        return ar_errorf(err,
                         "%s: normalizer type '%s' is not supported (supported: Lowercase, "
                         "Strip, NFC, or a Sequence of these)",
                         path, type);
    }
    if (t->n_norm == TOKENIZER_MAX_NORM_STEPS)
        return ar_errorf(err, "%s: more than %d normalizer steps", path, TOKENIZER_MAX_NORM_STEPS);
    t->norm[t->n_norm++] = step;
    return AR_OK;
}

static int parse_pre_tokenizer(tokenizer_t *t, const cJSON *node, const char *path,
                               ar_error_t *err) {
    t->pre = PRE_NONE;
    if (!node || cJSON_IsNull(node))
        return AR_OK;
    if (!cJSON_IsObject(node))
        return ar_errorf(err, "%s: pre_tokenizer is not an object", path);
    const char *type = json_type_name(node);
    if (!type)
        return ar_errorf(err, "%s: pre_tokenizer.type is missing or not a string", path);
    if (strcmp(type, "Whitespace") == 0)
        t->pre = PRE_WHITESPACE;
    else if (strcmp(type, "WhitespaceSplit") == 0)
        t->pre = PRE_WHITESPACE_SPLIT;
    else
        return ar_errorf(err,
                         "%s: pre_tokenizer type '%s' is not supported (supported: Whitespace, "
                         "WhitespaceSplit, null)",
                         path, type);
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

/* Applies the normalizer steps to buf[0..n) in place; the result is
 * buf[*start .. *start + returned length). */
static size_t normalize(const tokenizer_t *t, char *buf, size_t n, size_t *start) {
    size_t off = 0, sp;
    for (int k = 0; k < t->n_norm; k++) {
        const norm_step_t *step = &t->norm[k];
        if (step->kind == NORM_LOWERCASE) {
            lowercase(buf + off, n);
            continue;
        }
        if (step->strip_left)
            while ((sp = space_len(buf + off, n)))
                off += sp, n -= sp;
        if (step->strip_right)
            while ((sp = space_len_before(buf + off, n)))
                n -= sp;
    }
    *start = off;
    return n;
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

/* Reads added_tokens; checks each id is the one HF would assign: the vocab's
 * id if the content is a vocab word, otherwise (vocab word count + number of
 * earlier added tokens that were not vocab words), which is what HF
 * `tokenizers` 0.23 does whatever the file says. */
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
    int index = 0, n_new = 0;
    const cJSON *item;
    cJSON_ArrayForEach(item, list) {
        char where[64];
        snprintf(where, sizeof where, "added_tokens[%d]", index++);
        if (!cJSON_IsObject(item))
            return ar_errorf(err, "%s: %s is not an object", path, where);
        const cJSON *content = cJSON_GetObjectItemCaseSensitive(item, "content");
        if (!cJSON_IsString(content))
            return ar_errorf(err, "%s: %s.content is missing or not a string", path, where);
        int id = json_id(cJSON_GetObjectItemCaseSensitive(item, "id"));
        if (id < 0)
            return ar_errorf(err, "%s: %s.id is missing or not a whole number in [0, %d]", path,
                             where, TOKENIZER_MAX_ID);
        bool special = false;
        if (json_opt_bool(item, "special", &special, path, where, err) != AR_OK)
            return AR_ERR;
        added_token_t tok = {.id = id, .normalized = !special};
        if (json_opt_bool(item, "normalized", &tok.normalized, path, where, err) != AR_OK ||
            json_opt_bool(item, "single_word", &tok.single_word, path, where, err) != AR_OK ||
            json_opt_bool(item, "lstrip", &tok.lstrip, path, where, err) != AR_OK ||
            json_opt_bool(item, "rstrip", &tok.rstrip, path, where, err) != AR_OK)
            return AR_ERR;
        const char *text = content->valuestring;
        size_t len = strlen(text);
        if (len == 0)
            continue; /* HF skips empty added tokens too */
        tok_slot_t *slot = table_slot(&t->added_index, text, len);
        if (slot->text) {
            if (slot->id == id)
                continue; /* a harmless repeat */
            return ar_errorf(err, "%s: added token '%s' appears twice, with ids %d and %d", path,
                             text, slot->id, id);
        }
        int vocab_id = table_get(&t->vocab, text, len);
        if (vocab_id >= 0 && vocab_id != id)
            return ar_errorf(err, "%s: added token '%s' has id %d, but model.vocab gives it id %d",
                             path, text, id, vocab_id);
        if (vocab_id < 0) {
            int expected = (int)t->vocab.count + n_new++;
            if (id != expected)
                return ar_errorf(err,
                                 "%s: added token '%s' has id %d, but HF tokenizers would give "
                                 "it id %d (added tokens outside model.vocab take the ids after "
                                 "it, in order)",
                                 path, text, id, expected);
            if (id < t->vocab_size && t->id_text[id])
                return ar_errorf(err,
                                 "%s: added token '%s' has id %d, which model.vocab gives to '%s'",
                                 path, text, id, t->id_text[id]);
        }
        tok.content = strdup(text);
        tok.match = strdup(text);
        tok.match_len = len;
        t->added[t->n_added++] = tok; /* owned by t from here, even on error */
        if (!tok.content || !tok.match)
            return ar_errorf(err, "%s: out of memory for added_tokens", path);
        if (tok.normalized) {
            size_t start;
            tok.match_len = normalize(t, tok.match, len, &start);
            memmove(tok.match, tok.match + start, tok.match_len);
            t->added[t->n_added - 1].match_len = tok.match_len;
        }
        *slot = (tok_slot_t){tok.content, len, id};
        t->added_index.count++;
    }
    /* Grow id_text to cover the added ids, then point them at the content. */
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

static int parse_root(tokenizer_t *t, const cJSON *root, const char *path, ar_error_t *err) {
    if (!cJSON_IsObject(root))
        return ar_errorf(err, "%s: top level is not a JSON object", path);
    const cJSON *model = cJSON_GetObjectItemCaseSensitive(root, "model");
    if (!cJSON_IsObject(model))
        return ar_errorf(err, "%s: 'model' is missing or not an object", path);
    const char *type = json_type_name(model);
    if (!type)
        return ar_errorf(err, "%s: model.type is missing or not a string (expected 'WordLevel')",
                         path);
    if (strcmp(type, "WordLevel") != 0)
        return ar_errorf(err,
                         "%s: tokenizer model type '%s' is not supported yet (word-level only)",
                         path, type);
    if (parse_vocab(t, cJSON_GetObjectItemCaseSensitive(model, "vocab"), path, err) != AR_OK)
        return AR_ERR;
    const cJSON *unk = cJSON_GetObjectItemCaseSensitive(model, "unk_token");
    t->unk_id = -1;
    if (cJSON_IsString(unk))
        t->unk_id = table_get(&t->vocab, unk->valuestring, strlen(unk->valuestring));
    else if (unk && !cJSON_IsNull(unk))
        return ar_errorf(err, "%s: model.unk_token is not a string", path);
    if (parse_normalizer(t, cJSON_GetObjectItemCaseSensitive(root, "normalizer"), "normalizer", 0,
                         path, err) != AR_OK)
        return AR_ERR;
    if (parse_pre_tokenizer(t, cJSON_GetObjectItemCaseSensitive(root, "pre_tokenizer"), path,
                            err) != AR_OK)
        return AR_ERR;
    return parse_added_tokens(t, cJSON_GetObjectItemCaseSensitive(root, "added_tokens"), path, err);
}

tokenizer_t *tokenizer_load(const char *path, ar_error_t *err) {
    size_t len = 0;
    char *buf = read_file(path, &len, err);
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
    if (!t) {
        ar_errorf(err, "%s: out of memory", path);
    } else if (parse_root(t, root, path, err) != AR_OK) {
        tokenizer_free(t);
        t = NULL;
    }
    cJSON_Delete(root);
    free(buf);
    return t;
}

/* ---- encoding ---- */

typedef struct encode_state {
    const tokenizer_t *t;
    int *ids;
    int max_ids;
    int count;     /* ids needed so far; only the first max_ids are written */
    char *scratch; /* room for the normalised copy of one segment */
    ar_error_t *err;
} encode_state_t;

typedef int (*segment_fn)(encode_state_t *st, const char *s, size_t n);

static void emit(encode_state_t *st, int id) {
    if (st->count < st->max_ids)
        st->ids[st->count] = id;
    st->count++;
}

static int encode_word(encode_state_t *st, const char *s, size_t n) {
    int id = table_get(&st->t->vocab, s, n);
    if (id < 0)
        id = st->t->unk_id;
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

static int pre_tokenize(encode_state_t *st, const char *s, size_t n) {
    if (st->t->pre == PRE_NONE)
        return n ? encode_word(st, s, n) : AR_OK;
    size_t i = 0, len;
    while (i < n) {
        int cls = char_class(s + i, n - i, &len);
        if (cls == CLASS_SPACE) {
            i += len;
            continue;
        }
        size_t start = i;
        for (i += len; i < n; i += len) {
            int next = char_class(s + i, n - i, &len);
            if (st->t->pre == PRE_WHITESPACE ? next != cls : next == CLASS_SPACE)
                break;
        }
        if (encode_word(st, s + start, i - start) != AR_OK)
            return AR_ERR;
    }
    return AR_OK;
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
    if (t->n_norm == 0)
        return split_added(st, s, n, true, pre_tokenize);
    size_t start;
    memcpy(st->scratch, s, n);
    n = normalize(t, st->scratch, n, &start);
    return split_added(st, st->scratch + start, n, true, pre_tokenize);
}

int tokenizer_encode(const tokenizer_t *t, const char *text, int *ids, int max_ids, int *n_ids,
                     ar_error_t *err) {
    *n_ids = 0;
    if (!text)
        return ar_errorf(err, "prompt text is NULL");
    if (max_ids < 0 || (max_ids > 0 && !ids))
        return ar_errorf(err, "tokenizer_encode: bad output buffer (max_ids %d)", max_ids);
    size_t n = strlen(text);
    if (n > (size_t)INT32_MAX / 2)
        return ar_errorf(err, "prompt is %zu bytes, too long", n);
    encode_state_t st = {.t = t, .ids = ids, .max_ids = max_ids, .err = err};
    if (t->n_norm > 0 && !(st.scratch = malloc(n + 1)))
        return ar_errorf(err, "out of memory encoding a %zu-byte prompt", n);
    int rc = split_added(&st, text, n, false, encode_raw_segment);
    free(st.scratch);
    if (rc != AR_OK)
        return AR_ERR;
    if (st.count > max_ids)
        return ar_errorf(err, "prompt is %d tokens, more than the limit %d", st.count, max_ids);
    *n_ids = st.count;
    return AR_OK;
}

int tokenizer_token_id(const tokenizer_t *t, const char *token) {
    size_t n = strlen(token);
    int id = table_get(&t->added_index, token, n);
    return id >= 0 ? id : table_get(&t->vocab, token, n);
}

int tokenizer_vocab_size(const tokenizer_t *t) { return t->vocab_size; }

const char *tokenizer_token_text(const tokenizer_t *t, int id) {
    return id >= 0 && id < t->vocab_size ? t->id_text[id] : NULL;
}
